//! Loading a target model from a GGUF file or a Hugging Face directory into one [`Target`].
use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use candle_core::quantized::{gguf_file, GgmlDType};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use sha2::{Digest, Sha256};

use crate::cpu::quant::{QuantKind, Staged, WeightFormat};
use crate::model::gguf::{GgufFile, RawRows};
use crate::model::{Config, Llama, WeightSource};
use crate::model::tokenizer::{ChatTemplate, Tokenizer};
use crate::model::Activation;
use crate::{Error, Result};

/// A loaded target: the model, its tokenizer, its chat template and where it came from.
pub struct Target {
    pub model: Llama,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    /// Why the model's chat template could not be used, when it has one that does not parse.
    /// Kept rather than failing the load: plain prompts do not need the template.
    pub chat_template_error: Option<String>,
    pub path: PathBuf,
}

impl Target {
    /// `path` is a `.gguf` file, a Hugging Face model directory, or a `.safetensors` file inside
    /// one. f32 weights (the reference, and what training and GPUs need); see
    /// [`Target::load_with`] for the compact formats.
    pub fn load(path: &Path, device: &Device) -> Result<Self> {
        Self::load_with(path, device, WeightFormat::F32)
    }

    /// Load with the CPU fast path in `weights` (see [`WeightFormat`]), reading and packing one
    /// tensor at a time: no f32 copy of the model is made unless `weights` is f32 or `device`
    /// is not the CPU. `--weights native` keeps a GGUF's own blocks.
    pub fn load_with(path: &Path, device: &Device, weights: WeightFormat) -> Result<Self> {
        let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
        if meta.is_dir() {
            return load_hf(path, device, weights);
        }
        let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let mut magic = [0u8; 4];
        let n = f.read(&mut magic).map_err(|e| Error::io(path, e))?;
        if n == 4 && &magic == b"GGUF" {
            return load_gguf(path, device, weights);
        }
        if path.extension().is_some_and(|e| e == "safetensors") {
            let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
            return load_hf(dir, device, weights);
        }
        Err(Error::bad_file(path, "neither a GGUF file (no GGUF magic) nor a Hugging Face model directory"))
    }

    /// Switch the CPU fast path's weight format (GPUs keep candle's f32 kernels). A model with
    /// f32 weights that is not a GGUF re-packs in place; otherwise the model is loaded again from
    /// its file in the new format (a GGUF's own blocks are not kept beside the packed copy: that
    /// would double the memory). The KV cache's element type is kept.
    pub fn set_weights(&mut self, weights: WeightFormat) -> Result<()> {
        if weights == self.model.weight_format() {
            return Ok(());
        }
        let is_gguf = !self.path.is_dir() && self.path.extension().is_none_or(|e| e != "safetensors");
        if !is_gguf && self.model.set_weights(weights, &crate::model::NativeWeights::new()).is_ok() {
            return Ok(());
        }
        let kv = self.model.kv_dtype();
        let device = self.model.device().clone();
        *self = Target::load_with(&self.path, &device, weights)?;
        self.model.set_kv_dtype(kv)
    }

    /// Render a single user prompt through the chat template, or fail if the model has none.
    pub fn chat_prompt(&self, messages: &[crate::model::tokenizer::Message]) -> Result<String> {
        self.template()?.render(messages, true, &self.tokenizer.bos_token, &self.tokenizer.eos_token)
    }

    /// Token ids of the chat template's opening of a first user turn (system prompt and user
    /// header, as the template renders them), after which the model writes a user's message
    /// itself: the prefix `distill --self-prompts` samples prompts from (Magpie's method). Cut
    /// from a rendering around a placeholder message, so it is right for any template that
    /// puts the message's text in verbatim.
    pub fn user_turn_prefix_ids(&self) -> Result<Vec<u32>> {
        const MARK: &str = "\u{1}selfspec-user-turn\u{1}";
        let t = self.template()?;
        let text = t.render(&[crate::model::tokenizer::Message::new("user", MARK)], false, &self.tokenizer.bos_token, &self.tokenizer.eos_token)?;
        let at = text.find(MARK).ok_or_else(|| Error::bad_file(&self.path, "the chat template does not put a user's message into its text verbatim, so the opening of a user turn cannot be cut from it"))?;
        self.tokenizer.encode(&text[..at], false)
    }

    /// Token ids for a conversation whose last turn the model answers next (eval, tune and
    /// distill prompts): through the chat template, or, for a model without one (a base model),
    /// the turns as plain text joined by newlines, as a raw prompt. A template that is there but
    /// does not parse is an error, not a silent switch to plain text.
    pub fn prompt_ids(&self, messages: &[crate::model::tokenizer::Message]) -> Result<Vec<u32>> {
        match (&self.chat_template, &self.chat_template_error) {
            (None, None) => self.tokenizer.encode(&messages.iter().map(|m| m.content.as_str()).collect::<Vec<_>>().join("\n"), true),
            _ => self.tokenizer.encode(&self.chat_prompt(messages)?, false),
        }
    }

    /// For the CLI to say once: prompts go in as plain text because the model has no template.
    pub fn plain_prompts_note(&self) -> Option<String> {
        (self.chat_template.is_none() && self.chat_template_error.is_none())
            .then(|| format!("note: {} has no chat template; prompts are given to it as plain text", self.path.display()))
    }

