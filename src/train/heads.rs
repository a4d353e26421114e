//! Training draft heads with the backbone frozen.
//!
//! The target's hidden states are computed once per chunk without gradients (and optionally
//! cached on disk); only the heads learn. Loss = sum_k decay^k * CE(head_k(h_t), label_{t,k}),
//! with hard labels (the corpus token t+k+2) or soft labels (the target's own distribution for
//! that token, softmax(lm_head(h_{t+k+1}))). AdamW, cosine schedule with warm-up, gradient
//! clipping, atomic checkpoints, and exact resume: optimizer moments and the step counter are
//! checkpointed and the batch order is a pure function of (seed, epoch).
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{DType, Tensor, Var, D};
use candle_nn::VarMap;
use rand::seq::SliceRandom;
use serde::{Deserialize, Serialize};

use crate::data::Document;
use crate::draft::heads::{Heads, HeadsConfig};
use crate::model::loader::Target;
use crate::cpu::quant::WeightFormat;
use crate::train::loss::{soft_cross_entropy, Readout};
use crate::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LossKind {
    Hard,
    Soft,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainConfig {
    pub num_heads: usize,
    pub num_layers: usize,
    pub own_lm_head: bool,
    pub epochs: usize,
    pub lr: f64,
    pub weight_decay: f64,
    pub warmup_steps: usize,
    pub grad_clip: f64,
    pub seq_len: usize,
    pub batch_tokens: usize,
    pub loss: LossKind,
    pub decay: f64,
    pub val_fraction: f64,
    pub seed: u64,
    pub checkpoint_every: usize,
    /// Stop after this many optimizer steps (for tests of interruption); 0 = run to the end.
    #[serde(default)]
    pub max_steps: usize,
    /// Draft vocabulary: the N most frequent corpus tokens (0 = the full vocabulary).
    #[serde(default)]
    pub draft_vocab: usize,
    /// Token-aware heads (see [`HeadsConfig::token_aware`]).
    #[serde(default)]
    pub token_aware: bool,
    /// Train an EAGLE-style draft layer ([`crate::draft::layer`]) instead of heads.
    #[serde(default)]
    pub draft_layer: bool,
    /// Draft layer: steps of training-time test (1 = teacher forcing only); step s is weighted
    /// `decay^s`.
    #[serde(default = "one")]
    pub unroll: usize,
    /// Draft layer: weight of the feature regression (smooth L1) next to the token loss.
    #[serde(default)]
    pub feature_weight: f64,
    /// Draft layer: EAGLE-3 ([`crate::draft::layer::DraftArch::Eagle3`]) instead of EAGLE.
    #[serde(default)]
    pub eagle3: bool,
    /// EAGLE-3: the target layers whose inputs it reads (empty: the default low, middle and
    /// high ones, [`crate::draft::layer::eagle3_default_layers`]).
    #[serde(default)]
    pub feature_layers: Vec<usize>,
    /// Start from this trained drafter (same kind and shape; its draft vocabulary is kept)
    /// instead of fresh weights: fine-tuning on new data, or more epochs with a new schedule.
    #[serde(default)]
    pub init: Option<std::path::PathBuf>,
    /// Each batch is split into this many groups whose gradients are computed side by side
    /// and summed ([`crate::train::parallel`]). The numbers depend on it, not on the number of
    /// threads; checkpoints that lack it were made with one group.
    #[serde(default = "one")]
    pub grad_groups: usize,
    /// Draft layer with `init`: grow its draft vocabulary to this many tokens, adding this
    /// corpus's most frequent tokens it lacks (0: keep `init`'s). See
    /// [`crate::train::layer::widened_vocab`].
    #[serde(default)]
    pub widen_vocab: usize,
}

/// More groups than this would leave most of a batch's groups a chunk or less.
pub const MAX_GRAD_GROUPS: usize = 64;

fn one() -> usize {
    1
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            num_heads: 4,
            num_layers: 1,
            own_lm_head: false,
            epochs: 2,
            lr: 1e-3,
            weight_decay: 0.0,
            warmup_steps: 20,
            grad_clip: 1.0,
            seq_len: 256,
            batch_tokens: 512,
            loss: LossKind::Soft,
            decay: 0.8,
            val_fraction: 0.05,
            seed: 0,
            checkpoint_every: 50,
            max_steps: 0,
            draft_vocab: 8192,
            token_aware: true,
            draft_layer: false,
            unroll: 1,
            feature_weight: 0.0,
            eagle3: false,
            feature_layers: Vec::new(),
            init: None,
            grad_groups: 2,
            widen_vocab: 0,
        }
    }
}

impl TrainConfig {
    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(Error::InvalidArgument(m.into()));
        use crate::draft::heads::{MAX_HEADS, MAX_HEAD_LAYERS};
        if !(1..=MAX_HEADS).contains(&self.num_heads) || !(1..=MAX_HEAD_LAYERS).contains(&self.num_layers) {
            return Err(Error::InvalidArgument(format!("--num-heads must be from 1 to {MAX_HEADS} and --layers from 1 to {MAX_HEAD_LAYERS} (what a drafter may have to load)")));
        }
        if self.seq_len < self.num_heads + 3 {
            return bad("--seq-len must exceed the number of heads by at least 3");
        }
        if self.batch_tokens == 0 || self.epochs == 0 || !(self.lr > 0.0 && self.lr.is_finite()) {
            return bad("--batch-tokens, --epochs and --lr must be positive (and --lr finite)");
        }
        if !(self.feature_weight >= 0.0 && self.feature_weight.is_finite()) {
            return bad("--feature-weight must be a finite number, 0 or more");
        }
        if !(0.0..0.9).contains(&self.val_fraction) {
            return bad("--val-fraction must be in [0, 0.9)");
        }
        if !(self.decay > 0.0 && self.decay <= 1.0) {
            return bad("--decay must be in (0, 1]");
        }
        if self.draft_layer && (self.unroll == 0 || self.unroll + 2 > self.seq_len) {
            return bad("--unroll must be at least 1 and shorter than --seq-len");
        }
        if self.draft_layer && self.draft_vocab == 0 {
            return bad("a draft layer needs a draft vocabulary (--draft-vocab N)");
        }
        if self.eagle3 && !self.draft_layer {
            return bad("--eagle3 trains a draft layer: add --draft-layer");
        }
        if !self.eagle3 && !self.feature_layers.is_empty() {
            return bad("--feature-layers is for an EAGLE-3 layer (--eagle3)");
        }
        if self.eagle3 && self.feature_weight > 0.0 {
            return bad("--feature-weight regresses EAGLE's final features; an EAGLE-3 layer predicts no target feature (its output is its own), so it trains on tokens only");
        }
        if !self.feature_layers.is_empty() && (self.feature_layers.len() != 3 || !self.feature_layers.windows(2).all(|w| w[0] < w[1])) {
            return bad("--feature-layers takes three distinct layers in ascending order: a low, a middle and a high one");
        }
        if self.own_lm_head && self.draft_vocab > 0 {
            return bad("--own-lm-head needs the full vocabulary: add --draft-vocab 0");
        }
        if self.widen_vocab > 0 && (!self.draft_layer || self.init.is_none()) {
            return bad("--widen-vocab grows the draft vocabulary of a draft layer it starts from: add --draft-layer and --init");
        }
        if !(1..=MAX_GRAD_GROUPS).contains(&self.grad_groups) {
            return Err(Error::InvalidArgument(format!("--grad-groups must be in 1..={MAX_GRAD_GROUPS}")));
        }
        Ok(())
    }

    /// The target layers a run with this config reads beside the final states, for a target
    /// of `num_layers` layers (none unless EAGLE-3).
    pub fn feature_layers_for(&self, num_layers: usize) -> Vec<usize> {
        match (self.eagle3, self.feature_layers.is_empty()) {
            (false, _) => Vec::new(),
            (true, true) => crate::draft::layer::eagle3_default_layers(num_layers),
            (true, false) => self.feature_layers.clone(),
        }
    }
}

