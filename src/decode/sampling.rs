//! The distribution plain decoding draws from. Verification calls the very same functions on
//! each tree node (with that node's own path as history), which is what makes speculative
//! sampling exact rather than approximately right.
use rand::{Rng, SeedableRng};

use crate::{Error, Result};

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 disables.
    pub top_k: usize,
    /// 1 disables.
    pub top_p: f32,
    /// 0 disables.
    pub min_p: f32,
    /// 1 disables (HF convention: positive logits divided, negative multiplied).
    pub repetition_penalty: f32,
    /// Subtracted once from every token already present (OpenAI convention).
    pub presence_penalty: f32,
    /// Subtracted per occurrence.
    pub frequency_penalty: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, repetition_penalty: 1.0, presence_penalty: 0.0, frequency_penalty: 0.0 }
    }
}

pub type Rng64 = rand::rngs::StdRng;

pub fn rng(seed: u64) -> Rng64 {
    Rng64::seed_from_u64(seed)
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(m));
        if !(self.temperature >= 0.0) || !self.temperature.is_finite() {
            return bad(format!("temperature must be >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top-p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("min-p must be in [0, 1], got {}", self.min_p));
        }
        if !(self.repetition_penalty > 0.0) || !self.repetition_penalty.is_finite() {
            return bad(format!("repetition penalty must be > 0, got {}", self.repetition_penalty));
        }
        // OpenAI's range; a NaN or infinite penalty would turn every logit it touches into NaN or
        // infinity and silently change even greedy output.
        for (name, v) in [("presence", self.presence_penalty), ("frequency", self.frequency_penalty)] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(format!("{name} penalty must be in [-2, 2], got {v}"));
            }
        }
        Ok(())
    }

    /// Logits after penalties computed from `history` (the context this token would follow).
    pub fn penalised(&self, logits: &[f32], history: &[u32]) -> Vec<f32> {
        let mut l = logits.to_vec();
        if !self.has_penalties() {
            return l;
        }
        let mut counts: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
        for &t in history {
            if (t as usize) < l.len() {
                *counts.entry(t).or_default() += 1;
            }
        }
        // Sorted so the arithmetic is the same whatever the hash order.
        let mut counts: Vec<(u32, u32)> = counts.into_iter().collect();
        counts.sort_unstable();
        for (t, c) in counts {
            let x = &mut l[t as usize];
            if self.repetition_penalty != 1.0 {
                *x = if *x > 0.0 { *x / self.repetition_penalty } else { *x * self.repetition_penalty };
            }
            *x -= self.presence_penalty + self.frequency_penalty * c as f32;
        }
        l
    }

    /// The full next-token distribution (zeros where filtered) that sampling draws from.
    /// Greedy decoding is the one-hot at [`crate::cpu::reduce::argmax`] of the penalised logits.
    pub fn distribution(&self, logits: &[f32], history: &[u32]) -> Vec<f64> {
        let l = self.penalised(logits, history);
        let mut p = vec![0f64; l.len()];
        if self.is_greedy() {
            p[crate::cpu::reduce::argmax(&l) as usize] = 1.0;
            return p;
        }
        let t = self.temperature as f64;
        let max = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        exp_scaled(&l, max, t, &mut p);
        if self.top_k > 0 || self.top_p < 1.0 {
            let keep = nucleus(&p, self.top_k, self.top_p as f64);
            let mut kept = vec![false; p.len()];
            for &i in &keep {
                kept[i] = true;
            }
            for (pi, k) in p.iter_mut().zip(kept) {
                if !k {
                    *pi = 0.0;
                }
            }
        }
        if self.min_p > 0.0 {
            let pmax = p.iter().cloned().fold(0.0, f64::max);
            for pi in p.iter_mut() {
                if *pi < self.min_p as f64 * pmax {
                    *pi = 0.0;
                }
            }
        }
        let s: f64 = p.iter().sum();
        for pi in p.iter_mut() {
            *pi /= s;
        }
        p
    }

    /// Pick the next token as plain decoding does.
    pub fn choose(&self, logits: &[f32], history: &[u32], rng: &mut Rng64) -> u32 {
        if self.is_greedy() {
            if !self.has_penalties() {
                return crate::cpu::reduce::argmax(logits);
            }
            return crate::cpu::reduce::argmax(&self.penalised(logits, history));
        }
        sample_from(&self.distribution(logits, history), rng)
    }
}

