//! An EAGLE-style draft layer: one Llama decoder layer that runs on the target's own features.
//!
//! Medusa heads guess token t+k+2 from the hidden state at t alone, so a deep guess cannot know
//! what the shallower guesses were; on a small target their accuracy falls fast with depth. The
//! draft layer is autoregressive at the feature level (EAGLE): from the target's feature f_t and
//! the embedding of the token x_{t+1} it predicts the next feature f_{t+1}, which the target's
//! lm_head turns into a guess for x_{t+2}; that guess and the predicted feature feed the next
//! step. It attends over its own KV cache of the whole prefix, so it sees context the heads
//! cannot. Verification is unchanged, so output stays exactly the target's.
//!
//! Pair j of the draft sequence is (f_j, x_{j+1}) at position j: the draft KV cache always
//! holds one pair per token in the target's cache, all built from real target features.
use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor, D};
use candle_nn::{VarBuilder, VarMap};
use rand::Rng;
use serde::{Deserialize, Serialize};

use crate::cpu::TreeMask;
use crate::model::kv_cache::KvCache;
use crate::model::loader::{Fingerprint, Target};
use crate::draft::grad::Readout;
use crate::model::{Config, Linear, Llama};
use crate::cpu::quant::WeightFormat;
use crate::{Error, Result};

pub const LAYER_WEIGHTS_FILE: &str = "draft.safetensors";
pub const LAYER_CONFIG_FILE: &str = "draft.json";

/// How `save_as` stores the weights. Q8 keeps a committed layer at about a quarter of its f32
/// size (blocks of 32 values, one f16 scale each, as GGUF's Q8_0); drafts need not be exact, so
/// the rounding costs no correctness, only a hair of accuracy. Q4 stores every matrix in the
/// 4-bit blocks (Q4_1) a loaded drafter drafts from on the CPU by default
/// ([`crate::draft::drafter::DRAFTING_FORMAT`]), norms and biases in f32, at about a sixth of
/// f32: those drafts are the ones the f32 file gives (re-quantizing a Q4_1 block gives the same
/// block). Everything else that reads the weights sees them 4-bit rounded: other
/// `--draft-weights`, a GPU, `train --init`, `export --format eagle3`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreFormat {
    F32,
    F16,
    Q8,
    Q4,
}

const Q8_BLOCK: usize = 32;
const Q8_SUFFIX: &str = ".q8";
const Q8_SCALE_SUFFIX: &str = ".q8scale";
/// A matrix stored as its Q4_1 rows (20 bytes per 32 values: f16 scale, f16 offset, 16 bytes of
/// codes), a U8 tensor `[rows, cols / 32 * 20]`.
const Q4_SUFFIX: &str = ".q4_1";

/// Matrices whose rows split into whole blocks, as (codes + 128 in u8, f16 scale per block).
fn quantize_q8(t: &Tensor) -> Result<Option<(Tensor, Tensor)>> {
    let (rows, cols) = match t.dims() {
        &[r, c] if c % Q8_BLOCK == 0 => (r, c),
        _ => return Ok(None),
    };
    let v: Vec<f32> = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let mut codes = Vec::with_capacity(v.len());
    let mut scales = Vec::with_capacity(v.len() / Q8_BLOCK);
    for block in v.chunks(Q8_BLOCK) {
        let amax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
        let d = half::f16::from_f32(amax / 127.0);
        let inv = if d.to_f32() > 0.0 { 1.0 / d.to_f32() } else { 0.0 };
        codes.extend(block.iter().map(|x| ((x * inv).round().clamp(-127.0, 127.0) as i32 + 128) as u8));
        scales.push(d);
    }
    let device = t.device();
    Ok(Some((Tensor::from_vec(codes, (rows, cols), device)?, Tensor::from_vec(scales, (rows, cols / Q8_BLOCK), device)?)))
}

/// A matrix's Q4_1 rows as a U8 tensor, or None when its rows do not split into whole blocks.
fn quantize_q4(t: &Tensor) -> Result<Option<Tensor>> {
    let (rows, cols) = match t.dims() {
        &[r, c] if c % Q8_BLOCK == 0 => (r, c),
        _ => return Ok(None),
    };
    let v: Vec<f32> = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let q = crate::cpu::quant::QuantRows::quantize_q4_1(&v, rows, cols)?;
    Ok(Some(Tensor::from_vec(q.row_range(0, rows), (rows, cols / Q8_BLOCK * 20), t.device())?))
}

/// The Q4_1 rows of matrix `n` as stored (a U8 tensor of whole 20-byte blocks per row), their
/// scales and offsets checked finite.
fn q4_rows(n: &str, q: &Tensor) -> std::result::Result<crate::cpu::quant::QuantRows, String> {
    let (rows, width) = q.dims2().map_err(|e| format!("{n}: {e}"))?;
    if q.dtype() != DType::U8 || width == 0 || width % 20 != 0 {
        return Err(format!("{n}: 4-bit rows must be U8 in whole 20-byte blocks, not {:?} {:?}", q.dtype(), q.dims()));
    }
    let bytes: Vec<u8> = q.flatten_all().and_then(|t| t.to_vec1()).map_err(|e| format!("{n}: {e}"))?;
    for (b, block) in bytes.chunks_exact(20).enumerate() {
        let [d, m] = [0, 2].map(|o| half::f16::from_le_bytes([block[o], block[o + 1]]));
        if !d.is_finite() || !m.is_finite() {
            return Err(format!("{n}: block {b} of the 4-bit rows has a non-finite scale or offset"));
        }
    }
    crate::cpu::quant::QuantRows::new(crate::cpu::quant::QuantKind::Q4_1, rows, width / 20 * Q8_BLOCK, bytes).map_err(|e| format!("{n}: {e}"))
}

