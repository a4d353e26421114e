#![allow(dead_code)]
use std::path::PathBuf;

use candle_core::Device;
use selfspec::cpu::TreeMask;
use selfspec::cpu::reduce::{row_to_vec, rows_to_vec};
use selfspec::model::Llama;
use selfspec::model::fixtures;
use selfspec::model::loader::Target;

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

pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

pub fn last_logits(m: &Llama, toks: &[u32]) -> Vec<f32> {
    let mut c = m.new_cache().unwrap();
    let h = m.forward_causal(toks, &mut c).unwrap();
    let l = m.logits(&h).unwrap();
    row_to_vec(&l, toks.len() - 1).unwrap()
}

/// Random prefix-closed tree: node i's parent is any earlier node.
pub fn random_tree(r: &mut Rand, n: usize) -> Vec<Option<usize>> {
    (0..n).map(|i| if i == 0 { None } else { Some(r.below(i)) }).collect()
}

pub fn path_to(parents: &[Option<usize>], mut i: usize) -> Vec<usize> {
    let mut p = vec![i];
    while let Some(q) = parents[i] {
        p.push(q);
        i = q;
    }
    p.reverse();
    p
}

pub fn check_tree_equivalence(model: &Llama, prompt: &[u32], n: usize, seed: u64) {
    let mut r = Rand(seed);
    let parents = random_tree(&mut r, n);
    let vocab = model.config().vocab_size;
    let tokens: Vec<u32> = (0..n).map(|_| r.below(vocab) as u32).collect();
    let depth: Vec<usize> = (0..n).map(|i| path_to(&parents, i).len() - 1).collect();
    let mut cache = model.new_cache().unwrap();
    model.forward_causal(prompt, &mut cache).unwrap();
    let l = prompt.len();
    let positions: Vec<usize> = depth.iter().map(|d| l + d).collect();
    let mask = TreeMask::from_parents(&parents).unwrap();
    let h = model.forward(&tokens, &positions, &mask, &mut cache).unwrap();
    let tree_logits = rows_to_vec(&model.logits(&h).unwrap()).unwrap();
    for i in 0..n {
        // Sequential: same prefill, then the path one token at a time.
        let mut c = model.new_cache().unwrap();
        model.forward_causal(prompt, &mut c).unwrap();
        let mut last = vec![];
        for &node in &path_to(&parents, i) {
            let h = model.forward_causal(&[tokens[node]], &mut c).unwrap();
            last = row_to_vec(&model.logits(&h).unwrap(), 0).unwrap();
        }
        assert_eq!(tree_logits[i], last, "node {i}: tree logits are not bit-identical to sequential decoding");
    }
    // Compact to the deepest path, run one more token, compare with a fresh prefill.
    let deepest = (0..n).max_by_key(|&i| depth[i]).unwrap();
    let path = path_to(&parents, deepest);
    let slots: Vec<usize> = path.iter().map(|&p| l + p).collect();
    cache.compact(l, &slots).unwrap();
    assert_eq!(cache.len(), l + path.len());
    let next = 7u32;
    let h = model.forward_causal(&[next], &mut cache).unwrap();
    let after = row_to_vec(&model.logits(&h).unwrap(), 0).unwrap();
    let mut full = prompt.to_vec();
    full.extend(path.iter().map(|&p| tokens[p]));
    full.push(next);
    let fresh = last_logits(model, &full);
    let d = max_diff(&after, &fresh);
    assert!(d <= 1e-4, "after compaction the next forward differs from a fresh prefill by {d}");
}


/// A training corpus: repetitive (so drafters can learn it) but with every document, and so every
/// chunk, different: validation chunks are held out by content.
pub fn corpus() -> Vec<selfspec::data::Document> {
    (0..12)
        .map(|i| {
            let base = format!("the cat {i} sat on the mat. the dog ran in the sun. then the cat ran after the dog. ");
            selfspec::data::Document::plain(format!("{} {}", base.repeat(3), "the end ".repeat(i % 3 + 1)))
        })
        .collect()
}
