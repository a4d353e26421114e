//! EAGLE-3 checkpoints in the layout SpecForge and vLLM write and llama.cpp converts
//! (`convert_hf_to_gguf.py --target-model-dir`, then `--spec-type draft-eagle3`): a
//! `config.json` (`LlamaForCausalLMEagle3`, one hidden layer, `draft_vocab_size`, the feature
//! layers, `target_hidden_size`) and a `model.safetensors` holding `fc`, the `midlayer.*` decoder
//! layer with its `hidden_norm`, `norm`, `lm_head` over the draft vocabulary, and the vocabulary
//! maps `d2t` (draft slot → target id offset: `id = slot + d2t[slot]`) and `t2d` (per target id:
//! in the draft vocabulary or not).
//!
//! Feature layers are named as vLLM and llama.cpp read them: layer i's *input*, the residual
//! stream entering it (default 2, n/2, n-3). SGLang reads named ids as layer *outputs*, so the
//! export names them only when they are not the default, which every runtime agrees on. A layer trained here and exported drafts the same
//! tokens when imported back (tested), so a drafter moves between this tool and the servers.
use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};

use crate::draft::layer::{eagle3_default_layers, tensor_names, DraftArch, DraftLayer, DraftLayerConfig};
use crate::model::loader::{Fingerprint, Target};
use crate::model::RopeScaling;
use crate::{Error, Result};

/// The architecture names EAGLE-3 checkpoints carry (SpecForge's, then vLLM's and AngelSlim's).
pub const ARCHITECTURES: &[&str] = &["LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"];
pub const CONFIG_FILE: &str = "config.json";
pub const WEIGHTS_FILE: &str = "model.safetensors";

/// Whether `dir` holds an EAGLE-3 checkpoint: a `config.json` naming an EAGLE-3 architecture,
/// or one hidden layer with a `draft_vocab_size` (how llama.cpp's converter tells them apart).
pub fn is_eagle3_dir(dir: &Path) -> bool {
    let Ok(s) = crate::files::read_config(&dir.join(CONFIG_FILE)) else { return false };
    let Ok(c) = serde_json::from_str::<serde_json::Value>(&s) else { return false };
    let named = c["architectures"].as_array().is_some_and(|a| a.iter().any(|x| x.as_str().is_some_and(|n| ARCHITECTURES.contains(&n))));
    named || (c.get("draft_vocab_size").is_some() && c["num_hidden_layers"].as_u64() == Some(1))
}

/// Our tensor name for a checkpoint's (`midlayer.*`, Eagle3Speculator's `layers.0.*`, or ours).
fn our_name(name: &str) -> String {
    if let Some(rest) = name.strip_prefix("midlayer.") {
        format!("model.layers.0.{rest}")
    } else if let Some(rest) = name.strip_prefix("layers.0.") {
        format!("model.layers.0.{rest}")
    } else if name == "norm.weight" {
        "model.norm.weight".into()
    } else {
        name.to_string()
    }
}

/// The checkpoint's name for one of ours.
fn their_name(name: &str) -> String {
    if let Some(rest) = name.strip_prefix("model.layers.0.") {
        format!("midlayer.{rest}")
    } else if name == "model.norm.weight" {
        "norm.weight".into()
    } else {
        name.to_string()
    }
}

fn rope_scaling_json(r: &Option<RopeScaling>) -> Result<serde_json::Value> {
    Ok(match r {
        None => serde_json::Value::Null,
        Some(RopeScaling::Linear { factor }) => serde_json::json!({ "rope_type": "linear", "factor": factor }),
        Some(RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position }) => serde_json::json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor,
            "original_max_position_embeddings": original_max_position,
        }),
        Some(RopeScaling::Divisors { .. }) => {
            return Err(Error::InvalidArgument(
                "the target's rope scaling came from a GGUF's per-frequency divisors, which a config.json cannot state; export from the model's Hugging Face directory".into(),
            ))
        }
    })
}

