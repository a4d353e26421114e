//! The target model: a Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) built from candle
//! pieces, with what speculation needs and candle-transformers' models do not offer: explicit
//! per-token positions, a tree attention mask, a compactable KV cache, and the final hidden
//! states returned next to (not instead of) the logits.
use std::sync::Arc;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Embedding, RmsNorm, VarBuilder};
use serde::{Deserialize, Serialize};

use crate::cpu::{ROW_KERNEL_MAX_ROWS, PackedWeight, RowMatmul, SwiGlu, TreeAttention, TreeMask};
use crate::cpu::quant::{CpuMatmul, CpuWeight, PackedF16, PackedQuant, QuantRows, WeightFormat};
use crate::model::kv_cache::KvCache;
use crate::{Error, Result};


/// The longest context a model may declare (its rotary tables are built for all of it at load).
pub const MAX_CONTEXT: usize = 1 << 21;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    pub max_position: usize,
    pub tie_embeddings: bool,
    /// Qwen2 has biases on the q/k/v projections.
    pub attention_bias: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
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
        // The rotary tables are built for the whole context at load (8 bytes per position and
        // dimension pair); a context past this is refused rather than allocated.
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

/// A linear layer. On the CPU it keeps a second copy of its weight in a fast-path format
/// ([`WeightFormat`]): calls with up to [`crate::cpu::ROW_KERNEL_MAX_ROWS`] rows (decoding and tree
/// verification) use that copy's batch-invariant kernel; larger calls use candle's gemm on the
/// f32 weight when the format is f32, and the format's own kernel otherwise. Other devices use
/// candle's matmul on the f32 weight.
#[derive(Clone)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
    fast: Option<Arc<CpuWeight>>,
}

impl Linear {
    /// Without a fast copy (the row kernel still keeps CPU results batch-invariant).
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Linear { weight, bias, fast: None }
    }
    /// With an f32 panel copy for the fast CPU kernel (costs a second copy of the weight).
    pub fn new_packed(weight: Tensor, bias: Option<Tensor>) -> Result<Self> {
        let mut l = Linear::new(weight, bias);
        l.set_format(WeightFormat::F32, None)?;
        Ok(l)
    }
    pub fn load(in_dim: usize, out_dim: usize, bias: bool, vb: VarBuilder) -> Result<Self> {
        let weight = vb.get((out_dim, in_dim), "weight")?;
        let bias = if bias { Some(vb.get(out_dim, "bias")?) } else { None };
        Self::new_packed(weight, bias)
    }
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }
    /// The fast-path format in use, e.g. "q4" or "f32"; `None` off the CPU.
    pub fn format_name(&self) -> Option<&'static str> {
        self.fast.as_ref().map(|f| f.format_name())
    }
    /// Bytes one call streams from the fast copy (the f32 weight's size off the CPU).
    pub fn bytes_per_call(&self) -> usize {
        match &self.fast {
            Some(f) => f.bytes(),
            None => self.weight.elem_count() * self.weight.dtype().size_in_bytes(),
        }
    }
    /// Rebuild the fast copy in `format`. `native` is this weight's own GGUF blocks, which
    /// [`WeightFormat::Native`] keeps; native without blocks means f32.
    pub fn set_format(&mut self, format: WeightFormat, native: Option<&QuantRows>) -> Result<()> {
        if !self.weight.device().is_cpu() || self.weight.dtype() != DType::F32 {
            self.fast = None;
            return Ok(());
        }
        let (n, k) = self.weight.dims2()?;
        let data = || -> Result<Vec<f32>> { Ok(self.weight.flatten_all()?.to_vec1::<f32>()?) };
        let fast = match (format, native) {
            (WeightFormat::F32, _) | (WeightFormat::Native, None) => CpuWeight::F32(PackedWeight::pack(&data()?, n, k)),
            (WeightFormat::F16, _) => CpuWeight::F16(PackedF16::pack(&data()?, n, k)),
            (WeightFormat::Bf16, _) => CpuWeight::Bf16(crate::cpu::bf16::PackedBf16::pack(&data()?, n, k)),
            (WeightFormat::Q8_0, _) if k % crate::cpu::quant::QK != 0 => CpuWeight::F32(PackedWeight::pack(&data()?, n, k)),
            (WeightFormat::Q8_0, _) => CpuWeight::Quant(PackedQuant::pack(&QuantRows::quantize_q8_0(&data()?, n, k)?)),
            (WeightFormat::Native, Some(q)) => {
                if (q.n, q.k) != (n, k) {
                    return Err(Error::InvalidArgument(format!("quantized weight is [{}, {}], layer is [{n}, {k}]", q.n, q.k)));
                }
                CpuWeight::Quant(PackedQuant::pack(q))
            }
        };
        self.fast = Some(Arc::new(fast));
        Ok(())
    }
    /// `x [rows, in] -> [rows, out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let rows = x.dim(0)?;
        let cpu_f32 = x.device().is_cpu() && x.dtype() == DType::F32;
        let y = match &self.fast {
            Some(f) if cpu_f32 && f.prefers_kernel(rows) => x.contiguous()?.apply_op1_no_bwd(&CpuMatmul(f.clone()))?,
            _ if cpu_f32 && rows <= ROW_KERNEL_MAX_ROWS => x.contiguous()?.apply_op2_no_bwd(&self.weight, &RowMatmul)?,
            _ => x.matmul(&self.weight.t()?)?,
        };
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
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

