//! Self-speculative decoding is exact: greedy output is byte-identical to plain greedy decoding,
//! and sampled output follows the target's distribution (a chi-square test that a deliberately
//! broken rule fails).
mod common;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use common::*;
use selfspec::draft::budget::{Budget, CostCurve};
use selfspec::decode::generate::{generate_plain, Flow, StopRule};
use selfspec::draft::heads::{Heads, HeadsConfig};
use selfspec::draft::lookup::Lookup;
use selfspec::model::loader::Fingerprint;
use selfspec::cpu::reduce::row_to_vec;
use selfspec::model::Llama;
use selfspec::decode::sampling::{rng, SamplingParams};
use selfspec::draft::drafter::Drafter;
use selfspec::draft::choice::TreeChoice;
use selfspec::spec::{generate_spec, SpecOptions};
use selfspec::draft::tree::Tree;
use selfspec::spec::verify::Rule;

/// A random model with a 16-token vocabulary and random heads that draft varied tokens.
fn tiny16() -> (Llama, Drafter) {
    tiny16_of(selfspec::model::fixtures::tiny_config())
}

/// [`tiny16`] with another family's config (the sizes are set here).
fn tiny16_of(mut cfg: selfspec::model::Config) -> (Llama, Drafter) {
    cfg.vocab_size = 16;
    cfg.hidden_size = 32;
    cfg.intermediate_size = 64;
    cfg.head_dim = 8;
    let w = selfspec::model::fixtures::random_weights(&cfg, 77).unwrap();
    let model = Llama::load(VarBuilder::from_tensors(w, DType::F32, &Device::Cpu), &cfg).unwrap();
    let hcfg = HeadsConfig {
        num_heads: 2,
        num_layers: 1,
        hidden_size: 32,
        vocab_size: 16,
        own_lm_head: false,
        target: Fingerprint { architecture: "llama".into(), hidden_size: 32, vocab_size: 16, hash: "test".into() },
        draft_vocab_size: None,
        token_aware: false,
        recipe: serde_json::Value::Null,
    };
    // Seeded (uniform with standard deviation 0.5), so every run drafts with the same heads and
    // draws the same samples. Drawn from the thread's RNG, the heads changed from run to run and
    // with them the chi-square test's p-value, a fresh uniform number each run: about one run in
    // a few hundred failed at p < 0.001 with nothing wrong.
    let mut state = 0x5EED_u64;
    let mut uniform = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 1.732
            })
            .collect()
    };
    let mut hw = HashMap::new();
    for k in 0..2 {
        hw.insert(format!("heads.{k}.blocks.0.weight"), Tensor::from_vec(uniform(32 * 32), (32, 32), &Device::Cpu).unwrap());
        hw.insert(format!("heads.{k}.blocks.0.bias"), Tensor::from_vec(uniform(32), 32, &Device::Cpu).unwrap());
    }
    let heads = Heads::load(VarBuilder::from_tensors(hw, DType::F32, &Device::Cpu), &hcfg).unwrap();
    (model, Drafter::Heads(heads))
}

/// Exact joint distribution of the first three tokens after `prompt`, by enumeration.
fn exact_joint(model: &Llama, prompt: &[u32], params: &SamplingParams) -> Vec<f64> {
    let dist_after = |seq: &[u32]| -> Vec<f64> {
        let mut c = model.new_cache().unwrap();
        let h = model.forward_causal(seq, &mut c).unwrap();
        let l = row_to_vec(&model.logits(&h).unwrap(), seq.len() - 1).unwrap();
        params.distribution(&l, seq)
    };
    let mut joint = vec![0.0; 16 * 16 * 16];
    let p1 = dist_after(prompt);
    for a in 0..16u32 {
        if p1[a as usize] == 0.0 {
            continue;
        }
        let s1: Vec<u32> = prompt.iter().copied().chain([a]).collect();
        let p2 = dist_after(&s1);
        for b in 0..16u32 {
            if p2[b as usize] == 0.0 {
                continue;
            }
            let s2: Vec<u32> = s1.iter().copied().chain([b]).collect();
            let p3 = dist_after(&s2);
            for c in 0..16usize {
                joint[(a as usize * 16 + b as usize) * 16 + c] = p1[a as usize] * p2[b as usize] * p3[c];
            }
        }
    }
    joint
}

/// Chi-square goodness of fit; bins expecting < 5 counts are pooled. Returns the p-value
/// (Wilson-Hilferty approximation of the chi-square tail).
fn chi_square_p(counts: &[usize], probs: &[f64], n: usize) -> f64 {
    let (mut stat, mut df) = (0.0, 0usize);
    let (mut pool_o, mut pool_e) = (0.0, 0.0);
    for (&o, &p) in counts.iter().zip(probs) {
        let e = p * n as f64;
        if e < 5.0 {
            pool_o += o as f64;
            pool_e += e;
            assert!(p > 0.0 || o == 0, "a token sequence with probability 0 was generated");
        } else {
            stat += (o as f64 - e).powi(2) / e;
            df += 1;
        }
    }
    if pool_e > 0.0 {
        stat += (pool_o - pool_e).powi(2) / pool_e.max(1e-9);
        df += 1;
    }
    let k = (df - 1) as f64;
    let z = ((stat / k).powf(1.0 / 3.0) - (1.0 - 2.0 / (9.0 * k))) / (2.0 / (9.0 * k)).sqrt();
    0.5 * erfc(z / std::f64::consts::SQRT_2)
}

fn erfc(x: f64) -> f64 {
    // Numerical Recipes' erfc approximation, relative error < 1.2e-7.
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let r = t * (-z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))).exp();
    if x >= 0.0 { r } else { 2.0 - r }
}

fn test_tree() -> TreeChoice {
    TreeChoice::Static(Tree::from_paths(&[vec![0], vec![1], vec![2], vec![0, 0], vec![0, 1], vec![1, 0]]).unwrap())
}

