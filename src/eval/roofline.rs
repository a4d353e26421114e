//! This machine's roofline: how fast it can read memory and how fast it can multiply, measured,
//! so that `bench` can say how close each forward is to the best this hardware allows.
//!
//! Why: the cost of a forward over T tokens has two floors, the weight bytes over the read
//! bandwidth (the same for every T) and T times the multiply-adds over the arithmetic peak. The
//! second decides how flat the cost curve can be, and it differs several times over between
//! CPUs: a 2-core Zen 3 (AVX2, no AVX-512) does about half the f32 multiply-adds of a 2-core
//! Xeon with AVX-512 (90-103 against about 210 GMAC/s) and a quarter of its 8-bit ones (it has no
//! 8-bit dot-product instruction). A flat-curve target
//! written for one machine can be out of reach on another by arithmetic alone; this module puts a
//! number on that instead of a guess. Every figure is the best of a few runs on all of the team's
//! threads: the least disturbed one, so the floors it gives are the most optimistic.
use std::time::Instant;

use crate::model::{Config, Llama};
use crate::cpu::quant::WeightFormat;

/// Bytes the DRAM bandwidth test reads: larger than any last-level cache we have met (the Xeons
/// measured here have 260 and 480 MB of L3), so the reads come from DRAM.
pub const READ_BYTES: usize = 1 << 30;

/// How much faster than DRAM a working set must read to count as cached: beyond the spread of
/// the bandwidth test where no cache holds the buffer (192 MB to 1 GiB on the 2-core Xeon with a
/// 260 MB L3: 22.6-26.5 GB/s across runs, 1.17 times apart at most), short of what cached sets
/// read (SmolLM2's 102 MB there: 1.55-2.3 times the same call's DRAM figure).
pub const IN_CACHE_MARGIN: f64 = 1.3;

/// Measured peaks of this machine, all threads together.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Roofline {
    /// Sustained read bandwidth from DRAM ([`READ_BYTES`] read over and over), bytes per second.
    pub read_bytes_per_s: f64,
    /// The bytes one forward reads (weights and KV cache), which the second bandwidth test reads
    /// over and over: 0 when only DRAM was measured.
    pub working_set_bytes: usize,
    /// Read bandwidth over a buffer of `working_set_bytes`, bytes per second. Why a second test:
    /// a model that fits in the last-level cache streams its weights from there on every forward
    /// after the first. SmolLM2's 96 MB of 4-bit weights on a 2-core Xeon with a 260 MB L3 read
    /// at 47-57 GB/s against 23-26 GB/s from DRAM, so a DRAM floor put one-token forwards at
    /// 124% of it: a floor a forward beats is no floor.
    pub working_set_read_bytes_per_s: f64,
    /// f32 multiply-adds per second (fused multiply-add instructions, widest vectors).
    pub f32_macs_per_s: f64,
    /// 8-bit multiply-adds per second with the densest instruction the integer kernels use
    /// (`vpdpbusd` with AVX-512 VNNI; `vpmaddubsw` plus the add that accumulates it with AVX2).
    pub int8_macs_per_s: f64,
    /// Which instructions the arithmetic peaks used.
    pub isa: &'static str,
    pub threads: usize,
}

/// What one forward must do whatever its kernels: the bytes it reads and the multiply-adds it does.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct ForwardWork {
    /// The weights, and the KV cache the new rows attend over.
    pub bytes: usize,
    /// The weight matrices' multiply-adds, in the weight format's arithmetic.
    pub matmul_macs: usize,
    /// Attention's query-key and probability-value multiply-adds, f32 in every format. At a
    /// 256-token context they are 6% of SmolLM2's matmuls per row; at 2048, half.
    pub attention_macs: usize,
}

