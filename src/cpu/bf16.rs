//! bf16 weights for the CPU fast path, multiplied on AMX tiles where the CPU has them.
//!
//! Why a fourth float format: the f32 and f16 kernels run out of arithmetic before they run out
//! of memory bandwidth once a verification tree passes about 8 rows (512-bit FMAs: 16 rows of an
//! f32 forward need at least 10 ms of arithmetic here), so large trees, the ones that reach
//! τ ≥ 3, cost far more than one token. One AMX `tdpbf16ps` multiplies a 16-row × 32 tile of
//! activations by a 32 × 16 tile of weights (8,192 multiply-adds) in about 16 cycles (4.3 ns
//! measured here), 16 times what both FMA ports do in that time, so with bf16 weights (half the
//! bytes of f32) the arithmetic of 16 or even 32 rows hides under the weight stream: the
//! matmuls' cost stays flat in the row count.
//!
//! Numerics: activations are rounded to bf16 (round to nearest even) and weights are bf16, so
//! every product is exact in f32; the sums are f32. The portable kernel adds each output's
//! products one at a time in input order; AMX adds them in its own fixed order, so the two differ
//! in the last bits (measured here: by up to 1.5e-4 on outputs of magnitude ~1) and bf16 results
//! are the same bits only on one machine. Either way a row's result never depends on how many
//! rows share the call (AMX computes each tile row on its own; the portable kernel each row),
//! which is the batch invariance exactness needs. `SELFSPEC_NO_AMX=1` forces the portable kernel.
use half::bf16;

use crate::cpu::isa::amx_available;
use crate::cpu::matmul::{written_by, OutPtr};

/// Output columns per panel: one AMX tile's 16 columns of f32.
pub const PANEL: usize = 16;
/// Inputs per k-block: one tile row of 32 bf16 values.
pub const KB: usize = 32;
/// Panels computed together (one activation tile feeds four accumulator tiles).
pub const GROUP: usize = 4;
/// Activation rows per tile.
const TILE_ROWS: usize = 16;

/// Weights `[n, k]` packed for the tile product: per group of 4 panels and per k-block, four
/// 1 KB tiles (one per panel) of 16 pair-rows × 16 columns × 2 values, the layout `tdpbf16ps`
/// reads (`w[col][kb*32 + 2r + e]` at pair-row `r`, column `col`, element `e`). Columns and
/// inputs past the matrix are zero, so they add nothing.
pub struct PackedBf16 {
    pub(crate) n: usize,
    pub(crate) k: usize,
    /// `k` rounded up to whole k-blocks.
    kp: usize,
    data: Vec<u16>,
}

impl PackedBf16 {
    pub fn pack(w: &[f32], n: usize, k: usize) -> Self {
        use rayon::prelude::*;
        assert_eq!(w.len(), n * k);
        let kp = k.div_ceil(KB) * KB;
        let groups = n.div_ceil(PANEL * GROUP);
        let group_len = kp * PANEL * GROUP;
        let mut data = vec![0u16; groups * group_len];
        data.par_chunks_mut(group_len).enumerate().for_each(|(g, chunk)| {
            for kb in 0..kp / KB {
                for p in 0..GROUP {
                    let tile = &mut chunk[(kb * GROUP + p) * KB * PANEL..][..KB * PANEL];
                    for c in 0..PANEL {
                        let col = (g * GROUP + p) * PANEL + c;
                        if col >= n {
                            continue;
                        }
                        for r in 0..KB / 2 {
                            for e in 0..2 {
                                let kk = kb * KB + 2 * r + e;
                                if kk < k {
                                    tile[r * PANEL * 2 + c * 2 + e] = bf16::from_f32(w[col * k + kk]).to_bits();
                                }
                            }
                        }
                    }
                }
            }
        });
        PackedBf16 { n, k, kp, data }
    }
    pub fn rows(&self) -> usize {
        self.n
    }
    pub fn cols(&self) -> usize {
        self.k
    }
    /// Bytes one call streams.
    pub fn bytes(&self) -> usize {
        self.data.len() * 2
    }
    /// `w[col][kk]` as stored (the tests' reference).
    #[cfg(test)]
    fn weight(&self, col: usize, kk: usize) -> f32 {
        let (g, p, c) = (col / (PANEL * GROUP), col / PANEL % GROUP, col % PANEL);
        let (kb, r, e) = (kk / KB, kk % KB / 2, kk % 2);
        let at = g * self.kp * PANEL * GROUP + (kb * GROUP + p) * KB * PANEL + r * PANEL * 2 + c * 2 + e;
        bf16::from_bits(self.data[at]).to_f32()
    }
}

