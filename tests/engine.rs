//! The target forward: both loaders agree, we match candle-transformers, and a tree forward is
//! bit-identical to decoding each node's path one token at a time.
mod common;

use candle_core::{Device, Tensor};
use common::*;
use selfspec::model::fixtures;
use selfspec::cpu::TreeMask;
use selfspec::model::loader::Target;

#[test]
fn gguf_and_hf_loaders_give_identical_logits() {
    let dir = scratch("loaders");
    let cfg = fixtures::tiny_config();
    let w = fixtures::random_weights(&cfg, 11).unwrap();
    fixtures::write_gguf(&dir.join("m.gguf"), &cfg, &w).unwrap();
    fixtures::write_hf(&dir.join("hf"), &cfg, &w).unwrap();
    let a = Target::load(&dir.join("m.gguf"), &Device::Cpu).unwrap();
    let b = Target::load(&dir.join("hf"), &Device::Cpu).unwrap();
    let text = "the cat sat in the sun, then ran 42 times.";
    let ta = a.tokenizer.encode(text, false).unwrap();
    let tb = b.tokenizer.encode(text, false).unwrap();
    assert_eq!(ta, tb, "tokenizers differ");
    assert_eq!(a.tokenizer.decode(&ta).unwrap(), text);
    let la = last_logits(&a.model, &ta);
    let lb = last_logits(&b.model, &tb);
    assert_eq!(la, lb, "GGUF and safetensors logits differ");
    // The chat template came through both paths.
    let msg = [selfspec::model::tokenizer::Message::new("user", "hi")];
    assert_eq!(a.chat_prompt(&msg).unwrap(), b.chat_prompt(&msg).unwrap());
    assert_eq!(a.fingerprint().unwrap(), b.fingerprint().unwrap());
}

