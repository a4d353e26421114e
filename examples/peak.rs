//! Peak arithmetic rate of this CPU for the two instructions the decode kernels are built on:
//! a 512-bit f32 fused multiply-add (`vfmadd`, the f32 and f16 paths) and a 512-bit 8-bit dot
//! product (`vpdpbusd`, the quantized paths), on one thread and on every core at once.
//!
//! Why: a forward over T rows does T multiply-adds per weight, so besides the weight stream
//! (bytes / DRAM bandwidth) it has an arithmetic floor, weights x T / rate. Where that floor
//! reaches the stream's, checking more rows stops being nearly free, whatever the kernel. The
//! example prints both floors for SmolLM2-135M's 134.5M matmul weights.
//! Without AVX-512 it measures the AVX2 counterparts (256-bit FMA, `vpmaddubsw`).
//! `cargo run --release --example peak`
use std::time::Instant;

/// Multiply-add weights per SmolLM2-135M forward row: 30 layers of q, k, v, o, gate, up, down
/// (576 wide, 3 KV heads of 64, 1,536 intermediate) and the 49,152 x 576 lm_head.
const WEIGHTS: f64 = (30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536) + 49152 * 576) as f64;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// `iters` rounds of 12 independent 512-bit FMA chains (enough to cover the latency);
    /// returns a value so the work cannot be dropped.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma(iters: u64) -> f32 {
        let mut a = [_mm512_set1_ps(1.0); 12];
        for (j, a) in a.iter_mut().enumerate() {
            *a = _mm512_set1_ps(1.0 + j as f32 * 1e-7);
        }
        let (b, c) = (_mm512_set1_ps(0.999_999_9), _mm512_set1_ps(1e-8));
        for _ in 0..iters {
            for a in a.iter_mut() {
                *a = _mm512_fmadd_ps(*a, b, c);
            }
        }
        a.iter().map(|&v| _mm512_reduce_add_ps(v)).sum()
    }

    /// The same for `vpdpbusd` (64 byte products summed into 16 int32 lanes per instruction).
    #[target_feature(enable = "avx512f,avx512vnni")]
    pub unsafe fn dpbusd(iters: u64) -> i32 {
        let mut a = [_mm512_setzero_si512(); 12];
        let (b, c) = (_mm512_set1_epi8(3), _mm512_set1_epi8(-1));
        for _ in 0..iters {
            for a in a.iter_mut() {
                *a = _mm512_dpbusd_epi32(*a, b, c);
            }
        }
        a.iter().map(|&v| _mm512_reduce_add_epi32(v)).sum()
    }
}

/// The 256-bit instructions the AVX2 kernels use, for CPUs without AVX-512.
#[cfg(target_arch = "x86_64")]
mod x86_avx2 {
    use std::arch::x86_64::*;

    /// `iters` rounds of 12 independent 256-bit FMA chains.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma(iters: u64) -> f32 {
        let mut a = [_mm256_set1_ps(1.0); 12];
        for (j, a) in a.iter_mut().enumerate() {
            *a = _mm256_set1_ps(1.0 + j as f32 * 1e-7);
        }
        let (b, c) = (_mm256_set1_ps(0.999_999_9), _mm256_set1_ps(1e-8));
        for _ in 0..iters {
            for a in a.iter_mut() {
                *a = _mm256_fmadd_ps(*a, b, c);
            }
        }
        let mut out = [0f32; 8];
        let s = a.iter().fold(_mm256_setzero_ps(), |s, &v| _mm256_add_ps(s, v));
        _mm256_storeu_ps(out.as_mut_ptr(), s);
        out.iter().sum()
    }

    /// 12 independent `vpmaddubsw` + `vpaddw` chains (32 byte products into 16 int16 lanes per
    /// `vpmaddubsw`, the AVX2 integer kernel's multiply).
    #[target_feature(enable = "avx2")]
    pub unsafe fn maddubs(iters: u64) -> i32 {
        let mut a = [_mm256_setzero_si256(); 12];
        let c = _mm256_set1_epi8(-1);
        for (j, a) in a.iter_mut().enumerate() {
            *a = _mm256_set1_epi8(j as i8 + 1);
        }
        for _ in 0..iters {
            for a in a.iter_mut() {
                // The chain's own value feeds the multiply, so it cannot be hoisted.
                *a = _mm256_add_epi16(*a, _mm256_maddubs_epi16(*a, c));
            }
        }
        let s = a.iter().fold(_mm256_setzero_si256(), |s, &v| _mm256_add_epi16(s, v));
        _mm256_extract_epi16::<0>(s)
    }
}