/// An `auto` tree with a made-up cost curve (each extra node 8% dearer), so the cut varies from
/// step to step with the drafts' probabilities but does not depend on this machine's timing.
fn auto_tree(max_nodes: usize) -> TreeChoice {
    let costs = CostCurve::from_points(&[(1, 10.0), (2, 10.8), (64, 60.0)], 64).unwrap();
    TreeChoice::Auto(Budget { max_nodes, costs: Some(Arc::new(costs)), fit_to_device: false })
}

#[allow(clippy::too_many_arguments)]
fn sample_runs(model: &Llama, heads: &Drafter, prompt: &[u32], params: &SamplingParams, rule: Rule, tree: TreeChoice, lookup: Option<Lookup>, n: usize) -> Vec<usize> {
    let opts = SpecOptions { tree, lookup, datastore: None, rule, params: params.clone(), stop: StopRule { max_new_tokens: 3, eos_ids: &[] } };
    let mut counts = vec![0usize; 16 * 16 * 16];
    // One thread: this model is tiny, and waking workers for each of its ops costs more than the
    // ops (the results are the same bits either way).
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    pool.install(|| {
        for seed in 0..n as u64 {
            let (out, _) = generate_spec(model, heads, prompt, &opts, &mut rng(seed), &mut |_| Ok(Flow::Continue)).unwrap();
            counts[(out[0] as usize * 16 + out[1] as usize) * 16 + out[2] as usize] += 1;
        }
    });
    counts
}

#[test]
fn speculative_sampling_matches_the_target_distribution() {
    let (model, heads) = tiny16();
    let prompt = [3u32, 7, 1, 3];
    let n = 20_000;
    for params in [
        SamplingParams { temperature: 1.0, ..Default::default() },
        SamplingParams { temperature: 0.8, repetition_penalty: 1.8, presence_penalty: 0.4, ..Default::default() },
    ] {
        let exact = exact_joint(&model, &prompt, &params);
        assert!((exact.iter().sum::<f64>() - 1.0).abs() < 1e-9);
        let counts = sample_runs(&model, &heads, &prompt, &params, Rule::Sample, test_tree(), None, n);
        let p = chi_square_p(&counts, &exact, n);
        assert!(p >= 0.001, "exact rule rejected: p = {p} for {params:?}");
        // With a branch copied from the context grafted on (the prompt's last token 3 also opens
        // it, so the copy 7 1 3 is always proposed): still the target's distribution.
        let lookup = Lookup { max_tokens: 3, min_match: 1, max_match: 2 };
        let counts = sample_runs(&model, &heads, &prompt, &params, Rule::Sample, test_tree(), Some(lookup), n);
        let p = chi_square_p(&counts, &exact, n);
        assert!(p >= 0.001, "exact rule with lookup rejected: p = {p} for {params:?}");
        // A tree cut per step by cost (and by the run's calibration so far): still exact.
        let counts = sample_runs(&model, &heads, &prompt, &params, Rule::Sample, auto_tree(6), Some(lookup), n);
        let p = chi_square_p(&counts, &exact, n);
        assert!(p >= 0.001, "exact rule with an auto tree rejected: p = {p} for {params:?}");
        let broken = sample_runs(&model, &heads, &prompt, &params, Rule::BrokenResampleFromTarget, test_tree(), None, n);
        let pb = chi_square_p(&broken, &exact, n);
        assert!(pb < 0.001, "the test failed to catch a broken rule: p = {pb} for {params:?}");
    }
}

/// The sibling rule is realised by the draw plain sampling makes, so a seed gives plain
/// sampling's very tokens whatever tree was drafted (what lets a server size trees by load).
#[test]
fn seeded_speculative_sampling_emits_plain_samplings_tokens() {
    let (model, heads) = tiny16();
    let prompt = [3u32, 7, 1, 3];
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let lookup = Lookup { max_tokens: 3, min_match: 1, max_match: 2 };
    pool.install(|| {
        for params in [
            SamplingParams { temperature: 1.0, ..Default::default() },
            SamplingParams { temperature: 0.7, top_p: 0.9, frequency_penalty: 0.3, ..Default::default() },
        ] {
            let stop = StopRule { max_new_tokens: 12, eos_ids: &[] };
            let mut drafted = 0;
            for seed in 0..200u64 {
                let (plain, _) = generate_plain(&model, &prompt, &params, &stop, &mut rng(seed), &mut |_| Ok(Flow::Continue)).unwrap();
                for (tree, lk) in [(test_tree(), None), (auto_tree(6), Some(lookup)), (TreeChoice::Static(Tree::chain(2)), None)] {
                    let opts = SpecOptions { tree, lookup: lk, datastore: None, rule: Rule::Sample, params: params.clone(), stop: StopRule { max_new_tokens: 12, eos_ids: &[] } };
                    let (spec, stats) = generate_spec(&model, &heads, &prompt, &opts, &mut rng(seed), &mut |_| Ok(Flow::Continue)).unwrap();
                    assert_eq!(spec, plain, "seed {seed}, {params:?}");
                    drafted += stats.drafted.iter().filter(|&&d| d).count();
                }
            }
            assert!(drafted > 100, "the trees were hardly ever accepted ({drafted} tokens): the test shows nothing");
        }
    });
}

fn committed_heads() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("training/drafters/smollm2-heads")
}