/// Activations rounded to bf16, padded with zero inputs to whole k-blocks (row stride `kp`).
fn activations(x: &[f32], m: usize, k: usize, kp: usize) -> Vec<u16> {
    let mut a = vec![0u16; m * kp];
    #[cfg(target_arch = "x86_64")]
    let avx512 = matches!(crate::cpu::isa::isa(), crate::cpu::isa::Isa::Avx512);
    for (row, src) in a.chunks_exact_mut(kp).zip(x.chunks_exact(k)) {
        let row = &mut row[..k];
        #[cfg(target_arch = "x86_64")]
        if avx512 {
            // SAFETY: AVX-512F was detected; `row` has `src.len()` slots.
            unsafe { round_row_avx512(src, row.as_mut_ptr()) };
            continue;
        }
        for (d, s) in row.iter_mut().zip(src) {
            *d = round_to_bf16(*s);
        }
    }
    a
}

/// [`round_to_bf16`] 16 values at a time (the bits are the same: integer rounding, NaN kept).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn round_row_avx512(src: &[f32], dst: *mut u16) {
    use std::arch::x86_64::*;
    let chunks = src.len() / 16;
    for c in 0..chunks {
        let x = _mm512_loadu_ps(src.as_ptr().add(c * 16));
        let b = _mm512_castps_si512(x);
        let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))));
        let nan = _mm512_or_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(0x40));
        let is_nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
        let v = _mm512_mask_blend_epi32(is_nan, rounded, nan);
        _mm256_storeu_si256(dst.add(c * 16) as *mut __m256i, _mm512_cvtepi32_epi16(v));
    }
    for (j, s) in src.iter().enumerate().skip(chunks * 16) {
        *dst.add(j) = round_to_bf16(*s);
    }
}

/// f32 to bf16 bits, rounding to nearest even (as `half` does), written without branches so the
/// loop over a row vectorises: conversion runs on the calling thread between kernels.
#[inline(always)]
fn round_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    // NaN stays NaN (rounding could carry it into infinity): keep its top bits, quiet.
    let nan = ((b >> 16) as u16) | 0x40;
    if x.is_nan() { nan } else { rounded }
}

/// `out[m][n] = sum_k bf16(x[m][k]) * w[n][k]`, batch-invariant.
pub fn matmul_bf16(x: &[f32], m: usize, w: &PackedBf16) -> Vec<f32> {
    matmul_with(x, m, w, amx_available())
}

fn matmul_with(x: &[f32], m: usize, w: &PackedBf16, use_amx: bool) -> Vec<f32> {
    assert_eq!(x.len(), m * w.k, "x has {} values, expected {m}x{}", x.len(), w.k);
    let a = activations(x, m, w.k, w.kp);
    let groups = w.n.div_ceil(PANEL * GROUP);
    let avx2 = !use_amx && crate::cpu::isa::has_avx2();
    // The AVX2 kernel broadcasts activations as f32 (bf16 widens exactly).
    let wide: Vec<f32> = if avx2 { a.iter().map(|&b| f32::from_bits((b as u32) << 16)).collect() } else { Vec::new() };
    // SAFETY: the group ranges cover every column, and each group writes all rows.
    unsafe {
        written_by(m * w.n, |out| {
            crate::cpu::team::for_each_panel_range(groups, 1, |g0, g1| {
                #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
                if use_amx {
                    amx::groups(&a, m, w, g0, g1, out);
                    return;
                }
                #[cfg(target_arch = "x86_64")]
                if avx2 {
                    avx2::groups(&wide, m, w, g0, g1, out);
                    return;
                }
                let _ = (use_amx, avx2);
                portable_groups(&a, m, w, g0, g1, out);
            })
        })
    }
}

