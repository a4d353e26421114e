//! Plain autoregressive decoding: the reference every speculative run must reproduce.
use std::time::Instant;

use crate::model::kv_cache::KvCache;
use crate::cpu::reduce::row_to_vec;
use crate::model::Llama;
use crate::decode::sampling::{Rng64, SamplingParams};
use crate::model::tokenizer::Tokenizer;
use crate::{Error, Result};

/// Counts and timings of one generation.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct GenStats {
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    /// Target forwards after the prefill (plain decoding: one per token).
    pub target_forwards: usize,
    pub prefill_secs: f64,
    pub decode_secs: f64,
}

impl GenStats {
    pub fn prefill_tok_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_secs.max(1e-9)
    }
    /// Tokens per second of decoding: those after the first (which the prefill's logits give,
    /// before `decode_secs` starts) over the time that made them.
    pub fn decode_tok_s(&self) -> f64 {
        self.new_tokens.saturating_sub(1) as f64 / self.decode_secs.max(1e-9)
    }
    /// Tokens emitted per target forward, the bonus token counted (plain decoding = 1.0).
    /// The first token comes from the prefill's logits, so it is not counted on either side.
    pub fn tau(&self) -> f64 {
        if self.target_forwards == 0 {
            return 1.0;
        }
        (self.new_tokens.saturating_sub(1)) as f64 / self.target_forwards as f64
    }
}

/// Stop conditions shared by every decoder.
#[derive(Clone, Copy)]
pub struct StopRule<'a> {
    pub max_new_tokens: usize,
    pub eos_ids: &'a [u32],
}

/// Check a prompt fits and clip the token budget to the context.
pub fn check_budget(prompt_len: usize, max_new: usize, context: usize) -> Result<usize> {
    if max_new == 0 {
        return Err(Error::InvalidArgument("--max-tokens must be at least 1".into()));
    }
    if prompt_len == 0 {
        return Err(Error::InvalidArgument("the prompt is empty".into()));
    }
    if prompt_len >= context {
        return Err(Error::InvalidArgument(format!("the prompt has {prompt_len} tokens but the model's context is {context} tokens")));
    }
    Ok(max_new.min(context - prompt_len))
}

/// Prefill the prompt; returns the cache, the logits row of the last prompt token and every
/// prompt token's final hidden state (a draft layer reads them all).
pub fn prefill(model: &Llama, prompt: &[u32]) -> Result<(KvCache, Vec<f32>, candle_core::Tensor)> {
    let mut cache = model.new_cache()?;
    let hidden = model.forward_causal(prompt, &mut cache)?;
    let last = hidden.narrow(0, prompt.len() - 1, 1)?;
    let logits = model.logits(&last)?;
    Ok((cache, row_to_vec(&logits, 0)?, hidden))
}

/// Plain decoding. `on_token` sees every emitted token as soon as it exists.
pub fn generate_plain(
    model: &Llama,
    prompt: &[u32],
    params: &SamplingParams,
    stop: &StopRule,
    rng: &mut Rng64,
    on_token: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<(Vec<u32>, GenStats)> {
    params.validate()?;
    let budget = check_budget(prompt.len(), stop.max_new_tokens, model.config().max_position)?;
    let t0 = Instant::now();
    let (mut cache, mut logits, _) = prefill(model, prompt)?;
    let prefill_secs = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut history = prompt.to_vec();
    let mut out = Vec::new();
    let mut forwards = 0;
    loop {
        let tok = params.choose(&logits, &history, rng);
        out.push(tok);
        history.push(tok);
        on_token(tok)?;
        if stop.eos_ids.contains(&tok) || out.len() >= budget || cache.len() + 1 >= model.config().max_position {
            break;
        }
        let h = model.forward_causal(&[tok], &mut cache)?;
        logits = row_to_vec(&model.logits(&h)?, 0)?;
        forwards += 1;
    }
    let stats = GenStats {
        prompt_tokens: prompt.len(),
        new_tokens: out.len(),
        target_forwards: forwards,
        prefill_secs,
        decode_secs: t1.elapsed().as_secs_f64(),
    };
    Ok((out, stats))
}

/// Turns a token stream into text pieces, holding back incomplete UTF-8 (byte-level tokens can
/// split a character).
pub struct TextStream<'a> {
    tok: &'a Tokenizer,
    tokens: Vec<u32>,
    prev: usize,
    current: usize,
}

impl<'a> TextStream<'a> {
    pub fn new(tok: &'a Tokenizer) -> Self {
        TextStream { tok, tokens: Vec::new(), prev: 0, current: 0 }
    }

    /// Add a token; returns newly completed text, if any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        let before = self.tok.decode(&self.tokens[self.prev..self.current])?;
        self.tokens.push(id);
        let now = self.tok.decode(&self.tokens[self.prev..])?;
        if now.len() > before.len() && !now.ends_with('\u{FFFD}') && now.is_char_boundary(before.len()) {
            let piece = now[before.len()..].to_string();
            self.prev = self.current;
            self.current = self.tokens.len();
            Ok(Some(piece))
        } else {
            Ok(None)
        }
    }

    /// Whatever is left at the end, less a character cut short (the bytes of a character the
    /// last tokens began and never finished, which decode as U+FFFD). A U+FFFD the model wrote
    /// itself as the very last character goes too: the decoded text cannot tell them apart.
    pub fn finish(&mut self) -> Result<Option<String>> {
        let before = self.tok.decode(&self.tokens[self.prev..self.current])?;
        let mut now = self.tok.decode(&self.tokens[self.prev..])?;
        while now.len() > before.len() && now.ends_with('\u{FFFD}') {
            now.pop();
        }
        if now.len() > before.len() && now.is_char_boundary(before.len()) {
            self.prev = self.tokens.len();
            self.current = self.tokens.len();
            return Ok(Some(now[before.len()..].to_string()));
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn budget_checks() {
        assert_eq!(check_budget(10, 100, 50).unwrap(), 40);
        assert!(check_budget(50, 1, 50).is_err());
        assert!(check_budget(5, 0, 50).is_err());
        assert!(check_budget(0, 5, 50).is_err());
        let s = GenStats { new_tokens: 11, target_forwards: 5, decode_secs: 0.5, ..Default::default() };
        assert_eq!(s.tau(), 2.0);
        assert_eq!(s.decode_tok_s(), 20.0, "the first token is the prefill's");
    }
}