/// Turn stored Q8 pairs and Q4_1 rows back into f32 tensors under their own names; other
/// tensors pass through.
fn dequantize_stored(mut ts: HashMap<String, Tensor>) -> std::result::Result<HashMap<String, Tensor>, String> {
    let names: Vec<String> = ts.keys().filter_map(|k| k.strip_suffix(Q4_SUFFIX).map(str::to_string)).collect();
    for n in names {
        let q = ts.remove(&format!("{n}{Q4_SUFFIX}")).expect("listed above");
        let rows_q = q4_rows(&n, &q)?;
        let (rows, cols) = (rows_q.n, rows_q.k);
        let w = Tensor::from_vec(rows_q.dequantize(), (rows, cols), &Device::Cpu).map_err(|e| format!("{n}: {e}"))?;
        if ts.insert(n.clone(), w).is_some() {
            return Err(format!("{n}: stored both as 4-bit rows and as a plain tensor"));
        }
    }
    let names: Vec<String> = ts.keys().filter_map(|k| k.strip_suffix(Q8_SUFFIX).map(str::to_string)).collect();
    for n in names {
        let q = ts.remove(&format!("{n}{Q8_SUFFIX}")).expect("listed above");
        let scale = ts.remove(&format!("{n}{Q8_SCALE_SUFFIX}")).ok_or_else(|| format!("{n}: 8-bit codes without their scales"))?;
        let (rows, cols) = q.dims2().map_err(|e| format!("{n}: {e}"))?;
        if q.dtype() != DType::U8 || scale.dims() != [rows, cols / Q8_BLOCK] || cols % Q8_BLOCK != 0 {
            return Err(format!("{n}: 8-bit codes {:?} {:?} do not match scales {:?}", q.dtype(), q.dims(), scale.dims()));
        }
        let w = (|| -> candle_core::Result<Tensor> {
            let codes = (q.to_dtype(DType::F32)? - 128.0)?.reshape((rows, cols / Q8_BLOCK, Q8_BLOCK))?;
            let s = scale.to_dtype(DType::F32)?.unsqueeze(2)?;
            codes.broadcast_mul(&s)?.reshape((rows, cols))
        })()
        .map_err(|e| format!("{n}: {e}"))?;
        ts.insert(n, w);
    }
    Ok(ts)
}

/// `dir`'s `draft.json`, checked against `target`: trained for it, and a layer of its width.
fn read_config(dir: &Path, target: &Target) -> Result<DraftLayerConfig> {
    let cfg_path = dir.join(LAYER_CONFIG_FILE);
    let s = crate::files::read_config(&cfg_path)?;
    let cfg: DraftLayerConfig = serde_json::from_str(&s).map_err(|e| Error::bad_file(&cfg_path, format!("invalid draft layer config: {e}")))?;
    check_config(cfg, dir, target)
}

/// [`read_config`]'s checks of a parsed `draft.json` against `target`.
fn check_config(cfg: DraftLayerConfig, dir: &Path, target: &Target) -> Result<DraftLayerConfig> {
    let cfg_path = dir.join(LAYER_CONFIG_FILE);
    let fp = target.fingerprint()?;
    if cfg.target != fp {
        return Err(Error::HeadsMismatch { heads: dir.to_path_buf(), heads_target: cfg.target.to_string(), model_target: fp.to_string() });
    }
    cfg.layer.validate().map_err(|e| Error::bad_file(&cfg_path, e))?;
    let mc = target.model.config();
    if cfg.layer.hidden_size != mc.hidden_size || cfg.layer.vocab_size > mc.vocab_size || cfg.layer.num_layers != 1 || cfg.layer.intermediate_size > 64 * mc.hidden_size {
        return Err(Error::bad_file(
            &cfg_path,
            format!("a {}-layer draft of hidden {}, FFN {} and draft vocabulary {} does not fit the model's hidden {} and vocabulary {}", cfg.layer.num_layers, cfg.layer.hidden_size, cfg.layer.intermediate_size, cfg.layer.vocab_size, mc.hidden_size, mc.vocab_size),
        ));
    }
    if let DraftArch::Eagle3 { layers } = &cfg.arch {
        check_feature_layers(layers, mc.num_layers).map_err(|e| Error::bad_file(&cfg_path, e))?;
        if !cfg.layer.eagle3_input {
            return Err(Error::bad_file(&cfg_path, "an EAGLE-3 layer configured without EAGLE-3's input"));
        }
    } else if cfg.layer.eagle3_input {
        return Err(Error::bad_file(&cfg_path, "an EAGLE layer configured with EAGLE-3's input"));
    }
    Ok(cfg)
}

/// Check that a layer of `cfg` with these tensors (`dims` of each by name) and draft
/// vocabulary `ids` fits `target`, and set it to run at the target's context.
fn fit_to_target(cfg: &mut DraftLayerConfig, ids: &[u32], dims: &dyn Fn(&str) -> Option<Vec<usize>>, target: &Llama) -> Result<()> {
    let tcfg = target.config();
    // The layer runs at the target's positions, so its context is the target's: a shorter one
    // recorded in a file (an EAGLE-3 checkpoint's training length, or a bad value) used to
    // end a generation with an error once the text grew past it.
    cfg.layer.max_position = tcfg.max_position;
    if cfg.layer.hidden_size != tcfg.hidden_size || ids.len() != cfg.layer.vocab_size {
        return Err(Error::InvalidArgument(format!(
            "draft layer of width {} over {} tokens does not fit a target of width {} ({} ids given)",
            cfg.layer.hidden_size,
            cfg.layer.vocab_size,
            tcfg.hidden_size,
            ids.len()
        )));
    }
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= tcfg.vocab_size) {
        return Err(Error::InvalidArgument(format!("draft vocabulary holds token {bad}, beyond the target's {}", tcfg.vocab_size)));
    }
    for (name, shape) in tensor_names(cfg) {
        match dims(&name) {
            Some(d) if d == shape => {}
            Some(d) => return Err(Error::InvalidArgument(format!("{name} has shape {d:?}, expected {shape:?}"))),
            None => return Err(Error::InvalidArgument(format!("missing tensor {name}"))),
        }
    }
    Ok(())
}

/// A stored layer for [`Llama::build`] in 4-bit blocks: matrices come as their stored Q4_1
/// rows, norms in f32; no token embedding table is built.
struct StoredLayer<'a> {
    f32s: &'a HashMap<String, Tensor>,
    blocks: &'a HashMap<String, crate::cpu::quant::QuantRows>,
}