impl Fused {
    /// `None` when the parts cannot share a kernel (off the CPU, or native blocks of different
    /// kinds, as in Q4_K_M files that keep some tensors in Q6_K).
    fn build(parts: &[&Linear], format: WeightFormat, native: &[Option<&QuantRows>]) -> Result<Option<Fused>> {
        if parts.iter().any(|p| p.fast.is_none()) {
            return Ok(None);
        }
        let weight = Tensor::cat(&parts.iter().map(|p| p.weight.clone()).collect::<Vec<_>>(), 0)?;
        let blocks = if format == WeightFormat::Native {
            let qs: Option<Vec<&QuantRows>> = native.iter().copied().collect();
            match qs {
                Some(qs) if qs.iter().all(|q| q.kind == qs[0].kind && q.k == qs[0].k) => Some(QuantRows::concat_rows(&qs)?),
                Some(_) => return Ok(None),
                // Native without blocks for every part means f32 (or mixed): keep them apart
                // unless none has blocks.
                None if native.iter().any(|q| q.is_some()) => return Ok(None),
                None => None,
            }
        } else {
            None
        };
        let mut l = Linear::new(weight, None);
        l.set_format(format, blocks.as_ref())?;
        let bias = match parts.iter().map(|p| p.bias.clone()).collect::<Option<Vec<_>>>() {
            Some(bs) => Some(Tensor::cat(&bs, 0)?),
            // Some parts with a bias and some without: keep them apart.
            None if parts.iter().any(|p| p.bias.is_some()) => return Ok(None),
            None => None,
        };
        Ok(l.fast.map(|fast| Fused { fast, sizes: parts.iter().map(|p| p.weight.dims()[0]).collect(), bias }))
    }