    /// The chat template, or an error saying why there is none and what needs one.
    fn template(&self) -> Result<&ChatTemplate> {
        const NEEDS: &str = "chat prompts (generate --chat; eval, tune and distill, which answer their prompts as a chat; distill --self-prompts, which writes them after the template's opening of a user turn) need one: use a model that has one, or `generate` without --chat";
        match (&self.chat_template, &self.chat_template_error) {
            (Some(t), _) => Ok(t),
            (None, Some(e)) => Err(Error::bad_file(&self.path, format!("the model's chat template does not parse ({e}); {NEEDS}"))),
            (None, None) => Err(Error::bad_file(&self.path, format!("the model has no chat template; {NEEDS}"))),
        }
    }

    /// A whole conversation as training and datastore text: through the chat template without a
    /// generation prompt, or the turns joined by newlines for a model without one.
    pub fn render_conversation(&self, messages: &[crate::model::tokenizer::Message]) -> Result<String> {
        match (&self.chat_template, &self.chat_template_error) {
            (Some(t), _) => t.render(messages, false, &self.tokenizer.bos_token, &self.tokenizer.eos_token),
            // A template that is there but broken: joining the turns would silently train on
            // other text than the model sees at inference.
            (None, Some(_)) => self.template().and_then(|t| t.render(messages, false, &self.tokenizer.bos_token, &self.tokenizer.eos_token)),
            (None, None) => Ok(messages.iter().map(|x| x.content.as_str()).collect::<Vec<_>>().join("\n")),
        }
    }

    /// Tokens for a prompt, through the chat template when `chat` is set.
    pub fn encode_prompt(&self, prompt: &str, chat: bool) -> Result<Vec<u32>> {
        if chat {
            let text = self.chat_prompt(&[crate::model::tokenizer::Message::new("user", prompt)])?;
            self.tokenizer.encode(&text, false)
        } else {
            self.tokenizer.encode(prompt, true)
        }
    }