#[test]
fn greedy_self_speculation_is_identical_to_plain_greedy() {
    let t = smollm2();
    let heads = Drafter::Heads(Heads::from_dir(&committed_heads(), &t).unwrap());
    let prompts = selfspec::data::read_prompts(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("training/prompts/eval.jsonl")).unwrap();
    assert!(prompts.len() >= 20);
    let trees = [
        ("chain", Tree::chain(4)),
        ("wide", Tree::from_paths(&(0..10).map(|r| vec![r]).chain([vec![0, 0], vec![1, 0]]).collect::<Vec<_>>()).unwrap()),
        ("deep", Tree::from_paths(&[vec![0], vec![1], vec![0, 0], vec![0, 1], vec![0, 0, 0], vec![0, 0, 1], vec![0, 0, 0, 0], vec![0, 1, 0, 0], vec![0, 1, 0]]).unwrap()),
    ];
    let params = SamplingParams::greedy();
    let mut forwards = [0usize; 3];
    let mut tokens = 0usize;
    for (i, item) in prompts.iter().take(20).enumerate() {
        let ids = t.encode_prompt(&item.turns[0], true).unwrap();
        let stop = StopRule { max_new_tokens: 128, eos_ids: &t.tokenizer.eos_ids };
        let (plain, _) = generate_plain(&t.model, &ids, &params, &stop, &mut rng(0), &mut |_| Ok(Flow::Continue)).unwrap();
        tokens += plain.len();
        for (j, (name, tree)) in trees.iter().enumerate() {
            let opts = SpecOptions { tree: TreeChoice::Static(tree.clone()), lookup: None, datastore: None, rule: Rule::Greedy, params: params.clone(), stop: StopRule { max_new_tokens: 128, eos_ids: &t.tokenizer.eos_ids } };
            let (spec, stats) = generate_spec(&t.model, &heads, &ids, &opts, &mut rng(0), &mut |_| Ok(Flow::Continue)).unwrap();
            assert_eq!(spec, plain, "prompt {i} ({}), tree {name}: self-speculative output differs from plain greedy", item.turns[0]);
            forwards[j] += stats.gen.target_forwards;
        }
    }
    // Not a speed test: just that speculation really ran (fewer forwards than tokens).
    for (j, f) in forwards.iter().enumerate() {
        assert!(*f < tokens, "tree {j}: {f} forwards for {tokens} tokens");
    }
}

/// A callback's `Flow::Stop` ends either decoder right after that token, with its statistics:
/// a speculative step's later accepted tokens are dropped, not emitted.
#[test]
fn a_callback_can_end_the_run_after_any_token() {
    let t = smollm2();
    let heads = Drafter::Heads(Heads::from_dir(&committed_heads(), &t).unwrap());
    let ids = t.encode_prompt("Count from one to twenty in words.", true).unwrap();
    let params = SamplingParams::greedy();
    let stop = StopRule { max_new_tokens: 40, eos_ids: &t.tokenizer.eos_ids };
    let (full, _) = generate_plain(&t.model, &ids, &params, &stop, &mut rng(0), &mut |_| Ok(Flow::Continue)).unwrap();
    assert!(full.len() > 12, "{full:?}");
    let opts = SpecOptions { tree: TreeChoice::Static(Tree::chain(4)), lookup: None, datastore: None, rule: Rule::Greedy, params: params.clone(), stop };
    let (_, whole) = generate_spec(&t.model, &heads, &ids, &opts, &mut rng(0), &mut |_| Ok(Flow::Continue)).unwrap();
    assert!(whole.tau() > 1.0, "the heads must accept several tokens a step for this test to mean anything");
    for k in [1usize, 2, 5, 11] {
        let until = |k: usize| {
            let mut seen = 0;
            move |_| {
                seen += 1;
                Ok(if seen == k { Flow::Stop } else { Flow::Continue })
            }
        };
        let (plain, ps) = generate_plain(&t.model, &ids, &params, &stop, &mut rng(0), &mut until(k)).unwrap();
        assert_eq!((&plain[..], ps.new_tokens), (&full[..k], k), "plain, stopped after {k}");
        let (spec, ss) = generate_spec(&t.model, &heads, &ids, &opts, &mut rng(0), &mut until(k)).unwrap();
        assert_eq!((&spec[..], ss.gen.new_tokens), (&full[..k], k), "self-speculative, stopped after {k}");
        assert!(ss.gen.target_forwards < k.max(2), "{k} tokens in {} forwards", ss.gen.target_forwards);
    }
}

/// The committed draft layer on SmolLM2: static and dynamic trees emit exactly plain greedy
/// decoding, and it really drafts (fewer forwards than tokens).
#[test]
fn greedy_speculation_with_the_committed_draft_layer_is_exact() {
    let t = smollm2();
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("training/drafters/smollm2-layer");
    let drafter = Drafter::from_dir(&dir, &t).unwrap();
    assert_eq!(drafter.kind(), "draft layer");
    let prompts = selfspec::data::read_prompts(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("training/prompts/eval.jsonl")).unwrap();
    let params = SamplingParams::greedy();
    let lookup = Some(Lookup::default());
    let trees = [
        (TreeChoice::Static(Tree::chain(4)), None),
        (TreeChoice::Static(Tree::cpu_default()), None),
        (TreeChoice::Dynamic(10), None),
        (TreeChoice::Static(Tree::chain(2)), lookup),
        (TreeChoice::Dynamic(6), lookup),
        (auto_tree(12), lookup),
    ];
    // The datastore: the target's own answers to distill8's prompts (none of them an eval prompt).
    let ds = selfspec::draft::datastore::Datastore::from_corpus(&t, &[PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("training/data/distill8-smollm2.jsonl")]).unwrap();
    let (mut forwards, mut tokens, mut copied) = (0usize, 0usize, 0usize);
    let (mut copied_ctx, mut copied_ds) = (0usize, 0usize);
    for item in prompts.iter().skip(4).take(6) {
        let ids = t.encode_prompt(&item.turns[0], true).unwrap();
        let stop = StopRule { max_new_tokens: 96, eos_ids: &t.tokenizer.eos_ids };
        let (plain, _) = generate_plain(&t.model, &ids, &params, &stop, &mut rng(0), &mut |_| Ok(Flow::Continue)).unwrap();
        for (tree, lookup) in &trees {
            let opts = SpecOptions { tree: tree.clone(), lookup: *lookup, datastore: None, rule: Rule::Greedy, params: params.clone(), stop: StopRule { max_new_tokens: 96, eos_ids: &t.tokenizer.eos_ids } };
            let (spec, stats) = generate_spec(&t.model, &drafter, &ids, &opts, &mut rng(0), &mut |_| Ok(Flow::Continue)).unwrap();
            assert_eq!(spec, plain, "{:?}, tree {tree:?}, lookup {lookup:?}: output differs from plain greedy", item.turns[0]);
            forwards += stats.gen.target_forwards;
            tokens += plain.len();
            copied += stats.lookup_accepted;
        }
        // The same copied branch with the datastore as a second source: still exact, and it
        // copies more that is accepted.
        for (store, count) in [(None, &mut copied_ctx), (Some(&ds), &mut copied_ds)] {
            let opts = SpecOptions { tree: TreeChoice::Static(Tree::chain(2)), lookup, datastore: store, rule: Rule::Greedy, params: params.clone(), stop: StopRule { max_new_tokens: 96, eos_ids: &t.tokenizer.eos_ids } };
            let (spec, stats) = generate_spec(&t.model, &drafter, &ids, &opts, &mut rng(0), &mut |_| Ok(Flow::Continue)).unwrap();
            assert_eq!(spec, plain, "{:?}, datastore {}: output differs from plain greedy", item.turns[0], store.is_some());
            *count += stats.lookup_accepted;
        }
    }
    assert!(forwards * 5 < tokens * 4, "{forwards} forwards for {tokens} tokens: the layer hardly drafts");
    assert!(copied > 0, "the context lookup never contributed an accepted token");
    assert!(copied_ds > copied_ctx, "the datastore added no accepted copied token ({copied_ds} vs {copied_ctx} from the context alone)");
}

