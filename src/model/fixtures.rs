//! Tiny random models written to disk in both formats, so tests (and users trying the tool
//! without a download) have a real target to load. The same weights go into the GGUF (in
//! llama.cpp's permuted q/k layout) and into the safetensors directory.
use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use crate::model::loader::{permute_qk, GGUF_LAYER_TENSORS};
use crate::model::{Config, RopeScaling};
use crate::{Error, Result};

/// GPT-2's reversible map from bytes to printable characters, used by byte-level BPE vocabularies.
pub fn byte_to_char() -> Vec<char> {
    let mut printable: Vec<u32> = (33..=126).chain(161..=172).chain(174..=255).collect();
    let mut map = vec!['\0'; 256];
    let mut extra = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            map[b as usize] = char::from_u32(256 + extra).unwrap();
            extra += 1;
        }
    }
    printable.sort();
    for &b in &printable {
        map[b as usize] = char::from_u32(b).unwrap();
    }
    map
}

/// A byte-level vocabulary: 256 bytes, a few merges, and ChatML's special tokens.
pub fn tiny_vocab() -> (Vec<String>, Vec<String>, Vec<i32>) {
    let b2c = byte_to_char();
    let mut tokens: Vec<String> = (0..256).map(|b| b2c[b].to_string()).collect();
    let sp = b2c[b' ' as usize];
    let merges_pairs = [("t", "h"), ("th", "e"), (&*format!("{sp}"), "t"), ("i", "n"), ("a", "n"), ("e", "r"), ("o", "n")];
    let mut merges = Vec::new();
    for (a, b) in merges_pairs {
        merges.push(format!("{a} {b}"));
        tokens.push(format!("{a}{b}"));
    }
    let mut types = vec![1; tokens.len()];
    for s in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] {
        tokens.push(s.to_string());
        types.push(3);
    }
    (tokens, merges, types)
}

pub const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// A small Llama config with the tiny vocabulary.
pub fn tiny_config() -> Config {
    Config {
        architecture: "llama".into(),
        vocab_size: tiny_vocab().0.len(),
        hidden_size: 64,
        intermediate_size: 128,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        max_position: 512,
        tie_embeddings: false,
        attention_bias: false,
        qk_norm: false,
        bos_token_id: None,
        eos_token_ids: vec![],
        ..Default::default()
    }
}

/// Random weights with Hugging Face names; scaled so activations stay in a sane range.
pub fn random_weights(cfg: &Config, seed: u64) -> Result<HashMap<String, Tensor>> {
    let dev = Device::Cpu;
    let mut state = seed.wrapping_mul(0x9E3779B97F4A7C15).wrapping_add(1);
    let mut rnd = |shape: (usize, usize), scale: f32| -> Result<Tensor> {
        let n = shape.0 * shape.1;
        let v: Vec<f32> = (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * scale
            })
            .collect();
        Ok(Tensor::from_vec(v, shape, &dev)?)
    };
    let (d, f, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let (qd, kd) = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim);
    let s = |fan_in: usize| 1.5 / (fan_in as f32).sqrt();
    let mut w = HashMap::new();
    w.insert("model.embed_tokens.weight".into(), rnd((v, d), 1.0)?);
    for i in 0..cfg.num_layers {
        let p = format!("model.layers.{i}");
        w.insert(format!("{p}.self_attn.q_proj.weight"), rnd((qd, d), s(d))?);
        w.insert(format!("{p}.self_attn.k_proj.weight"), rnd((kd, d), s(d))?);
        w.insert(format!("{p}.self_attn.v_proj.weight"), rnd((kd, d), s(d))?);
        w.insert(format!("{p}.self_attn.o_proj.weight"), rnd((d, qd), s(qd))?);
        w.insert(format!("{p}.mlp.gate_proj.weight"), rnd((f, d), s(d))?);
        w.insert(format!("{p}.mlp.up_proj.weight"), rnd((f, d), s(d))?);
        w.insert(format!("{p}.mlp.down_proj.weight"), rnd((d, f), s(f))?);
        w.insert(format!("{p}.input_layernorm.weight"), (rnd((1, d), 0.2)?.squeeze(0)? + 1.0)?);
        w.insert(format!("{p}.post_attention_layernorm.weight"), (rnd((1, d), 0.2)?.squeeze(0)? + 1.0)?);
    }
    w.insert("model.norm.weight".into(), (rnd((1, d), 0.2)?.squeeze(0)? + 1.0)?);
    if !cfg.tie_embeddings {
        w.insert("lm_head.weight".into(), rnd((v, d), s(d) * 4.0)?);
    }
    // Drawn last, so the tensors above are the same for every family.
    for i in 0..cfg.num_layers {
        let p = format!("model.layers.{i}");
        if cfg.attention_bias {
            for (h, n) in [("q_proj", qd), ("k_proj", kd), ("v_proj", kd)] {
                w.insert(format!("{p}.self_attn.{h}.bias"), rnd((1, n), 0.5)?.squeeze(0)?);
            }
        }
        if cfg.qk_norm {
            for h in ["q_norm", "k_norm"] {
                w.insert(format!("{p}.self_attn.{h}.weight"), (rnd((1, cfg.head_dim), 0.2)?.squeeze(0)? + 1.0)?);
            }
        }
        if cfg.post_norms {
            for h in ["pre_feedforward_layernorm", "post_feedforward_layernorm"] {
                w.insert(format!("{p}.{h}.weight"), (rnd((1, d), 0.2)?.squeeze(0)? + 1.0)?);
            }
        }
    }
    // Norm weights as the checkpoint stores them (the model adds the offset back).
    if cfg.norm_offset != 0.0 {
        for (n, t) in w.iter_mut() {
            if n.contains("norm") {
                *t = (&*t - cfg.norm_offset)?;
            }
        }
    }
    Ok(w)
}

