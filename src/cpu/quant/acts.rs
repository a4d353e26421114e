//! Activation rows quantized to 8-bit codes per 32-value block, on every row the same way
//! whatever the row count (what makes the integer kernels batch-invariant).
use super::*;

/// Activation rows quantized per 32-value block: codes, scale, and code sum per block.
/// The buffers may be longer than the rows last quantized into them ([`quantize_acts_into`]
/// reuses them): the kernels read the first `m` rows' worth.
#[derive(Default)]
pub(super) struct QuantActs {
    pub(super) q: Vec<i8>,
    pub(super) d: Vec<f32>,
    pub(super) sum: Vec<i32>,
    /// `d * sum` per block (rounded to f32 once, as every path computes it), for the Q4_1
    /// offset term: the kernel broadcasts it from memory instead of multiplying and
    /// broadcasting from a register once per block, row and panel.
    pub(super) dsum: Vec<f32>,
    /// The code sum of each block's first 16 values, for Q6_K weights only (their two
    /// sub-blocks subtract their zero codes apart); empty otherwise.
    pub(super) sum_lo: Vec<i32>,
}

/// Rounds to nearest, ties to even, for |x| < 2^22 with plain adds the compiler vectorises
/// (`f32::round` is a libm call per value and was 6% of a 16-token forward).
#[inline(always)]
pub(super) fn round_small(x: f32) -> f32 {
    const MAGIC: f32 = 12582912.0; // 1.5 * 2^23
    (x + MAGIC) - MAGIC
}

impl QuantActs {
    /// Fill `sum_lo` for the first `blocks` blocks, which Q6_K weights need (the kernels check
    /// it is there).
    pub(super) fn add_half_sums(&mut self, blocks: usize) {
        self.sum_lo.clear();
        self.sum_lo.extend(self.q[..blocks * QK].chunks_exact(QK).map(|b| b[..16].iter().map(|&c| c as i32).sum::<i32>()));
        self.sum_lo.resize(self.sum.len(), 0);
    }
}

/// Grows `v` to at least `len` values; never shrinks it, so that a buffer reused for calls of
/// alternating sizes is zeroed only once.
fn at_least<T: Copy + Default>(v: &mut Vec<T>, len: usize) {
    if v.len() < len {
        v.resize(len, T::default());
    }
}

#[cfg(test)]
pub(super) fn quantize_acts(x: &[f32], m: usize, k: usize) -> QuantActs {
    let mut a = QuantActs::default();
    quantize_acts_into(&mut a, x, m, k);
    a
}

