//! The EAGLE-style draft layer: its training forward (differentiable ops, training-time test)
//! computes what the inference forward computes; drafting with it keeps greedy output exactly
//! the target's; training lowers the loss, resumes exactly, and files round-trip and refuse
//! other targets.
mod common;

use std::collections::HashMap;

use candle_core::{Device, Tensor};
use candle_nn::VarMap;
use common::*;
use selfspec::draft::layer::StoreFormat;
use selfspec::draft::layer::{DraftLayer, DraftLayerConfig, TrainLayer};
use selfspec::draft::drafter::Drafter;
use selfspec::decode::generate::{generate_plain, Flow, StopRule};
use selfspec::cpu::TreeMask;
use selfspec::decode::sampling::{rng, SamplingParams};
use selfspec::draft::choice::TreeChoice;
use selfspec::spec::{generate_spec, SpecOptions};
use selfspec::train::TrainConfig;
use selfspec::train::layer::train_layer;
use selfspec::draft::tree::Tree;
use selfspec::spec::verify::Rule;

fn to_vec(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

/// A random (untrained) layer for `t`, over its whole vocabulary.
fn random_layer(t: &selfspec::model::loader::Target, seed: u64) -> (TrainLayer, Vec<u32>) {
    let vocab = t.model.config().vocab_size;
    let ids: Vec<u32> = (0..vocab as u32).collect();
    let cfg = DraftLayerConfig::for_target(t, vocab).unwrap();
    let layer = TrainLayer::init(&VarMap::new(), cfg, &ids, &t.model, seed).unwrap();
    (layer, ids)
}

#[test]
fn training_forward_matches_inference_forward() {
    let (_, t) = tiny_gguf("layer-fwd", 31);
    let (train, ids) = random_layer(&t, 5);
    let layer = DraftLayer::from_tensors(train.tensors().unwrap(), ids, train.cfg.clone(), &t.model).unwrap();
    let toks: Vec<u32> = (0..24u32).map(|i| (i * 7 + 3) % t.model.config().vocab_size as u32).collect();
    // Three steps of training-time test in one differentiable forward.
    check_layer_forwards_agree(&t, &train, &layer, &toks, 3);
}

#[test]
fn drafting_with_a_layer_keeps_greedy_output_exact() {
    let (_, t) = tiny_gguf("layer-exact", 32);
    let (train, ids) = random_layer(&t, 6);
    let layer = DraftLayer::from_tensors(train.tensors().unwrap(), ids, train.cfg.clone(), &t.model).unwrap();
    let drafter = Drafter::Layer(layer);
    let params = SamplingParams::greedy();
    let trees = [
        TreeChoice::Static(Tree::chain(4)),
        TreeChoice::Static(Tree::from_paths(&[vec![0], vec![1], vec![2], vec![0, 0], vec![0, 1], vec![1, 0], vec![0, 0, 0]]).unwrap()),
        TreeChoice::Dynamic(6),
        TreeChoice::Dynamic(12),
    ];
    // The last prompt ends 12 tokens before the 512-token context: the output is cut there, and
    // the deeper trees' levels stop fitting in the layer's cache on the way.
    let ctx = t.model.config().max_position as u32;
    let near_end: Vec<u32> = (0..ctx - 12).map(|i| (i * 7 + 1) % 200).collect();
    for (p, prompt) in [vec![1u32, 5, 9, 2], vec![3u32; 9], (0..40u32).collect::<Vec<_>>(), near_end].iter().enumerate() {
        let stop = StopRule { max_new_tokens: 40, eos_ids: &[] };
        let (plain, _) = generate_plain(&t.model, prompt, &params, &stop, &mut rng(0), &mut |_| Ok(Flow::Continue)).unwrap();
        for tree in &trees {
            let opts = SpecOptions { tree: tree.clone(), lookup: None, datastore: None, rule: Rule::Greedy, params: params.clone(), stop: StopRule { max_new_tokens: 40, eos_ids: &[] } };
            let (out, stats) = generate_spec(&t.model, &drafter, prompt, &opts, &mut rng(0), &mut |_| Ok(Flow::Continue)).unwrap();
            assert_eq!(out, plain, "prompt {p}, tree {tree:?}");
            assert!(stats.gen.target_forwards <= plain.len());
        }
    }
    // A tree deeper than the layer may draft is refused up front.
    let too_deep = TreeChoice::Static(Tree::chain(selfspec::draft::drafter::LAYER_MAX_DEPTH + 1));
    assert!(drafter.validate_tree(&too_deep).is_err());
}

/// A draft layer trained on a model whose FFN width is not a whole number of 32-value blocks
/// (stories260K's is 172) loads with the default drafting format, falling back to f16 and
/// saying so, and bare `chain` drafts as deep as the layer goes; greedy output stays exact.
#[test]
fn odd_widths_fall_back_to_f16_and_bare_chain_is_full_depth() {
    let dir = scratch("layer-odd");
    let cfg = selfspec::model::Config { intermediate_size: 44, ..selfspec::model::fixtures::tiny_config() };
    let w = selfspec::model::fixtures::random_weights(&cfg, 8).unwrap();
    let p = dir.join("odd.gguf");
    selfspec::model::fixtures::write_gguf(&p, &cfg, &w).unwrap();
    let t = selfspec::model::loader::Target::load(&p, &candle_core::Device::Cpu).unwrap();
    let out = dir.join("layer");
    let (layer, _) = run(&t, &TrainConfig { max_steps: 2, ..quick_cfg() }, &out, false);
    layer.save_as(&out, selfspec::draft::layer::StoreFormat::F32).unwrap();
    let (drafter, note) = Drafter::from_dir_noted(&out, &t, selfspec::draft::drafter::DRAFTING_FORMAT).unwrap();
    let note = note.expect("the fallback is said");
    assert!(note.contains("f16") && note.contains("native"), "{note}");
    let (_, none) = Drafter::from_dir_noted(&out, &t, selfspec::cpu::quant::WeightFormat::F32).unwrap();
    assert!(none.is_none());
    let params = SamplingParams::greedy();
    let prompt = [1u32, 5, 9, 2, 7];
    let stop = || StopRule { max_new_tokens: 24, eos_ids: &[] };
    let (plain, _) = generate_plain(&t.model, &prompt, &params, &stop(), &mut rng(0), &mut |_| Ok(Flow::Continue)).unwrap();
    let opts = SpecOptions { tree: TreeChoice::parse("chain").unwrap(), lookup: None, datastore: None, rule: Rule::Greedy, params: params.clone(), stop: stop() };
    let (spec, stats) = generate_spec(&t.model, &drafter, &prompt, &opts, &mut rng(0), &mut |_| Ok(Flow::Continue)).unwrap();
    assert_eq!(spec, plain);
    // Bare `chain` once meant 4 levels (5 nodes a step); now one node per level the layer drafts.
    let steps: usize = stats.accept_hist.iter().sum();
    assert!(steps > 0 && stats.tree_nodes_total > 5 * steps, "{} nodes over {steps} steps", stats.tree_nodes_total);
    // A shorter context written in draft.json (a checkpoint's training length, or a bad value)
    // is the target's once loaded: generation past it runs on instead of failing midway.
    let cfg_path = out.join("draft.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    v["layer"]["max_position"] = serde_json::json!(1);
    std::fs::write(&cfg_path, v.to_string()).unwrap();
    let short = Drafter::from_dir(&out, &t).unwrap();
    let (spec, _) = generate_spec(&t.model, &short, &prompt, &opts, &mut rng(0), &mut |_| Ok(Flow::Continue)).unwrap();
    assert_eq!(spec, plain);
}

/// `--widen-vocab`: a layer trained over a few tokens, trained on with more; the old tokens stay,
/// the data's most frequent others join (in id order), and a smaller size or no `--init` is refused.
#[test]
fn widening_the_vocabulary_keeps_the_old_tokens_and_adds_the_datas() {
    let (_, t) = tiny_gguf("layer-widen", 33);
    let first = scratch("layer-widen-a");
    let (small, _) = run(&t, &TrainConfig { draft_vocab: 12, max_steps: 2, ..quick_cfg() }, &first, false);
    small.save_as(&first, StoreFormat::F32).unwrap();
    let (wide, _) = run(&t, &TrainConfig { init: Some(first.clone()), widen_vocab: 20, max_steps: 1, ..quick_cfg() }, &scratch("layer-widen-b"), false);
    let (old, new) = (small.draft_vocab(), wide.draft_vocab());
    assert_eq!((old.len(), new.len()), (12, 20));
    assert!(old.iter().all(|x| new.contains(x)) && new.windows(2).all(|w| w[0] < w[1]), "{old:?} -> {new:?}");
    let e = train_layer(&t, &corpus(), &TrainConfig { init: Some(first.clone()), widen_vocab: 8, ..quick_cfg() }, &scratch("layer-widen-c"), false, None, &mut |_, _, _, _, _| {}, &mut |_| {})
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("already has 12"), "{e}");
    assert!(TrainConfig { widen_vocab: 20, ..quick_cfg() }.validate().is_err());
    assert!(TrainConfig { draft_layer: false, init: Some(first), widen_vocab: 20, ..quick_cfg() }.validate().is_err(), "heads are refused");
}


fn quick_cfg() -> TrainConfig {
    TrainConfig {
        draft_layer: true,
        unroll: 2,
        epochs: 3,
        lr: 3e-3,
        warmup_steps: 2,
        seq_len: 64,
        batch_tokens: 128,
        val_fraction: 0.2,
        checkpoint_every: 2,
        draft_vocab: 64,
        ..Default::default()
    }
}

fn run(t: &selfspec::model::loader::Target, cfg: &TrainConfig, out: &std::path::Path, resume: bool) -> (DraftLayer, selfspec::train::TrainReport) {
    train_layer(t, &corpus(), cfg, out, resume, None, &mut |_, _, _, _, _| {}, &mut |_| {}).unwrap()
}

fn saved(l: &DraftLayer, dir: &std::path::Path) -> Vec<(String, Vec<f32>)> {
    l.save_as(dir, StoreFormat::F32).unwrap();
    let m: HashMap<String, Tensor> = candle_core::safetensors::load(dir.join("draft.safetensors"), &Device::Cpu).unwrap();
    let mut v: Vec<(String, Vec<f32>)> = m.into_iter().map(|(k, t)| (k, to_vec(&t))).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[test]
fn layer_training_learns_resumes_and_round_trips() {
    let (_, t) = tiny_gguf("layer-train", 33);
    let before = to_vec(t.model.lm_head().weight().unwrap());
    let (full, rep) = run(&t, &quick_cfg(), &scratch("layer-train-full"), false);
    let n = rep.losses.len();
    assert!(n >= 6, "{n} steps");
    let first: f64 = rep.losses[..3].iter().sum::<f64>() / 3.0;
    let last: f64 = rep.losses[n - 3..].iter().sum::<f64>() / 3.0;
    assert!(last < first * 0.9, "loss {first} -> {last}");
    assert_eq!(before, to_vec(t.model.lm_head().weight().unwrap()), "the backbone changed during training");
    assert_eq!(rep.val[0].top1.len(), selfspec::train::layer::VAL_LEVELS);

    // Killed half way and resumed: the same weights as the uninterrupted run.
    let part = scratch("layer-train-part");
    let (_, p) = run(&t, &TrainConfig { max_steps: n / 2, ..quick_cfg() }, &part, false);
    assert_eq!(p.steps, n / 2);
    let (resumed, _) = run(&t, &quick_cfg(), &part, true);
    assert_eq!(saved(&full, &scratch("layer-w-full")), saved(&resumed, &scratch("layer-w-resumed")), "resumed weights differ");
    // Resuming with another number of gradient groups would change the sums: refused.
    let e = train_layer(&t, &corpus(), &TrainConfig { grad_groups: 1, ..quick_cfg() }, &part, true, None, &mut |_, _, _, _, _| {}, &mut |_| {}).err().expect("other groups resume");
    assert!(e.to_string().contains("other training settings (grad_groups: checkpoint 2, this run 1)"), "{e}");

    // States kept in the disk cache and read per batch: the very same run.
    let cache = scratch("layer-train-states");
    let (_, cached) = train_layer(&t, &corpus(), &quick_cfg(), &scratch("layer-train-cached"), false, Some(cache.as_path()), &mut |_, _, _, _, _| {}, &mut |_| {}).unwrap();
    assert_eq!(cached.losses, rep.losses);
    assert!(std::fs::read_dir(&cache).unwrap().count() > 0, "no states were cached");

    // The groups are a split of the same batch: one pass gives the same losses up to rounding.
    assert_eq!(quick_cfg().grad_groups, 2);
    let (_, one) = run(&t, &TrainConfig { grad_groups: 1, ..quick_cfg() }, &scratch("layer-train-one-group"), false);
    assert_eq!(one.losses.len(), n);
    for (a, b) in one.losses.iter().zip(&rep.losses) {
        assert!((a - b).abs() <= 1e-3 * a.abs().max(1.0), "one group {:?} vs two {:?}", one.losses, rep.losses);
    }

    // Files round-trip to the same drafts, through the directory loader that picks the kind.
    let dir = scratch("layer-train-out");
    full.save_as(&dir, StoreFormat::F32).unwrap();
    let back = match Drafter::from_dir(&dir, &t).unwrap() {
        Drafter::Layer(l) => l,
        Drafter::Heads(_) => panic!("a draft.json directory must load as a layer"),
    };
    // A fixed input (a random one made the drift checks below flaky: some draws sit where
    // 8-bit rounding moves probabilities by a few hundredths).
    let d = t.model.config().hidden_size;
    let x = Tensor::from_vec((0..2 * d).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect::<Vec<f32>>(), (2, d), &Device::Cpu).unwrap();
    // The layer's own loader keeps the target's format: the same drafts exactly.
    assert_eq!(DraftLayer::from_dir(&dir, &t).unwrap().top_k(&x, 5).unwrap(), full.top_k(&x, 5).unwrap());
    // The drafter loader drafts in 4-bit blocks whatever the target's format (cheaper; drafts
    // need not be exact): the same top guesses, probabilities within a few hundredths (8-bit
    // blocks stayed within 0.02; 4-bit moved one here by 0.04).
    for (ra, rb) in back.top_k(&x, 5).unwrap().iter().zip(full.top_k(&x, 5).unwrap()) {
        assert_eq!(ra[0].0, rb[0].0, "{ra:?} vs {rb:?}");
        assert!(ra.iter().zip(&rb).all(|(p, q)| (p.1 - q.1).abs() < 0.06), "{ra:?} vs {rb:?}");
    }
    assert_eq!(back.draft_vocab(), full.draft_vocab());
    // 8-bit storage: a quarter of the size, the same drafts up to rounding.
    let q8 = scratch("layer-train-q8");
    full.save_as(&q8, StoreFormat::Q8).unwrap();
    let size = |d: &std::path::Path| std::fs::metadata(d.join("draft.safetensors")).unwrap().len() as f64;
    assert!(size(&q8) < 0.45 * size(&dir), "q8 file {} vs f32 {}", size(&q8), size(&dir));
    let lq = DraftLayer::from_dir(&q8, &t).unwrap();
    let draft = |l: &DraftLayer| -> Vec<Vec<(u32, f32)>> {
        let mut c = l.new_cache().unwrap();
        let f = l.forward(&x, &[3, 4], &[0, 1], &TreeMask::causal(2), &mut c, &t.model).unwrap();
        l.top_k(&f, 3).unwrap()
    };
    let (a, b) = (draft(&lq), draft(&full));
    assert_ne!(a, b, "8-bit weights round");
    for (ra, rb) in a.iter().zip(&b) {
        assert_eq!(ra[0].0, rb[0].0, "q8 changes the top draft: {ra:?} vs {rb:?}");
        for (pa, pb) in ra.iter().zip(rb) {
            assert!((pa.1 - pb.1).abs() < 0.02, "q8 drafts drift: {ra:?} vs {rb:?}");
        }
    }
    // 4-bit storage: the very blocks the drafter loader drafts from, so the same drafts as the
    // f32 file gives it, at under a fifth of its size.
    let q4 = scratch("layer-train-q4");
    full.save_as(&q4, StoreFormat::Q4).unwrap();
    assert!(size(&q4) < 0.2 * size(&dir), "q4 file {} vs f32 {}", size(&q4), size(&dir));
    let back4 = match Drafter::from_dir(&q4, &t).unwrap() {
        Drafter::Layer(l) => l,
        Drafter::Heads(_) => panic!("a draft.json directory must load as a layer"),
    };
    assert_eq!(back4.top_k(&x, 5).unwrap(), back.top_k(&x, 5).unwrap());
    assert_eq!(draft(&back4), draft(&back));
    assert_eq!(back4.draft_vocab(), full.draft_vocab());
    let mut ts: HashMap<String, Tensor> = candle_core::safetensors::load(q4.join("draft.safetensors"), &Device::Cpu).unwrap();
    let name = ts.keys().find(|k| k.ends_with(".q4_1")).unwrap().clone();
    let cut = ts[&name].narrow(1, 0, 19).unwrap();
    ts.insert(name, cut);
    candle_core::safetensors::save(&ts, q4.join("draft.safetensors")).unwrap();
    let e = DraftLayer::from_dir(&q4, &t).err().unwrap().to_string();
    assert!(e.contains("draft.safetensors") && e.contains("20-byte blocks"), "{e}");

    let mut ts: HashMap<String, Tensor> = candle_core::safetensors::load(q8.join("draft.safetensors"), &Device::Cpu).unwrap();
    let scale = ts.keys().find(|k| k.ends_with(".q8scale")).unwrap().clone();
    ts.remove(&scale);
    candle_core::safetensors::save(&ts, q8.join("draft.safetensors")).unwrap();
    let e = DraftLayer::from_dir(&q8, &t).err().unwrap().to_string();
    assert!(e.contains("draft.safetensors") && e.contains("without their scales"), "{e}");
    // Another target is refused, naming both.
    let (_, other) = tiny_gguf("layer-train-other", 98);
    let e = DraftLayer::from_dir(&dir, &other).err().expect("must refuse").to_string();
    assert!(e.contains("trained for") && e.contains("hash"), "{e}");
    // A damaged weights file names itself.
    std::fs::write(dir.join("draft.safetensors"), b"not safetensors").unwrap();
    let e = DraftLayer::from_dir(&dir, &t).err().unwrap().to_string();
    assert!(e.contains("draft.safetensors"), "{e}");
    // A run can start from a trained layer (here the uninterrupted one): one step at a vanishing
    // learning rate keeps its weights and draft vocabulary.
    let init = scratch("layer-train-init");
    full.save_as(&init, StoreFormat::F32).unwrap();
    let cont = TrainConfig { init: Some(init.clone()), max_steps: 1, lr: 1e-12, warmup_steps: 1, ..quick_cfg() };
    let (warm, _) = run(&t, &cont, &scratch("layer-train-warm"), false);
    assert_eq!(warm.draft_vocab(), full.draft_vocab());
    let (wf, ww) = (saved(&full, &scratch("layer-w-f2")), saved(&warm, &scratch("layer-w-warm")));
    assert!(wf.iter().zip(&ww).all(|(a, b)| a.0 == b.0 && a.1.iter().zip(&b.1).all(|(x, y)| (x - y).abs() <= 1e-6)), "warm start did not load the layer");
    // Measuring the saved layer alone on the run's held-out chunks gives the run's own final
    // validation (same chunks, same weights); a drafter is needed.
    let v = selfspec::train::layer::held_out_layer_accuracy(&t, &corpus(), &TrainConfig { init: Some(init.clone()), ..quick_cfg() }, None, &mut |_| {}).unwrap();
    assert_eq!(v, rep.val.last().unwrap().clone());
    assert!(selfspec::train::layer::held_out_layer_accuracy(&t, &corpus(), &quick_cfg(), None, &mut |_| {}).is_err());
    // A directory without a layer is refused by name.
    let e = train_layer(&t, &corpus(), &TrainConfig { init: Some(scratch("layer-train-empty")), ..cont }, &scratch("layer-train-x"), false, None, &mut |_, _, _, _, _| {}, &mut |_| {})
        .err()
        .expect("no layer there")
        .to_string();
    assert!(e.contains("layer-train-empty"), "{e}");
    // Bad settings are refused before any work.
    assert!(TrainConfig { unroll: 0, ..quick_cfg() }.validate().is_err());
    assert!(TrainConfig { draft_vocab: 0, ..quick_cfg() }.validate().is_err());
}
