//! Tokenizers and chat templates, from GGUF metadata or a Hugging Face directory.
//!
//! GGUF files carry their vocabulary as metadata, not as a `tokenizer.json`; we translate that
//! metadata into the JSON the `tokenizers` crate reads, so both sources end up in the same engine.
use std::path::Path;

use candle_core::quantized::gguf_file::Value;
use serde_json::{json, Value as Json};

use crate::{Error, Result};

/// A tokenizer plus the special ids decoding needs.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Whether pieces are GPT-2 byte-level (a `ByteLevel` decoder, alone or in a sequence):
    /// how [`Tokenizer::token_bytes`] reads them.
    byte_level: bool,
    pub bos_id: Option<u32>,
    /// Any of these ends generation.
    pub eos_ids: Vec<u32>,
    pub add_bos: bool,
    pub bos_token: String,
    pub eos_token: String,
}

impl Tokenizer {
    /// Text to ids; `add_bos` follows the model's convention for a raw prompt.
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(|e| Error::Tokenizer(e.to_string()))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if add_bos && self.add_bos {
            if let Some(b) = self.bos_id {
                ids.push(b);
            }
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// `encode`, plus each token's starting byte in `text` (`None` for an added BOS), so that
    /// tokens can be traced back to the part of a document they came from.
    pub fn encode_with_offsets(&self, text: &str, add_bos: bool) -> Result<(Vec<u32>, Vec<Option<usize>>)> {
        let enc = self.inner.encode(text, false).map_err(|e| Error::Tokenizer(e.to_string()))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        let mut starts = Vec::with_capacity(enc.len() + 1);
        if add_bos && self.add_bos {
            if let Some(b) = self.bos_id {
                ids.push(b);
                starts.push(None);
            }
        }
        ids.extend_from_slice(enc.get_ids());
        starts.extend(enc.get_offsets().iter().map(|o| Some(o.0)));
        Ok((ids, starts))
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, true).map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// `decode` with the special tokens written out (`<|im_start|>`): the text of a prompt given
    /// as ids, as a server echoes it.
    pub fn decode_with_special(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// One token's own bytes, and its text (those bytes as UTF-8, U+FFFD where the token holds
    /// only part of a character): what an API lists per token beside its log-probability. Read
    /// from the vocabulary piece, not by decoding the token alone (which drops a SentencePiece
    /// token's leading space and breaks a byte-level token's partial character): byte-level BPE
    /// pieces through GPT-2's byte-to-character table, SentencePiece ones with `▁` as a space
    /// and byte-fallback pieces (`<0xE2>`) as their byte. Special tokens give their marker.
    pub fn token_bytes(&self, id: u32) -> Result<(String, Vec<u8>)> {
        let Some(piece) = self.inner.id_to_token(id) else {
            return Err(Error::InvalidArgument(format!("token id {id} is outside the vocabulary ({} tokens)", self.vocab_size())));
        };
        let byte_level = self.byte_level;
        let byte = piece.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')).filter(|h| h.len() == 2).and_then(|h| u8::from_str_radix(h, 16).ok());
        let bytes = match (byte_level, byte) {
            // Added tokens of a byte-level vocabulary are stored as text: one outside the
            // table is its own UTF-8.
            (true, _) => piece.chars().map(byte_of_char).collect::<Option<Vec<u8>>>().unwrap_or_else(|| piece.into_bytes()),
            (false, Some(b)) => vec![b],
            (false, None) => piece.replace('\u{2581}', " ").into_bytes(),
        };
        Ok((String::from_utf8_lossy(&bytes).into_owned(), bytes))
    }

    /// The ids of the special added tokens (chat-template markers, end of text): text never
    /// contains them, so decoding drops them.
    pub fn special_ids(&self) -> std::collections::HashSet<u32> {
        self.inner.get_added_tokens_decoder().into_iter().filter(|(_, t)| t.special).map(|(id, _)| id).collect()
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, s: &str) -> Option<u32> {
        self.inner.token_to_id(s)
    }

    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_ids.contains(&id)
    }

    /// The serialised tokenizer, hashed into head fingerprints.
    pub fn to_json(&self) -> String {
        self.inner.to_string(false).unwrap_or_default()
    }

    pub fn from_hf_file(path: &Path, bos: Option<String>, eos: Vec<String>, add_bos: bool) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| Error::bad_file(path, format!("cannot read tokenizer: {e}")))?;
        let bos_id = bos.as_deref().and_then(|b| inner.token_to_id(b));
        let mut eos_ids: Vec<u32> = eos.iter().filter_map(|e| inner.token_to_id(e)).collect();
        add_chat_stops(&inner, &mut eos_ids);
        Ok(Tokenizer {
            byte_level: byte_level_decoder(&inner),
            bos_token: bos.unwrap_or_default(),
            eos_token: eos.first().cloned().unwrap_or_default(),
            inner,
            bos_id,
            eos_ids,
            add_bos,
        })
    }

    /// Build from GGUF metadata (`tokenizer.ggml.*`): `gpt2` byte-level BPE or `llama` SentencePiece.
    pub fn from_gguf(path: &Path, md: &std::collections::HashMap<String, Value>) -> Result<Self> {
        let get_str = |k: &str| md.get(k).and_then(|v| v.to_string().ok()).cloned();
        let get_u32 = |k: &str| md.get(k).and_then(|v| v.to_u32().ok());
        let get_bool = |k: &str| md.get(k).and_then(|v| v.to_bool().ok());
        let kind = get_str("tokenizer.ggml.model").ok_or_else(|| Error::bad_file(path, "no tokenizer in the GGUF metadata (tokenizer.ggml.model missing)"))?;
        let tokens: Vec<String> = match md.get("tokenizer.ggml.tokens").map(|v| v.to_vec()) {
            Some(Ok(v)) => v.iter().map(|t| t.to_string().cloned().unwrap_or_default()).collect(),
            _ => return Err(Error::bad_file(path, "no tokenizer in the GGUF metadata (tokenizer.ggml.tokens missing)")),
        };
        if tokens.is_empty() {
            return Err(Error::bad_file(path, "the GGUF tokenizer has an empty vocabulary"));
        }
        let types: Vec<i32> = match md.get("tokenizer.ggml.token_type").map(|v| v.to_vec()) {
            Some(Ok(v)) => v.iter().map(|t| t.to_i32().unwrap_or(1)).collect(),
            _ => vec![1; tokens.len()],
        };
        let bos_id = get_u32("tokenizer.ggml.bos_token_id");
        let eos_id = get_u32("tokenizer.ggml.eos_token_id");
        let unk_id = get_u32("tokenizer.ggml.unknown_token_id");
        // Control (3) and user-defined (4) tokens are matched whole, never split by the model.
        let added: Vec<tokenizers::AddedToken> = tokens
            .iter()
            .enumerate()
            .filter(|(i, _)| matches!(types.get(*i), Some(3) | Some(4)))
            .map(|(i, t)| tokenizers::AddedToken::from(t.clone(), types[i] == 3).single_word(false).lstrip(false).rstrip(false).normalized(false))
            .collect();
        let (model, normalizer, pre, decoder, add_bos_default) = match kind.as_str() {
            "gpt2" => {
                let merges: Vec<String> = match md.get("tokenizer.ggml.merges").map(|v| v.to_vec()) {
                    Some(Ok(v)) => v.iter().map(|t| t.to_string().cloned().unwrap_or_default()).collect(),
                    _ => return Err(Error::bad_file(path, "gpt2 tokenizer without tokenizer.ggml.merges")),
                };
                let mut pairs = Vec::with_capacity(merges.len());
                for (i, m) in merges.iter().enumerate() {
                    // As llama.cpp reads them: split at the first space after the first character.
                    let first = m.chars().next().map_or(0, char::len_utf8);
                    match m[first..].find(' ').map(|at| first + at) {
                        Some(at) => pairs.push((m[..at].to_string(), m[at + 1..].to_string())),
                        None => return Err(Error::bad_file(path, format!("merge {i} ({m:?}) is not two pieces separated by a space"))),
                    }
                }
                let model = bpe(path, &tokens, pairs, |b| b)?;
                let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
                let pre_name = get_str("tokenizer.ggml.pre").unwrap_or_else(|| "default".into());
                let pre = match pre_name.as_str() {
                    "default" | "gpt2" | "gpt-2" => byte_level,
                    "smollm" | "starcoder" | "refact" => json!({"type": "Sequence", "pretokenizers": [
                        {"type": "Digits", "individual_digits": true}, byte_level]}),
                    "llama-bpe" | "llama3" | "qwen2" | "deepseek-llm" => {
                        let re = if pre_name == "qwen2" {
                            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
                        } else {
                            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
                        };
                        json!({"type": "Sequence", "pretokenizers": [
                            {"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false},
                            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]})
                    }
                    other => return Err(Error::unsupported(path, format!("gpt2 pre-tokenizer '{other}' (supported: gpt2, smollm, starcoder, llama-bpe, qwen2)"))),
                };
                let decoder = json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true});
                (model, Json::Null, pre, decoder, false)
            }
            "llama" => {
                let scores: Vec<f64> = match md.get("tokenizer.ggml.scores").map(|v| v.to_vec()) {
                    Some(Ok(v)) => v.iter().map(|t| t.to_f32().unwrap_or(0.0) as f64).collect(),
                    _ => vec![0.0; tokens.len()],
                };
                // Every split of every piece is looked up (quadratic in a piece's length): bound
                // it before that work. Real vocabularies stay far below (Gemma 3's longest: 48).
                if let Some((i, t)) = tokens.iter().enumerate().find(|(_, t)| t.len() > MAX_SPM_PIECE_BYTES) {
                    return Err(Error::bad_file(path, format!("vocabulary piece {i} is {} bytes long; a SentencePiece vocabulary's pieces may be at most {MAX_SPM_PIECE_BYTES}", t.len())));
                }
                let merges = spm_merges(&tokens, &scores, &types);
                let unk = unk_id.and_then(|u| tokens.get(u as usize)).cloned();
                let model = bpe(path, &tokens, merges, |b| {
                    let b = b.fuse_unk(true).byte_fallback(true);
                    match unk {
                        Some(u) => b.unk_token(u),
                        None => b,
                    }
                })?;
                let prefix = get_bool("tokenizer.ggml.add_space_prefix").unwrap_or(true);
                let mut norms = vec![];
                if prefix {
                    norms.push(json!({"type": "Prepend", "prepend": "\u{2581}"}));
                }
                norms.push(json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}));
                let normalizer = json!({"type": "Sequence", "normalizers": norms});
                let mut decs = vec![
                    json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
                    json!({"type": "ByteFallback"}),
                    json!({"type": "Fuse"}),
                ];
                if prefix {
                    decs.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
                }
                let decoder = json!({"type": "Sequence", "decoders": decs});
                (model, normalizer, Json::Null, decoder, true)
            }
            other => return Err(Error::unsupported(path, format!("tokenizer kind '{other}' (supported: gpt2, llama)"))),
        };
        // The model is built directly and the small parts from their JSON: a whole tokenizer
        // document through `from_bytes` serialised and parsed every vocabulary entry and merge
        // again (Gemma 3's 262,144 pieces: a second of start-up and ~0.5 GB of transient
        // memory, most of it fresh pages the kernel had to zero).
        let bad = |e: &dyn std::fmt::Display| Error::bad_file(path, format!("cannot build the tokenizer from GGUF metadata: {e}"));
        let mut inner = tokenizers::Tokenizer::new(model);
        if !normalizer.is_null() {
            let n: tokenizers::NormalizerWrapper = serde_json::from_value(normalizer).map_err(|e| bad(&e))?;
            inner.with_normalizer(Some(n)).map_err(|e| bad(&e))?;
        }
        if !pre.is_null() {
            let p: tokenizers::PreTokenizerWrapper = serde_json::from_value(pre).map_err(|e| bad(&e))?;
            inner.with_pre_tokenizer(Some(p));
        }
        let d: tokenizers::DecoderWrapper = serde_json::from_value(decoder).map_err(|e| bad(&e))?;
        inner.with_decoder(Some(d));
        inner.add_tokens(added).map_err(|e| bad(&e))?;
        let name = |id: Option<u32>| id.and_then(|i| tokens.get(i as usize).cloned()).unwrap_or_default();
        let mut eos_ids: Vec<u32> = eos_id.into_iter().collect();
        add_chat_stops(&inner, &mut eos_ids);
        Ok(Tokenizer {
            byte_level: byte_level_decoder(&inner),
            bos_token: name(bos_id),
            eos_token: name(eos_id),
            inner,
            bos_id,
            eos_ids,
            add_bos: get_bool("tokenizer.ggml.add_bos_token").unwrap_or(add_bos_default),
        })
    }
}