/// The committed EAGLE-3 layer (stored in 4-bit blocks) on SmolLM2 in native weights: attached,
/// it drafts (fewer forwards than tokens) and greedy output stays exactly plain decoding's.
#[test]
fn greedy_speculation_with_the_committed_eagle3_layer_is_exact() {
    let mut t = selfspec::model::loader::Target::load_with(&common::smollm2_path(), &candle_core::Device::Cpu, selfspec::cpu::quant::WeightFormat::Native).unwrap();
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("training/drafters/smollm2-eagle3");
    let drafter = Drafter::from_dir(&dir, &t).unwrap();
    drafter.attach(&mut t).unwrap();
    assert_eq!(t.model.feature_layers(), [2, 15, 27]);
    let prompts = selfspec::data::read_prompts(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("training/prompts/eval.jsonl")).unwrap();
    let params = SamplingParams::greedy();
    let (mut forwards, mut tokens) = (0usize, 0usize);
    for item in prompts.iter().take(3) {
        let ids = t.encode_prompt(&item.turns[0], true).unwrap();
        let stop = || StopRule { max_new_tokens: 64, eos_ids: &t.tokenizer.eos_ids };
        let (plain, _) = generate_plain(&t.model, &ids, &params, &stop(), &mut rng(0), &mut |_| Ok(Flow::Continue)).unwrap();
        for tree in [TreeChoice::Static(Tree::chain(4)), TreeChoice::Dynamic(8)] {
            let opts = SpecOptions { tree: tree.clone(), lookup: None, datastore: None, rule: Rule::Greedy, params: params.clone(), stop: stop() };
            let (spec, stats) = generate_spec(&t.model, &drafter, &ids, &opts, &mut rng(0), &mut |_| Ok(Flow::Continue)).unwrap();
            assert_eq!(spec, plain, "{:?}, tree {tree:?}: output differs from plain greedy", item.turns[0]);
            forwards += stats.gen.target_forwards;
            tokens += plain.len();
        }
    }
    assert!(forwards * 5 < tokens * 4, "{forwards} forwards for {tokens} tokens: the layer hardly drafts");
}

/// `Drafter::for_drafting` reads a 4-bit layer straight into its blocks: the same trees, token
/// for token and score for score, as loading it through f32 and re-packing, for the committed
/// EAGLE-3 layer and an EAGLE layer stored in 4-bit blocks; a block with a NaN scale is refused
/// by name.
#[test]
fn a_four_bit_layer_loaded_straight_into_blocks_drafts_the_same() {
    use selfspec::cpu::quant::WeightFormat;
    use selfspec::draft::layer::StoreFormat;
    let mut t = selfspec::model::loader::Target::load_with(&common::smollm2_path(), &candle_core::Device::Cpu, WeightFormat::Native).unwrap();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("training/drafters");
    // The EAGLE layer is committed in 8-bit blocks (no 4-bit rows: the f32 path loads it); a
    // 4-bit copy of it takes the direct path.
    let eagle_q4 = common::scratch("eagle-layer-q4");
    let Drafter::Layer(full) = Drafter::from_dir_as(&root.join("smollm2-layer"), &t, WeightFormat::F32).unwrap() else { panic!("a draft layer") };
    full.save_as(&eagle_q4, StoreFormat::Q4).unwrap();
    let prompt = t.encode_prompt("Explain how a refrigerator keeps food cold, step by step.", true).unwrap();
    use selfspec::draft::layer::DraftLayer;
    for (dir, direct_path) in [(root.join("smollm2-eagle3"), true), (eagle_q4.clone(), true), (root.join("smollm2-layer"), false)] {
        assert_eq!(DraftLayer::from_dir_packed(&dir, &t, WeightFormat::Native).unwrap().is_some(), direct_path, "{}", dir.display());
        assert!(DraftLayer::from_dir_packed(&dir, &t, WeightFormat::Q8_0).unwrap().is_none(), "8-bit drafting goes the f32 way");
        let (direct, _) = Drafter::for_drafting(&dir, &t, WeightFormat::Native).unwrap();
        let (mut via_f32, _) = Drafter::from_dir_noted(&dir, &t, WeightFormat::Native).unwrap();
        via_f32.release_f32_weights();
        direct.attach(&mut t).unwrap();
        let mut cache = t.model.new_cache().unwrap();
        let hidden = t.model.forward_causal(&prompt, &mut cache).unwrap();
        let (mut a, mut b) = (direct.start(&t.model, &hidden, &prompt, 42).unwrap(), via_f32.start(&t.model, &hidden, &prompt, 42).unwrap());
        for step in 0..3 {
            let choice = TreeChoice::Dynamic(12);
            let (pa, pb) = (a.propose(&t.model, 42, &choice, 4, 64, 0.0).unwrap(), b.propose(&t.model, 42, &choice, 4, 64, 0.0).unwrap());
            assert_eq!((&pa.tokens, &pa.scores, pa.tree.len()), (&pb.tokens, &pb.scores, pb.tree.len()), "{}: step {step}", dir.display());
            assert!(pa.tree.len() > 1, "it drafted");
            // Commit the root and its first child with made-up target states (the same for both).
            let feats = hidden.narrow(0, 0, 2).unwrap();
            a.commit(&t.model, &feats, &[0, 1], &[pa.tokens[1], 7]).unwrap();
            b.commit(&t.model, &feats, &[0, 1], &[pa.tokens[1], 7]).unwrap();
        }
    }
    // A non-finite scale in the stored blocks: refused with the file named, not drafted from.
    let broken = common::scratch("eagle3-nan-scale");
    let src = root.join("smollm2-eagle3");
    std::fs::copy(src.join("draft.json"), broken.join("draft.json")).unwrap();
    let mut ts = candle_core::safetensors::load(src.join("draft.safetensors"), &candle_core::Device::Cpu).unwrap();
    let name = "model.layers.0.mlp.up_proj.weight.q4_1";
    let q = &ts[name];
    let mut bytes: Vec<u8> = q.flatten_all().unwrap().to_vec1().unwrap();
    bytes[40..42].copy_from_slice(&half::f16::NAN.to_le_bytes());
    ts.insert(name.into(), candle_core::Tensor::from_vec(bytes, q.dims(), &candle_core::Device::Cpu).unwrap());
    candle_core::safetensors::save(&ts, broken.join("draft.safetensors")).unwrap();
    let e = Drafter::for_drafting(&broken, &t, WeightFormat::Native).err().expect("refused").to_string();
    assert!(e.contains("draft.safetensors") && e.contains("up_proj") && e.contains("non-finite"), "{e}");
}