impl ForwardWork {
    /// A causal forward of `tokens` new tokens after `context` cached ones, with `weight_bytes`
    /// of weights and a KV cache of `kv_elem_bytes` per value.
    pub fn causal(cfg: &Config, weight_bytes: usize, kv_elem_bytes: usize, context: usize, tokens: usize) -> Self {
        let kv_width = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim;
        // New row i attends to the context and to rows 0..=i.
        let keys = tokens * context + tokens * (tokens + 1) / 2;
        ForwardWork {
            bytes: weight_bytes + kv_width * (context + tokens) * kv_elem_bytes,
            matmul_macs: tokens * cfg.matmul_macs_per_token(),
            attention_macs: 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * keys,
        }
    }
}

/// The floor of a forward doing `work` on this machine, in ms: it can beat neither its read nor
/// its arithmetic (the floor assumes it overlaps them perfectly). `weights_macs_per_s` is the
/// weight format's peak ([`Roofline::macs_per_s`]); `None` counts no time for the matmuls.
pub fn floor_ms(work: &ForwardWork, read_bytes_per_s: f64, weights_macs_per_s: Option<f64>, f32_macs_per_s: f64) -> f64 {
    let read = work.bytes as f64 / read_bytes_per_s;
    let arith = weights_macs_per_s.map_or(0.0, |p| work.matmul_macs as f64 / p) + work.attention_macs as f64 / f32_macs_per_s;
    read.max(arith) * 1e3
}

impl Roofline {
    /// Measure this machine's read bandwidth from DRAM (about a second, and [`READ_BYTES`] of
    /// memory for the moment), its arithmetic peaks, and the read bandwidth over `working_set`
    /// bytes (a buffer of that size for the moment, read [`READ_BYTES`] / `working_set` times,
    /// 8 to 64; the first pass warms the cache and the best pass counts), so a working set that
    /// fits in the last-level cache gets the floor it really has. 0, or more than [`READ_BYTES`] (no cache
    /// holds it, and a second copy of an 8B model's 4.5 GB could exhaust the memory the model
    /// left), skips the second test: the floors then use DRAM's bandwidth.
    pub fn measure_for(working_set: usize) -> Self {
        Self::measure_sized(READ_BYTES, working_set)
    }

    /// [`Roofline::measure_for`] with a DRAM test of `dram_bytes` (which also caps the working
    /// sets measured): the tests' small sizes.
    fn measure_sized(dram_bytes: usize, working_set: usize) -> Self {
        let threads = crate::cpu::team::threads();
        let dram = read_bandwidth(dram_bytes, 6);
        let working_set = if working_set > dram_bytes { 0 } else { working_set };
        let cached = if working_set == 0 { 0.0 } else { read_bandwidth(working_set, (dram_bytes / working_set).clamp(8, 64)) };
        Roofline {
            read_bytes_per_s: dram,
            working_set_bytes: working_set,
            working_set_read_bytes_per_s: cached,
            f32_macs_per_s: f32_fma_peak(),
            int8_macs_per_s: int8_dot_peak(),
            isa: isa_name(),
            threads,
        }
    }

    /// The bytes `model`'s one-token forward reads after `context` cached tokens: the working set
    /// to pass to [`Roofline::measure_for`].
    pub fn working_set(model: &Llama, context: usize) -> usize {
        ForwardWork::causal(model.config(), model.weight_bytes_per_forward(), model.kv_dtype().size_in_bytes(), context, 1).bytes
    }

    /// Whether the working set read clearly faster than DRAM ([`IN_CACHE_MARGIN`]): it fits in
    /// a cache, and the floors use its bandwidth.
    pub fn working_set_in_cache(&self) -> bool {
        self.working_set_read_bytes_per_s > IN_CACHE_MARGIN * self.read_bytes_per_s
    }

    /// The read bandwidth the floors use: the working set's where it is in cache, else DRAM's
    /// (so two noisy figures for the same DRAM reads do not pick the luckier one).
    pub fn forward_read_bytes_per_s(&self) -> f64 {
        if self.working_set_in_cache() {
            self.working_set_read_bytes_per_s
        } else {
            self.read_bytes_per_s
        }
    }