/// The tokens top-k and top-p keep: in the order of descending probability (lower index first
/// on ties), the shortest prefix whose cumulative share reaches `top_p`, at most `top_k` tokens
/// (0: no limit). The same set a full sort gives, from a partial one: the best 64 are selected
/// and sorted, then the next 64, 128, ... until the share is reached, the shares summed in the
/// same order (same bits). A full sort of SmolLM2's 49,152 entries took most of a sampled
/// token's time outside the forward (writing prompts with `--top-p 0.95` one at a time ran at
/// 110 tok/s against 264 with this; measured on the Xeon).
fn nucleus(p: &[f64], top_k: usize, top_p: f64) -> Vec<usize> {
    let n = p.len();
    let limit = if top_k > 0 { top_k.min(n) } else { n };
    let cmp = |a: &usize, b: &usize| p[*b].partial_cmp(&p[*a]).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(b));
    let total: f64 = if top_p < 1.0 { p.iter().sum() } else { 0.0 };
    let mut order: Vec<usize> = (0..n).collect();
    // order[..done] is the sorted best `done`; cum their summed shares.
    let (mut done, mut cum) = (0, 0.0);
    let mut m = if top_p < 1.0 { 64.min(limit) } else { limit };
    while done < limit {
        let rest = &mut order[done..];
        if m - done < rest.len() {
            rest.select_nth_unstable_by(m - done - 1, cmp);
        }
        rest[..m - done].sort_unstable_by(cmp);
        if top_p < 1.0 {
            for i in done..m {
                cum += p[order[i]] / total;
                if cum >= top_p {
                    order.truncate(i + 1);
                    return order;
                }
            }
        }
        done = m;
        m = (m * 2).min(limit);
    }
    order.truncate(limit);
    order
}

