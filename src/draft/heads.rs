//! Medusa-style draft heads: K small residual blocks on the target's last hidden state, each
//! guessing one more token ahead, all feeding the target's frozen lm_head (or an own copy).
//!
//! Head k (0-based) reading the hidden state at position t guesses token t+k+2: the target's own
//! lm_head already predicts t+1.
use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_nn::{Module, VarBuilder, VarMap};
use serde::{Deserialize, Serialize};

use crate::model::loader::{Fingerprint, Target};
use crate::cpu::quant::WeightFormat;
use crate::cpu::reduce::top_k_rows;
use crate::{Error, Result};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HeadsConfig {
    pub num_heads: usize,
    /// Residual blocks per head.
    pub num_layers: usize,
    pub hidden_size: usize,
    pub vocab_size: usize,
    /// false: the heads share the target's lm_head (the default, as in Medusa-2 and TGI).
    pub own_lm_head: bool,
    /// Which target these heads were trained for.
    pub target: Fingerprint,
    /// Size of the frequency-ranked draft vocabulary (FR-Spec style): heads score only these
    /// tokens, which makes drafting and training several times cheaper. None = the full vocabulary.
    /// Verification always uses the full target, so this never affects exactness.
    #[serde(default)]
    pub draft_vocab_size: Option<usize>,
    /// Token-aware heads (Hydra-style): the first block also reads the embedding of the root
    /// token, the one the target's lm_head just produced from the same hidden state, which plain
    /// Medusa heads must guess blindly. Zero-initialised, so training starts from plain Medusa.
    #[serde(default)]
    pub token_aware: bool,
    /// How they were made (command line, data, accuracy): free-form, for the record.
    #[serde(default)]
    pub recipe: serde_json::Value,
}

/// One residual block `h + SiLU(W h + b)`; W starts at zero so a fresh head is the identity.
struct ResBlock {
    lin: candle_nn::Linear,
}

pub struct Heads {
    cfg: HeadsConfig,
    blocks: Vec<Vec<ResBlock>>,
    own: Vec<candle_nn::Linear>,
    /// Per head, the root-token projection of a token-aware first block.
    token_proj: Vec<candle_nn::Linear>,
    /// Token ids of the draft vocabulary, ascending, and their slice of the target's lm_head
    /// (also as a packed layer for fast drafting).
    draft_vocab: Option<(Vec<u32>, Tensor)>,
    draft_proj: Option<crate::model::Linear>,
    /// Inference copy of every head's first block as one layer over `[h, root embedding]`:
    /// one kernel call instead of 2K small matmuls per drafting step.
    draft_first: Option<crate::model::Linear>,
}

/// Most heads, and most layers per head, a heads drafter may have: what the loader accepts (so
/// `train` refuses more up front rather than write heads nothing can load).
pub const MAX_HEADS: usize = 64;
pub const MAX_HEAD_LAYERS: usize = 16;
pub const WEIGHTS_FILE: &str = "heads.safetensors";
pub const CONFIG_FILE: &str = "heads.json";
/// vLLM's Medusa weights file.
pub const VLLM_MEDUSA_WEIGHTS: &str = "model.safetensors";

/// Check a Medusa-format `config.json` (`c`, read from `cfg_path` in `dir`) against `target` as
/// far as it records the base model: the sizes both Medusa formats have, and the fingerprint
/// selfspec's exports add. Returns the target's fingerprint.
fn check_medusa_base(c: &serde_json::Value, cfg_path: &Path, dir: &Path, target: &Target) -> Result<Fingerprint> {
    let mcfg = target.model.config();
    let here = target.fingerprint()?;
    let mismatch = |recorded: String| Error::HeadsMismatch { heads: dir.to_path_buf(), heads_target: recorded, model_target: here.to_string() };
    for (key, want) in [("hidden_size", mcfg.hidden_size), ("vocab_size", mcfg.vocab_size)] {
        if let Some(v) = c[key].as_u64().filter(|&v| v as usize != want) {
            return Err(mismatch(format!("a model with {key} {v}")));
        }
    }
    if let Some(fp) = c.get("selfspec_target").filter(|v| !v.is_null()) {
        let fp: Fingerprint = serde_json::from_value(fp.clone()).map_err(|e| Error::bad_file(cfg_path, format!("invalid selfspec_target: {e}")))?;
        if fp != here {
            return Err(mismatch(fp.to_string()));
        }
    }
    Ok(here)
}

