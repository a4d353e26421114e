//! Token ids of texts with a model's tokenizer, for comparing against another implementation
//! (scripts/gemma3-parity compares with llama.cpp's server). Reads one JSON string per line on
//! stdin, writes one JSON array of ids per line (no BOS).
//!
//! `cargo run --release --example tokenize -- models/gemma3-270m.gguf < texts.jsonl`
use std::io::{BufRead, Write};

fn main() -> anyhow::Result<()> {
    let path = std::env::args().nth(1).ok_or_else(|| anyhow::anyhow!("usage: tokenize MODEL < texts.jsonl"))?;
    let t = selfspec::Target::load_with(std::path::Path::new(&path), &candle_core::Device::Cpu, selfspec::cpu::quant::WeightFormat::Native)?;
    let mut out = std::io::stdout().lock();
    for line in std::io::stdin().lock().lines() {
        let text: String = serde_json::from_str(&line?)?;
        let ids = t.tokenizer.encode(&text, false)?;
        writeln!(out, "{}", serde_json::to_string(&ids)?)?;
    }
    Ok(())
}