/// The reference chain on AVX2 and FMA, for CPUs without AMX: each bf16 product is exact in
/// f32, so a fused multiply-add rounds once exactly as the reference's add does, and the same
/// order gives the same bits. A weight pair-row (16 columns x inputs 2r, 2r + 1) widens to f32
/// by shifts: the even input is a lane's low half, the odd one its high half.
///
/// Why: the portable loop made `--weights bf16` 3x slower than f32 on an AVX2 CPU (one-token
/// forward 50 ms against 17 on a 2-core Zen 3); AMX-less CPUs are most of them.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// `MR` rows x `NR` panels of group `g` (panels `p0..p0 + NR`), over all k-blocks.
    #[inline(always)]
    unsafe fn tile<const MR: usize, const NR: usize>(a: &[f32], w: &PackedBf16, g: usize, p0: usize, i0: usize, out: OutPtr) {
        let kp = w.kp;
        let chunk = w.data.as_ptr().add(g * kp * PANEL * GROUP);
        let high = _mm256_set1_epi32(0xffff_0000u32 as i32);
        let mut acc = [[[_mm256_setzero_ps(); 2]; NR]; MR];
        for kb in 0..kp / KB {
            for r in 0..KB / 2 {
                let mut w0 = [[_mm256_setzero_ps(); 2]; NR];
                let mut w1 = [[_mm256_setzero_ps(); 2]; NR];
                for jj in 0..NR {
                    let pair = chunk.add((kb * GROUP + p0 + jj) * KB * PANEL + r * PANEL * 2);
                    for h in 0..2 {
                        let v = _mm256_loadu_si256(pair.add(h * 16) as *const __m256i);
                        w0[jj][h] = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v));
                        w1[jj][h] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
                    }
                }
                for (ii, row) in acc.iter_mut().enumerate() {
                    let x = a.as_ptr().add((i0 + ii) * kp + kb * KB + 2 * r);
                    let (x0, x1) = (_mm256_broadcast_ss(&*x), _mm256_broadcast_ss(&*x.add(1)));
                    for jj in 0..NR {
                        for h in 0..2 {
                            row[jj][h] = _mm256_fmadd_ps(x0, w0[jj][h], row[jj][h]);
                            row[jj][h] = _mm256_fmadd_ps(x1, w1[jj][h], row[jj][h]);
                        }
                    }
                }
            }
        }
        for (ii, row) in acc.iter().enumerate() {
            for (jj, halves) in row.iter().enumerate() {
                let col = (g * GROUP + p0 + jj) * PANEL;
                let live = w.n.saturating_sub(col).min(PANEL);
                let mut buf = [0f32; PANEL];
                _mm256_storeu_ps(buf.as_mut_ptr(), halves[0]);
                _mm256_storeu_ps(buf.as_mut_ptr().add(8), halves[1]);
                std::ptr::copy_nonoverlapping(buf.as_ptr(), out.0.add((i0 + ii) * w.n + col), live);
            }
        }
    }

    /// Groups `g0..g1` for `m` rows of widened activations (row stride `kp`).
    ///
    /// # Safety
    /// AVX2 and FMA must be present.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn groups(a: &[f32], m: usize, w: &PackedBf16, g0: usize, g1: usize, out: OutPtr) {
        for g in g0..g1 {
            // Panels past the matrix hold zeros; skip them rather than write past `n`.
            let live = w.n.saturating_sub(g * GROUP * PANEL).div_ceil(PANEL).min(GROUP);
            if m == 1 && live == GROUP {
                tile::<1, 4>(a, w, g, 0, 0, out);
                continue;
            }
            for p in 0..live {
                let mut i = 0;
                while i + 4 <= m {
                    tile::<4, 1>(a, w, g, p, i, out);
                    i += 4;
                }
                match m - i {
                    3 => tile::<3, 1>(a, w, g, p, i, out),
                    2 => tile::<2, 1>(a, w, g, p, i, out),
                    1 => tile::<1, 1>(a, w, g, p, i, out),
                    _ => {}
                }
            }
        }
    }
}

