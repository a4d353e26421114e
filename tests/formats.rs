//! Weight formats (`--weights f32|f16|bf16|q8_0|native`): each stays close to the f32 reference, each
//! keeps tree verification bit-identical to sequential decoding, and greedy self-speculation in
//! each format emits exactly what plain greedy decoding in that format emits.
mod common;

use std::path::PathBuf;

use candle_core::quantized::GgmlDType;
use candle_core::{Device, Tensor};
use common::*;
use selfspec::model::fixtures;
use selfspec::decode::generate::{generate_plain, Flow, StopRule};
use selfspec::draft::heads::Heads;
use selfspec::model::loader::Target;
use selfspec::cpu::quant::WeightFormat;
use selfspec::decode::sampling::{rng, SamplingParams};
use selfspec::draft::drafter::Drafter;
use selfspec::draft::choice::TreeChoice;
use selfspec::spec::{generate_spec, SpecOptions};
use selfspec::draft::tree::Tree;
use selfspec::spec::verify::Rule;

/// Tolerance on the largest logit difference from the f32 reference, relative to the largest
/// |logit|: f16 rounds weights (2^-11 relative); bf16 rounds weights and activations (2^-8);
/// q8_0 also quantizes activations per 32 values;
/// native here is Q4_1 weights, whose error is the file's own, not the kernel's.
fn tolerance(f: WeightFormat) -> f32 {
    match f {
        WeightFormat::F32 => 0.0,
        WeightFormat::F16 => 0.005,
        WeightFormat::Bf16 => 0.015,
        WeightFormat::Q8_0 => 0.03,
        WeightFormat::Native => 0.03,
    }
}

fn rel_diff(a: &[f32], reference: &[f32]) -> f32 {
    let scale = reference.iter().fold(0f32, |m, x| m.max(x.abs()));
    max_diff(a, reference) / scale
}

/// A tiny model stored as Q4_1, as the SmolLM2 GGUF is: native keeps those blocks; the f32
/// reference is their exact dequantisation, so native differs only by activation rounding.
#[test]
fn every_format_matches_the_f32_reference_on_a_q4_1_gguf() {
    let dir = scratch("formats-q41");
    let cfg = fixtures::tiny_config();
    let w = fixtures::random_weights(&cfg, 21).unwrap();
    let path = dir.join("q41.gguf");
    fixtures::write_gguf_as(&path, &cfg, &w, GgmlDType::Q4_1).unwrap();
    let mut t = Target::load(&path, &Device::Cpu).unwrap();
    let toks: Vec<u32> = (0..19).map(|i| (i * 29 + 3) % 260).collect();
    let reference = last_logits(&t.model, &toks);
    let f32_bytes = t.model.weight_bytes_per_forward();
    for f in WeightFormat::ALL {
        t.set_weights(f).unwrap();
        assert_eq!(t.model.weight_format(), f);
        let got = last_logits(&t.model, &toks);
        let d = rel_diff(&got, &reference);
        eprintln!("{f}: logits differ from f32 by {d:.4} of the largest logit");
        assert!(d <= tolerance(f), "{f}: logits differ from f32 by {d} of the largest logit");
        let bytes = t.model.weight_bytes_per_forward();
        match f {
            WeightFormat::F32 => assert_eq!(got, reference),
            // Q4_1 is 20 bytes per 32 values (+ panel padding): well under a quarter of f32.
            WeightFormat::Native => assert!(bytes * 4 < f32_bytes, "native reads {bytes} bytes vs f32 {f32_bytes}"),
            _ => assert!(bytes < f32_bytes),
        }
    }
}

#[test]
fn tree_forward_is_bit_identical_to_sequential_in_every_format() {
    let dir = scratch("formats-tree");
    let cfg = fixtures::tiny_config();
    let w = fixtures::random_weights(&cfg, 22).unwrap();
    let path = dir.join("q41.gguf");
    fixtures::write_gguf_as(&path, &cfg, &w, GgmlDType::Q4_1).unwrap();
    let mut t = Target::load(&path, &Device::Cpu).unwrap();
    let prompt: Vec<u32> = (0..10).map(|i| (i * 17 + 2) % 260).collect();
    for f in WeightFormat::ALL {
        t.set_weights(f).unwrap();
        for seed in 1..3 {
            check_tree_equivalence(&t.model, &prompt, 17, seed);
        }
    }
}