    fn applies(&self, x: &Tensor) -> Result<bool> {
        Ok(x.device().is_cpu() && x.dtype() == DType::F32 && self.fast.prefers_kernel(x.dim(0)?))
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
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
    gate_up: Option<Fused>,
}

struct Block {
    attn_norm: RmsNorm,
    attn: Attention,
    mlp_norm: RmsNorm,
    mlp: Mlp,
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
    embed: Embedding,
    blocks: Vec<Block>,
    norm: RmsNorm,
    lm_head: Linear,
    cos: Tensor,
    sin: Tensor,
    cfg: Config,
    device: Device,
    format: WeightFormat,
    kv_dtype: DType,
}

pub(crate) fn rope_tables(cfg: &Config, device: &Device) -> Result<(Tensor, Tensor)> {
    let half = cfg.head_dim / 2;
    let theta: Vec<f32> = (0..half)
        .map(|i| 1f32 / (cfg.rope_theta as f32).powf((2 * i) as f32 / cfg.head_dim as f32))
        .collect();
    let mut cos = Vec::with_capacity(cfg.max_position * half);
    let mut sin = Vec::with_capacity(cfg.max_position * half);
    for p in 0..cfg.max_position {
        for &th in &theta {
            let a = p as f32 * th;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    Ok((
        Tensor::from_vec(cos, (cfg.max_position, half), device)?,
        Tensor::from_vec(sin, (cfg.max_position, half), device)?,
    ))
}

impl Llama {
    /// Weights use Hugging Face names (`model.layers.N.self_attn.q_proj.weight`, ...); the GGUF
    /// loader renames and un-permutes its tensors into this layout.
    pub fn load(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        cfg.validate().map_err(Error::InvalidArgument)?;
        let device = vb.device().clone();
        let m = vb.pp("model");
        let embed_w = m.get((cfg.vocab_size, cfg.hidden_size), "embed_tokens.weight")?;
        let embed = Embedding::new(embed_w.clone(), cfg.hidden_size);
        let (d, nh, nkv, hd) = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let mut blocks = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let b = m.pp(format!("layers.{i}"));
            let a = b.pp("self_attn");
            let f = b.pp("mlp");
            blocks.push(Block {
                attn_norm: candle_nn::rms_norm(d, cfg.rms_norm_eps, b.pp("input_layernorm"))?,
                attn: Attention {
                    q: Linear::load(d, nh * hd, cfg.attention_bias, a.pp("q_proj"))?,
                    k: Linear::load(d, nkv * hd, cfg.attention_bias, a.pp("k_proj"))?,
                    v: Linear::load(d, nkv * hd, cfg.attention_bias, a.pp("v_proj"))?,
                    o: Linear::load(nh * hd, d, false, a.pp("o_proj"))?,
                    qkv: None,
                    num_heads: nh,
                    num_kv_heads: nkv,
                    head_dim: hd,
                },
                mlp_norm: candle_nn::rms_norm(d, cfg.rms_norm_eps, b.pp("post_attention_layernorm"))?,
                mlp: Mlp {
                    gate: Linear::load(d, cfg.intermediate_size, false, f.pp("gate_proj"))?,
                    up: Linear::load(d, cfg.intermediate_size, false, f.pp("up_proj"))?,
                    down: Linear::load(cfg.intermediate_size, d, false, f.pp("down_proj"))?,
                    gate_up: None,
                },
            });
        }
        let norm = candle_nn::rms_norm(d, cfg.rms_norm_eps, m.pp("norm"))?;
        let lm_head = if cfg.tie_embeddings {
            Linear::new_packed(embed_w, None)?
        } else {
            Linear::load(d, cfg.vocab_size, false, vb.pp("lm_head"))?
        };
        let (cos, sin) = rope_tables(cfg, &device)?;
        let mut model = Llama { embed, blocks, norm, lm_head, cos, sin, cfg: cfg.clone(), kv_dtype: default_kv_dtype(&device), device, format: WeightFormat::F32 };
        // Fuse q/k/v and gate/up for the CPU kernel from the start.
        model.set_weights(WeightFormat::F32, &NativeWeights::new())?;
        Ok(model)
    }

    /// Switch every projection's CPU fast path to `format`. `native` (filled by the loader)
    /// says, per Hugging Face tensor name, what [`WeightFormat::Native`] keeps; tensors absent
    /// from it stay f32. Off the CPU this changes nothing: GPUs keep candle's f32 kernels.
    pub fn set_weights(&mut self, format: WeightFormat, native: &NativeWeights) -> Result<()> {
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
        let set = |l: &mut Linear, name: &str| -> Result<()> {
            let (f, q) = resolve(name);
            l.set_format(f, q).map_err(|e| Error::InvalidArgument(format!("{name}: {e}")))
        };
        // Fuse when every part resolves to the same format (and block kind): then the parts'
        // own fast copies are never used and are dropped.
        let fuse = |parts: &mut [&mut Linear], names: &[String]| -> Result<Option<Fused>> {
            let res: Vec<(WeightFormat, Option<&QuantRows>)> = names.iter().map(|n| resolve(n)).collect();
            if res.iter().any(|r| r.0 != res[0].0) {
                return Ok(None);
            }
            let qs: Vec<Option<&QuantRows>> = res.iter().map(|r| r.1).collect();
            let fused = Fused::build(&parts.iter().map(|p| &**p).collect::<Vec<_>>(), res[0].0, &qs)?;
            if fused.is_some() {
                for p in parts.iter_mut() {
                    p.fast = None;
                }
            }
            Ok(fused)
        };
        for (i, b) in self.blocks.iter_mut().enumerate() {
            let p = format!("model.layers.{i}.");
            let n = |s: &str| format!("{p}{s}.weight");
            let (qn, kn, vn) = (n("self_attn.q_proj"), n("self_attn.k_proj"), n("self_attn.v_proj"));
            let (gn, un) = (n("mlp.gate_proj"), n("mlp.up_proj"));
            set(&mut b.attn.q, &qn)?;
            set(&mut b.attn.k, &kn)?;
            set(&mut b.attn.v, &vn)?;
            set(&mut b.attn.o, &n("self_attn.o_proj"))?;
            set(&mut b.mlp.gate, &gn)?;
            set(&mut b.mlp.up, &un)?;
            set(&mut b.mlp.down, &n("mlp.down_proj"))?;
            b.attn.qkv = fuse(&mut [&mut b.attn.q, &mut b.attn.k, &mut b.attn.v], &[qn, kn, vn])?;
            b.mlp.gate_up = fuse(&mut [&mut b.mlp.gate, &mut b.mlp.up], &[gn, un])?;
        }
        let head = if self.cfg.tie_embeddings { "model.embed_tokens.weight" } else { "lm_head.weight" };
        set(&mut self.lm_head, head)?;
        self.format = format;
        Ok(())
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
    /// `cache`) and return the final-norm hidden states `[T, hidden]`. The new tokens' K/V land in
    /// slots `cache.len()..cache.len()+T` and are committed.
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
        let ids = Tensor::new(tokens, &self.device)?;
        self.run_blocks(self.embed.forward(&ids)?, positions, mask, cache)
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
        self.run_blocks_multi(x.clone(), &mut [Segment { positions, mask, tail, cache }])
    }

    fn run_blocks(&self, x: Tensor, positions: &[usize], mask: &TreeMask, cache: &mut KvCache) -> Result<Tensor> {
        self.run_blocks_multi(x, &mut [Segment { positions, mask, tail: 0, cache }])
    }

    /// Run several independent sequences' new tokens through the blocks in one pass, `x` holding
    /// their rows one sequence after another. Every matmul sees all rows at once, so each weight
    /// is read once for the whole batch; attention stays per sequence, over that sequence's own
    /// cache. The kernels are batch-invariant, so each row's result is the same bits as in a
    /// forward of its sequence alone.
    fn run_blocks_multi(&self, mut x: Tensor, segs: &mut [Segment]) -> Result<Tensor> {
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
            all_pos.extend(s.positions.iter().map(|&p| p as u32));
        }
        let pos = Tensor::new(all_pos.as_slice(), &self.device)?;
        let cos = self.cos.index_select(&pos, 0)?;
        let sin = self.sin.index_select(&pos, 0)?;
        let mut caches: Vec<&mut KvCache> = segs.iter_mut().map(|s| &mut *s.cache).collect();
        for (i, b) in self.blocks.iter().enumerate() {
            let h = rms_norm(&b.attn_norm, &x)?;
            let a = b.attn.forward(&h, &cos, &sin, &spans, &mut caches, i)?;
            x = (x + a)?;
            let h = rms_norm(&b.mlp_norm, &x)?;
            let act = match &b.mlp.gate_up {
                Some(f) if f.applies(&h)? => f.forward_joined(&h)?.apply_op1_no_bwd(&SwiGlu)?,
                _ => (candle_nn::ops::silu(&b.mlp.gate.forward(&h)?)? * b.mlp.up.forward(&h)?)?.contiguous()?,
            };
            let m = b.mlp.down.forward(&act)?;
            x = (x + m)?;
        }
        for (c, sp) in caches.iter_mut().zip(&spans) {
            c.append(sp.len)?;
        }
        rms_norm(&self.norm, &x)
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
        let x = self.embed.forward(&Tensor::new(ids.as_slice(), &self.device)?)?;
        let mut segs: Vec<Segment> = batch.iter_mut().map(|e| Segment { positions: e.positions, mask: e.mask, tail: 0, cache: &mut *e.cache }).collect();
        self.run_blocks_multi(x, &mut segs)
    }

    /// Token embeddings `[T, d]` (token-aware heads read the root token's).
    pub fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
        Ok(self.embed.forward(&Tensor::new(tokens, &self.device)?)?)
    }