/// Per-head accuracy on held-out text, against the target's own greedy next tokens.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HeadAccuracy {
    pub positions: usize,
    pub top1: Vec<f64>,
    pub top5: Vec<f64>,
    /// Estimated τ (tokens per target forward, the bonus token counted) of a greedy chain as
    /// deep as the levels validated, from where each held-out position's first wrong guess
    /// falls ([`TauEstimate`]).
    #[serde(default)]
    pub tau_chain: f64,
    /// The same for a tree keeping the top [`TREE_WIDTHS`] guesses per level.
    #[serde(default)]
    pub tau_tree: f64,
}

/// Per-level widths of the tree whose τ validation estimates: the top 3 guesses at the first
/// level, 2 at the second, then one (at most 3 + 6 + 6 + 6 = 21 nodes over 4 levels).
pub const TREE_WIDTHS: [usize; 4] = [3, 2, 1, 1];

/// An acceptance-length estimate during training (EAGLE-3 reports one): for every held-out
/// position, the rank of the target's own next tokens among the drafter's guesses level by
/// level, each level drafted along the true tokens above it. Along the target's greedy path
/// (the corpus is the target's own answers) that is what verification sees: a chain accepts
/// levels while the truth is each level's first guess, a tree while it is within that level's
/// width. Decoding is then walked through each chunk as it would run: a step at position p
/// accepts a run of r levels, emits r + 1 tokens and moves to p + r + 1, so easy stretches
/// count once per step, not once per position. τ = tokens emitted / steps; a level that is not
/// scored (past an answer's end) ends a run.
#[derive(Debug, Default)]
pub struct TauEstimate {
    /// Per chunk, per position: the truth's rank among the top 5 at each level (None: not
    /// among them, or not scored), or None where no step starts (not an answer position).
    chunks: Vec<Vec<Option<Vec<Option<usize>>>>>,
}

impl TauEstimate {
    /// One held-out chunk's positions in order.
    pub fn push_chunk(&mut self, positions: Vec<Option<Vec<Option<usize>>>>) {
        self.chunks.push(positions);
    }

    /// τ for per-level widths `widths` (1s: a chain); 0 without any step.
    pub fn tau(&self, widths: &[usize]) -> f64 {
        let (mut emitted, mut steps) = (0usize, 0usize);
        for chunk in &self.chunks {
            let mut p = 0;
            while p < chunk.len() {
                let Some(ranks) = &chunk[p] else {
                    p += 1;
                    continue;
                };
                let run = ranks.iter().zip(widths).take_while(|(x, &w)| x.is_some_and(|k| k < w)).count();
                emitted += run + 1;
                steps += 1;
                p += run + 1;
            }
        }
        if steps == 0 { 0.0 } else { emitted as f64 / steps as f64 }
    }

    /// (chain τ, tree τ) over the levels recorded.
    pub fn both(&self) -> (f64, f64) {
        (self.tau(&[1; 64]), self.tau(&TREE_WIDTHS))
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainReport {
    pub train_tokens: usize,
    pub val_tokens: usize,
    pub steps: usize,
    pub final_loss: f64,
    pub losses: Vec<f64>,
    pub val: Vec<HeadAccuracy>,
    pub hidden_secs: f64,
    pub train_secs: f64,
    pub train_tokens_per_sec: f64,
}

impl TrainReport {
    /// The report of a finished run: `data` = (train tokens, held-out tokens, seconds spent on
    /// hidden states); `tokens_seen` = tokens trained on in this process (for throughput).
    pub(crate) fn new(data: (usize, usize, f64), steps: usize, losses: &[f64], val: HeadAccuracy, train_secs: f64, tokens_seen: usize) -> Self {
        TrainReport {
            train_tokens: data.0,
            val_tokens: data.1,
            steps,
            final_loss: losses.last().copied().unwrap_or(f64::NAN),
            losses: losses.to_vec(),
            val: vec![val],
            hidden_secs: data.2,
            train_secs,
            train_tokens_per_sec: tokens_seen as f64 / train_secs.max(1e-9),
        }
    }
}

/// A piece of a document the size of one training sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct Chunk {
    pub tokens: Vec<u32>,
    /// Whether each token is one the drafter should learn to guess (see [`Document::scored`]).
    pub scored: Vec<bool>,
}

/// Where a chunk's hidden states are: held in memory, or in the disk cache, read when a batch
/// needs them. Cached states stay out of memory: an EAGLE-3 run's 1.5M tokens of states (the
/// final ones and three tapped layers', 9 KB a token) are 14 GB, which held in memory took
/// training to 16.8 GB of RSS; read per batch from the page cache they cost a few ms a step.
#[derive(Debug, Clone)]
pub enum States {
    Held(Tensor),
    Cached(std::path::PathBuf),
}

/// A chunk with the frozen backbone's hidden states for it.
pub struct Example {
    pub chunk: Chunk,
    pub states: States,
}

impl Example {
    pub fn tokens(&self) -> &[u32] {
        &self.chunk.tokens
    }
    pub fn scored(&self) -> &[bool] {
        &self.chunk.scored
    }
    /// The hidden states `[tokens, width]`, read from the cache file if they are there; an
    /// error names a cache file that went missing or changed shape since the run began.
    pub fn h(&self) -> Result<Tensor> {
        match &self.states {
            States::Held(t) => Ok(t.clone()),
            States::Cached(f) => {
                let h = read_cached(f).ok_or_else(|| Error::bad_file(f, "hidden states vanished or became unreadable during the run"))?;
                if h.dim(0)? != self.chunk.tokens.len() {
                    return Err(Error::bad_file(f, format!("holds states of {} tokens, the chunk has {}", h.dim(0)?, self.chunk.tokens.len())));
                }
                Ok(h)
            }
        }
    }
}

/// The rows of a cache file's states from its header alone (mapped, so only the header is
/// read: checking an EAGLE-3 run's 14 GB of cached states at the start read them all once
/// before training read them again), or None when it is missing or not a states file.
fn cached_rows(f: &Path) -> Option<usize> {
    let file = std::fs::File::open(f).ok()?;
    // SAFETY: read-only map of a file this run wrote atomically (rename) or found complete.
    let map = unsafe { memmap2::Mmap::map(&file) }.ok()?;
    let (_, meta) = safetensors::SafeTensors::read_metadata(&map[..]).ok()?;
    let info = meta.info("h")?;
    (info.shape.len() == 2).then_some(info.shape[0])
}

/// The states tensor of a cache file, or None when it is missing or unreadable.
fn read_cached(f: &Path) -> Option<Tensor> {
    let m = candle_core::safetensors::load(f, &candle_core::Device::Cpu).ok()?;
    m.get("h").cloned()
}

/// Tokenised chunks of at most `seq_len` tokens; each document starts a new chunk. Chunks with
/// fewer than `min_len` tokens, or with no scored token, are dropped.
pub fn chunk_documents(target: &Target, docs: &[Document], seq_len: usize, min_len: usize) -> Result<Vec<Chunk>> {
    let mut chunks = Vec::new();
    for d in docs {
        let (ids, starts) = target.tokenizer.encode_with_offsets(&d.text, true)?;
        let scored: Vec<bool> = starts.iter().map(|s| s.is_some_and(|o| d.scores(o))).collect();
        for (c, m) in ids.chunks(seq_len).zip(scored.chunks(seq_len)) {
            if c.len() >= min_len && m.iter().any(|&x| x) {
                chunks.push(Chunk { tokens: c.to_vec(), scored: m.to_vec() });
            }
        }
    }
    Ok(chunks)
}

/// Where hidden states are cached on disk, keyed by the target's fingerprint (computed once,
/// not per chunk: it hashes the whole tokenizer) and by the numerics that produced them, so
/// states from different numerics never mix in one run. The reference numerics (f32 weights, f32
/// KV cache) go unmarked; every other weight format and KV type is tagged in the key.
pub struct HiddenCache {
    dir: std::path::PathBuf,
    target_key: String,
}

impl HiddenCache {
    pub fn new(dir: &Path, target: &Target) -> Result<Self> {
        let m = &target.model;
        let hash = target.fingerprint()?.hash;
        // Unmarked reference numerics also keep the names of caches written before the key
        // carried numerics at all (they were all f32/f32), so those states stay valid.
        let mut target_key = if m.weight_format() == WeightFormat::F32 && m.kv_dtype() == DType::F32 {
            hash
        } else {
            format!("{hash}:{}:{:?}", m.weight_format().name(), m.kv_dtype())
        };
        // States with tapped layers beside them are other files (wider rows).
        if !m.feature_layers().is_empty() {
            target_key.push_str(&format!(":layers{:?}", m.feature_layers()));
        }
        Ok(HiddenCache { dir: dir.to_path_buf(), target_key })
    }