impl crate::model::WeightSource for StoredLayer<'_> {
    fn tensor(&self, name: &str, shape: &[usize], device: &Device) -> Result<Tensor> {
        let t = self.f32s.get(name).ok_or_else(|| Error::InvalidArgument(format!("missing tensor {name} (matrices come as 4-bit rows only)")))?.to_dtype(DType::F32)?;
        if t.dims() != shape {
            return Err(Error::InvalidArgument(format!("{name} has shape {:?}, expected {shape:?}", t.dims())));
        }
        Ok(t.to_device(device)?)
    }

    fn staged(&self, name: &str, shape: (usize, usize), format: WeightFormat) -> Result<crate::cpu::quant::Staged> {
        match self.blocks.get(name) {
            Some(q) if format == WeightFormat::Native && (q.n, q.k) == shape => Ok(crate::cpu::quant::Staged::Blocks(q.clone())),
            _ => Err(Error::InvalidArgument(format!("{name}: no 4-bit rows of shape {shape:?} stored"))),
        }
    }

    /// The decoder's inputs come through `fc` and the target's embedding: its tied table is the
    /// readout's, which drafting reads from the packed blocks alone.
    fn embeds_tokens(&self) -> bool {
        false
    }
}

/// Which draft layer: what it reads from the target and what it feeds itself.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum DraftArch {
    /// EAGLE(-2): `fc` (with bias) mixes the target's final feature with the next token's
    /// embedding; the layer predicts the next final feature, scored by the target's own
    /// lm_head rows, and feeds that prediction to the next level.
    #[default]
    Eagle,
    /// EAGLE-3: `fc` (no bias) fuses the inputs of the target's `layers` (a low, a middle and a
    /// high one, as vLLM, SGLang and llama.cpp read them); the attention reads the normed token
    /// embedding beside the normed fused feature; the layer's own lm_head scores its output
    /// after the final norm, and the output before that norm feeds the next level. The layout
    /// SpecForge and vLLM train and llama.cpp runs (`--spec-type draft-eagle3`), so a drafter
    /// moves between them ([`crate::draft::eagle3`]).
    Eagle3 { layers: Vec<usize> },
}

impl DraftArch {
    /// The target layers whose inputs the drafter reads (none: the final states).
    pub fn feature_layers(&self) -> &[usize] {
        match self {
            DraftArch::Eagle => &[],
            DraftArch::Eagle3 { layers } => layers,
        }
    }
}

/// EAGLE-3's default feature layers for a target of `n` layers: what vLLM, SGLang and
/// llama.cpp take when a checkpoint names none (inputs of layers 2, n/2 and n-3; three distinct
/// layers from 7 layers on; shallower targets must name theirs).
pub fn eagle3_default_layers(n: usize) -> Vec<usize> {
    vec![2, n / 2, n.saturating_sub(3)]
}

