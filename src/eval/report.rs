//! An eval report as Markdown and as an SVG chart, and writing all three forms atomically.
use std::path::{Path, PathBuf};

use crate::eval::run::EvalReport;
use crate::files::write_atomic;
use crate::Result;

/// Write `PREFIX.json`, `PREFIX.md` and `PREFIX.svg`, each atomically; returns the paths.
pub fn write_reports(r: &EvalReport, prefix: &Path) -> Result<Vec<PathBuf>> {
    let with = |ext: &str| PathBuf::from(format!("{}.{ext}", prefix.display()));
    let json = serde_json::to_string_pretty(r).map_err(|e| crate::Error::bad_file(with("json"), e.to_string()))?;
    let out = vec![with("json"), with("md"), with("svg")];
    write_atomic(&out[0], json.as_bytes())?;
    write_atomic(&out[1], to_markdown(r).as_bytes())?;
    write_atomic(&out[2], to_svg(r).as_bytes())?;
    Ok(out)
}

/// Markdown report.
pub fn to_markdown(r: &EvalReport) -> String {
    let mut m = String::new();
    m.push_str(&format!(
        "# selfspec eval\n\nmodel `{}` (weights {}, {}), {} `{}`, temperature {}, max {} new tokens, {} turns.\n\n",
        r.model,
        r.weights,
        r.device,
        r.drafter,
        r.drafter_dir,
        r.temperature,
        r.max_tokens,
        r.turns.len()
    ));
    m.push_str("τ = tokens emitted per target forward, the bonus token counted (plain decoding = 1.0). Speed-up = median self-speculative tok/s / median plain tok/s, measured alternately in this run; overall = all turns' tokens / all their decoding time, each way (as Spec-Bench reports).\n\n");
    if r.datastore_tokens > 0 {
        m.push_str(&format!("Copied = accepted tokens per forward from the copied branch (`+lookup`: from the context, or from a datastore of {} tokens of the target's earlier text where that matched a longer suffix), part of τ.\n\n", r.datastore_tokens));
    } else {
        m.push_str("Copied = accepted tokens per forward from the context-lookup branch (`+lookup`), part of τ.\n\n");
    }
    m.push_str("| tree | mean nodes | τ | copied | spec tok/s | plain tok/s | speed-up | overall speed-up | identical to plain |\n|---|---|---|---|---|---|---|---|---|\n");
    for (name, s) in r.trees.iter().zip(&r.overall) {
        m.push_str(&format!(
            "| {} | {:.1} | {:.2} | {:.2} | {:.1} | {:.1} | {:.2}x | {:.2}x | {} |\n",
            name,
            s.mean_tree_nodes,
            s.tau,
            s.copied_per_forward,
            s.spec_tok_s_median,
            s.plain_tok_s_median,
            s.speedup,
            s.speedup_total,
            s.all_identical.map_or("n/a (sampling)".to_string(), |b| if b { "yes".into() } else { "NO".into() })
        ));
    }
    m.push_str("\n## Where a step's time went (ms per target forward)\n\n| tree | draft | tree forward | verify | commit | outside the forward |\n|---|---|---|---|---|---|\n");
    for (name, s) in r.trees.iter().zip(&r.overall) {
        let t = &s.step_ms;
        m.push_str(&format!("| {name} | {:.2} | {:.2} | {:.2} | {:.2} | {:.1}% |\n", t.draft, t.forward, t.verify, t.commit, 100.0 * t.outside_forward()));
    }
    m.push_str("\n## Per category (first tree)\n\n| category | turns | τ | speed-up |\n|---|---|---|---|\n");
    for (c, v) in &r.per_category {
        m.push_str(&format!("| {} | {} | {:.2} | {:.2}x |\n", c, v[0].turns, v[0].tau, v[0].speedup));
    }
    if let Some(s) = r.overall.first() {
        m.push_str("\n## Drafting (first tree): accuracy of the guesses made from the root against the target's own tokens\n\nLevel k guesses the token k places past the root (heads: head k-1; a draft layer reports level 1, the only one it guesses from the root alone).\n\n| level | top-1 | top-5 |\n|---|---|---|\n");
        for (k, (a, b)) in s.head_top1.iter().zip(&s.head_top5).enumerate() {
            m.push_str(&format!("| {} | {a:.3} | {b:.3} |\n", k + 1));
        }
        m.push_str("\n## Drafted tokens accepted per step (first tree)\n\n| accepted | steps |\n|---|---|\n");
        for (i, c) in s.accept_hist.iter().enumerate() {
            m.push_str(&format!("| {i} | {c} |\n"));
        }
        if !s.node_accept_rate.is_empty() {
            m.push_str("\n## Acceptance rate per tree node (first tree, given its parent was accepted)\n\n");
            let rates: Vec<String> = s.node_accept_rate.iter().skip(1).map(|x| format!("{x:.2}")).collect();
            m.push_str(&rates.join(", "));
            m.push('\n');
        }
    }
    m.push_str(&format!("\n## Sample (accepted draft tokens in [brackets])\n\n{}\n", r.sample_marked));
    m
}