    fn file_for(&self, chunk: &[u32]) -> std::path::PathBuf {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        for t in chunk {
            h.update(t.to_le_bytes());
        }
        h.update(self.target_key.as_bytes());
        let name: String = h.finalize().iter().take(12).map(|b| format!("{b:02x}")).collect();
        self.dir.join(format!("{name}.safetensors"))
    }
}

/// The frozen backbone's final hidden states for one chunk, from the disk cache when present.
pub fn hidden_states(target: &Target, chunk: &[u32], cache: Option<&HiddenCache>) -> Result<Tensor> {
    match states_of(target, chunk, cache, true)? {
        States::Held(t) => Ok(t),
        States::Cached(f) => Err(Error::bad_file(&f, "states kept on disk where they were asked for in memory")),
    }
}

/// A chunk's states: computed and held in memory without a cache; with one, read or computed
/// into it and left on disk (`hold: false`), or held as well (`hold: true`).
fn states_of(target: &Target, chunk: &[u32], cache: Option<&HiddenCache>, hold: bool) -> Result<States> {
    let file = cache.map(|c| c.file_for(chunk));
    if let Some(f) = &file {
        // Off the CPU the states are held on the device: a batch reads them there.
        let device = target.model.device();
        if !hold && device.is_cpu() && cached_rows(f) == Some(chunk.len()) {
            return Ok(States::Cached(f.clone()));
        }
        if let Some(t) = read_cached(f).filter(|t| t.dim(0).ok() == Some(chunk.len())) {
            return Ok(States::Held(t.to_device(device)?));
        }
    }
    let mut cache = target.model.new_cache()?;
    // On the CPU the whole chunk runs on the batch-invariant kernels, so the states carry
    // decoding's own numerics.
    let h = target.model.forward_causal(chunk, &mut cache)?;
    match &file {
        Some(f) => {
            std::fs::create_dir_all(f.parent().unwrap()).map_err(|e| Error::io(f, e))?;
            let tmp = f.with_extension("tmp");
            candle_core::safetensors::save(&HashMap::from([("h".to_string(), h.clone())]), &tmp)?;
            std::fs::rename(&tmp, f).map_err(|e| Error::io(f, e))?;
            Ok(if hold || !h.device().is_cpu() { States::Held(h) } else { States::Cached(f.clone()) })
        }
        None => Ok(States::Held(h)),
    }
}

/// AdamW whose moments can be saved and restored, so a resumed run is bit-for-bit the
/// uninterrupted one.
pub struct AdamW {
    vars: Vec<(String, Var)>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    pub step: usize,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
}

impl AdamW {
    pub fn new(varmap: &VarMap, weight_decay: f64) -> Result<Self> {
        let data = varmap.data().lock().unwrap();
        let mut vars: Vec<(String, Var)> = data.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let m = vars.iter().map(|(_, v)| v.zeros_like()).collect::<candle_core::Result<Vec<_>>>()?;
        let vv = vars.iter().map(|(_, v)| v.zeros_like()).collect::<candle_core::Result<Vec<_>>>()?;
        Ok(AdamW { vars, m, v: vv, step: 0, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay })
    }

    /// One update with global-norm gradient clipping.
    pub fn step(&mut self, grads: &candle_core::backprop::GradStore, lr: f64, clip: f64) -> Result<f64> {
        let mut sq = 0f64;
        for (_, var) in &self.vars {
            if let Some(g) = grads.get(var.as_tensor()) {
                sq += g.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
            }
        }
        let norm = sq.sqrt();
        let scale = if clip > 0.0 && norm > clip { clip / norm } else { 1.0 };
        self.step += 1;
        let t = self.step as i32;
        let (b1, b2) = (self.beta1, self.beta2);
        for (i, (_, var)) in self.vars.iter().enumerate() {
            let Some(g) = grads.get(var.as_tensor()) else { continue };
            let g = (g * scale)?;
            self.m[i] = ((&self.m[i] * b1)? + (&g * (1.0 - b1))?)?;
            self.v[i] = ((&self.v[i] * b2)? + (g.sqr()? * (1.0 - b2))?)?;
            let mhat = (&self.m[i] / (1.0 - b1.powi(t)))?;
            let vhat = (&self.v[i] / (1.0 - b2.powi(t)))?;
            let upd = (mhat / (vhat.sqrt()? + self.eps)?)?;
            let decayed = (var.as_tensor() * (1.0 - lr * self.weight_decay))?;
            var.set(&(decayed - (upd * lr)?)?)?;
        }
        Ok(norm)
    }

    fn state(&self) -> HashMap<String, Tensor> {
        let mut s = HashMap::new();
        for (i, (name, var)) in self.vars.iter().enumerate() {
            s.insert(format!("param/{name}"), var.as_tensor().clone());
            s.insert(format!("m/{name}"), self.m[i].clone());
            s.insert(format!("v/{name}"), self.v[i].clone());
        }
        s
    }

    fn restore(&mut self, s: &HashMap<String, Tensor>, step: usize) -> Result<()> {
        for (i, (name, var)) in self.vars.iter().enumerate() {
            let get = |k: String| s.get(&k).cloned().ok_or_else(|| Error::InvalidArgument(format!("checkpoint lacks {k}")));
            var.set(&get(format!("param/{name}"))?)?;
            self.m[i] = get(format!("m/{name}"))?;
            self.v[i] = get(format!("v/{name}"))?;
        }
        self.step = step;
        Ok(())
    }
}

/// Cosine schedule with linear warm-up, to 10% of the peak at the end.
pub fn learning_rate(step: usize, total: usize, warmup: usize, peak: f64) -> f64 {
    if step < warmup {
        return peak * (step + 1) as f64 / warmup as f64;
    }
    let p = (step - warmup) as f64 / (total.saturating_sub(warmup)).max(1) as f64;
    peak * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * p.min(1.0)).cos()))
}

