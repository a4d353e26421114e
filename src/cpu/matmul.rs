//! Batch-invariant CPU kernels for the decode and verification shapes.
//!
//! Why these exist: greedy self-speculation must emit exactly what plain greedy decoding emits.
//! candle's CPU matmul picks a different kernel (and so a different summation order) for one row
//! than for many, so a tree node's logits could differ in the last bit from the sequential
//! forward's and flip a near-tie argmax. Here every output element `out[m][n]` is one fixed
//! chain of fused multiply-adds over `k` in 16 lanes, then a fixed tree reduction, whatever the
//! number of rows `m` in the call, so row `i` is bit-identical for any batch size.
//!
//! They also read each weight row once for all activation rows (the weight row stays in L1 while
//! every activation row is dotted with it), which is what makes checking a small token tree cost
//! little more than one token on a memory-bound CPU. On other devices the model uses candle's
//! own kernels instead.
use rayon::prelude::*;

use crate::cpu::isa::{isa, Isa};

pub(crate) const LANES: usize = 16;

/// An element type the kernels read as f32: f32 itself, or f16 (the `--weights f16` panels and
/// the default KV cache, at half the bytes to stream). Widening f16 to f32 is exact, so the
/// portable and SIMD paths compute the same bits from the same data.
pub(crate) trait Elem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    /// 16 elements as 16 f32 lanes.
    ///
    /// # Safety
    /// `p` must point at 16 readable elements, on a CPU with AVX-512F.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
    /// 8 elements as 8 f32 lanes.
    ///
    /// # Safety
    /// `p` must point at 8 readable elements, on a CPU with AVX and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl Elem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        std::arch::x86_64::_mm512_loadu_ps(p)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
}

impl Elem for half::f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const half::f16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const half::f16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
}

/// Dot product with a fixed reduction order: 16 interleaved FMA chains, then a pairwise tree.
#[inline(always)]
pub(crate) fn dot_fixed(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    dot_accumulate(a, b, &mut acc);
    reduce_lanes(acc)
}

#[inline(always)]
pub(crate) fn dot_accumulate(a: &[f32], b: &[f32], acc: &mut [f32; LANES]) {
    let n = a.len().min(b.len());
    let chunks = n / LANES;
    for c in 0..chunks {
        let a = &a[c * LANES..c * LANES + LANES];
        let b = &b[c * LANES..c * LANES + LANES];
        for l in 0..LANES {
            acc[l] = a[l].mul_add(b[l], acc[l]);
        }
    }
    for i in chunks * LANES..n {
        let l = i - chunks * LANES;
        acc[l] = a[i].mul_add(b[i], acc[l]);
    }
}

#[inline(always)]
pub(crate) fn reduce_lanes(mut acc: [f32; LANES]) -> f32 {
    let mut w = LANES / 2;
    while w > 0 {
        for l in 0..w {
            acc[l] += acc[l + w];
        }
        w /= 2;
    }
    acc[0]
}

/// Four weight rows against one activation row: shares each activation load across four chains.
/// Each chain is exactly the one `dot_fixed` would compute, so blocking changes no bits.
#[inline(always)]
fn dot4_fixed(x: &[f32], w0: &[f32], w1: &[f32], w2: &[f32], w3: &[f32]) -> [f32; 4] {
    let n = x.len();
    let chunks = n / LANES;
    let mut a0 = [0f32; LANES];
    let mut a1 = [0f32; LANES];
    let mut a2 = [0f32; LANES];
    let mut a3 = [0f32; LANES];
    for c in 0..chunks {
        let r = c * LANES..c * LANES + LANES;
        let xs = &x[r.clone()];
        let (b0, b1, b2, b3) = (&w0[r.clone()], &w1[r.clone()], &w2[r.clone()], &w3[r]);
        for l in 0..LANES {
            a0[l] = xs[l].mul_add(b0[l], a0[l]);
            a1[l] = xs[l].mul_add(b1[l], a1[l]);
            a2[l] = xs[l].mul_add(b2[l], a2[l]);
            a3[l] = xs[l].mul_add(b3[l], a3[l]);
        }
    }
    for i in chunks * LANES..n {
        let l = i - chunks * LANES;
        a0[l] = x[i].mul_add(w0[i], a0[l]);
        a1[l] = x[i].mul_add(w1[i], a1[l]);
        a2[l] = x[i].mul_add(w2[i], a2[l]);
        a3[l] = x[i].mul_add(w3[i], a3[l]);
    }
    [reduce_lanes(a0), reduce_lanes(a1), reduce_lanes(a2), reduce_lanes(a3)]
}

/// The first `live` of 16 lanes (all 16 when `live >= 16`), for a vector pass's last block.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn tail_mask(live: usize) -> std::arch::x86_64::__mmask16 {
    if live >= 16 { 0xffff } else { ((1u32 << live) - 1) as u16 }
}

/// Output pointer shared across rayon tasks that write disjoint columns.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub(crate) *mut f32);
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The pointer `i` values further on (callers keep within the buffer).
    pub(crate) fn offset(&self, i: usize) -> OutPtr {
        OutPtr(self.0.wrapping_add(i))
    }
}

/// An output buffer that `fill` writes completely, without zeroing it first: zeroing the
/// outputs of a forward's matmuls (each a fresh allocation) took a few percent of an 8-row
/// forward, all on the calling thread while the team waited.
///
/// # Safety
/// `fill` must write every one of the `len` elements through the pointer it is given (the
/// kernels do: every tile stores all its rows and live columns), and must not read any it
/// has not written.
pub(crate) unsafe fn written_by(len: usize, fill: impl FnOnce(OutPtr)) -> Vec<f32> {
    filled(len, |out| fill(OutPtr(out.as_mut_ptr() as *mut f32)))
}

