//! The target model: a Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) built from candle
//! pieces, with what speculation needs and candle-transformers' models do not offer: explicit
//! per-token positions, a tree attention mask, a compactable KV cache, and the final hidden
//! states returned next to (not instead of) the logits.
use std::sync::Arc;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Embedding, RmsNorm, VarBuilder};
use serde::{Deserialize, Serialize};

use crate::cpu::{GeluTanhGlu, ROW_KERNEL_MAX_ROWS, RowMatmul, SwiGlu, TreeAttention, TreeMask};
use crate::cpu::quant::{CpuMatmul, CpuWeight, QuantRows, Staged, WeightFormat};
use crate::model::gguf::RawRows;
use crate::model::kv_cache::KvCache;
use crate::{Error, Result};


/// The longest context a model may declare (positions are `u32` on their way into kernels, and
/// a bound keeps a hostile file's context from reaching sizes nothing here was tested at).
pub const MAX_CONTEXT: usize = 1 << 21;

/// `Default` is an empty Llama (zero sizes, which `validate` refuses): loaders fill in what a
/// file says and leave the family extras (Gemma's) at their Llama values.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Config {
    /// "llama", "mistral" or "qwen2": recorded in head fingerprints.
    pub architecture: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// How rotary frequencies are stretched for long contexts (Llama 3.1+), if at all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeScaling>,
    pub max_position: usize,
    pub tie_embeddings: bool,
    /// Qwen2 has biases on the q/k/v projections.
    pub attention_bias: bool,
    /// Qwen3 RMS-normalises each query and key head (its own weight over the head dimension)
    /// before the rotary embedding.
    #[serde(default)]
    pub qk_norm: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// Gemma 3: token embeddings are multiplied by √hidden_size.
    #[serde(default, skip_serializing_if = "is_false")]
    pub embed_scale: bool,
    /// Gemma 3: RMS norms on the attention's and the MLP's outputs too, before each residual add
    /// (`post_attention_layernorm`, `post_feedforward_layernorm`; the MLP's input norm is then
    /// `pre_feedforward_layernorm`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub post_norms: bool,
    /// The MLP's gate activation.
    #[serde(default, skip_serializing_if = "Activation::is_silu")]
    pub activation: Activation,
    /// The attention's score scale when it is not 1/√head_dim (Gemma 3: 1/√query_pre_attn_scalar).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attn_scale: Option<f64>,
    /// Sliding-window attention: a layer marked in `local_layers` sees only keys fewer than
    /// this many positions before the query (the query's own included).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<usize>,
    /// Per layer: whether it is a local (sliding-window) layer. Empty: none is.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub local_layers: Vec<bool>,
    /// The rotary base of local layers (unscaled); the others use `rope_theta` and its scaling.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_rope_theta: Option<f64>,
    /// Added to every RMS norm weight at load. Gemma's checkpoints store w and scale by 1 + w;
    /// its GGUFs store 1 + w already (llama.cpp's converter adds the 1).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub norm_offset: f64,
    /// An EAGLE-3 draft layer: the attention reads `[input_layernorm(embedding),
    /// hidden_norm(g)]` (twice the hidden width) and the residual stream starts from `g`, a
    /// feature vector given beside the token (see [`Llama::forward_fused_after`]).
    #[serde(default, skip_serializing_if = "is_false")]
    pub eagle3_input: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

/// The gate activation of the MLP: `act(gate(x)) * up(x)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// Llama, Mistral, Qwen.
    #[default]
    Silu,
    /// Gemma: GELU with the tanh approximation (`gelu_pytorch_tanh`).
    GeluTanh,
}

impl Activation {
    fn is_silu(&self) -> bool {
        *self == Activation::Silu
    }
}

/// Sliding windows must reach past any tree a step verifies: a node's ancestors are then all
/// inside its window, and only the cached prefix needs clipping.
pub const MIN_SLIDING_WINDOW: usize = 128;

/// Rotary-embedding scaling, as models declare it (`rope_scaling` in config.json; `rope_freqs.weight`
/// and `*.rope.scaling.*` in GGUF). Each stretches the per-dimension frequencies
/// θ_i = base^(-2i/d) once; positions are unchanged. Types not listed here (yarn, dynamic,
/// longrope) are refused at load: decoding without them would be silently wrong.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Every frequency divided by `factor` (position interpolation).
    Linear { factor: f64 },
    /// Llama 3.1's: wavelengths longer than `original_max_position / low_freq_factor` are
    /// divided by `factor`, those shorter than `original_max_position / high_freq_factor` kept,
    /// and a smooth blend in between (transformers' `_compute_llama3_parameters`).
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position: usize },
    /// Per-frequency divisors, one per dimension pair: what llama.cpp's converter stores in a
    /// GGUF's `rope_freqs.weight` (Llama 3.1+).
    Divisors { divisors: Vec<f32> },
}

impl RopeScaling {
    /// Check the parameters against the head dimension `head_dim`.
    pub fn validate(&self, head_dim: usize) -> std::result::Result<(), String> {
        let ok = |x: f64| x.is_finite() && x > 0.0;
        match self {
            RopeScaling::Linear { factor } if !ok(*factor) => Err(format!("rope scaling factor {factor} must be positive")),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
                if !ok(*factor) || !ok(*low_freq_factor) || !ok(*high_freq_factor) || high_freq_factor <= low_freq_factor || *original_max_position == 0 {
                    return Err(format!("llama3 rope scaling needs a positive factor ({factor}), 0 < low_freq_factor ({low_freq_factor}) < high_freq_factor ({high_freq_factor}) and an original context ({original_max_position})"));
                }
                Ok(())
            }
            RopeScaling::Divisors { divisors } if divisors.len() != head_dim / 2 || divisors.iter().any(|&d| !ok(d as f64)) => {
                Err(format!("rope frequency divisors: {} values (want {}, all positive)", divisors.len(), head_dim / 2))
            }
            _ => Ok(()),
        }
    }

    /// `inv_freq` (θ_i, f32 as the references compute it) stretched.
    pub fn apply(&self, inv_freq: &mut [f32]) {
        match self {
            RopeScaling::Linear { factor } => inv_freq.iter_mut().for_each(|f| *f /= *factor as f32),
            RopeScaling::Divisors { divisors } => inv_freq.iter_mut().zip(divisors).for_each(|(f, d)| *f /= d),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
                let (factor, lo, hi, old) = (*factor as f32, *low_freq_factor as f32, *high_freq_factor as f32, *original_max_position as f32);
                let (low_wavelen, high_wavelen) = (old / lo, old / hi);
                for f in inv_freq.iter_mut() {
                    let wavelen = 2.0 * std::f32::consts::PI / *f;
                    if wavelen > low_wavelen {
                        *f /= factor;
                    } else if wavelen >= high_wavelen {
                        let smooth = (old / wavelen - lo) / (hi - lo);
                        *f = (1.0 - smooth) * *f / factor + smooth * *f;
                    }
                }
            }
        }
    }
}