/// [`tiny_config`] as a Gemma 3: scaled embeddings, norms around attention and MLP, q/k norms,
/// GELU-tanh, and a local layer whose window (128, the least allowed) a test's sequences pass.
pub fn tiny_gemma3_config() -> Config {
    Config {
        architecture: "gemma3".into(),
        qk_norm: true,
        embed_scale: true,
        post_norms: true,
        activation: crate::model::Activation::GeluTanh,
        sliding_window: Some(crate::model::MIN_SLIDING_WINDOW),
        local_layers: vec![true, false],
        local_rope_theta: Some(10000.0),
        rope_theta: 1e6,
        norm_offset: 1.0,
        ..tiny_config()
    }
}

/// Write `weights` as a llama-architecture GGUF (f32 tensors) with the tiny tokenizer.
pub fn write_gguf(path: &Path, cfg: &Config, weights: &HashMap<String, Tensor>) -> Result<()> {
    write_gguf_as(path, cfg, weights, GgmlDType::F32)
}

/// [`write_gguf`] with the matrices (projections, embeddings, output) stored as `dtype`, e.g.
/// Q4_1 like the SmolLM2 GGUF; norms stay f32 as llama.cpp's converter keeps them.
pub fn write_gguf_as(path: &Path, cfg: &Config, weights: &HashMap<String, Tensor>, dtype: GgmlDType) -> Result<()> {
    use gguf_file::Value as V;
    let (tokens, merges, types) = tiny_vocab();
    let strs = |v: &[String]| V::Array(v.iter().map(|s| V::String(s.clone())).collect());
    let arch = cfg.architecture.as_str();
    let key = |k: &str| format!("{arch}.{k}");
    let md: Vec<(String, V)> = vec![
        ("general.architecture".into(), V::String(arch.into())),
        (key("embedding_length"), V::U32(cfg.hidden_size as u32)),
        (key("feed_forward_length"), V::U32(cfg.intermediate_size as u32)),
        (key("block_count"), V::U32(cfg.num_layers as u32)),
        (key("attention.head_count"), V::U32(cfg.num_heads as u32)),
        (key("attention.head_count_kv"), V::U32(cfg.num_kv_heads as u32)),
        (key("attention.key_length"), V::U32(cfg.head_dim as u32)),
        (key("attention.layer_norm_rms_epsilon"), V::F32(cfg.rms_norm_eps as f32)),
        (key("rope.freq_base"), V::F32(cfg.rope_theta as f32)),
        (key("rope.dimension_count"), V::U32(cfg.head_dim as u32)),
        (key("context_length"), V::U32(cfg.max_position as u32)),
        ("tokenizer.ggml.model".into(), V::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), V::String("smollm".into())),
        ("tokenizer.ggml.tokens".into(), strs(&tokens)),
        ("tokenizer.ggml.merges".into(), strs(&merges)),
        ("tokenizer.ggml.token_type".into(), V::Array(types.iter().map(|&t| V::I32(t)).collect())),
        ("tokenizer.ggml.eos_token_id".into(), V::U32(tokens.len() as u32 - 1)),
        ("tokenizer.ggml.bos_token_id".into(), V::U32(tokens.len() as u32 - 2)),
        ("tokenizer.chat_template".into(), V::String(CHATML.into())),
    ];
    let mut md = md;
    if arch == "gemma3" {
        // As llama.cpp's converter writes Gemma 3: the window, which layers use it (a list), and
        // the local layers' rotary base.
        if let Some(w) = cfg.sliding_window {
            md.push((key("attention.sliding_window"), V::U32(w as u32)));
            md.push((key("attention.sliding_window_pattern"), V::Array(cfg.local_layers.iter().map(|&b| V::Bool(b)).collect())));
            md.push((key("rope.freq_base_swa"), V::F32(cfg.local_rope_theta.unwrap_or(10000.0) as f32)));
        }
    }
    let mut named: Vec<(String, Tensor)> = Vec::new();
    let get = |n: &str| weights.get(n).cloned().ok_or_else(|| Error::InvalidArgument(format!("missing weight {n}")));
    // Norm weights as the GGUF stores them: Gemma's converter adds the 1 of its (1 + w) scale.
    let norm = |n: &str| -> Result<Tensor> { Ok((get(n)? + cfg.norm_offset)?) };
    named.push(("token_embd.weight".into(), get("model.embed_tokens.weight")?));
    named.push(("output_norm.weight".into(), norm("model.norm.weight")?));
    if !cfg.tie_embeddings {
        named.push(("output.weight".into(), get("lm_head.weight")?));
    }
    // llama.cpp's converter permutes q/k rows for Llama-architecture files only.
    let permuted = !matches!(arch, "qwen2" | "qwen3" | "gemma3");
    for i in 0..cfg.num_layers {
        let p = format!("model.layers.{i}");
        let b = format!("blk.{i}");
        let (q, k) = (get(&format!("{p}.self_attn.q_proj.weight"))?, get(&format!("{p}.self_attn.k_proj.weight"))?);
        named.push((format!("{b}.attn_q.weight"), if permuted { permute_qk(&q, cfg.num_heads)? } else { q }));
        named.push((format!("{b}.attn_k.weight"), if permuted { permute_qk(&k, cfg.num_kv_heads)? } else { k }));
        for (g, h) in GGUF_LAYER_TENSORS {
            let h = match h {
                "post_attention_layernorm.weight" if cfg.post_norms => "pre_feedforward_layernorm.weight",
                h => h,
            };
            named.push((format!("{b}.{g}"), if g.ends_with("norm.weight") { norm(&format!("{p}.{h}"))? } else { get(&format!("{p}.{h}"))? }));
        }
        if cfg.post_norms {
            named.push((format!("{b}.post_attention_norm.weight"), norm(&format!("{p}.post_attention_layernorm.weight"))?));
            named.push((format!("{b}.post_ffw_norm.weight"), norm(&format!("{p}.post_feedforward_layernorm.weight"))?));
        }
        if cfg.attention_bias {
            for (g, h) in [("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj")] {
                named.push((format!("{b}.{g}.bias"), get(&format!("{p}.self_attn.{h}.bias"))?));
            }
        }
        if cfg.qk_norm {
            named.push((format!("{b}.attn_q_norm.weight"), norm(&format!("{p}.self_attn.q_norm.weight"))?));
            named.push((format!("{b}.attn_k_norm.weight"), norm(&format!("{p}.self_attn.k_norm.weight"))?));
        }
    }
    let qs: Vec<(String, QTensor)> = named
        .into_iter()
        .map(|(n, t)| {
            let ty = if t.rank() == 2 { dtype } else { GgmlDType::F32 };
            Ok((n, QTensor::quantize(&t, ty)?))
        })
        .collect::<Result<_>>()?;
    let mut qs = qs;
    match &cfg.rope_scaling {
        None => {}
        Some(RopeScaling::Linear { factor }) => {
            md.push((key("rope.scaling.type"), V::String("linear".into())));
            md.push((key("rope.scaling.factor"), V::F32(*factor as f32)));
        }
        // As llama.cpp's converter stores Llama 3.1's scaling: one divisor per frequency.
        Some(RopeScaling::Llama3 { .. } | RopeScaling::Divisors { .. }) => {
            let divisors = rope_divisors(cfg);
            qs.push(("rope_freqs.weight".into(), QTensor::quantize(&Tensor::new(divisors.as_slice(), &Device::Cpu)?, GgmlDType::F32)?));
        }
    }
    let mdr: Vec<(&str, &V)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let qr: Vec<(&str, &QTensor)> = qs.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
    gguf_file::write(&mut f, &mdr, &qr)?;
    Ok(())
}

