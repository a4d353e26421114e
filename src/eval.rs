//! Evaluation: acceptance length, acceptance by tree position, per-head accuracy and wall-clock
//! speed-up against plain decoding measured in the same run; and `tune`, which picks the tree
//! that maximises expected speed-up on this device from measured head accuracies and forward costs.
use std::collections::BTreeMap;

use serde::Serialize;

use crate::data::PromptItem;
use crate::generate::{generate_plain, StopRule};
use crate::drafter::Drafter;
use crate::loader::Target;
use crate::sampling::{rng, SamplingParams};
use crate::budget::{Budget, AFFORDABLE_COST};
use crate::spec::{generate_spec, Plan, SpecOptions, SpecStats, StepTimes, TreeChoice};
use crate::tokenizer::Message;
use crate::tree::Tree;
use crate::verify::Rule;
use crate::Result;

/// One (prompt, turn) measured both ways.
#[derive(Debug, Clone, Serialize)]
pub struct TurnResult {
    pub prompt_id: String,
    pub category: String,
    pub turn: usize,
    pub new_tokens: usize,
    pub plain_tok_s: f64,
    /// Per tree (same order as the report's trees).
    pub spec: Vec<SpecStats>,
    pub identical: Vec<Option<bool>>,
}

/// Aggregates for one tree over a set of turns.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Summary {
    pub turns: usize,
    pub new_tokens: usize,
    pub target_forwards: usize,
    /// Tokens emitted per target forward, the bonus token counted (plain decoding = 1.0).
    pub tau: f64,
    pub spec_tok_s_median: f64,
    pub plain_tok_s_median: f64,
    /// Median over turns: the headline figure, which one unusually easy or hard turn cannot move.
    pub speedup: f64,
    /// All turns' tokens over all their decoding time, each way, and the ratio: the throughput a
    /// user running every prompt would see, as Spec-Bench reports it (long, easy turns weigh more).
    pub spec_tok_s_total: f64,
    pub plain_tok_s_total: f64,
    pub speedup_total: f64,
    pub accept_hist: Vec<usize>,
    /// Per static-tree node: accepted / tried.
    pub node_accept_rate: Vec<f64>,
    pub head_top1: Vec<f64>,
    pub head_top5: Vec<f64>,
    pub mean_tree_nodes: f64,
    /// Tokens per target forward that came from the context lookup's branch (included in τ).
    pub copied_per_forward: f64,
    /// Greedy only: every output identical to plain decoding.
    pub all_identical: Option<bool>,
    /// Where a step's time went, ms per target forward: drafting, the tree forward,
    /// verification, commit (KV compaction and the drafter's own update).
    pub step_ms: StepTimes,
}

#[derive(Debug, Clone, Serialize)]
pub struct EvalReport {
    pub model: String,
    /// The CPU weight format (`--weights`); speeds are only comparable within one format.
    pub weights: String,
    /// Where the forward ran: the device, and on the CPU its kernels' instruction-set paths
    /// (speeds are only comparable on one).
    pub device: String,
    pub heads: String,
    /// "heads" or "draft layer".
    pub drafter: String,
    pub trees: Vec<String>,
    /// Tokens in the datastore the `+lookup` branches also copied from (0: none given).
    pub datastore_tokens: usize,
    pub temperature: f32,
    pub max_tokens: usize,
    pub overall: Vec<Summary>,
    pub per_category: BTreeMap<String, Vec<Summary>>,
    pub turns: Vec<TurnResult>,
    /// One generation with the first tree, accepted draft tokens marked.
    pub sample: String,
    pub sample_marked: String,
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { 0.5 * (v[n / 2 - 1] + v[n / 2]) }
}

