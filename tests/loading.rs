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