    /// The floor of `model`'s forward over each of `tokens` new tokens after `context` cached
    /// ones, in its present weight format and KV cache type, as `bench` times them.
    pub fn floors_ms(&self, model: &Llama, context: usize, tokens: &[usize]) -> Vec<f64> {
        let (bytes, kv) = (model.weight_bytes_per_forward(), model.kv_dtype().size_in_bytes());
        let peak = self.macs_per_s(model.weight_format());
        let bw = self.forward_read_bytes_per_s();
        tokens.iter().map(|&t| floor_ms(&ForwardWork::causal(model.config(), bytes, kv, context, t), bw, peak, self.f32_macs_per_s)).collect()
    }

    /// The arithmetic peak a weight format's kernels are bound by. bf16 on AMX tiles has none
    /// worth stating at these sizes (its tiles do 16 rows in the time of one), so it has none.
    pub fn macs_per_s(&self, format: WeightFormat) -> Option<f64> {
        match format {
            WeightFormat::F32 | WeightFormat::F16 => Some(self.f32_macs_per_s),
            WeightFormat::Bf16 if crate::cpu::isa::amx_available() => None,
            WeightFormat::Bf16 => Some(self.f32_macs_per_s),
            WeightFormat::Q8_0 | WeightFormat::Native => Some(self.int8_macs_per_s),
        }
    }
}

fn isa_name() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::cpu::isa::vnni() {
            return "AVX-512 FMA, AVX-512 VNNI";
        }
        if crate::cpu::isa::isa() == crate::cpu::isa::Isa::Avx512 {
            return "AVX-512 FMA, AVX2 int8";
        }
        if crate::cpu::isa::has_avx2() {
            return "AVX2 FMA, AVX2 int8 (no VNNI)";
        }
    }
    "portable"
}

/// Read `bytes` of memory on every thread at once (each a contiguous share), best of `passes`:
/// bytes per second.
pub fn read_bandwidth(bytes: usize, passes: usize) -> f64 {
    let words = (bytes / 8).max(1);
    // Written once so every page is really mapped (an untouched page reads as the zero page,
    // from cache).
    let buf = vec![1u64; words];
    let tasks = crate::cpu::team::threads() * 4;
    let per = words.div_ceil(tasks);
    let sums: Vec<std::sync::atomic::AtomicU64> = (0..tasks).map(|_| Default::default()).collect();
    let mut best = f64::INFINITY;
    for _ in 0..passes.max(1) {
        let t0 = Instant::now();
        crate::cpu::team::run(tasks, &|t| {
            let chunk = &buf[(t * per).min(words)..((t + 1) * per).min(words)];
            sums[t].store(sum_words_widest(chunk), std::sync::atomic::Ordering::Relaxed);
        });
        best = best.min(t0.elapsed().as_secs_f64());
    }
    let total: u64 = sums.iter().map(|s| s.load(std::sync::atomic::Ordering::Relaxed)).fold(0, u64::wrapping_add);
    std::hint::black_box(total);
    (words * 8) as f64 / best
}

/// [`sum_words`] compiled for AVX2 where the CPU has it: 32-byte loads read DRAM a few per cent
/// faster than 16-byte ones on the Zen 3 (35-36 against 32 GB/s), near what the f32 forward's
/// own one-token stream reaches.
fn sum_words_widest(xs: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        unsafe fn avx2(xs: &[u64]) -> u64 {
            sum_words(xs)
        }
        if is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 is present.
            return unsafe { avx2(xs) };
        }
    }
    sum_words(xs)
}

/// Wrapping sum in 8 lanes: integer adds may be reordered, so the compiler vectorises it, and
/// the loads, not the adds, are what takes the time.
fn sum_words(xs: &[u64]) -> u64 {
    let mut lanes = [0u64; 8];
    let mut it = xs.chunks_exact(8);
    for c in &mut it {
        for (l, v) in lanes.iter_mut().zip(c) {
            *l = l.wrapping_add(*v);
        }
    }
    let rest = it.remainder().iter().fold(0u64, |a, &v| a.wrapping_add(v));
    lanes.iter().fold(rest, |a, &v| a.wrapping_add(v))
}

/// Iterations of each arithmetic test per thread: about 10-50 ms on the machines measured.
const ARITH_ITERS: usize = 4_000_000;

