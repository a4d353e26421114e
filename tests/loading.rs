//! Loading in the format asked for (issue #35): a compact format holds no f32 copy of the model,
//! reads the embedding and lm_head rows in place with the very values an f32 load has, names the
//! target the same way, and gives the same bits as re-packing an f32 load; switching formats
//! reloads; the loaders agree in every format.
mod common;
use candle_core::quantized::GgmlDType;
use candle_core::Device;
use common::{last_logits, scratch};
use selfspec::cpu::quant::WeightFormat;
use selfspec::model::fixtures;
use selfspec::model::loader::Target;

fn rows(t: &candle_core::Tensor) -> Vec<Vec<f32>> {
    t.to_vec2::<f32>().unwrap()
}

#[test]
fn a_compact_load_keeps_no_f32_copy_and_the_same_values() {
    let dir = scratch("loading");
    let mut cfg = fixtures::tiny_config();
    cfg.tie_embeddings = false;
    let w = fixtures::random_weights(&cfg, 5).unwrap();
    let p = dir.join("q.gguf");
    fixtures::write_gguf_as(&p, &cfg, &w, GgmlDType::Q4_1).unwrap();
    let reference = Target::load(&p, &Device::Cpu).unwrap();
    let native = Target::load_with(&p, &Device::Cpu, WeightFormat::Native).unwrap();
    assert_eq!(native.model.weight_format(), WeightFormat::Native);
    // No f32 weights: asking for one is an error that says how to get it.
    let e = native.model.lm_head().weight().unwrap_err().to_string();
    assert!(e.contains("--weights f32"), "{e}");
    assert!(reference.model.lm_head().weight().is_ok());
    // The rows read in place are the f32 load's values, bit for bit.
    let ids = [1u32, 7, 7, 30];
    assert_eq!(rows(&native.model.embed(&ids).unwrap()), rows(&reference.model.embed(&ids).unwrap()));
    assert_eq!(rows(&native.model.lm_head_rows(&ids).unwrap()), rows(&reference.model.lm_head_rows(&ids).unwrap()));
    assert_eq!(rows(&native.model.lm_head_weight().unwrap()), rows(&reference.model.lm_head_weight().unwrap()));
    assert!(native.model.embed(&[cfg.vocab_size as u32]).is_err());
    // Drafters are bound to the target by its fingerprint: the same whatever the format.
    assert_eq!(native.fingerprint().unwrap(), reference.fingerprint().unwrap());
    // Switching an f32 load to native reloads it: the same bits as loading native directly.
    let toks = native.tokenizer.encode("the cat sat on the mat", false).unwrap();
    let direct = last_logits(&native.model, &toks);
    let mut switched = Target::load(&p, &Device::Cpu).unwrap();
    switched.model.set_kv_dtype(candle_core::DType::F32).unwrap();
    switched.set_weights(WeightFormat::Native).unwrap();
    assert_eq!(switched.model.kv_dtype(), candle_core::DType::F32, "the KV element type survives a reload");
    switched.model.set_kv_dtype(candle_core::DType::F16).unwrap();
    assert_eq!(last_logits(&switched.model, &toks), direct);
    switched.set_weights(WeightFormat::F32).unwrap();
    assert_eq!(last_logits(&switched.model, &toks), last_logits(&reference.model, &toks));
    // A model without f32 weights cannot re-pack itself in place, and says so.
    let mut m = native.model;
    let e = m.set_weights(WeightFormat::Q8_0, &Default::default()).unwrap_err().to_string();
    assert!(e.contains("load it again"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_gguf_and_safetensors_loaders_agree_in_every_format() {
    let dir = scratch("loading-formats");
    let cfg = fixtures::tiny_config();
    let w = fixtures::random_weights(&cfg, 8).unwrap();
    fixtures::write_gguf(&dir.join("m.gguf"), &cfg, &w).unwrap();
    fixtures::write_hf(&dir.join("hf"), &cfg, &w).unwrap();
    for f in WeightFormat::ALL {
        let a = Target::load_with(&dir.join("m.gguf"), &Device::Cpu, f).unwrap();
        let b = Target::load_with(&dir.join("hf"), &Device::Cpu, f).unwrap();
        let toks = a.tokenizer.encode("a dog ran 42 times", false).unwrap();
        assert_eq!(last_logits(&a.model, &toks), last_logits(&b.model, &toks), "{f}");
        assert_eq!(a.fingerprint().unwrap(), b.fingerprint().unwrap(), "{f}");
        assert_eq!(a.model.weight_format(), f);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn llama3_rope_scaling_loads_from_both_formats_and_unknown_scalings_are_refused() {
    use selfspec::model::RopeScaling;
    let dir = scratch("loading-rope");
    let mut cfg = fixtures::tiny_config();
    // Head dimension 16, base 10^4: wavelengths 6 to 20k positions, so against an original
    // context of 64 one frequency is kept, two are blended and five divided.
    cfg.rope_scaling = Some(RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 64 });
    let w = fixtures::random_weights(&cfg, 12).unwrap();
    fixtures::write_gguf(&dir.join("m.gguf"), &cfg, &w).unwrap();
    fixtures::write_hf(&dir.join("hf"), &cfg, &w).unwrap();
    let a = Target::load(&dir.join("m.gguf"), &Device::Cpu).unwrap();
    let b = Target::load(&dir.join("hf"), &Device::Cpu).unwrap();
    assert!(matches!(a.model.config().rope_scaling, Some(RopeScaling::Divisors { .. })));
    assert_eq!(b.model.config().rope_scaling, cfg.rope_scaling);
    let toks: Vec<u32> = (0..120).map(|i| (i * 7 % 40 + 3) as u32).collect();
    let (la, lb) = (last_logits(&a.model, &toks), last_logits(&b.model, &toks));
    assert!(common::max_diff(&la, &lb) < 1e-3, "GGUF divisors and config.json llama3 disagree: {}", common::max_diff(&la, &lb));
    // Without the scaling the same weights give other logits: it is not silently dropped.
    let mut plain = cfg.clone();
    plain.rope_scaling = None;
    fixtures::write_gguf(&dir.join("plain.gguf"), &plain, &w).unwrap();
    let c = Target::load(&dir.join("plain.gguf"), &Device::Cpu).unwrap();
    assert!(common::max_diff(&la, &last_logits(&c.model, &toks)) > 1e-2);
    // Scalings not implemented are refused, naming the type, in both formats.
    let cfg_path = dir.join("hf/config.json");
    let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    c["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768});
    std::fs::write(&cfg_path, c.to_string()).unwrap();
    let e = Target::load(&dir.join("hf"), &Device::Cpu).err().unwrap().to_string();
    assert!(e.contains("yarn") && e.contains("llama3"), "{e}");
    let mut lin = cfg.clone();
    lin.rope_scaling = Some(RopeScaling::Linear { factor: 2.0 });
    fixtures::write_gguf(&dir.join("lin.gguf"), &lin, &w).unwrap();
    let t = Target::load(&dir.join("lin.gguf"), &Device::Cpu).unwrap();
    assert_eq!(t.model.config().rope_scaling, Some(RopeScaling::Linear { factor: 2.0 }));
    let mut bytes = std::fs::read(dir.join("lin.gguf")).unwrap();
    let at = bytes.windows(6).position(|x| x == b"linear").unwrap();
    bytes[at..at + 6].copy_from_slice(b"yarn\0\0");
    // The string's stored length stays 6: "yarn" plus two NULs is an unknown type all the same.
    std::fs::write(dir.join("yarn.gguf"), &bytes).unwrap();
    let e = Target::load(&dir.join("yarn.gguf"), &Device::Cpu).err().unwrap().to_string();
    assert!(e.contains("rope scaling") && e.contains("yarn"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