/// What a checkpoint records besides the optimizer's tensors. It travels inside the safetensors
/// file's header, so the tensors and the step they belong to are written (and renamed into place)
/// as one unit: a kill can leave the previous checkpoint or the new one, never a mix of the two.
#[derive(Serialize, Deserialize)]
struct CheckpointMeta {
    step: usize,
    losses: Vec<f64>,
    config: TrainConfig,
    /// [`data_fingerprint`] of the documents trained on: resuming on other data is refused.
    #[serde(default)]
    data: Option<String>,
}

const CKPT_TENSORS: &str = "checkpoint.safetensors";
/// Where checkpoints of earlier versions kept their metadata; read when the header has none.
const CKPT_META: &str = "checkpoint.json";
/// The safetensors header key holding the [`CheckpointMeta`] JSON.
const CKPT_META_KEY: &str = "selfspec_checkpoint";

/// A fingerprint of the training documents, in order: a resumed run must see the same data.
pub fn data_fingerprint(docs: &[Document]) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    for d in docs {
        h.update((d.text.len() as u64).to_le_bytes());
        h.update(d.text.as_bytes());
    }
    h.finalize().iter().take(12).map(|b| format!("{b:02x}")).collect()
}

/// Row indices and labels of one batch: positions `t` of chunks, with per-head targets.
struct Batch {
    h: Tensor,
    /// Embedding of token t+1 (the root the target emitted from h_t), for token-aware heads.
    root: Option<Tensor>,
    /// Hard labels `[K][B]` (u32::MAX = no label), or None for soft.
    hard: Option<Vec<Vec<u32>>>,
    /// Soft label rows: per head, per row, the chunk row index of h_{t+k+1} (usize::MAX = none).
    soft_rows: Option<(Tensor, Vec<Vec<usize>>)>,
    valid: Vec<Vec<bool>>,
}

fn make_batch(
    chunks: &[Example],
    ids: &[usize],
    k_heads: usize,
    loss: LossKind,
    slot: &dyn Fn(u32) -> Option<u32>,
    embed: Option<&dyn Fn(&[u32]) -> Result<Tensor>>,
) -> Result<Batch> {
    let mut hs = Vec::new();
    let mut roots: Vec<u32> = Vec::new();
    let mut hard = vec![Vec::new(); k_heads];
    let mut valid = vec![Vec::new(); k_heads];
    let mut soft_idx = vec![Vec::new(); k_heads];
    let mut offset = 0;
    let states: Vec<Tensor> = ids.iter().map(|&i| chunks[i].h()).collect::<Result<_>>()?;
    for (&i, h) in ids.iter().zip(&states) {
        let (toks, scored) = (chunks[i].tokens(), chunks[i].scored());
        let n = toks.len();
        let rows = n - 2; // positions t with at least the head-0 label t+2
        hs.push(h.narrow(0, 0, rows)?);
        roots.extend_from_slice(&toks[1..rows + 1]);
        for t in 0..rows {
            for k in 0..k_heads {
                let label = if t + k + 2 < n { slot(toks[t + k + 2]) } else { None };
                let ok = t + k + 2 < n && scored[t + k + 2] && (loss == LossKind::Soft || label.is_some());
                valid[k].push(ok);
                hard[k].push(label.unwrap_or(u32::MAX));
                soft_idx[k].push(if ok { offset + t + k + 1 } else { usize::MAX });
            }
        }
        offset += n;
    }
    let h = Tensor::cat(&hs, 0)?;
    let soft_rows = if loss == LossKind::Soft {
        Some((Tensor::cat(&states, 0)?, soft_idx))
    } else {
        None
    };
    let root = match embed {
        Some(f) => Some(f(&roots)?),
        None => None,
    };
    Ok(Batch { h, root, hard: if loss == LossKind::Hard { Some(hard) } else { None }, soft_rows, valid })
}

/// The loss of one batch (or one group of it): per head the mean over `norm[k]` rows (the whole
/// batch's valid rows, so that the groups' losses sum to the batch's), weighted `decay^k`.
/// Soft labels go through the fused loss ([`crate::train::loss`]); hard ones through candle's ops.
fn batch_loss(heads: &Heads, lm: &Tensor, b: &Batch, decay: f64, norm: &[f32]) -> Result<(Tensor, Vec<(usize, usize)>)> {
    // Soft targets and logits live in the draft vocabulary when there is one. The targets come
    // from the target's own rows, never from a head's own lm_head (which trains, and would move
    // its own labels; own heads have the full vocabulary).
    let proj = if heads.config().own_lm_head { lm } else { heads.projection(0, lm) };
    let hs = heads.hidden(&b.h, b.root.as_ref())?;
    let rows = b.h.dim(0)?;
    let dev = b.h.device();
    let mut total: Option<Tensor> = None;
    let mut acc = Vec::with_capacity(hs.len());
    // Soft targets: the target's own distribution at the row each head predicts.
    let soft_probs = match &b.soft_rows {
        Some((full, _)) => Some(candle_nn::ops::softmax(&full.matmul(&proj.t()?)?, D::Minus1)?),
        None => None,
    };
    for (k, x) in hs.iter().enumerate() {
        let w_k = heads.projection(k, lm);
        let mask: Vec<f32> = b.valid[k].iter().map(|&v| v as u8 as f32).collect();
        let n_valid = mask.iter().sum::<f32>();
        let (l, argmax, truth): (Tensor, Vec<u32>, Vec<u32>) = match (&b.hard, &soft_probs, &b.soft_rows) {
            (Some(h), _, _) => {
                let logits = x.matmul(&w_k.t()?)?;
                let lp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
                let labels: Vec<u32> = h[k].iter().map(|&x| if x == u32::MAX { 0 } else { x }).collect();
                let lt = Tensor::from_vec(labels.clone(), (rows, 1), dev)?;
                let mask_t = Tensor::from_vec(mask, rows, dev)?;
                let per_row = lp.gather(&lt, 1)?.squeeze(1)?.neg()?;
                let l = ((per_row * &mask_t)?.sum_all()? / norm[k].max(1.0) as f64)?;
                (l, logits.argmax(D::Minus1)?.to_vec1()?, labels)
            }
            (None, Some(p), Some((_, idx))) => {
                let ix: Vec<u32> = idx[k].iter().map(|&x| if x == usize::MAX { 0 } else { x as u32 }).collect();
                let target = p.index_select(&Tensor::new(ix.as_slice(), dev)?, 0)?;
                let truth: Vec<u32> = target.argmax(D::Minus1)?.to_vec1()?;
                let weights: Vec<f32> = mask.iter().map(|m| m / norm[k].max(1.0)).collect();
                let (l, argmax) = soft_cross_entropy(x, if heads.config().own_lm_head { Readout::Trained(w_k) } else { Readout::Frozen { w: w_k, wt: None } }, &target, &weights)?;
                (l, argmax, truth)
            }
            _ => unreachable!("a batch has hard or soft labels"),
        };
        let hits = (0..rows).filter(|&r| b.valid[k][r] && argmax[r] == truth[r]).count();
        acc.push((hits, n_valid as usize));
        let term = (l * decay.powi(k as i32))?;
        total = Some(match total {
            None => term,
            Some(t) => (t + term)?,
        });
    }
    Ok((total.expect("at least one head"), acc))
}