impl Config {
    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.num_heads == 0 || self.num_kv_heads == 0 || self.num_heads % self.num_kv_heads != 0 {
            return Err(format!("{} attention heads cannot share {} key/value heads", self.num_heads, self.num_kv_heads));
        }
        if self.head_dim == 0 || self.head_dim % 2 != 0 {
            return Err(format!("head dimension {} must be even", self.head_dim));
        }
        if self.vocab_size == 0 || self.hidden_size == 0 || self.num_layers == 0 || self.max_position == 0 {
            return Err("vocabulary, hidden size, layer count and context must be positive".into());
        }
        if self.num_heads.checked_mul(self.head_dim).is_none() || self.hidden_size.checked_mul(self.intermediate_size.max(1)).is_none() {
            return Err(format!("sizes out of range: {} heads of {} dimensions, hidden {}, FFN {}", self.num_heads, self.head_dim, self.hidden_size, self.intermediate_size));
        }
        if let Some(r) = &self.rope_scaling {
            r.validate(self.head_dim)?;
        }
        match (self.sliding_window, self.local_layers.is_empty()) {
            (Some(w), false) if w < MIN_SLIDING_WINDOW => return Err(format!("a sliding window of {w} positions; at least {MIN_SLIDING_WINDOW} are supported")),
            (Some(_), false) if self.local_layers.len() != self.num_layers => return Err(format!("{} layer types for {} layers", self.local_layers.len(), self.num_layers)),
            (None, false) => return Err("local layers without a sliding window".into()),
            _ => {}
        }
        if let Some(s) = self.attn_scale.filter(|s| !(s.is_finite() && *s > 0.0)) {
            return Err(format!("attention scale {s} must be positive"));
        }
        // A norm epsilon of zero or less (or NaN) divides by zero or worse; a rotary base of zero
        // or less gives NaN angles: either makes every output garbage without an error.
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(format!("RMS norm epsilon {} must be a positive number", self.rms_norm_eps));
        }
        if let Some(t) = [Some(self.rope_theta), self.local_rope_theta].into_iter().flatten().find(|t| !(t.is_finite() && *t > 0.0)) {
            return Err(format!("rotary base (rope theta) {t} must be a positive number"));
        }
        // Positions travel as u32 and the KV cache grows up to the context: a context past
        // this is refused rather than trusted.
        if self.max_position > MAX_CONTEXT {
            return Err(format!("a context of {} tokens; at most {MAX_CONTEXT} are supported", self.max_position));
        }
        Ok(())
    }

    /// Multiply-adds of the weight matrices per token (attention over the context excluded):
    /// with the weight bytes, what a forward's floor on a given machine follows from.
    pub fn matmul_macs_per_token(&self) -> usize {
        let (h, q, kv) = (self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim);
        let layer = h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size;
        self.num_layers * layer + self.vocab_size * h
    }
}

/// A linear layer. On the CPU it has a fast-path copy of its weight in a [`WeightFormat`], and
/// every call, whatever its row count, uses that copy's batch-invariant kernel: a row's bits
/// then never depend on what shares its forward (a server's batch, a prompt's prefill chunk).
/// It is also the faster path at every size measured: SmolLM2 f32 on a 2-core AVX-512 Xeon,
/// 64 rows 76 ms with the kernel, 65 rows 194 ms and 128 rows 304 ms with candle's gemm.
/// Other devices use candle's matmul on the f32 weight.
///
/// The f32 weight is there only where something needs it (f32 format, GPUs, training): a model
/// loaded straight into a compact format ([`Llama::build`]) holds the fast copy alone, which is
/// what lets a 4-bit 8B model load in a few GB instead of 32 GB of f32.
#[derive(Clone)]
pub struct Linear {
    weight: Option<Tensor>,
    bias: Option<Tensor>,
    fast: Option<Arc<CpuWeight>>,
}

impl Linear {
    /// Without a fast copy (the row kernel still keeps CPU results batch-invariant).
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Linear { weight: Some(weight), bias, fast: None }
    }
    /// With an f32 panel copy for the fast CPU kernel (costs a second copy of the weight).
    pub fn new_packed(weight: Tensor, bias: Option<Tensor>) -> Result<Self> {
        let mut l = Linear::new(weight, bias);
        l.set_format(WeightFormat::F32, None)?;
        Ok(l)
    }
    /// The fast copy alone, without an f32 weight (CPU only).
    pub fn packed_only(fast: CpuWeight, bias: Option<Tensor>) -> Self {
        Linear { weight: None, bias, fast: Some(Arc::new(fast)) }
    }
    pub fn load(in_dim: usize, out_dim: usize, bias: bool, vb: VarBuilder) -> Result<Self> {
        let weight = vb.get((out_dim, in_dim), "weight")?;
        let bias = if bias { Some(vb.get(out_dim, "bias")?) } else { None };
        Self::new_packed(weight, bias)
    }
    /// The same layer without its f32 weight (its fast copy shared, not copied).
    pub fn packed_only_from(l: &Linear) -> Self {
        Linear { weight: if l.fast.is_some() { None } else { l.weight.clone() }, bias: l.bias.clone(), fast: l.fast.clone() }
    }
    /// The f32 weight `[out, in]`, or an error for a layer loaded without one.
    pub fn weight(&self) -> Result<&Tensor> {
        self.weight.as_ref().ok_or_else(|| Error::InvalidArgument(format!("this layer was loaded in the {} format without an f32 copy of its weight; load with --weights f32 for this", self.format_name().unwrap_or("packed"))))
    }
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }
    /// `[out, in]`.
    pub fn dims(&self) -> Result<(usize, usize)> {
        match (&self.weight, &self.fast) {
            (Some(w), _) => Ok(w.dims2()?),
            (None, Some(f)) => Ok((f.rows(), f.cols())),
            (None, None) => Err(Error::InvalidArgument("a linear layer with no weight".into())),
        }
    }
    /// The fast-path format in use, e.g. "q4" or "f32"; `None` off the CPU.
    pub fn format_name(&self) -> Option<&'static str> {
        self.fast.as_ref().map(|f| f.format_name())
    }
    /// Bytes one call streams from the fast copy (the f32 weight's size off the CPU).
    pub fn bytes_per_call(&self) -> usize {
        match (&self.fast, &self.weight) {
            (Some(f), _) => f.bytes(),
            (None, Some(w)) => w.elem_count() * w.dtype().size_in_bytes(),
            (None, None) => 0,
        }
    }
    /// Rebuild the fast copy in `format` from the f32 weight. `native` is this weight's own GGUF
    /// blocks, which [`WeightFormat::Native`] keeps; native without blocks means f32.
    pub fn set_format(&mut self, format: WeightFormat, native: Option<&QuantRows>) -> Result<()> {
        let w = self.weight()?.clone();
        if !w.device().is_cpu() || w.dtype() != DType::F32 {
            self.fast = None;
            return Ok(());
        }
        self.fast = Some(Arc::new(stage_f32(&w, format, native)?.pack()?));
        Ok(())
    }
    /// `x [rows, in] -> [rows, out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let rows = x.dim(0)?;
        let cpu_f32 = x.device().is_cpu() && x.dtype() == DType::F32;
        let y = match (&self.fast, &self.weight) {
            (Some(f), _) if cpu_f32 => x.contiguous()?.apply_op1_no_bwd(&CpuMatmul(f.clone()))?,
            (_, Some(w)) if cpu_f32 && rows <= ROW_KERNEL_MAX_ROWS => x.contiguous()?.apply_op2_no_bwd(w, &RowMatmul)?,
            (_, Some(w)) => x.matmul(&w.t()?)?,
            (_, None) => return Err(Error::InvalidArgument("this layer has only a CPU copy of its weight; run it on the CPU in f32".into())),
        };
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

/// An f32 weight staged for `format` (its GGUF blocks under native, when it has them).
fn stage_f32(w: &Tensor, format: WeightFormat, native: Option<&QuantRows>) -> Result<Staged> {
    let (n, k) = w.dims2()?;
    match (format, native) {
        (WeightFormat::Native, Some(q)) if (q.n, q.k) != (n, k) => Err(Error::InvalidArgument(format!("quantized weight is [{}, {}], layer is [{n}, {k}]", q.n, q.k))),
        (WeightFormat::Native, Some(q)) => Ok(Staged::Blocks(q.clone())),
        _ => Ok(Staged::Values { data: w.flatten_all()?.to_vec1::<f32>()?, n, k, format }),
    }
}

/// Projections of the same input (q/k/v, gate/up) fused into one CPU kernel call: one weight
/// stream and one parallel region instead of three or two. Each output column is computed
/// exactly as in its own layer, so fusing changes no bits.
#[derive(Clone)]
struct Fused {
    fast: Arc<CpuWeight>,
    sizes: Vec<usize>,
    bias: Option<Tensor>,
}

/// Give `parts` their fast copies from `staged` (one per part): fused into one kernel when they
/// can share one (same format and block kind, all or none with a bias), each its own otherwise.
fn install(parts: &mut [&mut Linear], staged: Vec<Staged>) -> Result<Option<Fused>> {
    let biases: Option<Vec<Tensor>> = parts.iter().map(|p| p.bias.clone()).collect();
    let same_bias = biases.is_some() || parts.iter().all(|p| p.bias.is_none());
    if same_bias && Staged::can_stack(&staged) {
        let sizes = staged.iter().map(|s| s.dims().0).collect();
        let fast = Arc::new(Staged::stack(staged)?.pack()?);
        let bias = match biases {
            Some(bs) => Some(Tensor::cat(&bs, 0)?),
            None => None,
        };
        for p in parts.iter_mut() {
            p.fast = None;
        }
        return Ok(Some(Fused { fast, sizes, bias }));
    }
    for (p, s) in parts.iter_mut().zip(staged) {
        p.fast = Some(Arc::new(s.pack()?));
    }
    Ok(None)
}