/// Write `layer` (an EAGLE-3 layer with its weights) as an EAGLE-3 checkpoint in `out`:
/// `config.json` and `model.safetensors` (f32), each written atomically.
pub fn export(layer: &DraftLayer, target: &Target, out: &Path) -> Result<()> {
    let cfg = layer.config();
    let DraftArch::Eagle3 { layers } = &cfg.arch else {
        return Err(Error::InvalidArgument("only an EAGLE-3 layer (train --draft-layer --eagle3) has an EAGLE-3 checkpoint; this is an EAGLE layer, whose fc reads the final features".into()));
    };
    let w = layer.weights()?;
    let c = &cfg.layer;
    let tc = target.model.config();
    let ids = layer.draft_vocab();
    let mut ts: HashMap<String, Tensor> = HashMap::new();
    for (name, _) in tensor_names(cfg) {
        ts.insert(their_name(&name), w[&name].to_dtype(DType::F32)?);
    }
    let d2t: Vec<i64> = ids.iter().enumerate().map(|(slot, &id)| id as i64 - slot as i64).collect();
    ts.insert("d2t".into(), Tensor::from_vec(d2t, ids.len(), &Device::Cpu)?);
    let mut t2d = vec![false; tc.vocab_size];
    for &id in ids {
        t2d[id as usize] = true;
    }
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    crate::files::save_safetensors_with_bools(&ts, &[("t2d", &t2d)], &out.join(WEIGHTS_FILE))?;
    let config = serde_json::json!({
        "architectures": [ARCHITECTURES[0]],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": rope_scaling_json(&c.rope_scaling)?,
        "max_position_embeddings": c.max_position,
        "vocab_size": tc.vocab_size,
        "draft_vocab_size": ids.len(),
        "tie_word_embeddings": false,
        "attention_bias": false,
        "mlp_bias": false,
        "bos_token_id": tc.bos_token_id,
        "eos_token_id": tc.eos_token_ids,
        "torch_dtype": "float32",
        "target_hidden_size": tc.hidden_size,
        "eagle_aux_hidden_state_layer_ids": layers,
        "eagle_config": { "eagle_aux_hidden_state_layer_ids": layers, "use_aux_hidden_state": true },
        // Not read by other tools: lets an import here check the target beyond its sizes.
        "selfspec": { "target": cfg.target, "recipe": cfg.recipe },
    });
    let mut config = config;
    if *layers == eagle3_default_layers(tc.num_layers) {
        // The default layers go unnamed: vLLM, llama.cpp and SGLang then all take the inputs
        // of layers 2, n/2 and n-3. Named ids mean layer inputs to vLLM and llama.cpp, but
        // layer outputs to SGLang (it adds one), so a named set would be off by one there.
        let o = config.as_object_mut().expect("an object");
        o.remove("eagle_aux_hidden_state_layer_ids");
        o["eagle_config"].as_object_mut().expect("an object").remove("eagle_aux_hidden_state_layer_ids");
    }
    let json = serde_json::to_string_pretty(&config).expect("config serialises");
    crate::files::write_atomic(&out.join(CONFIG_FILE), json.as_bytes())
}