/// Merge the two smallest neighbours or split the largest batch until there are `n` batches
/// (`n` >= 1; every chunk stays in exactly one batch).
pub fn fit_batches(mut batches: Vec<Vec<usize>>, n: usize) -> Vec<Vec<usize>> {
    let n = n.max(1);
    while batches.len() > n {
        let last = batches.pop().unwrap_or_default();
        if let Some(prev) = batches.last_mut() {
            prev.extend(last);
        }
    }
    while batches.len() < n {
        let (i, big) = match batches.iter().enumerate().max_by_key(|(_, b)| b.len()) {
            Some((i, b)) if b.len() >= 2 => (i, b.len()),
            _ => break,
        };
        let tail = batches[i].split_off(big / 2);
        batches.insert(i + 1, tail);
    }
    batches
}

/// Top-1/top-5 of each head against the target's own greedy token on held-out chunks, at the
/// scored positions only (the answers of a conversation).
pub fn validate(heads: &Heads, target: &Target, chunks: &[Example]) -> Result<HeadAccuracy> {
    let k_heads = heads.num_heads();
    let lm = &target.model.lm_head_weight()?;
    let mut top1 = vec![0usize; k_heads];
    let mut top5 = vec![0usize; k_heads];
    let mut counts = vec![0usize; k_heads];
    let mut tau = TauEstimate::default();
    for ex in chunks {
        let (toks, h, scored) = (ex.tokens(), &ex.h()?, ex.scored());
        let n = toks.len();
        let own: Vec<u32> = h.matmul(&lm.t()?)?.argmax(D::Minus1)?.to_vec1()?; // own[t] = target's token t+1
        // The root at position t is the corpus token t+1: the target's "own" token at t+k+1 is
        // predicted from the corpus prefix, which contains that token.
        let root = if heads.config().token_aware { Some(target.model.embed(&toks[1..n - 1])?) } else { None };
        let logits = heads.train_logits(&h.narrow(0, 0, n - 2)?, root.as_ref(), lm)?;
        let mut ranks = vec![vec![None; k_heads]; n - 2];
        for k in 0..k_heads {
            let lk = logits.get(k)?;
            let top = crate::cpu::reduce::top_k_rows(&lk, 5)?;
            let id = |i: u32| heads.draft_vocab().map_or(i, |v| v[i as usize]);
            for t in 0..n - 2 {
                if t + k + 2 < n && scored[t + k + 2] {
                    let truth = own[t + k + 1];
                    counts[k] += 1;
                    top1[k] += (id(top[t][0].0) == truth) as usize;
                    top5[k] += top[t].iter().any(|x| id(x.0) == truth) as usize;
                    ranks[t][k] = top[t].iter().position(|x| id(x.0) == truth);
                }
            }
        }
        tau.push_chunk(ranks.into_iter().enumerate().map(|(t, r)| scored.get(t + 2).copied().unwrap_or(false).then_some(r)).collect());
    }
    let frac = |a: &[usize]| a.iter().zip(&counts).map(|(&x, &c)| x as f64 / c.max(1) as f64).collect();
    let (tau_chain, tau_tree) = tau.both();
    Ok(HeadAccuracy { positions: counts.first().copied().unwrap_or(0), top1: frac(&top1), top5: frac(&top5), tau_chain, tau_tree })
}

/// Chunks with the frozen backbone's hidden states, split into training and held-out sets.
pub(crate) struct Prepared {
    pub train_set: Vec<Example>,
    pub val_set: Vec<Example>,
    pub train_tokens: usize,
    pub val_tokens: usize,
    pub hidden_secs: f64,
}

/// Chunk the corpus, hold out the validation chunks, and compute (or read from the cache) the
/// backbone's hidden states. `with_train: false` computes them for the held-out chunks only,
/// for measuring a trained drafter on the very chunks a run held out without paying for the rest.
pub(crate) fn prepare(target: &Target, docs: &[Document], cfg: &TrainConfig, min_len: usize, cache_hidden: Option<&Path>, with_train: bool, log: &mut dyn FnMut(String)) -> Result<Prepared> {
    let chunks = chunk_documents(target, docs, cfg.seq_len, min_len)?;
    if chunks.is_empty() {
        return Err(Error::InvalidArgument(format!("the corpus gives no chunk of at least {min_len} tokens")));
    }
    let mut order: Vec<usize> = (0..chunks.len()).collect();
    order.shuffle(&mut crate::decode::sampling::rng(cfg.seed ^ 0x5eed));
    let n_val = ((chunks.len() as f64 * cfg.val_fraction).round() as usize).min(chunks.len().saturating_sub(1));
    // Validation is held out by content: corpora are often oversampled by listing a file twice,
    // and a copy of a validation chunk left in training would inflate the held-out accuracy.
    let mut val_ids: Vec<usize> = Vec::with_capacity(n_val);
    let mut val_content: std::collections::HashSet<&[u32]> = std::collections::HashSet::new();
    for &i in &order {
        if val_ids.len() == n_val {
            break;
        }
        if val_content.insert(&chunks[i].tokens) {
            val_ids.push(i);
        }
    }
    let train_ids: Vec<usize> = order.iter().copied().filter(|&i| !val_content.contains(chunks[i].tokens.as_slice())).collect();
    if train_ids.is_empty() {
        return Err(Error::InvalidArgument("no training chunk is left after holding out the validation chunks".into()));
    }
    let (val_ids, train_ids) = (&val_ids[..], &train_ids[..]);
    let t_hidden = Instant::now();
    let cache = cache_hidden.map(|d| HiddenCache::new(d, target)).transpose()?;
    let with_h = |ids: &[usize]| -> Result<Vec<Example>> {
        ids.iter().map(|&i| Ok(Example { chunk: chunks[i].clone(), states: states_of(target, &chunks[i].tokens, cache.as_ref(), false)? })).collect()
    };
    let train_set = if with_train { with_h(train_ids)? } else { Vec::new() };
    let val_set = with_h(val_ids)?;
    let hidden_secs = t_hidden.elapsed().as_secs_f64();
    let train_tokens: usize = train_set.iter().map(|c| c.tokens().len()).sum();
    let val_tokens: usize = val_set.iter().map(|c| c.tokens().len()).sum();
    let scored = |set: &[Example]| set.iter().map(|c| c.scored().iter().filter(|&&x| x).count()).sum::<usize>();
    log(format!(
        "{} train chunks ({train_tokens} tokens, {} scored), {} validation chunks ({val_tokens} tokens, {} scored); hidden states in {hidden_secs:.0}s",
        train_set.len(),
        scored(&train_set),
        val_set.len(),
        scored(&val_set)
    ));
    Ok(Prepared { train_set, val_set, train_tokens, val_tokens, hidden_secs })

}

/// Batches per epoch, and the batches of each epoch.
pub(crate) fn epoch_batches<'a>(train_set: &'a [Example], cfg: &'a TrainConfig) -> (usize, impl Fn(usize) -> Vec<Vec<usize>> + 'a) {
    // Batches: consecutive chunks of the epoch's permutation up to batch_tokens.
    // Batches of about `batch_tokens` tokens over a per-epoch shuffle. Chunk lengths vary, so
    // a shuffle can give one batch more or fewer than another; every epoch is fitted to the
    // first epoch's count so steps map to (epoch, batch) the same way in every epoch.
    let raw_batches = move |epoch: usize| -> Vec<Vec<usize>> {
        let mut ids: Vec<usize> = (0..train_set.len()).collect();
        ids.shuffle(&mut crate::decode::sampling::rng(cfg.seed.wrapping_add(1000 + epoch as u64)));
        let mut out = vec![];
        let mut cur = vec![];
        let mut toks = 0;
        for i in ids {
            toks += train_set[i].tokens().len();
            cur.push(i);
            if toks >= cfg.batch_tokens {
                out.push(std::mem::take(&mut cur));
                toks = 0;
            }
        }
        if !cur.is_empty() {
            out.push(cur);
        }
        out
    };
    let per_epoch = raw_batches(0).len();
    (per_epoch, move |epoch: usize| -> Vec<Vec<usize>> { fit_batches(raw_batches(epoch), per_epoch) })
}

