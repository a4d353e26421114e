//! Perplexity of the target over a text, scored exactly as llama.cpp's `llama-perplexity` scores
//! it, so the two runtimes' numbers for the same GGUF and text can be set side by side: a check
//! that a weight format (`native`'s int8 arithmetic, `q8_0`, `bf16`) keeps the model's quality,
//! and that this runtime reads a file as llama.cpp does.
//!
//! The text is tokenized whole (with BOS where the model adds one) and cut into chunks of `ctx`
//! tokens; each chunk runs alone from an empty cache, its first token replaced by BOS where the
//! model adds one, and only its second half is scored: the logits of rows `ctx/2 .. ctx-1`
//! against the tokens that follow them, so every scored token sees at least `ctx/2` tokens of
//! context. PPL = exp(mean negative log-likelihood); the ± is PPL times the standard error of
//! that mean, as llama.cpp prints it.
use serde::Serialize;

use crate::cpu::reduce::with_rows;
use crate::decode::sampling::token_logprobs;
use crate::model::loader::Target;
use crate::{Error, Result};

/// The fewest tokens a chunk may have (half of them scored).
pub const MIN_CTX: usize = 16;
/// Logits rows computed at a time: 256 × SmolLM2's 49,152 entries is 50 MB.
const LOGIT_ROWS: usize = 256;

#[derive(Debug, Clone, Serialize)]
pub struct Perplexity {
    pub ctx: usize,
    pub chunks: usize,
    /// Tokens scored: `ctx - 1 - ctx/2` a chunk.
    pub scored: usize,
    pub ppl: f64,
    /// PPL times the standard error of the mean negative log-likelihood.
    pub ppl_error: f64,
    pub mean_nll: f64,
    /// PPL over the chunks so far, after each (llama.cpp's `[1]12.34,[2]...` line).
    pub running: Vec<f64>,
    pub secs: f64,
}

/// How many chunks of `ctx` tokens `tokens` gives (at most `max_chunks` when set), or why none:
/// llama.cpp asks for at least two chunks' worth.
pub fn chunks(tokens: usize, ctx: usize, max_chunks: Option<usize>) -> Result<usize> {
    if ctx < MIN_CTX {
        return Err(Error::InvalidArgument(format!("a context of {ctx} tokens is too short to score (at least {MIN_CTX})")));
    }
    if tokens < 2 * ctx {
        return Err(Error::InvalidArgument(format!("the text is {tokens} tokens; a context of {ctx} needs at least {} (two chunks, as llama-perplexity asks)", 2 * ctx)));
    }
    Ok(max_chunks.map_or(tokens / ctx, |m| m.min(tokens / ctx)))
}

/// Score `tokens` (a whole text, tokenized with BOS where the model adds one) in chunks of `ctx`;
/// `on_chunk(i, running_ppl)` after each.
pub fn perplexity(target: &Target, tokens: &[u32], ctx: usize, max_chunks: Option<usize>, on_chunk: &mut dyn FnMut(usize, f64)) -> Result<Perplexity> {
    let context = target.model.config().max_position;
    if ctx > context {
        return Err(Error::InvalidArgument(format!("a context of {ctx} tokens is past this model's {context}")));
    }
    let n = chunks(tokens.len(), ctx, max_chunks)?;
    let bos = target.tokenizer.bos_id.filter(|_| target.tokenizer.add_bos);
    let first = ctx / 2;
    let t0 = std::time::Instant::now();
    let (mut nll, mut nll2, mut count) = (0f64, 0f64, 0usize);
    let mut running = Vec::with_capacity(n);
    for i in 0..n {
        let mut chunk = tokens[i * ctx..(i + 1) * ctx].to_vec();
        if let Some(b) = bos {
            chunk[0] = b;
        }
        let mut cache = target.model.new_cache()?;
        let hidden = target.model.forward_causal(&chunk, &mut cache)?;
        // Row r predicts chunk[r + 1]; rows first .. ctx - 1 are scored.
        let mut r = first;
        while r < ctx - 1 {
            let rows = LOGIT_ROWS.min(ctx - 1 - r);
            let logits = target.model.logits(&hidden.narrow(0, r, rows)?)?;
            with_rows(&logits, |row| {
                for j in 0..rows {
                    let v = -(token_logprobs(row(j)?, chunk[r + j + 1], 0).logprob as f64);
                    nll += v;
                    nll2 += v * v;
                }
                Ok(())
            })?;
            r += rows;
        }
        count += ctx - 1 - first;
        let ppl = (nll / count as f64).exp();
        running.push(ppl);
        on_chunk(i, ppl);
    }
    let mean = nll / count as f64;
    let var = nll2 / count as f64 - mean * mean;
    let ppl = mean.exp();
    let ppl_error = if var > 0.0 && count > 1 { ppl * (var / (count - 1) as f64).sqrt() } else { 0.0 };
    Ok(Perplexity { ctx, chunks: n, scored: count, ppl, ppl_error, mean_nll: mean, running, secs: t0.elapsed().as_secs_f64() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_follow_llama_perplexitys_rule() {
        assert_eq!(chunks(1024, 512, None).unwrap(), 2);
        assert_eq!(chunks(5000, 512, None).unwrap(), 9);
        assert_eq!(chunks(5000, 512, Some(3)).unwrap(), 3);
        assert!(chunks(1023, 512, None).unwrap_err().to_string().contains("at least 1024"));
        assert!(chunks(1000, 8, None).is_err());
    }
}