#[test]
fn a_draft_layer_without_its_f32_weights_drafts_the_same() {
    let t = selfspec::model::loader::Target::load_with(&common::smollm2_path(), &candle_core::Device::Cpu, selfspec::cpu::quant::WeightFormat::Native).unwrap();
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("training/drafters/smollm2-layer");
    let kept = Drafter::from_dir(&dir, &t).unwrap();
    let mut released = Drafter::from_dir(&dir, &t).unwrap();
    released.release_f32_weights();
    let ids = t.encode_prompt("Write a short poem about the sea.", true).unwrap();
    let params = SamplingParams::greedy();
    let opts = SpecOptions { tree: TreeChoice::Static(Tree::cpu_default()), lookup: None, datastore: None, rule: Rule::Greedy, params, stop: StopRule { max_new_tokens: 48, eos_ids: &t.tokenizer.eos_ids } };
    let (a, sa) = generate_spec(&t.model, &kept, &ids, &opts, &mut rng(0), &mut |_| Ok(Flow::Continue)).unwrap();
    let (b, sb) = generate_spec(&t.model, &released, &ids, &opts, &mut rng(0), &mut |_| Ok(Flow::Continue)).unwrap();
    assert_eq!(a, b);
    // The same drafts: the same number of forwards for the same text.
    assert_eq!(sa.gen.target_forwards, sb.gen.target_forwards);
    let Drafter::Layer(l) = &mut released else { panic!("a draft layer") };
    assert!(l.weights().is_err(), "the f32 weights are gone and say so");
    assert!(l.set_format(selfspec::cpu::quant::WeightFormat::Q8_0).is_err());
    assert!(l.save_as(&common::scratch("released-layer"), selfspec::draft::layer::StoreFormat::F32).is_err());
}

/// A sequence stepped from outside may skip drafting on some steps (the server does under
/// load): the drafter catches up on the skipped tokens in one call when drafting resumes, the
/// output stays plain greedy decoding's, and its drafts after a gap are as good as without gaps.
#[test]
fn a_sequence_that_skips_drafting_on_some_steps_catches_up_and_stays_exact() {
    use selfspec::spec::Sequence;
    let t = smollm2();
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("training/drafters/smollm2-layer");
    let drafter = Drafter::from_dir(&dir, &t).unwrap();
    let prompts = selfspec::data::read_prompts(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("training/prompts/eval.jsonl")).unwrap();
    let params = SamplingParams::greedy();
    // Gaps: none, one step in three drafting, and a long spell without drafting (more steps
    // than the drafter catches up on) before drafting resumes.
    let mut hits = [0usize; 3];
    let mut steps = [0usize; 3];
    for item in prompts.iter().take(4) {
        let ids = t.encode_prompt(&item.turns[0], true).unwrap();
        let stop = StopRule { max_new_tokens: 80, eos_ids: &t.tokenizer.eos_ids };
        let (plain, _) = generate_plain(&t.model, &ids, &params, &stop, &mut rng(0), &mut |_| Ok(Flow::Continue)).unwrap();
        for gaps in 0..3 {
            let opts = SpecOptions { tree: TreeChoice::Static(Tree::chain(3)), lookup: None, datastore: None, rule: Rule::Greedy, params: params.clone(), stop };
            let mut seq = Sequence::new(&t.model, Some(&drafter), &ids, opts, rng(0)).unwrap();
            let mut step = 0;
            let long_gap = selfspec::spec::session::LAG_KEEP + 8;
            let draft_now = |step: usize| match gaps {
                0 => true,
                1 => step % 3 == 0,
                _ => step == 0 || step > long_gap,
            };
            while let Some(work) = seq.next_work(&t.model, usize::MAX, draft_now(step)).unwrap() {
                let drafted = work.tokens().len() > 1;
                let last = work.tokens().len() >= seq.prompt_left();
                let hidden = t.model.forward(work.tokens(), work.positions(), work.mask(), seq.cache_mut()).unwrap();
                let r = work.logit_rows(last);
                let logits = (!r.is_empty()).then(|| t.model.logits(&hidden.narrow(0, r.start, r.len()).unwrap()).unwrap());
                let n = work.tokens().len();
                let emitted = seq.finish_work(&t.model, work, hidden, logits, n, 1.0, &mut |_, _| Ok(Flow::Continue)).unwrap();
                if drafted {
                    hits[gaps] += emitted - 1;
                    steps[gaps] += 1;
                }
                step += 1;
            }
            let (out, _, _) = seq.finish();
            assert_eq!(out, plain, "{:?}, gaps {gaps}", item.turns[0]);
        }
    }
    let [full, gappy, long] = [0, 1, 2].map(|g| hits[g] as f64 / steps[g] as f64);
    assert!(gappy > 0.7 * full && gappy > 0.5, "accepted per drafting step: {gappy:.2} after gaps, {full:.2} without");
    assert!(long > 0.7 * full && long > 0.5, "accepted per drafting step: {long:.2} after a long gap, {full:.2} without");
}