impl Fused {
    fn applies(&self, x: &Tensor) -> Result<bool> {
        Ok(x.device().is_cpu() && x.dtype() == DType::F32)
    }

    /// `x [rows, in]` -> `[rows, sum of out_i]`, the parts side by side.
    fn forward_joined(&self, x: &Tensor) -> Result<Tensor> {
        let y = x.contiguous()?.apply_op1_no_bwd(&CpuMatmul(self.fast.clone()))?;
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }

    /// `x [rows, in]` -> one `[rows, out_i]` tensor per fused part.
    fn forward(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        let y = self.forward_joined(x)?;
        let mut out = Vec::with_capacity(self.sizes.len());
        let mut at = 0;
        for &n in &self.sizes {
            out.push(y.narrow(1, at, n)?);
            at += n;
        }
        Ok(out)
    }
}

/// The token embedding: an f32 table, or (for a GGUF loaded in a compact format) the file's own
/// rows read in place, dequantised a few at a time. Both give the same values. `Absent` for a
/// model whose inputs never come from its own table (a draft layer's decoder, fed through `fc`).
#[derive(Clone)]
pub enum TokenEmbedding {
    F32(Embedding),
    Rows(RawRows),
    Absent,
}

impl TokenEmbedding {
    /// `[T, hidden]` for token ids `ids` (checked against the vocabulary by the caller).
    pub fn lookup(&self, ids: &[u32], device: &Device) -> Result<Tensor> {
        match self {
            TokenEmbedding::F32(e) => Ok(e.forward(&Tensor::new(ids, device)?)?),
            TokenEmbedding::Rows(r) => r.gather(ids, device),
            TokenEmbedding::Absent => Err(Error::InvalidArgument("this model was built without a token embedding (a draft layer's decoder takes its inputs through fc)".into())),
        }
    }
}

/// Where [`Llama::build`] reads its tensors, by Hugging Face name (`model.layers.N.…`): a
/// `VarBuilder` (safetensors, tests, drafters) or a GGUF file (see `model::loader`).
pub trait WeightSource {
    /// The tensor as f32, with the shape given, on `device`.
    fn tensor(&self, name: &str, shape: &[usize], device: &Device) -> Result<Tensor>;
    /// A projection's weight `[out, in]` staged for `format`'s CPU fast path. The default reads
    /// the f32 tensor; a GGUF keeps its blocks under [`WeightFormat::Native`].
    fn staged(&self, name: &str, shape: (usize, usize), format: WeightFormat) -> Result<Staged> {
        let format = if format == WeightFormat::Native { WeightFormat::F32 } else { format };
        stage_f32(&self.tensor(name, &[shape.0, shape.1], &Device::Cpu)?, format, None)
    }
    /// The rows of a matrix, read in place, where the source can (a memory-mapped GGUF).
    fn rows(&self, _name: &str) -> Result<Option<RawRows>> {
        Ok(None)
    }
    /// Done with `name`'s staged weight (it is packed): a memory-mapped source drops its pages.
    fn release(&self, _name: &str) {}
    /// Whether the model looks tokens up in its own embedding table. A source that says no (a
    /// draft layer read from its 4-bit rows) gets a model without that table, whose tied lm_head
    /// then lives in its packed copy alone (no f32 rows: draft vocabulary × hidden × 4 bytes,
    /// 19 MB for SmolLM2's EAGLE-3 layer, about 0.5 GB for a 32k-row layer on an 8B model).
    fn embeds_tokens(&self) -> bool {
        true
    }
}

impl WeightSource for VarBuilder<'_> {
    fn tensor(&self, name: &str, shape: &[usize], device: &Device) -> Result<Tensor> {
        Ok(self.get(shape, name)?.to_device(device)?)
    }
}

/// How [`Llama::set_weights`] treats one tensor under [`WeightFormat::Native`].
#[derive(Clone, Debug)]
pub enum NativeWeight {
    /// The GGUF's own blocks, kept as they are.
    Blocks(QuantRows),
    /// Stored as f16 in the file.
    F16,
    /// A quantized type without a kernel here (K-quants and others): requantised to Q8_0.
    Requantize,
}

/// Per-tensor native formats by Hugging Face name; tensors absent are f32.
pub type NativeWeights = std::collections::HashMap<String, NativeWeight>;

struct Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    qkv: Option<Fused>,
    /// Per-head query and key norms (Qwen3), applied before the rotary embedding.
    qk_norm: Option<(RmsNorm, RmsNorm)>,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
    gate_up: Option<Fused>,
    activation: Activation,
}

struct Block {
    attn_norm: RmsNorm,
    attn: Attention,
    mlp_norm: RmsNorm,
    mlp: Mlp,
    /// Norms of the attention's and the MLP's outputs (Gemma 3).
    post_norms: Option<(RmsNorm, RmsNorm)>,
    /// EAGLE-3's norm of the feature half of the attention input (see [`Config::eagle3_input`]).
    hidden_norm: Option<RmsNorm>,
    /// A local (sliding-window) layer.
    local: bool,
}

/// One sequence of a [`Llama::forward_batch`] call.
pub struct BatchEntry<'a> {
    pub tokens: &'a [u32],
    pub positions: &'a [usize],
    pub mask: &'a TreeMask,
    pub cache: &'a mut KvCache,
}

/// A sequence inside the blocks: where its rows come from and which cache they extend.
struct Segment<'a> {
    positions: &'a [usize],
    /// Over the last `tail` slots of `cache` and then the new rows.
    mask: &'a TreeMask,
    tail: usize,
    cache: &'a mut KvCache,
}

/// Rows `start..start + len` of a batched forward attend over their own cache (`prefix` slots,
/// all visible) and the mask's nodes (the mask's last `len` nodes are these rows).
struct AttnSpan {
    start: usize,
    len: usize,
    prefix: usize,
    mask: Arc<TreeMask>,
}

pub struct Llama {
    embed: TokenEmbedding,
    blocks: Vec<Block>,
    norm: RmsNorm,
    lm_head: Linear,
    /// The lm_head's exact rows read in place, for a GGUF model built without f32 weights
    /// (drafters copy rows of the lm_head; see [`Llama::lm_head_rows`]).
    lm_rows: Option<RawRows>,
    /// Whether every projection has its f32 weight, so [`Llama::set_weights`] can re-pack.
    has_f32: bool,
    cfg: Config,
    device: Device,
    format: WeightFormat,
    kv_dtype: DType,
    /// Layers whose inputs a forward returns beside the final hidden states (see
    /// [`Llama::set_feature_layers`]); empty for the final states alone.
    taps: Vec<usize>,
}

/// Rotary cos and sin `[positions.len(), head_dim / 2]` for `positions`. Computed per forward
/// for the positions in it rather than tabled for the whole context at load: a 128k-token
/// context's tables would be 64 MB and a tenth of a second of start-up, and the same formula
/// gives the same bits either way.
pub(crate) fn rope_rows(cfg: &Config, positions: &[usize], device: &Device) -> Result<(Tensor, Tensor)> {
    rope_rows_with(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling.as_ref(), positions, device)
}

