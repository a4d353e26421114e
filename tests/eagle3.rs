//! The EAGLE-3 draft layer: its training forward computes what the inference forward computes
//! (fused target layers at step 0, its own pre-norm output after), drafting keeps greedy output
//! exactly the target's, training lowers the loss, and the SpecForge/vLLM checkpoint it exports
//! imports back to the same drafts and refuses other targets.
mod common;

use candle_core::{Device, Tensor};
use candle_nn::VarMap;
use common::*;
use selfspec::cpu::TreeMask;
use selfspec::decode::generate::{generate_plain, Flow, StopRule};
use selfspec::decode::sampling::{rng, SamplingParams};
use selfspec::draft::choice::TreeChoice;
use selfspec::draft::drafter::Drafter;
use selfspec::draft::layer::{DraftArch, DraftLayer, DraftLayerConfig, StoreFormat, TrainLayer};
use selfspec::draft::tree::Tree;
use selfspec::model::loader::Target;
use selfspec::spec::verify::Rule;
use selfspec::spec::{generate_spec, SpecOptions};
use selfspec::train::layer::train_layer;
use selfspec::train::TrainConfig;

fn to_vec(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

/// A tiny eight-layer random model (EAGLE-3 reads a low, a middle and a high layer).
fn deep_tiny(name: &str, seed: u64) -> Target {
    let dir = scratch(name);
    let cfg = selfspec::model::Config { num_layers: 8, ..selfspec::model::fixtures::tiny_config() };
    let w = selfspec::model::fixtures::random_weights(&cfg, seed).unwrap();
    let p = dir.join("tiny6.gguf");
    selfspec::model::fixtures::write_gguf(&p, &cfg, &w).unwrap();
    Target::load(&p, &Device::Cpu).unwrap()
}

const LAYERS: [usize; 3] = [1, 3, 4];

fn random_layer(t: &Target, seed: u64) -> (TrainLayer, Vec<u32>) {
    let vocab = t.model.config().vocab_size;
    let ids: Vec<u32> = (0..vocab as u32).collect();
    let cfg = DraftLayerConfig::for_target_eagle3(t, vocab, &LAYERS).unwrap();
    let layer = TrainLayer::init(&VarMap::new(), cfg, &ids, &t.model, seed).unwrap();
    (layer, ids)
}

#[test]
fn target_forwards_return_the_inputs_of_the_named_layers() {
    let mut t = deep_tiny("e3-taps", 40);
    let toks: Vec<u32> = (0..12u32).map(|i| (i * 5 + 2) % 200).collect();
    let plain = selfspec::train::hidden_states(&t, &toks, None).unwrap();
    t.model.set_feature_layers(&LAYERS).unwrap();
    let wide = selfspec::train::hidden_states(&t, &toks, None).unwrap();
    let d = t.model.config().hidden_size;
    assert_eq!(wide.dims(), [toks.len(), 4 * d]);
    // The final states are the same bits, and so are the logits read from the wide rows.
    assert_eq!(to_vec(&wide.narrow(1, 0, d).unwrap()), to_vec(&plain));
    assert_eq!(to_vec(&t.model.logits(&wide).unwrap()), to_vec(&t.model.logits(&plain).unwrap()));
    // Layer 0's input would be the embeddings: a tap there reads them.
    t.model.set_feature_layers(&[0, 1, 5]).unwrap();
    let w0 = selfspec::train::hidden_states(&t, &toks, None).unwrap();
    assert_eq!(to_vec(&w0.narrow(1, d, d).unwrap()), to_vec(&t.model.embed(&toks).unwrap()));
    assert!(t.model.set_feature_layers(&[8]).is_err(), "a layer past the model is refused");
    // Repeated layers each get the layer's input.
    t.model.set_feature_layers(&[3, 3, 3]).unwrap();
    let rep = selfspec::train::hidden_states(&t, &toks, None).unwrap();
    assert_eq!(to_vec(&rep.narrow(1, d, d).unwrap()), to_vec(&rep.narrow(1, 3 * d, d).unwrap()));
    // A drafter reads three distinct layers in ascending order (what vLLM and SGLang capture).
    for bad in [vec![3, 3, 5], vec![5, 3, 1], vec![1, 2], vec![1, 2, 8]] {
        assert!(DraftLayerConfig::for_target_eagle3(&t, 10, &bad).is_err(), "{bad:?}");
    }
    assert!(TrainConfig { draft_layer: true, eagle3: true, feature_layers: vec![4, 2, 6], ..Default::default() }.validate().is_err());
}

#[test]
fn training_forward_matches_inference_forward() {
    let mut t = deep_tiny("e3-fwd", 41);
    t.model.set_feature_layers(&LAYERS).unwrap();
    let (train, ids) = random_layer(&t, 5);
    let layer = DraftLayer::from_tensors(train.tensors().unwrap(), ids, train.cfg.clone(), &t.model).unwrap();
    let toks: Vec<u32> = (0..24u32).map(|i| (i * 7 + 3) % t.model.config().vocab_size as u32).collect();
    // Step 0 fuses the target's layers; later steps take the layer's own output (hidden-size
    // wide) without the fusing fc.
    let preds = check_layer_forwards_agree(&t, &train, &layer, &toks, 3);
    // Logits after the final norm and the layer's own head agree too.
    let h = selfspec::train::hidden_states(&t, &toks, None).unwrap();
    let n = toks.len() - 1;
    let out = layer.forward(&h.narrow(0, 0, n).unwrap(), &toks[1..], &(0..n).collect::<Vec<_>>(), &TreeMask::causal(n), &mut layer.new_cache().unwrap(), &t.model).unwrap();
    let top = layer.top_k(&out.narrow(0, 3, 1).unwrap(), 1).unwrap()[0][0].0;
    let want: Vec<u32> = train.logits(&preds[0]).unwrap().argmax(candle_core::D::Minus1).unwrap().to_vec1().unwrap();
    assert_eq!(top, want[3]);
}

#[test]
fn drafting_keeps_greedy_output_exact_and_an_unattached_target_is_refused() {
    let mut t = deep_tiny("e3-exact", 42);
    let (train, ids) = random_layer(&t, 6);
    let drafter = Drafter::Layer(DraftLayer::from_tensors(train.tensors().unwrap(), ids, train.cfg.clone(), &t.model).unwrap());
    let params = SamplingParams::greedy();
    let prompt = [1u32, 5, 9, 2, 7, 7, 3];
    let opts = |tree: TreeChoice| SpecOptions { tree, lookup: None, datastore: None, rule: Rule::Greedy, params: params.clone(), stop: StopRule { max_new_tokens: 32, eos_ids: &[] } };
    // Not attached: the target returns its final states only, and drafting says what to do.
    let e = generate_spec(&t.model, &drafter, &prompt, &opts(TreeChoice::Dynamic(6)), &mut rng(0), &mut |_| Ok(Flow::Continue)).err().expect("refused").to_string();
    assert!(e.contains("attach"), "{e}");
    drafter.attach(&mut t).unwrap();
    assert_eq!(t.model.feature_layers(), LAYERS);
    // tune times drafting on rows as wide as the target's.
    let (propose, commit) = drafter.draft_cost_ms(&t.model).unwrap();
    assert!(propose > 0.0 && commit > 0.0);
    let (plain, _) = generate_plain(&t.model, &prompt, &params, &StopRule { max_new_tokens: 32, eos_ids: &[] }, &mut rng(0), &mut |_| Ok(Flow::Continue)).unwrap();
    for tree in [TreeChoice::Static(Tree::chain(4)), TreeChoice::Dynamic(6), TreeChoice::Dynamic(12)] {
        let (out, _) = generate_spec(&t.model, &drafter, &prompt, &opts(tree.clone()), &mut rng(0), &mut |_| Ok(Flow::Continue)).unwrap();
        assert_eq!(out, plain, "tree {tree:?}");
    }
}

/// `--widen-vocab` on an EAGLE-3 layer: its own head keeps its trained rows for the old tokens and
/// starts the added ones from the target's rows.
#[test]
fn widening_keeps_the_heads_trained_rows_and_starts_new_ones_from_the_targets() {
    let mut t = deep_tiny("e3-widen", 44);
    t.model.set_feature_layers(&LAYERS).unwrap();
    let first = scratch("e3-widen-a");
    let (small, _) = train_layer(&t, &corpus(), &TrainConfig { draft_vocab: 12, max_steps: 3, ..quick_cfg() }, &first, false, None, &mut |_, _, _, _, _| {}, &mut |_| {}).unwrap();
    small.save_as(&first, StoreFormat::F32).unwrap();
    // A learning rate too small to move anything: the widened head is what the warm start built.
    let cfg = TrainConfig { init: Some(first.clone()), widen_vocab: 20, max_steps: 1, lr: 1e-12, ..quick_cfg() };
    let (wide, _) = train_layer(&t, &corpus(), &cfg, &scratch("e3-widen-b"), false, None, &mut |_, _, _, _, _| {}, &mut |_| {}).unwrap();
    let (old, new) = (small.draft_vocab().to_vec(), wide.draft_vocab().to_vec());
    assert_eq!(new.len(), 20);
    let head = |l: &DraftLayer| l.weights().unwrap()["lm_head.weight"].clone();
    let (h_old, h_new) = (head(&small), head(&wide));
    let target_rows = t.model.lm_head_rows(&new).unwrap();
    let mut trained_rows_differ = false;
    for (i, tok) in new.iter().enumerate() {
        let got = to_vec(&h_new.narrow(0, i, 1).unwrap());
        let want = match old.iter().position(|o| o == tok) {
            Some(r) => to_vec(&h_old.narrow(0, r, 1).unwrap()),
            None => to_vec(&target_rows.narrow(0, i, 1).unwrap()),
        };
        assert!(got.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-5), "row of token {tok}");
        trained_rows_differ |= old.contains(tok) && to_vec(&target_rows.narrow(0, i, 1).unwrap()) != got;
    }
    assert!(trained_rows_differ, "training moved the old rows away from the target's");
}