/// [`written_by`] for row kernels that write through slices: `fill` gets the `len` values as
/// `MaybeUninit` (never a `&mut [f32]` over uninitialised memory). The norms' and SwiGLU's
/// outputs were zero-filled allocations (mimalloc clears a reused block): memset was 1.05% of
/// an 8-row native SmolLM2 forward's samples in `perf`, 0.71% after.
///
/// # Safety
/// `fill` must write every one of the `len` values.
pub(crate) unsafe fn filled(len: usize, fill: impl FnOnce(&mut [std::mem::MaybeUninit<f32>])) -> Vec<f32> {
    let mut out = Vec::with_capacity(len);
    fill(&mut out.spare_capacity_mut()[..len]);
    // SAFETY: `fill` wrote every one of the `len` values (the caller's contract).
    out.set_len(len);
    out
}

#[inline(always)]
fn matmul_block(x: &[f32], m: usize, k: usize, w: &[f32], n0: usize, n1: usize, n: usize, out: OutPtr) {
    let mut j = n0;
    while j + 4 <= n1 {
        let w0 = &w[j * k..(j + 1) * k];
        let w1 = &w[(j + 1) * k..(j + 2) * k];
        let w2 = &w[(j + 2) * k..(j + 3) * k];
        let w3 = &w[(j + 3) * k..(j + 4) * k];
        for i in 0..m {
            let r = dot4_fixed(&x[i * k..(i + 1) * k], w0, w1, w2, w3);
            // SAFETY: column range [n0, n1) is owned by this task; i < m, j + 3 < n.
            unsafe {
                let p = out.0.add(i * n + j);
                *p = r[0];
                *p.add(1) = r[1];
                *p.add(2) = r[2];
                *p.add(3) = r[3];
            }
        }
        j += 4;
    }
    while j < n1 {
        let wj = &w[j * k..(j + 1) * k];
        for i in 0..m {
            let r = dot_fixed(&x[i * k..(i + 1) * k], wj);
            unsafe { *out.0.add(i * n + j) = r };
        }
        j += 1;
    }
}

