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
    debug_assert!(k.is_multiple_of(QK), "rows of {k} values are not whole blocks");
    let nb = k / QK;
    at_least(&mut a.q, m * k);
    at_least(&mut a.d, m * nb);
    at_least(&mut a.sum, m * nb);
    at_least(&mut a.dsum, m * nb);
    a.sum_lo.clear();
    // Rows are contiguous and `k` is a whole number of blocks, so a run of rows is one run of
    // blocks: each call below quantizes its rows' blocks as one sequence.
    let (simd, avx2) = (vnni(), crate::cpu::isa::has_avx2());
    let blocks = |x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [i32], dsum: &mut [f32]| {
        #[cfg(target_arch = "x86_64")]
        if simd {
            // SAFETY: `vnni()` implies AVX-512 F and BW; the slices are whole rows of blocks.
            unsafe { quantize_blocks_avx512(x, q, d, sum, dsum) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: AVX2 is present.
            unsafe { quantize_row_avx2(x, q, d, sum) };
            set_dsum(d, sum, dsum);
            return;
        }
        let _ = (simd, avx2);
        quantize_row(x, q, d, sum);
        set_dsum(d, sum, dsum);
    };
    let (q, d, sum, dsum) = (&mut a.q[..m * k], &mut a.d[..m * nb], &mut a.sum[..m * nb], &mut a.dsum[..m * nb]);
    if m * k >= crate::cpu::team::PAR_MIN_VALUES {
        let mut rows: Vec<_> = x.chunks(k).zip(q.chunks_mut(k)).zip(d.chunks_mut(nb).zip(sum.chunks_mut(nb)).zip(dsum.chunks_mut(nb))).collect();
        crate::cpu::team::for_each_mut(&mut rows, |_, ((x, q), ((d, sum), dsum))| blocks(x, q, d, sum, dsum));
    } else {
        blocks(&x[..m * k], q, d, sum, dsum);
    }
}

/// `d * sum` per block, rounded to f32 once (the Q4_1 offset term's factor).
pub(super) fn set_dsum(d: &[f32], sum: &[i32], dsum: &mut [f32]) {
    for ((ds, &d), &s) in dsum.iter_mut().zip(d).zip(sum) {
        *ds = d * s as f32;
    }
}

/// `1 / scale`, or 0 for a block of zeros, and also for one so small (every value under about
/// 4e-37) that the inverse overflows: its codes are then all 0 on every path, rather than
/// products of infinity.
#[inline(always)]
pub(super) fn inverse_scale(scale: f32) -> f32 {
    let id = 1.0 / scale;
    if scale != 0.0 && id.is_finite() { id } else { 0.0 }
}