pub fn summarise(turns: &[&TurnResult], tree: usize) -> Summary {
    let mut s = Summary { turns: turns.len(), ..Default::default() };
    let mut head: Vec<(usize, usize, usize)> = Vec::new();
    let mut nodes: Vec<(usize, usize)> = Vec::new();
    let mut nodes_total = 0;
    let mut copied = 0;
    let mut identical = None;
    for t in turns {
        let st = &t.spec[tree];
        s.new_tokens += st.gen.new_tokens.saturating_sub(1);
        s.target_forwards += st.gen.target_forwards;
        s.step_ms.draft += st.time.draft;
        s.step_ms.forward += st.time.forward;
        s.step_ms.verify += st.time.verify;
        s.step_ms.commit += st.time.commit;
        nodes_total += st.tree_nodes_total;
        copied += st.lookup_accepted;
        if s.accept_hist.len() < st.accept_hist.len() {
            s.accept_hist.resize(st.accept_hist.len(), 0);
        }
        for (i, c) in st.accept_hist.iter().enumerate() {
            s.accept_hist[i] += c;
        }
        if head.len() < st.head_acc.len() {
            head.resize(st.head_acc.len(), (0, 0, 0));
        }
        for (i, a) in st.head_acc.iter().enumerate() {
            head[i].0 += a.0;
            head[i].1 += a.1;
            head[i].2 += a.2;
        }
        if nodes.len() < st.node_tries_hits.len() {
            nodes.resize(st.node_tries_hits.len(), (0, 0));
        }
        for (i, a) in st.node_tries_hits.iter().enumerate() {
            nodes[i].0 += a.0;
            nodes[i].1 += a.1;
        }
        if let Some(same) = t.identical[tree] {
            identical = Some(identical.unwrap_or(true) && same);
        }
    }
    s.tau = s.new_tokens as f64 / s.target_forwards.max(1) as f64;
    let per_step = 1e3 / s.target_forwards.max(1) as f64;
    for t in [&mut s.step_ms.draft, &mut s.step_ms.forward, &mut s.step_ms.verify, &mut s.step_ms.commit] {
        *t *= per_step;
    }
    s.spec_tok_s_median = median(turns.iter().map(|t| t.spec[tree].gen.decode_tok_s()).collect());
    s.plain_tok_s_median = median(turns.iter().map(|t| t.plain_tok_s).collect());
    s.speedup = s.spec_tok_s_median / s.plain_tok_s_median.max(1e-9);
    let spec_secs: f64 = turns.iter().map(|t| t.spec[tree].gen.decode_secs).sum();
    let plain_secs: f64 = turns.iter().map(|t| t.new_tokens as f64 / t.plain_tok_s.max(1e-9)).sum();
    let spec_tokens: usize = turns.iter().map(|t| t.spec[tree].gen.new_tokens).sum();
    let plain_tokens: usize = turns.iter().map(|t| t.new_tokens).sum();
    s.spec_tok_s_total = spec_tokens as f64 / spec_secs.max(1e-9);
    s.plain_tok_s_total = plain_tokens as f64 / plain_secs.max(1e-9);
    s.speedup_total = s.spec_tok_s_total / s.plain_tok_s_total.max(1e-9);
    s.node_accept_rate = nodes.iter().map(|(t, h)| *h as f64 / (*t).max(1) as f64).collect();
    s.head_top1 = head.iter().map(|a| a.1 as f64 / a.0.max(1) as f64).collect();
    s.head_top5 = head.iter().map(|a| a.2 as f64 / a.0.max(1) as f64).collect();
    s.mean_tree_nodes = nodes_total as f64 / s.target_forwards.max(1) as f64;
    s.copied_per_forward = copied as f64 / s.target_forwards.max(1) as f64;
    s.all_identical = identical;
    s
}

pub struct EvalOptions<'a> {
    pub trees: Vec<(String, Plan)>,
    pub params: SamplingParams,
    pub max_tokens: usize,
    pub seed: u64,
    /// A second source for `+lookup` branches (see [`crate::datastore`]).
    pub datastore: Option<&'a crate::datastore::Datastore>,
    pub progress: &'a mut dyn FnMut(usize, usize),
}