impl Heads {
    /// Build from a VarBuilder holding `heads.{k}.blocks.{l}.{weight,bias}` (and
    /// `heads.{k}.lm_head.weight` with an own lm_head). With a VarMap-backed builder whose
    /// initialiser is zero, this is a fresh (identity) set of heads ready for training.
    pub fn load(vb: VarBuilder, cfg: &HeadsConfig) -> Result<Self> {
        let d = cfg.hidden_size;
        let mut blocks = Vec::with_capacity(cfg.num_heads);
        let mut own = Vec::new();
        let mut token_proj = Vec::new();
        for k in 0..cfg.num_heads {
            let hv = vb.pp(format!("heads.{k}"));
            let mut bs = Vec::with_capacity(cfg.num_layers);
            for l in 0..cfg.num_layers {
                let bv = hv.pp(format!("blocks.{l}"));
                let w = bv.get_with_hints((d, d), "weight", candle_nn::Init::Const(0.0))?;
                let b = bv.get_with_hints(d, "bias", candle_nn::Init::Const(0.0))?;
                bs.push(ResBlock { lin: candle_nn::Linear::new(w, Some(b)) });
            }
            blocks.push(bs);
            if cfg.token_aware {
                let u = hv.get_with_hints((d, d), "blocks.0.token_weight", candle_nn::Init::Const(0.0))?;
                token_proj.push(candle_nn::Linear::new(u, None));
            }
            if cfg.own_lm_head {
                let rows = cfg.draft_vocab_size.unwrap_or(cfg.vocab_size);
                let w = hv.get_with_hints((rows, d), "lm_head.weight", candle_nn::Init::Const(0.0))?;
                own.push(candle_nn::Linear::new(w, None));
            }
        }
        let draft_vocab = match cfg.draft_vocab_size {
            Some(n) => {
                let ids = vb.get_with_hints(n, "draft_vocab", candle_nn::Init::Const(0.0))?;
                let ids: Vec<u32> = ids.to_dtype(DType::F32)?.to_vec1::<f32>()?.into_iter().map(|x| x as u32).collect();
                Some((ids, Tensor::zeros(1, DType::F32, vb.device())?))
            }
            None => None,
        };
        Ok(Heads { cfg: cfg.clone(), blocks, own, token_proj, draft_vocab, draft_proj: None, draft_first: None })
    }

    /// Restrict drafting to `ids` (ascending token ids), slicing `target_lm_head` to match.
    pub fn set_draft_vocab(&mut self, ids: Vec<u32>, target: &crate::model::Llama) -> Result<()> {
        let w = target.lm_head_rows(&ids)?.contiguous()?;
        self.cfg.draft_vocab_size = Some(ids.len());
        self.draft_proj = Some(crate::model::Linear::new_packed(w.clone(), None)?);
        self.draft_vocab = Some((ids, w));
        Ok(())
    }

    /// Store the draft vocabulary's projection in `format` (native means Q8_0: the slice of a
    /// quantized lm_head is requantised). Drafting reads it every step, so on a fast compact
    /// target an f32 copy would cost a noticeable share of the step; drafts need not be exact.
    pub fn set_draft_format(&mut self, format: WeightFormat) -> Result<()> {
        let format = if format == WeightFormat::Native { WeightFormat::Q8_0 } else { format };
        if let Some(p) = self.draft_proj.as_mut() {
            p.set_format(format, None)?;
        }
        // Rows of head k: [W_k | U_k] (U_k, the root-token projection, only for token-aware
        // heads), so the fused layer reads [h, e] and returns every head's pre-activation.
        let mut rows = Vec::with_capacity(self.blocks.len());
        let mut biases = Vec::with_capacity(self.blocks.len());
        for (k, bs) in self.blocks.iter().enumerate() {
            let Some(b0) = bs.first() else { return Ok(()) };
            let w = b0.lin.weight().clone();
            rows.push(if self.cfg.token_aware { Tensor::cat(&[&w, self.token_proj[k].weight()], 1)? } else { w });
            match b0.lin.bias() {
                Some(b) => biases.push(b.clone()),
                None => biases.push(Tensor::zeros(self.cfg.hidden_size, DType::F32, b0.lin.weight().device())?),
            }
        }
        let mut first = crate::model::Linear::new(Tensor::cat(&rows, 0)?.contiguous()?, Some(Tensor::cat(&biases, 0)?));
        first.set_format(format, None)?;
        self.draft_first = Some(first);
        Ok(())
    }

