//! `selfspec generate`: decode one prompt plainly, or self-speculatively with `--drafter`.
use std::io::Write;

use anyhow::{bail, Result};
use clap::Args;
use selfspec::decode::generate::{generate_plain, GenStats, StopRule, TextStream};
use selfspec::decode::sampling::rng;
use selfspec::spec::plan::{Plan, DEFAULT_TREE};
use selfspec::spec::verify::Rule;
use selfspec::spec::{generate_spec, SpecOptions, SpecStats};

use crate::cli::args::{DrafterArgs, ModelArgs, SamplingArgs};

#[derive(Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt in the model's chat template.
    #[arg(long)]
    chat: bool,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    drafter: DrafterArgs,
    /// cpu (8 nodes), gpu (64), chain, chain:N, dynamic, dynamic:N, auto, auto:N (cut per step
    /// by this device's measured costs), or a tree JSON file; append +lookup[:N] to graft up to
    /// N tokens copied from the context (prompt lookup). See docs/trees.md.
    #[arg(long, default_value = DEFAULT_TREE, requires = "drafter", help_heading = "Drafter")]
    tree: String,
    /// Medusa's typical acceptance. LOSSY: the output no longer follows the target's distribution.
    #[arg(long, help_heading = "Drafter")]
    lossy_typical: bool,
    /// Also run plain decoding on the same prompt and print both speeds and the speed-up.
    #[arg(long, requires = "drafter")]
    compare: bool,
}

pub fn run(a: GenerateArgs) -> Result<()> {
    let params = a.sampling.params()?;
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    if a.lossy_typical && a.drafter.drafter.is_none() {
        bail!("--lossy-typical changes how drafted tokens are accepted; it needs --drafter DIR");
    }
    if a.prompt.is_empty() && !a.chat {
        bail!("--prompt is empty: give it some text (or add --chat, which wraps even an empty prompt in the chat template)");
    }
    let plan = Plan::parse(&a.tree)?;
    let t0 = std::time::Instant::now();
    let mut target = a.model.load()?;
    eprintln!("loaded {} ({} weights) in {:.2} s", target.path.display(), target.model.weight_format(), t0.elapsed().as_secs_f64());
    let drafter = a.drafter.load(&mut target)?;
    let ids = target.encode_prompt(&a.prompt, a.chat)?;
    let stop = StopRule { max_new_tokens: a.max_tokens, eos_ids: &target.tokenizer.eos_ids };
    let mut stream = TextStream::new(&target.tokenizer);
    let mut stdout = std::io::stdout().lock();
    let mut print = |t: u32| -> selfspec::Result<()> {
        if let Some(s) = stream.push(t)? {
            let _ = stdout.write_all(s.as_bytes());
            let _ = stdout.flush();
        }
        Ok(())
    };
    let mut r = rng(a.sampling.seed);
    let Some(drafter) = drafter else {
        let (_, stats) = generate_plain(&target.model, &ids, &params, &stop, &mut r, &mut print)?;
        finish_stream(&mut stream)?;
        eprintln!("{}", plain_summary(&stats));
        return Ok(());
    };
    let rule = Rule::for_params(&params, a.lossy_typical);
    let ds = a.drafter.datastore(&target)?;
    let opts = SpecOptions { tree: plan.tree, lookup: plan.lookup, datastore: ds.as_ref(), rule, params: params.clone(), stop };
    let (spec_out, stats) = generate_spec(&target.model, &drafter, &ids, &opts, &mut r, &mut print)?;
    finish_stream(&mut stream)?;
    eprintln!("{}", spec_summary(&stats, a.lossy_typical));
    if a.compare {
        let stop = StopRule { max_new_tokens: a.max_tokens, eos_ids: &target.tokenizer.eos_ids };
        let (plain_out, plain) = generate_plain(&target.model, &ids, &params, &stop, &mut rng(a.sampling.seed), &mut |_| Ok(()))?;
        eprintln!("{}", plain_summary(&plain));
        let same = match (params.is_greedy() && !a.lossy_typical, spec_out == plain_out) {
            (false, _) => "",
            (true, true) => "; outputs identical",
            (true, false) => "; OUTPUTS DIFFER",
        };
        eprintln!(
            "speed-up {:.2}x (self-speculative {:.1} tok/s vs plain {:.1} tok/s){same}",
            stats.gen.decode_tok_s() / plain.decode_tok_s(),
            stats.gen.decode_tok_s(),
            plain.decode_tok_s(),
        );
    }
    Ok(())
}

fn finish_stream(stream: &mut TextStream) -> Result<()> {
    let mut stdout = std::io::stdout().lock();
    if let Some(s) = stream.finish()? {
        stdout.write_all(s.as_bytes())?;
    }
    writeln!(stdout)?;
    stdout.flush()?;
    Ok(())
}

fn plain_summary(s: &GenStats) -> String {
    format!("plain: prompt {} tokens, {} new tokens | prefill {:.1} tok/s | decode {:.1} tok/s", s.prompt_tokens, s.new_tokens, s.prefill_tok_s(), s.decode_tok_s())
}

fn spec_summary(s: &SpecStats, lossy: bool) -> String {
    let steps = s.gen.target_forwards.max(1) as f64;
    format!(
        "self-speculative{}: prompt {} tokens, {} new tokens, {} target forwards | tau {:.2} tokens/forward (bonus token counted; plain = 1.00) | prefill {:.1} tok/s | decode {:.1} tok/s | per step: draft {:.2} ms, tree forward {:.2} ms, verify {:.2} ms, commit {:.2} ms{}",
        if lossy { " (LOSSY typical acceptance: output does not follow the target's distribution)" } else { "" },
        s.gen.prompt_tokens,
        s.gen.new_tokens,
        s.gen.target_forwards,
        s.tau(),
        s.gen.prefill_tok_s(),
        s.gen.decode_tok_s(),
        s.time.draft * 1e3 / steps,
        s.time.forward * 1e3 / steps,
        s.time.verify * 1e3 / steps,
        s.time.commit * 1e3 / steps,
        if s.lookup_nodes > 0 { format!(" | lookup: {} of {} copied tokens accepted", s.lookup_accepted, s.lookup_nodes) } else { String::new() },
    )
}
