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

/// What a token callback tells the decoding loop after seeing a token: go on, or end the run
/// here (a stop text appeared, enough was seen), keeping the tokens so far and the run's
/// statistics, which an error would lose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Stop,
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

/// Plain decoding. `on_token` sees every emitted token as soon as it exists, and may end the
/// run after it ([`Flow::Stop`]).
pub fn generate_plain(
    model: &Llama,
    prompt: &[u32],
    params: &SamplingParams,
    stop: &StopRule,
    rng: &mut Rng64,
    on_token: &mut dyn FnMut(u32) -> Result<Flow>,
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
        let flow = on_token(tok)?;
        if flow == Flow::Stop || stop.eos_ids.contains(&tok) || out.len() >= budget || cache.len() + 1 >= model.config().max_position {
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

/// Stop strings over streamed text: passes text on, holding back a tail that could still grow
/// into a stop string, and cuts the answer where one appears.
pub struct StopMatch {
    stops: Vec<String>,
    pending: String,
    pub hit: bool,
}

impl StopMatch {
    pub fn new(stops: Vec<String>) -> Self {
        StopMatch { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), pending: String::new(), hit: false }
    }

    /// Add `text`; returns what may be sent now and whether a stop string was found (the text
    /// before it is returned, the rest dropped). `last`: no more text will come.
    pub fn push(&mut self, text: &str, last: bool) -> (String, bool) {
        if self.hit {
            return (String::new(), true);
        }
        self.pending.push_str(text);
        if let Some(at) = self.stops.iter().filter_map(|s| self.pending.find(s.as_str())).min() {
            self.hit = true;
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, true);
        }
        if last {
            return (std::mem::take(&mut self.pending), false);
        }
        // Hold back the longest tail that is a proper prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (n, _) in s.char_indices().skip(1) {
                if self.pending.ends_with(&s[..n]) {
                    keep = keep.max(n);
                }
            }
        }
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
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

    #[test]
    fn stop_strings_cut_the_answer_and_hold_back_partial_matches() {
        let mut s = StopMatch::new(vec!["\n\nUser:".into(), "END".into()]);
        assert_eq!(s.push("Hello", false), ("Hello".into(), false));
        assert_eq!(s.push(" world\n", false), (" world".into(), false), "a newline may start a stop string");
        assert_eq!(s.push("\nUs", false), (String::new(), false));
        assert_eq!(s.push("x", false), ("\n\nUsx".into(), false), "no longer a prefix");
        assert_eq!(s.push("EN", false), (String::new(), false));
        assert_eq!(s.push("D and more", false), (String::new(), true));
        assert_eq!(s.push("anything", false), (String::new(), true), "stays stopped");
        let mut t = StopMatch::new(vec!["xyz".into()]);
        assert_eq!(t.push("abc x", false), ("abc ".into(), false));
        assert_eq!(t.push("", true), ("x".into(), false), "the held-back tail is sent at the end");
        let mut none = StopMatch::new(vec![]);
        assert_eq!(none.push("é", false), ("é".into(), false));
    }
}