/// AVX-512 tiles: `MR` activation rows x `NR` weight rows, one zmm accumulator per output
/// element. Lane `l` of the accumulator for `(i, j)` sums `x[i][c*16+l] * w[j][c*16+l]` over
/// chunks `c` in order, exactly the chain `dot_accumulate` computes, so tiling changes no bits.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{OutPtr, LANES};
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn tile<const MR: usize, const NR: usize>(x: *const f32, k: usize, w: *const f32, i0: usize, j0: usize, n: usize, out: OutPtr, pf: *const f32) {
        let mut acc = [[_mm512_setzero_ps(); NR]; MR];
        let chunks = k / LANES;
        let rem = k % LANES;
        for c in 0..chunks {
            let off = c * LANES;
            if !pf.is_null() {
                // Pull the next weight group into cache while this one is computed, so memory
                // traffic overlaps the arithmetic when there are several activation rows.
                for jj in 0..NR {
                    _mm_prefetch::<_MM_HINT_T0>(pf.add(jj * k + off) as *const i8);
                }
            }
            let mut wv = [_mm512_setzero_ps(); NR];
            for (jj, wv) in wv.iter_mut().enumerate() {
                *wv = _mm512_loadu_ps(w.add((j0 + jj) * k + off));
            }
            for (ii, row) in acc.iter_mut().enumerate() {
                let xv = _mm512_loadu_ps(x.add((i0 + ii) * k + off));
                for jj in 0..NR {
                    row[jj] = _mm512_fmadd_ps(xv, wv[jj], row[jj]);
                }
            }
        }
        if rem > 0 {
            let mask: __mmask16 = ((1u32 << rem) - 1) as __mmask16;
            let off = chunks * LANES;
            let mut wv = [_mm512_setzero_ps(); NR];
            for (jj, wv) in wv.iter_mut().enumerate() {
                *wv = _mm512_maskz_loadu_ps(mask, w.add((j0 + jj) * k + off));
            }
            for (ii, row) in acc.iter_mut().enumerate() {
                let xv = _mm512_maskz_loadu_ps(mask, x.add((i0 + ii) * k + off));
                for jj in 0..NR {
                    // Only the live lanes change, as in the portable tail loop.
                    row[jj] = _mm512_mask3_fmadd_ps(xv, wv[jj], row[jj], mask);
                }
            }
        }
        for (ii, row) in acc.iter().enumerate() {
            for (jj, a) in row.iter().enumerate() {
                *out.0.add((i0 + ii) * n + j0 + jj) = hsum_tree(*a);
            }
        }
    }

    /// The same pairwise tree as `reduce_lanes` (l + 8, then + 4, + 2, + 1), in registers.
    #[inline(always)]
    unsafe fn hsum_tree(a: __m512) -> f32 {
        let y = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps::<1>(a));
        let x = _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps::<1>(y));
        let z = _mm_add_ps(x, _mm_movehl_ps(x, x));
        let r = _mm_add_ss(z, _mm_shuffle_ps::<1>(z, z));
        _mm_cvtss_f32(r)
    }

    #[inline(always)]
    unsafe fn rows<const NR: usize>(x: *const f32, m: usize, k: usize, w: *const f32, j0: usize, n: usize, out: OutPtr, next: *const f32) {
        let mut i = 0;
        let mut pf = next;
        while i + 4 <= m {
            tile::<4, NR>(x, k, w, i, j0, n, out, pf);
            pf = std::ptr::null();
            i += 4;
        }
        match m - i {
            3 => tile::<3, NR>(x, k, w, i, j0, n, out, pf),
            2 => tile::<2, NR>(x, k, w, i, j0, n, out, pf),
            1 => tile::<1, NR>(x, k, w, i, j0, n, out, pf),
            _ => {}
        }
    }

    #[target_feature(enable = "avx512f,avx512dq")]
    pub unsafe fn block(x: &[f32], m: usize, k: usize, w: &[f32], n0: usize, n1: usize, n: usize, out: OutPtr) {
        let (xp, wp) = (x.as_ptr(), w.as_ptr());
        let mut j = n0;
        while j + 4 <= n1 {
            let next = if j + 8 <= n1 { wp.add((j + 4) * k) } else { std::ptr::null() };
            rows::<4>(xp, m, k, wp, j, n, out, next);
            j += 4;
        }
        while j < n1 {
            rows::<1>(xp, m, k, wp, j, n, out, std::ptr::null());
            j += 1;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn matmul_block_avx2(x: &[f32], m: usize, k: usize, w: &[f32], n0: usize, n1: usize, n: usize, out: OutPtr) {
    matmul_block(x, m, k, w, n0, n1, n, out)
}

/// Rows up to which a layer without a packed copy ([`matmul_xwt`], e.g. the heads' first layer)
/// uses the batch-invariant kernel; larger calls use candle's gemm. Packed weights
/// ([`matmul_packed`]) take every row count.
pub const ROW_KERNEL_MAX_ROWS: usize = 64;

/// `out[m][n] = sum_k x[m][k] * w[n][k]` (a linear layer without bias), batch-invariant.
/// All arithmetic is IEEE fused multiply-add in one fixed order, so the result is the same bits
/// on every instruction set path.
pub fn matmul_xwt(x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
    assert_eq!(x.len(), m * k, "x has {} values, expected {m}x{k}", x.len());
    assert_eq!(w.len(), n * k, "w has {} values, expected {n}x{k}", w.len());
    // Blocks of columns large enough to amortise task overhead, small enough to balance 2+ cores.
    let block = (n / (crate::cpu::team::threads() * 8)).clamp(16, 512) / 4 * 4;
    let block = block.max(4);
    let nblocks = n.div_ceil(block);
    let isa = isa();
    // SAFETY: the column blocks cover 0..n and each writes its columns of every row.
    unsafe {
        written_by(m * n, |ptr| {
            crate::cpu::team::run(nblocks, &|b| {
                let n0 = b * block;
                let n1 = (n0 + block).min(n);
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 => avx512::block(x, m, k, w, n0, n1, n, ptr),
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => matmul_block_avx2(x, m, k, w, n0, n1, n, ptr),
                    Isa::Portable => matmul_block(x, m, k, w, n0, n1, n, ptr),
                }
            })
        })
    }
}

/// A weight matrix `[n, k]` repacked into panels of 16 output columns, each stored `[k][16]`, so
/// the kernel streams it once and keeps 16 outputs per vector register.
///
/// With this layout every output `out[i][j]` is a single fused multiply-add chain over `k` in
/// order, with no horizontal reduction, so it is batch-invariant whatever the tiling.
pub struct PackedWeight {
    k: usize,
    n: usize,
    data: Vec<f32>,
}

pub const PANEL: usize = 16;

impl PackedWeight {
    pub fn pack(w: &[f32], n: usize, k: usize) -> Self {
        assert_eq!(w.len(), n * k, "weight has {} values, expected {n}x{k}", w.len());
        let panels = n.div_ceil(PANEL);
        let mut data = vec![0f32; panels * k * PANEL];
        data.par_chunks_mut(k * PANEL).enumerate().for_each(|(p, panel)| {
            for c in 0..PANEL {
                let j = p * PANEL + c;
                if j < n {
                    for kk in 0..k {
                        panel[kk * PANEL + c] = w[j * k + kk];
                    }
                }
            }
        });
        PackedWeight { k, n, data }
    }
    pub fn rows(&self) -> usize {
        self.n
    }
    pub fn cols(&self) -> usize {
        self.k
    }
}

/// Portable version of the packed kernel: the same chains, one output at a time.
#[inline(always)]
fn packed_block(x: &[f32], m: usize, pw: &PackedWeight, p0: usize, p1: usize, out: OutPtr) {
    let (k, n) = (pw.k, pw.n);
    for p in p0..p1 {
        let panel = &pw.data[p * k * PANEL..(p + 1) * k * PANEL];
        for i in 0..m {
            let xr = &x[i * k..(i + 1) * k];
            let mut acc = [0f32; PANEL];
            for kk in 0..k {
                let xv = xr[kk];
                let wv = &panel[kk * PANEL..kk * PANEL + PANEL];
                for c in 0..PANEL {
                    acc[c] = xv.mul_add(wv[c], acc[c]);
                }
            }
            for c in 0..PANEL {
                let j = p * PANEL + c;
                if j < n {
                    unsafe { *out.0.add(i * n + j) = acc[c] };
                }
            }
        }
    }
}

/// The input ranges of a tile over `k0..k1` that prefetches `ahead` inputs on, each with the
/// offset its prefetches add. From input `wrap` on, a panel's stream runs past its end, and
/// the prefetches go to the next tile's panels instead: panel `p0 + NR + jj` at input
/// `kk + ahead - k` lies `(NR - 1) * panel_len` elements after where panel `p0 + jj` would
/// continue. Two loops, each with a fixed offset, keep the address arithmetic out of the inner
/// loop (a select and a multiply per input were a third of the instructions of a 6 x 4 tile,
/// more than the front end could issue beside the FMAs: f16 8-token forwards 12.2 -> 10.9 ms
/// on the Xeon, interleaved A/B; f32 unchanged).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_ranges(k: usize, k0: usize, k1: usize, ahead: usize, nr: usize, panel_len: usize) -> [(usize, usize, usize); 2] {
    let wrap = k.saturating_sub(ahead).clamp(k0, k1);
    [(k0, wrap, 0), (wrap, k1, (nr - 1) * panel_len)]
}