/// A batched forward over independent sequences (batched distillation) gives each row the same
/// bits as that sequence's own forward, in every format: sequences of different lengths, one
/// of them a small tree and one a 66-token prompt chunk (so the forward holds more rows than a
/// tree may, as a server's does), each after its own prefix. The chunk's rows also equal the
/// same tokens run in two smaller pieces: prefill chunking changes no bits.
#[test]
fn batched_forward_matches_each_sequence_alone_in_every_format() {
    use selfspec::cpu::TreeMask;
    use selfspec::model::BatchEntry;
    let dir = scratch("formats-batch");
    let cfg = fixtures::tiny_config();
    let w = fixtures::random_weights(&cfg, 24).unwrap();
    let path = dir.join("q41.gguf");
    fixtures::write_gguf_as(&path, &cfg, &w, GgmlDType::Q4_1).unwrap();
    let mut t = Target::load(&path, &Device::Cpu).unwrap();
    let prompts: Vec<Vec<u32>> = (0..4).map(|s| (0..5 + 4 * s).map(|i| ((i * 23 + 11 * s + 1) % 260) as u32).collect()).collect();
    let chunk: Vec<u32> = (0..66).map(|i| ((i * 37 + 5) % 260) as u32).collect();
    let news: Vec<Vec<u32>> = vec![vec![7], vec![9, 31, 44], vec![100], chunk];
    let masks = [TreeMask::causal(1), TreeMask::from_parents(&[None, Some(0), Some(0)]).unwrap(), TreeMask::causal(1), TreeMask::causal(66)];
    for f in WeightFormat::ALL {
        t.set_weights(f).unwrap();
        let m = &t.model;
        let mut alone = Vec::new();
        let mut caches = Vec::new();
        for ((p, n), mask) in prompts.iter().zip(&news).zip(&masks) {
            let mut c = m.new_cache().unwrap();
            m.forward_causal(p, &mut c).unwrap();
            let mut c2 = m.new_cache().unwrap();
            m.forward_causal(p, &mut c2).unwrap();
            let pos: Vec<usize> = match n.len() {
                1 => vec![p.len()],
                3 => vec![p.len(), p.len() + 1, p.len() + 1],
                _ => (p.len()..p.len() + n.len()).collect(),
            };
            let own = if n.len() > 3 {
                let a = m.forward_causal(&n[..30], &mut c).unwrap();
                Tensor::cat(&[a, m.forward_causal(&n[30..], &mut c).unwrap()], 0).unwrap()
            } else {
                m.forward(n, &pos, mask, &mut c).unwrap()
            };
            alone.push(own.flatten_all().unwrap().to_vec1::<f32>().unwrap());
            caches.push((c2, pos));
        }
        let positions: Vec<Vec<usize>> = caches.iter().map(|(_, p)| p.clone()).collect();
        let mut entries: Vec<BatchEntry> = caches
            .iter_mut()
            .zip(&news)
            .zip(&masks)
            .zip(&positions)
            .map(|(((c, n), mask), pos)| BatchEntry { tokens: n, positions: pos, mask, cache: &mut c.0 })
            .collect();
        let got = m.forward_batch(&mut entries).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(got, alone.concat(), "{f}: batched rows differ from each sequence's own forward");
        for ((c, p), n) in caches.iter().zip(&prompts).zip(&news) {
            assert_eq!(c.0.len(), p.len() + n.len(), "{f}: each cache committed its own tokens");
        }
    }
    // Bad batches are refused, not run: none at all, or positions that do not match the tokens.
    assert!(t.model.forward_batch(&mut []).is_err());
    let mut c = t.model.new_cache().unwrap();
    let mask = TreeMask::causal(1);
    let err = t.model.forward_batch(&mut [BatchEntry { tokens: &[1, 2], positions: &[0], mask: &mask, cache: &mut c }]).unwrap_err();
    assert!(err.to_string().contains("sequence 0"), "{err}");
    assert_eq!(c.len(), 0, "a refused batch commits nothing");
}

