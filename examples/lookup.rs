//! How often would copying from the context (prompt lookup, `src/lookup.rs`) guess the target's
//! next tokens? For every answer token of some distill JSONL files, look up the continuation of
//! the text before it and count how much of it is right.
//!
//! cargo run --release --example lookup -- models/smollm2.gguf training/data/distill3-smollm2.jsonl
use std::path::PathBuf;

use selfspec::draft::lookup::Lookup;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        anyhow::bail!("usage: lookup MODEL.gguf DISTILL.jsonl...");
    }
    let target = selfspec::model::loader::Target::load(&PathBuf::from(&args[1]), &candle_core::Device::Cpu)?;
    // (context before the token, the answer from the token on), for every answer token.
    let mut cases: Vec<(Vec<u32>, Vec<u32>)> = Vec::new();
    for f in &args[2..] {
        for line in std::fs::read_to_string(f)?.lines().filter(|l| !l.trim().is_empty()) {
            let r: selfspec::data::DistillRecord = serde_json::from_str(line)?;
            let mut ctx = Vec::new();
            for m in &r.messages {
                let ids = target.tokenizer.encode(&m.content, false)?;
                if m.role == "assistant" {
                    for t in 0..ids.len() {
                        let mut before = ctx.clone();
                        before.extend_from_slice(&ids[..t]);
                        cases.push((before, ids[t..].to_vec()));
                    }
                }
                ctx.extend(ids);
            }
        }
    }
    println!("{} answer positions", cases.len());
    println!("min match  max tokens  match found  first right (of found)  accepted per position  per copied token");
    for min_match in [1, 2, 3] {
        for max_tokens in [2, 4, 6] {
            let l = Lookup { max_tokens, min_match, max_match: 4 };
            let (mut found, mut first, mut accepted, mut copied) = (0usize, 0usize, 0usize, 0usize);
            for (before, truth) in &cases {
                let guess = l.continuation(before);
                let run = guess.iter().zip(truth).take_while(|(a, b)| a == b).count();
                found += !guess.is_empty() as usize;
                first += (run > 0) as usize;
                accepted += run;
                copied += guess.len();
            }
            let n = cases.len().max(1) as f64;
            println!(
                "{min_match:>9}  {max_tokens:>10}  {:>11.3}  {:>11.3} ({:.3})  {:>21.3}  {:>16.3}",
                found as f64 / n,
                first as f64 / n,
                first as f64 / found.max(1) as f64,
                accepted as f64 / n,
                accepted as f64 / copied.max(1) as f64
            );
        }
    }
    Ok(())
}