/// Gemma 3's sliding-window layers under speculation: sequences run well past the 128-position
/// window, trees and KV compaction clip each node's window by its own path, and greedy output
/// stays plain decoding's (which the tree rows reproduce bit for bit).
#[test]
fn greedy_speculation_is_exact_past_a_sliding_window() {
    let (model, heads) = tiny16_of(selfspec::model::fixtures::tiny_gemma3_config());
    assert_eq!(model.config().sliding_window, Some(128));
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    pool.install(|| {
        let mut drafted = 0;
        for seed in 0..6u64 {
            let prompt: Vec<u32> = (0..100 + 10 * seed as usize).map(|i| ((i as u64 * 7 + seed) % 16) as u32).collect();
            let stop = StopRule { max_new_tokens: 120, eos_ids: &[] };
            let (plain, _) = generate_plain(&model, &prompt, &SamplingParams::greedy(), &stop, &mut rng(0), &mut |_| Ok(Flow::Continue)).unwrap();
            for tree in [test_tree(), TreeChoice::Static(Tree::chain(2)), auto_tree(6)] {
                let opts = SpecOptions { tree, lookup: Some(Lookup { max_tokens: 3, min_match: 1, max_match: 2 }), datastore: None, rule: Rule::Greedy, params: SamplingParams::greedy(), stop };
                let (spec, stats) = generate_spec(&model, &heads, &prompt, &opts, &mut rng(0), &mut |_| Ok(Flow::Continue)).unwrap();
                assert_eq!(spec, plain, "seed {seed}");
                drafted += stats.drafted.iter().filter(|&&d| d).count();
            }
        }
        assert!(drafted > 100, "hardly anything was drafted ({drafted}): the test shows nothing");
    });
}

/// Every family's tiny model under speculation, as the Llama-family tests above check one:
/// Qwen2's biases, Qwen3's q/k norms, Llama 3.1's rope scaling and Gemma 3's norms, GELU and
/// scaled embeddings. Greedy output equals plain greedy decoding's, and sampling with the
/// sibling rule draws the target's joint distribution of three tokens (chi-square), while the
/// broken rule is caught.
#[test]
fn every_family_speculates_exactly() {
    use selfspec::model::fixtures::{tiny_config, tiny_gemma3_config};
    let base = tiny_config();
    let mut qwen2 = base.clone();
    qwen2.architecture = "qwen2".into();
    qwen2.attention_bias = true;
    let mut qwen3 = base.clone();
    qwen3.architecture = "qwen3".into();
    qwen3.qk_norm = true;
    let mut llama3 = base.clone();
    llama3.rope_scaling = Some(selfspec::model::RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 8 });
    for (name, cfg) in [("qwen2", qwen2), ("qwen3", qwen3), ("llama3", llama3), ("gemma3", tiny_gemma3_config())] {
        let (model, heads) = tiny16_of(cfg);
        let greedy = SamplingParams::greedy();
        for prompt in [vec![3u32, 7, 1, 3], vec![1, 2, 3, 4, 5, 6, 7, 8, 9], vec![0, 0, 15]] {
            let stop = || StopRule { max_new_tokens: 48, eos_ids: &[] };
            let (plain, _) = generate_plain(&model, &prompt, &greedy, &stop(), &mut rng(0), &mut |_| Ok(Flow::Continue)).unwrap();
            for tree in [test_tree(), auto_tree(6)] {
                let opts = SpecOptions { tree, lookup: None, datastore: None, rule: Rule::Greedy, params: greedy.clone(), stop: stop() };
                let (spec, _) = generate_spec(&model, &heads, &prompt, &opts, &mut rng(0), &mut |_| Ok(Flow::Continue)).unwrap();
                assert_eq!(spec, plain, "{name}: speculative greedy output differs from plain for {prompt:?}");
            }
        }
        let prompt = [3u32, 7, 1, 3];
        let n = 20_000;
        let params = SamplingParams { temperature: 0.8, repetition_penalty: 1.5, ..Default::default() };
        let exact = exact_joint(&model, &prompt, &params);
        let counts = sample_runs(&model, &heads, &prompt, &params, Rule::Sample, test_tree(), None, n);
        let p = chi_square_p(&counts, &exact, n);
        assert!(p >= 0.001, "{name}: exact rule rejected: p = {p}");
        let broken = sample_runs(&model, &heads, &prompt, &params, Rule::BrokenResampleFromTarget, test_tree(), None, n);
        let pb = chi_square_p(&broken, &exact, n);
        assert!(pb < 0.001, "{name}: the test failed to catch a broken rule: p = {pb}");
    }
}