/// Instructions per second over `threads` threads each running `f(iters)` (12 per round).
fn rate(threads: usize, iters: u64, f: fn(u64) -> f64) -> f64 {
    let t = Instant::now();
    let sink: f64 = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads).map(|_| s.spawn(move || f(iters))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).sum()
    });
    std::hint::black_box(sink);
    (threads as u64 * iters * 12) as f64 / t.elapsed().as_secs_f64()
}

fn main() {
    #[cfg(target_arch = "x86_64")]
    {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let iters = 100_000_000;
        if !std::arch::is_x86_feature_detected!("avx512f") {
            if !(std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")) {
                println!("neither AVX-512 nor AVX2 with FMA on this CPU: nothing to measure");
                return;
            }
            let fma: fn(u64) -> f64 = |n| unsafe { x86_avx2::fma(n) as f64 };
            let (f1, fa) = (rate(1, iters, fma), rate(cores, iters, fma));
            println!("no AVX-512; 256-bit f32 FMA: {:.2} G/s on one thread, {:.2} G/s on {cores} ({:.0} GFLOP/s)", f1 / 1e9, fa / 1e9, fa * 16.0 / 1e9);
            println!("  f32 arithmetic floor of a SmolLM2-135M forward over T rows (all cores): T=1 {:.2} ms, T=8 {:.1} ms, T=16 {:.1} ms", WEIGHTS / (fa * 8.0) * 1e3, 8.0 * WEIGHTS / (fa * 8.0) * 1e3, 16.0 * WEIGHTS / (fa * 8.0) * 1e3);
            let mb: fn(u64) -> f64 = |n| unsafe { x86_avx2::maddubs(n) as f64 };
            let (m1, ma) = (rate(1, iters, mb), rate(cores, iters, mb));
            println!("256-bit vpmaddubsw (+ vpaddw): {:.2} G/s on one thread, {:.2} G/s on {cores} ({:.0} G int8 MAC/s)", m1 / 1e9, ma / 1e9, ma * 32.0 / 1e9);
            println!("  int8 multiply floor over T rows, without widening and the per-block float steps: T=1 {:.2} ms, T=8 {:.2} ms, T=16 {:.2} ms", WEIGHTS / (ma * 32.0) * 1e3, 8.0 * WEIGHTS / (ma * 32.0) * 1e3, 16.0 * WEIGHTS / (ma * 32.0) * 1e3);
            return;
        }
        let fma: fn(u64) -> f64 = |n| unsafe { x86::fma(n) as f64 };
        let f1 = rate(1, iters, fma);
        let fa = rate(cores, iters, fma);
        println!("512-bit f32 FMA: {:.2} G/s on one thread, {:.2} G/s on {cores} ({:.0} GFLOP/s)", f1 / 1e9, fa / 1e9, fa * 32.0 / 1e9);
        println!("  f32 arithmetic floor of a SmolLM2-135M forward over T rows (all cores): T=1 {:.2} ms, T=8 {:.1} ms, T=16 {:.1} ms, T=32 {:.1} ms", WEIGHTS / (fa * 16.0) * 1e3, 8.0 * WEIGHTS / (fa * 16.0) * 1e3, 16.0 * WEIGHTS / (fa * 16.0) * 1e3, 32.0 * WEIGHTS / (fa * 16.0) * 1e3);
        if std::arch::is_x86_feature_detected!("avx512vnni") {
            let dp: fn(u64) -> f64 = |n| unsafe { x86::dpbusd(n) as f64 };
            let d1 = rate(1, iters, dp);
            let da = rate(cores, iters, dp);
            println!("512-bit vpdpbusd: {:.2} G/s on one thread, {:.2} G/s on {cores} ({:.0} G int8 MAC/s)", d1 / 1e9, da / 1e9, da * 64.0 / 1e9);
            println!("  int8 multiply-add floor over T rows, without the per-block float steps: T=1 {:.2} ms, T=8 {:.2} ms, T=16 {:.2} ms", WEIGHTS / (da * 64.0) * 1e3, 8.0 * WEIGHTS / (da * 64.0) * 1e3, 16.0 * WEIGHTS / (da * 64.0) * 1e3);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    println!("this example measures x86-64 instructions only");
}