    /// Identifies the target for heads files: architecture, sizes, and a hash of tokenizer and lm_head.
    pub fn fingerprint(&self) -> Result<Fingerprint> {
        let cfg = self.model.config();
        let mut h = Sha256::new();
        h.update(self.tokenizer.to_json().as_bytes());
        // Hash a strided sample of lm_head: enough to tell models apart, cheap to compute. The
        // rows are exact whatever the weight format (see `Llama::lm_head_rows`).
        let (rows, cols) = (cfg.vocab_size, cfg.hidden_size);
        let n = rows * cols;
        let step = (n / 4096).max(1);
        let flat: Vec<usize> = (0..n).step_by(step).collect();
        let mut row_ids: Vec<u32> = flat.iter().map(|&i| (i / cols) as u32).collect();
        row_ids.dedup();
        let got = self.model.lm_head_rows(&row_ids)?.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
        let mut at = 0;
        let mut sample = Vec::with_capacity(flat.len());
        for &i in &flat {
            while row_ids[at] as usize != i / cols {
                at += 1;
            }
            sample.push(got[at * cols + i % cols]);
        }
        for x in sample {
            // Round so the tiny differences between dequantisation paths do not matter.
            h.update(((x * 1e4).round() as i64).to_le_bytes());
        }
        let hash = h.finalize();
        Ok(Fingerprint {
            architecture: cfg.architecture.clone(),
            hidden_size: cfg.hidden_size,
            vocab_size: cfg.vocab_size,
            hash: hash.iter().take(8).map(|b| format!("{b:02x}")).collect(),
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Fingerprint {
    pub architecture: String,
    pub hidden_size: usize,
    pub vocab_size: usize,
    /// Hash of the tokenizer and lm_head.
    pub hash: String,
}

impl std::fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (hidden {}, vocab {}, hash {})", self.architecture, self.hidden_size, self.vocab_size, self.hash)
    }
}

/// Per-layer tensors whose GGUF (`blk.N.*`) and Hugging Face (`model.layers.N.*`) names differ
/// only by name; q/k also differ by a row permutation and are handled apart.
pub const GGUF_LAYER_TENSORS: [(&str, &str); 7] = [
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("attn_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
];

/// Every tensor the model reads, with the shape the metadata implies for it (GGUF lists dims
/// innermost last here, as candle reports them), and its extent inside the file. Checked before
/// any tensor is read: a file whose header disagrees with its metadata (a corrupt or hostile
/// one) must fail with a message, not index past a buffer or allocate what the metadata claims.
fn check_tensor_shapes(ct: &gguf_file::Content, cfg: &Config, path: &Path) -> Result<()> {
    let (h, q, kv, f) = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size);
    // Nine tensors a layer: a block count the file cannot hold is refused before it is looped over.
    if cfg.num_layers > ct.tensor_infos.len() / 9 {
        return Err(Error::bad_file(path, format!("the metadata says {} layers but the file has {} tensors", cfg.num_layers, ct.tensor_infos.len())));
    }
    let check = |name: &str, shape: &[usize]| -> Result<()> {
        let info = ct.tensor_infos.get(name).ok_or_else(|| Error::bad_file(path, format!("no {name} tensor")))?;
        if info.shape.dims() != shape {
            return Err(Error::bad_file(path, format!("tensor {name} has shape {:?}, but the metadata implies {shape:?}", info.shape.dims())));
        }
        Ok(())
    };
    check("token_embd.weight", &[cfg.vocab_size, h])?;
    check("output_norm.weight", &[h])?;
    if !cfg.tie_embeddings {
        check("output.weight", &[cfg.vocab_size, h])?;
    }
    for i in 0..cfg.num_layers {
        let b = |n: &str| format!("blk.{i}.{n}");
        for (n, shape) in [("attn_q.weight", vec![q, h]), ("attn_k.weight", vec![kv, h]), ("attn_v.weight", vec![kv, h]), ("attn_output.weight", vec![h, q]), ("attn_norm.weight", vec![h]), ("ffn_norm.weight", vec![h]), ("ffn_gate.weight", vec![f, h]), ("ffn_up.weight", vec![f, h]), ("ffn_down.weight", vec![h, f])] {
            check(&b(n), &shape)?;
        }
        if cfg.attention_bias {
            for (n, shape) in [("attn_q.bias", q), ("attn_k.bias", kv), ("attn_v.bias", kv)] {
                check(&b(n), &[shape])?;
            }
        }
        if cfg.qk_norm {
            for n in ["attn_q_norm.weight", "attn_k_norm.weight"] {
                check(&b(n), &[cfg.head_dim])?;
            }
        }
        if cfg.post_norms {
            for n in ["post_attention_norm.weight", "post_ffw_norm.weight"] {
                check(&b(n), &[h])?;
            }
        }
    }
    Ok(())
}

/// GGUF stores Llama's q/k rows permuted for interleaved rotary embeddings; undo that so one
/// (half-split) rope serves both formats.
fn unpermute_qk(w: &Tensor, heads: usize) -> Result<Tensor> {
    let (out, inp) = w.dims2()?;
    let hd = out / heads;
    Ok(w.reshape((heads, hd / 2, 2, inp))?.transpose(1, 2)?.reshape((out, inp))?.contiguous()?)
}

/// The row order [`unpermute_qk`] produces: output row `i` is input row `perm[i]`.
fn unpermute_rows(heads: usize, head_dim: usize) -> Vec<usize> {
    let half = head_dim / 2;
    let mut perm = Vec::with_capacity(heads * head_dim);
    for h in 0..heads {
        for a in 0..2 {
            for b in 0..half {
                perm.push(h * head_dim + b * 2 + a);
            }
        }
    }
    perm
}

/// The inverse of `unpermute_qk`, for writing GGUF files in llama.cpp's layout.
pub fn permute_qk(w: &Tensor, heads: usize) -> Result<Tensor> {
    let (out, inp) = w.dims2()?;
    let hd = out / heads;
    Ok(w.reshape((heads, 2, hd / 2, inp))?.transpose(1, 2)?.reshape((out, inp))?.contiguous()?)
}

/// A GGUF file as a [`WeightSource`]: Hugging Face names mapped to GGUF tensors, q/k rows
/// un-permuted, blocks kept for `--weights native`, rows of the embedding and lm_head read in
/// place.
struct GgufSource<'a> {
    file: &'a GgufFile,
    /// Hugging Face name -> (GGUF name, heads whose q/k rows to un-permute).
    names: HashMap<String, (String, Option<usize>)>,
    head_dim: usize,
}

impl GgufSource<'_> {
    fn gguf_name(&self, name: &str) -> Result<&(String, Option<usize>)> {
        self.names.get(name).ok_or_else(|| Error::bad_file(&self.file.path, format!("no tensor for {name}")))
    }
}

impl WeightSource for GgufSource<'_> {
    fn tensor(&self, name: &str, shape: &[usize], device: &Device) -> Result<Tensor> {
        let (g, heads) = self.gguf_name(name)?;
        let mut t = self.file.dequantize(g)?;
        self.file.release(g);
        if t.dims() != shape {
            return Err(Error::bad_file(&self.file.path, format!("tensor {g} has shape {:?}, expected {shape:?}", t.dims())));
        }
        if let Some(h) = heads {
            t = unpermute_qk(&t, *h)?;
        }
        Ok(t.to_device(device)?)
    }

    fn staged(&self, name: &str, shape: (usize, usize), format: WeightFormat) -> Result<Staged> {
        let (g, heads) = self.gguf_name(name)?;
        let e = self.file.extent(g)?;
        if e.dims != [shape.0, shape.1] {
            return Err(Error::bad_file(&self.file.path, format!("tensor {g} has shape {:?}, expected {:?}", e.dims, [shape.0, shape.1])));
        }
        let (n, k) = shape;
        let values = |format: WeightFormat| -> Result<Staged> {
            let t = self.tensor(name, &[n, k], &Device::Cpu)?;
            Ok(Staged::Values { data: t.flatten_all()?.to_vec1::<f32>()?, n, k, format })
        };
        if format != WeightFormat::Native {
            return values(format);
        }
        match QuantKind::from_ggml(e.dtype) {
            Some(kind) if k % kind.block_values() == 0 => {
                let rows = self.file.blocks(g, kind)?;
                Ok(Staged::Blocks(match heads {
                    Some(h) => rows.permute_rows(&unpermute_rows(*h, self.head_dim))?,
                    None => rows,
                }))
            }
            // No kernel reads these blocks as they are: f32 and f16 keep their precision,
            // other types (Q5_1, Q2_K, Q3_K, Q5_K, ...) are requantised to Q8_0.
            _ if e.dtype == GgmlDType::F32 => values(WeightFormat::F32),
            _ if e.dtype == GgmlDType::F16 => values(WeightFormat::F16),
            _ => values(WeightFormat::Q8_0),
        }
    }

    fn release(&self, name: &str) {
        if let Some((g, _)) = self.names.get(name) {
            self.file.release(g);
        }
    }

    fn rows(&self, name: &str) -> Result<Option<RawRows>> {
        match self.names.get(name) {
            Some((g, None)) => Ok(Some(self.file.rows(g)?)),
            _ => Ok(None),
        }
    }
}