/// One activation row to 8-bit codes per 32-value block: `d = max|x| / 127`, codes
/// `round(x / d)` (ties to even), and the codes' sum (for the Q4_1 offset term).
pub(super) fn quantize_row(x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [i32]) {
    for (((block, out), d), sum) in x.chunks_exact(QK).zip(q.chunks_exact_mut(QK)).zip(d.iter_mut()).zip(sum.iter_mut()) {
        let amax = block.iter().fold(0f32, |a, &v| a.max(v.abs()));
        let scale = amax / 127.0;
        let id = inverse_scale(scale);
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

/// [`quantize_row`] and [`set_dsum`] on AVX-512, sixteen blocks at a time, with the same bits:
/// the absolute maximum is exact in any order, the scale and its inverse are the scalar
/// divisions done in 16 lanes, the codes are the scalar products rounded to nearest even
/// (`vcvtps2dq` in the default rounding mode rounds as `round_small` does), and integer sums are
/// exact in any order. Why sixteen at once: block by block, each block's maximum and code sum
/// were a chain of cross-lane reductions and two scalar divisions, and its codes went out
/// through `vpmovdb` to memory, which stalls on Zen 4; sixteen blocks share one transposing
/// reduction for each, and two blocks' codes are packed in registers for one store. On a
/// 2-core Zen 4 (in L1): 8 rows x 576 1.25 -> 0.55 us, 8 x 1,536 3.34 -> 1.57 us; in the forward,
/// where the rows arrive from the other core's cache, 8-token native SmolLM2 forwards were
/// 2-7% faster (3 interleaved rounds). Below `PAR_MIN_VALUES` values this runs on the calling
/// thread while the team waits.
///
/// # Safety
/// AVX-512 F and BW must be present; `x` and `q` hold at least `d.len()` blocks, `sum` and
/// `dsum` at least `d.len()` values (checked).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn quantize_blocks_avx512(x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [i32], dsum: &mut [f32]) {
    let nb = d.len();
    assert!(x.len() >= nb * QK && q.len() >= nb * QK && sum.len() >= nb && dsum.len() >= nb);
    let full = nb / 16 * 16;
    for b in (0..full).step_by(16) {
        quantize16_avx512(x.as_ptr().add(b * QK), q.as_mut_ptr().add(b * QK), d.as_mut_ptr().add(b), sum.as_mut_ptr().add(b), dsum.as_mut_ptr().add(b));
    }
    let rest = nb - full;
    if rest > 0 {
        // The last blocks through zero-padded copies: an all-zero block is harmless.
        let mut xs = [0f32; 16 * QK];
        let mut qs = [0i8; 16 * QK];
        let (mut ds, mut ss, mut dss) = ([0f32; 16], [0i32; 16], [0f32; 16]);
        xs[..rest * QK].copy_from_slice(&x[full * QK..nb * QK]);
        quantize16_avx512(xs.as_ptr(), qs.as_mut_ptr(), ds.as_mut_ptr(), ss.as_mut_ptr(), dss.as_mut_ptr());
        q[full * QK..nb * QK].copy_from_slice(&qs[..rest * QK]);
        d[full..].copy_from_slice(&ds[..rest]);
        sum[full..nb].copy_from_slice(&ss[..rest]);
        dsum[full..nb].copy_from_slice(&dss[..rest]);
    }
}

/// Sixteen blocks from `x` (512 values) into codes at `q` and per-block scale, sum and
/// `scale * sum` at `d`, `sum`, `dsum`. (Plain loops: a closure here would be compiled without
/// AVX-512 and call each intrinsic out of line.)
///
/// # Safety
/// AVX-512 F and BW must be present; 512 values readable at `x`, 512 codes and 16 values of
/// each of `d`, `sum`, `dsum` writable.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn quantize16_avx512(x: *const f32, q: *mut i8, d: *mut f32, sum: *mut i32, dsum: *mut f32) {
    use crate::cpu::lanes::tree16;
    use std::arch::x86_64::*;
    let mut v = [_mm512_setzero_ps(); 16];
    for (u, v) in v.iter_mut().enumerate() {
        let p = x.add(u * QK);
        *v = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(p)), _mm512_abs_ps(_mm512_loadu_ps(p.add(16))));
    }
    let amax = tree16::reduce::<tree16::Max>(&v);
    let scale = _mm512_div_ps(amax, _mm512_set1_ps(127.0));
    // `inverse_scale` in 16 lanes: 1 / scale where the scale is not 0 and the inverse is finite.
    let nonzero = _mm512_cmp_ps_mask::<_CMP_NEQ_OQ>(scale, _mm512_setzero_ps());
    let inv = _mm512_maskz_div_ps(nonzero, _mm512_set1_ps(1.0), scale);
    let inv = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_LT_OQ>(inv, _mm512_set1_ps(f32::INFINITY)), inv);
    let mut invs = [0f32; 16];
    _mm512_storeu_ps(invs.as_mut_ptr(), inv);
    // Two blocks' codes per 64-byte store: packed to 16 and then 8 bits within 128-bit lanes
    // (no saturation: codes lie in [-127, 127]), then the dwords put in order. (`vpmovdb` to
    // memory, 16 bytes at a time, stalled this loop on Zen 4.)
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for pair in 0..8 {
        let mut half = [_mm512_setzero_si512(); 2];
        for (h, half) in half.iter_mut().enumerate() {
            let u = 2 * pair + h;
            let p = x.add(u * QK);
            let id = _mm512_set1_ps(invs[u]);
            let cl = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(p), id));
            let ch = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(p.add(16)), id));
            v[u] = _mm512_castsi512_ps(_mm512_add_epi32(cl, ch));
            *half = _mm512_packs_epi32(cl, ch);
        }
        let bytes = _mm512_permutexvar_epi32(order, _mm512_packs_epi16(half[0], half[1]));
        _mm512_storeu_si512(q.add(2 * pair * QK) as *mut _, bytes);
    }
    let sums = _mm512_castps_si512(tree16::reduce::<tree16::AddI32>(&v));
    _mm512_storeu_ps(d, scale);
    _mm512_storeu_si512(sum as *mut _, sums);
    _mm512_storeu_ps(dsum, _mm512_mul_ps(scale, _mm512_cvtepi32_ps(sums)));
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
        let id = _mm256_set1_ps(inverse_scale(scale));
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
