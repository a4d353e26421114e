#![allow(dead_code)]
use std::path::PathBuf;

use candle_core::Device;
use selfspec::fixtures;
use selfspec::loader::Target;

/// A fresh scratch directory per test.
pub fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("selfspec-test-{}-{}", name, std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The tiny random model written as GGUF, loaded back.
pub fn tiny_gguf(name: &str, seed: u64) -> (PathBuf, Target) {
    let dir = scratch(name);
    let cfg = fixtures::tiny_config();
    let w = fixtures::random_weights(&cfg, seed).unwrap();
    let p = dir.join("tiny.gguf");
    fixtures::write_gguf(&p, &cfg, &w).unwrap();
    let t = Target::load(&p, &Device::Cpu).unwrap();
    (p, t)
}

/// SmolLM2-135M-Instruct, fetched by `scripts/fetch-model` (the test command runs it first).
pub fn smollm2_path() -> PathBuf {
    let dir = std::env::var_os("SELFSPEC_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models"));
    let p = dir.join("smollm2.gguf");
    assert!(p.exists(), "{} is missing: run scripts/fetch-model (scripts/test does)", p.display());
    p
}

pub fn smollm2() -> Target {
    Target::load(&smollm2_path(), &Device::Cpu).unwrap()
}

/// xorshift for test randomness without extra dependencies.
pub struct Rand(pub u64);
impl Rand {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}