fn load_gguf(path: &Path, device: &Device, weights: WeightFormat) -> Result<Target> {
    let file = GgufFile::open(path)?;
    let ct = &file.content;
    let md = &ct.metadata;
    let arch = md
        .get("general.architecture")
        .and_then(|v| v.to_string().ok())
        .cloned()
        .ok_or_else(|| Error::bad_file(path, "no general.architecture in the GGUF metadata"))?;
    if !matches!(arch.as_str(), "llama" | "mistral" | "qwen2" | "qwen3" | "gemma3") {
        return Err(Error::unsupported(path, format!("architecture '{arch}' (supported: {SUPPORTED})")));
    }
    let key = |k: &str| format!("{arch}.{k}");
    let get_u = |k: &str| -> Result<usize> {
        md.get(&key(k))
            .and_then(|v| v.to_u32().ok().or_else(|| v.to_u64().ok().map(|x| x as u32)))
            .map(|v| v as usize)
            .ok_or_else(|| Error::bad_file(path, format!("GGUF metadata lacks {}", key(k))))
    };
    let get_f = |k: &str| md.get(&key(k)).and_then(|v| v.to_f32().ok());
    let hidden = get_u("embedding_length")?;
    let heads = get_u("attention.head_count")?;
    let kv_heads = get_u("attention.head_count_kv").unwrap_or(heads);
    let layers = get_u("block_count")?;
    let ffn = get_u("feed_forward_length")?;
    let ctx = get_u("context_length").unwrap_or(4096);
    let tokenizer = Tokenizer::from_gguf(path, md)?;
    let embd = ct.tensor_infos.get("token_embd.weight").ok_or_else(|| Error::bad_file(path, "no token_embd.weight tensor"))?;
    let vocab = match embd.shape.dims() {
        &[v, h] if h == hidden => v,
        d => return Err(Error::bad_file(path, format!("token_embd.weight has shape {d:?}; the metadata's embedding length {hidden} wants [vocabulary, {hidden}]"))),
    };
    let head_dim = md.get(&key("attention.key_length")).and_then(|v| v.to_u32().ok()).map(|v| v as usize).unwrap_or(hidden / heads.max(1));
    let tie = !file.has("output.weight");
    let mut cfg = Config {
        architecture: arch.clone(),
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: ffn,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        rms_norm_eps: get_f("attention.layer_norm_rms_epsilon").unwrap_or(1e-5) as f64,
        rope_theta: get_f("rope.freq_base").unwrap_or(10000.0) as f64,
        rope_scaling: gguf_rope_scaling(&file, &key, head_dim)?,
        max_position: ctx,
        tie_embeddings: tie,
        attention_bias: file.has("blk.0.attn_q.bias"),
        qk_norm: file.has("blk.0.attn_q_norm.weight"),
        bos_token_id: tokenizer.bos_id,
        eos_token_ids: tokenizer.eos_ids.clone(),
        ..Default::default()
    };
    if arch == "gemma3" {
        gemma3_gguf(&mut cfg, &file, &key)?;
    }
    cfg.validate().map_err(|m| Error::bad_file(path, m))?;
    check_tensor_shapes(ct, &cfg, path)?;
    // f32 weights on a device other than the CPU need room there, not here; on the CPU, say up
    // front what the model will take rather than fail part way.
    if device.is_cpu() {
        let need = resident_bytes(ct, weights);
        if let Some(avail) = crate::files::available_memory() {
            if need > avail {
                return Err(Error::bad_file(path, format!("--weights {weights} needs about {:.1} GB of memory for the weights; {:.1} GB is available{}", need as f64 / 1e9, avail as f64 / 1e9, if weights == WeightFormat::Native { "" } else { " (--weights native keeps the file's own blocks)" })));
            }
        }
    }
    // Only llama-arch GGUFs are permuted by the converter; Qwen keeps the NeoX layout.
    let permuted = !matches!(arch.as_str(), "qwen2" | "qwen3" | "gemma3");
    let mut names: HashMap<String, (String, Option<usize>)> = HashMap::new();
    names.insert("model.embed_tokens.weight".into(), ("token_embd.weight".into(), None));
    names.insert("model.norm.weight".into(), ("output_norm.weight".into(), None));
    if !tie {
        names.insert("lm_head.weight".into(), ("output.weight".into(), None));
    }
    for i in 0..layers {
        let (p, b) = (format!("model.layers.{i}"), format!("blk.{i}"));
        names.insert(format!("{p}.self_attn.q_proj.weight"), (format!("{b}.attn_q.weight"), permuted.then_some(heads)));
        names.insert(format!("{p}.self_attn.k_proj.weight"), (format!("{b}.attn_k.weight"), permuted.then_some(kv_heads)));
        for (g, h) in [("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj")] {
            names.insert(format!("{p}.self_attn.{h}.bias"), (format!("{b}.{g}.bias"), None));
        }
        for (g, h) in GGUF_LAYER_TENSORS {
            names.insert(format!("{p}.{h}"), (format!("{b}.{g}"), None));
        }
        names.insert(format!("{p}.self_attn.q_norm.weight"), (format!("{b}.attn_q_norm.weight"), None));
        names.insert(format!("{p}.self_attn.k_norm.weight"), (format!("{b}.attn_k_norm.weight"), None));
        if cfg.post_norms {
            // Gemma 3's names: ffn_norm is the MLP's input norm, the other two its outputs'.
            names.insert(format!("{p}.pre_feedforward_layernorm.weight"), (format!("{b}.ffn_norm.weight"), None));
            names.insert(format!("{p}.post_attention_layernorm.weight"), (format!("{b}.post_attention_norm.weight"), None));
            names.insert(format!("{p}.post_feedforward_layernorm.weight"), (format!("{b}.post_ffw_norm.weight"), None));
        }
    }
    let src = GgufSource { file: &file, names, head_dim };
    let model = Llama::build(&src, &cfg, weights, device).map_err(|e| Error::bad_file(path, e.to_string()))?;
    let (chat_template, chat_template_error) = usable_template(md.get("tokenizer.chat_template").and_then(|v| v.to_string().ok()).cloned());
    Ok(Target { model, tokenizer, chat_template, chat_template_error, path: path.to_path_buf() })
}

