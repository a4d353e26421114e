//! The library in a few lines: load a target and a drafter, decode a prompt self-speculatively,
//! and check the output against plain decoding.
//!
//! cargo run --release --example generate -- models/smollm2.gguf training/drafters/smollm2-layer "Write a haiku about the sea."
use std::path::Path;

use selfspec::{generate_plain, generate_spec, rng, Drafter, Flow, Plan, Rule, SamplingParams, SpecOptions, StopRule, Target, DEFAULT_TREE};

fn main() -> selfspec::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (model, drafter, prompt) = match args.as_slice() {
        [_, m, d, p] => (m, d, p),
        _ => {
            eprintln!("usage: generate MODEL.gguf DRAFTER_DIR PROMPT");
            std::process::exit(2);
        }
    };
    let target = Target::load(Path::new(model), &candle_core::Device::Cpu)?;
    let drafter = Drafter::from_dir(Path::new(drafter), &target)?;
    let ids = target.encode_prompt(prompt, true)?;
    let params = SamplingParams::greedy();
    let plan = Plan::parse(DEFAULT_TREE)?;
    let stop = StopRule { max_new_tokens: 64, eos_ids: &target.tokenizer.eos_ids };
    let opts = SpecOptions { tree: plan.tree, lookup: plan.lookup, datastore: None, rule: Rule::for_params(&params, false), params: params.clone(), stop };
    let (spec, stats) = generate_spec(&target.model, &drafter, &ids, &opts, &mut rng(0), &mut |_| Ok(Flow::Continue))?;
    let stop = StopRule { max_new_tokens: 64, eos_ids: &target.tokenizer.eos_ids };
    let (plain, _) = generate_plain(&target.model, &ids, &params, &stop, &mut rng(0), &mut |_| Ok(Flow::Continue))?;
    println!("{}", target.tokenizer.decode(&spec)?);
    eprintln!("tau {:.2} tokens per target forward (bonus token counted; plain = 1.00); identical to plain decoding: {}", stats.tau(), spec == plain);
    Ok(())
}