/// Overwrite every variable of `varmap` with the same-named tensor of `from` (a warm start from
/// the drafter in `source`). A missing tensor or another shape means another kind of drafter.
pub(crate) fn warm_start(varmap: &VarMap, from: &HashMap<String, Tensor>, source: &Path) -> Result<()> {
    let data = varmap.data().lock().unwrap();
    if let Some(extra) = from.keys().filter(|k| *k != "draft_vocab").find(|k| !data.contains_key(*k)) {
        return Err(Error::bad_file(source, format!("--init: {extra} has no place here; the drafter there has another shape or kind")));
    }
    for (name, var) in data.iter() {
        let t = from.get(name).ok_or_else(|| Error::bad_file(source, format!("--init: no tensor {name}; the drafter there has another shape or kind")))?;
        if t.dims() != var.dims() {
            return Err(Error::bad_file(source, format!("--init: {name} is {:?} there, {:?} here", t.dims(), var.dims())));
        }
        var.set(&t.to_dtype(candle_core::DType::F32)?.to_device(var.device())?)?;
    }
    Ok(())
}

/// Restore optimizer state and losses from `out`'s checkpoint when resuming and one exists.
pub(crate) fn resume_from(out: &Path, cfg: &TrainConfig, data: &str, opt: &mut AdamW, device: &candle_core::Device, total_steps: usize, log: &mut dyn FnMut(String)) -> Result<Vec<f64>> {
    let tp = out.join(CKPT_TENSORS);
    if !tp.exists() {
        // Said, since it may not be what was meant (a recipe passes --resume on every run).
        log(format!("no checkpoint in {}: --resume starts from step 0", out.display()));
        return Ok(Vec::new());
    }
    let bytes = crate::files::read_data(&tp)?;
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| Error::bad_file(&tp, format!("invalid checkpoint: {e}")))?;
    let (meta_path, text) = match header.metadata().as_ref().and_then(|m| m.get(CKPT_META_KEY)) {
        Some(t) => (tp.clone(), t.clone()),
        None => {
            let mp = out.join(CKPT_META);
            let t = std::fs::read_to_string(&mp).map_err(|e| Error::io(&mp, e))?;
            (mp, t)
        }
    };
    let meta: CheckpointMeta = serde_json::from_str(&text).map_err(|e| Error::bad_file(&meta_path, format!("invalid checkpoint: {e}")))?;
    match &meta.data {
        Some(d) if d != data => {
            return Err(Error::bad_file(&meta_path, format!("the checkpoint was trained on other data (fingerprint {d}, this run's {data}); resume with the same --data, or train into a new --out")))
        }
        Some(_) => {}
        None => log(format!("{}: an older checkpoint without a data fingerprint; resuming on trust that --data is the same", meta_path.display())),
    }
    let differ = config_differences(&meta.config, cfg);
    if !differ.is_empty() {
        return Err(Error::bad_file(&meta_path, format!("the checkpoint was made with other training settings ({}); resume with the same flags", differ.join("; "))));
    }
    let st = candle_core::safetensors::load_buffer(&bytes, device).map_err(|e| Error::bad_file(&tp, e.to_string()))?;
    opt.restore(&st, meta.step)?;
    log(format!("resumed from step {} of {total_steps}", meta.step));
    Ok(meta.losses)
}

/// The settings in which a checkpoint's config and this run's differ, as "name: checkpoint's
/// value, this run's value" (`max_steps` may differ: it only says where to stop). A checkpoint
/// from before a setting existed reads as that setting's old behaviour (`grad_groups` 1).
fn config_differences(saved: &TrainConfig, now: &TrainConfig) -> Vec<String> {
    let (Ok(serde_json::Value::Object(a)), Ok(serde_json::Value::Object(b))) = (serde_json::to_value(saved), serde_json::to_value(now)) else {
        return vec!["unreadable settings".into()];
    };
    let mut out = Vec::new();
    for (k, v) in &b {
        let old = a.get(k).unwrap_or(&serde_json::Value::Null);
        if k != "max_steps" && old != v {
            out.push(format!("{k}: checkpoint {old}, this run {v}"));
        }
    }
    out
}

/// Progress callback: (step, total steps, loss, per-head running accuracy, tokens/s).
pub type Progress<'a> = &'a mut dyn FnMut(usize, usize, f64, &[f64], f64);

/// Train heads on `docs`, writing checkpoints and the final heads into `out`.
pub fn train(
    target: &Target,
    docs: &[Document],
    cfg: &TrainConfig,
    out: &Path,
    resume: bool,
    cache_hidden: Option<&Path>,
    progress: Progress,
    log: &mut dyn FnMut(String),
) -> Result<(Heads, TrainReport)> {
    cfg.validate()?;
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let k_heads = cfg.num_heads;
    let Prepared { train_set, val_set, train_tokens, val_tokens, hidden_secs } = prepare(target, docs, cfg, k_heads + 3, cache_hidden, true, log)?;
    let (per_epoch, batches_for_epoch) = epoch_batches(&train_set, cfg);
    let total_steps = per_epoch * cfg.epochs;

    let device = target.model.device().clone();
    let varmap = VarMap::new();
    let lm = target.model.lm_head_weight()?;
    let mcfg = target.model.config();
    let hcfg = HeadsConfig {
        num_heads: k_heads,
        num_layers: cfg.num_layers,
        hidden_size: mcfg.hidden_size,
        vocab_size: mcfg.vocab_size,
        own_lm_head: cfg.own_lm_head,
        target: target.fingerprint()?,
        draft_vocab_size: None,
        token_aware: cfg.token_aware,
        recipe: serde_json::Value::Null,
    };
    let mut heads = Heads::init(&varmap, &hcfg, &lm, &device)?;
    let init = match &cfg.init {
        Some(dir) => {
            let from = Heads::from_dir(dir, target)?;
            warm_start(&varmap, &from.tensors(), dir)?;
            log(format!("starting from the heads in {}", dir.display()));
            Some(from)
        }
        None => None,
    };
    let mut slot_of: HashMap<u32, u32> = HashMap::new();
    let init_vocab = init.as_ref().and_then(|h| h.draft_vocab().map(|v| v.to_vec()));
    if init_vocab.is_some() || (init.is_none() && cfg.draft_vocab > 0 && cfg.draft_vocab < mcfg.vocab_size) {
        let ids = match init_vocab {
            Some(v) => v,
            None => frequent_tokens(train_set.iter().map(|c| c.tokens()), cfg.draft_vocab, &target.tokenizer.eos_ids),
        };
        slot_of = ids.iter().enumerate().map(|(i, &t)| (t, i as u32)).collect();
        log(format!("draft vocabulary: {} tokens{}", ids.len(), if init.is_some() { ", as --init's" } else { ", the corpus's most frequent" }));
        heads.set_draft_vocab(ids, &target.model)?;
    }
    let restricted = heads.draft_vocab().is_some();
    let slot = |t: u32| -> Option<u32> { if restricted { slot_of.get(&t).copied() } else { Some(t) } };
    let mut opt = AdamW::new(&varmap, cfg.weight_decay)?;
    let data = data_fingerprint(docs);
    let mut losses = if resume { resume_from(out, cfg, &data, &mut opt, &device, total_steps, log)? } else { Vec::new() };

    let embed = |t: &[u32]| target.model.embed(t);
    let runner = crate::train::parallel::GroupRunner::new()?;
    let vars: Vec<Tensor> = varmap.all_vars().iter().map(|v| v.as_tensor().clone()).collect();
    let done = run_steps(
        StepsSetup { cfg, out, data: &data, train_set: &train_set, per_epoch, total_steps, batches_for_epoch: &batches_for_epoch, val_levels: "" },
        &mut opt,
        &mut losses,
        progress,
        log,
        &mut |ids| {
            let groups = crate::train::parallel::split_groups(ids, cfg.grad_groups);
            let batches =
                groups.iter().map(|g| make_batch(&train_set, g, k_heads, cfg.loss, &slot, if cfg.token_aware { Some(&embed) } else { None })).collect::<Result<Vec<_>>>()?;
            let norm: Vec<f32> = (0..k_heads).map(|k| batches.iter().map(|b| b.valid[k].iter().filter(|&&v| v).count()).sum::<usize>() as f32).collect();
            runner.grads(batches, &vars, &|b| batch_loss(&heads, &lm, &b, cfg.decay, &norm))
        },
        &mut || if val_set.is_empty() { Ok(None) } else { validate(&heads, target, &val_set).map(Some) },
    )?;
    let val = if val_set.is_empty() { HeadAccuracy::default() } else { validate(&heads, target, &val_set)? };
    let report = TrainReport::new((train_tokens, val_tokens, hidden_secs), done.step, &losses, val, done.secs, done.tokens_seen);
    // Trained: now build the inference copies for drafting (they would go stale if built
    // while the weights were still changing).
    let mut heads = heads;
    crate::cpu::quant::with_block_fallback(target.model.weight_format(), |f| heads.set_draft_format(f))?;
    Ok((heads, report))
}