/// Every architecture the loaders take.
pub const SUPPORTED: &str = "llama, mistral, qwen2, qwen3, gemma3";

/// Gemma 3's differences from Llama, as llama.cpp reads them from a GGUF: embeddings scaled by
/// √hidden, norms on the attention's and MLP's outputs, GELU-tanh, and sliding-window layers
/// (every sixth layer global, unless the file lists the pattern) with rotary base 10,000 (or
/// `rope.freq_base_swa`) where the global layers use `rope.freq_base`. The norms' weights are
/// stored as 1 + w already. Softcapping (Gemma 2) is refused.
fn gemma3_gguf(cfg: &mut Config, file: &GgufFile, key: &dyn Fn(&str) -> String) -> Result<()> {
    let md = &file.content.metadata;
    for k in ["final_logit_softcapping", "attn_logit_softcapping"] {
        if md.get(&key(k)).and_then(|v| v.to_f32().ok()).is_some_and(|v| v != 0.0) {
            return Err(Error::unsupported(&file.path, format!("{} (logit softcapping)", key(k))));
        }
    }
    cfg.embed_scale = true;
    cfg.post_norms = true;
    cfg.activation = Activation::GeluTanh;
    cfg.qk_norm = true;
    // As llama.cpp: 1/√head_dim (the 27B model's 1/√(hidden/heads) is the same formula there).
    cfg.attn_scale = None;
    if let Some(w) = md.get(&key("attention.sliding_window")).and_then(|v| v.to_u32().ok()).filter(|&w| w > 0) {
        cfg.sliding_window = Some(w as usize);
        cfg.local_layers = match md.get(&key("attention.sliding_window_pattern")) {
            Some(v) => match (v.to_vec(), v.to_u32()) {
                (Ok(list), _) => list.iter().map(|x| x.to_bool().unwrap_or(false)).collect(),
                (_, Ok(n)) => (0..cfg.num_layers).map(|i| n == 0 || (i as u32 % n) < n - 1).collect(),
                _ => return Err(Error::bad_file(&file.path, format!("{} is neither a number nor a list", key("attention.sliding_window_pattern")))),
            },
            None => (0..cfg.num_layers).map(|i| i % 6 < 5).collect(),
        };
        cfg.local_rope_theta = Some(md.get(&key("rope.freq_base_swa")).and_then(|v| v.to_f32().ok()).unwrap_or(10000.0) as f64);
    }
    Ok(())
}