/// [`rope_rows`] for a given base and scaling (local layers have their own, unscaled).
fn rope_rows_with(head_dim: usize, base: f64, scaling: Option<&RopeScaling>, positions: &[usize], device: &Device) -> Result<(Tensor, Tensor)> {
    let half = head_dim / 2;
    let mut theta: Vec<f32> = (0..half)
        .map(|i| 1f32 / (base as f32).powf((2 * i) as f32 / head_dim as f32))
        .collect();
    if let Some(r) = scaling {
        r.apply(&mut theta);
    }
    let mut cos = Vec::with_capacity(positions.len() * half);
    let mut sin = Vec::with_capacity(positions.len() * half);
    for &p in positions {
        for &th in &theta {
            let a = p as f32 * th;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    Ok((
        Tensor::from_vec(cos, (positions.len(), half), device)?,
        Tensor::from_vec(sin, (positions.len(), half), device)?,
    ))
}

/// [`rope_rows`] for every position of the model's context (training keeps these).
pub(crate) fn rope_tables(cfg: &Config, device: &Device) -> Result<(Tensor, Tensor)> {
    rope_rows(cfg, &(0..cfg.max_position).collect::<Vec<_>>(), device)
}

impl Llama {
    /// Weights use Hugging Face names (`model.layers.N.self_attn.q_proj.weight`, ...); the GGUF
    /// loader renames and un-permutes its tensors into this layout. f32 weights throughout.
    pub fn load(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        let device = vb.device().clone();
        Self::build(&vb, cfg, WeightFormat::F32, &device)
    }

    /// Build from `src` with the CPU fast path in `format`. The f32 weights are kept only where
    /// something needs them (format f32, or a device other than the CPU, whose kernels are
    /// candle's); otherwise each projection is read, packed and dropped, one group at a time,
    /// so the model never exists in f32.
    pub fn build(src: &dyn WeightSource, cfg: &Config, format: WeightFormat, device: &Device) -> Result<Self> {
        cfg.validate().map_err(Error::InvalidArgument)?;
        let keep_f32 = format == WeightFormat::F32 || !device.is_cpu();
        let (d, nh, nkv, hd, ff) = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size);
        let shifted = |w: Tensor| -> Result<Tensor> { Ok(if cfg.norm_offset != 0.0 { (w + cfg.norm_offset)? } else { w }) };
        let norm = |name: &str| -> Result<RmsNorm> { Ok(RmsNorm::new(shifted(src.tensor(&format!("{name}.weight"), &[d], device)?)?, cfg.rms_norm_eps)) };
        // A projection `name` of shape [out, in]: its f32 weight when kept, its bias if any.
        let linear = |name: &str, out: usize, inp: usize, bias: bool| -> Result<Linear> {
            let bias = if bias { Some(src.tensor(&format!("{name}.bias"), &[out], device)?) } else { None };
            let weight = if keep_f32 { Some(src.tensor(&format!("{name}.weight"), &[out, inp], device)?) } else { None };
            Ok(Linear { weight, bias, fast: None })
        };
        // Without f32 weights: stage the group's weights (names and [out, in] shapes) from the
        // source and pack them now.
        let pack = |parts: &mut [&mut Linear], names: &[(&str, (usize, usize))]| -> Result<Option<Fused>> {
            if keep_f32 {
                return Ok(None);
            }
            let staged = names.iter().map(|(n, shape)| src.staged(&format!("{n}.weight"), *shape, format)).collect::<Result<Vec<_>>>()?;
            let fused = install(parts, staged)?;
            for (n, _) in names {
                src.release(&format!("{n}.weight"));
            }
            Ok(fused)
        };
        // The lm_head first: packing holds a tensor twice for a moment, and the largest tensor
        // costs least while little else is resident (SmolLM2 native: 60 MB off the peak).
        let embed_name = "model.embed_tokens.weight";
        let head_name = if cfg.tie_embeddings { embed_name } else { "lm_head.weight" };
        let in_place = if keep_f32 { None } else { src.rows(embed_name)? };
        let no_table = !keep_f32 && !src.embeds_tokens();
        let (embed, embed_w) = match in_place {
            Some(rows) => (TokenEmbedding::Rows(rows), None),
            None if no_table => (TokenEmbedding::Absent, None),
            None => {
                let w = src.tensor(embed_name, &[cfg.vocab_size, d], device)?;
                (TokenEmbedding::F32(Embedding::new(w.clone(), d)), Some(w))
            }
        };
        let lm_rows = if keep_f32 { None } else { src.rows(head_name)? };
        // The lm_head keeps an f32 weight when kept throughout, or when its rows cannot be read
        // in place (a tied head then shares the embedding's table: no extra memory).
        let head_w = match (&embed_w, cfg.tie_embeddings) {
            (Some(w), true) => Some(w.clone()),
            _ if no_table => None,
            _ if keep_f32 || lm_rows.is_none() => Some(src.tensor(head_name, &[cfg.vocab_size, d], device)?),
            _ => None,
        };
        let mut lm_head = Linear { weight: head_w, bias: None, fast: None };
        pack(&mut [&mut lm_head], &[(head_name.trim_end_matches(".weight"), (cfg.vocab_size, d))])?;
        let mut blocks = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = format!("model.layers.{i}");
            let n = |s: &str| format!("{p}.{s}");
            let (qn, kn, vn, on) = (n("self_attn.q_proj"), n("self_attn.k_proj"), n("self_attn.v_proj"), n("self_attn.o_proj"));
            let (gn, un, dn) = (n("mlp.gate_proj"), n("mlp.up_proj"), n("mlp.down_proj"));
            let attn_in = if cfg.eagle3_input { 2 * d } else { d };
            let (qs, kvs, os, ups, downs) = ((nh * hd, attn_in), (nkv * hd, attn_in), (d, nh * hd), (ff, d), (d, ff));
            let mut q = linear(&qn, qs.0, qs.1, cfg.attention_bias)?;
            let mut k = linear(&kn, kvs.0, kvs.1, cfg.attention_bias)?;
            let mut v = linear(&vn, kvs.0, kvs.1, cfg.attention_bias)?;
            let mut o = linear(&on, os.0, os.1, false)?;
            let mut gate = linear(&gn, ups.0, ups.1, false)?;
            let mut up = linear(&un, ups.0, ups.1, false)?;
            let mut down = linear(&dn, downs.0, downs.1, false)?;
            let qkv = pack(&mut [&mut q, &mut k, &mut v], &[(&qn, qs), (&kn, kvs), (&vn, kvs)])?;
            pack(&mut [&mut o], &[(&on, os)])?;
            let gate_up = pack(&mut [&mut gate, &mut up], &[(&gn, ups), (&un, ups)])?;
            pack(&mut [&mut down], &[(&dn, downs)])?;
            blocks.push(Block {
                attn_norm: norm(&n("input_layernorm"))?,
                attn: Attention {
                    q,
                    k,
                    v,
                    o,
                    qkv,
                    qk_norm: if cfg.qk_norm {
                        let head_norm = |name: &str| -> Result<RmsNorm> { Ok(RmsNorm::new(shifted(src.tensor(&format!("{name}.weight"), &[hd], device)?)?, cfg.rms_norm_eps)) };
                        Some((head_norm(&n("self_attn.q_norm"))?, head_norm(&n("self_attn.k_norm"))?))
                    } else {
                        None
                    },
                    num_heads: nh,
                    num_kv_heads: nkv,
                    head_dim: hd,
                },
                // With post norms (Gemma 3), `post_attention_layernorm` is the attention's output
                // norm and the MLP's input norm is `pre_feedforward_layernorm`.
                mlp_norm: norm(&n(if cfg.post_norms { "pre_feedforward_layernorm" } else { "post_attention_layernorm" }))?,
                mlp: Mlp { gate, up, down, gate_up, activation: cfg.activation },
                post_norms: if cfg.post_norms { Some((norm(&n("post_attention_layernorm"))?, norm(&n("post_feedforward_layernorm"))?)) } else { None },
                hidden_norm: if cfg.eagle3_input { Some(norm(&n("hidden_norm"))?) } else { None },
                local: cfg.local_layers.get(i).copied().unwrap_or(false),
            });
        }
        let final_norm = norm("model.norm")?;
        let mut model = Llama { embed, blocks, norm: final_norm, lm_head, lm_rows, has_f32: keep_f32, cfg: cfg.clone(), kv_dtype: default_kv_dtype(device), device: device.clone(), format, taps: Vec::new() };
        if keep_f32 {
            // Fast copies (and the fused q/k/v and gate/up) from the f32 weights.
            model.set_weights(format, &NativeWeights::new())?;
        }
        Ok(model)
    }

    /// Switch every projection's CPU fast path to `format`, re-packing from the f32 weights (so
    /// only for a model that has them: see [`Llama::build`]). `native` (filled by whoever has
    /// the blocks) says, per Hugging Face tensor name, what [`WeightFormat::Native`] keeps;
    /// tensors absent from it stay f32. Off the CPU this changes nothing: GPUs keep candle's f32
    /// kernels.
    pub fn set_weights(&mut self, format: WeightFormat, native: &NativeWeights) -> Result<()> {
        if !self.has_f32 {
            return Err(Error::InvalidArgument(format!("the model was loaded in the {} format without f32 weights to re-pack; load it again in the format wanted", self.format)));
        }
        let on_cpu = self.device.is_cpu();
        // What each tensor becomes: under native, its own blocks, or a stand-in format.
        let resolve = |name: &str| -> (WeightFormat, Option<&QuantRows>) {
            match format {
                WeightFormat::Native => match native.get(name) {
                    Some(NativeWeight::Blocks(q)) => (WeightFormat::Native, Some(q)),
                    Some(NativeWeight::F16) => (WeightFormat::F16, None),
                    Some(NativeWeight::Requantize) => (WeightFormat::Q8_0, None),
                    None => (WeightFormat::F32, None),
                },
                f => (f, None),
            }
        };
        // Fuse when every part resolves to the same format (and block kind): then the parts'
        // own fast copies are never used and are dropped.
        let set = |parts: &mut [&mut Linear], names: &[String]| -> Result<Option<Fused>> {
            if !on_cpu {
                for p in parts.iter_mut() {
                    p.fast = None;
                }
                return Ok(None);
            }
            let staged = parts
                .iter()
                .zip(names)
                .map(|(p, n)| {
                    let (f, q) = resolve(n);
                    stage_f32(p.weight()?, f, q).map_err(|e| Error::InvalidArgument(format!("{n}: {e}")))
                })
                .collect::<Result<Vec<_>>>()?;
            install(parts, staged)
        };
        for (i, b) in self.blocks.iter_mut().enumerate() {
            let p = format!("model.layers.{i}.");
            let n = |s: &str| format!("{p}{s}.weight");
            b.attn.qkv = set(&mut [&mut b.attn.q, &mut b.attn.k, &mut b.attn.v], &[n("self_attn.q_proj"), n("self_attn.k_proj"), n("self_attn.v_proj")])?;
            set(&mut [&mut b.attn.o], &[n("self_attn.o_proj")])?;
            b.mlp.gate_up = set(&mut [&mut b.mlp.gate, &mut b.mlp.up], &[n("mlp.gate_proj"), n("mlp.up_proj")])?;
            set(&mut [&mut b.mlp.down], &[n("mlp.down_proj")])?;
        }
        let head = if self.cfg.tie_embeddings { "model.embed_tokens.weight" } else { "lm_head.weight" };
        set(&mut [&mut self.lm_head], &[head.to_string()])?;
        self.format = format;
        Ok(())
    }
    /// Drop the f32 weights of every projection that has a CPU fast copy, keeping only that copy
    /// (a model built by [`Llama::load`] in f32 and then re-packed holds both). For drafters,
    /// which are re-packed from f32 at load: their f32 weights are no longer read once they
    /// draft in a compact format. Afterwards [`Llama::set_weights`] refuses (nothing to re-pack
    /// from). Off the CPU, or in f32, nothing is dropped: candle's kernels read the f32 weights.
    pub fn release_f32_weights(&mut self) {
        if !self.device.is_cpu() || self.format == WeightFormat::F32 {
            return;
        }
        let release = |l: &mut Linear, fused: bool| {
            if fused || l.fast.is_some() {
                l.weight = None;
            }
        };
        for b in &mut self.blocks {
            let qkv = b.attn.qkv.is_some();
            for l in [&mut b.attn.q, &mut b.attn.k, &mut b.attn.v] {
                release(l, qkv);
            }
            let gate_up = b.mlp.gate_up.is_some();
            for l in [&mut b.mlp.gate, &mut b.mlp.up] {
                release(l, gate_up);
            }
            release(&mut b.attn.o, false);
            release(&mut b.mlp.down, false);
        }
        // The lm_head's rows stay readable where they are the embedding's (a tied head): the
        // table is shared, so dropping the head's reference frees nothing.
        if !self.cfg.tie_embeddings || matches!(self.embed, TokenEmbedding::Rows(_)) {
            release(&mut self.lm_head, false);
        }
        self.has_f32 = false;
    }

    /// The CPU fast path's weight format.
    pub fn weight_format(&self) -> WeightFormat {
        self.format
    }
    /// The element type of the KV caches this model makes: f16 (the CPU default, half the bytes
    /// for attention to stream) or f32 (exact K/V, the reference).
    pub fn set_kv_dtype(&mut self, dtype: DType) -> Result<()> {
        crate::model::kv_cache::check_dtype(dtype)?;
        self.kv_dtype = dtype;
        Ok(())
    }
    pub fn kv_dtype(&self) -> DType {
        self.kv_dtype
    }
    /// Bytes of projection weights read per forward: the memory-bound floor's numerator.
    pub fn weight_bytes_per_forward(&self) -> usize {
        let mut total = self.lm_head.bytes_per_call();
        for b in &self.blocks {
            let fused = [&b.attn.qkv, &b.mlp.gate_up];
            total += fused.iter().filter_map(|f| f.as_ref()).map(|f| f.fast.bytes()).sum::<usize>();
            let mut parts = vec![&b.attn.o, &b.mlp.down];
            if b.attn.qkv.is_none() {
                parts.extend([&b.attn.q, &b.attn.k, &b.attn.v]);
            }
            if b.mlp.gate_up.is_none() {
                parts.extend([&b.mlp.gate, &b.mlp.up]);
            }
            total += parts.iter().map(|l| l.bytes_per_call()).sum::<usize>();
        }
        total
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }
    pub fn device(&self) -> &Device {
        &self.device
    }
    /// The shared vocabulary projection; Medusa heads feed their output through it.
    pub fn lm_head(&self) -> &Linear {
        &self.lm_head
    }

    pub fn new_cache(&self) -> Result<KvCache> {
        KvCache::new(self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim, self.cfg.max_position, self.kv_dtype, &self.device)
    }

    /// Run `tokens` (placed at `positions`, attending as `mask` says, after everything already in
    /// `cache`) and return the final-norm hidden states `[T, hidden]`, followed by the inputs of
    /// the layers [`Llama::set_feature_layers`] named (`[T, hidden × (1 + layers)]`). The new
    /// tokens' K/V land in slots `cache.len()..cache.len()+T` and are committed.
    pub fn forward(&self, tokens: &[u32], positions: &[usize], mask: &TreeMask, cache: &mut KvCache) -> Result<Tensor> {
        self.forward_inner(tokens, positions, mask, cache)
    }

    fn forward_inner(&self, tokens: &[u32], positions: &[usize], mask: &TreeMask, cache: &mut KvCache) -> Result<Tensor> {
        let t = tokens.len();
        if t == 0 || positions.len() != t || mask.len() != t {
            return Err(Error::InvalidArgument(format!(
                "forward: {t} tokens, {} positions, mask for {}",
                positions.len(),
                mask.len()
            )));
        }
        if let Some(&bad) = tokens.iter().find(|&&x| x as usize >= self.cfg.vocab_size) {
            return Err(Error::InvalidArgument(format!("token id {bad} is outside the vocabulary ({})", self.cfg.vocab_size)));
        }
        let (x, taps) = self.run_blocks_multi(self.embed_scaled(tokens)?, None, &mut [Segment { positions, mask, tail: 0, cache }])?;
        self.features(&x, taps)
    }

    /// Which layers' inputs (the residual stream entering layer `i`, as vLLM and llama.cpp
    /// take EAGLE-3 features) every forward returns beside the final hidden states; an EAGLE-3
    /// drafter reads a low, a middle and a high one. Empty: the final states alone. Why here
    /// and not per call: every path that runs the target (prefill, verification, a server's
    /// batch, training's cached states) must hand the drafter the same features.
    pub fn set_feature_layers(&mut self, layers: &[usize]) -> Result<()> {
        if let Some(&bad) = layers.iter().find(|&&l| l >= self.cfg.num_layers) {
            return Err(Error::InvalidArgument(format!("feature layer {bad}: the model has layers 0..{}", self.cfg.num_layers)));
        }
        if layers.len() > 8 {
            return Err(Error::InvalidArgument(format!("{} feature layers; at most 8", layers.len())));
        }
        self.taps = layers.to_vec();
        Ok(())
    }

    /// The layers whose inputs a forward returns (see [`Llama::set_feature_layers`]).
    pub fn feature_layers(&self) -> &[usize] {
        &self.taps
    }

    /// The final norm of the last block's output, then the tapped layers' inputs beside it.
    fn features(&self, x: &Tensor, taps: Vec<Tensor>) -> Result<Tensor> {
        let last = self.final_norm(x)?;
        if taps.is_empty() {
            return Ok(last);
        }
        let mut parts = vec![last];
        parts.extend(taps);
        Ok(Tensor::cat(&parts, 1)?)
    }

    /// The model's final norm (an EAGLE-3 layer returns its output before it).
    pub fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        rms_norm(&self.norm, x)
    }

    /// [`Llama::forward`] on input vectors `[T, hidden]` instead of token ids: a draft layer
    /// feeds its own mix of features and embeddings through the same blocks.
    pub fn forward_embeds(&self, x: &Tensor, positions: &[usize], mask: &TreeMask, cache: &mut KvCache) -> Result<Tensor> {
        self.forward_embeds_after(x, positions, mask, 0, cache)
    }

    /// [`Llama::forward_embeds`] where the last `tail` slots of `cache` are tree nodes too: `mask`
    /// covers those `tail` nodes and then the `T` new rows, so a new row sees only the tail nodes
    /// that are its ancestors. Why: a drafter grows its tree level by level, and keeping the
    /// earlier levels' K/V in the cache (rather than recomputing every ancestor at each level)
    /// makes a level cost its own rows only. Each row's result is the same bits either way (its
    /// visible keys come in the same slot order, and the kernels are batch-invariant).
    pub fn forward_embeds_after(&self, x: &Tensor, positions: &[usize], mask: &TreeMask, tail: usize, cache: &mut KvCache) -> Result<Tensor> {
        let t = x.dim(0)?;
        if t == 0 || positions.len() != t || mask.len() != tail + t || tail > cache.len() || x.dims() != [t, self.cfg.hidden_size] {
            return Err(Error::InvalidArgument(format!(
                "forward: inputs {:?}, {} positions, mask for {}, {tail} of {} cached slots in the tree",
                x.dims(),
                positions.len(),
                mask.len(),
                cache.len()
            )));
        }
        if self.cfg.eagle3_input {
            return Err(Error::InvalidArgument("an EAGLE-3 layer takes features and tokens apart (forward_fused_after)".into()));
        }
        let (x, _) = self.run_blocks_multi(x.clone(), None, &mut [Segment { positions, mask, tail, cache }])?;
        self.final_norm(&x)
    }

    /// An EAGLE-3 layer's forward ([`Config::eagle3_input`]): features `g [T, hidden]` and the
    /// embeddings `e [T, hidden]` of the tokens beside them, after `tail` tree slots as in
    /// [`Llama::forward_embeds_after`]. Returns the output *before* the final norm: EAGLE-3
    /// feeds that back as the next step's `g` (see [`Llama::final_norm`] for the logits).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_fused_after(&self, g: &Tensor, e: &Tensor, positions: &[usize], mask: &TreeMask, tail: usize, cache: &mut KvCache) -> Result<Tensor> {
        let t = g.dim(0)?;
        let d = self.cfg.hidden_size;
        if !self.cfg.eagle3_input || t == 0 || positions.len() != t || mask.len() != tail + t || tail > cache.len() || g.dims() != [t, d] || e.dims() != [t, d] {
            return Err(Error::InvalidArgument(format!(
                "EAGLE-3 forward: features {:?}, embeddings {:?}, {} positions, mask for {}, {tail} of {} cached slots in the tree{}",
                g.dims(),
                e.dims(),
                positions.len(),
                mask.len(),
                cache.len(),
                if self.cfg.eagle3_input { "" } else { " (not an EAGLE-3 layer)" }
            )));
        }
        Ok(self.run_blocks_multi(g.clone(), Some(e), &mut [Segment { positions, mask, tail, cache }])?.0)
    }

    /// Run several independent sequences' new tokens through the blocks in one pass, `x` holding
    /// their rows one sequence after another. Every matmul sees all rows at once, so each weight
    /// is read once for the whole batch; attention stays per sequence, over that sequence's own
    /// cache. The kernels are batch-invariant, so each row's result is the same bits as in a
    /// forward of its sequence alone.
    ///
    /// Returns the last block's output before the final norm, and the tapped layers' inputs
    /// ([`Llama::set_feature_layers`]). `side`: an EAGLE-3 layer's token embeddings.
    fn run_blocks_multi(&self, mut x: Tensor, side: Option<&Tensor>, segs: &mut [Segment]) -> Result<(Tensor, Vec<Tensor>)> {
        let mut all_pos = Vec::new();
        let mut spans = Vec::with_capacity(segs.len());
        for s in segs.iter_mut() {
            if let Some(&bad) = s.positions.iter().find(|&&p| p >= self.cfg.max_position) {
                return Err(Error::InvalidArgument(format!(
                    "position {bad} is past the model's context of {} tokens",
                    self.cfg.max_position
                )));
            }
            s.cache.reserve(s.positions.len())?;
            spans.push(AttnSpan { start: all_pos.len(), len: s.positions.len(), prefix: s.cache.len() - s.tail, mask: Arc::new(s.mask.clone()) });
            all_pos.extend_from_slice(s.positions);
        }
        let global = rope_rows(&self.cfg, &all_pos, &self.device)?;
        // Local layers: their own rotary base, and per row the first key slot inside the
        // window (slot i of a cache holds position i: the committed path is compacted).
        let local = match (self.cfg.sliding_window, self.blocks.iter().any(|b| b.local)) {
            (Some(w), true) => {
                let rope = rope_rows_with(self.cfg.head_dim, self.cfg.local_rope_theta.unwrap_or(self.cfg.rope_theta), None, &all_pos, &self.device)?;
                // A key's slot is its position for the cached prefix and for a causal chunk of
                // new rows (prompt reading); tree nodes sit at other slots, but a tree is
                // shallower than any window (MIN_SLIDING_WINDOW), so its nodes are never clipped.
                let firsts: Vec<Arc<Vec<usize>>> = spans.iter().map(|sp| Arc::new(all_pos[sp.start..sp.start + sp.len].iter().map(|&p| (p + 1).saturating_sub(w)).collect())).collect();
                Some((rope, firsts))
            }
            _ => None,
        };
        let scale = self.cfg.attn_scale.map_or(1.0 / (self.cfg.head_dim as f32).sqrt(), |s| s as f32);
        let mut caches: Vec<&mut KvCache> = segs.iter_mut().map(|s| &mut *s.cache).collect();
        let mut taps: Vec<Option<Tensor>> = vec![None; self.taps.len()];
        for (i, b) in self.blocks.iter().enumerate() {
            let ((cos, sin), window) = match (&local, b.local) {
                (Some((rope, firsts)), true) => (rope, Some(firsts.as_slice())),
                _ => (&global, None),
            };
            for (k, _) in self.taps.iter().enumerate().filter(|(_, &l)| l == i) {
                taps[k] = Some(x.clone());
            }
            let h = match (&b.hidden_norm, side) {
                (Some(hn), Some(e)) => Tensor::cat(&[rms_norm(&b.attn_norm, e)?, rms_norm(hn, &x)?], 1)?,
                (None, None) => rms_norm(&b.attn_norm, &x)?,
                _ => return Err(Error::InvalidArgument("an EAGLE-3 layer needs token embeddings beside its features, and only it takes them".into())),
            };
            let mut a = b.attn.forward(&h, cos, sin, &spans, window, scale, &mut caches, i)?;
            if let Some((post_attn, _)) = &b.post_norms {
                a = rms_norm(post_attn, &a)?;
            }
            x = (x + a)?;
            let h = rms_norm(&b.mlp_norm, &x)?;
            let act = match (&b.mlp.gate_up, b.mlp.activation) {
                (Some(f), Activation::Silu) if f.applies(&h)? => f.forward_joined(&h)?.apply_op1_no_bwd(&SwiGlu)?,
                (_, Activation::Silu) => (candle_nn::ops::silu(&b.mlp.gate.forward(&h)?)? * b.mlp.up.forward(&h)?)?.contiguous()?,
                (Some(f), Activation::GeluTanh) if f.applies(&h)? => f.forward_joined(&h)?.apply_op1_no_bwd(&GeluTanhGlu)?,
                (_, Activation::GeluTanh) => (b.mlp.gate.forward(&h)?.gelu()? * b.mlp.up.forward(&h)?)?.contiguous()?,
            };
            let mut m = b.mlp.down.forward(&act)?;
            if let Some((_, post_mlp)) = &b.post_norms {
                m = rms_norm(post_mlp, &m)?;
            }
            x = (x + m)?;
        }
        for (c, sp) in caches.iter_mut().zip(&spans) {
            c.append(sp.len)?;
        }
        Ok((x, taps.into_iter().map(|t| t.expect("every tapped layer ran")).collect()))
    }

    /// One forward over several independent sequences (batched decoding): each entry's `tokens`
    /// run after its own `cache`, at its `positions`, under its `mask`, exactly as
    /// [`Llama::forward`] would run them alone. Returns the final-norm hidden states of all
    /// entries' tokens, one entry after another (`[sum of T, hidden]`).
    pub fn forward_batch(&self, batch: &mut [BatchEntry]) -> Result<Tensor> {
        self.forward_batch_inner(batch)
    }

    fn forward_batch_inner(&self, batch: &mut [BatchEntry]) -> Result<Tensor> {
        if batch.is_empty() {
            return Err(Error::InvalidArgument("forward_batch: no sequences".into()));
        }
        let mut ids = Vec::new();
        for (n, e) in batch.iter().enumerate() {
            let t = e.tokens.len();
            if t == 0 || e.positions.len() != t || e.mask.len() != t {
                return Err(Error::InvalidArgument(format!(
                    "forward_batch: sequence {n} has {t} tokens, {} positions, mask for {}",
                    e.positions.len(),
                    e.mask.len()
                )));
            }
            if let Some(&bad) = e.tokens.iter().find(|&&x| x as usize >= self.cfg.vocab_size) {
                return Err(Error::InvalidArgument(format!("token id {bad} is outside the vocabulary ({})", self.cfg.vocab_size)));
            }
            ids.extend_from_slice(e.tokens);
        }
        let x = self.embed_scaled(&ids)?;
        let mut segs: Vec<Segment> = batch.iter_mut().map(|e| Segment { positions: e.positions, mask: e.mask, tail: 0, cache: &mut *e.cache }).collect();
        let (x, taps) = self.run_blocks_multi(x, None, &mut segs)?;
        self.features(&x, taps)
    }

    /// The blocks' input for `tokens`: their embeddings, times √hidden where the model scales
    /// them (Gemma), in f32 as transformers and llama.cpp both do.
    fn embed_scaled(&self, tokens: &[u32]) -> Result<Tensor> {
        let x = self.embed.lookup(tokens, &self.device)?;
        Ok(if self.cfg.embed_scale { (x * (self.cfg.hidden_size as f32).sqrt() as f64)? } else { x })
    }

    /// Token embeddings `[T, d]` (token-aware heads read the root token's).
    pub fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
        if let Some(&bad) = tokens.iter().find(|&&x| x as usize >= self.cfg.vocab_size) {
            return Err(Error::InvalidArgument(format!("token id {bad} is outside the vocabulary ({})", self.cfg.vocab_size)));
        }
        self.embed.lookup(tokens, &self.device)
    }

    /// Rows `ids` of the lm_head `[ids.len(), hidden]` in f32, exact: from the f32 weight, or
    /// read in place from the GGUF for a model built without one. Drafters with a reduced draft
    /// vocabulary copy these.
    pub fn lm_head_rows(&self, ids: &[u32]) -> Result<Tensor> {
        if let Some(&bad) = ids.iter().find(|&&x| x as usize >= self.cfg.vocab_size) {
            return Err(Error::InvalidArgument(format!("token id {bad} is outside the vocabulary ({})", self.cfg.vocab_size)));
        }
        match (&self.lm_head.weight, &self.lm_rows) {
            (Some(w), _) => Ok(w.index_select(&Tensor::new(ids, w.device())?, 0)?),
            (None, Some(r)) => r.gather(ids, &self.device),
            (None, None) => self.lm_head.weight().cloned(),
        }
    }

    /// The whole lm_head in f32 `[vocab, hidden]`: the weight itself, or (for a model built
    /// without f32 weights) a copy made now. Training and Medusa heads read it whole.
    pub fn lm_head_weight(&self) -> Result<Tensor> {
        match &self.lm_head.weight {
            Some(w) => Ok(w.clone()),
            None => self.lm_head_rows(&(0..self.cfg.vocab_size as u32).collect::<Vec<_>>()),
        }
    }

    /// `hidden [T, d] -> logits [T, vocab]`; a forward's wider output (final states and then
    /// tapped layers, [`Llama::set_feature_layers`]) is read for its final states.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let d = self.cfg.hidden_size;
        if hidden.rank() == 2 && hidden.dim(1)? > d {
            return self.lm_head.forward(&hidden.narrow(1, 0, d)?.contiguous()?);
        }
        self.lm_head.forward(hidden)
    }

    /// Causal forward of a whole sequence from position `cache.len()` on.
    pub fn forward_causal(&self, tokens: &[u32], cache: &mut KvCache) -> Result<Tensor> {
        let start = cache.len();
        let positions: Vec<usize> = (start..start + tokens.len()).collect();
        self.forward(tokens, &positions, &TreeMask::causal(tokens.len()), cache)
    }
}

