//! Parity with a reference implementation, per family (issue #31): tiny random-weight
//! checkpoints written by Hugging Face transformers (`scripts/reference-fixtures`, committed
//! under tests/fixtures/reference/) must give transformers' logits and greedy tokens here, loaded
//! from the safetensors directory and from a GGUF conversion of the same weights.
//!
//! Families: Llama with Llama 3.1's rope scaling (a 160-token input, past the 64-token original
//! context the scaling stretches), Qwen2 (q/k/v biases, NeoX rotary layout) and Qwen3 (per-head
//! q/k norms) and Gemma 3 (scaled embeddings, (1 + w) norms around attention and MLP, GELU-tanh,
//! a sliding-window layer past whose window the input runs, and a global one).
mod common;
use candle_core::Device;
use common::scratch;
use selfspec::decode::generate::{generate_plain, Flow, StopRule};
use selfspec::decode::sampling::{rng, SamplingParams};
use selfspec::model::loader::Target;
use selfspec::model::{fixtures, Llama};

/// Logits within this share of the largest logit of transformers' (f32 both sides, the sums in
/// other orders; measured 5e-7 on all three families, GGUF and safetensors alike).
const TOLERANCE: f32 = 1e-5;

struct Expected {
    input_ids: Vec<u32>,
    logits: Vec<Vec<f32>>,
    greedy: Vec<u32>,
}

fn expected(dir: &std::path::Path) -> Expected {
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let ids = |k: &str| v[k].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect::<Vec<_>>();
    let logits = v["logits"].as_array().unwrap().iter().map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()).collect();
    Expected { input_ids: ids("input_ids"), logits, greedy: ids("greedy") }
}

/// Largest difference of the last positions' logits, relative to the largest logit.
fn logit_error(model: &Llama, e: &Expected) -> f32 {
    let mut cache = model.new_cache().unwrap();
    let h = model.forward_causal(&e.input_ids, &mut cache).unwrap();
    let n = e.input_ids.len();
    let got = model.logits(&h.narrow(0, n - e.logits.len(), e.logits.len()).unwrap()).unwrap().to_vec2::<f32>().unwrap();
    let scale = e.logits.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
    got.iter().flatten().zip(e.logits.iter().flatten()).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / scale
}

fn greedy(model: &Llama, e: &Expected) -> Vec<u32> {
    let stop = StopRule { max_new_tokens: e.greedy.len(), eos_ids: &[] };
    generate_plain(model, &e.input_ids, &SamplingParams::greedy(), &stop, &mut rng(0), &mut |_| Ok(Flow::Continue)).unwrap().0
}

fn check_family(name: &str, check_config: impl Fn(&selfspec::model::Config)) {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/reference").join(name);
    let dir = scratch(&format!("reference-{name}"));
    for f in ["config.json", "model.safetensors", "expected.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    fixtures::write_hf_tokenizer(&dir).unwrap();
    let e = expected(&dir);
    // f32 K/V: the f16 cache (the CPU default) rounds them, and the reference does not.
    let mut hf = Target::load(&dir, &Device::Cpu).unwrap();
    hf.model.set_kv_dtype(candle_core::DType::F32).unwrap();
    check_config(hf.model.config());
    let err = logit_error(&hf.model, &e);
    eprintln!("{name} (safetensors): largest logit difference {err:.2e} of the largest logit");
    assert!(err <= TOLERANCE, "{name} (safetensors): logits differ from transformers' by {err} of the largest");
    assert_eq!(greedy(&hf.model, &e), e.greedy, "{name} (safetensors): greedy tokens differ from transformers'");
    // The same weights as a GGUF, in llama.cpp's layout for the family (q/k rows permuted for
    // Llama, Llama 3.1's scaling as rope_freqs.weight).
    let weights = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let gguf = dir.join("m.gguf");
    fixtures::write_gguf(&gguf, hf.model.config(), &weights).unwrap();
    let mut g = Target::load(&gguf, &Device::Cpu).unwrap();
    g.model.set_kv_dtype(candle_core::DType::F32).unwrap();
    assert_eq!(g.model.config().qk_norm, hf.model.config().qk_norm);
    assert_eq!(g.model.config().attention_bias, hf.model.config().attention_bias);
    let err = logit_error(&g.model, &e);
    eprintln!("{name} (GGUF): largest logit difference {err:.2e} of the largest logit");
    assert!(err <= TOLERANCE, "{name} (GGUF): logits differ from transformers' by {err} of the largest");
    assert_eq!(greedy(&g.model, &e), e.greedy, "{name} (GGUF): greedy tokens differ from transformers'");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn llama3_with_rope_scaling_matches_transformers() {
    check_family("llama3", |c| {
        assert!(matches!(c.rope_scaling, Some(selfspec::model::RopeScaling::Llama3 { .. })), "{:?}", c.rope_scaling);
        assert_eq!(c.architecture, "llama");
    });
}

#[test]
fn qwen2_matches_transformers() {
    check_family("qwen2", |c| {
        assert!(c.attention_bias && !c.qk_norm);
        assert_eq!(c.rope_theta, 1e6);
    });
}

#[test]
fn qwen3_matches_transformers() {
    check_family("qwen3", |c| assert!(c.qk_norm && !c.attention_bias));
}

#[test]
fn gemma3_matches_transformers() {
    check_family("gemma3", |c| {
        assert!(c.qk_norm && c.post_norms && c.embed_scale && !c.attention_bias);
        assert_eq!(c.activation, selfspec::model::Activation::GeluTanh);
        assert_eq!((c.sliding_window, c.local_layers.as_slice(), c.local_rope_theta, c.rope_theta), (Some(128), &[true, false][..], Some(1e4), 1e6));
    });
}