/// An SVG with two bar charts: accepted-length histogram and per-head top-1/top-5 accuracy.
pub fn to_svg(r: &EvalReport) -> String {
    let s = match r.overall.first() {
        Some(s) => s,
        None => return String::from("<svg xmlns='http://www.w3.org/2000/svg'/>"),
    };
    let (w, h) = (760.0, 300.0);
    let mut svg = format!("<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' font-family='sans-serif' font-size='12'>\n<rect width='100%' height='100%' fill='white'/>\n");
    let chart = |svg: &mut String, x0: f64, title: &str, bars: &[(String, f64, &str)], max: f64| {
        let (cw, ch, base) = (330.0, 200.0, 250.0);
        svg.push_str(&format!("<text x='{}' y='25' font-size='14'>{}</text>\n", x0, title));
        svg.push_str(&format!("<line x1='{x0}' y1='{base}' x2='{}' y2='{base}' stroke='black'/>\n", x0 + cw));
        let bw = cw / bars.len().max(1) as f64;
        for (i, (label, v, color)) in bars.iter().enumerate() {
            let bh = if max > 0.0 { v / max * ch } else { 0.0 };
            let x = x0 + i as f64 * bw;
            svg.push_str(&format!("<rect x='{:.1}' y='{:.1}' width='{:.1}' height='{:.1}' fill='{}'/>\n", x + 2.0, base - bh, bw - 4.0, bh, color));
            svg.push_str(&format!("<text x='{:.1}' y='{}' text-anchor='middle'>{}</text>\n", x + bw / 2.0, base + 15.0, label));
            svg.push_str(&format!("<text x='{:.1}' y='{:.1}' text-anchor='middle' font-size='10'>{}</text>\n", x + bw / 2.0, base - bh - 3.0, if *v >= 1.0 { format!("{v:.0}") } else { format!("{v:.2}") }));
        }
    };
    let hist: Vec<(String, f64, &str)> = s.accept_hist.iter().enumerate().map(|(i, c)| (format!("{i}"), *c as f64, "#4477aa")).collect();
    let hmax = hist.iter().map(|b| b.1).fold(0.0, f64::max);
    chart(&mut svg, 20.0, &format!("drafted tokens accepted per step (τ = {:.2}, bonus counted)", s.tau), &hist, hmax);
    let mut acc: Vec<(String, f64, &str)> = Vec::new();
    for (k, (a, b)) in s.head_top1.iter().zip(&s.head_top5).enumerate() {
        acc.push((format!("L{} top1", k + 1), *a, "#228833"));
        acc.push(("top5".to_string(), *b, "#88cc88"));
    }
    chart(&mut svg, 400.0, "drafting accuracy per level vs the target's tokens", &acc, 1.0);
    svg.push_str("</svg>\n");
    svg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_are_written_in_three_forms() {
        let r = EvalReport::default();
        let dir = std::env::temp_dir().join(format!("selfspec-report-{}", std::process::id()));
        let paths = write_reports(&r, &dir.join("r")).unwrap();
        for p in &paths {
            assert!(p.is_file(), "{}", p.display());
        }
        assert!(std::fs::read_to_string(&paths[2]).unwrap().starts_with("<svg"));
        std::fs::remove_dir_all(&dir).ok();
    }
}