impl Attention {
    /// `window`: per span, each row's first visible key slot (a local layer); `scale`: the
    /// score scale.
    #[allow(clippy::too_many_arguments)]
    fn forward(&self, x: &Tensor, cos: &Tensor, sin: &Tensor, spans: &[AttnSpan], window: Option<&[Arc<Vec<usize>>]>, scale: f32, caches: &mut [&mut KvCache], layer: usize) -> Result<Tensor> {
        let t = x.dim(0)?;
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        if let (Some(f), [sp], [cache], None, None) = (&self.qkv, spans, &mut *caches, &self.qk_norm, window) {
            if f.applies(x)? {
                // The CPU decode path: q and k rotated in place in the fused output, then q, k
                // and v read from it as views (no copies), k and v stored straight into the cache.
                let qkv = f.forward_joined(x)?;
                qkv.inplace_op3(cos, sin, &crate::cpu::RopeInPlace { heads: nh + nkv })?;
                let parts = qkv.reshape((t, nh + 2 * nkv, hd))?;
                let (k_all, v_all) = cache.write(layer, &parts.narrow(1, nh, nkv)?, &parts.narrow(1, nh + nkv, nkv)?)?;
                let op = TreeAttention { mask: sp.mask.clone(), prefix_len: sp.prefix, scale, first_key: None };
                let out = parts.narrow(1, 0, nh)?.apply_op3_no_bwd(&k_all, &v_all, &op)?;
                return self.o.forward(&out.reshape((t, nh * hd))?);
            }
        }
        let (q, k, v) = match &self.qkv {
            Some(f) if f.applies(x)? => match <[Tensor; 3]>::try_from(f.forward(x)?) {
                Ok([q, k, v]) => (q.contiguous()?, k.contiguous()?, v.contiguous()?),
                Err(_) => return Err(Error::InvalidArgument("fused q/k/v must have three parts".into())),
            },
            _ => (self.q.forward(x)?, self.k.forward(x)?, self.v.forward(x)?),
        };
        // Qwen3: each head normalised over its own dimensions, row by row (batch-invariant).
        let (q, k) = match &self.qk_norm {
            Some((qn, kn)) => (rms_norm(qn, &q.contiguous()?.reshape((t * nh, hd))?)?, rms_norm(kn, &k.contiguous()?.reshape((t * nkv, hd))?)?),
            None => (q, k),
        };
        let q = q.reshape((1, t, nh, hd))?;
        let k = k.reshape((1, t, nkv, hd))?;
        let v = v.reshape((t, nkv, hd))?;
        let q = rope_thd(&q, cos, sin)?.squeeze(0)?;
        let k = rope_thd(&k, cos, sin)?.squeeze(0)?;
        let mut outs = Vec::with_capacity(spans.len());
        for (n, (sp, cache)) in spans.iter().zip(caches.iter_mut()).enumerate() {
            let first_key = window.map(|w| w[n].clone());
            let (q, k, v) = if spans.len() == 1 {
                (q.clone(), k.clone(), v.clone())
            } else {
                (q.narrow(0, sp.start, sp.len)?, k.narrow(0, sp.start, sp.len)?, v.narrow(0, sp.start, sp.len)?)
            };
            let (k_all, v_all) = cache.write(layer, &k, &v)?;
            outs.push(if x.device().is_cpu() {
                let op = TreeAttention { mask: sp.mask.clone(), prefix_len: sp.prefix, scale, first_key };
                q.contiguous()?.apply_op3_no_bwd(&k_all, &v_all, &op)?
            } else {
                attention_candle(&q, &k_all, &v_all, &sp.mask, sp.prefix, scale, first_key.as_deref().map(|v| v.as_slice()))?
            });
        }
        let out = if outs.len() == 1 { outs.pop().expect("one") } else { Tensor::cat(&outs, 0)? };
        self.o.forward(&out.reshape((t, nh * hd))?)
    }
}