/// A GGUF's rotary scaling: the per-frequency divisors of `rope_freqs.weight` (how llama.cpp's
/// converter stores Llama 3.1's scaling), or `{arch}.rope.scaling.type` linear with its factor.
/// Other declared types are refused: decoding without them would be silently wrong.
fn gguf_rope_scaling(file: &GgufFile, key: &dyn Fn(&str) -> String, head_dim: usize) -> Result<Option<crate::model::RopeScaling>> {
    let md = &file.content.metadata;
    let kind = md.get(&key("rope.scaling.type")).and_then(|v| v.to_string().ok()).cloned();
    let factor = md.get(&key("rope.scaling.factor")).and_then(|v| v.to_f32().ok());
    if file.has("rope_freqs.weight") {
        let e = file.extent("rope_freqs.weight")?;
        if e.dims != [head_dim / 2] {
            return Err(Error::bad_file(&file.path, format!("rope_freqs.weight has shape {:?}; the head dimension {head_dim} wants [{}]", e.dims, head_dim / 2)));
        }
        if let Some(t) = kind.as_deref().filter(|t| !matches!(*t, "none" | "llama3")) {
            // Two scalings at once would be applied one on top of the other by some readers and
            // not by others: refuse rather than guess which the file meant.
            return Err(Error::unsupported(&file.path, format!("rope_freqs.weight together with rope scaling '{t}' (a file carries one or the other)")));
        }
        let divisors = file.dequantize("rope_freqs.weight")?.to_vec1::<f32>()?;
        return Ok(Some(crate::model::RopeScaling::Divisors { divisors }));
    }
    match (kind.as_deref(), factor) {
        (None | Some("none"), _) => Ok(None),
        (Some("linear"), Some(1.0)) => Ok(None),
        (Some("linear"), Some(f)) => Ok(Some(crate::model::RopeScaling::Linear { factor: f as f64 })),
        (Some(t), _) => Err(Error::unsupported(&file.path, format!("rope scaling '{t}'{} (supported: linear, and llama3 through rope_freqs.weight)", factor.map(|f| format!(" with factor {f}")).unwrap_or_default()))),
    }
}

/// Gemma 3's config.json (`Gemma3TextConfig`): `query_pre_attn_scalar`, `sliding_window` with
/// `layer_types` (or the older `sliding_window_pattern`), the local layers' base
/// (`rope_local_base_freq`, or transformers 5's `rope_parameters.sliding_attention`), and the
/// global layers' from `rope_parameters.full_attention` where that is how it is written.
fn gemma3_hf(cfg: &mut Config, c: &serde_json::Value) -> std::result::Result<(), String> {
    for k in ["final_logit_softcapping", "attn_logit_softcapping"] {
        if c[k].as_f64().is_some_and(|v| v != 0.0) {
            return Err(format!("{k} (logit softcapping)"));
        }
    }
    let act = c["hidden_activation"].as_str().or_else(|| c["hidden_act"].as_str()).unwrap_or("gelu_pytorch_tanh");
    if !matches!(act, "gelu_pytorch_tanh" | "gelu_tanh") {
        return Err(format!("Gemma 3 with hidden activation '{act}' (supported: gelu_pytorch_tanh)"));
    }
    cfg.embed_scale = true;
    cfg.post_norms = true;
    cfg.activation = Activation::GeluTanh;
    cfg.qk_norm = true;
    cfg.norm_offset = 1.0;
    cfg.attn_scale = c["query_pre_attn_scalar"].as_f64().map(|s| 1.0 / s.sqrt());
    if let Some(full) = c["rope_parameters"].get("full_attention") {
        cfg.rope_theta = full["rope_theta"].as_f64().unwrap_or(cfg.rope_theta);
        cfg.rope_scaling = hf_rope_scaling(full)?;
    }
    let local_theta = c["rope_local_base_freq"].as_f64().or_else(|| c["rope_parameters"]["sliding_attention"]["rope_theta"].as_f64()).unwrap_or(10000.0);
    if let Some(w) = c["sliding_window"].as_u64().filter(|&w| w > 0) {
        cfg.sliding_window = Some(w as usize);
        cfg.local_layers = match c["layer_types"].as_array() {
            Some(types) => types.iter().map(|t| t.as_str() == Some("sliding_attention")).collect(),
            None => {
                let n = c["sliding_window_pattern"].as_u64().unwrap_or(6) as usize;
                (0..cfg.num_layers).map(|i| n == 0 || (i + 1) % n != 0).collect()
            }
        };
        cfg.local_rope_theta = Some(local_theta);
    }
    Ok(())
}

/// config.json's `rope_scaling` (`type` or `rope_type`): linear and llama3 are supported, null
/// and `default` mean none; anything else is refused.
pub(crate) fn hf_rope_scaling(v: &serde_json::Value) -> std::result::Result<Option<crate::model::RopeScaling>, String> {
    if v.is_null() {
        return Ok(None);
    }
    let kind = v.get("rope_type").or_else(|| v.get("type")).and_then(|t| t.as_str()).unwrap_or("");
    let num = |k: &str| v.get(k).and_then(|x| x.as_f64()).ok_or_else(|| format!("rope_scaling type '{kind}' lacks a numeric '{k}'"));
    match kind {
        "default" => Ok(None),
        "" if v.get("factor").is_none() => Ok(None),
        "linear" => Ok(Some(crate::model::RopeScaling::Linear { factor: num("factor")? })),
        "llama3" => Ok(Some(crate::model::RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position: num("original_max_position_embeddings")? as usize,
        })),
        other => Err(format!("rope scaling '{other}' (supported: linear, llama3)")),
    }
}