    /// Bind a loaded draft vocabulary to the target's lm_head rows.
    fn bind_draft_vocab(&mut self, target: &crate::model::Llama) -> Result<()> {
        if let Some((ids, _)) = self.draft_vocab.take() {
            if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.cfg.vocab_size) {
                return Err(Error::InvalidArgument(format!("draft vocabulary holds token {bad}, beyond the vocabulary")));
            }
            self.set_draft_vocab(ids, target)?;
        }
        Ok(())
    }

    /// The draft vocabulary's token ids, if restricted.
    pub fn draft_vocab(&self) -> Option<&[u32]> {
        self.draft_vocab.as_ref().map(|(ids, _)| ids.as_slice())
    }

    /// The projection the heads score with during training: own, the draft-vocabulary slice of
    /// lm_head, or lm_head itself.
    pub fn projection<'a>(&'a self, k: usize, target_lm_head: &'a Tensor) -> &'a Tensor {
        if self.cfg.own_lm_head {
            return self.own[k].weight();
        }
        match &self.draft_vocab {
            Some((_, w)) => w,
            None => target_lm_head,
        }
    }

    /// Fresh heads for training, their variables in `varmap`. An own lm_head starts as a copy
    /// of the target's.
    pub fn init(varmap: &VarMap, cfg: &HeadsConfig, target_lm_head: &Tensor, device: &Device) -> Result<Self> {
        let vb = VarBuilder::from_varmap(varmap, DType::F32, device);
        let heads = Self::load(vb, cfg)?;
        if cfg.own_lm_head {
            let data = varmap.data().lock().unwrap();
            for k in 0..cfg.num_heads {
                if let Some(v) = data.get(&format!("heads.{k}.lm_head.weight")) {
                    v.set(target_lm_head)?;
                }
            }
        }
        Ok(heads)
    }

    /// Attach how these heads were made; saved in heads.json.
    pub fn with_recipe(mut self, recipe: serde_json::Value) -> Self {
        self.cfg.recipe = recipe;
        self
    }

    pub fn config(&self) -> &HeadsConfig {
        &self.cfg
    }
    pub fn num_heads(&self) -> usize {
        self.cfg.num_heads
    }

    /// Per head, the transformed hidden states `[rows, d]` before the vocabulary projection.
    /// `root` holds the root tokens' embeddings `[rows, d]` (needed by token-aware heads).
    pub fn hidden(&self, h: &Tensor, root: Option<&Tensor>) -> Result<Vec<Tensor>> {
        let mut out = Vec::with_capacity(self.cfg.num_heads);
        for (k, bs) in self.blocks.iter().enumerate() {
            let mut x = h.clone();
            for (l, b) in bs.iter().enumerate() {
                let mut pre = b.lin.forward(&x)?;
                if l == 0 && self.cfg.token_aware {
                    let e = root.ok_or_else(|| Error::InvalidArgument("token-aware heads need the root token".into()))?;
                    pre = (pre + self.token_proj[k].forward(e)?)?;
                }
                x = (&x + candle_nn::ops::silu(&pre)?)?;
            }
            out.push(x);
        }
        Ok(out)
    }

    /// Draft logits `[K, draft vocab]` for one hidden state `[1, d]` whose lm_head output was
    /// `root`: one batched projection.
    pub fn draft_logits(&self, h: &Tensor, root: u32, target: &crate::model::Llama) -> Result<Tensor> {
        let h = if h.rank() == 1 { h.unsqueeze(0)? } else { h.clone() };
        let e = if self.cfg.token_aware { Some(target.embed(&[root])?) } else { None };
        let hs = match &self.draft_first {
            Some(first) => {
                let input = match &e {
                    Some(e) => Tensor::cat(&[&h, e], 1)?,
                    None => h.clone(),
                };
                let pre = first.forward(&input.contiguous()?)?;
                let d = self.cfg.hidden_size;
                let mut out = Vec::with_capacity(self.blocks.len());
                for (k, bs) in self.blocks.iter().enumerate() {
                    let mut x = (&h + candle_nn::ops::silu(&pre.narrow(1, k * d, d)?)?)?;
                    for b in bs.iter().skip(1) {
                        x = (&x + candle_nn::ops::silu(&b.lin.forward(&x)?)?)?;
                    }
                    out.push(x);
                }
                out
            }
            None => self.hidden(&h, e.as_ref())?,
        };
        if self.cfg.own_lm_head {
            let rows: Vec<Tensor> = hs.iter().zip(&self.own).map(|(x, l)| l.forward(x)).collect::<candle_core::Result<_>>()?;
            return Ok(Tensor::cat(&rows, 0)?);
        }
        let x = Tensor::cat(&hs, 0)?.contiguous()?;
        match &self.draft_proj {
            Some(p) => p.forward(&x),
            None => target.logits(&x),
        }
    }

    /// Each head's top-`k` guesses as (token id, probability within the draft vocabulary).
    pub fn draft_top_k(&self, h: &Tensor, root: u32, target: &crate::model::Llama, k: usize) -> Result<Vec<Vec<(u32, f32)>>> {
        let rows = top_k_rows(&self.draft_logits(h, root, target)?, k)?;
        Ok(match &self.draft_vocab {
            Some((ids, _)) => rows.into_iter().map(|r| r.into_iter().map(|(i, p)| (ids[i as usize], p)).collect()).collect(),
            None => rows,
        })
    }

    /// Training forward: `h [B, d]` (and root embeddings `[B, d]` for token-aware heads) ->
    /// logits `[K, B, vocab]`, differentiable in the heads only.
    pub fn train_logits(&self, h: &Tensor, root: Option<&Tensor>, target_lm_head: &Tensor) -> Result<Tensor> {
        let hs = self.hidden(h, root)?;
        let mut outs = Vec::with_capacity(hs.len());
        for (k, x) in hs.iter().enumerate() {
            outs.push(x.matmul(&self.projection(k, target_lm_head).t()?)?);
        }
        Ok(Tensor::stack(&outs, 0)?)
    }

    pub(crate) fn tensors(&self) -> HashMap<String, Tensor> {
        let mut m = HashMap::new();
        for (k, bs) in self.blocks.iter().enumerate() {
            for (l, b) in bs.iter().enumerate() {
                m.insert(format!("heads.{k}.blocks.{l}.weight"), b.lin.weight().clone());
                if let Some(bias) = b.lin.bias() {
                    m.insert(format!("heads.{k}.blocks.{l}.bias"), bias.clone());
                }
            }
        }
        for (k, l) in self.own.iter().enumerate() {
            m.insert(format!("heads.{k}.lm_head.weight"), l.weight().clone());
        }
        for (k, l) in self.token_proj.iter().enumerate() {
            m.insert(format!("heads.{k}.blocks.0.token_weight"), l.weight().clone());
        }
        if let Some((ids, w)) = &self.draft_vocab {
            // Stored as f32 (exact for ids below 2^24) so one dtype serves every tensor.
            let v: Vec<f32> = ids.iter().map(|&i| i as f32).collect();
            m.insert("draft_vocab".into(), Tensor::from_vec(v, ids.len(), w.device()).expect("vector tensor"));
        }
        m
    }

    /// Write `heads.safetensors` and `heads.json` into `dir`, each atomically.
    pub fn save(&self, dir: &Path) -> Result<()> {
        self.save_as(dir, false)
    }

    /// As [`Heads::save`]; with `half`, weights are stored as f16 (half the size; they load back
    /// as f32). Token ids stay exact.
    pub fn save_as(&self, dir: &Path, half: bool) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let mut ts = self.tensors();
        if half {
            for (name, t) in ts.iter_mut() {
                if name != "draft_vocab" {
                    *t = t.to_dtype(DType::F16)?;
                }
            }
        }
        crate::files::save_safetensors(&ts, None, &dir.join(WEIGHTS_FILE))?;
        let json = serde_json::to_string_pretty(&self.cfg).expect("config serialises");
        crate::files::write_atomic(&dir.join(CONFIG_FILE), json.as_bytes())
    }

    /// Load heads from `dir` for `target`, refusing heads trained for another model.
    pub fn from_dir(dir: &Path, target: &Target) -> Result<Self> {
        let cfg_path = dir.join(CONFIG_FILE);
        let w_path = dir.join(WEIGHTS_FILE);
        if !dir.is_dir() {
            return Err(Error::io(dir, std::io::Error::new(std::io::ErrorKind::NotFound, "heads directory not found")));
        }
        if !cfg_path.exists() || !w_path.exists() {
            if dir.join("medusa_lm_head.safetensors").exists() {
                return Self::import_medusa(dir, target);
            }
            if dir.join(VLLM_MEDUSA_WEIGHTS).exists() && dir.join("config.json").exists() {
                return Self::import_medusa_vllm(dir, target);
            }
            return Err(Error::bad_file(dir, format!("heads directory needs {CONFIG_FILE} and {WEIGHTS_FILE} (or the Medusa format's medusa_lm_head.safetensors + config.json, or vLLM's model.safetensors + config.json)")));
        }
        let s = crate::files::read_config(&cfg_path)?;
        let cfg: HeadsConfig = serde_json::from_str(&s).map_err(|e| Error::bad_file(&cfg_path, format!("invalid heads config: {e}")))?;
        let fp = target.fingerprint()?;
        if cfg.target != fp {
            return Err(Error::HeadsMismatch { heads: dir.to_path_buf(), heads_target: cfg.target.to_string(), model_target: fp.to_string() });
        }
        // The sizes that shape allocations, checked against the target before any is made.
        let mc = target.model.config();
        if !(1..=MAX_HEADS).contains(&cfg.num_heads) || cfg.num_layers > MAX_HEAD_LAYERS {
            return Err(Error::bad_file(&cfg_path, format!("{} heads of {} layers: expected 1 to {MAX_HEADS} heads of at most {MAX_HEAD_LAYERS} layers", cfg.num_heads, cfg.num_layers)));
        }
        if cfg.hidden_size != mc.hidden_size || cfg.vocab_size != mc.vocab_size || cfg.draft_vocab_size.is_some_and(|d| d == 0 || d > mc.vocab_size) {
            return Err(Error::bad_file(
                &cfg_path,
                format!("hidden {} / vocabulary {} / draft vocabulary {:?} do not fit the model's hidden {} and vocabulary {}", cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab_size, mc.hidden_size, mc.vocab_size),
            ));
        }
        let ts = crate::files::load_weights(&w_path)?;
        let vb = VarBuilder::from_tensors(ts, DType::F32, target.model.device());
        let mut heads = Self::load(vb, &cfg).map_err(|e| Error::bad_file(&w_path, e.to_string()))?;
        heads.bind_draft_vocab(&target.model).map_err(|e| Error::bad_file(&w_path, e.to_string()))?;
        crate::cpu::quant::with_block_fallback(target.model.weight_format(), |f| heads.set_draft_format(f))?;
        Ok(heads)
    }

    /// Write the FasterDecoding/Medusa format (`medusa_lm_head.safetensors` + `config.json`) that
    /// vLLM and TGI load. Medusa-1 heads carry their own vocabulary projection, so a shared
    /// lm_head is written out as a copy in each head.
    pub fn export_medusa(&self, dir: &Path, target: &Target) -> Result<()> {
        if self.draft_vocab.is_some() || self.cfg.token_aware {
            return Err(Error::InvalidArgument(
                "token-aware heads or heads with a reduced draft vocabulary have no Medusa-format equivalent; train with --draft-vocab 0 --no-root-token to export".into(),
            ));
        }
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let mut m = HashMap::new();
        let lm = target.model.lm_head_weight()?;
        for (k, bs) in self.blocks.iter().enumerate() {
            for (l, b) in bs.iter().enumerate() {
                m.insert(format!("{k}.{l}.linear.weight"), b.lin.weight().clone());
                m.insert(format!("{k}.{l}.linear.bias"), b.lin.bias().expect("blocks have biases").clone());
            }
            let w = if self.cfg.own_lm_head { self.own[k].weight().clone() } else { lm.clone() };
            m.insert(format!("{k}.{}.weight", self.cfg.num_layers), w);
        }
        crate::files::save_safetensors(&m, None, &dir.join("medusa_lm_head.safetensors"))?;
        let cfg = serde_json::json!({
            "medusa_num_heads": self.cfg.num_heads, "medusa_num_layers": self.cfg.num_layers,
            "hidden_size": self.cfg.hidden_size, "vocab_size": self.cfg.vocab_size,
            // The model's name, not a path on this machine; the fingerprint lets an import here
            // refuse heads exported for another model.
            "base_model_name_or_path": target.path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default(),
            "selfspec_target": target.fingerprint()?,
        });
        crate::files::write_atomic(&dir.join("config.json"), cfg.to_string().as_bytes())
    }

    /// Write vLLM's Medusa format (`config.json` with `MedusaModel`, `model.safetensors` with
    /// `blocks.{k}.layers.{l}.{weight,bias}` and `lm_heads.{k}.weight`; a reduced draft
    /// vocabulary as `truncated_vocab_size` and the `token_map` of its ids). Token-aware heads
    /// have no equivalent: vLLM's heads read the hidden state alone.
    pub fn export_medusa_vllm(&self, dir: &Path, target: &Target) -> Result<()> {
        if self.cfg.token_aware {
            return Err(Error::InvalidArgument("token-aware heads (they read the root token too) have no vLLM Medusa equivalent; train with --no-root-token to export".into()));
        }
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let mut m = HashMap::new();
        // The rows each head scores: its own, or the target's (whole, or the draft vocabulary's).
        let shared = match &self.draft_vocab {
            Some((ids, _)) => target.model.lm_head_rows(ids)?,
            None => target.model.lm_head_weight()?,
        };
        for (k, bs) in self.blocks.iter().enumerate() {
            for (l, b) in bs.iter().enumerate() {
                m.insert(format!("blocks.{k}.layers.{l}.weight"), b.lin.weight().clone());
                m.insert(format!("blocks.{k}.layers.{l}.bias"), b.lin.bias().expect("blocks have biases").clone());
            }
            let w = if self.cfg.own_lm_head { self.own[k].weight().clone() } else { shared.clone() };
            m.insert(format!("lm_heads.{k}.weight"), w);
        }
        let truncated = match &self.draft_vocab {
            Some((ids, _)) => {
                m.insert("token_map".into(), Tensor::from_vec(ids.iter().map(|&i| i as i64).collect::<Vec<_>>(), ids.len(), &Device::Cpu)?);
                ids.len()
            }
            None => self.cfg.vocab_size,
        };
        crate::files::save_safetensors(&m, None, &dir.join(VLLM_MEDUSA_WEIGHTS))?;
        let cfg = serde_json::json!({
            "architectures": ["MedusaModel"], "model_type": "medusa",
            "hidden_size": self.cfg.hidden_size, "vocab_size": self.cfg.vocab_size,
            "num_heads": self.cfg.num_heads, "num_hidden_layers": self.cfg.num_layers,
            "truncated_vocab_size": truncated, "medusa_fc_bias": true,
            "base_model_name_or_path": target.path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default(),
            "selfspec_target": target.fingerprint()?,
        });
        crate::files::write_atomic(&dir.join("config.json"), cfg.to_string().as_bytes())
    }

    /// Read vLLM's Medusa format ([`Heads::export_medusa_vllm`]), checking the base model as far
    /// as the config records it. Heads whose rows equal the target's become shared.
    pub fn import_medusa_vllm(dir: &Path, target: &Target) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        let w_path = dir.join(VLLM_MEDUSA_WEIGHTS);
        let c: serde_json::Value = serde_json::from_str(&crate::files::read_config(&cfg_path)?).map_err(|e| Error::bad_file(&cfg_path, format!("invalid JSON: {e}")))?;
        let get = |k: &str| c[k].as_u64().map(|v| v as usize).ok_or_else(|| Error::bad_file(&cfg_path, format!("missing '{k}'")));
        let (k_heads, layers) = (get("num_heads")?, get("num_hidden_layers")?);
        let mcfg = target.model.config();
        get("hidden_size")?;
        get("vocab_size")?;
        let here = check_medusa_base(&c, &cfg_path, dir, target)?;
        if !(1..=MAX_HEADS).contains(&k_heads) || layers > MAX_HEAD_LAYERS {
            return Err(Error::bad_file(&cfg_path, format!("{k_heads} heads of {layers} layers: expected 1 to {MAX_HEADS} heads of at most {MAX_HEAD_LAYERS} layers")));
        }
        let truncated = c["truncated_vocab_size"].as_u64().map(|v| v as usize).unwrap_or(mcfg.vocab_size);
        if truncated == 0 || truncated > mcfg.vocab_size {
            return Err(Error::bad_file(&cfg_path, format!("truncated_vocab_size {truncated} for a vocabulary of {}", mcfg.vocab_size)));
        }
        let bias = c["medusa_fc_bias"].as_bool().unwrap_or(false);
        let ts = crate::files::load_weights(&w_path)?;
        let tensor = |name: &str| ts.get(name).ok_or_else(|| Error::bad_file(&w_path, format!("missing tensor {name}")));
        let ids: Option<Vec<u32>> = if truncated < mcfg.vocab_size {
            let t = tensor("token_map")?;
            let v: Vec<i64> = t.to_dtype(DType::I64)?.flatten_all()?.to_vec1()?;
            if v.len() != truncated || v.iter().any(|&i| i < 0 || i as usize >= mcfg.vocab_size) || v.windows(2).any(|w| w[0] >= w[1]) {
                return Err(Error::bad_file(&w_path, format!("token_map must hold {truncated} ascending ids below {}", mcfg.vocab_size)));
            }
            Some(v.into_iter().map(|i| i as u32).collect())
        } else {
            None
        };
        let d = mcfg.hidden_size;
        let shared = match &ids {
            Some(ids) => target.model.lm_head_rows(ids)?.to_device(&Device::Cpu)?,
            None => target.model.lm_head_weight()?.to_device(&Device::Cpu)?,
        };
        let original = c["original_lm_head"].as_bool().unwrap_or(false);
        let mut renamed = HashMap::new();
        let mut own = false;
        for k in 0..k_heads {
            for l in 0..layers {
                let w = tensor(&format!("blocks.{k}.layers.{l}.weight"))?.to_dtype(DType::F32)?;
                if w.dims() != [d, d] {
                    return Err(Error::bad_file(&w_path, format!("blocks.{k}.layers.{l}.weight is {:?}; expected [{d}, {d}]", w.dims())));
                }
                let b = if bias { tensor(&format!("blocks.{k}.layers.{l}.bias"))?.to_dtype(DType::F32)? } else { Tensor::zeros(d, DType::F32, &Device::Cpu)? };
                renamed.insert(format!("heads.{k}.blocks.{l}.weight"), w);
                renamed.insert(format!("heads.{k}.blocks.{l}.bias"), b);
            }
            let name = if original { "lm_heads.0.weight".to_string() } else { format!("lm_heads.{k}.weight") };
            let name = if original && !ts.contains_key(&name) { "lm_head.weight".to_string() } else { name };
            let w = tensor(&name)?.to_dtype(DType::F32)?;
            if w.dims() != [truncated, d] {
                return Err(Error::bad_file(&w_path, format!("{name} is {:?}; expected [{truncated}, {d}]", w.dims())));
            }
            own |= w.sub(&shared)?.abs()?.max_all()?.to_scalar::<f32>()? != 0.0;
            renamed.insert(format!("heads.{k}.lm_head.weight"), w);
        }
        if !own {
            renamed.retain(|k, _| !k.ends_with("lm_head.weight"));
        }
        if let Some(ids) = &ids {
            renamed.insert("draft_vocab".into(), Tensor::from_vec(ids.iter().map(|&i| i as f32).collect::<Vec<_>>(), ids.len(), &Device::Cpu)?);
        }
        let cfg = HeadsConfig {
            num_heads: k_heads,
            num_layers: layers,
            hidden_size: d,
            vocab_size: mcfg.vocab_size,
            own_lm_head: own,
            target: here.clone(),
            draft_vocab_size: ids.as_ref().map(|v| v.len()),
            token_aware: false,
            recipe: serde_json::json!({"imported_from": dir.display().to_string(), "format": "vllm medusa"}),
        };
        let vb = VarBuilder::from_tensors(renamed, DType::F32, target.model.device());
        let mut heads = Self::load(vb, &cfg).map_err(|e| Error::bad_file(&w_path, e.to_string()))?;
        heads.bind_draft_vocab(&target.model).map_err(|e| Error::bad_file(&w_path, e.to_string()))?;
        crate::cpu::quant::with_block_fallback(target.model.weight_format(), |f| heads.set_draft_format(f))?;
        Ok(heads)
    }

    /// Read the Medusa format. Heads whose projection equals the target's lm_head become shared.
    pub fn import_medusa(dir: &Path, target: &Target) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        let w_path = dir.join("medusa_lm_head.safetensors");
        let s = crate::files::read_config(&cfg_path)?;
        let c: serde_json::Value = serde_json::from_str(&s).map_err(|e| Error::bad_file(&cfg_path, format!("invalid JSON: {e}")))?;
        let get = |k: &str| c[k].as_u64().map(|v| v as usize).ok_or_else(|| Error::bad_file(&cfg_path, format!("missing '{k}'")));
        let (k_heads, layers) = (get("medusa_num_heads")?, get("medusa_num_layers")?);
        let mcfg = target.model.config();
        let here = check_medusa_base(&c, &cfg_path, dir, target)?;
        if k_heads == 0 || layers > MAX_HEAD_LAYERS || k_heads > MAX_HEADS {
            return Err(Error::bad_file(&cfg_path, format!("{k_heads} heads of {layers} layers: expected 1 to {MAX_HEADS} heads of at most {MAX_HEAD_LAYERS} layers")));
        }
        let ts = crate::files::load_weights(&w_path)?;
        let lm = target.model.lm_head_weight()?.to_device(&Device::Cpu)?;
        let mut own = false;
        let mut renamed = HashMap::new();
        for k in 0..k_heads {
            for l in 0..layers {
                for p in ["weight", "bias"] {
                    let t = ts.get(&format!("{k}.{l}.linear.{p}")).ok_or_else(|| Error::bad_file(&w_path, format!("missing tensor {k}.{l}.linear.{p}")))?;
                    renamed.insert(format!("heads.{k}.blocks.{l}.{p}"), t.to_dtype(DType::F32)?);
                }
            }
            let w = ts.get(&format!("{k}.{layers}.weight")).ok_or_else(|| Error::bad_file(&w_path, format!("missing tensor {k}.{layers}.weight")))?;
            let w = w.to_dtype(DType::F32)?;
            if w.dims() != [mcfg.vocab_size, mcfg.hidden_size] {
                return Err(Error::HeadsMismatch {
                    heads: dir.to_path_buf(),
                    heads_target: format!("vocab x hidden {:?}", w.dims()),
                    model_target: format!("vocab x hidden [{}, {}]", mcfg.vocab_size, mcfg.hidden_size),
                });
            }
            let same = w.sub(&lm)?.abs()?.max_all()?.to_scalar::<f32>()? == 0.0;
            own |= !same;
            renamed.insert(format!("heads.{k}.lm_head.weight"), w);
        }
        if !own {
            renamed.retain(|k, _| !k.ends_with("lm_head.weight"));
        }
        let cfg = HeadsConfig {
            num_heads: k_heads,
            num_layers: layers,
            hidden_size: mcfg.hidden_size,
            vocab_size: mcfg.vocab_size,
            own_lm_head: own,
            target: here,
            draft_vocab_size: None,
            token_aware: false,
            recipe: serde_json::json!({"imported_from": dir.display().to_string()}),
        };
        let vb = VarBuilder::from_tensors(renamed, DType::F32, target.model.device());
        let mut heads = Self::load(vb, &cfg)?;
        crate::cpu::quant::with_block_fallback(target.model.weight_format(), |f| heads.set_draft_format(f))?;
        Ok(heads)
    }
}

