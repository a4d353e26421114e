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
use crate::decode::sampling::log_softmax_into;
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

/// How far a weight format's distributions are from a reference format's over the same scored
/// tokens (llama-perplexity's `--kl-divergence` figures): mean KL(reference ‖ tested) with its
/// standard error, the largest, and how often both pick the same likeliest token.
#[derive(Debug, Clone, Serialize)]
pub struct Divergence {
    /// The reference's own perplexity over the same tokens.
    pub reference: Perplexity,
    pub mean_kld: f64,
    pub kld_error: f64,
    pub max_kld: f64,
    /// Share of scored positions whose argmax is the same in both.
    pub same_top: f64,
}

/// Running sums of a per-token figure (a negative log-likelihood, a divergence): its mean and
/// that mean's standard error, and for likelihoods PPL and its ±, as llama.cpp computes them.
#[derive(Default)]
struct Nll {
    sum: f64,
    sum2: f64,
    count: usize,
}

impl Nll {
    fn add(&mut self, v: f64) {
        self.sum += v;
        self.sum2 += v * v;
        self.count += 1;
    }
    fn ppl(&self) -> f64 {
        (self.sum / self.count as f64).exp()
    }
    /// (mean, standard error of the mean).
    fn mean_error(&self) -> (f64, f64) {
        let n = self.count as f64;
        let mean = self.sum / n;
        let var = self.sum2 / n - mean * mean;
        (mean, if var > 0.0 && self.count > 1 { (var / (n - 1.0)).sqrt() } else { 0.0 })
    }
    fn report(&self, ctx: usize, chunks: usize, running: Vec<f64>, secs: f64) -> Perplexity {
        let (mean, se) = self.mean_error();
        let ppl = mean.exp();
        Perplexity { ctx, chunks, scored: self.count, ppl, ppl_error: ppl * se, mean_nll: mean, running, secs }
    }
}

/// Score `tokens` (a whole text, tokenized with BOS where the model adds one) in chunks of `ctx`;
/// `on_chunk(i, running_ppl)` after each.
pub fn perplexity(target: &Target, tokens: &[u32], ctx: usize, max_chunks: Option<usize>, on_chunk: &mut dyn FnMut(usize, f64)) -> Result<Perplexity> {
    score(target, None, tokens, ctx, max_chunks, on_chunk).map(|(p, _)| p)
}

/// [`perplexity`] of `target`, and beside it how its distributions depart from `reference`'s
/// (the same model in another weight format, usually f32) on every scored token.
pub fn perplexity_against(target: &Target, reference: &Target, tokens: &[u32], ctx: usize, max_chunks: Option<usize>, on_chunk: &mut dyn FnMut(usize, f64)) -> Result<(Perplexity, Divergence)> {
    let (p, d) = score(target, Some(reference), tokens, ctx, max_chunks, on_chunk)?;
    Ok((p, d.expect("a reference gives a divergence")))
}

fn score(target: &Target, reference: Option<&Target>, tokens: &[u32], ctx: usize, max_chunks: Option<usize>, on_chunk: &mut dyn FnMut(usize, f64)) -> Result<(Perplexity, Option<Divergence>)> {
    let context = target.model.config().max_position;
    if ctx > context {
        return Err(Error::InvalidArgument(format!("a context of {ctx} tokens is past this model's {context}")));
    }
    if let Some(r) = reference {
        if r.model.config().vocab_size != target.model.config().vocab_size {
            return Err(Error::InvalidArgument("the reference is another model (its vocabulary differs)".into()));
        }
    }
    let n = chunks(tokens.len(), ctx, max_chunks)?;
    let bos = target.tokenizer.bos_id.filter(|_| target.tokenizer.add_bos);
    let first = ctx / 2;
    let t0 = std::time::Instant::now();
    let (mut nll, mut ref_nll, mut kld) = (Nll::default(), Nll::default(), Nll::default());
    let (mut max_kld, mut same) = (0f64, 0usize);
    let (mut running, mut ref_running) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let (mut lt, mut lr) = (Vec::new(), Vec::new());
    for i in 0..n {
        let mut chunk = tokens[i * ctx..(i + 1) * ctx].to_vec();
        if let Some(b) = bos {
            chunk[0] = b;
        }
        let forward = |t: &Target| -> Result<candle_core::Tensor> { t.model.forward_causal(&chunk, &mut t.model.new_cache()?) };
        let hidden = forward(target)?;
        let ref_hidden = reference.map(forward).transpose()?;
        // Row r predicts chunk[r + 1]; rows first .. ctx - 1 are scored.
        let mut r = first;
        while r < ctx - 1 {
            let rows = LOGIT_ROWS.min(ctx - 1 - r);
            let logits = target.model.logits(&hidden.narrow(0, r, rows)?)?;
            let ref_logits = match (reference, &ref_hidden) {
                (Some(m), Some(h)) => Some(m.model.logits(&h.narrow(0, r, rows)?)?),
                _ => None,
            };
            with_rows(&logits, |row| {
                let Some(rl) = &ref_logits else {
                    for j in 0..rows {
                        log_softmax_into(row(j)?, &mut lt);
                        nll.add(-lt[chunk[r + j + 1] as usize]);
                    }
                    return Ok(());
                };
                with_rows(rl, |ref_row| {
                    for j in 0..rows {
                        let next = chunk[r + j + 1] as usize;
                        log_softmax_into(row(j)?, &mut lt);
                        log_softmax_into(ref_row(j)?, &mut lr);
                        nll.add(-lt[next]);
                        ref_nll.add(-lr[next]);
                        // KL(ref || tested) = sum p_ref (log p_ref - log p_tested), over the tokens
                        // the reference allows.
                        let d: f64 = lr.iter().zip(&lt).filter(|(a, _)| a.is_finite()).map(|(&a, &b)| a.exp() * (a - b)).sum();
                        kld.add(d);
                        max_kld = max_kld.max(d);
                        same += (argmax(&lt) == argmax(&lr)) as usize;
                    }
                    Ok(())
                })
            })?;
            r += rows;
        }
        running.push(nll.ppl());
        if reference.is_some() {
            ref_running.push(ref_nll.ppl());
        }
        on_chunk(i, nll.ppl());
    }
    let secs = t0.elapsed().as_secs_f64();
    let divergence = reference.map(|_| {
        let (mean_kld, kld_error) = kld.mean_error();
        Divergence { reference: ref_nll.report(ctx, n, ref_running, secs), mean_kld, kld_error, max_kld, same_top: same as f64 / kld.count as f64 }
    });
    Ok((nll.report(ctx, n, running, secs), divergence))
}

/// The first index of the largest value.
fn argmax(v: &[f64]) -> usize {
    v.iter().enumerate().fold((0, f64::NEG_INFINITY), |best, (i, &x)| if x > best.1 { (i, x) } else { best }).0
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