/// The divisor of each rotary frequency under `cfg.rope_scaling`, computed the way llama.cpp's
/// converter computes Llama 3.1's `rope_freqs.weight` (in f64, from the unscaled frequencies).
pub fn rope_divisors(cfg: &Config) -> Vec<f32> {
    let half = cfg.head_dim / 2;
    let freqs: Vec<f64> = (0..half).map(|i| 1.0 / cfg.rope_theta.powf((2 * i) as f64 / cfg.head_dim as f64)).collect();
    match &cfg.rope_scaling {
        Some(RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position }) => {
            let old = *original_max_position as f64;
            let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
            freqs
                .iter()
                .map(|f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_wavelen {
                        1.0
                    } else if wavelen > low_wavelen {
                        *factor as f32
                    } else {
                        let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        (1.0 / ((1.0 - smooth) / factor + smooth)) as f32
                    }
                })
                .collect()
        }
        Some(RopeScaling::Linear { factor }) => vec![*factor as f32; half],
        Some(RopeScaling::Divisors { divisors }) => divisors.clone(),
        None => vec![1.0; half],
    }
}

/// Write the same model as a Hugging Face directory (config.json, model.safetensors,
/// tokenizer.json built from the tiny vocabulary, tokenizer_config.json with the chat template).
pub fn write_hf(dir: &Path, cfg: &Config, weights: &HashMap<String, Tensor>) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let class = match cfg.architecture.as_str() {
        "qwen2" => "Qwen2ForCausalLM",
        "qwen3" => "Qwen3ForCausalLM",
        "mistral" => "MistralForCausalLM",
        _ => "LlamaForCausalLM",
    };
    let config = serde_json::json!({
        "architectures": [class], "model_type": cfg.architecture, "head_dim": cfg.head_dim, "attention_bias": cfg.attention_bias,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": cfg.vocab_size - 2, "eos_token_id": cfg.vocab_size - 1,
    });
    let mut config = config;
    config["rope_scaling"] = match &cfg.rope_scaling {
        None => serde_json::Value::Null,
        Some(RopeScaling::Linear { factor }) => serde_json::json!({"rope_type": "linear", "factor": factor}),
        Some(RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position }) => serde_json::json!({
            "rope_type": "llama3", "factor": factor, "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor, "original_max_position_embeddings": original_max_position,
        }),
        Some(RopeScaling::Divisors { .. }) => return Err(Error::InvalidArgument("config.json has no per-frequency divisors".into())),
    };
    crate::files::write_atomic(&dir.join("config.json"), config.to_string().as_bytes())?;
    candle_core::safetensors::save(weights, dir.join("model.safetensors"))?;
    write_hf_tokenizer(dir)
}