/// Prefetch into L2, for input `kk`, the weights `ahead` inputs on in each of `nr` panels from
/// `wb` (plus `beyond`, see [`prefetch_ranges`]).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn prefetch_panels<E>(wb: *const E, kk: usize, ahead: usize, beyond: usize, nr: usize, panel_len: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
    let pf = wb.wrapping_add((kk + ahead) * PANEL + beyond);
    for jj in 0..nr {
        _mm_prefetch::<_MM_HINT_T1>(pf.wrapping_add(jj * panel_len) as *const i8);
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512_packed {
    use super::{Elem, OutPtr, PackedWeight, PANEL};
    use std::arch::x86_64::*;

    /// `MR` activation rows x `NR` panels (16 columns each), over inputs `k0..k1`, prefetching
    /// `ahead` inputs on when `PREFETCH` (the argument is unused otherwise). A tile that
    /// does not start at input 0 resumes the partial sums it left in `out`: storing an f32 and
    /// loading it back is exact, so each output is still one unbroken FMA chain in input order.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<E: Elem, const MR: usize, const NR: usize, const PREFETCH: bool>(x: *const f32, k: usize, w: *const E, i0: usize, p0: usize, n: usize, out: OutPtr, k0: usize, k1: usize, ahead: usize) {
        let mut acc = [[_mm512_setzero_ps(); NR]; MR];
        if k0 > 0 {
            load_tile(&mut acc, i0, p0, n, out);
        }
        let panel_len = k * PANEL;
        let (wb, xb) = (w.add(p0 * panel_len), x.add(i0 * k));
        for (from, to, beyond) in super::prefetch_ranges(k, k0, k1, ahead, NR, panel_len) {
            for kk in from..to {
                if PREFETCH {
                    super::prefetch_panels(wb, kk, ahead, beyond, NR, panel_len);
                }
                let mut wv = [_mm512_setzero_ps(); NR];
                for (jj, wv) in wv.iter_mut().enumerate() {
                    *wv = E::load16(wb.add(jj * panel_len + kk * PANEL));
                }
                for (ii, row) in acc.iter_mut().enumerate() {
                    let xv = _mm512_set1_ps(*xb.add(ii * k + kk));
                    for jj in 0..NR {
                        row[jj] = _mm512_fmadd_ps(xv, wv[jj], row[jj]);
                    }
                }
            }
        }
        store_tile(&acc, i0, p0, n, out);
    }

    /// The partial sums [`store_tile`] left, with the same column mask.
    #[inline(always)]
    unsafe fn load_tile<const MR: usize, const NR: usize>(acc: &mut [[__m512; NR]; MR], i0: usize, p0: usize, n: usize, out: OutPtr) {
        for (ii, row) in acc.iter_mut().enumerate() {
            for (jj, a) in row.iter_mut().enumerate() {
                let col = (p0 + jj) * PANEL;
                let live = n.saturating_sub(col).min(PANEL);
                let mask: __mmask16 = if live >= PANEL { 0xffff } else { ((1u32 << live) - 1) as __mmask16 };
                *a = _mm512_maskz_loadu_ps(mask, out.0.add((i0 + ii) * n + col));
            }
        }
    }

    /// Write an `MR` rows x `NR` panels tile of outputs, masking the columns past `n` in the
    /// last panel. Shared by the f32/f16 and the integer kernels.
    #[inline(always)]
    pub(crate) unsafe fn store_tile<const MR: usize, const NR: usize>(acc: &[[__m512; NR]; MR], i0: usize, p0: usize, n: usize, out: OutPtr) {
        for (ii, row) in acc.iter().enumerate() {
            for (jj, a) in row.iter().enumerate() {
                let col = (p0 + jj) * PANEL;
                let live = n.saturating_sub(col).min(PANEL);
                let mask: __mmask16 = if live >= PANEL { 0xffff } else { ((1u32 << live) - 1) as __mmask16 };
                _mm512_mask_storeu_ps(out.0.add((i0 + ii) * n + col), mask, *a);
            }
        }
    }

    /// Inputs per slice when the rows need more than one tile (17 rows or more; 7-16 rows go
    /// through [`one_pass`]).
    ///
    /// Why slices: with rows in several tiles, running each tile over all of `k` in turn streams
    /// the panels from memory during the first tile and from L2 during the others, with the
    /// memory bus idle meanwhile. Taking every tile over one slice of the panels (16 KB of f32,
    /// in L1) before the next keeps the weight stream steadier; the overlap is still partial (the
    /// bus idles while the tiles after the first run), which is why 7-16 rows avoid slices.
    const K_SLICE: usize = 64;
    /// How far ahead (in inputs) the first tile of a slice prefetches: well inside the next
    /// slice rather than all of it. Fetching the whole next slice during the first tile leaves
    /// the bus idle while the other tiles run; a short lookahead keeps each tile's own demand
    /// stream ahead instead. 13-24-row forwards 4-7% faster (16 rows 24.4-25.7 -> 23.7-23.9 ms,
    /// interleaved A/B over 16, 24, 32 and 64); one-pass and single tiles keep `K_SLICE` (16 was
    /// slower there: 8 rows 17.5 -> 18.4 ms).
    const SLICED_AHEAD: usize = 24;

    #[inline(always)]
    unsafe fn panels<E: Elem, const NR: usize>(x: *const f32, m: usize, k: usize, w: *const E, p: usize, n: usize, out: OutPtr) {
        let slice = if m <= 6 { k } else { K_SLICE };
        let mut k0 = 0;
        // At least one pass, even for an empty `k`, so every output is written.
        loop {
            let k1 = (k0 + slice).min(k);
            let mut i = 0;
            if m > 6 {
                // The first tile of each slice prefetches SLICED_AHEAD inputs on.
                tile::<E, 6, NR, true>(x, k, w, 0, p, n, out, k0, k1, SLICED_AHEAD);
                i = 6;
            } else if m > 0 {
                // One tile of 1-6 rows: it fetches ahead too (the arithmetic of extra rows
                // otherwise stalls the stream). One row gains too: f16 one-token forwards
                // 8.1-8.4 -> 7.2-7.3 ms (widening f16 slows the loads the hardware prefetcher
                // follows), f32 16.2-17.1 -> 15.7-15.9 ms (interleaved A/B, 3 rounds).
                match m {
                    6 => tile::<E, 6, NR, true>(x, k, w, 0, p, n, out, k0, k1, K_SLICE),
                    5 => tile::<E, 5, NR, true>(x, k, w, 0, p, n, out, k0, k1, K_SLICE),
                    4 => tile::<E, 4, NR, true>(x, k, w, 0, p, n, out, k0, k1, K_SLICE),
                    3 => tile::<E, 3, NR, true>(x, k, w, 0, p, n, out, k0, k1, K_SLICE),
                    2 => tile::<E, 2, NR, true>(x, k, w, 0, p, n, out, k0, k1, K_SLICE),
                    _ => tile::<E, 1, NR, true>(x, k, w, 0, p, n, out, k0, k1, K_SLICE),
                }
                i = m;
            }
            while i + 6 <= m {
                tile::<E, 6, NR, false>(x, k, w, i, p, n, out, k0, k1, K_SLICE);
                i += 6;
            }
            match m - i {
                5 => tile::<E, 5, NR, false>(x, k, w, i, p, n, out, k0, k1, K_SLICE),
                4 => tile::<E, 4, NR, false>(x, k, w, i, p, n, out, k0, k1, K_SLICE),
                3 => tile::<E, 3, NR, false>(x, k, w, i, p, n, out, k0, k1, K_SLICE),
                2 => tile::<E, 2, NR, false>(x, k, w, i, p, n, out, k0, k1, K_SLICE),
                1 => tile::<E, 1, NR, false>(x, k, w, i, p, n, out, k0, k1, K_SLICE),
                _ => {}
            }
            k0 = k1;
            if k0 >= k {
                break;
            }
        }
    }

    /// Panels `p0..p1` of a `[n, k]` weight stored as `[panel][k][16]` elements at `w`.
    ///
    /// # Safety
    /// AVX-512F must be present; `w` must hold `ceil(n/16) * k * 16` elements and `x` `m * k`.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn block_of<E: Elem>(x: &[f32], m: usize, k: usize, n: usize, w: *const E, p0: usize, p1: usize, out: OutPtr) {
        let xp = x.as_ptr();
        // 7 to 12 rows fit one tile of 2-3 panels (at most 24 accumulators), so the weights
        // stream once with every row's arithmetic in the same loop as their prefetches; the
        // slices below run the prefetching tile first and the others after, with the memory bus
        // idle meanwhile (1536 x 576 weight streamed from DRAM, 12 rows: 0.09 ms against 0.14).
        // 13 to 16 rows (the largest `auto` trees) go in one tile of one panel the same way:
        // SmolLM2 forwards of 13 and 16 tokens 19-20% faster in f32 and 15-17% in f16 than in
        // slices of 6-row tiles (Zen 4, `bench`, interleaved rounds: f32 16 tokens 30.2-32.3 ->
        // 24.7-26.4 ms).
        match m {
            7 => return one_pass::<E, 7, 3>(xp, k, w, p0, p1, n, out),
            8 => return one_pass::<E, 8, 3>(xp, k, w, p0, p1, n, out),
            9 => return one_pass::<E, 9, 2>(xp, k, w, p0, p1, n, out),
            10 => return one_pass::<E, 10, 2>(xp, k, w, p0, p1, n, out),
            11 => return one_pass::<E, 11, 2>(xp, k, w, p0, p1, n, out),
            12 => return one_pass::<E, 12, 2>(xp, k, w, p0, p1, n, out),
            13 => return one_pass::<E, 13, 1>(xp, k, w, p0, p1, n, out),
            14 => return one_pass::<E, 14, 1>(xp, k, w, p0, p1, n, out),
            15 => return one_pass::<E, 15, 1>(xp, k, w, p0, p1, n, out),
            16 => return one_pass::<E, 16, 1>(xp, k, w, p0, p1, n, out),
            _ => {}
        }
        let mut p = p0;
        while p + 4 <= p1 {
            panels::<E, 4>(xp, m, k, w, p, n, out);
            p += 4;
        }
        while p < p1 {
            panels::<E, 1>(xp, m, k, w, p, n, out);
            p += 1;
        }
    }

    /// All `MR` rows in one pass over the panels, `NR` panels at a time (the last ones alone).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn one_pass<E: Elem, const MR: usize, const NR: usize>(x: *const f32, k: usize, w: *const E, p0: usize, p1: usize, n: usize, out: OutPtr) {
        let mut p = p0;
        while p + NR <= p1 {
            tile::<E, MR, NR, true>(x, k, w, 0, p, n, out, 0, k, K_SLICE);
            p += NR;
        }
        while p < p1 {
            tile::<E, MR, 1, true>(x, k, w, 0, p, n, out, 0, k, K_SLICE);
            p += 1;
        }
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn block(x: &[f32], m: usize, pw: &PackedWeight, p0: usize, p1: usize, out: OutPtr) {
        block_of(x, m, pw.k, pw.n, pw.data.as_ptr(), p0, p1, out)
    }
}