    /// `hidden [T, d] -> logits [T, vocab]`.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
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
    fn forward(&self, x: &Tensor, cos: &Tensor, sin: &Tensor, spans: &[AttnSpan], caches: &mut [&mut KvCache], layer: usize) -> Result<Tensor> {
        let t = x.dim(0)?;
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let scale = 1.0 / (hd as f32).sqrt();
        if let (Some(f), [sp], [cache]) = (&self.qkv, spans, &mut *caches) {
            if f.applies(x)? {
                // The CPU decode path: q and k rotated in place in the fused output, then q, k
                // and v read from it as views (no copies), k and v stored straight into the cache.
                let qkv = f.forward_joined(x)?;
                qkv.inplace_op3(cos, sin, &crate::cpu::RopeInPlace { heads: nh + nkv })?;
                let parts = qkv.reshape((t, nh + 2 * nkv, hd))?;
                let (k_all, v_all) = cache.write(layer, &parts.narrow(1, nh, nkv)?, &parts.narrow(1, nh + nkv, nkv)?)?;
                let op = TreeAttention { mask: sp.mask.clone(), prefix_len: sp.prefix, scale };
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
        let q = q.reshape((1, t, nh, hd))?;
        let k = k.reshape((1, t, nkv, hd))?;
        let v = v.reshape((t, nkv, hd))?;
        let q = rope_thd(&q, cos, sin)?.squeeze(0)?;
        let k = rope_thd(&k, cos, sin)?.squeeze(0)?;
        let mut outs = Vec::with_capacity(spans.len());
        for (sp, cache) in spans.iter().zip(caches.iter_mut()) {
            let (q, k, v) = if spans.len() == 1 {
                (q.clone(), k.clone(), v.clone())
            } else {
                (q.narrow(0, sp.start, sp.len)?, k.narrow(0, sp.start, sp.len)?, v.narrow(0, sp.start, sp.len)?)
            };
            let (k_all, v_all) = cache.write(layer, &k, &v)?;
            outs.push(if x.device().is_cpu() {
                let op = TreeAttention { mask: sp.mask.clone(), prefix_len: sp.prefix, scale };
                q.contiguous()?.apply_op3_no_bwd(&k_all, &v_all, &op)?
            } else {
                attention_candle(&q, &k_all, &v_all, &sp.mask, sp.prefix, scale)?
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
pub fn attention_candle(q: &Tensor, k: &Tensor, v: &Tensor, mask: &TreeMask, prefix: usize, scale: f32) -> Result<Tensor> {
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
    let add = Tensor::from_vec(mask.additive(prefix, n - t), (t, s), q.device())?;
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
    #[test]
    fn matmul_macs_count_every_weight_once() {
        // SmolLM2-135M: 134.5M parameters besides the norms (embeddings tied to the lm_head).
        let cfg = super::Config {
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
            max_position: 8192,
            tie_embeddings: true,
            attention_bias: false,
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
        };
        assert_eq!(cfg.matmul_macs_per_token(), 134_479_872);
    }


}