#[test]
fn logits_match_candle_transformers_quantized_llama() {
    let (path, mut ours) = tiny_gguf("parity", 3);
    let mut f = std::fs::File::open(&path).unwrap();
    let ct = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
    let mut theirs = candle_transformers::models::quantized_llama::ModelWeights::from_gguf(ct, &mut f, &Device::Cpu).unwrap();
    let toks: Vec<u32> = (0..23).map(|i| (i * 37 + 5) % 260).collect();
    let input = Tensor::new(toks.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let reference: Vec<f32> = theirs.forward(&input, 0).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    // The default CPU cache rounds K/V to f16; with an f32 cache the forward is candle's own.
    assert_eq!(ours.model.kv_dtype(), candle_core::DType::F16);
    let d16 = max_diff(&last_logits(&ours.model, &toks), &reference);
    ours.model.set_kv_dtype(candle_core::DType::F32).unwrap();
    let d = max_diff(&last_logits(&ours.model, &toks), &reference);
    assert!(d <= 1e-4, "max abs diff {d} against quantized_llama (f32 cache)");
    assert!(d16 <= 1e-2, "max abs diff {d16} against quantized_llama (f16 cache)");
    assert!(ours.model.set_kv_dtype(candle_core::DType::BF16).is_err());
}

#[test]
fn tree_forward_is_bit_identical_to_sequential_tiny() {
    let (_, mut t) = tiny_gguf("tree", 5);
    let prompt: Vec<u32> = (0..12).map(|i| (i * 13 + 1) % 260).collect();
    // Both KV cache types: f16 (the CPU default) and f32.
    for dtype in [candle_core::DType::F16, candle_core::DType::F32] {
        t.model.set_kv_dtype(dtype).unwrap();
        for seed in 1..4 {
            check_tree_equivalence(&t.model, &prompt, 17, seed);
        }
    }
}

#[test]
fn tree_forward_is_bit_identical_to_sequential_smollm2() {
    let t = smollm2();
    let prompt = t.tokenizer.encode("The quick brown fox jumps over the lazy dog because", false).unwrap();
    check_tree_equivalence(&t.model, &prompt, 16, 42);
}

#[test]
fn smollm2_knows_the_capital_of_france() {
    let t = smollm2();
    let ids = t.encode_prompt("The capital of France is", false).unwrap();
    let stop = selfspec::decode::generate::StopRule { max_new_tokens: 4, eos_ids: &t.tokenizer.eos_ids };
    let params = selfspec::decode::sampling::SamplingParams::greedy();
    let (out, _) = selfspec::decode::generate::generate_plain(&t.model, &ids, &params, &stop, &mut selfspec::decode::sampling::rng(0), &mut |_| Ok(selfspec::Flow::Continue)).unwrap();
    let text = t.tokenizer.decode(&out).unwrap();
    assert!(text.starts_with(" Paris"), "got {text:?}");
}

#[test]
fn attention_kernel_matches_candle_ops() {
    use selfspec::cpu::TreeAttention;
    let dev = Device::Cpu;
    let (t, h, hkv, d, prefix) = (5, 4, 2, 16, 7);
    let q = Tensor::randn(0f32, 1., (t, h, d), &dev).unwrap();
    let k = Tensor::randn(0f32, 1., (hkv, prefix + t, d), &dev).unwrap();
    let v = Tensor::randn(0f32, 1., (hkv, prefix + t, d), &dev).unwrap();
    let mask = TreeMask::from_parents(&[None, Some(0), Some(0), Some(1), Some(2)]).unwrap();
    let op = TreeAttention { mask: std::sync::Arc::new(mask.clone()), prefix_len: prefix, scale: 0.25, first_key: None };
    let a: Vec<f32> = q.apply_op3_no_bwd(&k, &v, &op).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let b: Vec<f32> = selfspec::model::attention_candle(&q, &k, &v, &mask, prefix, 0.25, None).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    assert!(max_diff(&a, &b) < 1e-5);
    // Queries for the mask's last 2 nodes only, the first 3 already in the cache after the
    // prefix: the same rows, the same bits as when all 5 are queried.
    let q2 = q.narrow(0, 3, 2).unwrap();
    let a2: Vec<f32> = q2.apply_op3_no_bwd(&k, &v, &op).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(a2, a[3 * h * d..]);
    let b2: Vec<f32> = selfspec::model::attention_candle(&q2, &k, &v, &mask, prefix, 0.25, None).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    assert!(max_diff(&a2, &b2) < 1e-5);
    // Keys that do not cover the prefix and the whole mask are refused.
    let short = k.narrow(1, 0, prefix + 4).unwrap();
    assert!(q2.apply_op3_no_bwd(&short, &v.narrow(1, 0, prefix + 4).unwrap(), &op).is_err());
    assert!(selfspec::model::attention_candle(&q2, &short, &v.narrow(1, 0, prefix + 4).unwrap(), &mask, prefix, 0.25, None).is_err());
    // A sliding window: each row sees keys from its own first slot on (cached or new). The
    // kernel agrees with candle's ops, and a row's bits do not depend on the other rows'
    // windows (row 4 alone, with the same first slot, gives the same bits).
    let firsts = vec![2usize, 3, 0, 8, 9];
    let wop = TreeAttention { first_key: Some(std::sync::Arc::new(firsts.clone())), ..op.clone() };
    let aw: Vec<f32> = q.apply_op3_no_bwd(&k, &v, &wop).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let bw: Vec<f32> = selfspec::model::attention_candle(&q, &k, &v, &mask, prefix, 0.25, Some(&firsts)).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    assert!(max_diff(&aw, &bw) < 1e-5);
    assert!(max_diff(&aw, &a) > 1e-3, "the window changed nothing");
    let one = TreeAttention { first_key: Some(std::sync::Arc::new(vec![9])), ..op.clone() };
    let a4: Vec<f32> = q.narrow(0, 4, 1).unwrap().apply_op3_no_bwd(&k, &v, &one).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(a4, aw[4 * h * d..]);
}

#[test]
fn sharded_safetensors_and_qwen2_bias_load() {
    let dir = scratch("shards");
    let cfg = fixtures::tiny_config();
    let w = fixtures::random_weights(&cfg, 12).unwrap();
    let one = dir.join("one");
    fixtures::write_hf(&one, &cfg, &w).unwrap();
    // Same weights split over two shards with an index.
    let two = dir.join("two");
    fixtures::write_hf(&two, &cfg, &w).unwrap();
    std::fs::remove_file(two.join("model.safetensors")).unwrap();
    let mut names: Vec<&String> = w.keys().collect();
    names.sort();
    let (a, b) = names.split_at(names.len() / 2);
    let mut map = serde_json::Map::new();
    for (file, part) in [("model-00001-of-00002.safetensors", a), ("model-00002-of-00002.safetensors", b)] {
        let m: std::collections::HashMap<String, Tensor> = part.iter().map(|k| ((*k).clone(), w[*k].clone())).collect();
        candle_core::safetensors::save(&m, two.join(file)).unwrap();
        for k in part {
            map.insert((*k).clone(), serde_json::json!(file));
        }
    }
    std::fs::write(two.join("model.safetensors.index.json"), serde_json::json!({"weight_map": map}).to_string()).unwrap();
    let t1 = Target::load(&one, &Device::Cpu).unwrap();
    let t2 = Target::load(&two, &Device::Cpu).unwrap();
    let toks = [5u32, 9, 200, 3];
    assert_eq!(last_logits(&t1.model, &toks), last_logits(&t2.model, &toks));

    // Qwen2: q/k/v biases change the output.
    let q = dir.join("qwen");
    let mut wq = w.clone();
    for i in 0..cfg.num_layers {
        for (n, size) in [("q_proj", cfg.num_heads * cfg.head_dim), ("k_proj", cfg.num_kv_heads * cfg.head_dim), ("v_proj", cfg.num_kv_heads * cfg.head_dim)] {
            wq.insert(format!("model.layers.{i}.self_attn.{n}.bias"), Tensor::randn(0f32, 0.5, size, &Device::Cpu).unwrap());
        }
    }
    fixtures::write_hf(&q, &cfg, &wq).unwrap();
    let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(q.join("config.json")).unwrap()).unwrap();
    c["model_type"] = "qwen2".into();
    c["architectures"] = serde_json::json!(["Qwen2ForCausalLM"]);
    // As in Qwen2's own config.json: no attention_bias key (the biases are in the weights).
    c.as_object_mut().unwrap().remove("attention_bias");
    std::fs::write(q.join("config.json"), c.to_string()).unwrap();
    let tq = Target::load(&q, &Device::Cpu).unwrap();
    assert!(tq.model.config().attention_bias);
    assert_ne!(last_logits(&tq.model, &toks), last_logits(&t1.model, &toks));
    // Unsupported architectures are named.
    c["model_type"] = "gpt_neox".into();
    c["architectures"] = serde_json::json!(["GPTNeoXForCausalLM"]);
    std::fs::write(q.join("config.json"), c.to_string()).unwrap();
    let e = Target::load(&q, &Device::Cpu).err().unwrap().to_string();
    assert!(e.contains("GPTNeoXForCausalLM") && e.contains("config.json"), "{e}");
}

