//! Cost of one forward over T new tokens: the number that decides how large a verification tree
//! may be on a device (speculation pays only while cost(T) / cost(1) stays well below τ).
use std::time::Instant;

use crate::model::Llama;
use crate::Result;

/// Sustained DRAM read bandwidth of the development machine (2 threads), for the floor that
/// `bench` prints: a memory-bound forward cannot beat weight bytes / bandwidth.
pub const DRAM_BYTES_PER_S: f64 = 26e9;

#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchRow {
    pub tokens: usize,
    pub median_ms: f64,
    /// The fastest repetition: the least disturbed by other load on a shared machine.
    pub min_ms: f64,
    /// median_ms / median_ms at T = 1.
    pub ratio: f64,
}

/// Median time of a forward (with logits for every row, as verification needs) over `t` new
/// tokens after a `context`-token prefix, for each `t` in `token_counts`.
pub fn bench_forward(model: &Llama, context: usize, token_counts: &[usize], reps: usize) -> Result<Vec<BenchRow>> {
    let vocab = model.config().vocab_size as u32;
    let ctx: Vec<u32> = (0..context.max(1)).map(|i| (i as u32 * 7919 + 13) % vocab).collect();
    let mut cache = model.new_cache()?;
    model.forward_causal(&ctx, &mut cache)?;
    let toks: Vec<Vec<u32>> = token_counts
        .iter()
        .map(|&t| (0..t).map(|i| (i as u32 * 31 + 5) % vocab).collect())
        .collect();
    // Round-robin over the token counts, so that a machine slowing down or speeding up during the
    // run (frequent on shared hosts) shifts every count alike and leaves the ratios intact.
    let mut times = vec![Vec::with_capacity(reps); token_counts.len()];
    for r in 0..reps + 1 {
        for (toks, times) in toks.iter().zip(times.iter_mut()) {
            let t0 = Instant::now();
            let h = model.forward_causal(toks, &mut cache)?;
            let l = model.logits(&h)?;
            let _ = l.sum_all()?.to_scalar::<f32>()?;
            let dt = t0.elapsed().as_secs_f64() * 1e3;
            cache.truncate(ctx.len());
            if r > 0 {
                times.push(dt);
            }
        }
    }
    let mut rows: Vec<BenchRow> = Vec::new();
    for (&t, mut times) in token_counts.iter().zip(times) {
        times.sort_by(|a, b| a.partial_cmp(b).unwrap());
        rows.push(BenchRow { tokens: t, median_ms: times[times.len() / 2], min_ms: times[0], ratio: 0.0 });
    }
    let base = rows.iter().find(|r| r.tokens == 1).map(|r| r.median_ms).unwrap_or(rows[0].median_ms);
    for r in rows.iter_mut() {
        r.ratio = r.median_ms / base;
    }
    Ok(rows)
}
