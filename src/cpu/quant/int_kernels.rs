//! The integer matmul over packed panels: the portable kernel, AVX-512 VNNI and AVX2, the same
//! bits on all three.
use super::*;

pub(super) fn matmul_quant(x: &[f32], m: usize, w: &PackedQuant) -> Vec<f32> {
    assert_eq!(x.len(), m * w.k, "x has {} values, expected {m}x{}", x.len(), w.k);
    // The activation buffers are this thread's, kept between calls (taken out while in use, so
    // a call made from inside another just allocates its own).
    thread_local! {
        static ACTS: std::cell::Cell<Option<QuantActs>> = const { std::cell::Cell::new(None) };
    }
    let mut acts = ACTS.take().unwrap_or_default();
    quantize_acts_into(&mut acts, x, m, w.k);
    if w.high == 2 {
        acts.add_half_sums(m * (w.k / QK));
    }
    let vnni = vnni();
    let avx2 = crate::cpu::isa::has_avx2();
    // SAFETY: the panel ranges cover every column, and each panel writes all rows.
    let out = unsafe {
        written_by(m * w.n, |ptr| {
            for_each_panel_range(w.n.div_ceil(PANEL), 2, |p0, p1| {
                #[cfg(target_arch = "x86_64")]
                if vnni {
                    avx512_quant::block(&acts, m, w, p0, p1, ptr);
                    return;
                }
                #[cfg(target_arch = "x86_64")]
                if avx2 {
                    avx2_quant::block(&acts, m, w, p0, p1, ptr);
                    return;
                }
                let _ = (vnni, avx2);
                quant_block(&acts, m, w, p0, p1, ptr);
            })
        })
    };
    ACTS.set(Some(acts));
    out
}

/// Portable integer kernel with the same per-block float steps as the VNNI one:
/// `acc = fma(isum, d_w * d_x, acc); acc = fma(m_w, d_x * sum_x, acc)` with stored offsets, and
/// `acc = fma(isum - zero * sum_x, d_w * d_x, acc)` without; Q6_K takes the last step once per
/// 16-value half with its own scale, first half first.
pub(super) fn quant_block(a: &QuantActs, m: usize, w: &PackedQuant, p0: usize, p1: usize, out: OutPtr) {
    let (k, n) = (w.k, w.n);
    let nb = k / QK;
    let stride = PackedQuant::stride(w.bits4, w.high, w.zero.is_none());
    let codes = PackedQuant::codes_bytes(w.bits4, w.high);
    assert!(w.high != 2 || a.sum_lo.len() == a.sum.len(), "Q6_K weights need the activations' half sums");
    for p in p0..p1 {
        for i in 0..m {
            let mut acc = [0f32; PANEL];
            for b in 0..nb {
                let blk = &w.data[(p * nb + b) * stride..(p * nb + b + 1) * stride];
                let xq = &a.q[i * k + b * QK..i * k + (b + 1) * QK];
                let (dx, sx) = (a.d[i * nb + b], a.sum[i * nb + b]);
                for (c, acc) in acc.iter_mut().enumerate() {
                    let mut isum = 0i32;
                    // Q6_K: the sums of values 0..16 and 16..32 apart (two scales).
                    let mut isum_hi = 0i32;
                    if w.bits4 {
                        let high = w.high as usize;
                        for g in 0..4 {
                            for t in 0..4 {
                                let byte = blk[g * 64 + c * 4 + t];
                                let (mut lo, mut hi) = ((byte & 0x0f) as i32, (byte >> 4) as i32);
                                let bit = 4 * c + t;
                                for h in 0..high {
                                    let plane = 256 + g * 16 * high;
                                    lo |= (((blk[plane + 8 * h + bit / 8] >> (bit % 8)) & 1) as i32) << (4 + h);
                                    hi |= (((blk[plane + 8 * (high + h) + bit / 8] >> (bit % 8)) & 1) as i32) << (4 + h);
                                }
                                isum += lo * xq[4 * g + t] as i32;
                                isum_hi += hi * xq[16 + 4 * g + t] as i32;
                            }
                        }
                        if high < 2 {
                            isum += isum_hi;
                        }
                    } else {
                        for g in 0..8 {
                            for t in 0..4 {
                                isum += blk[g * 64 + c * 4 + t] as i32 * xq[4 * g + t] as i32;
                            }
                        }
                    }
                    let dw = f16::from_bits(u16::from_le_bytes([blk[codes + 2 * c], blk[codes + 2 * c + 1]])).to_f32();
                    match w.zero {
                        Some(z) if w.high == 2 => {
                            let dw2 = f16::from_bits(u16::from_le_bytes([blk[codes + 32 + 2 * c], blk[codes + 33 + 2 * c]])).to_f32();
                            let slo = a.sum_lo[i * nb + b];
                            *acc = ((isum - z as i32 * slo) as f32).mul_add(dw * dx, *acc);
                            *acc = ((isum_hi - z as i32 * (sx - slo)) as f32).mul_add(dw2 * dx, *acc);
                        }
                        Some(z) => *acc = ((isum - z as i32 * sx) as f32).mul_add(dw * dx, *acc),
                        None => {
                            let mw = f16::from_bits(u16::from_le_bytes([blk[codes + 32 + 2 * c], blk[codes + 33 + 2 * c]])).to_f32();
                            *acc = (isum as f32).mul_add(dw * dx, *acc);
                            *acc = mw.mul_add(a.dsum[i * nb + b], *acc);
                        }
                    }
                }
            }
            for (c, v) in acc.iter().enumerate() {
                let j = p * PANEL + c;
                if j < n {
                    unsafe { *out.0.add(i * n + j) = *v };
                }
            }
        }
    }
}