/// `p[i] = exp((l[i] - max) / t)` for the softmax. libm's `exp`, one call per vocabulary entry,
/// was most of a sampled token's cost outside the forward (0.4 ms of 4 ms for SmolLM2's 49,152
/// entries); [`exp_nonpositive_f64`] is branch-free, so this loop vectorises, 8 lanes with AVX-512.
/// Plain and speculative sampling share this function, so both draw from the same distribution.
fn exp_scaled(l: &[f32], max: f64, t: f64, p: &mut [f64]) {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::isa::isa() == crate::cpu::isa::Isa::Avx512 {
        // SAFETY: the feature was just detected.
        unsafe { exp_scaled_avx512(l, max, t, p) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::isa::has_avx2() {
        // SAFETY: the features were just detected.
        unsafe { exp_scaled_avx2(l, max, t, p) };
        return;
    }
    exp_scaled_generic(l, max, t, p);
}

/// Without FMA compiled in, each `mul_add` above is a libm call (15 per entry: about 4 ms of a
/// sampled token on an AVX2 CPU); with it, four lanes and the same bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_scaled_avx2(l: &[f32], max: f64, t: f64, p: &mut [f64]) {
    exp_scaled_generic(l, max, t, p);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_scaled_avx512(l: &[f32], max: f64, t: f64, p: &mut [f64]) {
    exp_scaled_generic(l, max, t, p);
}

#[inline(always)]
fn exp_scaled_generic(l: &[f32], max: f64, t: f64, p: &mut [f64]) {
    for (pi, &x) in p.iter_mut().zip(l) {
        *pi = exp_nonpositive_f64((x as f64 - max) / t);
    }
}

/// `e^x` for `x <= 0` (NaN-free input), within a few ulps of libm's; values below -708, where
/// the result would be subnormal, give 0. Cody–Waite reduction `x = k ln2 + r`, |r| <= ln2/2,
/// a degree-13 Taylor polynomial for `e^r` (truncation error below 1e-17), and `2^k` built from
/// the bits of the rounding constant, all without branches or calls. The f32 sibling in
/// `kernels` (attention's softmax) is the same method at f32 precision; sampling keeps f64 so
/// the distribution's tiny probabilities keep their digits.
#[inline(always)]
pub fn exp_nonpositive_f64(x: f64) -> f64 {
    const LN2_HI: f64 = 6.931_471_803_691_238_164_90e-1;
    const LN2_LO: f64 = 1.908_214_929_270_587_700_02e-10;
    const INV_LN2: f64 = std::f64::consts::LOG2_E;
    // 1.5 * 2^52: adding it rounds to an integer, kept in the low mantissa bits.
    const ROUND: f64 = 6_755_399_441_055_744.0;
    let under = x < -708.0;
    let x = x.max(-708.0);
    let kr = x.mul_add(INV_LN2, ROUND);
    let k = kr - ROUND;
    let r = (-k).mul_add(LN2_LO, (-k).mul_add(LN2_HI, x));
    let mut poly: f64 = 1.0 / 6_227_020_800.0; // 1/13!
    for d in [479_001_600.0f64, 39_916_800.0, 3_628_800.0, 362_880.0, 40_320.0, 5_040.0, 720.0, 120.0, 24.0, 6.0, 2.0, 1.0, 1.0] {
        poly = poly.mul_add(r, 1.0 / d);
    }
    // k + 1023 in the exponent field (k >= -1022 here, so the field is in 1..=1023).
    let scale = f64::from_bits((kr.to_bits().wrapping_add(1023)) << 52);
    if under { 0.0 } else { poly * scale }
}

/// The most alternatives [`token_logprobs`] lists (OpenAI's and vLLM's default cap for
/// `top_logprobs`).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A chosen token's log-probability under the target, and the likeliest tokens at its position.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    /// The `top` likeliest tokens, best first (ties: lower id first).
    pub top: Vec<(u32, f32)>,
}

/// Log-probabilities of one logits row: `token`'s, and the `top` best (at most
/// [`MAX_TOP_LOGPROBS`]). They are the model's own distribution, the raw logits' log-softmax,
/// before temperature, penalties or truncation (what vLLM reports by default), so a token
/// sampled at a high temperature still shows how likely the model found it. Computed in f64
/// from the row's bits: a row that is bit-identical with and without speculation (the verified
/// rows are) gives identical log-probabilities.
pub fn token_logprobs(logits: &[f32], token: u32, top: usize) -> TokenLogprobs {
    let log_z = log_z(logits);
    // NaN (a NaN logit, or a row of -inf, or one with +inf) reads as "ruled out".
    let lp = |x: f32| match x as f64 - log_z {
        v if v.is_nan() => f32::NEG_INFINITY,
        v => v as f32,
    };
    let logprob = logits.get(token as usize).map_or(f32::NEG_INFINITY, |&x| lp(x));
    let k = top.min(MAX_TOP_LOGPROBS).min(logits.len());
    // The k best by a running insertion (k <= 20): one pass over the row, no sort of it.
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    if k > 0 {
        for (i, &x) in logits.iter().enumerate() {
            if x.is_nan() || (best.len() == k && x <= best[k - 1].1) {
                continue;
            }
            let at = best.partition_point(|&(_, y)| y >= x);
            best.insert(at, (i as u32, x));
            best.truncate(k);
        }
    }
    TokenLogprobs { token, logprob, top: best.into_iter().map(|(i, x)| (i, lp(x))).collect() }
}

/// The raw log-softmax of a logits row into `out` (f64; -inf where a logit is -inf): what
/// [`token_logprobs`] reads for one token, for every token (a divergence between two
/// distributions needs them all).
pub fn log_softmax_into(logits: &[f32], out: &mut Vec<f64>) {
    out.clear();
    out.resize(logits.len(), f64::NEG_INFINITY);
    let log_z = log_z(logits);
    if log_z == f64::NEG_INFINITY {
        return;
    }
    for (o, &x) in out.iter_mut().zip(logits) {
        *o = x as f64 - log_z;
    }
}

/// `ln(sum(exp(l[i])))`, shifted by the largest logit; -inf for a row of -inf. What
/// [`token_logprobs`] and [`log_softmax_into`] subtract.
fn log_z(logits: &[f32]) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    if max == f64::NEG_INFINITY {
        return f64::NEG_INFINITY;
    }
    max + exp_sum(logits, max).ln()
}