/// Held-out accuracy of the heads in `cfg.init` on the chunks a `train` run with `cfg` and
/// these `docs` holds out (the split is by content and seed), without computing the training
/// chunks' hidden states: how later heads are compared on an earlier run's validation set.
pub fn held_out_accuracy(target: &Target, docs: &[Document], cfg: &TrainConfig, cache_hidden: Option<&Path>, log: &mut dyn FnMut(String)) -> Result<HeadAccuracy> {
    let (dir, val_set) = held_out_set(target, docs, cfg, cfg.num_heads + 3, cache_hidden, log)?;
    validate(&Heads::from_dir(dir, target)?, target, &val_set)
}

/// The drafter directory to measure (`--init`) and the held-out chunks with their states, for
/// `--validate-only` with either drafter (`min_len` as its training run chunks).
pub(crate) fn held_out_set<'a>(target: &Target, docs: &[Document], cfg: &'a TrainConfig, min_len: usize, cache_hidden: Option<&Path>, log: &mut dyn FnMut(String)) -> Result<(&'a Path, Vec<Example>)> {
    let dir = cfg.init.as_deref().ok_or_else(|| Error::InvalidArgument("--validate-only needs --init: the drafter to measure".into()))?;
    let Prepared { val_set, .. } = prepare(target, docs, cfg, min_len, cache_hidden, false, log)?;
    if val_set.is_empty() {
        return Err(Error::InvalidArgument("no validation chunk: raise --val-fraction".into()));
    }
    Ok((dir, val_set))
}

/// What [`run_steps`] needs to know about a run besides the drafter.
pub(crate) struct StepsSetup<'a> {
    pub cfg: &'a TrainConfig,
    pub out: &'a Path,
    /// [`data_fingerprint`] of the run's documents, recorded in each checkpoint.
    pub data: &'a str,
    pub train_set: &'a [Example],
    pub per_epoch: usize,
    pub total_steps: usize,
    pub batches_for_epoch: &'a dyn Fn(usize) -> Vec<Vec<usize>>,
    /// Appended to each epoch's validation line (what the accuracies are per).
    pub val_levels: &'a str,
}

/// Where [`run_steps`] stopped.
pub(crate) struct StepsDone {
    pub step: usize,
    pub tokens_seen: usize,
    pub secs: f64,
}

/// The optimisation loop the heads and the draft layer share: from the optimizer's step counter
/// (0, or where a resumed checkpoint stopped) through the batches in epoch order, with the
/// cosine schedule, running accuracy and progress, atomic checkpoints, and a validation line at
/// each epoch's end. `batch_grads` returns a batch's loss, gradients and per-output (hits, rows);
/// `validate` the held-out accuracy, if there is held-out data.
#[allow(clippy::type_complexity)]
pub(crate) fn run_steps(
    setup: StepsSetup,
    opt: &mut AdamW,
    losses: &mut Vec<f64>,
    progress: Progress,
    log: &mut dyn FnMut(String),
    batch_grads: &mut dyn FnMut(&[usize]) -> Result<crate::train::parallel::BatchGrads>,
    validate: &mut dyn FnMut() -> Result<Option<HeadAccuracy>>,
) -> Result<StepsDone> {
    let StepsSetup { cfg, out, data, train_set, per_epoch, total_steps, batches_for_epoch, val_levels } = setup;
    let t_train = Instant::now();
    let start_step = opt.step;
    let mut tokens_seen = 0usize;
    let mut running: Vec<f64> = Vec::new();
    let mut step = opt.step;
    while step < total_steps && !(cfg.max_steps > 0 && step >= cfg.max_steps) {
        let batches = batches_for_epoch(step / per_epoch);
        let ids = &batches[step % per_epoch];
        let crate::train::parallel::BatchGrads { loss: lv, grads, acc } = batch_grads(ids)?;
        opt.step(&grads, learning_rate(step, total_steps, cfg.warmup_steps, cfg.lr), cfg.grad_clip)?;
        step = opt.step;
        losses.push(lv);
        tokens_seen += ids.iter().map(|&i| train_set[i].tokens().len()).sum::<usize>();
        running.resize(acc.len(), 0.0);
        for (k, (h, n)) in acc.iter().enumerate() {
            let a = *h as f64 / (*n).max(1) as f64;
            running[k] = if step == start_step + 1 { a } else { 0.9 * running[k] + 0.1 * a };
        }
        progress(step, total_steps, lv, &running, tokens_seen as f64 / t_train.elapsed().as_secs_f64());
        if step.is_multiple_of(cfg.checkpoint_every) || step == total_steps {
            save_checkpoint(out, opt, losses, cfg, data)?;
        }
        if step.is_multiple_of(per_epoch) {
            if let Some(v) = validate()? {
                log(format!(
                    "epoch {}: validation top-1 {:?} top-5 {:?}{val_levels}; estimated τ (bonus token counted) chain {:.2}, tree {:?} {:.2}",
                    step / per_epoch,
                    fmt(&v.top1),
                    fmt(&v.top5),
                    v.tau_chain,
                    TREE_WIDTHS,
                    v.tau_tree
                ));
            }
        }
    }
    Ok(StepsDone { step, tokens_seen, secs: t_train.elapsed().as_secs_f64() })
}