/// The reference order: per output, products added one at a time in input order.
fn portable_groups(a: &[u16], m: usize, w: &PackedBf16, g0: usize, g1: usize, out: OutPtr) {
    let kp = w.kp;
    let f = |b: u16| bf16::from_bits(b).to_f32();
    // Every row's accumulators for one panel, so each weight pair-row is widened once for all
    // rows (the weights stream once per call, as on AMX); each output still adds in input order.
    let mut acc = vec![[0f32; PANEL]; m];
    for g in g0..g1 {
        let chunk = &w.data[g * kp * PANEL * GROUP..][..kp * PANEL * GROUP];
        for p in 0..GROUP {
            acc.iter_mut().for_each(|r| *r = [0.0; PANEL]);
            for kb in 0..kp / KB {
                let tile = &chunk[(kb * GROUP + p) * KB * PANEL..][..KB * PANEL];
                for r in 0..KB / 2 {
                    let pair = &tile[r * PANEL * 2..(r + 1) * PANEL * 2];
                    let w0: [f32; PANEL] = std::array::from_fn(|c| f(pair[2 * c]));
                    let w1: [f32; PANEL] = std::array::from_fn(|c| f(pair[2 * c + 1]));
                    for (i, acc) in acc.iter_mut().enumerate() {
                        let (x0, x1) = (f(a[i * kp + kb * KB + 2 * r]), f(a[i * kp + kb * KB + 2 * r + 1]));
                        for c in 0..PANEL {
                            acc[c] += x0 * w0[c];
                            acc[c] += x1 * w1[c];
                        }
                    }
                }
            }
            for (i, acc) in acc.iter().enumerate() {
                for (c, v) in acc.iter().enumerate() {
                    let col = (g * GROUP + p) * PANEL + c;
                    if col < w.n {
                        // SAFETY: in bounds; this group owns these columns.
                        unsafe { *out.0.add(i * w.n + col) = *v };
                    }
                }
            }
        }
    }
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod amx {
    use super::*;
    /// How far ahead (bytes, 4 k-blocks) the two-row-tile loop prefetches its weight tiles into
    /// L1. With two multiplies per weight tile, tile loads that miss the cache stall the loop
    /// (measured: 24 rows of lm_head 2.6 → 1.8–2.0 ms); the one-row loop gains nothing from it.
    const PREFETCH_AHEAD: usize = 16384;
    use std::arch::asm;

    /// Tile configuration (palette 1), all tiles 64 bytes wide. One row tile: tmm0-3
    /// accumulators (16 f32 columns) and tmm4 activations (32 bf16) with `r0` rows; tmm5-7
    /// weights (16 pair-rows × 16 columns). Two row tiles: tmm0-1 and tmm4 with `r0` rows, tmm2-3
    /// and tmm5 with `r1`, tmm6-7 weights. Configuring the real row count means a tile never
    /// reads or writes rows past the matrix, so accumulators store straight into the output.
    #[repr(C, align(64))]
    struct TileConfig([u8; 64]);

    fn config(r0: usize, r1: Option<usize>) -> TileConfig {
        let mut c = [0u8; 64];
        c[0] = 1;
        let rows: [usize; 8] = match r1 {
            None => [r0, r0, r0, r0, r0, 16, 16, 16],
            Some(r1) => [r0, r0, r1, r1, r0, r1, 16, 16],
        };
        for (t, r) in rows.iter().enumerate() {
            c[16 + 2 * t] = 64;
            c[48 + t] = *r as u8;
        }
        TileConfig(c)
    }

    /// Columns `[g0, g1)` groups of 4 panels, every row. Up to 16 rows, one activation tile
    /// feeds four accumulators (one per panel); past 16, two row tiles share each weight tile
    /// (pairs of panels), so the weights still stream once per call instead of once per 16
    /// rows. Each row's tile row sees the same instructions in the same order either way.
    pub(super) unsafe fn groups(a: &[u16], m: usize, w: &PackedBf16, g0: usize, g1: usize, out: OutPtr) {
        let kp = w.kp;
        let mut spare = [[0f32; PANEL * TILE_ROWS]; 4];
        let mut current: Option<(usize, Option<usize>)> = None;
        let mut configure = |shape: (usize, Option<usize>)| {
            if current != Some(shape) {
                let cfg = config(shape.0, shape.1);
                asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack));
                current = Some(shape);
            }
        };
        for g in g0..g1 {
            let wg = w.data.as_ptr().add(g * kp * PANEL * GROUP);
            // Row tiles in pairs, then what is left: a last pair, or a single tile.
            let mut i0 = 0;
            while i0 < m {
                let left = m - i0;
                let ai = a.as_ptr().add(i0 * kp);
                if left > TILE_ROWS {
                    let r1 = (left - TILE_ROWS).min(TILE_ROWS);
                    configure((TILE_ROWS, Some(r1)));
                    for pair in 0..GROUP / 2 {
                        let (p0, p1) = (2 * pair, 2 * pair + 1);
                        let accs = [(i0, TILE_ROWS, p0), (i0, TILE_ROWS, p1), (i0 + TILE_ROWS, r1, p0), (i0 + TILE_ROWS, r1, p1)];
                        with_accumulators(accs, g, w.n, out, &mut spare, |d| two_row_tiles(ai, wg.add(pair * 2 * KB * PANEL), kp, d));
                    }
                    i0 += TILE_ROWS + r1;
                } else {
                    configure((left, None));
                    let accs = std::array::from_fn(|p| (i0, left, p));
                    with_accumulators(accs, g, w.n, out, &mut spare, |d| one_row_tile(ai, wg, kp, d));
                    i0 = m;
                }
            }
        }
        asm!("tilerelease", options(nostack));
    }

    /// Runs `kernel` with the four accumulators' destinations: accumulator `t` holds rows
    /// `[i0, i0 + rows)` of group `g`'s panel `p` (`accs[t] = (i0, rows, p)`). A panel inside
    /// the matrix stores straight into the output (row stride `n` floats); one past the last
    /// column stores into `spare[t]`, and only its columns inside the matrix are copied out.
    unsafe fn with_accumulators(accs: [(usize, usize, usize); 4], g: usize, n: usize, out: OutPtr, spare: &mut [[f32; PANEL * TILE_ROWS]; 4], kernel: impl FnOnce(&[(*mut f32, usize); 4])) {
        let col0 = |p: usize| (g * GROUP + p) * PANEL;
        let d: [(*mut f32, usize); 4] = std::array::from_fn(|t| {
            let (i0, _, p) = accs[t];
            if col0(p) + PANEL <= n {
                (out.0.add(i0 * n + col0(p)), n * 4)
            } else {
                (spare[t].as_mut_ptr(), PANEL * 4)
            }
        });
        kernel(&d);
        for (t, &(i0, rows, p)) in accs.iter().enumerate() {
            if col0(p) + PANEL > n {
                let cols = n.saturating_sub(col0(p)).min(PANEL);
                for ii in 0..rows {
                    std::ptr::copy_nonoverlapping(spare[t][ii * PANEL..].as_ptr(), out.0.add((i0 + ii) * n + col0(p)), cols);
                }
            }
        }
    }

    /// Zero the accumulators tmm0-3 (before a kernel's k loop).
    #[inline(always)]
    unsafe fn zero_accumulators() {
        asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
    }

    /// Store accumulators tmm0-3 to `d[t]` = (address, row stride in bytes). The tile registers
    /// keep their values between `asm!` blocks: nothing else in the program touches them.
    #[inline(always)]
    unsafe fn store_accumulators(d: &[(*mut f32, usize); 4]) {
        asm!(
            "tilestored [{c0} + {d0}], tmm0",
            "tilestored [{c1} + {d1}], tmm1",
            "tilestored [{c2} + {d2}], tmm2",
            "tilestored [{c3} + {d3}], tmm3",
            c0 = in(reg) d[0].0,
            c1 = in(reg) d[1].0,
            c2 = in(reg) d[2].0,
            c3 = in(reg) d[3].0,
            d0 = in(reg) d[0].1,
            d1 = in(reg) d[1].1,
            d2 = in(reg) d[2].1,
            d3 = in(reg) d[3].1,
            options(nostack),
        );
    }

    /// One row tile × the group's four panels over all k-blocks; accumulator `t` (panel `t`)
    /// stores to `d[t]`.
    unsafe fn one_row_tile(a: *const u16, w: *const u16, kp: usize, d: &[(*mut f32, usize); 4]) {
        zero_accumulators();
        asm!(
            "2:",
            "tileloadd tmm4, [{a} + {astride}]",
            "tileloadd tmm5, [{w} + {s64}]",
            "tdpbf16ps tmm0, tmm4, tmm5",
            "tileloadd tmm6, [{w} + {s64} + 1024]",
            "tdpbf16ps tmm1, tmm4, tmm6",
            "tileloadd tmm7, [{w} + {s64} + 2048]",
            "tdpbf16ps tmm2, tmm4, tmm7",
            "tileloadd tmm5, [{w} + {s64} + 3072]",
            "tdpbf16ps tmm3, tmm4, tmm5",
            "add {a}, 64",
            "add {w}, 4096",
            "dec {n}",
            "jnz 2b",
            a = inout(reg) a => _,
            w = inout(reg) w => _,
            n = inout(reg) kp / KB => _,
            astride = in(reg) kp * 2,
            s64 = in(reg) 64usize,
            options(nostack),
        );
        store_accumulators(d);
    }

    /// Two row tiles × two panels of the group (at `w` and `w + 1 KB`); accumulators (first
    /// tile, panel 0), (first, panel 1), (second, panel 0), (second, panel 1) store to `d[0..4]`.
    unsafe fn two_row_tiles(a: *const u16, w: *const u16, kp: usize, d: &[(*mut f32, usize); 4]) {
        zero_accumulators();
        asm!(
            "2:",
            "tileloadd tmm4, [{a} + {astride}]",
            "tileloadd tmm5, [{a2} + {astride}]",
            "tileloadd tmm6, [{w} + {s64}]",
            "tileloadd tmm7, [{w} + {s64} + 1024]",
            "prefetcht0 [{w} + {pf} + 0]",
            "prefetcht0 [{w} + {pf} + 64]",
            "prefetcht0 [{w} + {pf} + 128]",
            "prefetcht0 [{w} + {pf} + 192]",
            "prefetcht0 [{w} + {pf} + 256]",
            "prefetcht0 [{w} + {pf} + 320]",
            "prefetcht0 [{w} + {pf} + 384]",
            "prefetcht0 [{w} + {pf} + 448]",
            "prefetcht0 [{w} + {pf} + 512]",
            "prefetcht0 [{w} + {pf} + 576]",
            "prefetcht0 [{w} + {pf} + 640]",
            "prefetcht0 [{w} + {pf} + 704]",
            "prefetcht0 [{w} + {pf} + 768]",
            "prefetcht0 [{w} + {pf} + 832]",
            "prefetcht0 [{w} + {pf} + 896]",
            "prefetcht0 [{w} + {pf} + 960]",
            "prefetcht0 [{w} + {pf} + 1024]",
            "prefetcht0 [{w} + {pf} + 1088]",
            "prefetcht0 [{w} + {pf} + 1152]",
            "prefetcht0 [{w} + {pf} + 1216]",
            "prefetcht0 [{w} + {pf} + 1280]",
            "prefetcht0 [{w} + {pf} + 1344]",
            "prefetcht0 [{w} + {pf} + 1408]",
            "prefetcht0 [{w} + {pf} + 1472]",
            "prefetcht0 [{w} + {pf} + 1536]",
            "prefetcht0 [{w} + {pf} + 1600]",
            "prefetcht0 [{w} + {pf} + 1664]",
            "prefetcht0 [{w} + {pf} + 1728]",
            "prefetcht0 [{w} + {pf} + 1792]",
            "prefetcht0 [{w} + {pf} + 1856]",
            "prefetcht0 [{w} + {pf} + 1920]",
            "prefetcht0 [{w} + {pf} + 1984]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "add {a}, 64",
            "add {a2}, 64",
            "add {w}, 4096",
            "dec {n}",
            "jnz 2b",
            a = inout(reg) a => _,
            pf = in(reg) PREFETCH_AHEAD,
            a2 = inout(reg) a.add(TILE_ROWS * kp) => _,
            w = inout(reg) w => _,
            n = inout(reg) kp / KB => _,
            astride = in(reg) kp * 2,
            s64 = in(reg) 64usize,
            options(nostack),
        );
        store_accumulators(d);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(len: usize, seed: usize) -> Vec<f32> {
        (0..len).map(|i| (((i * 7919 + seed * 104729) % 2003) as f32 / 1001.0 - 1.0) * 0.7).collect()
    }

    /// The exact chain each output is defined as: bf16 inputs, f32 additions in input order.
    fn reference(x: &[f32], m: usize, w: &PackedBf16) -> Vec<f32> {
        let mut out = vec![0f32; m * w.n];
        for i in 0..m {
            for col in 0..w.n {
                let mut acc = 0f32;
                for kk in 0..w.k {
                    acc += bf16::from_f32(x[i * w.k + kk]).to_f32() * w.weight(col, kk);
                }
                out[i * w.n + col] = acc;
            }
        }
        out
    }

    #[test]
    fn rounding_matches_half() {
        let mut vals = vec![0.0f32, -0.0, 1.0, -1.5, f32::MAX, f32::MIN_POSITIVE, 1e-40, f32::INFINITY, f32::NEG_INFINITY, f32::NAN];
        vals.extend((0..100_000u32).map(|i| f32::from_bits(i.wrapping_mul(2_654_435_761))));
        for v in vals {
            let (got, want) = (round_to_bf16(v), bf16::from_f32(v));
            if v.is_nan() {
                assert!(bf16::from_bits(got).is_nan());
            } else {
                assert_eq!(got, want.to_bits(), "{v:e}");
            }
        }
    }

    #[test]
    fn vector_rounding_matches_scalar() {
        let mut x: Vec<f32> = (0..1000u32).map(|i| f32::from_bits(i.wrapping_mul(2_654_435_761))).collect();
        x.extend([f32::NAN, -f32::NAN, f32::INFINITY, 3.0, -0.0]);
        let (k, kp) = (x.len(), x.len().div_ceil(KB) * KB);
        let a = activations(&x, 1, k, kp);
        for (i, v) in x.iter().enumerate() {
            assert_eq!(a[i], round_to_bf16(*v), "{v:e}");
        }
        assert!(a[k..].iter().all(|&z| z == 0));
    }

    #[test]
    fn avx2_kernel_gives_the_reference_bits() {
        if !crate::cpu::isa::has_avx2() {
            return;
        }
        // 70 columns: a last group with two live panels, the second part-filled.
        let (n, k) = (70, 100);
        let w = PackedBf16::pack(&data(n * k, 7), n, k);
        for m in [1usize, 2, 3, 4, 5, 9] {
            let x = data(m * k, 8 + m);
            let a = activations(&x, m, k, w.kp);
            let wide: Vec<f32> = a.iter().map(|&b| f32::from_bits((b as u32) << 16)).collect();
            let groups = n.div_ceil(PANEL * GROUP);
            let mut port = vec![0f32; m * n];
            portable_groups(&a, m, &w, 0, groups, OutPtr(port.as_mut_ptr()));
            let mut got = vec![f32::NAN; m * n];
            #[cfg(target_arch = "x86_64")]
            unsafe { avx2::groups(&wide, m, &w, 0, groups, OutPtr(got.as_mut_ptr())) };
            assert_eq!(got, port, "m={m}");
        }
    }

    #[test]
    fn portable_kernel_is_the_reference_chain() {
        for (n, k, m) in [(64, 32, 1), (70, 40, 3), (130, 96, 17)] {
            let w = PackedBf16::pack(&data(n * k, 1), n, k);
            let x = data(m * k, 2);
            assert_eq!(matmul_with(&x, m, &w, false), reference(&x, m, &w), "n={n} k={k} m={m}");
        }
    }

    #[test]
    fn close_to_f32_product() {
        let (n, k, m) = (100, 200, 5);
        let wf = data(n * k, 3);
        let x = data(m * k, 4);
        let got = matmul_bf16(&x, m, &PackedBf16::pack(&wf, n, k));
        for i in 0..m {
            for j in 0..n {
                let exact: f32 = (0..k).map(|kk| x[i * k + kk] * wf[j * k + kk]).sum();
                let norm: f32 = (0..k).map(|kk| (x[i * k + kk] * wf[j * k + kk]).abs()).sum();
                assert!((got[i * n + j] - exact).abs() <= 1e-2 * norm, "({i},{j}): {} vs {exact}", got[i * n + j]);
            }
        }
    }

    /// Every row count gives each row the same bits, on whichever kernel this machine runs.
    #[test]
    fn batch_invariant() {
        let (n, k) = (136, 608);
        let w = PackedBf16::pack(&data(n * k, 5), n, k);
        let x = data(40 * k, 6);
        for use_amx in [false, amx_available()] {
            let all = matmul_with(&x, 40, &w, use_amx);
            for m in 1..=40 {
                let part = matmul_with(&x[..m * k], m, &w, use_amx);
                assert_eq!(part[..], all[..m * n], "m={m} amx={use_amx}");
            }
        }
    }

    /// Records whether this machine's AMX adds exactly as the reference chain does.
    #[test]
    fn amx_matches_the_portable_chain_when_present() {
        if !amx_available() {
            return;
        }
        let (n, k, m) = (128, 576, 20);
        let w = PackedBf16::pack(&data(n * k, 7), n, k);
        let x = data(m * k, 8);
        let amx = matmul_with(&x, m, &w, true);
        let portable = matmul_with(&x, m, &w, false);
        let differ = amx.iter().zip(&portable).filter(|(a, b)| a != b).count();
        let worst = amx.iter().zip(&portable).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        eprintln!("AMX vs portable: {differ} of {} outputs differ, worst {worst:e}", amx.len());
        assert!(worst <= 1e-3, "AMX and the portable kernel disagree by {worst}");
    }
}