/// Best of 3 runs of `f(iters)` on every thread at once; `f` returns the multiply-adds it did.
fn peak(f: &(dyn Fn(usize) -> f64 + Sync)) -> f64 {
    let threads = crate::cpu::team::threads();
    let done: Vec<std::sync::atomic::AtomicU64> = (0..threads).map(|_| Default::default()).collect();
    let mut best = 0f64;
    for _ in 0..3 {
        let t0 = Instant::now();
        crate::cpu::team::run(threads, &|t| done[t].store(f(ARITH_ITERS).to_bits(), std::sync::atomic::Ordering::Relaxed));
        let secs = t0.elapsed().as_secs_f64();
        let macs: f64 = done.iter().map(|d| f64::from_bits(d.load(std::sync::atomic::Ordering::Relaxed))).sum();
        best = best.max(macs / secs);
    }
    best
}

/// f32 multiply-adds per second on all threads: 12 independent FMA chains (more than latency x
/// ports on any core we know), the widest vectors the CPU has.
pub fn f32_fma_peak() -> f64 {
    peak(&|iters| {
        #[cfg(target_arch = "x86_64")]
        {
            if crate::cpu::isa::isa() == crate::cpu::isa::Isa::Avx512 {
                // SAFETY: AVX-512F is present.
                return unsafe { x86::fma512(iters, 0.5) };
            }
            if crate::cpu::isa::has_avx2() {
                // SAFETY: AVX2 and FMA are present.
                return unsafe { x86::fma256(iters, 0.5) };
            }
        }
        fma_portable(iters, 0.5)
    })
}

/// 8-bit multiply-adds per second on all threads, with the instructions the integer kernels are
/// built from (see [`Roofline::int8_macs_per_s`]).
pub fn int8_dot_peak() -> f64 {
    peak(&|iters| {
        #[cfg(target_arch = "x86_64")]
        {
            if crate::cpu::isa::vnni() {
                // SAFETY: AVX-512F, BW and VNNI are present.
                return unsafe { x86::dpbusd512(iters, 3) };
            }
            if crate::cpu::isa::has_avx2() {
                // SAFETY: AVX2 is present.
                return unsafe { x86::maddubs256(iters, 3) };
            }
        }
        dot_portable(iters, 3)
    })
}

const CHAINS: usize = 12;

fn fma_portable(iters: usize, seed: f32) -> f64 {
    let mut a = [std::hint::black_box(seed); CHAINS];
    let (b, c) = (std::hint::black_box(0.999_9f32), std::hint::black_box(1e-6f32));
    for _ in 0..iters {
        for x in a.iter_mut() {
            *x = x.mul_add(b, c);
        }
    }
    std::hint::black_box(a);
    (iters * CHAINS) as f64
}