#[test]
fn q8_0_q4_0_and_q4_k_ggufs_load_natively() {
    let dir = scratch("formats-q8");
    // Q4_K needs rows of 256 values.
    let cfg = selfspec::model::Config { hidden_size: 256, intermediate_size: 512, head_dim: 64, ..fixtures::tiny_config() };
    let w = fixtures::random_weights(&cfg, 23).unwrap();
    for ty in [GgmlDType::Q8_0, GgmlDType::Q4_0, GgmlDType::Q4K] {
        let path = dir.join(format!("{ty:?}.gguf"));
        fixtures::write_gguf_as(&path, &cfg, &w, ty).unwrap();
        let mut t = Target::load(&path, &Device::Cpu).unwrap();
        let toks: Vec<u32> = (0..15).map(|i| (i * 31 + 7) % 260).collect();
        let reference = last_logits(&t.model, &toks);
        let f32_bytes = t.model.weight_bytes_per_forward();
        t.set_weights(WeightFormat::Native).unwrap();
        let d = rel_diff(&last_logits(&t.model, &toks), &reference);
        assert!(d <= 0.03, "{ty:?} native: logits differ by {d}");
        // Kept in its own blocks (a fallback to f32 or Q8_0 would read more).
        let ratio = t.model.weight_bytes_per_forward() as f64 / f32_bytes as f64;
        let most = if ty == GgmlDType::Q8_0 { 0.3 } else { 0.2 };
        assert!(ratio < most, "{ty:?} native reads {ratio:.2} of f32's bytes");
    }
}

#[test]
fn smollm2_every_format_stays_close_and_greedy_speculation_stays_exact() {
    let mut t = smollm2();
    let text = t.encode_prompt("Explain why the sky is blue in two sentences.", true).unwrap();
    let reference = last_logits(&t.model, &text);
    let prompts = selfspec::data::read_prompts(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("training/prompts/eval.jsonl")).unwrap();
    let params = SamplingParams::greedy();
    for f in [WeightFormat::F16, WeightFormat::Bf16, WeightFormat::Q8_0, WeightFormat::Native] {
        t.set_weights(f).unwrap();
        // Loaded after the switch, so its draft projection takes the target's format too.
        let heads = Drafter::Heads(Heads::from_dir(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("training/drafters/smollm2-heads"), &t).unwrap());
        let got = last_logits(&t.model, &text);
        let d = rel_diff(&got, &reference);
        eprintln!("{f}: SmolLM2 logits differ from f32 by {d:.4} of the largest logit");
        assert!(d <= tolerance(f) * 3.0, "{f}: SmolLM2 logits differ from f32 by {d} of the largest logit");
        let mut forwards = 0;
        let mut tokens = 0;
        for item in prompts.iter().take(4) {
            let ids = t.encode_prompt(&item.turns[0], true).unwrap();
            let stop = StopRule { max_new_tokens: 64, eos_ids: &t.tokenizer.eos_ids };
            let (plain, _) = generate_plain(&t.model, &ids, &params, &stop, &mut rng(0), &mut |_| Ok(Flow::Continue)).unwrap();
            let opts = SpecOptions { tree: TreeChoice::Static(Tree::cpu_default()), lookup: None, datastore: None, rule: Rule::Greedy, params: params.clone(), stop: StopRule { max_new_tokens: 64, eos_ids: &t.tokenizer.eos_ids } };
            let (spec, stats) = generate_spec(&t.model, &heads, &ids, &opts, &mut rng(0), &mut |_| Ok(Flow::Continue)).unwrap();
            assert_eq!(spec, plain, "{f}: speculative output differs from plain greedy for {:?}", item.turns[0]);
            forwards += stats.gen.target_forwards;
            tokens += plain.len();
        }
        assert!(forwards < tokens, "{f}: speculation never accepted a drafted token");
    }
}

/// Drafting fuses every head's first block into one layer (stored in the target's format);
/// its draft logits match the training-time path (`hidden` + projection).
#[test]
fn fused_drafting_matches_the_training_path() {
    let mut t = smollm2();
    let ids = t.encode_prompt("Name three colours.", true).unwrap();
    for (f, tol) in [(WeightFormat::F32, 1e-4f32), (WeightFormat::Native, 0.05)] {
        t.set_weights(f).unwrap();
        let heads = Heads::from_dir(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("training/drafters/smollm2-heads"), &t).unwrap();
        let mut cache = t.model.new_cache().unwrap();
        let h = t.model.forward_causal(&ids, &mut cache).unwrap().narrow(0, ids.len() - 1, 1).unwrap();
        let root = 42u32;
        let fused: Vec<f32> = heads.draft_logits(&h, root, &t.model).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let e = t.model.embed(&[root]).unwrap();
        let reference: Vec<f32> =
            heads.train_logits(&h, Some(&e), &t.model.lm_head_weight().unwrap()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(fused.len(), reference.len());
        let d = rel_diff(&fused, &reference);
        assert!(d <= tol, "{f}: fused draft logits differ by {d} of the largest");
    }
}