/// Log-probabilities come from the rows verification read: with a drafter (static and `auto`
/// trees, greedy and seeded sampling) they are bit for bit those of plain decoding, and they are
/// the raw log-softmax of a causal forward over the same tokens (to rounding: that forward
/// runs the rows in other chunks).
#[test]
fn logprobs_with_a_drafter_are_plain_decodings_bit_for_bit() {
    use selfspec::decode::sampling::{token_logprobs, TokenLogprobs};
    use selfspec::spec::Sequence;
    let t = smollm2();
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("training/drafters/smollm2-eagle3");
    let mut target = t;
    let drafter = Drafter::from_dir(&dir, &target).unwrap();
    drafter.attach(&mut target).unwrap();
    let t = target;
    let run = |drafter: Option<&Drafter>, tree: TreeChoice, params: &SamplingParams, ids: &[u32]| -> (Vec<u32>, Vec<TokenLogprobs>, usize) {
        let stop = StopRule { max_new_tokens: 40, eos_ids: &t.tokenizer.eos_ids };
        let opts = SpecOptions { tree, lookup: None, datastore: None, rule: Rule::for_params(params, false), params: params.clone(), stop };
        let mut seq = Sequence::new(&t.model, drafter, ids, opts, rng(9)).unwrap().with_logprobs(3);
        let forwards = run_alone(&t.model, &mut seq);
        let lps = seq.logprobs().to_vec();
        let (out, _, _) = seq.finish();
        assert_eq!(lps.len(), out.len());
        (out, lps, forwards)
    };
    let sampled = SamplingParams { temperature: 0.9, top_p: 0.95, ..Default::default() };
    let ids = t.encode_prompt("Name three rivers in Europe.", true).unwrap();
    let mut saved = 0;
    for params in [SamplingParams::greedy(), sampled] {
        let (plain, plain_lps, plain_forwards) = run(None, TreeChoice::Static(Tree::chain(1)), &params, &ids);
        for tree in [TreeChoice::Static(Tree::chain(3)), drafter.resolve(&TreeChoice::parse("auto").unwrap())] {
            let (out, lps, forwards) = run(Some(&drafter), tree, &params, &ids);
            assert_eq!(out, plain);
            assert_eq!(lps, plain_lps, "log-probabilities differ with a drafter");
            saved += plain_forwards - forwards;
        }
        for (lp, &tok) in plain_lps.iter().zip(&plain) {
            assert_eq!(lp.token, tok);
            assert!(lp.top.len() == 3 && lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
            if params.is_greedy() {
                assert_eq!(lp.top[0], (tok, lp.logprob), "greedy picks the likeliest");
            }
        }
        // One causal forward over prompt and answer: its rows' log-softmax, to rounding.
        let all: Vec<u32> = ids.iter().chain(&plain[..plain.len() - 1]).copied().collect();
        let mut cache = t.model.new_cache().unwrap();
        let hidden = t.model.forward_causal(&all, &mut cache).unwrap();
        let logits = t.model.logits(&hidden.narrow(0, ids.len() - 1, plain.len()).unwrap()).unwrap();
        for (i, lp) in plain_lps.iter().enumerate() {
            let want = token_logprobs(&row_to_vec(&logits, i).unwrap(), plain[i], 3);
            assert!((want.logprob - lp.logprob).abs() < 0.02, "token {i}: {} vs {}", lp.logprob, want.logprob);
        }
    }
    assert!(saved > 10, "the drafter saved only {saved} forwards: the test shows little");
}

/// A sequence resumed from a finished one's kept prefix (its K/V copied, the drafter restarted
/// from the kept target states) emits what a fresh sequence on the same prompt emits, with the
/// same log-probabilities and the same number of forwards; wrong uses are refused.
#[test]
fn a_sequence_resumed_from_a_kept_prefix_is_a_fresh_one_bit_for_bit() {
    use selfspec::spec::Sequence;
    let mut target = smollm2();
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("training/drafters/smollm2-eagle3");
    let drafter = Drafter::from_dir(&dir, &target).unwrap();
    drafter.attach(&mut target).unwrap();
    let t = target;
    let sampled = SamplingParams { temperature: 0.9, top_p: 0.95, ..Default::default() };
    let seq = |ids: &[u32], params: &SamplingParams| {
        let stop = StopRule { max_new_tokens: 32, eos_ids: &t.tokenizer.eos_ids };
        let opts = SpecOptions { tree: TreeChoice::Static(Tree::chain(3)), lookup: None, datastore: None, rule: Rule::for_params(params, false), params: params.clone(), stop };
        Sequence::new(&t.model, Some(&drafter), ids, opts, rng(3)).unwrap()
    };
    let first = t.encode_prompt("Name three rivers in Europe.", true).unwrap();
    let mut a = seq(&first, &SamplingParams::greedy()).keeping_prefix();
    run_alone(&t.model, &mut a);
    let (out, _, _, prefix) = a.finish_keeping_prefix();
    let prefix = prefix.expect("a finished sequence with its states kept leaves a prefix");
    // Every token whose K/V ran: all but the last, or all when the last step stopped partway.
    assert!((first.len() + out.len() - 1..=first.len() + out.len()).contains(&prefix.tokens().len()));
    assert!(prefix.states().is_some());
    assert!(prefix.draft().is_some_and(|d| d.len() > first.len()), "the draft layer's pairs are kept too");
    // The next turn: the first prompt, its answer and more.
    let follow = t.encode_prompt(" And which is the longest?", false).unwrap();
    let second: Vec<u32> = first.iter().chain(&out).chain(&follow).copied().collect();
    let n = prefix.usable(&second);
    assert_eq!(n, prefix.tokens().len());
    // One step of a sequence run alone: the drafted tree's tokens (none for a prompt chunk).
    let step = |s: &mut Sequence| -> Option<Vec<u32>> {
        let work = s.next_work(&t.model, usize::MAX, true).unwrap()?;
        let tree = matches!(work, selfspec::spec::Work::Tree { .. }).then(|| work.tokens().to_vec()).unwrap_or_default();
        let last = work.tokens().len() >= s.prompt_left();
        let hidden = t.model.forward(work.tokens(), work.positions(), work.mask(), s.cache_mut()).unwrap();
        let r = work.logit_rows(last);
        let logits = (!r.is_empty()).then(|| t.model.logits(&hidden.narrow(0, r.start, r.len()).unwrap()).unwrap());
        let rows = work.tokens().len();
        s.finish_work(&t.model, work, hidden, logits, rows, 1.0, &mut |_, _| Ok(selfspec::Flow::Continue)).unwrap();
        Some(tree)
    };
    for params in [SamplingParams::greedy(), sampled] {
        let mut fresh = seq(&second, &params).with_logprobs(2);
        let mut resumed = seq(&second, &params).with_logprobs(2).resume_from(&prefix, n).unwrap();
        // In step: each drafted tree the same, so the drafter resumed in the state a fresh
        // prefill leaves it in.
        let mut trees = 0;
        loop {
            let (a, b) = (step(&mut fresh), step(&mut resumed));
            assert_eq!(a, b, "step {trees}: the drafter drafted differently after resuming");
            if a.is_none() {
                break;
            }
            trees += a.is_some_and(|t| t.len() > 1) as usize;
        }
        assert!(trees > 5, "{trees} drafted trees");
        assert_eq!(resumed.output(), fresh.output());
        assert_eq!(resumed.logprobs(), fresh.logprobs());
        assert_eq!((resumed.stats().cached_prompt_tokens, fresh.stats().cached_prompt_tokens), (n, 0));
    }
    // A prompt that shares fewer tokens than the prefix holds pairs for: the pair before the
    // split read the prefix's next token, not this prompt's, and must not be taken.
    let draft_pairs = prefix.draft().unwrap().len();
    let other: Vec<u32> = first.iter().chain(&out[..4]).chain(&follow).copied().collect();
    let j = prefix.usable(&other);
    assert!(j < draft_pairs && out[4] != follow[0], "{j} shared, {draft_pairs} pairs");
    let mut fresh = seq(&other, &SamplingParams::greedy());
    let mut resumed = seq(&other, &SamplingParams::greedy()).resume_from(&prefix, j).unwrap();
    let mut steps = 0;
    loop {
        let (a, b) = (step(&mut fresh), step(&mut resumed));
        assert_eq!(a, b, "step {steps} after a {j}-token resume: the drafter drafted differently");
        steps += 1;
        if a.is_none() {
            break;
        }
    }
    // Refused: more than the prefix covers, prompt log-probabilities, a started sequence, and a
    // drafter's sequence from a prefix without states.
    assert!(seq(&second, &SamplingParams::greedy()).resume_from(&prefix, n + 1).is_err());
    assert!(seq(&second, &SamplingParams::greedy()).with_prompt_logprobs(1).resume_from(&prefix, n).is_err());
    let mut started = seq(&second, &SamplingParams::greedy());
    let w = started.next_work(&t.model, 8, true).unwrap().unwrap();
    let hidden = t.model.forward(w.tokens(), w.positions(), w.mask(), started.cache_mut()).unwrap();
    started.finish_work(&t.model, w, hidden, None, 8, 1.0, &mut |_, _| Ok(selfspec::Flow::Continue)).unwrap();
    assert!(started.resume_from(&prefix, 4).is_err());
    let mut plain = Sequence::new(&t.model, None, &first, SpecOptions { tree: TreeChoice::Static(Tree::chain(1)), lookup: None, datastore: None, rule: Rule::Greedy, params: SamplingParams::greedy(), stop: StopRule { max_new_tokens: 4, eos_ids: &[] } }, rng(0)).unwrap();
    run_alone(&t.model, &mut plain);
    let (_, _, _, bare) = plain.finish_keeping_prefix();
    let bare = bare.expect("plain decoding keeps its cache without states");
    assert!(bare.states().is_none());
    assert!(seq(&second, &SamplingParams::greedy()).resume_from(&bare, 4).is_err());
}

/// A conversation's second turn, decoded from the first turn's cache, is what a fresh
/// sequence over the whole conversation gives; `reset` forgets the turns and the cache.
#[test]
fn a_conversations_next_turn_is_the_whole_conversation_decoded_afresh() {
    use selfspec::model::tokenizer::Message;
    use selfspec::spec::{Conversation, Sequence};
    let mut target = smollm2();
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("training/drafters/smollm2-eagle3");
    let drafter = Drafter::from_dir(&dir, &target).unwrap();
    drafter.attach(&mut target).unwrap();
    let t = target;
    let params = SamplingParams { temperature: 0.7, ..Default::default() };
    let stop = StopRule { max_new_tokens: 32, eos_ids: &t.tokenizer.eos_ids };
    let opts = SpecOptions { tree: TreeChoice::Static(Tree::chain(3)), lookup: None, datastore: None, rule: Rule::for_params(&params, false), params: params.clone(), stop };
    let mut convo = Conversation::new(Some(&drafter), Some("You are brief.".into()));
    let mut r = rng(11);
    let mut seen = Vec::new();
    let first = convo.reply(&t, "Name a river in Europe.", &opts, &mut r, &mut |tok| {
        seen.push(tok);
        Ok(selfspec::Flow::Continue)
    }).unwrap();
    assert_eq!(seen, first.tokens);
    assert_eq!(first.stats.cached_prompt_tokens, 0);
    let r_before = r.clone();
    let second = convo.reply(&t, "How long is it?", &opts, &mut r, &mut |_| Ok(selfspec::Flow::Continue)).unwrap();
    assert!(second.stats.cached_prompt_tokens > first.stats.gen.prompt_tokens, "the first turn came from the cache");
    let msgs = convo.messages();
    assert_eq!(msgs.len(), 5);
    assert_eq!((msgs[0].role.as_str(), msgs[2].content.as_str(), msgs[4].content.as_str()), ("system", first.text.as_str(), second.text.as_str()));
    // Afresh: the system message, the first exchange and the second message, decoded with the
    // generator as it stood before the second turn.
    let ids = t.prompt_ids(&msgs[..4]).unwrap();
    let mut fresh = Sequence::new(&t.model, Some(&drafter), &ids, opts.clone(), r_before).unwrap();
    run_alone(&t.model, &mut fresh);
    assert_eq!(fresh.output(), &second.tokens[..]);
    convo.reset();
    assert_eq!(convo.messages().len(), 1, "the system message stays");
    let again = convo.reply(&t, "Name a river in Europe.", &opts, &mut rng(11), &mut |_| Ok(selfspec::Flow::Continue)).unwrap();
    assert_eq!((again.tokens, again.stats.cached_prompt_tokens), (first.tokens, 0));
}