/// Run every prompt (each turn following the model's own previous answer) with plain decoding
/// and with each tree, alternating, after one warm-up generation.
pub fn evaluate(target: &Target, drafter: &Drafter, prompts: &[PromptItem], opts: &mut EvalOptions) -> Result<EvalReport> {
    let eos = target.tokenizer.eos_ids.clone();
    let rule = Rule::for_params(&opts.params, false);
    let greedy = opts.params.is_greedy();
    // Warm-up: page in weights, spin up threads.
    if let Some(first) = prompts.first() {
        let ids = target.encode_prompt(&first.turns[0], true)?;
        let stop = StopRule { max_new_tokens: 8, eos_ids: &eos };
        generate_plain(&target.model, &ids, &opts.params, &stop, &mut rng(0), &mut |_| Ok(()))?;
    }
    // `auto` trees: time this device's forward once for all prompts.
    let plans: Vec<Plan> = opts
        .trees
        .iter()
        .map(|(name, p)| {
            let tree = p.tree.clone().with_costs(&target.model, p.lookup.map_or(0, |l| l.max_tokens))?;
            if let (TreeChoice::Auto(b), TreeChoice::Auto(Budget { fit_to_device: true, .. })) = (&tree, &p.tree) {
                eprintln!("{name}: grows up to {} nodes here at start (forward cost within {AFFORDABLE_COST}x one token's; refitted per step to the forward times the run observes)", b.max_nodes);
            }
            Ok(Plan { tree, lookup: p.lookup })
        })
        .collect::<Result<_>>()?;
    let mut turns = Vec::new();
    let total: usize = prompts.iter().map(|p| p.turns.len()).sum();
    let mut sample = (String::new(), String::new());
    for (pi, item) in prompts.iter().enumerate() {
        let mut messages: Vec<Message> = Vec::new();
        for (ti, turn) in item.turns.iter().enumerate() {
            messages.push(Message { role: "user".into(), content: turn.clone() });
            let text = target.chat_prompt(&messages)?;
            let ids = target.tokenizer.encode(&text, false)?;
            let seed = opts.seed.wrapping_add((pi * 16 + ti) as u64);
            let stop = StopRule { max_new_tokens: opts.max_tokens, eos_ids: &eos };
            let (plain_out, plain) = generate_plain(&target.model, &ids, &opts.params, &stop, &mut rng(seed), &mut |_| Ok(()))?;
            let mut specs = Vec::new();
            let mut identical = Vec::new();
            for (j, plan) in plans.iter().enumerate() {
                let so = SpecOptions { tree: plan.tree.clone(), lookup: plan.lookup, datastore: opts.datastore, rule, params: opts.params.clone(), stop: StopRule { max_new_tokens: opts.max_tokens, eos_ids: &eos } };
                let (out, st) = generate_spec(&target.model, drafter, &ids, &so, &mut rng(seed), &mut |_| Ok(()))?;
                identical.push(if greedy { Some(out == plain_out) } else { None });
                if pi == 0 && ti == 0 && j == 0 {
                    sample = (target.tokenizer.decode(&out)?, mark_drafted(target, &out, &st.drafted)?);
                }
                specs.push(st);
            }
            // Answer history for the next turn: the target's own reply.
            let mut reply = plain_out.clone();
            if reply.last().is_some_and(|t| target.tokenizer.is_eos(*t)) {
                reply.pop();
            }
            messages.push(Message { role: "assistant".into(), content: target.tokenizer.decode(&reply)? });
            turns.push(TurnResult {
                prompt_id: item.id.clone(),
                category: item.category.clone(),
                turn: ti,
                new_tokens: plain.new_tokens,
                plain_tok_s: plain.decode_tok_s(),
                spec: specs,
                identical,
            });
            (opts.progress)(turns.len(), total);
        }
    }
    let all: Vec<&TurnResult> = turns.iter().collect();
    let overall = (0..opts.trees.len()).map(|j| summarise(&all, j)).collect();
    let mut per_category = BTreeMap::new();
    let cats: std::collections::BTreeSet<String> = turns.iter().map(|t| t.category.clone()).collect();
    for c in cats {
        let ts: Vec<&TurnResult> = turns.iter().filter(|t| t.category == c).collect();
        per_category.insert(c, (0..opts.trees.len()).map(|j| summarise(&ts, j)).collect());
    }
    Ok(EvalReport {
        model: target.path.display().to_string(),
        weights: target.model.weight_format().to_string(),
        device: if target.model.device().is_cpu() { format!("cpu ({} kernels)", crate::kernels::cpu_kernels()) } else { format!("{:?}", target.model.device().location()) },
        heads: String::new(),
        drafter: drafter.kind().to_string(),
        trees: opts.trees.iter().map(|t| t.0.clone()).collect(),
        datastore_tokens: opts.datastore.map_or(0, |d| d.len()),
        temperature: opts.params.temperature,
        max_tokens: opts.max_tokens,
        overall,
        per_category,
        turns,
        sample: sample.0,
        sample_marked: sample.1,
    })
}