/// Three distinct layers in ascending order, inside a target of `n` layers: what every runtime
/// can capture (vLLM and SGLang collect a layer once, in layer order, so a repeated or unsorted
/// list would fuse other columns than it was trained on).
pub fn check_feature_layers(layers: &[usize], n: usize) -> std::result::Result<(), String> {
    if layers.len() != 3 || !layers.windows(2).all(|w| w[0] < w[1]) || layers[2] >= n {
        return Err(format!(
            "EAGLE-3 reads three distinct target layers in ascending order below {n}; got {layers:?}{}",
            if n < 7 { " (a target this shallow has no default: name them with --feature-layers)" } else { "" }
        ));
    }
    Ok(())
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DraftLayerConfig {
    /// The layer as a one-layer Llama whose vocabulary is the draft vocabulary.
    pub layer: Config,
    /// EAGLE or EAGLE-3 (drafters written before EAGLE-3 have no field: EAGLE).
    #[serde(default)]
    pub arch: DraftArch,
    /// Which target it was trained for.
    pub target: Fingerprint,
    /// How it was made (command line, data, accuracy): free-form, for the record.
    #[serde(default)]
    pub recipe: serde_json::Value,
}

impl DraftLayerConfig {
    /// A layer shaped like one of `target`'s, scoring `draft_vocab` tokens.
    pub fn for_target(target: &Target, draft_vocab: usize) -> Result<Self> {
        let mut layer = target.model.config().clone();
        layer.num_layers = 1;
        layer.vocab_size = draft_vocab;
        layer.tie_embeddings = true;
        layer.attention_bias = false;
        layer.qk_norm = false;
        // The draft layer is a plain Llama decoder layer whatever the target's family: none of
        // Gemma's extras (its training and drafting code implement the Llama layer only).
        layer.embed_scale = false;
        layer.post_norms = false;
        layer.activation = crate::model::Activation::Silu;
        layer.attn_scale = None;
        layer.sliding_window = None;
        layer.local_layers = Vec::new();
        layer.local_rope_theta = None;
        layer.norm_offset = 0.0;
        layer.eagle3_input = false;
        Ok(DraftLayerConfig { layer, arch: DraftArch::Eagle, target: target.fingerprint()?, recipe: serde_json::Value::Null })
    }

    /// An EAGLE-3 layer for `target` reading the inputs of its `layers` ([`check_feature_layers`]).
    pub fn for_target_eagle3(target: &Target, draft_vocab: usize, layers: &[usize]) -> Result<Self> {
        check_feature_layers(layers, target.model.config().num_layers).map_err(Error::InvalidArgument)?;
        let mut cfg = Self::for_target(target, draft_vocab)?;
        cfg.layer.eagle3_input = true;
        cfg.arch = DraftArch::Eagle3 { layers: layers.to_vec() };
        Ok(cfg)
    }

    /// Widths of the features the drafter reads from the target (fc's input).
    pub fn feature_width(&self) -> usize {
        self.layer.hidden_size * self.arch.feature_layers().len().max(1)
    }
}

/// Names of the trained tensors (Hugging Face layout for the decoder layer). EAGLE-3 adds the
/// feature half's norm and its own lm_head, and its `fc` has no bias.
pub fn tensor_names(cfg: &DraftLayerConfig) -> Vec<(String, Vec<usize>)> {
    let c = &cfg.layer;
    let (d, i) = (c.hidden_size, c.intermediate_size);
    let (q, kv) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
    let l = "model.layers.0.";
    let eagle3 = matches!(cfg.arch, DraftArch::Eagle3 { .. });
    let a = if eagle3 { 2 * d } else { d };
    let mut names = vec![
        ("fc.weight".into(), vec![d, if eagle3 { cfg.feature_width() } else { 2 * d }]),
        (format!("{l}input_layernorm.weight"), vec![d]),
        (format!("{l}self_attn.q_proj.weight"), vec![q, a]),
        (format!("{l}self_attn.k_proj.weight"), vec![kv, a]),
        (format!("{l}self_attn.v_proj.weight"), vec![kv, a]),
        (format!("{l}self_attn.o_proj.weight"), vec![d, q]),
        (format!("{l}post_attention_layernorm.weight"), vec![d]),
        (format!("{l}mlp.gate_proj.weight"), vec![i, d]),
        (format!("{l}mlp.up_proj.weight"), vec![i, d]),
        (format!("{l}mlp.down_proj.weight"), vec![d, i]),
        ("model.norm.weight".into(), vec![d]),
    ];
    if eagle3 {
        names.push((format!("{l}hidden_norm.weight"), vec![d]));
        names.push(("lm_head.weight".into(), vec![c.vocab_size, d]));
    } else {
        names.push(("fc.bias".into(), vec![d]));
    }
    names
}

/// The inference copy: fast CPU kernels, a KV cache per generation.
pub struct DraftLayer {
    cfg: DraftLayerConfig,
    /// `[f, e] -> d`: mixes the feature with the next token's embedding.
    fc: Linear,
    /// The decoder layer, its final norm and the draft-vocabulary slice of the target's lm_head.
    llama: Llama,
    /// Token id of each draft-vocabulary slot, ascending.
    ids: Vec<u32>,
    tensors: HashMap<String, Tensor>,
    /// The f32 weights were dropped ([`DraftLayer::release_f32_weights`]).
    released: bool,
}

impl DraftLayer {
    /// Build from trained tensors (names of [`tensor_names`]) and the draft vocabulary's ids.
    pub fn from_tensors(tensors: HashMap<String, Tensor>, ids: Vec<u32>, mut cfg: DraftLayerConfig, target: &Llama) -> Result<Self> {
        fit_to_target(&mut cfg, &ids, &|n: &str| tensors.get(n).map(|t| t.dims().to_vec()), target)?;
        let device = target.device().clone();
        let mut map: HashMap<String, Tensor> = HashMap::new();
        for (k, v) in &tensors {
            map.insert(k.clone(), v.to_dtype(DType::F32)?.to_device(&device)?);
        }
        // The layer's "embedding" and lm_head (tied; the embedding is never read: inputs come
        // through `fc`): EAGLE's are the target's lm_head rows of the draft vocabulary,
        // EAGLE-3's its own.
        let lm = match map.get("lm_head.weight") {
            Some(w) => w.clone(),
            None => target.lm_head_rows(&ids)?.to_device(&device)?.contiguous()?,
        };
        map.insert("model.embed_tokens.weight".into(), lm);
        let fc = Linear::new_packed(map["fc.weight"].clone(), map.get("fc.bias").cloned())?;
        let llama = Llama::load(VarBuilder::from_tensors(map.clone(), DType::F32, &device), &cfg.layer)?;
        let tensors = tensor_names(&cfg).into_iter().map(|(n, _)| (n.clone(), map[&n].clone())).collect();
        Ok(DraftLayer { cfg, fc, llama, ids, tensors, released: false })
    }

    /// Load `draft.json` + `draft.safetensors` from `dir` for `target`, refusing a layer
    /// trained for another model.
    pub fn from_dir(dir: &Path, target: &Target) -> Result<Self> {
        let cfg = read_config(dir, target)?;
        let w_path = dir.join(LAYER_WEIGHTS_FILE);
        let ts = candle_core::safetensors::load(&w_path, &Device::Cpu).map_err(|e| Error::bad_file(&w_path, format!("not a readable safetensors file: {e}")))?;
        let mut ts = dequantize_stored(ts).map_err(|e| Error::bad_file(&w_path, e))?;
        crate::files::check_finite(&ts, &w_path)?;
        let ids = ts.remove("draft_vocab").ok_or_else(|| Error::bad_file(&w_path, "no draft_vocab tensor"))?;
        let ids: Vec<u32> = ids.to_dtype(DType::F32)?.to_vec1::<f32>()?.into_iter().map(|x| x as u32).collect();
        let mut layer = Self::from_tensors(ts, ids, cfg, &target.model).map_err(|e| Error::bad_file(&w_path, e.to_string()))?;
        crate::cpu::quant::with_block_fallback(target.model.weight_format(), |f| layer.set_format(f))?;
        Ok(layer)
    }

    /// Load `dir` only to draft, in 4-bit blocks on the CPU (`native`, the default drafting
    /// format), without an f32 detour: the stored 4-bit rows are the kernels' blocks as they
    /// are (the blocks the f32 path would make again: re-quantizing a Q4_1 block gives the same
    /// block). Why: the f32 path made the trained weights in f32, a packed f32 copy of them and
    /// the blocks twice over, for a 6 MB file, and kept the readout's rows in f32 as a tied
    /// embedding table nothing reads (19 MB for SmolLM2's EAGLE-3 layer). Only norms stay f32.
    /// The layer keeps only what it drafts with, as
    /// after [`DraftLayer::release_f32_weights`]. None where this does not apply (another format
    /// or device; a file that is not exactly this layer's tensors, every matrix in 4-bit rows):
    /// [`DraftLayer::from_dir`] loads those.
    pub fn from_dir_packed(dir: &Path, target: &Target, format: WeightFormat) -> Result<Option<Self>> {
        if format != WeightFormat::Native || !target.model.device().is_cpu() {
            return Ok(None);
        }
        // Only a file of exactly this layer's tensors, every matrix in 4-bit rows, takes this
        // path; anything else (8-bit or f32 files, extra or doubled tensors) goes the f32 way,
        // which reads or refuses it as before. Decided from the config and the file's header,
        // before the costlier checks (the target's fingerprint), which each path makes once.
        let cfg_path = dir.join(LAYER_CONFIG_FILE);
        let Ok(peek) = serde_json::from_str::<DraftLayerConfig>(&crate::files::read_config(&cfg_path)?) else { return Ok(None) };
        let w_path = dir.join(LAYER_WEIGHTS_FILE);
        let bad = |m: String| Error::bad_file(&w_path, m);
        let bytes = std::fs::read(&w_path).map_err(|e| Error::io(&w_path, e))?;
        let Ok(file) = candle_core::safetensors::SliceSafetensors::new(&bytes) else { return Ok(None) };
        let stored: std::collections::BTreeSet<String> = file.tensors().into_iter().map(|(n, _)| n).collect();
        let names = tensor_names(&peek);
        let wanted: std::collections::BTreeSet<String> =
            names.iter().map(|(n, s)| if s.len() == 2 { format!("{n}{Q4_SUFFIX}") } else { n.clone() }).chain(["draft_vocab".to_string()]).collect();
        if stored != wanted {
            return Ok(None);
        }
        let mut cfg = check_config(peek, dir, target)?;
        let mut ts = HashMap::new();
        let mut blocks = HashMap::new();
        for (n, s) in &names {
            if s.len() == 2 {
                let q = file.load(&format!("{n}{Q4_SUFFIX}"), &Device::Cpu).map_err(|e| bad(format!("{n}: {e}")))?;
                let rows = q4_rows(n, &q).map_err(bad)?;
                if [rows.n, rows.k] != s[..] {
                    return Err(bad(format!("{n} has shape {:?}, expected {s:?}", [rows.n, rows.k])));
                }
                blocks.insert(n.clone(), rows);
            } else {
                // Norms and biases in f32, whatever the file stored them in.
                ts.insert(n.clone(), file.load(n, &Device::Cpu).and_then(|t| t.to_dtype(DType::F32)).map_err(|e| bad(format!("{n}: {e}")))?);
            }
        }
        ts.insert("draft_vocab".into(), file.load("draft_vocab", &Device::Cpu).map_err(|e| bad(format!("draft_vocab: {e}")))?);
        drop(bytes);
        crate::files::check_finite(&ts, &w_path)?;
        let ids = ts.remove("draft_vocab").ok_or_else(|| bad("no draft_vocab tensor".into()))?;
        let ids: Vec<u32> = ids.to_dtype(DType::F32)?.to_vec1::<f32>()?.into_iter().map(|x| x as u32).collect();
        let dims = |n: &str| blocks.get(n).map(|q: &crate::cpu::quant::QuantRows| vec![q.n, q.k]).or_else(|| ts.get(n).map(|t| t.dims().to_vec()));
        fit_to_target(&mut cfg, &ids, &dims, &target.model).map_err(|e| bad(e.to_string()))?;
        // The tied "embedding" (never read for tokens) and the readout: EAGLE-3's own lm_head,
        // or an EAGLE layer's slice of the target's lm_head rows, put in blocks here.
        let head = match blocks.get("lm_head.weight") {
            Some(q) => q.clone(),
            None => {
                let rows = target.model.lm_head_rows(&ids)?;
                let (n, k) = rows.dims2()?;
                crate::cpu::quant::QuantRows::quantize_q4_1(&rows.flatten_all()?.to_vec1::<f32>()?, n, k)?
            }
        };
        blocks.insert("model.embed_tokens.weight".into(), head);
        let fc_bias = ts.get("fc.bias").cloned();
        let fc = Linear::packed_only(crate::cpu::quant::Staged::Blocks(blocks["fc.weight"].clone()).pack()?, fc_bias);
        let llama = Llama::build(&StoredLayer { f32s: &ts, blocks: &blocks }, &cfg.layer, WeightFormat::Native, &Device::Cpu).map_err(|e| bad(e.to_string()))?;
        Ok(Some(DraftLayer { cfg, fc, llama, ids, tensors: HashMap::new(), released: true }))
    }

    /// Write `draft.safetensors` (weights stored as `store` says) and `draft.json` into `dir`,
    /// each atomically.
    pub fn save_as(&self, dir: &Path, store: StoreFormat) -> Result<()> {
        self.weights()?;
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let mut ts: HashMap<String, Tensor> = HashMap::new();
        for (n, t) in &self.tensors {
            match store {
                StoreFormat::F32 => {
                    ts.insert(n.clone(), t.clone());
                }
                StoreFormat::F16 => {
                    ts.insert(n.clone(), t.to_dtype(DType::F16)?);
                }
                StoreFormat::Q8 => match quantize_q8(t)? {
                    Some((q, scale)) => {
                        ts.insert(format!("{n}{Q8_SUFFIX}"), q);
                        ts.insert(format!("{n}{Q8_SCALE_SUFFIX}"), scale);
                    }
                    None => {
                        ts.insert(n.clone(), t.to_dtype(DType::F16)?);
                    }
                },
                StoreFormat::Q4 => match quantize_q4(t)? {
                    Some(q) => {
                        ts.insert(format!("{n}{Q4_SUFFIX}"), q);
                    }
                    // Norms and biases (a few KB) stay f32: native drafting reads them so.
                    None => {
                        ts.insert(n.clone(), t.clone());
                    }
                },
            }
        }
        let v: Vec<f32> = self.ids.iter().map(|&i| i as f32).collect();
        ts.insert("draft_vocab".into(), Tensor::from_vec(v, self.ids.len(), &Device::Cpu)?);
        crate::files::save_safetensors(&ts, None, &dir.join(LAYER_WEIGHTS_FILE))?;
        let json = serde_json::to_string_pretty(&self.cfg).expect("config serialises");
        crate::files::write_atomic(&dir.join(LAYER_CONFIG_FILE), json.as_bytes())
    }

    /// Fast-path format of every projection. `Native` means 4-bit blocks (Q4_1) of every
    /// matrix, the draft vocabulary's slice of lm_head included: the layer has no GGUF blocks of
    /// its own, and drafts need not be exact (verification decides what is emitted). Why 4-bit:
    /// a level reads the layer's and the slice's weights again, and from 8-bit blocks that was
    /// 0.2 ms of a 2.3 ms native step; 4-bit blocks cut drafting and the drafter's commit by a
    /// fifth to a third with τ within 0.03 (12 bundled prompts, native and f32 targets).
    pub fn set_format(&mut self, format: WeightFormat) -> Result<()> {
        self.weights()?;
        if format != WeightFormat::Native || !self.fc.weight()?.device().is_cpu() {
            // Off the CPU the formats fall back to candle's f32, as for the target.
            let format = if format == WeightFormat::Native { WeightFormat::Q8_0 } else { format };
            self.fc.set_format(format, None)?;
            return self.llama.set_weights(format, &crate::model::NativeWeights::new());
        }
        let q4 = |t: &Tensor| -> Result<crate::cpu::quant::QuantRows> {
            let (n, k) = t.dims2()?;
            crate::cpu::quant::QuantRows::quantize_q4_1(&t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?, n, k)
        };
        let mut blocks = crate::model::NativeWeights::new();
        for (name, t) in &self.tensors {
            if t.rank() == 2 && name != "fc.weight" && name != "lm_head.weight" {
                blocks.insert(name.clone(), crate::model::NativeWeight::Blocks(q4(t)?));
            }
        }
        blocks.insert("model.embed_tokens.weight".into(), crate::model::NativeWeight::Blocks(q4(self.llama.lm_head().weight()?)?));
        self.fc.set_format(WeightFormat::Native, Some(&q4(self.fc.weight()?)?))?;
        self.llama.set_weights(WeightFormat::Native, &blocks)
    }

    pub fn with_recipe(mut self, recipe: serde_json::Value) -> Self {
        self.cfg.recipe = recipe;
        self
    }
    pub fn config(&self) -> &DraftLayerConfig {
        &self.cfg
    }
    /// The trained tensors by name (f32), e.g. to continue training from them; an error after
    /// [`DraftLayer::release_f32_weights`].
    pub fn weights(&self) -> Result<&HashMap<String, Tensor>> {
        if self.released {
            return Err(Error::InvalidArgument("this draft layer kept only its packed weights (it was loaded for drafting); load it again to train from or save it".into()));
        }
        Ok(&self.tensors)
    }

    /// Keep only the packed copies the layer drafts with: its f32 weights (by parameter count
    /// 17 MB for SmolLM2's layer, about 1 GB for an 8B model's) are read only to re-pack, save
    /// or train. Afterwards those refuse. A no-op in f32 or off the CPU. The draft vocabulary's
    /// f32 rows stay: they are the tied embedding table the lm_head shares.
    pub fn release_f32_weights(&mut self) {
        let f32_or_gpu = self.llama.weight_format() == WeightFormat::F32 || !self.llama.device().is_cpu();
        if f32_or_gpu {
            return;
        }
        self.llama.release_f32_weights();
        if self.fc.format_name().is_some() {
            self.fc = Linear::packed_only_from(&self.fc);
        }
        self.tensors.clear();
        self.released = true;
    }
    pub fn draft_vocab(&self) -> &[u32] {
        &self.ids
    }

    pub fn new_cache(&self) -> Result<KvCache> {
        self.llama.new_cache()
    }

    /// Predicted next features `[T, d]` for pairs (feature `feats[i]`, token `tokens[i]`) at
    /// `positions`, attending to everything in `cache` and to each other as `mask` says.
    pub fn forward(&self, feats: &Tensor, tokens: &[u32], positions: &[usize], mask: &TreeMask, cache: &mut KvCache, target: &Llama) -> Result<Tensor> {
        self.forward_after(feats, tokens, positions, mask, 0, cache, target)
    }

    /// [`DraftLayer::forward`] for one level of a growing draft tree: the last `tail` slots of
    /// `cache` hold the tree's earlier levels, and `mask` covers them and then the new pairs
    /// (see [`Llama::forward_embeds_after`]).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_after(&self, feats: &Tensor, tokens: &[u32], positions: &[usize], mask: &TreeMask, tail: usize, cache: &mut KvCache, target: &Llama) -> Result<Tensor> {
        if feats.dim(0)? != tokens.len() {
            return Err(Error::InvalidArgument(format!("draft layer: {} features for {} tokens", feats.dim(0)?, tokens.len())));
        }
        let e = target.embed(tokens)?;
        let d = self.cfg.layer.hidden_size;
        let width = feats.dim(1)?;
        match &self.cfg.arch {
            DraftArch::Eagle => {
                // The target's final states (the first `d` columns of a wider forward).
                let f = if width > d { feats.narrow(1, 0, d)? } else { feats.clone() };
                let x = Tensor::cat(&[&f, &e], 1)?.contiguous()?;
                let x = self.fc.forward(&x)?;
                self.llama.forward_embeds_after(&x, positions, mask, tail, cache)
            }
            DraftArch::Eagle3 { layers } => {
                // Its own outputs come back `d` wide; the target's forward is its final states
                // and then the tapped layers' inputs, which `fc` fuses.
                let fused = self.cfg.feature_width();
                let g = if width == d {
                    feats.clone()
                } else if width == d + fused {
                    self.fc.forward(&feats.narrow(1, d, fused)?.contiguous()?)?
                } else {
                    return Err(Error::InvalidArgument(format!(
                        "this EAGLE-3 layer reads the inputs of target layers {layers:?} ({fused} values a token beside the final {d}); the target returned {width}: attach the drafter to the target first (Drafter::attach)"
                    )));
                };
                self.llama.forward_fused_after(&g, &e, positions, mask, tail, cache)
            }
        }
    }

    /// Check that `hidden`, rows of a target forward, carry what this layer reads: an
    /// EAGLE-3 layer's own outputs are as wide as the target's final states, so a target not
    /// attached ([`crate::draft::drafter::Drafter::attach`]) would otherwise pass unnoticed.
    pub fn check_target_states(&self, hidden: &Tensor) -> Result<()> {
        let d = self.cfg.layer.hidden_size;
        let want = match self.cfg.arch {
            DraftArch::Eagle => d,
            DraftArch::Eagle3 { .. } => d + self.cfg.feature_width(),
        };
        let got = hidden.dim(1)?;
        if got < want || (got != want && matches!(self.cfg.arch, DraftArch::Eagle3 { .. })) {
            return Err(Error::InvalidArgument(format!(
                "this draft layer reads target rows of {want} values (final states and target layers {:?}); the target returned {got}: attach the drafter to the target first (Drafter::attach)",
                self.feature_layers()
            )));
        }
        Ok(())
    }

    /// The target layers whose inputs this layer reads (none: the final states).
    pub fn feature_layers(&self) -> &[usize] {
        self.cfg.arch.feature_layers()
    }

    /// Each row's top-`k` guesses for the next token as (token id, probability within the draft
    /// vocabulary), best first.
    pub fn top_k(&self, feats: &Tensor, k: usize) -> Result<Vec<Vec<(u32, f32)>>> {
        let logits = match self.cfg.arch {
            DraftArch::Eagle => self.llama.logits(feats)?,
            DraftArch::Eagle3 { .. } => self.llama.logits(&self.llama.final_norm(feats)?)?,
        };
        let rows = crate::cpu::reduce::top_k_rows(&logits, k)?;
        Ok(rows.into_iter().map(|r| r.into_iter().map(|(i, p)| (self.ids[i as usize], p)).collect()).collect())
    }
}

