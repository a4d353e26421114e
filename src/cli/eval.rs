//! `selfspec eval`: τ, acceptance and speed-up against plain decoding, in one run.
use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use selfspec::eval::report::write_reports;
use selfspec::eval::{evaluate, EvalOptions, EvalReport};
use selfspec::spec::plan::{Plan, DEFAULT_TREE};

use crate::cli::args::{progress, DrafterArgs, ModelArgs, SamplingArgs};

#[derive(Args)]
pub struct EvalArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    drafter: DrafterArgs,
    /// One prompt per line, JSONL with "prompt", or MT-Bench/Spec-Bench style "turns".
    #[arg(long)]
    prompts: PathBuf,
    /// Trees to compare (repeatable): cpu, gpu, chain[:N], dynamic[:N], auto[:N], or a tree
    /// file, each optionally with +lookup[:N] (a branch copied from the context).
    #[arg(long, default_values_t = vec![DEFAULT_TREE.to_string()], help_heading = "Drafter")]
    tree: Vec<String>,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Only the first N prompts.
    #[arg(long)]
    limit: Option<usize>,
    /// Write PREFIX.json, PREFIX.md and PREFIX.svg.
    #[arg(long)]
    out: Option<PathBuf>,
}

pub fn run(a: EvalArgs) -> Result<()> {
    let params = a.sampling.params()?;
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    if a.limit == Some(0) {
        bail!("--limit must be at least 1 (it keeps the first N prompts)");
    }
    let dir = a.drafter.dir("eval")?.to_path_buf();
    if let Some(prefix) = &a.out {
        selfspec::files::check_writable(&PathBuf::from(format!("{}.json", prefix.display())))?;
    }
    let trees = a.tree.iter().map(|t| Ok((t.clone(), Plan::parse(t)?))).collect::<Result<Vec<_>>>()?;
    let mut items = selfspec::data::read_prompts(&a.prompts)?;
    if let Some(n) = a.limit {
        items.truncate(n);
    }
    let mut target = a.model.load()?;
    if let Some(n) = target.plain_prompts_note() {
        eprintln!("{n}");
    }
    let drafter = a.drafter.load(&mut target)?.expect("--drafter checked above");
    for (_, p) in &trees {
        drafter.validate_tree(&p.tree)?;
    }
    let ds = a.drafter.datastore(&target)?;
    let bar = progress(items.iter().map(|i| i.turns.len() as u64).sum(), "eval");
    let mut prog = |done: usize, _total: usize| bar.set_position(done as u64);
    let mut opts = EvalOptions { trees, params, max_tokens: a.max_tokens, seed: a.sampling.seed, datastore: ds.as_ref(), progress: &mut prog };
    let mut report = evaluate(&target, &drafter, &items, &mut opts)?;
    bar.finish_and_clear();
    report.drafter_dir = dir.display().to_string();
    print_eval(&report);
    if let Some(prefix) = a.out {
        write_reports(&report, &prefix)?;
        eprintln!("wrote {0}.json, {0}.md, {0}.svg", prefix.display());
    }
    Ok(())
}

fn print_eval(r: &EvalReport) {
    println!("tau = tokens emitted per target forward, the bonus token counted (plain decoding = 1.00); copied = of those, accepted tokens from the +lookup branch");
    println!("speed-up = median over turns of tok/s, each way; overall = all tokens / all decoding time, each way");
    println!("{:<24} {:>6} {:>6} {:>7} {:>11} {:>12} {:>9} {:>8} {:>10}", "tree", "nodes", "tau", "copied", "spec tok/s", "plain tok/s", "speed-up", "overall", "identical");
    for (name, s) in r.trees.iter().zip(&r.overall) {
        println!(
            "{:<24} {:>6.1} {:>6.2} {:>7.2} {:>11.1} {:>12.1} {:>8.2}x {:>7.2}x {:>10}",
            name,
            s.mean_tree_nodes,
            s.tau,
            s.copied_per_forward,
            s.spec_tok_s_median,
            s.plain_tok_s_median,
            s.speedup,
            s.speedup_total,
            s.all_identical.map_or("n/a", |b| if b { "yes" } else { "NO" })
        );
    }
    for (name, s) in r.trees.iter().zip(&r.overall) {
        let t = &s.step_ms;
        println!(
            "{name}: per step, ms: draft {:.2}, tree forward {:.2}, verify {:.2}, commit {:.2} ({:.1}% outside the forward){}",
            t.draft,
            t.forward,
            t.verify,
            t.commit,
            100.0 * t.outside_forward(),
            if s.explored_steps > 0 { format!("; {} of {} steps verified a larger tree to price it", s.explored_steps, s.target_forwards) } else { String::new() }
        );
    }
    println!("per category ({}):", r.trees[0]);
    for (c, v) in &r.per_category {
        println!("  {:<12} turns {:>3}  tau {:.2}  speed-up {:.2}x", c, v[0].turns, v[0].tau, v[0].speedup);
    }
    if let Some(s) = r.overall.first() {
        let f = |v: &[f64]| v.iter().map(|x| format!("{x:.2}")).collect::<Vec<_>>().join(" ");
        println!("{} guesses from the root, top-1 per level vs the target's tokens: {}", r.drafter, f(&s.head_top1));
        println!("{} guesses from the root, top-5 per level vs the target's tokens: {}", r.drafter, f(&s.head_top5));
        println!("drafted tokens accepted per step (0, 1, 2, ...): {:?}", s.accept_hist);
    }
    println!("sample ({}; accepted draft tokens in [brackets]):\n{}", r.trees[0], r.sample_marked);
}