/// Bytes the weights will take in memory under `weights` (the packed copies, plus the f32
/// weights for f32), estimated from the file's tensor types before anything is read.
fn resident_bytes(ct: &gguf_file::Content, weights: WeightFormat) -> u64 {
    ct.tensor_infos
        .values()
        .map(|info| {
            let elems = info.shape.elem_count() as u64;
            let file_bytes = elems / info.ggml_dtype.block_size() as u64 * info.ggml_dtype.type_size() as u64;
            match weights {
                // f32 weights and their packed copies.
                WeightFormat::F32 => elems * 8,
                WeightFormat::F16 | WeightFormat::Bf16 => elems * 2,
                WeightFormat::Q8_0 => elems * 34 / 32,
                WeightFormat::Native => match info.ggml_dtype {
                    GgmlDType::Q4_0 | GgmlDType::Q4_1 | GgmlDType::Q4K | GgmlDType::Q8_0 | GgmlDType::F16 | GgmlDType::F32 => file_bytes,
                    _ => elems * 34 / 32,
                },
            }
        })
        .sum()
}

fn read_json(path: &Path) -> Result<serde_json::Value> {
    let s = crate::files::read_config(path)?;
    serde_json::from_str(&s).map_err(|e| Error::bad_file(path, format!("invalid JSON: {e}")))
}

/// `tokenizer_config.json` stores special tokens as strings or as `{"content": ...}` objects.
fn token_str(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(str::to_string),
        _ => None,
    }
}

fn load_hf(dir: &Path, device: &Device, weights: WeightFormat) -> Result<Target> {
    let cfg_path = dir.join("config.json");
    if !cfg_path.exists() {
        return Err(Error::bad_file(dir, "not a Hugging Face model directory: config.json is missing"));
    }
    let c = read_json(&cfg_path)?;
    let arch_name = c["architectures"].get(0).and_then(|a| a.as_str()).unwrap_or("");
    let model_type = c["model_type"].as_str().unwrap_or("");
    let architecture = match (model_type, arch_name) {
        ("llama", _) | (_, "LlamaForCausalLM") => "llama",
        ("mistral", _) | (_, "MistralForCausalLM") => "mistral",
        ("qwen2", _) | (_, "Qwen2ForCausalLM") => "qwen2",
        ("qwen3", _) | (_, "Qwen3ForCausalLM") => "qwen3",
        ("gemma3_text", _) | (_, "Gemma3ForCausalLM") => "gemma3",
        _ => {
            return Err(Error::unsupported(
                &cfg_path,
                format!("architecture '{}' (supported: {SUPPORTED}; Gemma 3 as its text-only checkpoint, gemma3_text)", if arch_name.is_empty() { model_type } else { arch_name }),
            ))
        }
    };
    if c["use_sliding_window"].as_bool() == Some(true) {
        return Err(Error::unsupported(&cfg_path, "sliding-window attention (use_sliding_window: true)"));
    }
    let u = |k: &str| -> Result<usize> {
        c[k].as_u64().map(|v| v as usize).ok_or_else(|| Error::bad_file(&cfg_path, format!("missing or non-integer '{k}'")))
    };
    let heads = u("num_attention_heads")?;
    let hidden = u("hidden_size")?;
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        match v {
            serde_json::Value::Number(n) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
            serde_json::Value::Array(a) => a.iter().filter_map(|x| x.as_u64().map(|x| x as u32)).collect(),
            _ => vec![],
        }
    };
    let mut cfg = Config {
        architecture: architecture.into(),
        vocab_size: u("vocab_size")?,
        hidden_size: hidden,
        intermediate_size: u("intermediate_size")?,
        num_layers: u("num_hidden_layers")?,
        num_heads: heads,
        num_kv_heads: c["num_key_value_heads"].as_u64().map(|v| v as usize).unwrap_or(heads),
        head_dim: c["head_dim"].as_u64().map(|v| v as usize).unwrap_or(hidden / heads.max(1)),
        rms_norm_eps: c["rms_norm_eps"].as_f64().unwrap_or(1e-6),
        // transformers 5 writes `rope_parameters` (theta inside, type `default` when unscaled);
        // earlier versions `rope_theta` and `rope_scaling`.
        rope_theta: c["rope_theta"].as_f64().or_else(|| c["rope_parameters"]["rope_theta"].as_f64()).unwrap_or(10000.0),
        rope_scaling: hf_rope_scaling(if c["rope_scaling"].is_null() { &c["rope_parameters"] } else { &c["rope_scaling"] }).map_err(|m| Error::unsupported(&cfg_path, m))?,
        max_position: c["max_position_embeddings"].as_u64().map(|v| v as usize).unwrap_or(4096),
        tie_embeddings: c["tie_word_embeddings"].as_bool().unwrap_or(false),
        attention_bias: c["attention_bias"].as_bool().unwrap_or(false),
        qk_norm: architecture == "qwen3",
        bos_token_id: ids(&c["bos_token_id"]).first().copied(),
        eos_token_ids: ids(&c["eos_token_id"]),
        ..Default::default()
    };
    if architecture == "gemma3" {
        gemma3_hf(&mut cfg, &c).map_err(|m| Error::unsupported(&cfg_path, m))?;
    }
    if c["use_bidirectional_attention"].as_bool() == Some(true) {
        return Err(Error::unsupported(&cfg_path, "bidirectional attention (use_bidirectional_attention: true)"));
    }
    cfg.validate().map_err(|m| Error::bad_file(&cfg_path, m))?;

    // Weights: one file or shards listed in the index.
    let single = dir.join("model.safetensors");
    let index = dir.join("model.safetensors.index.json");
    let files: Vec<PathBuf> = if single.exists() {
        vec![single]
    } else if index.exists() {
        let idx = read_json(&index)?;
        let map = idx["weight_map"].as_object().ok_or_else(|| Error::bad_file(&index, "no weight_map"))?;
        let mut fs: Vec<PathBuf> = map.values().filter_map(|v| v.as_str()).map(|f| dir.join(f)).collect();
        fs.sort();
        fs.dedup();
        fs
    } else {
        return Err(Error::bad_file(dir, "no model.safetensors or model.safetensors.index.json"));
    };
    for f in &files {
        if !f.exists() {
            return Err(Error::io(f, std::io::Error::new(std::io::ErrorKind::NotFound, "weight shard not found")));
        }
    }
    // SAFETY: the shards are memory-mapped read-only and must not change while loading (as in
    // candle's and every other safetensors loader); each tensor is read once, converted to f32
    // and, unless f32 is asked for, packed and dropped.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, DType::F32, device) }.map_err(|e| Error::bad_file(&files[0], format!("not a readable safetensors file: {e}")))?;
    if !vb.contains_tensor("lm_head.weight") {
        cfg.tie_embeddings = true;
    }
    // Qwen2's config.json does not say it has q/k/v biases (its code always adds them): where
    // the config is silent, the weights decide.
    if c["attention_bias"].is_null() {
        cfg.attention_bias = vb.contains_tensor("model.layers.0.self_attn.q_proj.bias");
    }

    let tok_path = dir.join("tokenizer.json");
    if !tok_path.exists() {
        return Err(Error::bad_file(dir, "no tokenizer: tokenizer.json is missing"));
    }
    let tc_path = dir.join("tokenizer_config.json");
    let tc = if tc_path.exists() { read_json(&tc_path)? } else { serde_json::Value::Null };
    let bos = token_str(tc.get("bos_token"));
    let mut eos: Vec<String> = token_str(tc.get("eos_token")).into_iter().collect();
    let add_bos = tc.get("add_bos_token").and_then(|v| v.as_bool()).unwrap_or(!matches!(architecture, "qwen2" | "qwen3") && bos.is_some());
    let mut tokenizer = Tokenizer::from_hf_file(&tok_path, bos, std::mem::take(&mut eos), add_bos)?;
    for id in &cfg.eos_token_ids {
        if !tokenizer.eos_ids.contains(id) {
            tokenizer.eos_ids.push(*id);
        }
    }
    if tokenizer.bos_id.is_none() {
        tokenizer.bos_id = cfg.bos_token_id;
    }
    cfg.eos_token_ids = tokenizer.eos_ids.clone();
    let (chat_template, chat_template_error) = usable_template(match tc.get("chat_template") {
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(serde_json::Value::Array(a)) => a.iter().find(|t| t["name"] == "default").or_else(|| a.first()).and_then(|t| t["template"].as_str()).map(str::to_string),
        _ => None,
    });
    let model = Llama::build(&vb, &cfg, weights, device).map_err(|e| Error::bad_file(dir, e.to_string()))?;
    Ok(Target { model, tokenizer, chat_template, chat_template_error, path: dir.to_path_buf() })
}