/// The trainable copy: variables in a [`VarMap`], a forward made of differentiable candle ops
/// and [`crate::draft::grad::linear`] only (the inference kernels have no backward pass), and
/// the same arithmetic as [`DraftLayer::forward`] up to rounding.
pub struct TrainLayer {
    pub cfg: DraftLayerConfig,
    w: HashMap<String, Tensor>,
    /// Draft-vocabulary slice of the target's lm_head (frozen).
    proj: Tensor,
    /// `proj` transposed, contiguous: what the fused loss's forward and [`Self::target_logits`]
    /// read (see [`Readout::Frozen`]).
    proj_t: Tensor,
    cos: Tensor,
    sin: Tensor,
}

impl TrainLayer {
    /// Fresh variables in `varmap`, initialised from `seed` (so a resumed run can rebuild the
    /// same start): small random projections, unit norms, and an `fc` that starts by passing the
    /// feature through.
    pub fn init(varmap: &VarMap, cfg: DraftLayerConfig, ids: &[u32], target: &Llama, seed: u64) -> Result<Self> {
        let device = target.device().clone();
        let mut rng = crate::decode::sampling::rng(seed ^ 0xea61e);
        let d = cfg.layer.hidden_size;
        let mut w = HashMap::new();
        {
            let mut data = varmap.data().lock().unwrap();
            let eagle3 = matches!(cfg.arch, DraftArch::Eagle3 { .. });
            let fw = cfg.feature_width();
            for (name, shape) in tensor_names(&cfg) {
                let n: usize = shape.iter().product();
                let values: Vec<f32> = if name.ends_with("norm.weight") {
                    vec![1.0; n]
                } else if name == "fc.bias" {
                    vec![0.0; n]
                } else if name == "lm_head.weight" {
                    // EAGLE-3's own head starts as the target's rows of the draft vocabulary.
                    target.lm_head_rows(ids)?.flatten_all()?.to_vec1::<f32>()?
                } else if name == "fc.weight" && eagle3 {
                    // [0 | 0 | I] + small noise: start from "the highest tapped layer's input".
                    (0..n).map(|i| {
                        let (r, c) = (i / fw, i % fw);
                        if c == fw - d + r { 1.0 } else { (rng.random::<f32>() - 0.5) * 0.02 }
                    }).collect()
                } else if name == "fc.weight" {
                    // [I | small noise]: start from "the next feature is like this one".
                    (0..n).map(|i| {
                        let (r, c) = (i / (2 * d), i % (2 * d));
                        if c == r { 1.0 } else { (rng.random::<f32>() - 0.5) * 0.02 }
                    }).collect()
                } else {
                    let fan_in = shape[1] as f32;
                    let a = (3.0 / fan_in).sqrt() * 0.5;
                    (0..n).map(|_| (rng.random::<f32>() * 2.0 - 1.0) * a).collect()
                };
                let var = candle_core::Var::from_tensor(&Tensor::from_vec(values, shape.as_slice(), &device)?)?;
                w.insert(name.clone(), var.as_tensor().clone());
                data.insert(name, var);
            }
        }
        let proj = target.lm_head_rows(ids)?.to_device(&device)?.contiguous()?;
        let proj_t = Readout::transposed(&proj)?;
        let (cos, sin) = crate::model::rope_tables(&cfg.layer, &device)?;
        Ok(TrainLayer { cfg, w, proj, proj_t, cos, sin })
    }