/// AVX2 + FMA tiles for CPUs without AVX-512 (AMD Zen 1-3, Intel client cores since Alder
/// Lake). Each output is the same single FMA chain over the inputs in order as in
/// [`avx512_packed`] and the portable [`packed_block`], so every path gives the same bits; a
/// 16-column panel is two 8-lane registers here, and with 16 registers a tile holds at most 12
/// accumulators (6 rows of one panel, or one row of four).
///
/// Why not the portable loop compiled for AVX2: it keeps one row's 16 outputs in two registers,
/// so each FMA waits on the one before (latency-bound at a quarter of the FMA rate), and it
/// reads a panel once per row. On a 2-core Zen 3 a 16-token f32 forward cost 8.8x one token's.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2_packed {
    use super::{Elem, OutPtr, PANEL};
    use std::arch::x86_64::*;

    /// Inputs per slice when the rows need more than one tile: each slice of a panel (4 KB of
    /// f32) stays in L1 while every row tile takes it.
    const K_SLICE: usize = 64;

    /// `MR` rows x `NR` panels over inputs `k0..k1`, resuming the partial sums in `out` when
    /// `k0 > 0` (an f32 stored and loaded back is exact, so each output stays one chain), and
    /// prefetching into L2 `ahead` inputs on when `PREFETCH` (past the end of its panels, into
    /// the next tile's, as [`super::avx512_packed`] does).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<E: Elem, const MR: usize, const NR: usize, const PREFETCH: bool>(x: *const f32, k: usize, w: *const E, i0: usize, p0: usize, n: usize, out: OutPtr, k0: usize, k1: usize, ahead: usize) {
        let mut acc = [[[_mm256_setzero_ps(); 2]; NR]; MR];
        if k0 > 0 {
            for (ii, row) in acc.iter_mut().enumerate() {
                for (jj, a) in row.iter_mut().enumerate() {
                    let col = (p0 + jj) * PANEL;
                    let live = n.saturating_sub(col).min(PANEL);
                    let src = out.0.add((i0 + ii) * n + col);
                    if live == PANEL {
                        *a = [_mm256_loadu_ps(src), _mm256_loadu_ps(src.add(8))];
                    } else {
                        let mut buf = [0f32; PANEL];
                        std::ptr::copy_nonoverlapping(src, buf.as_mut_ptr(), live);
                        *a = [_mm256_loadu_ps(buf.as_ptr()), _mm256_loadu_ps(buf.as_ptr().add(8))];
                    }
                }
            }
        }
        let panel_len = k * PANEL;
        let (wb, xb) = (w.add(p0 * panel_len), x.add(i0 * k));
        for (from, to, beyond) in super::prefetch_ranges(k, k0, k1, ahead, NR, panel_len) {
            for kk in from..to {
                if PREFETCH {
                    super::prefetch_panels(wb, kk, ahead, beyond, NR, panel_len);
                }
                let mut wv = [[_mm256_setzero_ps(); 2]; NR];
                for (jj, wv) in wv.iter_mut().enumerate() {
                    let q = wb.add(jj * panel_len + kk * PANEL);
                    *wv = [E::load8(q), E::load8(q.add(8))];
                }
                for (ii, row) in acc.iter_mut().enumerate() {
                    let xv = _mm256_broadcast_ss(&*xb.add(ii * k + kk));
                    for jj in 0..NR {
                        row[jj][0] = _mm256_fmadd_ps(xv, wv[jj][0], row[jj][0]);
                        row[jj][1] = _mm256_fmadd_ps(xv, wv[jj][1], row[jj][1]);
                    }
                }
            }
        }
        for (ii, row) in acc.iter().enumerate() {
            for (jj, a) in row.iter().enumerate() {
                let col = (p0 + jj) * PANEL;
                let live = n.saturating_sub(col).min(PANEL);
                let dst = out.0.add((i0 + ii) * n + col);
                if live == PANEL {
                    _mm256_storeu_ps(dst, a[0]);
                    _mm256_storeu_ps(dst.add(8), a[1]);
                } else {
                    let mut buf = [0f32; PANEL];
                    _mm256_storeu_ps(buf.as_mut_ptr(), a[0]);
                    _mm256_storeu_ps(buf.as_mut_ptr().add(8), a[1]);
                    std::ptr::copy_nonoverlapping(buf.as_ptr(), dst, live);
                }
            }
        }
    }

    /// Up to 6 rows in one tile over all inputs, `NR` panels at a time (the last ones alone),
    /// prefetching `ahead` inputs on when `PREFETCH`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn one_pass<E: Elem, const MR: usize, const NR: usize, const PREFETCH: bool>(x: *const f32, k: usize, w: *const E, p0: usize, p1: usize, n: usize, out: OutPtr, ahead: usize) {
        let mut p = p0;
        while p + NR <= p1 {
            tile::<E, MR, NR, PREFETCH>(x, k, w, 0, p, n, out, 0, k, ahead);
            p += NR;
        }
        while p < p1 {
            tile::<E, MR, 1, PREFETCH>(x, k, w, 0, p, n, out, 0, k, ahead);
            p += 1;
        }
    }

    /// How far ahead (in inputs) a lone tile of 2-6 rows prefetches its panels into L2: about
    /// 1-2 KB of each panel's stream. Interleaved A/B on the 2-core Zen 3 (`selfspec bench`, 5-6
    /// rounds each): f16 4-token forwards 14.2 -> 12.4 ms with 64 inputs ahead, and 16 was 5-15%
    /// slower than 64; f32 2-, 3-, 4- and 6-token forwards 17.7 -> 17.0, 18.8 -> 17.3, 21.0 ->
    /// 20.2 and 23.5 -> 21.1 ms with 16 ahead (a second run agreed, -5 to -8%), while 64 ahead
    /// was no faster than none. One-row tiles never prefetch: slower in both formats (f16 8.4
    /// -> 9.7 ms). The first tile of a slice (7 rows or more) prefetches too: see [`slice_tile`].
    #[inline(always)]
    fn few_rows_ahead<E: Elem>() -> usize {
        if std::mem::size_of::<E>() == 2 {
            K_SLICE
        } else {
            16
        }
    }

    /// 2-6 rows in one tile over all inputs.
    #[inline(always)]
    unsafe fn few_rows<E: Elem, const MR: usize, const NR: usize>(x: *const f32, k: usize, w: *const E, p0: usize, p1: usize, n: usize, out: OutPtr) {
        one_pass::<E, MR, NR, true>(x, k, w, p0, p1, n, out, few_rows_ahead::<E>())
    }

    /// One tile of a slice; the first of each slice fetches the next one while the others work
    /// from L1, so the memory bus is not idle meanwhile. Interleaved A/B on the 2-core Zen 3
    /// (`selfspec bench`, 5 rounds each): f32 8-token forwards 29.9 -> 27.3 and 28.4 -> 26.2 ms,
    /// 16 tokens 42.6 -> 39.5 ms (two earlier 3-4-round runs: 31.0 -> 28.2-29.2 and 29.9 ->
    /// 31.4); f16 8 and 16 tokens 21.9 -> 19.4 and 42.3 -> 34.8 ms.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn slice_tile<E: Elem, const MR: usize>(first: bool, x: *const f32, k: usize, w: *const E, i0: usize, p: usize, n: usize, out: OutPtr, k0: usize, k1: usize) {
        if first {
            tile::<E, MR, 1, true>(x, k, w, i0, p, n, out, k0, k1, K_SLICE)
        } else {
            tile::<E, MR, 1, false>(x, k, w, i0, p, n, out, k0, k1, 0)
        }
    }

    /// Panels `p0..p1` of a `[n, k]` weight stored as `[panel][k][16]` elements at `w`.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be present; `w` must hold `ceil(n/16) * k * 16` elements and `x`
    /// `m * k`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn block_of<E: Elem>(x: &[f32], m: usize, k: usize, n: usize, w: *const E, p0: usize, p1: usize, out: OutPtr) {
        let xp = x.as_ptr();
        match m {
            0 => return,
            1 => return one_pass::<E, 1, 4, false>(xp, k, w, p0, p1, n, out, 0),
            2 => return few_rows::<E, 2, 2>(xp, k, w, p0, p1, n, out),
            3 => return few_rows::<E, 3, 2>(xp, k, w, p0, p1, n, out),
            4 => return few_rows::<E, 4, 1>(xp, k, w, p0, p1, n, out),
            5 => return few_rows::<E, 5, 1>(xp, k, w, p0, p1, n, out),
            6 => return few_rows::<E, 6, 1>(xp, k, w, p0, p1, n, out),
            _ => {}
        }
        // Rows in as few tiles as 6-row tiles allow, their sizes as even as possible (8 rows as
        // 4 + 4, not 6 + 2: a 2-row tile has 4 accumulators, too few chains to keep both FMA
        // ports busy).
        let tiles = m.div_ceil(6);
        for p in p0..p1 {
            let mut k0 = 0;
            // At least one pass, even for an empty `k`, so every output is written.
            loop {
                let k1 = (k0 + K_SLICE).min(k);
                let mut i = 0;
                for t in 0..tiles {
                    let rows = (m - i).div_ceil(tiles - t);
                    match rows {
                        6 => slice_tile::<E, 6>(t == 0, xp, k, w, i, p, n, out, k0, k1),
                        5 => slice_tile::<E, 5>(t == 0, xp, k, w, i, p, n, out, k0, k1),
                        4 => slice_tile::<E, 4>(t == 0, xp, k, w, i, p, n, out, k0, k1),
                        3 => slice_tile::<E, 3>(t == 0, xp, k, w, i, p, n, out, k0, k1),
                        2 => slice_tile::<E, 2>(t == 0, xp, k, w, i, p, n, out, k0, k1),
                        _ => slice_tile::<E, 1>(t == 0, xp, k, w, i, p, n, out, k0, k1),
                    }
                    i += rows;
                }
                k0 = k1;
                if k0 >= k {
                    break;
                }
            }
        }
    }
}