/// The longest SentencePiece piece accepted from a GGUF (building the merges looks up every split of every piece).
pub const MAX_SPM_PIECE_BYTES: usize = 1024;

/// A GGUF "llama" (SentencePiece) vocabulary as the BPE model that tokenizes as llama.cpp does:
/// starting from characters, repeatedly merge the adjacent pair whose concatenation is a
/// vocabulary piece with the highest score (the scores of these files rank the pieces: Llama 2's
/// and Gemma's are minus the merge rank), falling back to `<0xXX>` byte tokens for characters
/// outside the vocabulary. Every split of a piece into two pieces becomes a merge, ranked by
/// the piece's score. A Unigram (Viterbi) model over the same scores splits differently: with
/// Gemma 3's, "The capital of France is" came out as ten pieces where llama.cpp has five.
fn spm_merges(tokens: &[String], scores: &[f64], types: &[i32]) -> Vec<(String, String)> {
    // Normal (1) and unused (5) pieces take part in merges; control, user-defined and byte
    // tokens are matched otherwise.
    let mergeable = |i: usize| matches!(types.get(i), None | Some(1) | Some(5));
    let index: std::collections::HashMap<&str, usize> = tokens.iter().enumerate().filter(|&(i, _)| mergeable(i)).map(|(i, t)| (t.as_str(), i)).collect();
    let mut merges: Vec<(f64, usize, usize, usize)> = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        if !mergeable(i) || t.chars().nth(1).is_none() {
            continue;
        }
        for (k, _) in t.char_indices().skip(1) {
            if let (Some(&a), Some(&b)) = (index.get(&t[..k]), index.get(&t[k..])) {
                merges.push((scores.get(i).copied().unwrap_or(0.0), i, a, b));
            }
        }
    }
    // Highest score first; a piece's splits together, left part shortest first.
    merges.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)).then(tokens[x.2].len().cmp(&tokens[y.2].len())));
    merges.iter().map(|&(_, _, a, b)| (tokens[a].clone(), tokens[b].clone())).collect()
}