/// `sum(exp(l[i] - max))`, through [`exp_scaled`]'s vectorised loop a block at a time: a scalar
/// loop of libm `fma` calls took 1.8 ms a token for SmolLM2's 49,152 logits.
fn exp_sum(l: &[f32], max: f64) -> f64 {
    let mut buf = [0f64; 512];
    let mut acc = [0f64; 8];
    for c in l.chunks(buf.len()) {
        let p = &mut buf[..c.len()];
        exp_scaled(c, max, 1.0, p);
        for (i, &x) in p.iter().enumerate() {
            acc[i % 8] += x;
        }
    }
    acc.iter().sum()
}

/// Inverse-CDF draw from a (not necessarily normalised) distribution.
pub fn sample_from(p: &[f64], rng: &mut Rng64) -> u32 {
    let total: f64 = p.iter().sum();
    let u: f64 = rng.random::<f64>() * total;
    let mut cum = 0.0;
    let mut last_nonzero = 0;
    for (i, &x) in p.iter().enumerate() {
        if x > 0.0 {
            last_nonzero = i;
            cum += x;
            if u < cum {
                return i as u32;
            }
        }
    }
    last_nonzero as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_matches_token_logprobs_for_every_token() {
        let logits = [1.0f32, 3.0, -2.0, f32::NEG_INFINITY, 0.5];
        let mut out = Vec::new();
        log_softmax_into(&logits, &mut out);
        for (i, &x) in out.iter().enumerate() {
            assert!((x as f32 - token_logprobs(&logits, i as u32, 0).logprob).abs() < 1e-6 || (x == f64::NEG_INFINITY && i == 3), "{i}: {x}");
        }
        assert!((out.iter().map(|x| x.exp()).sum::<f64>() - 1.0).abs() < 1e-12);
    }

    #[test]
    fn logprobs_are_the_raw_log_softmax_with_the_best_first() {
        let logits = [1.0f32, 3.0, -2.0, 3.0, 0.5];
        let z: f64 = logits.iter().map(|&x| (x as f64).exp()).sum();
        let want = |i: usize| ((logits[i] as f64).exp() / z).ln() as f32;
        let l = token_logprobs(&logits, 4, 3);
        assert_eq!(l.token, 4);
        assert!((l.logprob - want(4)).abs() < 1e-6, "{} vs {}", l.logprob, want(4));
        // Ties keep the lower id first.
        assert_eq!(l.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 3, 0]);
        for &(i, x) in &l.top {
            assert!((x - want(i as usize)).abs() < 1e-6);
        }
        let total: f64 = logits.iter().enumerate().map(|(i, _)| (token_logprobs(&logits, i as u32, 0).logprob as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
        // No alternatives asked for, more than the row has, past the cap; a token out of range.
        assert!(token_logprobs(&logits, 1, 0).top.is_empty());
        assert_eq!(token_logprobs(&logits, 1, 99).top.len(), 5);
        assert_eq!(token_logprobs(&vec![0.0; 100], 1, 99).top.len(), MAX_TOP_LOGPROBS);
        assert_eq!(token_logprobs(&logits, 9, 0).logprob, f32::NEG_INFINITY);
        // A masked token (-inf) has log-probability -inf; the rest stay normalised.
        let masked = [0.0f32, f32::NEG_INFINITY];
        assert_eq!(token_logprobs(&masked, 1, 2).top, vec![(0, 0.0), (1, f32::NEG_INFINITY)]);
    }

    /// The partial selection keeps exactly the set a full sort keeps, ties and all.
    #[test]
    fn nucleus_matches_a_full_sort() {
        let full = |p: &[f64], top_k: usize, top_p: f64| -> Vec<usize> {
            let mut order: Vec<usize> = (0..p.len()).collect();
            order.sort_by(|&a, &b| p[b].partial_cmp(&p[a]).unwrap().then(a.cmp(&b)));
            let mut keep = if top_k > 0 { top_k.min(p.len()) } else { p.len() };
            if top_p < 1.0 {
                let total: f64 = p.iter().sum();
                let mut cum = 0.0;
                for (i, &idx) in order.iter().enumerate().take(keep) {
                    cum += p[idx] / total;
                    if cum >= top_p {
                        keep = i + 1;
                        break;
                    }
                }
            }
            order.truncate(keep);
            order
        };
        let mut r = rng(5);
        for case in 0..60 {
            let n = [1, 3, 70, 500, 5000][case % 5];
            // Peaked, flat and tied distributions.
            let p: Vec<f64> = (0..n)
                .map(|i| match case % 3 {
                    0 => (-(r.random::<f64>() * 12.0)).exp(),
                    1 => 1.0 + r.random::<f64>() * 1e-3,
                    _ => ((i % 7) as f64 + 1.0) / 7.0,
                })
                .collect();
            for (k, tp) in [(0, 0.5), (0, 0.95), (0, 0.999), (10, 1.0), (100, 0.9), (3, 0.2), (0, 0.0)] {
                assert_eq!(nucleus(&p, k, tp), full(&p, k, tp), "case {case}, n {n}, top_k {k}, top_p {tp}");
            }
        }
    }

    #[test]
    fn penalties_must_be_finite_and_in_range() {
        for bad in [f32::NAN, f32::INFINITY, -3.0, 2.5] {
            let p = SamplingParams { presence_penalty: bad, ..Default::default() };
            assert!(p.validate().unwrap_err().to_string().contains("presence penalty"), "{bad}");
            let p = SamplingParams { frequency_penalty: bad, ..Default::default() };
            assert!(p.validate().unwrap_err().to_string().contains("frequency penalty"), "{bad}");
        }
        let ok = SamplingParams { presence_penalty: -2.0, frequency_penalty: 2.0, ..Default::default() };
        assert!(ok.validate().is_ok());
    }

    #[test]
    fn filters_and_penalties() {
        let logits = [1.0f32, 2.0, 3.0, 0.5];
        let p = SamplingParams { temperature: 1.0, top_k: 2, ..Default::default() }.distribution(&logits, &[]);
        assert_eq!(p[0], 0.0);
        assert!((p[1] + p[2] - 1.0).abs() < 1e-12 && p[2] > p[1]);
        let g = SamplingParams::greedy();
        assert_eq!(g.choose(&logits, &[], &mut rng(0)), 2);
        let rp = SamplingParams { repetition_penalty: 10.0, ..Default::default() };
        assert_eq!(rp.choose(&logits, &[2], &mut rng(0)), 1);
        let tp = SamplingParams { temperature: 1.0, top_p: 0.5, ..Default::default() }.distribution(&logits, &[]);
        assert_eq!(tp.iter().filter(|&&x| x > 0.0).count(), 1);
        let mp = SamplingParams { temperature: 1.0, min_p: 0.3, ..Default::default() }.distribution(&logits, &[]);
        assert_eq!(mp.iter().filter(|&&x| x > 0.0).count(), 2);
        assert!(SamplingParams { temperature: -1.0, ..Default::default() }.validate().is_err());
        assert!(SamplingParams { top_p: 0.0, ..Default::default() }.validate().is_err());
    }

    #[test]
    fn fast_exp_matches_libm() {
        let mut worst = 0f64;
        for i in 0..200_000 {
            let x = -(i as f64) * 0.003_7 - (i % 7) as f64 * 1e-9;
            let (a, b) = (exp_nonpositive_f64(x), x.exp());
            if x >= -708.0 {
                worst = worst.max(((a - b) / b).abs());
            } else {
                assert_eq!(a, 0.0, "{x}");
            }
        }
        assert!(worst < 1e-15, "worst relative error {worst}");
        assert_eq!(exp_nonpositive_f64(0.0), 1.0);
        assert_eq!(exp_nonpositive_f64(-1e300), 0.0);
        assert_eq!(exp_nonpositive_f64(f64::NEG_INFINITY), 0.0);
    }

    #[test]
    fn sample_from_follows_distribution() {
        let p = [0.25, 0.0, 0.75];
        let mut r = rng(7);
        let n = 20000;
        let twos = (0..n).filter(|_| sample_from(&p, &mut r) == 2).count();
        assert!((twos as f64 / n as f64 - 0.75).abs() < 0.02);
        assert!((0..1000).all(|_| sample_from(&p, &mut r) != 1));
    }
}