/// `out[m][n] = sum_k x[m][k] * w[n][k]` with a packed weight; batch-invariant (one in-order FMA
/// chain per output, the same on every instruction-set path).
pub fn matmul_packed(x: &[f32], m: usize, pw: &PackedWeight) -> Vec<f32> {
    assert_eq!(x.len(), m * pw.k, "x has {} values, expected {m}x{}", x.len(), pw.k);
    let n = pw.n;
    let panels = n.div_ceil(PANEL);
    // As few tasks as balance allows: a whole multiple of the thread count, each at most 32
    // panels (512 columns). Why so few: with 4 panels a task, a 576-column matrix made 9 tasks
    // that split 5:4 between two threads, and each task restarted its weight stream; halves read
    // each thread's share as one stream. Interleaved A/B on SmolLM2 (2 threads): 1 row
    // 16.4-17.1 -> 15.7-16.1 ms, 8 rows 19.6-20.4 -> 18.1-18.6 ms. lm_head gets 96 tasks.
    let threads = crate::cpu::team::threads();
    let balanced = panels.div_ceil(threads * 32).max(1) * threads;
    let per_task = panels.div_ceil(balanced).max(1);
    let tasks = panels.div_ceil(per_task);
    let isa = isa();
    // SAFETY: the tasks' panels cover every column, and each panel writes all rows.
    unsafe {
        written_by(m * n, |ptr| {
            crate::cpu::team::run(tasks, &|t| {
                let p0 = t * per_task;
                let p1 = (p0 + per_task).min(panels);
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 => avx512_packed::block(x, m, pw, p0, p1, ptr),
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => avx2_packed::block_of(x, m, pw.k, pw.n, pw.data.as_ptr(), p0, p1, ptr),
                    Isa::Portable => packed_block(x, m, pw, p0, p1, ptr),
                }
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::isa::{cpu_kernels, has_avx2};
    use crate::cpu::testutil::*;

    #[test]
    fn matmul_matches_reference_and_is_batch_invariant() {
        let (k, n) = (100, 37);
        let w = rand_vec(n * k, 1);
        let x = rand_vec(9 * k, 2);
        let full = matmul_xwt(&x, 9, k, &w, n);
        for i in 0..9 {
            let one = matmul_xwt(&x[i * k..(i + 1) * k], 1, k, &w, n);
            assert_eq!(one, full[i * n..(i + 1) * n].to_vec(), "row {i} differs between M=1 and M=9");
            for j in 0..n {
                let r: f64 = (0..k).map(|q| x[i * k + q] as f64 * w[j * k + q] as f64).sum();
                assert!((r - full[i * n + j] as f64).abs() < 1e-4);
            }
        }
    }

    #[test]
    fn packed_matmul_matches_and_is_batch_invariant() {
        let (k, n) = (70, 37);
        let w = rand_vec(n * k, 3);
        let x = rand_vec(17 * k, 4);
        let pw = PackedWeight::pack(&w, n, k);
        let full = matmul_packed(&x, 17, &pw);
        // Every row count has its own tiling (one tile, one pass, slices); all give the same bits.
        for m in 1..17 {
            let part = matmul_packed(&x[..m * k], m, &pw);
            assert_eq!(part, full[..m * n].to_vec(), "rows differ between M={m} and M=17");
        }
        for i in 0..17 {
            let one = matmul_packed(&x[i * k..(i + 1) * k], 1, &pw);
            assert_eq!(one, full[i * n..(i + 1) * n].to_vec(), "row {i} differs between M=1 and M=17");
            for j in 0..n {
                let r: f64 = (0..k).map(|q| x[i * k + q] as f64 * w[j * k + q] as f64).sum();
                assert!((r - full[i * n + j] as f64).abs() < 1e-4);
            }
        }
        // The portable path computes the very same chains.
        let mut port = vec![0f32; 17 * n];
        packed_block(&x, 17, &pw, 0, n.div_ceil(PANEL), OutPtr(port.as_mut_ptr()));
        assert_eq!(port, full);
    }

    #[test]
    fn cpu_kernels_names_the_path_taken() {
        let k = cpu_kernels();
        let first = k.split(',').next().unwrap();
        assert_eq!(first, match isa() {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => "AVX-512",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => "AVX2",
            Isa::Portable => "portable",
        });
        assert_eq!(k.contains("VNNI"), crate::cpu::isa::vnni());
        assert_eq!(k.contains("AMX"), crate::cpu::isa::amx_available());
    }

    /// The AVX2 tiles give the portable kernel's bits for every row count (each has its own
    /// tiling: one tile of 1-4 panels, balanced row tiles over slices), wherever AVX2 runs, not
    /// only on CPUs where it is the path taken.
    #[test]
    fn avx2_packed_matmul_matches_portable_bits() {
        if !has_avx2() {
            return;
        }
        let (k, n) = (150, 77); // slices of 64 with a short last one; a part-filled last panel
        let w = rand_vec(n * k, 13);
        let pw = PackedWeight::pack(&w, n, k);
        let panels = n.div_ceil(PANEL);
        for m in [1usize, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 16, 17, 25] {
            let x = rand_vec(m * k, 14 + m as u64);
            let mut port = vec![0f32; m * n];
            packed_block(&x, m, &pw, 0, panels, OutPtr(port.as_mut_ptr()));
            let mut got = vec![f32::NAN; m * n];
            // Two column ranges, as two tasks would split them.
            #[cfg(target_arch = "x86_64")]
            unsafe {
                avx2_packed::block_of(&x, m, k, n, pw.data.as_ptr(), 0, 2, OutPtr(got.as_mut_ptr()));
                avx2_packed::block_of(&x, m, k, n, pw.data.as_ptr(), 2, panels, OutPtr(got.as_mut_ptr()));
            }
            assert_eq!(got, port, "AVX2 f32 tiles differ from the portable kernel at m={m}");
        }
    }
}