/// The corpus's tokens outside `skip`, most frequent first (ties: lower id).
pub(crate) fn tokens_by_frequency<'a>(chunks: impl Iterator<Item = &'a [u32]>, skip: &std::collections::HashSet<u32>) -> Vec<u32> {
    let mut counts: HashMap<u32, usize> = HashMap::new();
    for c in chunks {
        for &t in c.iter().filter(|t| !skip.contains(t)) {
            *counts.entry(t).or_default() += 1;
        }
    }
    let mut by_freq: Vec<(u32, usize)> = counts.into_iter().collect();
    by_freq.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    by_freq.into_iter().map(|x| x.0).collect()
}

/// The `n` most frequent tokens of the corpus (ties: lower id), plus the end-of-sequence ids,
/// in ascending id order.
pub fn frequent_tokens<'a>(chunks: impl Iterator<Item = &'a [u32]>, n: usize, always: &[u32]) -> Vec<u32> {
    let mut ids: Vec<u32> = tokens_by_frequency(chunks, &Default::default()).into_iter().take(n.saturating_sub(always.len())).collect();
    ids.extend(always.iter().copied());
    ids.sort_unstable();
    ids.dedup();
    ids
}

pub(crate) fn fmt(v: &[f64]) -> Vec<String> {
    v.iter().map(|x| format!("{x:.3}")).collect()
}

pub(crate) fn save_checkpoint(out: &Path, opt: &AdamW, losses: &[f64], cfg: &TrainConfig, data: &str) -> Result<()> {
    let meta = CheckpointMeta { step: opt.step, losses: losses.to_vec(), config: cfg.clone(), data: Some(data.to_string()) };
    let meta = serde_json::to_string(&meta).expect("meta serialises");
    crate::files::save_safetensors(&opt.state(), Some((CKPT_META_KEY, &meta)), &out.join(CKPT_TENSORS))?;
    // An earlier version's separate metadata file would now describe another step.
    let old = out.join(CKPT_META);
    if old.exists() {
        std::fs::remove_file(&old).map_err(|e| Error::io(&old, e))?;
    }
    Ok(())
}

/// Input paths of a run, for the recipe record.
pub fn describe_inputs(paths: &[PathBuf]) -> Vec<String> {
    paths.iter().map(|p| p.display().to_string()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tau_estimate_walks_steps_as_decoding_does() {
        let mut t = TauEstimate::default();
        let r = |v: &[Option<usize>]| Some(v.to_vec());
        // Position 0: levels 1-2 right at the first guess, level 3's truth second: the chain
        // and the tree (widths 3, 2, 1, 1) accept 2 and land on position 3. There: level 1's
        // truth is the second guess: the chain accepts nothing (next: position 4), the tree
        // all 4 (past the end). Position 4: nothing right. Positions 1 and 2 are never a
        // step's start; position 5 is not an answer position.
        t.push_chunk(vec![
            r(&[Some(0), Some(0), Some(1), Some(0)]),
            r(&[Some(0), Some(0), Some(0), Some(0)]),
            r(&[Some(0), Some(0), Some(0), Some(0)]),
            r(&[Some(1), Some(0), Some(0), Some(0)]),
            r(&[None, Some(0), Some(0), Some(0)]),
            None,
        ]);
        let (chain, tree) = t.both();
        // Chain: steps at 0 (3 tokens), 3 (1), 4 (1): 5 / 3. Tree: steps at 0 (3), 3 (5): 8 / 2.
        assert!((chain - 5.0 / 3.0).abs() < 1e-12, "{chain}");
        assert!((tree - 4.0).abs() < 1e-12, "{tree}");
        assert_eq!(TauEstimate::default().both(), (0.0, 0.0));
    }

    /// Values a run would accept and then make nothing loadable with: infinite learning rates
    /// (weights all NaN), more heads or layers than the loader takes, a NaN feature weight.
    #[test]
    fn configs_that_would_train_unloadable_or_nan_drafters_are_refused() {
        let ok = TrainConfig::default();
        assert!(ok.validate().is_ok());
        for (bad, flag) in [
            (TrainConfig { lr: f64::INFINITY, ..ok.clone() }, "--lr"),
            (TrainConfig { lr: f64::NAN, ..ok.clone() }, "--lr"),
            (TrainConfig { feature_weight: f64::NAN, ..ok.clone() }, "--feature-weight"),
            (TrainConfig { feature_weight: -1.0, ..ok.clone() }, "--feature-weight"),
            (TrainConfig { num_heads: crate::draft::heads::MAX_HEADS + 1, seq_len: 100, ..ok.clone() }, "--num-heads"),
            (TrainConfig { num_layers: crate::draft::heads::MAX_HEAD_LAYERS + 1, ..ok.clone() }, "--layers"),
        ] {
            let e = bad.validate().unwrap_err().to_string();
            assert!(e.contains(flag), "{flag}: {e}");
        }
        assert!(TrainConfig { num_heads: crate::draft::heads::MAX_HEADS, seq_len: 100, num_layers: crate::draft::heads::MAX_HEAD_LAYERS, ..ok }.validate().is_ok());
    }

    #[test]
    fn checkpoints_from_before_grad_groups_resume_as_one_group() {
        let mut old = serde_json::to_value(TrainConfig::default()).unwrap();
        old.as_object_mut().unwrap().remove("grad_groups");
        let old: TrainConfig = serde_json::from_value(old).unwrap();
        assert_eq!(old.grad_groups, 1);
        assert_eq!(config_differences(&old, &TrainConfig::default()), vec!["grad_groups: checkpoint 1, this run 2".to_string()]);
        assert!(config_differences(&old, &TrainConfig { grad_groups: 1, max_steps: 7, ..Default::default() }).is_empty());
    }

    #[test]
    fn cached_states_that_vanish_name_their_file() {
        let chunk = Chunk { tokens: vec![1, 2, 3], scored: vec![true; 3] };
        let gone = std::env::temp_dir().join(format!("selfspec-no-states-{}.safetensors", std::process::id()));
        let ex = Example { chunk: chunk.clone(), states: States::Cached(gone.clone()) };
        let e = ex.h().unwrap_err().to_string();
        assert!(e.contains(&gone.display().to_string()) && e.contains("vanished"), "{e}");
        // A file whose states are for another length is refused too.
        let t = Tensor::zeros((2, 4), DType::F32, &candle_core::Device::Cpu).unwrap();
        candle_core::safetensors::save(&HashMap::from([("h".to_string(), t)]), &gone).unwrap();
        let e = ex.h().unwrap_err().to_string();
        assert!(e.contains("2 tokens") && e.contains("has 3"), "{e}");
        let held = Example { chunk, states: States::Held(Tensor::ones((3, 4), DType::F32, &candle_core::Device::Cpu).unwrap()) };
        assert_eq!(held.h().unwrap().dims(), &[3, 4]);
        std::fs::remove_file(&gone).unwrap();
    }

    #[test]
    fn fit_batches_keeps_every_chunk_once() {
        let b = vec![vec![0, 1], vec![2], vec![3, 4, 5], vec![6]];
        for n in 1..9 {
            let f = fit_batches(b.clone(), n);
            let mut all: Vec<usize> = f.iter().flatten().copied().collect();
            all.sort();
            assert_eq!(all, (0..7).collect::<Vec<_>>());
            assert_eq!(f.len(), n.min(7), "n = {n}");
            assert!(f.iter().all(|x| !x.is_empty()));
        }
    }
}
