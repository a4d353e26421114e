//! `selfspec distill`: the target answers a prompts file, one JSONL record per answer; or, with
//! `--self-prompts N`, writes N user prompts itself, a prompts file for a later `distill`.
use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use selfspec::train::distill::{distill_file, write_prompts_file};

use crate::cli::args::{progress, ModelArgs, SamplingArgs};

#[derive(Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["prompts", "self_prompts"])))]
pub struct DistillArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// One prompt per line, or JSONL with "prompt" or "turns".
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// Instead of answering --prompts, the target writes this many user prompts itself:
    /// sampled (with the sampling flags; e.g. --temperature 1) after its chat template's
    /// opening of a user turn, until it ends the turn (Magpie's method). --out gets a prompts
    /// file in prompt order ("finished": false marks a prompt cut at --max-tokens, empty, or
    /// gone off the template; --prompts skips those) for a later distill to answer.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    self_prompts: Option<u32>,
    /// JSONL answers (or prompts), appended as each is done (a killed run resumes).
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Conversations decoded side by side, one token each per forward: each weight is read
    /// once per step for all of them. Answers are the same at any batch size.
    #[arg(long, default_value_t = 8)]
    batch: usize,
}

pub fn run(a: DistillArgs) -> Result<()> {
    let params = a.sampling.params()?;
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    if a.batch == 0 {
        bail!("--batch must be at least 1");
    }
    if let Some(n) = a.self_prompts {
        if params.is_greedy() && n > 1 {
            bail!("{}", selfspec::train::distill::GREEDY_PROMPTS);
        }
        return self_prompts(&a, n as usize, &params);
    }
    let items = selfspec::data::read_prompts(a.prompts.as_ref().expect("clap requires --prompts or --self-prompts"))?;
    selfspec::files::check_writable(&a.out)?;
    // An existing --out must be this command's own output (resumed), checked before the load.
    selfspec::train::distill::done_ids(&a.out)?;
    let target = a.model.load()?;
    if let Some(n) = target.plain_prompts_note() {
        eprintln!("{n}");
    }
    let bar = progress(items.len() as u64, "distill");
    let t0 = std::time::Instant::now();
    let mut tokens = 0usize;
    let s = distill_file(&target, &items, &a.out, &params, a.max_tokens, a.sampling.seed, a.batch, &mut |rec| {
        tokens += rec.new_tokens;
        bar.set_message(format!("{:.1} tok/s", tokens as f64 / t0.elapsed().as_secs_f64()));
        bar.inc(1);
    })?;
    bar.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    eprintln!("distill: {} answered now, {} already done, {} tokens in {secs:.0}s ({:.1} tok/s) -> {}", s.answered, s.already_done, s.tokens, s.tokens as f64 / secs.max(1e-9), a.out.display());
    Ok(())
}

fn self_prompts(a: &DistillArgs, n: usize, params: &selfspec::decode::sampling::SamplingParams) -> Result<()> {
    selfspec::files::check_writable(&a.out)?;
    selfspec::train::distill::self_prompt_ids(&a.out)?;
    let target = a.model.load()?;
    let bar = progress(n as u64, "prompts");
    let t0 = std::time::Instant::now();
    let mut finished = 0usize;
    let s = write_prompts_file(&target, n, &a.out, params, a.max_tokens, a.sampling.seed, a.batch, &mut |p| {
        finished += p.finished as usize;
        bar.inc(1);
    })?;
    bar.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    eprintln!(
        "distill --self-prompts: {} written now ({finished} finished; the others cut at --max-tokens, empty or off the template), {} already done, {} tokens in {secs:.0}s ({:.1} tok/s) -> {} (in prompt order)",
        s.answered,
        s.already_done,
        s.tokens,
        s.tokens as f64 / secs.max(1e-9),
        a.out.display()
    );
    Ok(())
}