fn quick_cfg() -> TrainConfig {
    TrainConfig {
        draft_layer: true,
        eagle3: true,
        feature_layers: LAYERS.to_vec(),
        unroll: 3,
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

#[test]
fn trains_exports_for_vllm_and_llama_cpp_and_imports_to_the_same_drafts() {
    let mut t = deep_tiny("e3-train", 43);
    // The run checks that the target returns the layers it trains on.
    let e = train_layer(&t, &corpus(), &quick_cfg(), &scratch("e3-unattached"), false, None, &mut |_, _, _, _, _| {}, &mut |_| {}).err().expect("refused").to_string();
    assert!(e.contains("set_feature_layers"), "{e}");
    t.model.set_feature_layers(&LAYERS).unwrap();
    let (layer, rep) = train_layer(&t, &corpus(), &quick_cfg(), &scratch("e3-run"), false, None, &mut |_, _, _, _, _| {}, &mut |_| {}).unwrap();
    let n = rep.losses.len();
    let (first, last) = (rep.losses[..3].iter().sum::<f64>() / 3.0, rep.losses[n - 3..].iter().sum::<f64>() / 3.0);
    assert!(last < first * 0.9, "loss {first} -> {last}");
    assert_eq!(layer.config().arch, DraftArch::Eagle3 { layers: LAYERS.to_vec() });
    // Validation estimates τ from held-out acceptance runs: a tree keeps at least what a
    // chain does.
    let v = rep.val.last().unwrap();
    assert!(v.tau_chain >= 1.0 && v.tau_tree >= v.tau_chain && v.tau_tree <= 5.0, "{v:?}");

    // Saved in our format and in EAGLE-3's.
    let ours = scratch("e3-ours");
    layer.save_as(&ours, StoreFormat::F32).unwrap();
    let ckpt = scratch("e3-ckpt");
    let from_ours = Drafter::from_dir(&ours, &t).unwrap();
    selfspec::draft::export::export(&from_ours, &ours, &t, &ckpt, "eagle3".parse().unwrap()).unwrap();
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(ckpt.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["architectures"][0], "LlamaForCausalLMEagle3");
    assert_eq!(cfg["num_hidden_layers"], 1);
    assert_eq!(cfg["draft_vocab_size"], layer.draft_vocab().len());
    assert_eq!(cfg["target_hidden_size"], 64);
    assert_eq!(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"], serde_json::json!(LAYERS));
    let bytes = std::fs::read(ckpt.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(|s| s.to_string()).collect();
    names.sort();
    for want in ["d2t", "t2d", "fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight", "midlayer.self_attn.q_proj.weight", "norm.weight", "lm_head.weight"] {
        assert!(names.iter().any(|n| n == want), "{want} missing from {names:?}");
    }
    assert_eq!(st.tensor("fc.weight").unwrap().shape(), [64, 3 * 64]);
    assert_eq!(st.tensor("midlayer.self_attn.q_proj.weight").unwrap().shape(), [64, 2 * 64]);
    assert_eq!(st.tensor("t2d").unwrap().dtype(), safetensors::Dtype::BOOL);
    // d2t: target id = slot + d2t[slot].
    let d2t: Vec<i64> = st.tensor("d2t").unwrap().data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap())).collect();
    let ids: Vec<u32> = d2t.iter().enumerate().map(|(s, o)| (s as i64 + o) as u32).collect();
    assert_eq!(ids, layer.draft_vocab());

    // Imported back: the same drafts and the same speculative run, step for step.
    let back = Drafter::from_dir(&ckpt, &t).unwrap();
    let d = t.model.config().hidden_size;
    let x = Tensor::from_vec((0..2 * d).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect::<Vec<f32>>(), (2, d), &Device::Cpu).unwrap();
    let (Drafter::Layer(a), Drafter::Layer(b)) = (&from_ours, &back) else { panic!("both load as layers") };
    assert_eq!(a.top_k(&x, 5).unwrap(), b.top_k(&x, 5).unwrap());
    let params = SamplingParams::greedy();
    let opts = SpecOptions { tree: TreeChoice::Dynamic(8), lookup: None, datastore: None, rule: Rule::Greedy, params: params.clone(), stop: StopRule { max_new_tokens: 40, eos_ids: &[] } };
    let prompt = t.tokenizer.encode("the cat sat on", false).unwrap();
    let (o1, s1) = generate_spec(&t.model, &from_ours, &prompt, &opts, &mut rng(0), &mut |_| Ok(Flow::Continue)).unwrap();
    let (o2, s2) = generate_spec(&t.model, &back, &prompt, &opts, &mut rng(0), &mut |_| Ok(Flow::Continue)).unwrap();
    assert_eq!(o1, o2);
    assert_eq!(s1.accept_hist, s2.accept_hist, "the imported drafter accepts differently");
    let (plain, _) = generate_plain(&t.model, &prompt, &params, &StopRule { max_new_tokens: 40, eos_ids: &[] }, &mut rng(0), &mut |_| Ok(Flow::Continue)).unwrap();
    assert_eq!(o1, plain);

    // A checkpoint from elsewhere is a starting point for training here (--init).
    let (tuned, _) = train_layer(&t, &corpus(), &TrainConfig { init: Some(ckpt.clone()), max_steps: 2, ..quick_cfg() }, &scratch("e3-tune"), false, None, &mut |_, _, _, _, _| {}, &mut |_| {}).unwrap();
    assert_eq!(tuned.draft_vocab(), layer.draft_vocab());
    assert_eq!(back.kind(), "EAGLE-3 draft layer");

    // Another target (same shapes, other weights) is refused by the recorded fingerprint; a
    // checkpoint without it (as other tools write) is checked by its sizes.
    let other = deep_tiny("e3-other", 44);
    assert!(Drafter::from_dir(&ckpt, &other).is_err());
    let mut c2 = cfg.clone();
    c2.as_object_mut().unwrap().remove("selfspec");
    c2["vocab_size"] = serde_json::json!(1000);
    std::fs::write(ckpt.join("config.json"), serde_json::to_string(&c2).unwrap()).unwrap();
    let e = Drafter::from_dir(&ckpt, &t).err().expect("refused").to_string();
    assert!(e.contains("config.json") && e.contains("1000"), "{e}");

    // An EAGLE layer has no EAGLE-3 form.
    let mut t2 = deep_tiny("e3-eagle", 45);
    t2.model.set_feature_layers(&[]).unwrap();
    let (eagle, _) = train_layer(&t2, &corpus(), &TrainConfig { eagle3: false, feature_layers: vec![], max_steps: 1, ..quick_cfg() }, &scratch("e3-eagle-run"), false, None, &mut |_, _, _, _, _| {}, &mut |_| {}).unwrap();
    let e = selfspec::draft::export::export(&Drafter::Layer(eagle), &ours, &t2, &scratch("e3-x"), "eagle3".parse().unwrap()).err().expect("refused").to_string();
    assert!(e.contains("EAGLE-3"), "{e}");
}

/// A layer reading the default layers exports without naming them (SGLang reads named ids as
/// layer outputs, vLLM and llama.cpp as inputs; unnamed, all take the same default) and imports
/// back to the same layers.
#[test]
fn default_layers_go_unnamed_and_come_back() {
    let t = deep_tiny("e3-default", 46);
    let layers = selfspec::draft::layer::eagle3_default_layers(8);
    assert_eq!(layers, [2, 4, 5]);
    let vocab = t.model.config().vocab_size;
    let ids: Vec<u32> = (0..vocab as u32).collect();
    let cfg = DraftLayerConfig::for_target_eagle3(&t, vocab, &layers).unwrap();
    let train = TrainLayer::init(&VarMap::new(), cfg, &ids, &t.model, 3).unwrap();
    let layer = DraftLayer::from_tensors(train.tensors().unwrap(), ids, train.cfg.clone(), &t.model).unwrap();
    let dir = scratch("e3-default-ckpt");
    selfspec::draft::eagle3::export(&layer, &t, &dir).unwrap();
    let c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert!(c.get("eagle_aux_hidden_state_layer_ids").is_none() && c["eagle_config"].get("eagle_aux_hidden_state_layer_ids").is_none(), "{c}");
    // A full draft vocabulary still carries d2t (all zeros) for llama.cpp.
    let back = selfspec::draft::eagle3::import(&dir, &t).unwrap();
    assert_eq!(back.feature_layers(), layers);
    assert_eq!(back.draft_vocab(), layer.draft_vocab());

    // Variants this layer does not compute are refused, naming what: a flag in the config, a
    // tensor it has no place for.
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let mut flagged: serde_json::Value = serde_json::from_str(&text).unwrap();
    flagged["norm_before_residual"] = serde_json::json!(true);
    std::fs::write(dir.join("config.json"), flagged.to_string()).unwrap();
    let e = selfspec::draft::eagle3::import(&dir, &t).err().expect("refused").to_string();
    assert!(e.contains("norm_before_residual"), "{e}");
    std::fs::write(dir.join("config.json"), &text).unwrap();
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut views: Vec<(String, safetensors::tensor::TensorView)> = st.tensors();
    let d = t.model.config().hidden_size;
    let extra: Vec<u8> = vec![0u8; d * 4];
    views.push(("midlayer.self_attn.q_proj.bias".into(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![d], &extra).unwrap()));
    std::fs::write(dir.join("model.safetensors"), safetensors::serialize(views, None).unwrap()).unwrap();
    let e = selfspec::draft::eagle3::import(&dir, &t).err().expect("refused").to_string();
    assert!(e.contains("q_proj.bias"), "{e}");
}