/// The BPE model over `tokens` (ids in order; a repeated piece takes its last id, as llama.cpp's
/// map and the JSON vocabulary built before did) and `merges`, with `options` applied to the
/// builder.
fn bpe(path: &Path, tokens: &[String], merges: Vec<(String, String)>, options: impl FnOnce(tokenizers::models::bpe::BpeBuilder) -> tokenizers::models::bpe::BpeBuilder) -> Result<tokenizers::models::bpe::BPE> {
    let mut vocab = ahash::AHashMap::with_capacity(tokens.len());
    for (i, t) in tokens.iter().enumerate() {
        vocab.insert(t.clone(), i as u32);
    }
    options(tokenizers::models::bpe::BPE::builder().vocab_and_merges(vocab, merges))
        .build()
        .map_err(|e| Error::bad_file(path, format!("cannot build the tokenizer from GGUF metadata: {e}")))
}

/// End-of-turn markers of common chat formats also end generation.
fn add_chat_stops(inner: &tokenizers::Tokenizer, eos: &mut Vec<u32>) {
    for s in ["<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end|>", "<end_of_turn>"] {
        if let Some(id) = inner.token_to_id(s) {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
    }
}

/// Whether `t` decodes GPT-2 byte-level pieces: a `ByteLevel` decoder, alone or anywhere in a
/// sequence of decoders (read from its serialised form, which names every step's type).
fn byte_level_decoder(t: &tokenizers::Tokenizer) -> bool {
    fn has(v: &serde_json::Value) -> bool {
        match v {
            serde_json::Value::Object(o) => o.get("type").is_some_and(|t| t == "ByteLevel") || o.values().any(has),
            serde_json::Value::Array(a) => a.iter().any(has),
            _ => false,
        }
    }
    t.get_decoder().and_then(|d| serde_json::to_value(d).ok()).is_some_and(|v| has(&v))
}

/// The byte GPT-2's byte-level BPE writes as `c`: printable Latin-1 bytes stand for
/// themselves, the other 68 bytes (controls, space, 0x7F-0xA0, 0xAD) for U+0100 onwards in
/// byte order. `None` for any other character.
fn byte_of_char(c: char) -> Option<u8> {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let code = c as u32;
    if code < 256 {
        return printable(code as u8).then_some(code as u8);
    }
    (0..=255u8).filter(|&b| !printable(b)).nth((code - 256) as usize)
}

/// A Jinja chat template as shipped with the model.
#[derive(Clone)]
pub struct ChatTemplate {
    source: String,
}

/// One chat turn.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct Message {
    pub role: String,
    pub content: String,
    /// The participant's name (OpenAI's `name`): the template sees it as `message.name`; most
    /// templates ignore it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Message { role: role.into(), content: content.into(), name: None }
    }
}

