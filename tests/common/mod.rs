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

/// A draft layer's training forward (differentiable ops, `steps` steps of training-time test)
/// against its inference forward on `toks`: step 0 is the causal forward over the real pairs,
/// step s a chain drafted at inference from anchors 0, 9 and 17 (its own predictions fed back).
/// Returns the predictions, for further checks.
pub fn check_layer_forwards_agree(t: &Target, train: &selfspec::draft::layer::TrainLayer, layer: &selfspec::draft::layer::DraftLayer, toks: &[u32], steps: usize) -> Vec<candle_core::Tensor> {
    let v = |x: &candle_core::Tensor| -> Vec<f32> { x.flatten_all().unwrap().to_vec1().unwrap() };
    let h = selfspec::train::hidden_states(t, toks, None).unwrap();
    let n = toks.len() - 1;
    let feats = h.narrow(0, 0, n).unwrap();
    let embs: Vec<candle_core::Tensor> = (0..steps).map(|s| t.model.embed(&(0..n).map(|r| *toks.get(r + s + 1).unwrap_or(&0)).collect::<Vec<_>>()).unwrap()).collect();
    let preds = train.forward_unrolled(&feats, &embs).unwrap();
    let mut cache = layer.new_cache().unwrap();
    let out = layer.forward(&feats, &toks[1..], &(0..n).collect::<Vec<_>>(), &TreeMask::causal(n), &mut cache, &t.model).unwrap();
    let d0 = max_diff(&v(&out), &v(&preds[0]));
    assert!(d0 < 1e-3, "step 0 differs by {d0}");
    for a in [0usize, 9, 17].into_iter().filter(|&a| a + steps < n) {
        let mut c = layer.new_cache().unwrap();
        let mut f = layer.forward(&h.narrow(0, 0, a + 1).unwrap(), &toks[1..a + 2], &(0..a + 1).collect::<Vec<_>>(), &TreeMask::causal(a + 1), &mut c, &t.model).unwrap().narrow(0, a, 1).unwrap();
        for s in 1..steps {
            f = layer.forward(&f, &[toks[a + s + 1]], &[a + s], &TreeMask::causal(1), &mut c, &t.model).unwrap();
            let d = max_diff(&v(&f), &v(&preds[s].narrow(0, a, 1).unwrap()));
            // The inference cache holds K/V in f16 (relative rounding 2^-11), the training
            // forward keeps them in f32.
            assert!(d < 1e-3, "anchor {a}, step {s}: differs by {d}");
        }
    }
    preds
}

/// Step `seq` alone to its end, as `generate_spec` does (each tree cut by the sequence's own
/// costs); returns the target forwards it took.
pub fn run_alone(model: &Llama, seq: &mut selfspec::spec::Sequence) -> usize {
    let mut forwards = 0;
    while let Some(work) = seq.next_work(model, usize::MAX, true).unwrap() {
        let work = seq.cut(work).unwrap();
        let last = work.tokens().len() >= seq.prompt_left();
        let hidden = model.forward(work.tokens(), work.positions(), work.mask(), seq.cache_mut()).unwrap();
        let r = work.logit_rows(last);
        let logits = (!r.is_empty()).then(|| model.logits(&hidden.narrow(0, r.start, r.len()).unwrap()).unwrap());
        let n = work.tokens().len();
        seq.finish_work(model, work, hidden, logits, n, 1.0, &mut |_, _| Ok(selfspec::Flow::Continue)).unwrap();
        forwards += 1;
    }
    forwards
}
