//! exp(x) as a fixed polynomial (Cody-Waite range reduction, degree 6, fused multiply-adds in
//! one order), so scalar, AVX2 and AVX-512 paths give the same bits; attention and SwiGLU use it.

/// `e^x` for x <= 0 (softmax after subtracting the max), within ~2 ulp: Cody-Waite range
/// reduction and a degree-6 polynomial, all fused multiply-adds in a fixed order, so it gives
/// the same bits on every instruction-set path and vectorises (libm's expf is a call per value).
#[inline(always)]
pub(crate) fn exp_nonpositive(x: f32) -> f32 {
    exp_in_range(x.max(EXP_MIN))
}

/// `e^x` for any x, clamped to [-87, 88] where f32 neither flushes to zero nor overflows; the
/// same arithmetic as `exp_nonpositive`.
#[inline(always)]
#[allow(clippy::manual_clamp)] // `clamp` keeps NaN; max/min map it to EXP_MIN, as the SIMD path does
pub(crate) fn exp_clamped(x: f32) -> f32 {
    exp_in_range(x.max(EXP_MIN).min(EXP_MAX))
}

#[inline(always)]
pub(crate) fn exp_in_range(x: f32) -> f32 {
    let n = (x * LOG2E + MAGIC) - MAGIC;
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    let mut p = EXP_POLY[0];
    for &c in &EXP_POLY[1..] {
        p = p.mul_add(r, c);
    }
    let e = (r * r).mul_add(p, r) + 1.0;
    e * f32::from_bits(((n as i32 + 127) as u32) << 23)
}
pub(crate) const EXP_MIN: f32 = -87.0;
pub(crate) const EXP_MAX: f32 = 88.0;
pub(crate) const LOG2E: f32 = std::f32::consts::LOG2_E;
pub(crate) const LN2_HI: f32 = 0.693_359_4;
pub(crate) const LN2_LO: f32 = -2.121_944_4e-4;
/// 1.5 * 2^23: adding it rounds to an integer.
pub(crate) const MAGIC: f32 = 12582912.0;
pub(crate) const EXP_POLY: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 5e-1];

/// [`exp_in_range`] on 8 lanes, the same operations per value.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// `exp_in_range` on 8 values.
    #[inline(always)]
    pub(crate) unsafe fn exp8_in_range(x: __m256) -> __m256 {
        let magic = _mm256_set1_ps(MAGIC);
        let n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), magic), magic);
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x));
        let mut p = _mm256_set1_ps(EXP_POLY[0]);
        for &c in &EXP_POLY[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let e = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(r, r), p, r), _mm256_set1_ps(1.0));
        let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)));
        _mm256_mul_ps(e, _mm256_castsi256_ps(bits))
    }
}

/// [`exp_in_range`] on 16 lanes, the same operations per value.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    /// `exp_in_range` on 16 values.
    #[inline(always)]
    pub(crate) unsafe fn exp16_in_range(x: __m512) -> __m512 {
        let magic = _mm512_set1_ps(MAGIC);
        let n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), magic), magic);
        let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), x));
        let mut p = _mm512_set1_ps(EXP_POLY[0]);
        for &c in &EXP_POLY[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        let e = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(r, r), p, r), _mm512_set1_ps(1.0));
        let bits = _mm512_slli_epi32::<23>(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)));
        _mm512_mul_ps(e, _mm512_castsi512_ps(bits))
    }
}
