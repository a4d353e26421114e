//! `selfspec tune`: write the tree that maximises expected speed-up on this device, and check it.
use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use selfspec::eval::tune::{tune, TuneOptions};
use selfspec::spec::plan::DEFAULT_TREE;

use crate::cli::args::{DrafterArgs, ModelArgs};

#[derive(Args)]
pub struct TuneArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    drafter: DrafterArgs,
    #[arg(long)]
    prompts: PathBuf,
    /// The tree file to write (JSON; `--tree FILE` reads it).
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = 24)]
    max_nodes: usize,
    /// Tokens generated per prompt to measure the drafter's accuracy.
    #[arg(long, default_value_t = 96)]
    max_tokens: usize,
    /// Prompts used afterwards to measure the chosen tree against plain decoding.
    #[arg(long, default_value_t = 6)]
    check_prompts: usize,
}

pub fn run(a: TuneArgs) -> Result<()> {
    a.drafter.dir("tune")?;
    selfspec::eval::tune::check_sizes(a.max_nodes, a.max_tokens, a.check_prompts)?;
    selfspec::files::check_writable(&a.out)?;
    let items = selfspec::data::read_prompts(&a.prompts)?;
    let mut target = a.model.load()?;
    if let Some(n) = target.plain_prompts_note() {
        eprintln!("{n}");
    }
    let drafter = a.drafter.load(&mut target)?.expect("--drafter checked above");
    let ds = a.drafter.datastore(&target)?;
    let mut opts = TuneOptions { max_nodes: a.max_nodes, max_tokens: a.max_tokens, check_prompts: a.check_prompts, datastore: ds.as_ref(), log: &mut |s| eprintln!("{s}") };
    let t = tune(&target, &drafter, &items, &a.out, &mut opts)?;
    println!("{:>5} {:>12} {:>10} {:>17}", "nodes", "expected tau", "cost/plain", "expected speed-up");
    for p in &t.points {
        println!("{:>5} {:>12.2} {:>10.2} {:>16.2}x{}", p.nodes, p.expected_tau, p.cost_ratio, p.expected_speedup, if p.nodes == t.chosen_nodes { "  <- chosen" } else { "" });
    }
    for (name, s) in &t.measured {
        println!("measured {name}: tau {:.2} tokens/forward (bonus counted), speed-up {:.2}x ({:.1} vs {:.1} tok/s)", s.tau, s.speedup, s.spec_tok_s_median, s.plain_tok_s_median);
    }
    if t.default_faster {
        println!("the default tree ({DEFAULT_TREE}, no tree file needed) measured faster than the tuned tree here");
    }
    if let Some(n) = t.lookup {
        println!("kept +lookup:{n} in {} (`--tree {}` uses it)", a.out.display(), a.out.display());
    }
    Ok(())
}
