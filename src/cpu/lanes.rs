//! SIMD lane reductions the kernels share.

/// Sixteen 16-lane vectors reduced at once (AVX-512): lane `u` of the result is the fold of
/// every lane of vector `u`, by one transposing tree (lanes l and l + 8, then + 4, + 2, + 1: 15
/// folds instead of sixteen reductions of four steps). The tree pairs lanes exactly as
/// `reduce_lanes` does, so with `AddF32` each lane's sum has the scalar tree's bits
/// (attention's scores); [`tree16::Max`] and [`tree16::AddI32`] fold in any order (activation
/// quantizing). The first two steps only join vectors within a group of four, so a caller can
/// run them per group ([`tree16::fold_four`]) and finish with [`tree16::finish`].
#[cfg(target_arch = "x86_64")]
pub(crate) mod tree16 {
    use std::arch::x86_64::*;

    /// How two vectors' lanes are folded.
    pub(crate) trait Fold {
        /// # Safety
        /// AVX-512 F must be present.
        unsafe fn fold(a: __m512, b: __m512) -> __m512;
    }
    /// Float addition, operands in the tree's order.
    pub(crate) struct AddF32;
    impl Fold for AddF32 {
        #[inline(always)]
        unsafe fn fold(a: __m512, b: __m512) -> __m512 {
            _mm512_add_ps(a, b)
        }
    }
    /// Float maximum.
    pub(crate) struct Max;
    impl Fold for Max {
        #[inline(always)]
        unsafe fn fold(a: __m512, b: __m512) -> __m512 {
            _mm512_max_ps(a, b)
        }
    }
    /// 32-bit integer addition on vectors that carry integers as floats' bits.
    pub(crate) struct AddI32;
    impl Fold for AddI32 {
        #[inline(always)]
        unsafe fn fold(a: __m512, b: __m512) -> __m512 {
            _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)))
        }
    }

    /// The tree's first two steps for vectors `4g..4g + 4` (lanes l and l + 8, then l and
    /// l + 4): one of the four vectors [`finish`] takes.
    ///
    /// # Safety
    /// AVX-512 F must be present.
    #[inline(always)]
    pub(crate) unsafe fn fold_four<F: Fold>(a: &[__m512; 4]) -> __m512 {
        // [a.q0, a.q1, b.q0, b.q1] with [a.q2, a.q3, b.q2, b.q3].
        let s1a = F::fold(_mm512_shuffle_f32x4::<0b01_00_01_00>(a[0], a[1]), _mm512_shuffle_f32x4::<0b11_10_11_10>(a[0], a[1]));
        let s1b = F::fold(_mm512_shuffle_f32x4::<0b01_00_01_00>(a[2], a[3]), _mm512_shuffle_f32x4::<0b11_10_11_10>(a[2], a[3]));
        // Quarters of the four vectors.
        F::fold(_mm512_shuffle_f32x4::<0b10_00_10_00>(s1a, s1b), _mm512_shuffle_f32x4::<0b11_01_11_01>(s1a, s1b))
    }

    /// The tree's last two steps (lanes l and l + 2, then l and l + 1, within each 128-bit
    /// quarter) over the four groups' [`fold_four`] results, and the lanes put in vector order.
    ///
    /// # Safety
    /// AVX-512 F must be present.
    #[inline(always)]
    pub(crate) unsafe fn finish<F: Fold>(s2: &[__m512; 4]) -> __m512 {
        let s3a = F::fold(_mm512_shuffle_ps::<0b01_00_01_00>(s2[0], s2[1]), _mm512_shuffle_ps::<0b11_10_11_10>(s2[0], s2[1]));
        let s3b = F::fold(_mm512_shuffle_ps::<0b01_00_01_00>(s2[2], s2[3]), _mm512_shuffle_ps::<0b11_10_11_10>(s2[2], s2[3]));
        let all = F::fold(_mm512_shuffle_ps::<0b10_00_10_00>(s3a, s3b), _mm512_shuffle_ps::<0b11_01_11_01>(s3a, s3b));
        // Lane 4q + i holds vector q + 4i.
        _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), all)
    }

    /// The whole tree over sixteen vectors.
    ///
    /// # Safety
    /// AVX-512 F must be present.
    #[inline(always)]
    pub(crate) unsafe fn reduce<F: Fold>(a: &[__m512; 16]) -> __m512 {
        let mut s2 = [_mm512_setzero_ps(); 4];
        for (g, s) in s2.iter_mut().enumerate() {
            *s = fold_four::<F>(&[a[4 * g], a[4 * g + 1], a[4 * g + 2], a[4 * g + 3]]);
        }
        finish::<F>(&s2)
    }
}
