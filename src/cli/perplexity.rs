//! `selfspec perplexity`: the target's perplexity over a text file, as llama.cpp's
//! `llama-perplexity` computes it (same chunks, same scored half, same ±).
use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use selfspec::cpu::quant::WeightFormat;
use selfspec::eval::perplexity::{chunks, perplexity, perplexity_against, MIN_CTX};

use crate::cli::args::{progress, ModelArgs};

/// The largest text read (a whole Wikipedia test set, wikitext-2's, is 1.3 MB).
const MAX_TEXT_BYTES: u64 = 64 << 20;

#[derive(Args)]
pub struct PerplexityArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The text to score (UTF-8), e.g. wikitext-2's test set, as llama-perplexity's -f.
    #[arg(long, short = 'f')]
    file: PathBuf,
    /// Tokens per chunk (llama-perplexity's -c); each chunk's second half is scored.
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// Score only the first N chunks (llama-perplexity's --chunks). Default: all.
    #[arg(long)]
    chunks: Option<usize>,
    /// Also run the model in this weight format (usually f32) on the same chunks and report how
    /// far --weights' distributions are from it: mean KL divergence and how often both pick the
    /// same likeliest token (llama-perplexity's --kl-divergence figures, in one run)
    #[arg(long, value_name = "FORMAT")]
    compare: Option<WeightFormat>,
    /// Print the result as JSON (with the running PPL after each chunk).
    #[arg(long)]
    json: bool,
}

pub fn run(a: PerplexityArgs) -> Result<()> {
    if a.ctx < MIN_CTX {
        anyhow::bail!("--ctx {}: at least {MIN_CTX} tokens", a.ctx);
    }
    if a.chunks == Some(0) {
        anyhow::bail!("--chunks 0 scores nothing");
    }
    let text = selfspec::files::read_text(&a.file, MAX_TEXT_BYTES, "a text to score")?;
    let target = a.model.load()?;
    let reference = a.compare.map(|w| a.model.load_as(w)).transpose()?;
    let tokens = target.tokenizer.encode(&text, true)?;
    let n = chunks(tokens.len(), a.ctx, a.chunks).map_err(|e| anyhow::anyhow!("{}: {e}", a.file.display()))?;
    eprintln!("{}: {} tokens, {n} chunks of {} (the second half of each scored), weights {}", a.file.display(), tokens.len(), a.ctx, target.model.weight_format());
    let bar = progress(n as u64, "perplexity");
    let mut tick = |_, ppl: f64| {
        bar.set_message(format!("PPL {ppl:.4}"));
        bar.inc(1);
    };
    let (p, d) = match &reference {
        Some(r) => perplexity_against(&target, r, &tokens, a.ctx, a.chunks, &mut tick).map(|(p, d)| (p, Some(d)))?,
        None => (perplexity(&target, &tokens, a.ctx, a.chunks, &mut tick)?, None),
    };
    bar.finish_and_clear();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&serde_json::json!({"perplexity": p, "against": d}))?);
    } else {
        println!("{}", p.running.iter().enumerate().map(|(i, x)| format!("[{}]{x:.4}", i + 1)).collect::<Vec<_>>().join(","));
        println!("Final estimate: PPL = {:.4} +/- {:.5} ({} tokens scored in {} chunks of {}; {:.1} s, {:.0} tokens/s)", p.ppl, p.ppl_error, p.scored, p.chunks, p.ctx, p.secs, (p.chunks * p.ctx) as f64 / p.secs);
        if let (Some(d), Some(w)) = (d, a.compare) {
            println!(
                "Against {w}: PPL({w}) = {:.4} +/- {:.5}, mean KLD = {:.6} +/- {:.6} (max {:.4}), same top token {:.2}% of {} positions",
                d.reference.ppl,
                d.reference.ppl_error,
                d.mean_kld,
                d.kld_error,
                d.max_kld,
                100.0 * d.same_top,
                p.scored
            );
        }
    }
    Ok(())
}