#[test]
fn tree_grown_level_by_level_is_bit_identical_to_one_forward() {
    // A drafter keeps each level's K/V in the cache and runs only the next level's rows
    // (`forward_embeds_after`); every row must come out as in one forward over the whole tree.
    let (_, mut t) = tiny_gguf("levels", 9);
    let prompt: Vec<u32> = (0..10).map(|i| (i * 29 + 3) % 260).collect();
    let parents = [None, None, Some(0), Some(1), Some(1), Some(2), Some(4), Some(4)];
    let depth = [0usize, 0, 1, 1, 1, 2, 2, 2];
    let levels = [0..2, 2..5, 5..8];
    let tokens: Vec<u32> = (0..parents.len() as u32).map(|i| (i * 41 + 7) % 260).collect();
    let x = t.model.embed(&tokens).unwrap();
    let positions: Vec<usize> = depth.iter().map(|d| prompt.len() + d).collect();
    for dtype in [candle_core::DType::F16, candle_core::DType::F32] {
        t.model.set_kv_dtype(dtype).unwrap();
        let m = &t.model;
        let mut one = m.new_cache().unwrap();
        m.forward_causal(&prompt, &mut one).unwrap();
        let whole: Vec<Vec<f32>> =
            m.forward_embeds(&x, &positions, &TreeMask::from_parents(&parents).unwrap(), &mut one).unwrap().to_vec2().unwrap();
        let mut grown = m.new_cache().unwrap();
        m.forward_causal(&prompt, &mut grown).unwrap();
        for r in levels.clone() {
            let mask = TreeMask::from_parents(&parents[..r.end]).unwrap();
            let rows: Vec<Vec<f32>> = m
                .forward_embeds_after(&x.narrow(0, r.start, r.len()).unwrap(), &positions[r.clone()], &mask, r.start, &mut grown)
                .unwrap()
                .to_vec2()
                .unwrap();
            assert_eq!(rows, whole[r.clone()], "level {r:?} ({dtype:?} cache)");
        }
        assert_eq!(grown.len(), prompt.len() + parents.len());
        // A mask that does not cover the cached tail plus the new rows is refused.
        let bad = TreeMask::causal(2);
        assert!(m.forward_embeds_after(&x.narrow(0, 0, 1).unwrap(), &positions[..1], &bad, 0, &mut grown).is_err());
        assert!(m.forward_embeds_after(&x.narrow(0, 0, 1).unwrap(), &positions[..1], &bad, grown.len() + 1, &mut grown).is_err());
    }
}