/// Text with each run of accepted draft tokens wrapped in `[brackets]`.
pub fn mark_drafted(target: &Target, out: &[u32], drafted: &[bool]) -> Result<String> {
    let mut s = String::new();
    let mut i = 0;
    while i < out.len() {
        let d = drafted.get(i).copied().unwrap_or(false);
        let mut j = i;
        while j < out.len() && drafted.get(j).copied().unwrap_or(false) == d {
            j += 1;
        }
        let piece = target.tokenizer.decode(&out[i..j])?;
        if d {
            s.push('[');
            s.push_str(&piece);
            s.push(']');
        } else {
            s.push_str(&piece);
        }
        i = j;
    }
    Ok(s)
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
        r.heads,
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
    m.push_str("\n## Where a step's time went (ms per target forward)\n\n| tree | draft | tree forward | verify | commit |\n|---|---|---|---|---|\n");
    for (name, s) in r.trees.iter().zip(&r.overall) {
        let t = &s.step_ms;
        m.push_str(&format!("| {name} | {:.2} | {:.2} | {:.2} | {:.2} |\n", t.draft, t.forward, t.verify, t.commit));
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

/// `acc[k][r]`: how often the rank-r guess at level k+1 below the root equals the target's own
/// greedy token there (for a draft layer: given the true tokens above it), measured on the
/// target's greedy continuations of `prompts`.
pub fn rank_accuracy(target: &Target, drafter: &Drafter, prompts: &[PromptItem], max_tokens: usize, ranks: usize) -> Result<Vec<Vec<f64>>> {
    let mut hits: Vec<Vec<usize>> = Vec::new();
    let mut counts: Vec<usize> = Vec::new();
    let eos = target.tokenizer.eos_ids.clone();
    for item in prompts {
        let ids = target.encode_prompt(&item.turns[0], true)?;
        let stop = StopRule { max_new_tokens: max_tokens, eos_ids: &eos };
        let (out, _) = generate_plain(&target.model, &ids, &SamplingParams::greedy(), &stop, &mut rng(0), &mut |_| Ok(()))?;
        let mut seq = ids.clone();
        seq.extend(&out);
        let mut cache = target.model.new_cache()?;
        let hidden = target.model.forward_causal(&seq, &mut cache)?;
        let (h, c) = drafter.rank_hits(&target.model, &hidden, &seq, ids.len() - 1, ranks)?;
        if hits.is_empty() {
            (hits, counts) = (h, c);
        } else {
            for (k, row) in h.iter().enumerate() {
                counts[k] += c[k];
                for (r, x) in row.iter().enumerate() {
                    hits[k][r] += x;
                }
            }
        }
    }
    Ok(hits.iter().zip(&counts).map(|(h, &c)| h.iter().map(|&x| x as f64 / c.max(1) as f64).collect()).collect())
}

/// Medusa's best-first growth: repeatedly add the frontier node with the highest product of
/// rank accuracies along its path. Returns the paths in order of addition and the expected τ
/// after each addition (τ = 1 + sum of path values).
pub fn grow_tree(acc: &[Vec<f64>], max_nodes: usize) -> (Vec<Vec<usize>>, Vec<f64>) {
    let value = |p: &[usize]| p.iter().enumerate().map(|(d, &r)| acc[d].get(r).copied().unwrap_or(0.0)).product::<f64>();
    let mut chosen: Vec<Vec<usize>> = Vec::new();
    let mut taus = Vec::new();
    let mut frontier: Vec<Vec<usize>> = vec![vec![0]];
    let mut tau = 1.0;
    while chosen.len() + 1 < max_nodes && !frontier.is_empty() {
        let (bi, _) = frontier.iter().enumerate().map(|(i, p)| (i, value(p))).max_by(|a, b| a.1.total_cmp(&b.1)).unwrap();
        let p = frontier.swap_remove(bi);
        tau += value(&p);
        let mut sib = p.clone();
        *sib.last_mut().unwrap() += 1;
        if *sib.last().unwrap() < acc[p.len() - 1].len() {
            frontier.push(sib);
        }
        if p.len() < acc.len() {
            let mut child = p.clone();
            child.push(0);
            frontier.push(child);
        }
        chosen.push(p);
        taus.push(tau);
    }
    (chosen, taus)
}

#[derive(Debug, Clone, Serialize)]
pub struct TunePoint {
    pub nodes: usize,
    pub expected_tau: f64,
    pub cost_ratio: f64,
    pub expected_speedup: f64,
}

/// Pick the tree size maximising expected τ / relative cost: a forward of `nodes` tokens plus
/// drafting (`draft_ms.0` per step and `draft_ms.1` per level below the first), over a
/// one-token forward.
pub fn choose_tree(acc: &[Vec<f64>], cost_ms: &[f64], draft_ms: (f64, f64), max_nodes: usize) -> (Tree, Vec<TunePoint>) {
    let (paths, taus) = grow_tree(acc, max_nodes);
    let mut points = vec![TunePoint { nodes: 1, expected_tau: 1.0, cost_ratio: 1.0, expected_speedup: 1.0 }];
    for (i, tau) in taus.iter().enumerate() {
        let n = i + 2;
        let depth = paths[..=i].iter().map(|p| p.len()).max().unwrap_or(1);
        let c = cost_ms.get(n - 1).copied().unwrap_or(*cost_ms.last().unwrap());
        let ratio = (c + draft_ms.0 + draft_ms.1 * (depth - 1) as f64) / cost_ms[0];
        points.push(TunePoint { nodes: n, expected_tau: *tau, cost_ratio: ratio, expected_speedup: tau / ratio });
    }
    let best = points.iter().skip(1).max_by(|a, b| a.expected_speedup.total_cmp(&b.expected_speedup)).map(|p| p.nodes).unwrap_or(2);
    let tree = Tree::from_paths(&paths[..best - 1]).expect("grown trees are prefix-closed");
    (tree, points)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The median speed-up and the overall one (all tokens over all time) differ when turns do.
    #[test]
    fn summary_medians_and_totals() {
        let turn = |tokens: usize, spec_secs: f64, plain_tok_s: f64| {
            let mut st = SpecStats::default();
            st.gen.new_tokens = tokens;
            st.gen.target_forwards = tokens / 2;
            st.gen.decode_secs = spec_secs;
            TurnResult { prompt_id: "p".into(), category: "c".into(), turn: 0, new_tokens: tokens, plain_tok_s, spec: vec![st], identical: vec![Some(true)] }
        };
        let (a, b) = (turn(100, 0.5, 100.0), turn(10, 0.2, 50.0));
        let s = summarise(&[&a, &b], 0);
        assert!((s.spec_tok_s_median - 125.0).abs() < 1e-9 && (s.plain_tok_s_median - 75.0).abs() < 1e-9);
        assert!((s.speedup - 125.0 / 75.0).abs() < 1e-9);
        assert!((s.spec_tok_s_total - 110.0 / 0.7).abs() < 1e-9);
        assert!((s.plain_tok_s_total - 110.0 / 1.2).abs() < 1e-9);
        assert!((s.speedup_total - (110.0 / 0.7) / (110.0 / 1.2)).abs() < 1e-9);
        assert_eq!(s.all_identical, Some(true));
    }

    #[test]
    fn best_first_growth_and_choice() {
        let acc = vec![vec![0.6, 0.2, 0.1], vec![0.5, 0.2], vec![0.4]];
        let (paths, taus) = grow_tree(&acc, 6);
        assert_eq!(paths[0], vec![0]);
        assert_eq!(paths[1], vec![0, 0]);
        assert!((taus[0] - 1.6).abs() < 1e-12 && (taus[1] - 1.9).abs() < 1e-12);
        assert!(Tree::from_paths(&paths).is_ok());
        // Flat cost: the biggest tree wins; steep cost: a small one.
        let (big, _) = choose_tree(&acc, &[10.0; 8], (0.0, 0.0), 6);
        assert_eq!(big.len(), 6);
        let steep: Vec<f64> = (1..=8).map(|n| 10.0 * n as f64).collect();
        let (small, pts) = choose_tree(&acc, &steep, (0.0, 0.0), 6);
        assert!(small.len() <= 3, "{pts:?}");
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
    }
}