/// A template source as a usable template, or the reason it is not one.
fn usable_template(source: Option<String>) -> (Option<ChatTemplate>, Option<String>) {
    match source.map(ChatTemplate::new) {
        None => (None, None),
        Some(Ok(t)) => (Some(t), None),
        Some(Err(e)) => (None, Some(e.to_string())),
    }
}

/// Parse `--device cpu|cuda[:N]|metal`.
pub fn parse_device(s: &str) -> Result<Device> {
    let bad = || Error::InvalidArgument(format!("unknown device '{s}' (use cpu, cuda, cuda:N or metal)"));
    match s {
        "cpu" => Ok(Device::Cpu),
        "metal" => Device::new_metal(0).map_err(|e| Error::InvalidArgument(format!("metal device: {e}"))),
        _ => {
            let rest = s.strip_prefix("cuda").ok_or_else(bad)?;
            let n = if rest.is_empty() { 0 } else { rest.strip_prefix(':').and_then(|x| x.parse().ok()).ok_or_else(bad)? };
            Device::new_cuda(n).map_err(|e| Error::InvalidArgument(format!("cuda device {n}: {e}")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permute_round_trip_and_devices() {
        let w = Tensor::arange(0f32, 48., &Device::Cpu).unwrap().reshape((8, 6)).unwrap();
        let back = unpermute_qk(&permute_qk(&w, 2).unwrap(), 2).unwrap();
        assert_eq!(back.to_vec2::<f32>().unwrap(), w.to_vec2::<f32>().unwrap());
        assert!(parse_device("cpu").is_ok());
        assert!(parse_device("tpu").is_err());
        assert!(parse_device("cuda:x").is_err());
    }
}