/// [`quantize_acts`] into buffers kept from an earlier call. Why: a forward quantizes about
/// 120 activation matrices, and a zeroed allocation for each (mimalloc clears the block) took
/// longer than the quantizing, on the calling thread while the team waited: 8-token SmolLM2
/// forwards 6.23 -> 6.15 ms, 16-token 10.99 -> 10.88 (3 interleaved rounds, 2-core Zen 4).
pub(super) fn quantize_acts_into(a: &mut QuantActs, x: &[f32], m: usize, k: usize) {
    let nb = k / QK;
    at_least(&mut a.q, m * k);
    at_least(&mut a.d, m * nb);
    at_least(&mut a.sum, m * nb);
    at_least(&mut a.dsum, m * nb);
    a.sum_lo.clear();
    let (simd, avx2) = (vnni(), crate::cpu::isa::has_avx2());
    let row = |x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [i32]| {
        #[cfg(target_arch = "x86_64")]
        if simd {
            unsafe { quantize_row_avx512(x, q, d, sum) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            unsafe { quantize_row_avx2(x, q, d, sum) };
            return;
        }
        let _ = (simd, avx2);
        quantize_row(x, q, d, sum);
    };
    let (q, d, sum) = (&mut a.q[..m * k], &mut a.d[..m * nb], &mut a.sum[..m * nb]);
    if m * k >= crate::cpu::team::PAR_MIN_VALUES {
        let mut rows: Vec<_> = x.chunks(k).zip(q.chunks_mut(k)).zip(d.chunks_mut(nb).zip(sum.chunks_mut(nb))).collect();
        crate::cpu::team::for_each_mut(&mut rows, |_, ((x, q), (d, sum))| row(x, q, d, sum));
    } else {
        for (((x, q), d), sum) in x.chunks(k).zip(q.chunks_mut(k)).zip(d.chunks_mut(nb)).zip(sum.chunks_mut(nb)) {
            row(x, q, d, sum);
        }
    }
    for ((ds, &d), &s) in a.dsum.iter_mut().zip(&a.d[..m * nb]).zip(&a.sum[..m * nb]) {
        *ds = d * s as f32;
    }
}

/// One activation row to 8-bit codes per 32-value block: `d = max|x| / 127`, codes
/// `round(x / d)` (ties to even), and the codes' sum (for the Q4_1 offset term).
pub(super) fn quantize_row(x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [i32]) {
    for (((block, out), d), sum) in x.chunks_exact(QK).zip(q.chunks_exact_mut(QK)).zip(d.iter_mut()).zip(sum.iter_mut()) {
        let amax = block.iter().fold(0f32, |a, &v| a.max(v.abs()));
        let scale = amax / 127.0;
        let id = if scale != 0.0 { 1.0 / scale } else { 0.0 };
        let mut s = 0i32;
        for (o, &v) in out.iter_mut().zip(block) {
            let c = round_small(v * id) as i32;
            *o = c as i8;
            s += c;
        }
        *d = scale;
        *sum = s;
    }
}

/// [`quantize_row`] 32 values at a time, with the same operations (so the same bits): the max
/// of absolute values is exact in any order, and the multiply and the rounding adds are the
/// scalar ones per lane. The scalar loop was 5% of a 16-token forward, all on one thread.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn quantize_row_avx512(x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [i32]) {
    use std::arch::x86_64::*;
    let magic = _mm512_set1_ps(12582912.0);
    for (b, (d, sum)) in d.iter_mut().zip(sum.iter_mut()).enumerate() {
        let p = x.as_ptr().add(b * QK);
        let (lo, hi) = (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)));
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        let scale = amax / 127.0;
        let id = _mm512_set1_ps(if scale != 0.0 { 1.0 / scale } else { 0.0 });
        let round = |v: __m512| _mm512_cvtps_epi32(_mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(v, id), magic), magic));
        let (cl, ch) = (round(lo), round(hi));
        let out = q.as_mut_ptr().add(b * QK) as *mut __m128i;
        _mm_storeu_si128(out, _mm512_cvtepi32_epi8(cl));
        _mm_storeu_si128(out.add(1), _mm512_cvtepi32_epi8(ch));
        *d = scale;
        *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(cl, ch));
    }
}

/// [`quantize_row`] on AVX2, with the same operations per lane (so the same bits). On the
/// 2-core Zen 3 the scalar loop, run on one thread before every integer matmul, was 2% of an
/// 8-token native forward's samples (`perf`), a share that grows with the rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn quantize_row_avx2(x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [i32]) {
    use std::arch::x86_64::*;
    let magic = _mm256_set1_ps(12582912.0);
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    for (b, (d, sum)) in d.iter_mut().zip(sum.iter_mut()).enumerate() {
        let p = x.as_ptr().add(b * QK);
        let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(p.add(8 * i)));
        let m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs), _mm256_and_ps(v[1], abs)), _mm256_max_ps(_mm256_and_ps(v[2], abs), _mm256_and_ps(v[3], abs)));
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m)));
        let scale = amax / 127.0;
        let id = _mm256_set1_ps(if scale != 0.0 { 1.0 / scale } else { 0.0 });
        let c: [__m256i; 4] = std::array::from_fn(|i| _mm256_cvtps_epi32(_mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(v[i], id), magic), magic)));
        // Packing works within 128-bit lanes: the bytes come out in dword order 0 2 4 6 1 3 5 7.
        let packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
        let ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(q.as_mut_ptr().add(b * QK) as *mut __m256i, ordered);
        let t = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
        let t = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256::<1>(t));
        let t = _mm_add_epi32(t, _mm_shuffle_epi32::<0b01_00_11_10>(t));
        *d = scale;
        *sum = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32::<0b10_11_00_01>(t)));
    }
}