    /// Predicted features `[T, d]` for one sequence of pairs (`feats[t]`, `embs[t]`) at positions
    /// 0..T, causally. `feats`: the target's forward rows (final states, then any tapped
    /// layers' inputs).
    pub fn forward(&self, feats: &Tensor, embs: &Tensor) -> Result<Tensor> {
        Ok(self.forward_unrolled(feats, std::slice::from_ref(embs))?.remove(0))
    }

    /// What step 0 reads from the target's forward rows `h [T, d × (1 + layers)]`: EAGLE's
    /// final states, or EAGLE-3's tapped layers' inputs.
    fn step0_features(&self, h: &Tensor) -> Result<Tensor> {
        let d = self.cfg.layer.hidden_size;
        let (at, width) = match self.cfg.arch {
            DraftArch::Eagle => (0, d),
            DraftArch::Eagle3 { .. } => (d, self.cfg.feature_width()),
        };
        if h.dim(1)? < at + width {
            return Err(Error::InvalidArgument(format!("the target's states are {} wide; this draft layer reads columns {at}..{}", h.dim(1)?, at + width)));
        }
        Ok(h.narrow(1, at, width)?)
    }

    /// Training-time test (EAGLE-3): step 0 runs the pairs (f_t, e_{t+1}) as [`Self::forward`];
    /// step s feeds row t its own step s-1 prediction with the embedding `embs[s][t]`, at
    /// position t+s, attending to the real pairs 0..=t and to its own chain of earlier steps,
    /// exactly as a chain drafted at inference would. Returns the predictions of every step.
    pub fn forward_unrolled(&self, feats: &Tensor, embs: &[Tensor]) -> Result<Vec<Tensor>> {
        let c = &self.cfg.layer;
        let t = feats.dim(0)?;
        let (nh, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
        let eps = c.rms_norm_eps as f32;
        let w = |n: &str| -> &Tensor { &self.w[n] };
        let lin = |x: &Tensor, n: &str| -> Result<Tensor> { crate::draft::grad::linear(x, w(n)) };
        let l = "model.layers.0.";
        let group = nh / nkv;
        // [t, nkv, hd] -> [nh, t, hd]
        let expand = |x: &Tensor| -> Result<Tensor> {
            let x = x.transpose(0, 1)?;
            Ok(x.unsqueeze(1)?.expand((nkv, group, t, hd))?.reshape((nh, t, hd))?)
        };
        let mask: Vec<f32> = (0..t * t).map(|i| if i % t <= i / t { 0.0 } else { -1e9 }).collect();
        let mask = Tensor::from_vec(mask, (t, t), feats.device())?;
        let scale = 1.0 / (hd as f64).sqrt();
        let mut kv0: Option<(Tensor, Tensor)> = None;
        let mut chain: Vec<(Tensor, Tensor)> = Vec::new();
        let eagle3 = matches!(self.cfg.arch, DraftArch::Eagle3 { .. });
        let mut f = self.step0_features(feats)?;
        let mut outs = Vec::with_capacity(embs.len());
        for (s, e) in embs.iter().enumerate() {
            if s + t > self.cos.dim(0)? {
                return Err(Error::InvalidArgument(format!("sequence of {t} pairs unrolled {s} steps passes the rope table")));
            }
            // `x` starts the residual stream; `h` is what the attention reads.
            let (x, h) = if eagle3 {
                // Step 0 fuses the target's layers; later steps take the layer's own output.
                let g = if s == 0 { lin(&f, "fc.weight")? } else { f.clone() };
                let en = candle_nn::ops::rms_norm_slow(e, w(&format!("{l}input_layernorm.weight")), eps)?;
                let gn = candle_nn::ops::rms_norm_slow(&g, w(&format!("{l}hidden_norm.weight")), eps)?;
                (g, Tensor::cat(&[&en, &gn], 1)?)
            } else {
                let x = Tensor::cat(&[&f, e], 1)?;
                let x = lin(&x, "fc.weight")?.broadcast_add(w("fc.bias"))?;
                let h = candle_nn::ops::rms_norm_slow(&x, w(&format!("{l}input_layernorm.weight")), eps)?;
                (x, h)
            };
            let q = lin(&h, &format!("{l}self_attn.q_proj.weight"))?.reshape((t, nh, hd))?;
            let k = lin(&h, &format!("{l}self_attn.k_proj.weight"))?.reshape((t, nkv, hd))?;
            let v = lin(&h, &format!("{l}self_attn.v_proj.weight"))?.reshape((t, nkv, hd))?;
            let (cos, sin) = (self.cos.narrow(0, s, t)?, self.sin.narrow(0, s, t)?);
            let (q, k) = (rope(&q, &cos, &sin)?, rope(&k, &cos, &sin)?);
            let q = q.transpose(0, 1)?.contiguous()?; // [nh, t, hd]
            let (k, v) = (expand(&k)?.contiguous()?, expand(&v)?.contiguous()?);
            if s == 0 {
                kv0 = Some((k, v));
            } else {
                chain.push((k, v));
            }
            let (k0, v0) = kv0.as_ref().expect("step 0 ran first");
            let mut scores = vec![(q.matmul(&k0.t()?)? * scale)?.broadcast_add(&mask)?];
            for (kj, _) in &chain {
                scores.push(((&q * kj)?.sum_keepdim(D::Minus1)? * scale)?);
            }
            let p = candle_nn::ops::softmax(&Tensor::cat(&scores, D::Minus1)?, D::Minus1)?;
            let mut a = p.narrow(D::Minus1, 0, t)?.matmul(v0)?;
            for (j, (_, vj)) in chain.iter().enumerate() {
                a = (a + p.narrow(D::Minus1, t + j, 1)?.broadcast_mul(vj)?)?;
            }
            let a = a.transpose(0, 1)?.reshape((t, nh * hd))?;
            let x = (x + lin(&a, &format!("{l}self_attn.o_proj.weight"))?)?;
            let h = candle_nn::ops::rms_norm_slow(&x, w(&format!("{l}post_attention_layernorm.weight")), eps)?;
            let g = lin(&h, &format!("{l}mlp.gate_proj.weight"))?;
            let u = lin(&h, &format!("{l}mlp.up_proj.weight"))?;
            let m = lin(&(g.silu()? * u)?, &format!("{l}mlp.down_proj.weight"))?;
            // EAGLE feeds back (and scores) the normed output; EAGLE-3 feeds back the output
            // before the final norm and scores it after ([`Self::logits`]).
            f = if eagle3 { (x + m)? } else { candle_nn::ops::rms_norm_slow(&(x + m)?, w("model.norm.weight"), eps)? };
            outs.push(f.clone());
        }
        Ok(outs)
    }

    /// Draft-vocabulary logits of predicted features (of [`Self::forward_unrolled`]).
    pub fn logits(&self, f: &Tensor) -> Result<Tensor> {
        let (x, readout) = self.head(f)?;
        Ok(x.matmul(&readout.w().t()?)?)
    }

    /// The readout's input and weight for features `f`: the EAGLE layer reads `f` through the
    /// target's frozen lm_head rows, EAGLE-3's normed `f` through its own head, which trains.
    /// `logits(f) = x · wᵀ`.
    pub fn head(&self, f: &Tensor) -> Result<(Tensor, Readout<'_>)> {
        match self.cfg.arch {
            DraftArch::Eagle => Ok((f.clone(), Readout::Frozen { w: &self.proj, wt: Some(&self.proj_t) })),
            DraftArch::Eagle3 { .. } => {
                let eps = self.cfg.layer.rms_norm_eps as f32;
                let n = candle_nn::ops::rms_norm_slow(f, &self.w["model.norm.weight"], eps)?;
                Ok((n, Readout::Trained(&self.w["lm_head.weight"])))
            }
        }
    }

    /// The target's own logits over the draft vocabulary from its forward rows `h` (final
    /// states first): the labels' distribution.
    pub fn target_logits(&self, h: &Tensor) -> Result<Tensor> {
        let d = self.cfg.layer.hidden_size;
        Ok(h.narrow(1, 0, d)?.matmul(&self.proj_t)?)
    }

    /// The current weights, detached, for [`DraftLayer::from_tensors`].
    pub fn tensors(&self) -> Result<HashMap<String, Tensor>> {
        self.w.iter().map(|(k, v)| Ok((k.clone(), v.detach().copy()?))).collect()
    }
}

/// Rotary embedding (non-interleaved halves, as Llama) of `x [t, heads, hd]` from differentiable ops.
fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let hd = x.dim(2)?;
    let half = hd / 2;
    let (x1, x2) = (x.narrow(2, 0, half)?, x.narrow(2, half, half)?);
    let (c, s) = (cos.unsqueeze(1)?, sin.unsqueeze(1)?);
    let a = (x1.broadcast_mul(&c)? - x2.broadcast_mul(&s)?)?;
    let b = (x1.broadcast_mul(&s)? + x2.broadcast_mul(&c)?)?;
    Ok(Tensor::cat(&[a, b], 2)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_matches_candle() {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (5, 3, 8), &dev).unwrap();
        let cos = Tensor::randn(0f32, 1.0, (5, 4), &dev).unwrap();
        let sin = Tensor::randn(0f32, 1.0, (5, 4), &dev).unwrap();
        let ours = rope(&x, &cos, &sin).unwrap();
        let theirs = candle_nn::rotary_emb::rope_thd(&x.unsqueeze(0).unwrap(), &cos, &sin).unwrap().squeeze(0).unwrap();
        let diff = (ours - theirs).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff < 1e-5, "{diff}");
    }
}