/// The tiny tokenizer as `tokenizer.json` and `tokenizer_config.json` in `dir` (for checkpoints
/// written elsewhere, such as the transformers reference fixtures). The JSON comes from the GGUF
/// conversion path, so both formats tokenize alike.
pub fn write_hf_tokenizer(dir: &Path) -> Result<()> {
    let tmp = dir.join("tokenizer-source.gguf");
    let cfg = tiny_config();
    write_gguf(&tmp, &cfg, &random_weights(&cfg, 0)?)?;
    let target = crate::model::loader::Target::load(&tmp, &Device::Cpu)?;
    std::fs::remove_file(&tmp).map_err(|e| Error::io(&tmp, e))?;
    crate::files::write_atomic(&dir.join("tokenizer.json"), target.tokenizer.to_json().as_bytes())?;
    let tc = serde_json::json!({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": false, "chat_template": CHATML});
    crate::files::write_atomic(&dir.join("tokenizer_config.json"), tc.to_string().as_bytes())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The GGUF form of Llama 3.1's scaling (llama.cpp's per-frequency divisors, as written here)
    /// gives the frequencies transformers' formula gives.
    #[test]
    fn rope_divisors_match_the_llama3_formula() {
        let mut cfg = tiny_config();
        cfg.head_dim = 128;
        cfg.rope_theta = 500000.0;
        let l3 = RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 8192 };
        cfg.rope_scaling = Some(l3.clone());
        let plain: Vec<f32> = (0..64).map(|i| 1f32 / 500000f32.powf((2 * i) as f32 / 128.0)).collect();
        let (mut direct, mut via) = (plain.clone(), plain);
        l3.apply(&mut direct);
        RopeScaling::Divisors { divisors: rope_divisors(&cfg) }.apply(&mut via);
        for (a, b) in via.iter().zip(&direct) {
            assert!((a - b).abs() <= 1e-6 * b.abs(), "{a} vs {b}");
        }
        cfg.rope_scaling = None;
        assert_eq!(rope_divisors(&cfg), vec![1.0; 64]);
    }

    /// A chat template that does not parse leaves the model usable for plain prompts; only what
    /// needs the template fails, naming the file and what to do.
    #[test]
    fn a_model_without_a_template_takes_plain_prompts() {
        let dir = std::env::temp_dir().join(format!("selfspec-no-template-{}", std::process::id()));
        let cfg = tiny_config();
        write_hf(&dir, &cfg, &random_weights(&cfg, 3).unwrap()).unwrap();
        let tc = dir.join("tokenizer_config.json");
        let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&tc).unwrap()).unwrap();
        v.as_object_mut().unwrap().remove("chat_template");
        std::fs::write(&tc, v.to_string()).unwrap();
        let t = crate::model::loader::Target::load(&dir, &Device::Cpu).unwrap();
        assert!(t.plain_prompts_note().unwrap().contains("no chat template"));
        let m = |c: &str| crate::model::tokenizer::Message::new("user", c);
        assert_eq!(t.prompt_ids(&[m("the cat"), m("the dog")]).unwrap(), t.tokenizer.encode("the cat\nthe dog", true).unwrap());
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn broken_chat_template_fails_only_where_needed() {
        let dir = std::env::temp_dir().join(format!("selfspec-broken-template-{}", std::process::id()));
        let cfg = tiny_config();
        let w = random_weights(&cfg, 3).unwrap();
        write_hf(&dir, &cfg, &w).unwrap();
        let tc = dir.join("tokenizer_config.json");
        let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&tc).unwrap()).unwrap();
        v["chat_template"] = serde_json::json!("{% for m in messages %}{{ m.content }");
        std::fs::write(&tc, v.to_string()).unwrap();
        let t = crate::model::loader::Target::load(&dir, &Device::Cpu).unwrap();
        assert!(t.chat_template.is_none() && t.chat_template_error.is_some());
        assert!(!t.encode_prompt("the cat", false).unwrap().is_empty());
        let e = t.encode_prompt("the cat", true).unwrap_err().to_string();
        assert!(e.contains("does not parse") && e.contains("without --chat"), "{e}");
        let m = [crate::model::tokenizer::Message::new("user", "hi")];
        assert!(t.render_conversation(&m).is_err(), "a broken template must not silently become joined turns");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn byte_map_is_a_bijection() {
        let m = byte_to_char();
        let mut s: Vec<char> = m.clone();
        s.sort();
        s.dedup();
        assert_eq!(s.len(), 256);
        assert_eq!(m[b'a' as usize], 'a');
        assert_eq!(m[b' ' as usize], '\u{120}');
    }
}