/// candle's RMS norm, through [`crate::cpu::RmsNormRows`] (the same bits, faster) on the CPU.
fn rms_norm(norm: &RmsNorm, x: &Tensor) -> Result<Tensor> {
    if x.device().is_cpu() && x.dtype() == DType::F32 && norm.weight().dtype() == DType::F32 {
        return Ok(x.contiguous()?.apply_op2_no_bwd(norm.weight(), &crate::cpu::RmsNormRows { eps: norm.eps() as f32 })?);
    }
    Ok(norm.forward(x)?)
}

/// candle's `rope_thd`, through [`crate::cpu::RopeThd`] (the same bits, faster) on the CPU.
fn rope_thd(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    if x.device().is_cpu() && x.dtype() == DType::F32 && cos.dtype() == DType::F32 && x.dim(0)? == 1 {
        return Ok(x.contiguous()?.apply_op3_no_bwd(&cos.contiguous()?, &sin.contiguous()?, &crate::cpu::RopeThd)?);
    }
    Ok(candle_nn::rotary_emb::rope_thd(x, cos, sin)?)
}

/// The same attention with candle's ops, for CUDA/Metal and as a reference in tests; `k`, `v`
/// are head-major `[kv_heads, s, head_dim]`, as the KV cache holds them (any float dtype).
/// `first_key`: per query row, the first key slot it sees (a sliding window); none: all.
pub fn attention_candle(q: &Tensor, k: &Tensor, v: &Tensor, mask: &TreeMask, prefix: usize, scale: f32, first_key: Option<&[usize]>) -> Result<Tensor> {
    let (t, nh, hd) = q.dims3()?;
    let (nkv, s, _) = k.dims3()?;
    let group = nh / nkv;
    let expand = |x: &Tensor| -> Result<Tensor> { Ok(x.to_dtype(q.dtype())?.unsqueeze(1)?.expand((nkv, group, s, hd))?.reshape((nh, s, hd))?.contiguous()?) };
    let (k, v) = (expand(k)?, expand(v)?);
    let q = q.transpose(0, 1)?.contiguous()?; // [nh, t, hd]
    // The queries are the mask's last `t` nodes (see `TreeAttention`).
    let n = mask.len();
    if s != prefix + n || t > n {
        return Err(Error::InvalidArgument(format!("attention: {t} queries, {s} keys, prefix {prefix}, mask for {n}")));
    }
    let mut add = mask.additive(prefix, n - t);
    if let Some(f) = first_key {
        for (r, &first) in f.iter().enumerate().take(t) {
            add[r * s..r * s + first.min(s)].fill(f32::NEG_INFINITY);
        }
    }
    let add = Tensor::from_vec(add, (t, s), q.device())?;
    let scores = (q.matmul(&k.t()?)? * scale as f64)?.broadcast_add(&add)?;
    let p = candle_nn::ops::softmax_last_dim(&scores)?;
    let o = p.matmul(&v)?; // [nh, t, hd]
    Ok(o.transpose(0, 1)?.contiguous()?)
}