/// Load an EAGLE-3 checkpoint (SpecForge, vLLM or ours) from `dir` as a draft layer for
/// `target`, checking the target as far as the checkpoint records it: hidden size, vocabulary,
/// feature layers, a token embedding of its own (must be the target's), and our fingerprint
/// when it was exported here.
pub fn import(dir: &Path, target: &Target) -> Result<DraftLayer> {
    let cfg_path = dir.join(CONFIG_FILE);
    let mut c: serde_json::Value = serde_json::from_str(&crate::files::read_config(&cfg_path)?).map_err(|e| Error::bad_file(&cfg_path, format!("invalid JSON: {e}")))?;
    let bad = |m: String| Error::bad_file(&cfg_path, m);
    // vLLM's speculators layout (Eagle3Speculator) nests the layer's settings.
    if let Some(inner) = c.get("transformer_layer_config").and_then(|v| v.as_object()).cloned() {
        let o = c.as_object_mut().ok_or_else(|| bad("not a JSON object".into()))?;
        for (k, v) in inner {
            o.insert(k, v);
        }
    }
    // Variants this layer does not compute are refused rather than drafted wrongly.
    for flag in ["norm_before_residual", "norm_before_fc", "attention_bias", "mlp_bias"] {
        if c[flag].as_bool() == Some(true) {
            return Err(Error::unsupported(&cfg_path, format!("an EAGLE-3 variant with {flag}: true")));
        }
    }
    if let Some(act) = c["hidden_act"].as_str().filter(|a| *a != "silu") {
        return Err(Error::unsupported(&cfg_path, format!("hidden_act '{act}' (an EAGLE-3 layer here is a SiLU Llama layer)")));
    }
    let tc = target.model.config().clone();
    let u = |k: &str| -> Result<usize> { c[k].as_u64().map(|v| v as usize).ok_or_else(|| bad(format!("missing or non-integer '{k}'"))) };
    if u("num_hidden_layers")? != 1 {
        return Err(bad(format!("{} hidden layers; an EAGLE-3 drafter has one", u("num_hidden_layers")?)));
    }
    let hidden = u("hidden_size")?;
    let target_hidden = c["target_hidden_size"].as_u64().map(|v| v as usize).unwrap_or(hidden);
    if hidden != tc.hidden_size || target_hidden != tc.hidden_size {
        return Err(bad(format!("a drafter of hidden size {hidden} for a target of {target_hidden}; this target's is {} (a drafter whose width differs from its target's is not supported here)", tc.hidden_size)));
    }
    let vocab = u("vocab_size")?;
    if vocab != tc.vocab_size {
        return Err(bad(format!("made for a vocabulary of {vocab} tokens; the target has {}", tc.vocab_size)));
    }
    let draft_vocab = c["draft_vocab_size"].as_u64().map(|v| v as usize).unwrap_or(vocab);
    if draft_vocab == 0 || draft_vocab > vocab {
        return Err(bad(format!("a draft vocabulary of {draft_vocab} tokens for a vocabulary of {vocab}")));
    }
    let ids_json = c["eagle_config"]["eagle_aux_hidden_state_layer_ids"].as_array().or_else(|| c["eagle_aux_hidden_state_layer_ids"].as_array());
    let layers: Vec<usize> = match ids_json {
        Some(a) => a.iter().map(|x| x.as_u64().map(|v| v as usize).ok_or_else(|| bad("eagle_aux_hidden_state_layer_ids holds a non-integer".into()))).collect::<Result<_>>()?,
        None => eagle3_default_layers(tc.num_layers),
    };
    if let Some(fp) = c["selfspec"].get("target") {
        let fp: Fingerprint = serde_json::from_value(fp.clone()).map_err(|e| bad(format!("selfspec.target: {e}")))?;
        let ours = target.fingerprint()?;
        if fp != ours {
            return Err(Error::HeadsMismatch { heads: dir.to_path_buf(), heads_target: fp.to_string(), model_target: ours.to_string() });
        }
    }
    let mut dcfg = DraftLayerConfig::for_target_eagle3(target, draft_vocab, &layers).map_err(|e| bad(e.to_string()))?;
    {
        let l = &mut dcfg.layer;
        let heads = u("num_attention_heads")?;
        l.intermediate_size = u("intermediate_size")?;
        l.num_heads = heads;
        l.num_kv_heads = c["num_key_value_heads"].as_u64().map(|v| v as usize).unwrap_or(heads);
        l.head_dim = c["head_dim"].as_u64().map(|v| v as usize).unwrap_or(hidden / heads.max(1));
        l.rms_norm_eps = c["rms_norm_eps"].as_f64().unwrap_or(1e-6);
        l.rope_theta = c["rope_theta"].as_f64().or_else(|| c["rope_parameters"]["rope_theta"].as_f64()).unwrap_or(10000.0);
        l.rope_scaling = crate::model::loader::hf_rope_scaling(if c["rope_scaling"].is_null() { &c["rope_parameters"] } else { &c["rope_scaling"] }).map_err(|m| Error::unsupported(&cfg_path, m))?;
        l.max_position = c["max_position_embeddings"].as_u64().map(|v| v as usize).unwrap_or(tc.max_position).min(tc.max_position);
        // `validate` first: it checks the products below without overflow.
        l.validate().map_err(&bad)?;
        if l.intermediate_size > 64 * hidden || l.num_heads * l.head_dim > 64 * hidden {
            return Err(bad(format!("an FFN of {} and {} heads of {} are out of proportion to hidden {hidden}", l.intermediate_size, l.num_heads, l.head_dim)));
        }
    }
    if let Some(r) = c["selfspec"].get("recipe") {
        dcfg.recipe = r.clone();
    }

    let w_path = dir.join(WEIGHTS_FILE);
    let bytes = crate::files::read_data(&w_path)?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| Error::bad_file(&w_path, format!("not a readable safetensors file: {e}")))?;
    let wbad = |m: String| Error::bad_file(&w_path, m);
    // Every tensor's name and shape are checked against the config before any is converted.
    let expected: HashMap<String, Vec<usize>> = tensor_names(&dcfg).into_iter().collect();
    let mut ts: HashMap<String, Tensor> = HashMap::new();
    let mut d2t: Option<Vec<i64>> = None;
    let mut embed_rows: Option<Vec<Vec<f32>>> = None;
    let sample: Vec<u32> = (0..vocab as u32).step_by((vocab / 64).max(1)).collect();
    for (name, view) in st.tensors() {
        let shape = view.shape().to_vec();
        let data = view.data();
        let dtype = view.dtype();
        let to_f32 = |bytes: &[u8]| -> Result<Vec<f32>> {
            Ok(match dtype {
                safetensors::Dtype::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
                safetensors::Dtype::F16 => bytes.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
                safetensors::Dtype::BF16 => bytes.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
                other => return Err(wbad(format!("{name} is {other:?}; weights must be f32, f16 or bf16"))),
            })
        };
        if name == "t2d" {
            continue;
        }
        if name == "d2t" {
            if dtype != safetensors::Dtype::I64 || shape != [draft_vocab] {
                return Err(wbad(format!("d2t is {dtype:?} {shape:?}; expected I64 [{draft_vocab}]")));
            }
            d2t = Some(data.chunks_exact(8).map(|b| i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])).collect());
            continue;
        }
        if name.ends_with("embed_tokens.weight") {
            // Only the rows compared with the target's are read.
            if shape != [vocab, hidden] {
                return Err(wbad(format!("{name} is {shape:?}; the target's embedding is [{vocab}, {hidden}]")));
            }
            let row = data.len() / vocab;
            embed_rows = Some(sample.iter().map(|&i| to_f32(&data[i as usize * row..(i as usize + 1) * row])).collect::<Result<_>>()?);
            continue;
        }
        let ours = our_name(&name);
        match expected.get(&ours) {
            Some(want) if *want == shape => {}
            Some(want) => return Err(wbad(format!("{name} is {shape:?}; the config says {want:?}"))),
            None => return Err(Error::unsupported(&w_path, format!("tensor {name}: not part of the EAGLE-3 layer computed here (biases, extra norms and other variants are not supported)"))),
        }
        let v = to_f32(data)?;
        if let Some(x) = v.iter().find(|x| !x.is_finite()) {
            return Err(wbad(format!("tensor {name} holds {x}: not usable weights (from a training run that diverged?)")));
        }
        let t = Tensor::from_vec(v, shape.as_slice(), &Device::Cpu).map_err(|e| wbad(format!("{name}: {e}")))?;
        ts.insert(ours, t);
    }
    let ids: Vec<u32> = match d2t {
        Some(off) => {
            let mut seen = vec![false; vocab];
            let mut ids = Vec::with_capacity(off.len());
            for (slot, &o) in off.iter().enumerate() {
                let id = (slot as i64).checked_add(o).filter(|&id| id >= 0 && (id as u64) < vocab as u64);
                let Some(id) = id.filter(|&id| !std::mem::replace(&mut seen[id as usize], true)) else {
                    return Err(wbad(format!("d2t maps draft slot {slot} by {o}: outside the vocabulary of {vocab}, or onto a token mapped already")));
                };
                ids.push(id as u32);
            }
            ids
        }
        None if draft_vocab == vocab => (0..vocab as u32).collect(),
        None => return Err(wbad(format!("no d2t map for a draft vocabulary of {draft_vocab} of {vocab} tokens"))),
    };
    if let Some(rows) = embed_rows {
        // The layer reads the target's embeddings; a checkpoint with its own (SpecForge keeps a
        // frozen copy of the target's) must agree with them, or it was made for another model.
        // Cosine per row: a 4-bit target's rows differ from the original's by their rounding.
        let ours: Vec<Vec<f32>> = target.model.embed(&sample)?.to_device(&Device::Cpu)?.to_vec2()?;
        let cos = |a: &[f32], b: &[f32]| {
            let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
            let n = (a.iter().map(|x| x * x).sum::<f32>() * b.iter().map(|x| x * x).sum::<f32>()).sqrt();
            if n > 0.0 { dot / n } else { 1.0 }
        };
        let mean = rows.iter().zip(&ours).map(|(a, b)| cos(a, b)).sum::<f32>() / rows.len().max(1) as f32;
        if mean < 0.95 {
            return Err(wbad(format!("its own token embedding is not the target's (mean cosine {mean:.3} over {} rows): made for another model", rows.len())));
        }
    }
    let layer = DraftLayer::from_tensors(ts, ids, dcfg, &target.model).map_err(|e| wbad(e.to_string()))?;
    Ok(layer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_both_ways() {
        for ours in ["fc.weight", "model.layers.0.hidden_norm.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight", "lm_head.weight"] {
            assert_eq!(our_name(&their_name(ours)), ours);
        }
        assert_eq!(their_name("model.layers.0.mlp.up_proj.weight"), "midlayer.mlp.up_proj.weight");
        assert_eq!(our_name("layers.0.input_layernorm.weight"), "model.layers.0.input_layernorm.weight");
        assert_eq!(their_name("model.norm.weight"), "norm.weight");
    }

    #[test]
    fn rope_scaling_is_written_as_transformers_reads_it_and_divisors_are_refused() {
        let l3 = Some(RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 8192 });
        let v = rope_scaling_json(&l3).unwrap();
        assert_eq!(crate::model::loader::hf_rope_scaling(&v).unwrap(), l3);
        assert!(rope_scaling_json(&None).unwrap().is_null());
        assert!(rope_scaling_json(&Some(RopeScaling::Divisors { divisors: vec![1.0] })).is_err());
    }
}