fn dot_portable(iters: usize, seed: i32) -> f64 {
    let mut a = [std::hint::black_box(seed); CHAINS];
    let u = std::hint::black_box(7i32);
    for i in 0..iters {
        for (j, x) in a.iter_mut().enumerate() {
            *x = x.wrapping_add((i as i32 ^ j as i32).wrapping_mul(u));
        }
    }
    std::hint::black_box(a);
    (iters * CHAINS) as f64
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::CHAINS;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma256(iters: usize, seed: f32) -> f64 {
        let b = _mm256_set1_ps(std::hint::black_box(0.999_9));
        let c = _mm256_set1_ps(std::hint::black_box(1e-6));
        let mut a = [_mm256_set1_ps(std::hint::black_box(seed)); CHAINS];
        for _ in 0..iters {
            for x in a.iter_mut() {
                *x = _mm256_fmadd_ps(*x, b, c);
            }
        }
        std::hint::black_box(a);
        (iters * CHAINS * 8) as f64
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma512(iters: usize, seed: f32) -> f64 {
        let b = _mm512_set1_ps(std::hint::black_box(0.999_9));
        let c = _mm512_set1_ps(std::hint::black_box(1e-6));
        let mut a = [_mm512_set1_ps(std::hint::black_box(seed)); CHAINS];
        for _ in 0..iters {
            for x in a.iter_mut() {
                *x = _mm512_fmadd_ps(*x, b, c);
            }
        }
        std::hint::black_box(a);
        (iters * CHAINS * 16) as f64
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn dpbusd512(iters: usize, seed: i8) -> f64 {
        let u = _mm512_set1_epi8(std::hint::black_box(seed));
        let s = _mm512_set1_epi8(std::hint::black_box(-5));
        let mut a = [_mm512_setzero_si512(); CHAINS];
        for _ in 0..iters {
            for x in a.iter_mut() {
                *x = _mm512_dpbusd_epi32(*x, u, s);
            }
        }
        std::hint::black_box(a);
        (iters * CHAINS * 64) as f64
    }

    /// AVX2 has no 8-bit multiply that accumulates: each `vpmaddubsw` (32 multiply-adds into 16
    /// pairs) needs an add to accumulate it, as in the integer kernels. Eight products per
    /// iteration, each of its own (activation, weight) pair so none is computed once for all;
    /// the activation moves once per iteration so none can be hoisted out of the loop.
    #[target_feature(enable = "avx2")]
    pub unsafe fn maddubs256(iters: usize, seed: i8) -> f64 {
        const PAIRS: usize = 8;
        let w: [__m256i; PAIRS] = std::hint::black_box(std::array::from_fn(|j| _mm256_set1_epi8(j as i8 * 3 - 11)));
        let step = _mm256_set1_epi8(std::hint::black_box(1));
        let mut u = _mm256_set1_epi8(std::hint::black_box(seed));
        let mut a = [_mm256_setzero_si256(); PAIRS];
        for _ in 0..iters {
            u = _mm256_add_epi8(u, step);
            for (x, w) in a.iter_mut().zip(&w) {
                *x = _mm256_add_epi16(*x, _mm256_maddubs_epi16(u, *w));
            }
        }
        std::hint::black_box(a);
        (iters * PAIRS * 32) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floor_is_the_slower_of_reading_and_arithmetic() {
        let work = |tokens: usize| ForwardWork { bytes: 1_000_000_000, matmul_macs: tokens * 1_000_000_000, attention_macs: tokens * 100_000_000 };
        // 1 GB at 10 GB/s = 100 ms; per token 1e9 weight multiply-adds at 1e11/s = 10 ms and
        // 1e8 attention ones at 1e10/s = 10 ms.
        assert!((floor_ms(&work(1), 1e10, Some(1e11), 1e10) - 100.0).abs() < 1e-9);
        assert!((floor_ms(&work(16), 1e10, Some(1e11), 1e10) - 320.0).abs() < 1e-9);
        // No peak for the weights' arithmetic (AMX): attention alone, 160 ms.
        assert!((floor_ms(&work(16), 1e10, None, 1e10) - 160.0).abs() < 1e-9);
    }

    #[test]
    fn causal_work_counts_weights_cache_and_attention() {
        let cfg = crate::model::fixtures::tiny_config();
        let (l, kvw) = (cfg.num_layers, 2 * cfg.num_kv_heads * cfg.head_dim);
        let w = ForwardWork::causal(&cfg, 1000, 2, 10, 3);
        assert_eq!(w.bytes, 1000 + l * kvw * 13 * 2);
        assert_eq!(w.matmul_macs, 3 * cfg.matmul_macs_per_token());
        // Rows see 11, 12 and 13 keys.
        assert_eq!(w.attention_macs, 2 * l * cfg.num_heads * cfg.head_dim * (11 + 12 + 13));
    }

    #[test]
    fn sum_words_counts_every_word() {
        let xs: Vec<u64> = (1..=1001).collect();
        assert_eq!(sum_words(&xs), 1001 * 1002 / 2);
        assert_eq!(sum_words(&[]), 0);
        assert_eq!(sum_words_widest(&xs), 1001 * 1002 / 2);
    }

    #[test]
    fn measured_peaks_are_positive_and_ordered() {
        // Small sizes: this checks the plumbing, not the machine.
        let bw = read_bandwidth(1 << 20, 2);
        assert!(bw.is_finite() && bw > 1e8, "{bw}");
        let r = Roofline::measure_sized(1 << 20, 1 << 19);
        assert_eq!(r.working_set_bytes, 1 << 19);
        assert!(r.working_set_read_bytes_per_s > 1e8 && r.forward_read_bytes_per_s() >= r.read_bytes_per_s);
        // Larger than the DRAM test (than any cache): not measured, nothing allocated for it.
        let r = Roofline::measure_sized(1 << 20, (1 << 20) + 1);
        assert_eq!((r.working_set_bytes, r.working_set_read_bytes_per_s), (0, 0.0));
        assert_eq!(r.forward_read_bytes_per_s(), r.read_bytes_per_s);
        let f = f32_fma_peak();
        let i = int8_dot_peak();
        assert!(f.is_finite() && f > 1e8, "{f}");
        assert!(i.is_finite() && i > 1e8, "{i}");
        // Every vector unit we know multiplies more 8-bit pairs than f32 pairs per second.
        if isa_name() != "portable" {
            assert!(i > f, "int8 {i} vs f32 {f}");
        }
    }

    #[test]
    fn model_floors_follow_its_format_and_context() -> crate::Result<()> {
        use candle_core::{DType, Device};
        let cfg = crate::model::fixtures::tiny_config();
        let vb = candle_nn::VarBuilder::from_tensors(crate::model::fixtures::random_weights(&cfg, 5)?, DType::F32, &Device::Cpu);
        let mut model = Llama::load(vb, &cfg)?;
        let mut r = Roofline { read_bytes_per_s: 1e6, working_set_bytes: 0, working_set_read_bytes_per_s: 0.0, f32_macs_per_s: 1e15, int8_macs_per_s: 1e15, isa: "test", threads: 1 };
        // Bound by reading: the weights and the cache, in this format's bytes.
        let kv_elem = model.kv_dtype().size_in_bytes();
        let kv = |context: usize, t: usize| cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * (context + t) * kv_elem;
        let f = r.floors_ms(&model, 16, &[1, 4]);
        assert!((f[0] - (model.weight_bytes_per_forward() + kv(16, 1)) as f64 / 1e3).abs() < 1e-9, "{f:?}");
        assert!(f[1] > f[0]);
        let f32_bytes = model.weight_bytes_per_forward();
        model.set_weights(WeightFormat::Q8_0, &crate::model::NativeWeights::new())?;
        assert!(model.weight_bytes_per_forward() < f32_bytes);
        let one = (model.weight_bytes_per_forward() + kv(16, 1)) as f64;
        assert!((r.floors_ms(&model, 16, &[1])[0] - one / 1e3).abs() < 1e-9);
        assert_eq!(Roofline::working_set(&model, 16), one as usize);
        // A working set read clearly faster than DRAM (it fits in cache) lowers the floor; one
        // within the noise of DRAM's figure, or slower, leaves DRAM's.
        r.working_set_read_bytes_per_s = 4e6;
        assert!(r.working_set_in_cache());
        assert!((r.floors_ms(&model, 16, &[1])[0] - one / 4e3).abs() < 1e-9);
        for within_noise in [0.5e6, 1.1e6, 1.25e6] {
            r.working_set_read_bytes_per_s = within_noise;
            assert!(!r.working_set_in_cache());
            assert!((r.floors_ms(&model, 16, &[1])[0] - one / 1e3).abs() < 1e-9);
        }
        Ok(())
    }

    #[test]
    fn formats_map_to_their_arithmetic() {
        let r = Roofline { read_bytes_per_s: 1e10, working_set_bytes: 0, working_set_read_bytes_per_s: 0.0, f32_macs_per_s: 1e11, int8_macs_per_s: 4e11, isa: "test", threads: 2 };
        assert_eq!(r.macs_per_s(WeightFormat::F32), Some(1e11));
        assert_eq!(r.macs_per_s(WeightFormat::F16), Some(1e11));
        assert_eq!(r.macs_per_s(WeightFormat::Q8_0), Some(4e11));
        assert_eq!(r.macs_per_s(WeightFormat::Native), Some(4e11));
    }
}