impl ChatTemplate {
    /// The template's Jinja source (cache keys of what it renders name it).
    pub fn source(&self) -> &str {
        &self.source
    }
    pub fn new(source: String) -> Result<Self> {
        let t = ChatTemplate { source };
        // Compile once now so a broken template is reported at load, not at the first prompt.
        t.env()?;
        Ok(t)
    }

    fn env(&self) -> Result<minijinja::Environment<'static>> {
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned("chat", self.source.clone()).map_err(|e| Error::Template(e.to_string()))?;
        Ok(env)
    }

    /// Render a conversation; `add_generation_prompt` opens the assistant's turn.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool, bos: &str, eos: &str) -> Result<String> {
        let env = self.env()?;
        let tmpl = env.get_template("chat").map_err(|e| Error::Template(e.to_string()))?;
        tmpl.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => bos,
            eos_token => eos,
        })
        .map_err(|e| Error::Template(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GPT-2's table, built forwards as its `bytes_to_unicode` does, is what `byte_of_char`
    /// reads backwards: all 256 bytes, and nothing else.
    #[test]
    fn byte_level_characters_map_back_to_their_bytes() {
        let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
        let mut chars = printable.clone();
        let mut n = 0;
        for b in 0..256u32 {
            if !printable.contains(&b) {
                printable.push(b);
                chars.push(256 + n);
                n += 1;
            }
        }
        for (&b, &c) in printable.iter().zip(&chars) {
            assert_eq!(byte_of_char(char::from_u32(c).unwrap()), Some(b as u8), "U+{c:04X}");
        }
        assert_eq!(byte_of_char('\u{0120}'), Some(b' '));
        assert_eq!(byte_of_char('\u{010A}'), Some(b'\n'));
        assert_eq!(byte_of_char('\u{0144}'), None);
        assert_eq!(byte_of_char('\u{2581}'), None);
    }

    #[test]
    fn llama_sentencepiece_from_gguf_metadata() {
        use candle_core::quantized::gguf_file::Value as V;
        let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
        let mut types = vec![2, 3, 3];
        for b in 0..256u32 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(6);
        }
        // As in real SentencePiece-BPE vocabularies, every piece is reachable by merging two.
        for w in ["\u{2581}the", "\u{2581}cat", "\u{2581}sat", "\u{2581}th", "\u{2581}ca", "\u{2581}sa", "\u{2581}t", "\u{2581}c", "\u{2581}s", "\u{2581}", "t", "h", "e", "c", "a", "s"] {
            tokens.push(w.to_string());
            types.push(1);
        }
        let scores: Vec<V> = tokens.iter().enumerate().map(|(i, t)| V::F32(if t.chars().count() > 2 { -1.0 } else { -10.0 - i as f32 * 0.01 })).collect();
        let md: std::collections::HashMap<String, V> = [
            ("tokenizer.ggml.model", V::String("llama".into())),
            ("tokenizer.ggml.tokens", V::Array(tokens.iter().map(|t| V::String(t.clone())).collect())),
            ("tokenizer.ggml.scores", V::Array(scores)),
            ("tokenizer.ggml.token_type", V::Array(types.iter().map(|&t| V::I32(t)).collect())),
            ("tokenizer.ggml.bos_token_id", V::U32(1)),
            ("tokenizer.ggml.eos_token_id", V::U32(2)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let t = Tokenizer::from_gguf(std::path::Path::new("spm.gguf"), &md).unwrap();
        let ids = t.encode("the cat sat", true).unwrap();
        assert_eq!(ids[0], 1, "llama tokenizers add BOS");
        assert_eq!(ids.len(), 4, "{ids:?}: pairs merge best score first, up to whole words");
        assert_eq!(t.decode(&ids).unwrap(), "the cat sat");
        // Characters outside the vocabulary fall back to bytes and decode back.
        let ids = t.encode("the \u{e9}", false).unwrap();
        assert_eq!(t.decode(&ids).unwrap(), "the \u{e9}");
        // Per-token bytes: the piece's space kept, a byte-fallback piece as its byte.
        let id = |p: &str| t.token_to_id(p).unwrap();
        assert_eq!(t.token_bytes(id("\u{2581}cat")).unwrap(), (" cat".to_string(), b" cat".to_vec()));
        assert_eq!(t.token_bytes(id("<0xC3>")).unwrap(), ("\u{FFFD}".to_string(), vec![0xC3]));
        assert_eq!(t.token_bytes(2).unwrap().0, "</s>");
        assert!(t.token_bytes(100_000).is_err());
        assert!(t.is_eos(2));
        // A piece past the bound is refused, naming the file, before the quadratic work.
        let mut long = md.clone();
        let mut toks = tokens.clone();
        toks.push("x".repeat(MAX_SPM_PIECE_BYTES + 1));
        long.insert("tokenizer.ggml.tokens".into(), V::Array(toks.iter().map(|t| V::String(t.clone())).collect()));
        let e = Tokenizer::from_gguf(std::path::Path::new("spm.gguf"), &long).err().expect("refused").to_string();
        assert!(e.contains("spm.gguf") && e.contains("1025 bytes"), "{e}");
    }

    #[test]
    fn chatml_template_renders() {
        let src = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content.strip() }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        let t = ChatTemplate::new(src.into()).unwrap();
        let out = t.render(&[Message::new("user", " hi ")], true, "", "").unwrap();
        assert_eq!(out, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
        assert!(ChatTemplate::new("{% for %}".into()).is_err());
    }
}