/// f16 on the CPU, where the attention kernel reads it directly; f32 on GPUs, whose candle
/// attention would otherwise convert the whole cache at every layer.
pub fn default_kv_dtype(device: &Device) -> DType {
    if device.is_cpu() {
        DType::F16
    } else {
        DType::F32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// transformers' `_compute_llama3_parameters`, transcribed in f64: the reference.
    fn hf_llama3(inv: &[f64], factor: f64, lo: f64, hi: f64, old: f64) -> Vec<f64> {
        let (low_wavelen, high_wavelen) = (old / lo, old / hi);
        inv.iter()
            .map(|&f| {
                let wavelen = 2.0 * std::f64::consts::PI / f;
                let scaled = if wavelen > low_wavelen { f / factor } else { f };
                let smooth = (old / wavelen - lo) / (hi - lo);
                // transformers: ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
                let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                if medium { (1.0 - smooth) * scaled / factor + smooth * scaled } else { scaled }
            })
            .collect()
    }

    #[test]
    fn rope_scaling_matches_the_reference_formulas() {
        // Llama 3.1's own parameters, over a 128-dimension head: all three regimes occur.
        let mut cfg = smollm2_config();
        cfg.head_dim = 128;
        cfg.rope_theta = 500000.0;
        let plain: Vec<f32> = (0..64).map(|i| 1f32 / 500000f32.powf((2 * i) as f32 / 128.0)).collect();
        let l3 = RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 8192 };
        l3.validate(128).unwrap();
        let mut got = plain.clone();
        l3.apply(&mut got);
        let want = hf_llama3(&plain.iter().map(|&x| x as f64).collect::<Vec<_>>(), 8.0, 1.0, 4.0, 8192.0);
        let (mut kept, mut divided, mut blended) = (0, 0, 0);
        for ((g, w), p) in got.iter().zip(&want).zip(&plain) {
            assert!(((*g as f64) - w).abs() <= 1e-6 * w.abs(), "{g} vs {w}");
            match *g / *p {
                1.0 => kept += 1,
                r if (r - 0.125).abs() < 1e-7 => divided += 1,
                _ => blended += 1,
            }
        }
        assert!(kept > 0 && divided > 0 && blended > 0, "{kept} {divided} {blended}");
        // Linear divides every frequency; the rope rows follow the scaled frequencies.
        let mut lin = plain.clone();
        RopeScaling::Linear { factor: 4.0 }.apply(&mut lin);
        assert!(lin.iter().zip(&plain).all(|(a, b)| *a == b / 4.0));
        cfg.rope_scaling = Some(RopeScaling::Linear { factor: 4.0 });
        let (cos, _) = rope_rows(&cfg, &[8], &Device::Cpu).unwrap();
        cfg.rope_scaling = None;
        let (cos2, _) = rope_rows(&cfg, &[2], &Device::Cpu).unwrap();
        let (a, b) = (cos.to_vec2::<f32>().unwrap(), cos2.to_vec2::<f32>().unwrap());
        assert!(a[0].iter().zip(&b[0]).all(|(x, y)| (x - y).abs() < 1e-5), "position 8 at factor 4 is position 2");
        // Bad parameters are refused.
        assert!(RopeScaling::Linear { factor: 0.0 }.validate(128).is_err());
        assert!(RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 4.0, high_freq_factor: 1.0, original_max_position: 8192 }.validate(128).is_err());
        assert!(RopeScaling::Divisors { divisors: vec![1.0; 63] }.validate(128).is_err());
        assert!(RopeScaling::Divisors { divisors: vec![f32::NAN; 64] }.validate(128).is_err());
    }
    #[test]
    fn matmul_macs_count_every_weight_once() {
        // SmolLM2-135M: 134.5M parameters besides the norms (embeddings tied to the lm_head).
        assert_eq!(smollm2_config().matmul_macs_per_token(), 134_479_872);
    }

    fn smollm2_config() -> Config {
        super::Config {
            architecture: "llama".into(),
            vocab_size: 49152,
            hidden_size: 576,
            intermediate_size: 1536,
            num_layers: 30,
            num_heads: 9,
            num_kv_heads: 3,
            head_dim: 64,
            rms_norm_eps: 1e-5,
            rope_theta: 1e5,
            rope_scaling: None,
            max_position: 8192,
            tie_embeddings: true,
            attention_bias: false,
            qk_norm: false,
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
            ..Default::default()
        }
    }


}