/// `$panel::<B4, H, OFS>(args)` for `w`'s code layout, so each SIMD kernel is compiled per
/// layout: 4- or 8-bit codes (`B4`), planes of higher bits (`H`: 1 for Q5_0, 2 for Q6_K, which
/// come only with a fixed zero code), offsets stored per block (`OFS`: Q4_1, Q4_K).
#[cfg(target_arch = "x86_64")]
macro_rules! by_layout {
    ($w:expr, $panel:ident($($arg:expr),*)) => {
        match ($w.bits4, $w.high, $w.zero.is_none()) {
            (true, 1, _) => $panel::<true, 1, false>($($arg),*),
            (true, 2, _) => $panel::<true, 2, false>($($arg),*),
            (true, _, true) => $panel::<true, 0, true>($($arg),*),
            (true, _, false) => $panel::<true, 0, false>($($arg),*),
            (false, _, true) => $panel::<false, 0, true>($($arg),*),
            (false, _, false) => $panel::<false, 0, false>($($arg),*),
        }
    };
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx512_quant {
    use super::{OutPtr, PackedQuant, QuantActs, QK};
    use std::arch::x86_64::*;

    /// How far ahead (in blocks of one panel) the weight stream is prefetched into L2.
    const PREFETCH_BLOCKS: usize = 24;

    /// `MR` rows (1 to 8) x one panel; 8-bit or 4-bit codes, the latter with `H` planes of
    /// higher bits (each set bit adds 16 or 32 to its code with one masked byte add); with two
    /// (Q6_K) each half of a block keeps its own integer sum for its own scale.
    #[inline(always)]
    unsafe fn tile<const MR: usize, const B4: bool, const H: u8, const OFS: bool>(a: &QuantActs, w: &PackedQuant, i0: usize, p0: usize, out: OutPtr) {
        // Panels per tile: one. The arrays keep the panel dimension of `store_tile`'s
        // `[[__m512; NR]; MR]`, which the f32 kernel's wider tiles share.
        const NR: usize = 1;
        let (k, n) = (w.k, w.n);
        let nb = k / QK;
        let stride = PackedQuant::stride(B4, H, OFS);
        let zero = w.zero.unwrap_or(0) as i32;
        let codes = PackedQuant::codes_bytes(B4, H);
        let (sixteen, thirty_two) = (_mm512_set1_epi8(16), _mm512_set1_epi8(32));
        // Two integer accumulators per output (exact, so splitting changes no bits): enough
        // independent chains to hide vpdpbusd's latency in a one-panel tile. Q6_K's halves
        // need theirs apart anyway.
        assert!(H != 2 || a.sum_lo.len() == a.sum.len(), "Q6_K weights need the activations' half sums");
        let base = w.data.as_ptr();
        let xq = a.q.as_ptr();
        let low = _mm512_set1_epi8(0x0f);
        let mut acc = [[_mm512_setzero_ps(); NR]; MR];
        for b in 0..nb {
            let mut isum = [[_mm512_setzero_si512(); NR]; MR];
            let mut blk = [base; NR];
            for (jj, blk) in blk.iter_mut().enumerate() {
                *blk = base.add(((p0 + jj) * nb + b) * stride);
                // Fetch every cache line of the block 2 blocks ahead into L1 and of the block
                // PREFETCH_BLOCKS ahead into L2 while this one computes. The panels are short
                // streams (18-48 blocks of 5-9 lines), too short for the hardware prefetcher to
                // run far ahead, and one L1 distance either arrives late (near) or holds the L1
                // fill buffers too long (far). Whole blocks at 6 ahead made 4-token calls ~11%
                // faster than first lines only; the two distances made 1-, 2- and 4-token native
                // forwards another 10-14% faster (interleaved A/B, 5 rounds, 2-core Xeon).
                let ahead = blk.wrapping_add(stride * 2);
                let far = blk.wrapping_add(stride * PREFETCH_BLOCKS);
                let mut o = 0;
                while o < stride {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(o) as *const i8);
                    _mm_prefetch::<_MM_HINT_T1>(far.wrapping_add(o) as *const i8);
                    o += 64;
                }
            }
            let mut isum2 = [[_mm512_setzero_si512(); NR]; MR];
            if B4 {
                for g in 0..4 {
                    let mut lo = [_mm512_setzero_si512(); NR];
                    let mut hi = [_mm512_setzero_si512(); NR];
                    for jj in 0..NR {
                        let raw = _mm512_loadu_si512(blk[jj].add(g * 64) as *const _);
                        lo[jj] = _mm512_and_si512(raw, low);
                        hi[jj] = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), low);
                        if H > 0 {
                            let plane = blk[jj].add(256 + g * 16 * H as usize) as *const u64;
                            lo[jj] = _mm512_mask_add_epi8(lo[jj], plane.read_unaligned(), lo[jj], sixteen);
                            hi[jj] = _mm512_mask_add_epi8(hi[jj], plane.add(H as usize).read_unaligned(), hi[jj], sixteen);
                            if H == 2 {
                                lo[jj] = _mm512_mask_add_epi8(lo[jj], plane.add(1).read_unaligned(), lo[jj], thirty_two);
                                hi[jj] = _mm512_mask_add_epi8(hi[jj], plane.add(3).read_unaligned(), hi[jj], thirty_two);
                            }
                        }
                    }
                    for ii in 0..MR {
                        let row = xq.add((i0 + ii) * k + b * QK);
                        let xl = _mm512_set1_epi32((row.add(4 * g) as *const i32).read_unaligned());
                        let xh = _mm512_set1_epi32((row.add(16 + 4 * g) as *const i32).read_unaligned());
                        for jj in 0..NR {
                            isum[ii][jj] = _mm512_dpbusd_epi32(isum[ii][jj], lo[jj], xl);
                            isum2[ii][jj] = _mm512_dpbusd_epi32(isum2[ii][jj], hi[jj], xh);
                        }
                    }
                }
            } else {
                for g in 0..4 {
                    let mut wa = [_mm512_setzero_si512(); NR];
                    let mut wb = [_mm512_setzero_si512(); NR];
                    for jj in 0..NR {
                        wa[jj] = _mm512_loadu_si512(blk[jj].add(2 * g * 64) as *const _);
                        wb[jj] = _mm512_loadu_si512(blk[jj].add((2 * g + 1) * 64) as *const _);
                    }
                    for ii in 0..MR {
                        let row = xq.add((i0 + ii) * k + b * QK);
                        let xa = _mm512_set1_epi32((row.add(8 * g) as *const i32).read_unaligned());
                        let xb = _mm512_set1_epi32((row.add(8 * g + 4) as *const i32).read_unaligned());
                        for jj in 0..NR {
                            isum[ii][jj] = _mm512_dpbusd_epi32(isum[ii][jj], wa[jj], xa);
                            isum2[ii][jj] = _mm512_dpbusd_epi32(isum2[ii][jj], wb[jj], xb);
                        }
                    }
                }
            }
            if H != 2 {
                for ii in 0..MR {
                    for jj in 0..NR {
                        isum[ii][jj] = _mm512_add_epi32(isum[ii][jj], isum2[ii][jj]);
                    }
                }
            }
            for jj in 0..NR {
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(blk[jj].add(codes) as *const __m256i));
                for ii in 0..MR {
                    let dx = *a.d.get_unchecked((i0 + ii) * nb + b);
                    let sx = *a.sum.get_unchecked((i0 + ii) * nb + b);
                    let scale = _mm512_mul_ps(dw, _mm512_set1_ps(dx));
                    if H == 2 {
                        // Q6_K: each half with its own zero-code sum and scale, first half first.
                        let dw2 = _mm512_cvtph_ps(_mm256_loadu_si256(blk[jj].add(codes + 32) as *const __m256i));
                        let slo = *a.sum_lo.get_unchecked((i0 + ii) * nb + b);
                        let ia = _mm512_sub_epi32(isum[ii][jj], _mm512_set1_epi32(zero * slo));
                        let ib = _mm512_sub_epi32(isum2[ii][jj], _mm512_set1_epi32(zero * (sx - slo)));
                        acc[ii][jj] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), scale, acc[ii][jj]);
                        acc[ii][jj] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ib), _mm512_mul_ps(dw2, _mm512_set1_ps(dx)), acc[ii][jj]);
                    } else if OFS {
                        let mw = _mm512_cvtph_ps(_mm256_loadu_si256(blk[jj].add(codes + 32) as *const __m256i));
                        acc[ii][jj] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[ii][jj]), scale, acc[ii][jj]);
                        acc[ii][jj] = _mm512_fmadd_ps(mw, _mm512_set1_ps(*a.dsum.get_unchecked((i0 + ii) * nb + b)), acc[ii][jj]);
                    } else {
                        let centred = _mm512_sub_epi32(isum[ii][jj], _mm512_set1_epi32(zero * sx));
                        acc[ii][jj] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), scale, acc[ii][jj]);
                    }
                }
            }
        }
        crate::cpu::matmul::avx512_packed::store_tile(&acc, i0, p0, n, out);
    }

    /// One panel's rows: tiles of 8, then the rest in one tile. Every tile covers one panel,
    /// so the panel's codes, unpacked once per tile, serve up to 8 rows. Why not 4-row x
    /// 2-panel tiles (the choice below 8 rows until December 2026): a 5-row call then took a
    /// 4-row tile and a 1-row one, each unpacking the codes, and cost what 8 rows cost. On the
    /// 2-core Zen 4 (`bench --weights native`, SmolLM2, five interleaved rounds, the last four
    /// quiet) one-panel tiles made 1-, 2-, 4-, 5- and 6-token forwards 3, 7, 9.5, 10 and 8%
    /// faster (T = 4: 4.36-4.40 -> 3.93-4.03 ms), 8 and 16 tokens unchanged; the 1B-shaped
    /// Q4_K model's 4-token forward 6% faster, its single tokens unchanged.
    #[inline(always)]
    unsafe fn panel<const B4: bool, const H: u8, const OFS: bool>(a: &QuantActs, m: usize, w: &PackedQuant, p: usize, out: OutPtr) {
        let mut i = 0;
        while i + 8 <= m {
            tile::<8, B4, H, OFS>(a, w, i, p, out);
            i += 8;
        }
        match m - i {
            7 => tile::<7, B4, H, OFS>(a, w, i, p, out),
            6 => tile::<6, B4, H, OFS>(a, w, i, p, out),
            5 => tile::<5, B4, H, OFS>(a, w, i, p, out),
            4 => tile::<4, B4, H, OFS>(a, w, i, p, out),
            3 => tile::<3, B4, H, OFS>(a, w, i, p, out),
            2 => tile::<2, B4, H, OFS>(a, w, i, p, out),
            1 => tile::<1, B4, H, OFS>(a, w, i, p, out),
            _ => {}
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn block(a: &QuantActs, m: usize, w: &PackedQuant, p0: usize, p1: usize, out: OutPtr) {
        for p in p0..p1 {
            by_layout!(w, panel(a, m, w, p, out));
        }
    }
}

/// The integer kernel on AVX2 (CPUs without AVX-512 VNNI): the same exact integer sums as
/// `vpdpbusd`, from `vpmaddubsw` (unsigned 8-bit times signed 8-bit, adjacent pairs added into
/// 16 bits) and `vpmaddwd` against ones (adjacent 16-bit pairs into 32 bits), then the same
/// float steps per block, so the same bits as the VNNI and portable kernels.
///
/// Why the pairs cannot overflow 16 bits: activation codes lie in [-127, 127]. A 4-bit pair is
/// at most 2 * 15 * 127 = 3,810 in size, so a block's 8 of them per lane (30,480) still fit
/// and are added in 16 bits before one widening; 5-bit pairs (7,874) and 6-bit ones (16,002,
/// each half of a block apart) are widened every two groups. 8-bit codes are taken as `code - 128` in
/// [-128, 127] with the sign moved onto the activation (`vpsignb`), so a pair is at most
/// 2 * 128 * 127 = 32,512, widened one at a time; `128 * sum(x)` added back gives the codes'
/// own sum.
#[cfg(target_arch = "x86_64")]
pub(super) mod avx2_quant {
    use super::{OutPtr, PackedQuant, QuantActs, QK};
    use crate::cpu::PANEL;
    use std::arch::x86_64::*;

    /// How far ahead (in blocks of one panel) the weight stream is prefetched into L2.
    const PREFETCH_BLOCKS: usize = 16;

    /// The 8-column halves of a panel, one register each.
    const HALVES: usize = PANEL / 8;

    /// `MR` rows x panel `p` (16 columns, as two 8-column halves: each 16-bit and float
    /// accumulator register holds one half). A tile of 4 rows then needs 16 accumulators, more
    /// registers than AVX2 has beside the codes, yet broadcasting each activation once for both
    /// halves beats half-panel tiles that fit the registers. Interleaved A/B on a 2-core Zen 3
    /// (`selfspec bench`, 4-5 rounds, three runs): native 1-, 2-, 4-, 8- and 16-token forwards
    /// 5.03 -> 4.57, 5.83 -> 4.88, 7.21 -> 6.38, 12.7 -> 11.3 and 24.2 -> 21.4 ms; q8_0 8 and 16
    /// tokens 16.5 -> 13.8 and 31.1 -> 26.6 ms. The nineteenth session had chosen half-panel
    /// tiles from single `kbench` runs on a noisier machine.
    #[inline(always)]
    unsafe fn tile<const MR: usize, const B4: bool, const H: u8, const OFS: bool>(a: &QuantActs, w: &PackedQuant, i0: usize, p: usize, out: OutPtr) {
        assert!(H != 2 || a.sum_lo.len() == a.sum.len(), "Q6_K weights need the activations' half sums");
        let (k, n) = (w.k, w.n);
        let nb = k / QK;
        let stride = PackedQuant::stride(B4, H, OFS);
        let zero = w.zero.unwrap_or(0) as i32;
        let codes = PackedQuant::codes_bytes(B4, H);
        let xq = a.q.as_ptr();
        let low = _mm256_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        let flip = _mm256_set1_epi8(-128);
        let mut acc = [[_mm256_setzero_ps(); HALVES]; MR];
        for b in 0..nb {
            let blk = w.data.as_ptr().add((p * nb + b) * stride);
            let far = blk.wrapping_add(stride * PREFETCH_BLOCKS);
            let mut o = 0;
            while o < stride {
                _mm_prefetch::<_MM_HINT_T1>(far.wrapping_add(o) as *const i8);
                o += 64;
            }
            let mut isum = [[_mm256_setzero_si256(); HALVES]; MR];
            // Q6_K: the second half's sums apart (its own scale).
            let mut isum2 = [[_mm256_setzero_si256(); HALVES]; MR];
            if B4 {
                let mut s16 = [[_mm256_setzero_si256(); HALVES]; MR];
                let mut s16b = [[_mm256_setzero_si256(); HALVES]; MR];
                for g in 0..4 {
                    let mut lo = [_mm256_setzero_si256(); HALVES];
                    let mut hi = [_mm256_setzero_si256(); HALVES];
                    for j in 0..HALVES {
                        let raw = _mm256_loadu_si256(blk.add(g * 64 + j * 32) as *const __m256i);
                        lo[j] = _mm256_and_si256(raw, low);
                        hi[j] = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), low);
                        if H > 0 {
                            let plane = blk.add(256 + g * 16 * H as usize) as *const u64;
                            let bits = |h: usize| (plane.add(h).read_unaligned() >> (32 * j)) as u32;
                            lo[j] = _mm256_or_si256(lo[j], high_bits::<16>(bits(0)));
                            hi[j] = _mm256_or_si256(hi[j], high_bits::<16>(bits(H as usize)));
                            if H == 2 {
                                lo[j] = _mm256_or_si256(lo[j], high_bits::<32>(bits(1)));
                                hi[j] = _mm256_or_si256(hi[j], high_bits::<32>(bits(3)));
                            }
                        }
                    }
                    for (ii, (s, sb)) in s16.iter_mut().zip(s16b.iter_mut()).enumerate() {
                        let row = xq.add((i0 + ii) * k + b * QK);
                        let xl = _mm256_set1_epi32((row.add(4 * g) as *const i32).read_unaligned());
                        let xh = _mm256_set1_epi32((row.add(16 + 4 * g) as *const i32).read_unaligned());
                        for j in 0..HALVES {
                            if H == 2 {
                                s[j] = _mm256_add_epi16(s[j], _mm256_maddubs_epi16(lo[j], xl));
                                sb[j] = _mm256_add_epi16(sb[j], _mm256_maddubs_epi16(hi[j], xh));
                            } else {
                                s[j] = _mm256_add_epi16(s[j], _mm256_add_epi16(_mm256_maddubs_epi16(lo[j], xl), _mm256_maddubs_epi16(hi[j], xh)));
                            }
                        }
                    }
                    // Pairs of 5-bit codes reach 2 * 31 * 127 = 7,874 and of 6-bit ones (each
                    // half apart) 2 * 63 * 127 = 16,002: two groups' worth per lane (31,496 or
                    // 32,004) still fit 16 bits, a whole block's would not.
                    if H > 0 && g % 2 == 1 {
                        for ii in 0..MR {
                            for j in 0..HALVES {
                                isum[ii][j] = _mm256_add_epi32(isum[ii][j], _mm256_madd_epi16(s16[ii][j], ones));
                                s16[ii][j] = _mm256_setzero_si256();
                                if H == 2 {
                                    isum2[ii][j] = _mm256_add_epi32(isum2[ii][j], _mm256_madd_epi16(s16b[ii][j], ones));
                                    s16b[ii][j] = _mm256_setzero_si256();
                                }
                            }
                        }
                    }
                }
                if H == 0 {
                    for (is, s) in isum.iter_mut().zip(&s16) {
                        for j in 0..HALVES {
                            is[j] = _mm256_madd_epi16(s[j], ones);
                        }
                    }
                }
            } else {
                for g in 0..8 {
                    // code - 128 as a signed byte, its size, and the activation carrying its sign.
                    let mut signed = [_mm256_setzero_si256(); HALVES];
                    let mut size = [_mm256_setzero_si256(); HALVES];
                    for j in 0..HALVES {
                        signed[j] = _mm256_xor_si256(_mm256_loadu_si256(blk.add(g * 64 + j * 32) as *const __m256i), flip);
                        size[j] = _mm256_abs_epi8(signed[j]);
                    }
                    for (ii, is) in isum.iter_mut().enumerate() {
                        let row = xq.add((i0 + ii) * k + b * QK);
                        let x = _mm256_set1_epi32((row.add(4 * g) as *const i32).read_unaligned());
                        for j in 0..HALVES {
                            let pairs = _mm256_maddubs_epi16(size[j], _mm256_sign_epi8(x, signed[j]));
                            is[j] = _mm256_add_epi32(is[j], _mm256_madd_epi16(pairs, ones));
                        }
                    }
                }
            }
            for j in 0..HALVES {
                let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(codes + j * 16) as *const __m128i));
                let mw = if OFS { _mm256_cvtph_ps(_mm_loadu_si128(blk.add(codes + 32 + j * 16) as *const __m128i)) } else { dw };
                for ii in 0..MR {
                    let dx = *a.d.get_unchecked((i0 + ii) * nb + b);
                    let sx = *a.sum.get_unchecked((i0 + ii) * nb + b);
                    let scale = _mm256_mul_ps(dw, _mm256_set1_ps(dx));
                    // The sum over the codes themselves, as `vpdpbusd` gives it (8-bit codes were
                    // summed as code - 128); every step here is exact integer arithmetic.
                    let raw = if B4 { isum[ii][j] } else { _mm256_add_epi32(isum[ii][j], _mm256_set1_epi32(128 * sx)) };
                    if H == 2 {
                        // Q6_K: each half with its own zero-code sum and scale, first half first.
                        let dw2 = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(codes + 32 + j * 16) as *const __m128i));
                        let slo = *a.sum_lo.get_unchecked((i0 + ii) * nb + b);
                        let ia = _mm256_sub_epi32(raw, _mm256_set1_epi32(zero * slo));
                        let ib = _mm256_sub_epi32(isum2[ii][j], _mm256_set1_epi32(zero * (sx - slo)));
                        acc[ii][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), scale, acc[ii][j]);
                        acc[ii][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ib), _mm256_mul_ps(dw2, _mm256_set1_ps(dx)), acc[ii][j]);
                    } else if OFS {
                        acc[ii][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(raw), scale, acc[ii][j]);
                        acc[ii][j] = _mm256_fmadd_ps(mw, _mm256_set1_ps(*a.dsum.get_unchecked((i0 + ii) * nb + b)), acc[ii][j]);
                    } else {
                        let centred = _mm256_sub_epi32(raw, _mm256_set1_epi32(zero * sx));
                        acc[ii][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), scale, acc[ii][j]);
                    }
                }
            }
        }
        for j in 0..HALVES {
            let col = p * PANEL + j * 8;
            let live = n.saturating_sub(col).min(8);
            for (ii, v) in acc.iter().enumerate() {
                let dst = out.0.add((i0 + ii) * n + col);
                if live == 8 {
                    _mm256_storeu_ps(dst, v[j]);
                } else if live > 0 {
                    let mut buf = [0f32; 8];
                    _mm256_storeu_ps(buf.as_mut_ptr(), v[j]);
                    std::ptr::copy_nonoverlapping(buf.as_ptr(), dst, live);
                }
            }
        }
    }

    /// `V` for each set bit of `bits` in its byte (bit t -> byte t), 0 elsewhere: the fifth
    /// (16) or sixth (32) bits of 32 codes.
    #[inline(always)]
    unsafe fn high_bits<const V: i8>(bits: u32) -> __m256i {
        let idx = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
        let sel = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let spread = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), idx), sel);
        _mm256_and_si256(_mm256_cmpeq_epi8(spread, sel), _mm256_set1_epi8(V))
    }

    /// All rows of panel `p`, in as few tiles of at most 4 rows as that allows, their sizes as
    /// even as possible.
    #[inline(always)]
    unsafe fn panel<const B4: bool, const H: u8, const OFS: bool>(a: &QuantActs, m: usize, w: &PackedQuant, p: usize, out: OutPtr) {
        let tiles = m.div_ceil(4);
        let mut i = 0;
        for t in 0..tiles {
            let rows = (m - i).div_ceil(tiles - t);
            match rows {
                4 => tile::<4, B4, H, OFS>(a, w, i, p, out),
                3 => tile::<3, B4, H, OFS>(a, w, i, p, out),
                2 => tile::<2, B4, H, OFS>(a, w, i, p, out),
                _ => tile::<1, B4, H, OFS>(a, w, i, p, out),
            }
            i += rows;
        }
    }

    /// Panels `p0..p1` for the `m` quantized activation rows in `a`.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be present.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn block(a: &QuantActs, m: usize, w: &PackedQuant, p0: usize, p1: usize, out: OutPtr) {
        for p in p0..p1 {
            by_layout!(w, panel(a, m, w, p, out));
        }
    }
}
