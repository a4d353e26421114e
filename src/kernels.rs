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
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Shape};
use rayon::prelude::*;

const LANES: usize = 16;

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
fn dot_fixed(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    dot_accumulate(a, b, &mut acc);
    reduce_lanes(acc)
}

#[inline(always)]
fn dot_accumulate(a: &[f32], b: &[f32], acc: &mut [f32; LANES]) {
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
fn reduce_lanes(mut acc: [f32; LANES]) -> f32 {
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
    let mut buf: Vec<std::mem::MaybeUninit<f32>> = Vec::with_capacity(len);
    // SAFETY: `MaybeUninit` needs no initialisation.
    buf.set_len(len);
    fill(OutPtr(buf.as_mut_ptr() as *mut f32));
    let mut buf = std::mem::ManuallyDrop::new(buf);
    // SAFETY: every element was written (the caller's contract), so each is a valid f32; the
    // allocation is handed over with its own length and capacity.
    Vec::from_raw_parts(buf.as_mut_ptr() as *mut f32, buf.len(), buf.capacity())
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

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Isa {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Portable,
}

/// Whether the AVX2 kernels can run here (AVX2, FMA and F16C). Every AVX-512 CPU so far has
/// them too; the integer kernel uses them on AVX-512 CPUs without VNNI, and the tests run the
/// AVX2 kernels against the portable ones wherever they can, not only where [`isa`] picks them.
pub(crate) fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The instruction-set paths the CPU kernels take on this machine, as reports name them
/// ("AVX-512, int8 on VNNI, bf16 on AMX", "AVX2", "portable"). Why reports carry it: every path
/// gives the same bits, but timings, and so speed-ups and `auto`'s trees, are comparable only
/// between runs on the same path.
pub fn cpu_kernels() -> String {
    let mut s = match isa() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => "AVX-512".to_string(),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => "AVX2".to_string(),
        Isa::Portable => "portable".to_string(),
    };
    if crate::quant::vnni() {
        s.push_str(", int8 on VNNI");
    } else if isa() != Isa::Avx2 && has_avx2() {
        s.push_str(", int8 on AVX2");
    }
    if crate::bf16::amx_available() {
        s.push_str(", bf16 on AMX");
    }
    s
}

pub(crate) fn isa() -> Isa {
    static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512dq") {
                return Isa::Avx512;
            }
            if has_avx2() {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    })
}

/// `out[m][n] = sum_k x[m][k] * w[n][k]` (a linear layer without bias), batch-invariant.
/// All arithmetic is IEEE fused multiply-add in one fixed order, so the result is the same bits
/// on every instruction set path.
pub fn matmul_xwt(x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
    assert_eq!(x.len(), m * k, "x has {} values, expected {m}x{k}", x.len());
    assert_eq!(w.len(), n * k, "w has {} values, expected {n}x{k}", w.len());
    // Blocks of columns large enough to amortise task overhead, small enough to balance 2+ cores.
    let block = (n / (crate::team::threads() * 8)).clamp(16, 512) / 4 * 4;
    let block = block.max(4);
    let nblocks = n.div_ceil(block);
    let isa = isa();
    // SAFETY: the column blocks cover 0..n and each writes its columns of every row.
    unsafe {
        written_by(m * n, |ptr| {
            crate::team::run(nblocks, &|b| {
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

    /// Inputs per slice when the rows need more than one tile (13 rows or more; 7-12 rows go
    /// through [`one_pass`]).
    ///
    /// Why slices: with rows in several tiles, running each tile over all of `k` in turn streams
    /// the panels from memory during the first tile and from L2 during the others, with the
    /// memory bus idle meanwhile. Taking every tile over one slice of the panels (16 KB of f32,
    /// in L1) before the next keeps the weight stream steadier; the overlap is still partial (the
    /// bus idles while the tiles after the first run), which is why 7-12 rows avoid slices.
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
        match m {
            7 => return one_pass::<E, 7, 3>(xp, k, w, p0, p1, n, out),
            8 => return one_pass::<E, 8, 3>(xp, k, w, p0, p1, n, out),
            9 => return one_pass::<E, 9, 2>(xp, k, w, p0, p1, n, out),
            10 => return one_pass::<E, 10, 2>(xp, k, w, p0, p1, n, out),
            11 => return one_pass::<E, 11, 2>(xp, k, w, p0, p1, n, out),
            12 => return one_pass::<E, 12, 2>(xp, k, w, p0, p1, n, out),
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
    let threads = crate::team::threads();
    let balanced = panels.div_ceil(threads * 32).max(1) * threads;
    let per_task = panels.div_ceil(balanced).max(1);
    let tasks = panels.div_ceil(per_task);
    let isa = isa();
    // SAFETY: the tasks' panels cover every column, and each panel writes all rows.
    unsafe {
        written_by(m * n, |ptr| {
            crate::team::run(tasks, &|t| {
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

pub(crate) fn contiguous<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> candle_core::Result<&'a [f32]> {
    let data = match s {
        CpuStorage::F32(d) => d.as_slice(),
        _ => candle_core::bail!("{what}: batch-invariant kernels take f32"),
    };
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("{what}: must be contiguous"),
    }
}

/// A `[t, h, d]` tensor whose heads are contiguous within each row but whose rows may lie apart
/// (q as a view of the fused q/k/v output): its data from the first element on, and the
/// distance between rows. The same layout rule as [`head_major`], one level up.
fn rows_apart<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> candle_core::Result<(&'a [f32], usize)> {
    match s {
        CpuStorage::F32(d) => head_major(d, l, what),
        _ => candle_core::bail!("{what}: batch-invariant kernels take f32"),
    }
}

/// A head-major K or V (`[hkv, s, d]`) whose rows are contiguous within each head: its data
/// from the first element on, and the distance between heads (outer entries may lie apart, the
/// inner `[s, d]` must be contiguous).
fn head_major<'a, E>(data: &'a [E], l: &Layout, what: &str) -> candle_core::Result<(&'a [E], usize)> {
    let (hkv, n, d) = l.shape().dims3()?;
    let st = l.stride();
    if (n > 1 && st[1] != d) || (d > 1 && st[2] != 1) || (hkv > 1 && st[0] < n * d) {
        candle_core::bail!("{what}: rows of each head must be contiguous, got strides {st:?} for shape {:?}", l.shape())
    }
    let head_stride = if hkv > 1 { st[0] } else { n * d };
    let end = l.start_offset() + (hkv - 1) * head_stride + n * d;
    if end > data.len() {
        candle_core::bail!("{what}: layout runs past its storage")
    }
    Ok((&data[l.start_offset()..end], head_stride))
}

/// candle op wrapping [`matmul_xwt`]: `x [.., k] x w[n, k]^T -> [.., n]`.
pub struct RowMatmul;

impl CustomOp2 for RowMatmul {
    fn name(&self) -> &'static str {
        "selfspec-row-matmul"
    }
    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous(s1, l1, "row-matmul x")?;
        let w = contiguous(s2, l2, "row-matmul w")?;
        let (n, k) = l2.shape().dims2()?;
        let xd = l1.shape().dims();
        if xd.last() != Some(&k) {
            candle_core::bail!("row-matmul: x {:?} does not match w {:?}", l1.shape(), l2.shape())
        }
        let m = x.len() / k;
        let out = matmul_xwt(x, m, k, w, n);
        let mut od = xd.to_vec();
        *od.last_mut().unwrap() = n;
        Ok((CpuStorage::F32(out), Shape::from(od)))
    }
}

/// Which keys each new query may see. Every query sees the whole committed prefix
/// (`prefix_len` slots); among the new tokens it sees itself and its ancestors only. The first
/// nodes of a mask may already sit in the cache after the prefix (a drafter's earlier tree
/// levels), with queries for the last ones only (see [`TreeAttention`]).
/// Ancestors always come earlier (breadth-first or causal order), so `visible` is lower-triangular.
#[derive(Debug, Clone, PartialEq)]
pub struct TreeMask {
    t: usize,
    visible: Vec<bool>,
}

impl TreeMask {
    /// Plain causal attention over `t` new tokens (prefill, plain decoding, a chain).
    pub fn causal(t: usize) -> Self {
        let mut visible = vec![false; t * t];
        for i in 0..t {
            for j in 0..=i {
                visible[i * t + j] = true;
            }
        }
        TreeMask { t, visible }
    }

    /// Tree attention from parent links; `parents[i] < i` for every non-root node.
    pub fn from_parents(parents: &[Option<usize>]) -> crate::Result<Self> {
        let t = parents.len();
        let mut visible = vec![false; t * t];
        for i in 0..t {
            visible[i * t + i] = true;
            if let Some(p) = parents[i] {
                if p >= i {
                    return Err(crate::Error::InvalidTree(format!("node {i} has parent {p}; parents must come first")));
                }
                for j in 0..i {
                    if visible[p * t + j] {
                        visible[i * t + j] = true;
                    }
                }
            }
        }
        Ok(TreeMask { t, visible })
    }

    pub fn len(&self) -> usize {
        self.t
    }
    pub fn is_empty(&self) -> bool {
        self.t == 0
    }
    pub fn sees(&self, i: usize, j: usize) -> bool {
        self.visible[i * self.t + j]
    }

    /// Additive mask (0 or -inf) for devices that use candle's ops: rows `first..t` (the
    /// queries; earlier nodes may already be cached) over `prefix_len + t` keys.
    pub fn additive(&self, prefix_len: usize, first: usize) -> Vec<f32> {
        let s = prefix_len + self.t;
        let first = first.min(self.t);
        let mut m = vec![0f32; (self.t - first) * s];
        for i in first..self.t {
            for j in 0..self.t {
                if !self.sees(i, j) {
                    m[(i - first) * s + prefix_len + j] = f32::NEG_INFINITY;
                }
            }
        }
        m
    }
}

/// Row-wise elementwise passes (activation quantizing, SwiGLU) split over the thread team from
/// this many values on. Below it a split costs more than the work (with rayon, which ran these
/// before the team, a fork and join took tens of microseconds when the other thread slept): a 4-row verify forward forked about 120 times for under
/// 0.1 µs of work each, and a 4-row call on a 3072 x 576 Q8_0 weight took 0.080 ms with those
/// forks, 0.031 ms without. Rows are independent, so either way gives the same bits.
pub(crate) const PAR_MIN_VALUES: usize = 1 << 14;

/// `silu(g) * u` per row of `x = [g | u]`, the fused gate/up projection's output: one pass
/// instead of candle's narrow, copy, silu (a libm `expf` call per value) and multiply, which
/// together cost 3-4% of a forward. `silu(g) = g / (1 + e^-g)` with this module's `exp`, the
/// same bits on every instruction-set path; each value depends only on its own g and u.
pub struct SwiGlu;

impl candle_core::CustomOp1 for SwiGlu {
    fn name(&self) -> &'static str {
        "selfspec-swiglu"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous(s, l, "swiglu x")?;
        let (t, w) = l.shape().dims2()?;
        if w % 2 != 0 {
            candle_core::bail!("swiglu: width {w} is not [gate | up]")
        }
        let n = w / 2;
        let mut out = vec![0f32; t * n];
        let simd = isa();
        let row = |(x, o): (&[f32], &mut [f32])| {
            let (g, u) = x.split_at(n);
            #[cfg(target_arch = "x86_64")]
            if simd == Isa::Avx512 {
                unsafe { swiglu512(g, u, o) };
                return;
            }
            #[cfg(target_arch = "x86_64")]
            if simd == Isa::Avx2 {
                unsafe { swiglu256(g, u, o) };
                return;
            }
            let _ = simd;
            swiglu_row(g, u, o);
        };
        if t * w >= PAR_MIN_VALUES {
            let mut rows: Vec<(&[f32], &mut [f32])> = x.chunks(w).zip(out.chunks_mut(n)).collect();
            crate::team::for_each_mut(&mut rows, |_, (x, o)| row((x, o)));
        } else {
            x.chunks(w).zip(out.chunks_mut(n)).for_each(row);
        }
        Ok((CpuStorage::F32(out), Shape::from((t, n))))
    }
}

/// RMS norm per row with candle's own arithmetic (`candle_nn::ops::rms_norm`: a row's squares
/// summed in order in f32, then `x / sqrt(mean + eps) * w`), so it gives the same bits. Why:
/// candle sums one row at a time, a chain of dependent adds, on the calling thread while the
/// team waits (3% of an 8-row native forward); here eight rows' chains run side by side.
pub struct RmsNormRows {
    pub eps: f32,
}

/// Rows summed side by side in [`RmsNormRows`].
const NORM_ROWS: usize = 8;

fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    let rows = x.len() / n;
    // Each row's own chain in candle's order: ((0 + x0^2) + x1^2) + ...
    let mut sums = [0f32; NORM_ROWS];
    for j in 0..n {
        for (i, s) in sums.iter_mut().enumerate().take(rows) {
            let v = x[i * n + j];
            *s += v * v;
        }
    }
    for (i, s) in sums.iter().enumerate().take(rows) {
        let m = (s / n as f32 + eps).sqrt();
        for ((o, &v), &a) in out[i * n..(i + 1) * n].iter_mut().zip(&x[i * n..(i + 1) * n]).zip(w) {
            *o = v / m * a;
        }
    }
}

impl candle_core::CustomOp2 for RmsNormRows {
    fn name(&self) -> &'static str {
        "selfspec-rms-norm"
    }
    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous(s1, l1, "rms-norm x")?;
        let w = contiguous(s2, l2, "rms-norm weight")?;
        let n = w.len();
        if n == 0 || l1.dims().last() != Some(&n) {
            candle_core::bail!("rms-norm: input {:?} against a weight of {n}", l1.dims())
        }
        let mut out = vec![0f32; x.len()];
        let group = NORM_ROWS * n;
        if x.len() >= PAR_MIN_VALUES {
            let mut parts: Vec<(&[f32], &mut [f32])> = x.chunks(group).zip(out.chunks_mut(group)).collect();
            crate::team::for_each_mut(&mut parts, |_, (x, o)| rms_norm_rows(x, w, self.eps, o));
        } else {
            x.chunks(group).zip(out.chunks_mut(group)).for_each(|(x, o)| rms_norm_rows(x, w, self.eps, o));
        }
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// Rotary embedding of `x [1, t, heads, d]` with `cos`, `sin` `[t, d/2]`, the arithmetic of
/// `candle_nn::rotary_emb::rope_thd` (`x1 c - x2 s`, `x1 s + x2 c`, no fused multiply-add), so
/// the same bits. Why: candle's loop walks the heads innermost (a stride of `d`, so it does not
/// vectorise) and goes through rayon for a single batch; this walks each head's halves in order.
pub struct RopeThd;

impl candle_core::CustomOp3 for RopeThd {
    fn name(&self) -> &'static str {
        "selfspec-rope"
    }
    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout, s3: &CpuStorage, l3: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous(s1, l1, "rope x")?;
        let cos = contiguous(s2, l2, "rope cos")?;
        let sin = contiguous(s3, l3, "rope sin")?;
        let (b, t, h, d) = l1.shape().dims4()?;
        let half = d / 2;
        if b != 1 || d % 2 != 0 || l2.dims() != [t, half] || l3.dims() != [t, half] {
            candle_core::bail!("rope: x {:?}, cos {:?}, sin {:?}", l1.dims(), l2.dims(), l3.dims())
        }
        let mut out = vec![0f32; x.len()];
        for (i, (xt, ot)) in x.chunks(h * d).zip(out.chunks_mut(h * d)).enumerate() {
            let (c, s) = (&cos[i * half..(i + 1) * half], &sin[i * half..(i + 1) * half]);
            for (xh, oh) in xt.chunks(d).zip(ot.chunks_mut(d)) {
                let (x1, x2) = xh.split_at(half);
                let (o1, o2) = oh.split_at_mut(half);
                for j in 0..half {
                    o1[j] = x1[j] * c[j] - x2[j] * s[j];
                    o2[j] = x1[j] * s[j] + x2[j] * c[j];
                }
            }
        }
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// [`RopeThd`] in place on the first `heads` heads of each row of a contiguous `[t, W]` tensor
/// (the fused q/k/v output: q's heads, then k's, then v's, which stay as they are), with the
/// same arithmetic, so the same bits. Why: the decode forward then needs no copies of q, k and
/// v, nor two fresh rotated tensors, per layer.
pub struct RopeInPlace {
    pub heads: usize,
}

impl candle_core::InplaceOp3 for RopeInPlace {
    fn name(&self) -> &'static str {
        "selfspec-rope-in-place"
    }
    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout, s3: &CpuStorage, l3: &Layout) -> candle_core::Result<()> {
        let cos = contiguous(s2, l2, "rope cos")?;
        let sin = contiguous(s3, l3, "rope sin")?;
        let (t, w) = l1.shape().dims2()?;
        let (t2, half) = l2.shape().dims2()?;
        let d = 2 * half;
        if t2 != t || l3.dims() != [t, half] || self.heads * d > w {
            candle_core::bail!("rope in place: x {:?}, cos {:?}, sin {:?}, {} heads", l1.dims(), l2.dims(), l3.dims(), self.heads)
        }
        let x = match (s1, l1.contiguous_offsets()) {
            (CpuStorage::F32(x), Some((a, b))) => &mut x[a..b],
            _ => candle_core::bail!("rope in place: x must be contiguous f32"),
        };
        for (i, row) in x.chunks_mut(w).enumerate() {
            let (c, s) = (&cos[i * half..(i + 1) * half], &sin[i * half..(i + 1) * half]);
            for head in row[..self.heads * d].chunks_mut(d) {
                let (x1, x2) = head.split_at_mut(half);
                for j in 0..half {
                    let (a, b) = (x1[j], x2[j]);
                    x1[j] = a * c[j] - b * s[j];
                    x2[j] = a * s[j] + b * c[j];
                }
            }
        }
        Ok(())
    }
}

/// Writes new K or V rows (`[t, hkv, d]`, f32, rows possibly apart) into a head-major cache
/// tensor (`[hkv, capacity, d]`, f16 or f32) at slots `at..at + t`, converting in one pass.
/// Why: candle's transpose, `to_dtype` (one f16 conversion call per value) and `slice_set` took
/// about 1.6% of an 8-row forward on the calling thread while the team waited.
pub struct KvStore {
    pub at: usize,
}

impl candle_core::InplaceOp2 for KvStore {
    fn name(&self) -> &'static str {
        "selfspec-kv-store"
    }
    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> candle_core::Result<()> {
        let (hkv, cap, d) = l1.shape().dims3()?;
        let (t, hkv2, d2) = l2.shape().dims3()?;
        if hkv2 != hkv || d2 != d || self.at + t > cap {
            candle_core::bail!("kv store: rows {:?} into cache {:?} at slot {}", l2.dims(), l1.dims(), self.at)
        }
        let src = match s2 {
            CpuStorage::F32(x) => x.as_slice(),
            _ => candle_core::bail!("kv store: new rows must be f32"),
        };
        let st = l2.stride();
        if d > 1 && st[2] != 1 {
            candle_core::bail!("kv store: each row must be contiguous, got strides {st:?}")
        }
        let (a, b) = l1.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("kv store: cache must be contiguous".into()))?;
        let row = |i: usize, h: usize| -> candle_core::Result<&[f32]> {
            let o = l2.start_offset() + i * st[0] + h * st[1];
            src.get(o..o + d).ok_or_else(|| candle_core::Error::Msg("kv store: layout reaches past its storage".into()))
        };
        let slots = (t, hkv, cap, self.at, d);
        match s1 {
            CpuStorage::F32(c) => store_rows(&mut c[a..b], slots, row, |dst, src| dst.copy_from_slice(src)),
            CpuStorage::F16(c) => {
                use half::slice::HalfFloatSliceExt;
                store_rows(&mut c[a..b], slots, row, |dst, src| dst.convert_from_f32_slice(src))
            }
            _ => candle_core::bail!("kv store: the cache must be f16 or f32"),
        }
    }
}

/// Move slots `keep` (increasing, each `>= start`) of a head-major `[hkv, cap, d]` KV cache
/// down to `start, start + 1, ...` in place, every head: the accepted path of a tree step
/// joining the committed prefix. Why: candle's `index_select` plus `slice_set` allocated and
/// copied twice per layer and tensor (60 pairs a step on SmolLM2); this is one `copy_within`
/// per kept row and head. Moving in increasing order never overwrites a row still to be moved.
pub struct KvCompact {
    pub start: usize,
    pub keep: Vec<usize>,
}

impl candle_core::InplaceOp1 for KvCompact {
    fn name(&self) -> &'static str {
        "selfspec-kv-compact"
    }
    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
        let (hkv, cap, d) = l.shape().dims3()?;
        let ordered = self.keep.iter().enumerate().all(|(i, &k)| k >= self.start + i && k < cap && (i == 0 || k > self.keep[i - 1]));
        if !ordered {
            candle_core::bail!("kv compact: slots {:?} must increase and lie in {}..{cap}", self.keep, self.start)
        }
        let (a, b) = l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("kv compact: cache must be contiguous".into()))?;
        fn run<E: Copy>(c: &mut [E], (hkv, cap, d): (usize, usize, usize), start: usize, keep: &[usize]) {
            for h in 0..hkv {
                for (i, &k) in keep.iter().enumerate() {
                    if k != start + i {
                        let from = (h * cap + k) * d;
                        c.copy_within(from..from + d, (h * cap + start + i) * d);
                    }
                }
            }
        }
        match s {
            CpuStorage::F32(c) => run(&mut c[a..b], (hkv, cap, d), self.start, &self.keep),
            CpuStorage::F16(c) => run(&mut c[a..b], (hkv, cap, d), self.start, &self.keep),
            _ => candle_core::bail!("kv compact: the cache must be f16 or f32"),
        }
        Ok(())
    }
}

/// Row `(i, h)` of `t` new rows of `hkv` heads into slot `at + i` of head `h` of a head-major
/// `[hkv, cap, d]` cache, through `put` (a copy or a conversion).
fn store_rows<'a, E>(c: &mut [E], (t, hkv, cap, at, d): (usize, usize, usize, usize, usize), row: impl Fn(usize, usize) -> candle_core::Result<&'a [f32]>, put: impl Fn(&mut [E], &[f32])) -> candle_core::Result<()> {
    for i in 0..t {
        for h in 0..hkv {
            let o = (h * cap + at + i) * d;
            put(&mut c[o..o + d], row(i, h)?);
        }
    }
    Ok(())
}

#[inline(always)]
fn swiglu_row(g: &[f32], u: &[f32], o: &mut [f32]) {
    for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
        *o = g / (1.0 + exp_clamped(-g)) * u;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn swiglu512(g: &[f32], u: &[f32], o: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = g.len();
    let mut i = 0;
    let one = _mm512_set1_ps(1.0);
    while i < n {
        let m = if n - i >= LANES { 0xffff } else { ((1u32 << (n - i)) - 1) as __mmask16 };
        let gv = _mm512_maskz_loadu_ps(m, g.as_ptr().add(i));
        let uv = _mm512_maskz_loadu_ps(m, u.as_ptr().add(i));
        let neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gv), _mm512_set1_epi32(i32::MIN)));
        let x = _mm512_min_ps(_mm512_max_ps(neg, _mm512_set1_ps(EXP_MIN)), _mm512_set1_ps(EXP_MAX));
        let e = attend512::exp16_in_range(x);
        let y = _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), uv);
        _mm512_mask_storeu_ps(o.as_mut_ptr().add(i), m, y);
        i += LANES;
    }
}

/// [`swiglu512`] in 8 lanes: the same operations per value.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn swiglu256(g: &[f32], u: &[f32], o: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = g.len();
    let body = n / 8 * 8;
    let one = _mm256_set1_ps(1.0);
    let mut i = 0;
    while i < body {
        let gv = _mm256_loadu_ps(g.as_ptr().add(i));
        let uv = _mm256_loadu_ps(u.as_ptr().add(i));
        let neg = _mm256_xor_ps(gv, _mm256_set1_ps(-0.0));
        let x = _mm256_min_ps(_mm256_max_ps(neg, _mm256_set1_ps(EXP_MIN)), _mm256_set1_ps(EXP_MAX));
        let e = attend256::exp8_in_range(x);
        _mm256_storeu_ps(o.as_mut_ptr().add(i), _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), uv));
        i += 8;
    }
    // The tail through the scalar code, compiled here with FMA (the same rounding).
    swiglu_row(&g[body..], &u[body..], &mut o[body..]);
}

/// Tree attention on the CPU: `q [t, h, d]`, `k, v [hkv, s, d]` (head-major, as the KV cache
/// holds them; a view whose heads lie apart is fine) with `s = prefix_len + mask.len()`.
/// The queries are the mask's last `t` nodes; its first `mask.len() - t` are already in the
/// cache after the prefix (a drafter's earlier tree levels), seen only by their descendants.
/// Keys are visited in slot order and masked keys are skipped, so a node's output is
/// bit-identical to the one computed when its path is decoded one token at a time.
pub struct TreeAttention {
    pub mask: std::sync::Arc<TreeMask>,
    pub prefix_len: usize,
    pub scale: f32,
}

impl CustomOp3 for TreeAttention {
    fn name(&self) -> &'static str {
        "selfspec-tree-attention"
    }
    fn cpu_fwd(
        &self,
        sq: &CpuStorage,
        lq: &Layout,
        sk: &CpuStorage,
        lk: &Layout,
        sv: &CpuStorage,
        lv: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let q = rows_apart(sq, lq, "attention q")?;
        match (sk, sv) {
            (CpuStorage::F32(k), CpuStorage::F32(v)) => self.run(q, lq, (k, lk), (v, lv)),
            (CpuStorage::F16(k), CpuStorage::F16(v)) => self.run(q, lq, (k, lk), (v, lv)),
            _ => candle_core::bail!("tree attention: K and V must both be f32 or both f16"),
        }
    }
}

impl TreeAttention {
    fn run<E: Elem>(&self, (q, q_row): (&[f32], usize), lq: &Layout, (k, lk): (&[E], &Layout), (v, lv): (&[E], &Layout)) -> candle_core::Result<(CpuStorage, Shape)> {
        let (k, k_stride) = head_major(k, lk, "attention k")?;
        let (v, v_stride) = head_major(v, lv, "attention v")?;
        let (t, h, d) = lq.shape().dims3()?;
        let (hkv, s, d2) = lk.shape().dims3()?;
        let n = self.mask.len();
        if d != d2 || lv.shape().dims3()? != (hkv, s, d) || k_stride != v_stride || s != self.prefix_len + n || t == 0 || t > n || h % hkv != 0 {
            candle_core::bail!("tree attention: shapes q {:?} k {:?} v {:?} prefix {}", lq.shape(), lk.shape(), lv.shape(), self.prefix_len)
        }
        let group = h / hkv;
        let mut out = vec![0f32; t * h * d];
        let prefix = self.prefix_len;
        let mask = &self.mask;
        let scale = self.scale;
        let isa = isa();
        let outp = OutPtr(out.as_mut_ptr());
        // A task is a run of (row, query head) pairs that share one K/V head, row by row, so the
        // K/V rows of the common prefix are fetched once per task and used by every pair while
        // in L1. Runs are short enough for about four tasks per thread, rounded up to whole
        // groups of query heads, so that a row's heads that share a K/V head read it once: a
        // single decoded token gets three tasks of three pairs rather than nine of one (one-token
        // forwards at a 2,048-token context 17% faster, 2-4 tokens 5-6%).
        let per_task = ((t * h / (crate::team::threads() * 4)).clamp(1, MAX_PAIRS_PER_TASK).div_ceil(group) * group).min(MAX_PAIRS_PER_TASK.max(group));
        let tasks: Vec<(usize, usize, usize)> = (0..hkv)
            .flat_map(|g| (0..t * group).step_by(per_task).map(move |s| (g, s, (t * group - s).min(per_task))))
            .collect();
        thread_local! {
            static SCRATCH: std::cell::RefCell<(Scratch, Vec<usize>)> = Default::default();
        }
        crate::team::run(tasks.len(), &|task| {
            let (g, first, count) = tasks[task];
            SCRATCH.with_borrow_mut(|(scratch, keys)| {
                // Key lists of the task's rows, one after another (pairs of a row share one).
                let (r0, r1) = (first / group, (first + count - 1) / group + 1);
                keys.clear();
                let mut bounds = Vec::with_capacity(r1 - r0 + 1);
                for i in r0..r1 {
                    bounds.push(keys.len());
                    keys.extend(0..prefix);
                    keys.extend((0..n).filter(|&j| mask.sees(n - t + i, j)).map(|j| prefix + j));
                }
                bounds.push(keys.len());
                let pairs: Vec<Pair> = (first..first + count)
                    .map(|idx| {
                        let (i, hh) = (idx / group, g * group + idx % group);
                        let q0 = i * q_row + hh * d;
                        Pair { q: &q[q0..q0 + d], keys: &keys[bounds[i - r0]..bounds[i - r0 + 1]], out: outp.offset((i * h + hh) * d) }
                    })
                    .collect();
                let kv = KvHead { k, v, head_stride: k_stride, kvh: g, d, scale };
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 if d % LANES == 0 && d <= attend512::MAX_D => unsafe { attend512::attend_group(&kv, &pairs, prefix, scratch) },
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 if d % LANES == 0 && d <= attend256::MAX_D => unsafe { attend256::attend_group(&kv, &pairs, prefix, scratch) },
                    _ => {
                        for pr in &pairs {
                            let o = unsafe { std::slice::from_raw_parts_mut(pr.out.0, d) };
                            #[cfg(target_arch = "x86_64")]
                            if matches!(isa, Isa::Avx512 | Isa::Avx2) {
                                unsafe { attend_head_fma(&kv, pr.q, pr.keys, scratch, o) };
                                continue;
                            }
                            attend_head(&kv, pr.q, pr.keys, scratch, o);
                        }
                    }
                }
            })
        });
        Ok((CpuStorage::F32(out), Shape::from((t, h, d))))
    }
}

/// Most (row, head) pairs in one attention task (bounds the per-task scratch).
const MAX_PAIRS_PER_TASK: usize = 12;

/// Per-thread buffers of the attention tasks.
#[derive(Default)]
struct Scratch {
    scores: Vec<f32>,
    /// One K or V row in f32, for the portable path.
    row: Vec<f32>,
    /// A block of f16 K or V rows widened to f32, shared by the pairs of an AVX-512 task.
    widened: Vec<f32>,
    chains: Vec<f32>,
    /// Per pair of a task: running score maxima (16 lanes), output accumulators, 1 / softmax sum.
    maxv: Vec<f32>,
    acc: Vec<f32>,
    inv: Vec<f32>,
}

/// The K/V of one key-value head, for every pair of a task.
struct KvHead<'a, E> {
    k: &'a [E],
    v: &'a [E],
    /// Values from one head's slot 0 to the next head's.
    head_stride: usize,
    kvh: usize,
    d: usize,
    scale: f32,
}

impl<E> KvHead<'_, E> {
    /// Where slot `slot`'s row of this head starts in `k` and `v`.
    #[inline(always)]
    fn row(&self, slot: usize) -> usize {
        self.kvh * self.head_stride + slot * self.d
    }
    #[inline(always)]
    fn rows(&self, slot: usize) -> std::ops::Range<usize> {
        self.row(slot)..self.row(slot) + self.d
    }
}

/// One query head of one row: its query, the slots it sees (increasing; the first `prefix` are
/// `0..prefix`), and where its output goes.
struct Pair<'a> {
    q: &'a [f32],
    keys: &'a [usize],
    out: OutPtr,
}

/// `sum of e^(x - max)` over `xs` (each `x <= max`): a softmax's normaliser, in 16 lanes (value
/// `i` into lane `i % 16`) added up at the end, the same bits on every instruction-set path.
/// Why: drafting ranks a few thousand draft-vocabulary logits per tree level, and libm's `expf`
/// per value (or `mul_add` without FMA compiled in) cost more than the draft layer's matmuls.
pub fn sum_exp_below(xs: &[f32], max: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx512 {
        // SAFETY: AVX-512F is present.
        return unsafe { attend512::sum_exp_below(xs, max) };
    }
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx2 {
        // SAFETY: AVX2 and FMA are present.
        return unsafe { attend256::sum_exp_below(xs, max) };
    }
    sum_exp_below_portable(xs, max)
}

/// [`sum_exp_below`] without SIMD: the lane order every path follows.
fn sum_exp_below_portable(xs: &[f32], max: f32) -> f32 {
    let mut lanes = [0f32; LANES];
    for c in xs.chunks(LANES) {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l += exp_nonpositive(x - max);
        }
    }
    lanes.iter().sum()
}

/// `e^x` for x <= 0 (softmax after subtracting the max), within ~2 ulp: Cody-Waite range
/// reduction and a degree-6 polynomial, all fused multiply-adds in a fixed order, so it gives
/// the same bits on every instruction-set path and vectorises (libm's expf is a call per value).
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    exp_in_range(x.max(EXP_MIN))
}

/// `e^x` for any x, clamped to [-87, 88] where f32 neither flushes to zero nor overflows; the
/// same arithmetic as `exp_nonpositive`.
#[inline(always)]
#[allow(clippy::manual_clamp)] // `clamp` keeps NaN; max/min map it to EXP_MIN, as the SIMD path does
fn exp_clamped(x: f32) -> f32 {
    exp_in_range(x.max(EXP_MIN).min(EXP_MAX))
}

#[inline(always)]
fn exp_in_range(x: f32) -> f32 {
    let n = (x * LOG2E + MAGIC) - MAGIC;
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    let mut p = EXP_POLY[0];
    for &c in &EXP_POLY[1..] {
        p = p.mul_add(r, c);
    }
    let e = (r * r).mul_add(p, r) + 1.0;
    e * f32::from_bits(((n as i32 + 127) as u32) << 23)
}
const EXP_MIN: f32 = -87.0;
const EXP_MAX: f32 = 88.0;
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// 1.5 * 2^23: adding it rounds to an integer.
const MAGIC: f32 = 12582912.0;
const EXP_POLY: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 5e-1];

/// Attention for one query head over `keys` in slot order. The reference for the SIMD path:
/// scores are `dot_fixed * scale`, the softmax sum runs in 16 interleaved lanes and then the
/// pairwise tree, and each output element is one fused multiply-add chain over the keys in
/// order, times 1 / sum. None of it depends on how many rows or heads the call holds.
#[inline(always)]
fn attend_head<E: Elem>(kv: &KvHead<E>, q: &[f32], keys: &[usize], scratch: &mut Scratch, o: &mut [f32]) {
    let n = keys.len();
    let Scratch { scores, chains, row, .. } = scratch;
    let load = |row: &mut Vec<f32>, x: &[E]| {
        row.clear();
        row.extend(x.iter().map(|e| e.to_f32()));
    };
    scores.clear();
    for &j in keys {
        load(row, &kv.k[kv.rows(j)]);
        scores.push(dot_fixed(q, row) * kv.scale);
    }
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let mut lanes = [0f32; LANES];
    for (jj, sc) in scores.iter_mut().enumerate() {
        *sc = exp_nonpositive(*sc - max);
        lanes[jj % LANES] += *sc;
    }
    let inv = 1.0 / reduce_lanes(lanes);
    // One chain per element: the SIMD path gets its independent chains from the pairs that
    // share a V row instead (see `attend512::values`), so a key's place in the chain is just
    // its place in this row's own list.
    chains.clear();
    chains.resize(kv.d, 0.0);
    for jj in 0..n {
        let p = scores[jj];
        load(row, &kv.v[kv.rows(keys[jj])]);
        for (o, &x) in chains.iter_mut().zip(row.iter()) {
            *o = p.mul_add(x, *o);
        }
    }
    for (o, c) in o.iter_mut().zip(chains.iter()) {
        *o = c * inv;
    }
}

/// The same code compiled with hardware FMA (identical results, as FMA is exactly rounded).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_head_fma<E: Elem>(kv: &KvHead<E>, q: &[f32], keys: &[usize], scratch: &mut Scratch, o: &mut [f32]) {
    attend_head(kv, q, keys, scratch, o)
}

/// AVX2 attention for CPUs without AVX-512: `attend_head`'s arithmetic bit for bit, with a
/// query's 16 score lanes in two 8-lane registers (the lane tree's first step adds them), the
/// softmax's exp eight scores at a time, and the output's chains eight elements per register.
/// Why: the portable loop widened every f16 K/V value through a function call and kept one
/// output chain at a time; on a 2-core Zen 3, attention over a 256-token context made a
/// 16-token forward cost 7-9x one token's.
#[cfg(target_arch = "x86_64")]
mod attend256 {
    use super::*;
    use std::arch::x86_64::*;

    /// `exp_nonpositive` on 8 values with the same operations in the same order.
    #[inline(always)]
    unsafe fn exp8(x: __m256) -> __m256 {
        exp8_in_range(_mm256_max_ps(x, _mm256_set1_ps(EXP_MIN)))
    }

    /// `exp_in_range` on 8 values.
    #[inline(always)]
    pub(super) unsafe fn exp8_in_range(x: __m256) -> __m256 {
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

    /// `reduce_lanes` of the 16 lanes `lo ++ hi`: l + 8, then + 4, + 2, + 1.
    #[inline(always)]
    unsafe fn reduce(lo: __m256, hi: __m256) -> f32 {
        let y = _mm256_add_ps(lo, hi);
        let x = _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps::<1>(y));
        let z = _mm_add_ps(x, _mm_movehl_ps(x, x));
        _mm_cvtss_f32(_mm_add_ss(z, _mm_shuffle_ps::<1>(z, z)))
    }

    /// The first `live` of 8 lanes set (all 8 when `live >= 8`).
    #[inline(always)]
    unsafe fn live_lanes(live: usize) -> __m256 {
        let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(live.min(8) as i32), idx))
    }

    /// [`super::sum_exp_below`], 16 values at a time with the same per-lane arithmetic.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn sum_exp_below(xs: &[f32], max: f32) -> f32 {
        let m = _mm256_set1_ps(max);
        let mut acc = [_mm256_setzero_ps(); 2];
        for c in xs.chunks(LANES) {
            for (h, a) in acc.iter_mut().enumerate() {
                let live = c.len().saturating_sub(h * 8);
                if live == 0 {
                    continue;
                }
                let mut buf = [0f32; 8];
                buf[..live.min(8)].copy_from_slice(&c[h * 8..h * 8 + live.min(8)]);
                let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(buf.as_ptr()), m));
                *a = _mm256_add_ps(*a, _mm256_and_ps(e, live_lanes(live)));
            }
        }
        let mut lanes = [0f32; LANES];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc[0]);
        _mm256_storeu_ps(lanes.as_mut_ptr().add(8), acc[1]);
        lanes.iter().sum()
    }

    /// Larger heads take the portable path.
    pub const MAX_D: usize = 128;

    /// Four keys' scores from their lane chains (`lo[u]`, `hi[u]`: lanes 0-7 and 8-15 of key
    /// `u`), each reduced by `reduce_lanes`' tree (l + 8, + 4, + 2, + 1), all four at once.
    #[inline(always)]
    unsafe fn reduce4(lo: &[__m256; 4], hi: &[__m256; 4]) -> __m128 {
        let y: [__m256; 4] = std::array::from_fn(|u| _mm256_add_ps(lo[u], hi[u]));
        // Lanes l and l + 4: key 0 (or 2) in the low half, key 1 (or 3) in the high half.
        let s01 = _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(y[0], y[1]), _mm256_permute2f128_ps::<0x31>(y[0], y[1]));
        let s23 = _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(y[2], y[3]), _mm256_permute2f128_ps::<0x31>(y[2], y[3]));
        // Lanes l and l + 2: per half [key a: 0, 1; key b: 0, 1].
        let w = _mm256_add_ps(_mm256_shuffle_ps::<0b01_00_01_00>(s01, s23), _mm256_shuffle_ps::<0b11_10_11_10>(s01, s23));
        // Lanes 0 and 1: per half [key a, key b, ..].
        let r = _mm256_add_ps(_mm256_shuffle_ps::<0b10_00_10_00>(w, w), _mm256_shuffle_ps::<0b11_01_11_01>(w, w));
        _mm_unpacklo_ps(_mm256_castps256_ps128(r), _mm256_extractf128_ps::<1>(r))
    }

    /// The (row, head) pairs of one task, which share a K/V head, for head sizes that are a
    /// multiple of 16 up to [`MAX_D`]; every pair gets [`super::attend_head`]'s bits.
    ///
    /// The pairs take the common prefix in blocks of keys small enough for L1, so each block
    /// comes from L2 once for all of them: the scores pair by pair over a block, then, after
    /// each pair's softmax, the output chains the same way, resumed from memory between blocks
    /// (an f32 stored and loaded back is exact, so each output element stays one chain over the
    /// keys in order). A pair's own keys after the prefix (a tree node's ancestors) follow,
    /// pair by pair. Against taking the pairs one at a time over all their keys, on a 2-core
    /// Zen 3 (`examples/attention_bench`, f16 K/V, three interleaved rounds): 16 rows at a
    /// 2,048-token context 905-914 -> 854-856 µs, 4 rows at 1,024 113-114 -> 110 µs, the same at
    /// 256. So L2 is not much of what limits this loop there, and neither is widening f16 per
    /// pair (widening each block once for all pairs was slower, 40-80% in a noisier run).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn attend_group<E: Elem>(kv: &KvHead<E>, pairs: &[Pair], prefix: usize, scratch: &mut Scratch) {
        debug_assert!(kv.d.is_multiple_of(LANES) && kv.d <= MAX_D);
        match kv.d / LANES {
            1 => group::<E, 1, 2, 0>(kv, pairs, prefix, scratch),
            2 => group::<E, 2, 4, 0>(kv, pairs, prefix, scratch),
            3 => group::<E, 3, 6, 0>(kv, pairs, prefix, scratch),
            4 => group::<E, 4, 8, 0>(kv, pairs, prefix, scratch),
            5 => group::<E, 5, 8, 2>(kv, pairs, prefix, scratch),
            6 => group::<E, 6, 8, 4>(kv, pairs, prefix, scratch),
            7 => group::<E, 7, 8, 6>(kv, pairs, prefix, scratch),
            _ => group::<E, 8, 8, 8>(kv, pairs, prefix, scratch),
        }
    }

    /// [`attend_group`] for a head of `C` 16-value chunks, whose output takes `W1` and then `W2`
    /// 8-lane registers (at most 8 per pass: 64 elements).
    #[inline(always)]
    unsafe fn group<E: Elem, const C: usize, const W1: usize, const W2: usize>(kv: &KvHead<E>, pairs: &[Pair], prefix: usize, scratch: &mut Scratch) {
        let d = kv.d;
        // Keys per block: 8 KB of K rows (and as much of V) in L1, a multiple of 4.
        let block = (8192 / (d * std::mem::size_of::<E>())).max(4) / 4 * 4;
        let stride = pairs.iter().map(|p| p.keys.len()).max().unwrap_or(0).div_ceil(LANES) * LANES;
        let Scratch { scores, acc, maxv, .. } = scratch;
        scores.clear();
        scores.resize(pairs.len() * stride, 0.0);
        acc.clear();
        acc.resize(pairs.len() * d, 0.0);
        maxv.clear();
        maxv.resize(pairs.len() * 4, f32::NEG_INFINITY);
        let (sp, ap, mp) = (scores.as_mut_ptr(), acc.as_mut_ptr(), maxv.as_mut_ptr());
        let common = prefix.min(pairs.iter().map(|p| p.keys.len()).min().unwrap_or(0));
        // Scores: the common prefix block by block, then each pair's own keys.
        let mut k0 = 0;
        while k0 < common {
            let k1 = (k0 + block).min(common);
            for (pi, pr) in pairs.iter().enumerate() {
                scores_of::<E, C>(kv, pr.q, &pr.keys[k0..k1], sp.add(pi * stride + k0), mp.add(pi * 4));
            }
            k0 = k1;
        }
        for (pi, pr) in pairs.iter().enumerate() {
            scores_of::<E, C>(kv, pr.q, &pr.keys[common..], sp.add(pi * stride + common), mp.add(pi * 4));
        }
        // Softmax per pair: exp(score - max), summed per lane (key jj into lane jj % 16) in
        // key order; the probabilities replace the scores.
        let mut inv = Vec::with_capacity(pairs.len());
        for (pi, pr) in pairs.iter().enumerate() {
            let n = pr.keys.len();
            let max = std::slice::from_raw_parts(mp.add(pi * 4), 4).iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            let m = _mm256_set1_ps(max);
            let row = sp.add(pi * stride);
            let mut lanes = [_mm256_setzero_ps(); 2];
            for c in 0..n.div_ceil(LANES) {
                for (h, acc) in lanes.iter_mut().enumerate() {
                    let at = c * LANES + h * 8;
                    let live = n.saturating_sub(at);
                    if live == 0 {
                        continue;
                    }
                    let e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(row.add(at)), m)), live_lanes(live));
                    _mm256_storeu_ps(row.add(at), e);
                    *acc = _mm256_add_ps(*acc, e);
                }
            }
            inv.push(1.0 / reduce(lanes[0], lanes[1]));
        }
        // Output chains: the common prefix block by block, then each pair's own keys.
        let mut k0 = 0;
        while k0 < common {
            let k1 = (k0 + block).min(common);
            for (pi, pr) in pairs.iter().enumerate() {
                let (probs, chains) = (sp.add(pi * stride + k0), ap.add(pi * d));
                values::<E, W1>(kv, &pr.keys[k0..k1], probs, chains, 0);
                if W2 > 0 {
                    values::<E, W2>(kv, &pr.keys[k0..k1], probs, chains, 8 * W1);
                }
            }
            k0 = k1;
        }
        for (pi, pr) in pairs.iter().enumerate() {
            let (probs, chains) = (sp.add(pi * stride + common), ap.add(pi * d));
            values::<E, W1>(kv, &pr.keys[common..], probs, chains, 0);
            if W2 > 0 {
                values::<E, W2>(kv, &pr.keys[common..], probs, chains, 8 * W1);
            }
            let f = _mm256_set1_ps(inv[pi]);
            for e in (0..d).step_by(8) {
                _mm256_storeu_ps(pr.out.0.add(e), _mm256_mul_ps(_mm256_loadu_ps(chains.add(e)), f));
            }
        }
    }

    /// Scores of one query against `keys` (written from `out` on), four keys at a time: per
    /// key, lanes 0-7 and 8-15 of the 16 chains over the head's chunks in order, then the lane
    /// tree for the four together, times the scale. Folds them into the running maxima at `maxv`
    /// (4 lanes).
    #[inline(always)]
    unsafe fn scores_of<E: Elem, const C: usize>(kv: &KvHead<E>, q: &[f32], keys: &[usize], out: *mut f32, maxv: *mut f32) {
        let n = keys.len();
        let (kp, qp) = (kv.k.as_ptr(), q.as_ptr());
        let scale = _mm_set1_ps(kv.scale);
        let mut mx = _mm_loadu_ps(maxv);
        let mut jj = 0;
        while jj < n {
            let live = (n - jj).min(4);
            let rows: [*const E; 4] = std::array::from_fn(|u| kp.add(kv.row(keys[jj + u.min(live - 1)])));
            let mut lo = [_mm256_setzero_ps(); 4];
            let mut hi = [_mm256_setzero_ps(); 4];
            for c in 0..C {
                let (ql, qh) = (_mm256_loadu_ps(qp.add(c * LANES)), _mm256_loadu_ps(qp.add(c * LANES + 8)));
                for u in 0..4 {
                    lo[u] = _mm256_fmadd_ps(ql, E::load8(rows[u].add(c * LANES)), lo[u]);
                    hi[u] = _mm256_fmadd_ps(qh, E::load8(rows[u].add(c * LANES + 8)), hi[u]);
                }
            }
            let sc = _mm_mul_ps(reduce4(&lo, &hi), scale);
            if live == 4 {
                _mm_storeu_ps(out.add(jj), sc);
                // max(x, acc) is x > acc ? x : acc, so a NaN score leaves the maximum as the
                // scalar fold does; the order of a maximum's comparisons changes nothing else.
                mx = _mm_max_ps(sc, mx);
            } else {
                let mut buf = [0f32; 4];
                _mm_storeu_ps(buf.as_mut_ptr(), sc);
                for (u, &v) in buf.iter().enumerate().take(live) {
                    *out.add(jj + u) = v;
                    mx = _mm_max_ps(_mm_set1_ps(v), mx);
                }
            }
            jj += 4;
        }
        _mm_storeu_ps(maxv, mx);
    }

    /// Continue the output chains at `chains[e0..e0 + 8W]` over `keys`: `+= p_j v_j[e]` in
    /// key order, with `probs[jj]` the probability of `keys[jj]`.
    #[inline(always)]
    unsafe fn values<E: Elem, const W: usize>(kv: &KvHead<E>, keys: &[usize], probs: *const f32, chains: *mut f32, e0: usize) {
        if keys.is_empty() {
            return;
        }
        let vp = kv.v.as_ptr();
        let mut acc: [__m256; W] = std::array::from_fn(|u| _mm256_loadu_ps(chains.add(e0 + u * 8)));
        for (jj, &j) in keys.iter().enumerate() {
            let p = _mm256_broadcast_ss(&*probs.add(jj));
            let row = vp.add(kv.row(j) + e0);
            for (u, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(p, E::load8(row.add(u * 8)), *a);
            }
        }
        for (u, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(chains.add(e0 + u * 8), *a);
        }
    }
}

/// AVX-512 attention for head sizes that are a multiple of 16: the same arithmetic as
/// `attend_head`, bit for bit, but 16 keys' scores at a time (one accumulator per key, then a
/// transposing reduction that performs the pairwise tree of `reduce_lanes` for all 16 at once),
/// a vector exp, and the output accumulated in registers.
#[cfg(target_arch = "x86_64")]
mod attend512 {
    use super::*;
    use std::arch::x86_64::*;

    /// Larger heads take the portable path.
    pub const MAX_D: usize = 128;

    /// Lane `l` of the result is `reduce_lanes(a[l])`: the tree (l + 8, + 4, + 2, + 1) is done for
    /// all sixteen vectors together. Each step adds the same pairs as the scalar tree.
    #[inline(always)]
    unsafe fn reduce16(a: &[__m512; 16]) -> __m512 {
        let mut s1 = [_mm512_setzero_ps(); 8];
        for p in 0..8 {
            // [a.q0, a.q1, b.q0, b.q1] + [a.q2, a.q3, b.q2, b.q3]: lanes l and l + 8.
            let lo = _mm512_shuffle_f32x4::<0b01_00_01_00>(a[2 * p], a[2 * p + 1]);
            let hi = _mm512_shuffle_f32x4::<0b11_10_11_10>(a[2 * p], a[2 * p + 1]);
            s1[p] = _mm512_add_ps(lo, hi);
        }
        let mut s2 = [_mm512_setzero_ps(); 4];
        for r in 0..4 {
            // Quarter pairs: lanes l and l + 4 of each of four vectors.
            let lo = _mm512_shuffle_f32x4::<0b10_00_10_00>(s1[2 * r], s1[2 * r + 1]);
            let hi = _mm512_shuffle_f32x4::<0b11_01_11_01>(s1[2 * r], s1[2 * r + 1]);
            s2[r] = _mm512_add_ps(lo, hi);
        }
        let mut s3 = [_mm512_setzero_ps(); 2];
        for u in 0..2 {
            // Within each 128-bit quarter: lanes l and l + 2.
            let lo = _mm512_shuffle_ps::<0b01_00_01_00>(s2[2 * u], s2[2 * u + 1]);
            let hi = _mm512_shuffle_ps::<0b11_10_11_10>(s2[2 * u], s2[2 * u + 1]);
            s3[u] = _mm512_add_ps(lo, hi);
        }
        // Lanes l and l + 1. Lane 4q + i now holds vector q + 4i.
        let lo = _mm512_shuffle_ps::<0b10_00_10_00>(s3[0], s3[1]);
        let hi = _mm512_shuffle_ps::<0b11_01_11_01>(s3[0], s3[1]);
        let sums = _mm512_add_ps(lo, hi);
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_permutexvar_ps(order, sums)
    }

    /// `exp_nonpositive` on 16 values with the same operations in the same order.
    #[inline(always)]
    unsafe fn exp16(x: __m512) -> __m512 {
        exp16_in_range(_mm512_max_ps(x, _mm512_set1_ps(EXP_MIN)))
    }

    /// `exp_in_range` on 16 values.
    #[inline(always)]
    pub(super) unsafe fn exp16_in_range(x: __m512) -> __m512 {
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

    /// [`super::sum_exp_below`], 16 values at a time with the same per-lane arithmetic.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn sum_exp_below(xs: &[f32], max: f32) -> f32 {
        let m = _mm512_set1_ps(max);
        let mut acc = _mm512_setzero_ps();
        for (i, c) in xs.chunks(LANES).enumerate() {
            let lm = tail_mask(c.len());
            let x = _mm512_maskz_loadu_ps(lm, xs.as_ptr().add(i * LANES));
            acc = _mm512_mask_add_ps(acc, lm, acc, exp16(_mm512_sub_ps(x, m)));
        }
        let mut lanes = [0f32; LANES];
        _mm512_storeu_ps(lanes.as_mut_ptr(), acc);
        lanes.iter().sum()
    }

    /// Dispatches on the head size so that the per-head vectors live in registers.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn attend_group<E: Elem>(kv: &KvHead<E>, pairs: &[Pair], prefix: usize, scratch: &mut Scratch) {
        match kv.d / LANES {
            1 => group::<E, 1>(kv, pairs, prefix, scratch),
            2 => group::<E, 2>(kv, pairs, prefix, scratch),
            3 => group::<E, 3>(kv, pairs, prefix, scratch),
            4 => group::<E, 4>(kv, pairs, prefix, scratch),
            5 => group::<E, 5>(kv, pairs, prefix, scratch),
            6 => group::<E, 6>(kv, pairs, prefix, scratch),
            7 => group::<E, 7>(kv, pairs, prefix, scratch),
            8 => group::<E, 8>(kv, pairs, prefix, scratch),
            _ => {
                for pr in pairs {
                    super::attend_head(kv, pr.q, pr.keys, scratch, std::slice::from_raw_parts_mut(pr.out.0, kv.d));
                }
            }
        }
    }

    /// One pair alone (the reference test's entry point).
    #[cfg(test)]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn attend_head<E: Elem>(kv: &KvHead<E>, q: &[f32], keys: &[usize], scratch: &mut Scratch, o: &mut [f32]) {
        attend_group(kv, &[Pair { q, keys, out: OutPtr(o.as_mut_ptr()) }], 0, scratch)
    }

    /// Scores of one pair for the 16 keys whose K rows are `rows`: per key, one FMA chain over
    /// the head's 16-lane slices, then the transposing lane tree.
    #[inline(always)]
    unsafe fn scores16<E: Elem, const C: usize>(q: *const f32, rows: &[*const E; 16], scale: __m512) -> __m512 {
        let mut acc = [_mm512_setzero_ps(); 16];
        for c in 0..C {
            let qc = _mm512_loadu_ps(q.add(c * LANES));
            for u in 0..16 {
                acc[u] = _mm512_fmadd_ps(qc, E::load16(rows[u].add(c * LANES)), acc[u]);
            }
        }
        _mm512_mul_ps(reduce16(&acc), scale)
    }

    /// Keys `j0..j1` (key `j`'s V row at `row(j)`) into the output chains of `PB` pairs, whose
    /// probabilities for key `j` are `probs[pb][j]`: each V row is loaded (and widened) once
    /// for all `PB` pairs (a single pair's loop made one load per multiply-add and was bound by
    /// L1 loads). Each pair's chains see its keys in order, as when it runs alone.
    #[inline(always)]
    unsafe fn values<E: Elem, const PB: usize, const C: usize>(acc: &mut [[__m512; C]; PB], probs: [*const f32; PB], row: impl Fn(usize) -> *const E, j0: usize, j1: usize) {
        for j in j0..j1 {
            let r = row(j);
            let v: [__m512; C] = std::array::from_fn(|c| E::load16(r.add(c * LANES)));
            for (pb, acc) in acc.iter_mut().enumerate() {
                let p = _mm512_set1_ps(*probs[pb].add(j));
                for (a, v) in acc.iter_mut().zip(&v) {
                    *a = _mm512_fmadd_ps(p, *v, *a);
                }
            }
        }
    }

    /// Rows `first..first + count` of one head of `src` (K or V) into `dst` as f32.
    #[inline(always)]
    unsafe fn widen_rows<E: Elem, const C: usize>(kv: &KvHead<E>, src: *const E, first: usize, count: usize, dst: *mut f32) {
        for r in 0..count {
            for c in 0..C {
                _mm512_storeu_ps(dst.add((r * C + c) * LANES), E::load16(src.add(kv.row(first + r) + c * LANES)));
            }
        }
    }

    /// Keys of the shared prefix per step of the output phase: their V rows (16 KB for 64-wide
    /// heads) stay in L1 while every pair of the task reads them.
    const V_STEP: usize = 64;

    /// Attention for pairs that share a K/V head. Each pair's arithmetic is exactly that of the
    /// pair alone (the portable `attend_head`, bit for bit); only the order in which pairs visit
    /// the shared prefix's keys is interleaved, so those K/V rows are loaded from memory once.
    #[inline(always)]
    unsafe fn group<E: Elem, const C: usize>(kv: &KvHead<E>, pairs: &[Pair], prefix: usize, scratch: &mut Scratch) {
        let np = pairs.len();
        let stride = pairs.iter().map(|p| p.keys.len()).max().unwrap_or(0).next_multiple_of(LANES);
        let Scratch { scores, maxv, acc: accs, inv, widened, .. } = scratch;
        scores.clear();
        scores.resize(np * stride, 0.0);
        maxv.clear();
        maxv.resize(np * LANES, f32::NEG_INFINITY);
        let (kp, vp, sp) = (kv.k.as_ptr(), kv.v.as_ptr(), scores.as_mut_ptr());
        let scale = _mm512_set1_ps(kv.scale);
        // Scores, 16 keys at a time: first the blocks inside the shared prefix, for all pairs
        // while the 16 K rows are hot, then each pair's own remaining keys.
        // With several pairs and an f16 cache, each block of rows is widened to f32 once (into
        // L1-resident scratch) rather than once per pair; the widening is exact, so the bits
        // are the same either way.
        let widen = np > 1 && std::mem::size_of::<E>() != 4;
        let wp = if widen {
            widened.clear();
            widened.resize(V_STEP.max(LANES) * C * LANES, 0.0);
            widened.as_mut_ptr()
        } else {
            std::ptr::null_mut()
        };
        let shared = (prefix / LANES) * LANES;
        for b in (0..shared).step_by(LANES) {
            let rows: [*const E; 16] = std::array::from_fn(|u| kp.add(kv.row(b + u)));
            let wide: [*const f32; 16] = std::array::from_fn(|u| wp.add(u * C * LANES) as *const f32);
            if widen {
                widen_rows::<E, C>(kv, kp, b, LANES, wp);
            }
            for (pi, pr) in pairs.iter().enumerate() {
                let s = if widen { scores16::<f32, C>(pr.q.as_ptr(), &wide, scale) } else { scores16::<E, C>(pr.q.as_ptr(), &rows, scale) };
                _mm512_storeu_ps(sp.add(pi * stride + b), s);
                let mv = maxv.as_mut_ptr().add(pi * LANES);
                _mm512_storeu_ps(mv, _mm512_max_ps(_mm512_loadu_ps(mv), s));
            }
        }
        inv.clear();
        inv.resize(np, 0.0);
        for (pi, pr) in pairs.iter().enumerate() {
            let n = pr.keys.len();
            let spp = sp.add(pi * stride);
            let mut m = _mm512_loadu_ps(maxv.as_ptr().add(pi * LANES));
            for b in (shared..n).step_by(LANES) {
                let live = (n - b).min(LANES);
                let mut rows = [kp; 16];
                for u in 0..live {
                    rows[u] = kp.add(kv.row(pr.keys[b + u]));
                }
                let s = scores16::<E, C>(pr.q.as_ptr(), &rows, scale);
                let lm = tail_mask(live);
                _mm512_mask_storeu_ps(spp.add(b), lm, s);
                m = _mm512_mask_max_ps(m, lm, m, s);
            }
            // Probabilities (unnormalised) and their sum, as the pair alone would.
            let max = _mm512_set1_ps(_mm512_reduce_max_ps(m));
            let mut lanes = _mm512_setzero_ps();
            for b in (0..n).step_by(LANES) {
                let lm = tail_mask(n - b);
                let e = exp16(_mm512_sub_ps(_mm512_loadu_ps(spp.add(b)), max));
                _mm512_mask_storeu_ps(spp.add(b), lm, e);
                lanes = _mm512_mask_add_ps(lanes, lm, lanes, e);
            }
            let mut l = [0f32; LANES];
            _mm512_storeu_ps(l.as_mut_ptr(), lanes);
            inv[pi] = 1.0 / reduce_lanes(l);
        }
        // Outputs: the shared prefix in steps of V_STEP keys for all pairs (chains parked in
        // scratch between steps), pairs in blocks that share each V row's loads, then each
        // pair's own keys.
        accs.clear();
        accs.resize(np * C * LANES, 0.0);
        let ap = accs.as_mut_ptr();
        let vshared = (prefix / V_STEP) * V_STEP;
        // Pairs per block: their chains and one V row fill most of the 32 vector registers.
        const fn block(c: usize) -> usize {
            if c <= 4 { 4 } else { 2 }
        }
        let pb_max = block(C);
        for j0 in (0..vshared).step_by(V_STEP) {
            if widen {
                widen_rows::<E, C>(kv, vp, j0, V_STEP, wp);
            }
            let mut pi = 0;
            while pi < np {
                let pb = pb_max.min(np - pi);
                macro_rules! run {
                    ($pb:literal) => {{
                        let mut acc: [[__m512; C]; $pb] = std::array::from_fn(|b| std::array::from_fn(|c| _mm512_loadu_ps(ap.add(((pi + b) * C + c) * LANES))));
                        let probs: [*const f32; $pb] = std::array::from_fn(|b| sp.add((pi + b) * stride) as *const f32);
                        if widen {
                            values::<f32, $pb, C>(&mut acc, probs, |j| wp.add((j - j0) * C * LANES) as *const f32, j0, j0 + V_STEP);
                        } else {
                            values::<E, $pb, C>(&mut acc, probs, |j| vp.add(kv.row(j)), j0, j0 + V_STEP);
                        }
                        for (b, acc) in acc.iter().enumerate() {
                            for (c, a) in acc.iter().enumerate() {
                                _mm512_storeu_ps(ap.add(((pi + b) * C + c) * LANES), *a);
                            }
                        }
                    }};
                }
                match pb {
                    4 => run!(4),
                    3 => run!(3),
                    2 => run!(2),
                    _ => run!(1),
                }
                pi += pb;
            }
        }
        for (pi, pr) in pairs.iter().enumerate() {
            let n = pr.keys.len();
            let mut acc: [[__m512; C]; 1] = [std::array::from_fn(|c| _mm512_loadu_ps(ap.add((pi * C + c) * LANES)))];
            values::<E, 1, C>(&mut acc, [sp.add(pi * stride) as *const f32], |j| vp.add(kv.row(pr.keys[j])), vshared, n);
            let invv = _mm512_set1_ps(inv[pi]);
            for (c, a) in acc[0].iter().enumerate() {
                _mm512_storeu_ps(pr.out.0.add(c * LANES), _mm512_mul_ps(*a, invv));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

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
        assert_eq!(k.contains("VNNI"), crate::quant::vnni());
        assert_eq!(k.contains("AMX"), crate::bf16::amx_available());
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

    #[test]
    fn exp_nonpositive_is_accurate() {
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let x = -(i as f32) * 1e-3 * (1.0 + (i % 7) as f32 * 0.01);
            let got = exp_nonpositive(x) as f64;
            let want = (x as f64).exp();
            if want > 1e-30 {
                worst = worst.max(((got - want) / want).abs());
            }
        }
        assert!(worst < 5e-7, "relative error {worst}");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert!(exp_nonpositive(-1000.0) >= 0.0 && exp_nonpositive(-1000.0) < 1e-37);
    }

    #[test]
    fn rms_norm_and_rope_give_candles_bits() {
        use candle_core::{Device, Tensor};
        let dev = Device::Cpu;
        let d = 96;
        let w = Tensor::from_vec(rand_vec(d, 11), d, &dev).unwrap();
        // Row counts below, at and past a group of 8, and past candle's 32-row switch to rayon
        // and this op's switch to the team.
        for rows in [1usize, 3, 8, 13, 40, 200] {
            let x = Tensor::from_vec(rand_vec(rows * d, rows as u64), (rows, d), &dev).unwrap();
            let ours = x.apply_op2_no_bwd(&w, &RmsNormRows { eps: 1e-5 }).unwrap().to_vec2::<f32>().unwrap();
            let theirs = candle_nn::ops::rms_norm(&x, &w, 1e-5).unwrap().to_vec2::<f32>().unwrap();
            assert_eq!(ours, theirs, "rms norm of {rows} rows");
        }
        let bad = Tensor::zeros((2, d + 1), candle_core::DType::F32, &dev).unwrap();
        assert!(bad.apply_op2_no_bwd(&w, &RmsNormRows { eps: 1e-5 }).is_err());
        let (h, hd) = (3, 64);
        for t in [1usize, 5] {
            let x = Tensor::from_vec(rand_vec(t * h * hd, 7 + t as u64), (1, t, h, hd), &dev).unwrap();
            let cos = Tensor::from_vec(rand_vec(t * hd / 2, 8), (t, hd / 2), &dev).unwrap();
            let sin = Tensor::from_vec(rand_vec(t * hd / 2, 9), (t, hd / 2), &dev).unwrap();
            let ours = x.apply_op3_no_bwd(&cos, &sin, &RopeThd).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let theirs = candle_nn::rotary_emb::rope_thd(&x, &cos, &sin).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(ours, theirs, "rope of {t} tokens");
            if t > 1 {
                assert!(x.apply_op3_no_bwd(&cos.narrow(0, 0, 1).unwrap(), &sin, &RopeThd).is_err(), "cos for 1 of {t} tokens");
            }
        }
    }

    /// The decode path's in-place rotation gives [`RopeThd`]'s bits for q and k and leaves v
    /// alone; shapes that do not fit are refused.
    #[test]
    fn rope_in_place_matches_rope_thd() {
        use candle_core::{Device, Tensor};
        let dev = Device::Cpu;
        let (nh, nkv, hd) = (3, 1, 64);
        let w = (nh + 2 * nkv) * hd;
        for t in [1usize, 4] {
            let qkv = Tensor::from_vec(rand_vec(t * w, 21 + t as u64), (t, w), &dev).unwrap();
            let cos = Tensor::from_vec(rand_vec(t * hd / 2, 22), (t, hd / 2), &dev).unwrap();
            let sin = Tensor::from_vec(rand_vec(t * hd / 2, 23), (t, hd / 2), &dev).unwrap();
            let heads = |x: &Tensor, a: usize, n: usize| x.reshape((t, nh + 2 * nkv, hd)).unwrap().narrow(1, a, n).unwrap().contiguous().unwrap();
            let want = |a: usize, n: usize| heads(&qkv, a, n).unsqueeze(0).unwrap().apply_op3_no_bwd(&cos, &sin, &RopeThd).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let (want_q, want_k) = (want(0, nh), want(nh, nkv));
            let v_before = heads(&qkv, nh + nkv, nkv).flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let rotated = qkv.copy().unwrap();
            rotated.inplace_op3(&cos, &sin, &RopeInPlace { heads: nh + nkv }).unwrap();
            let got = |a: usize, n: usize| heads(&rotated, a, n).flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(got(0, nh), want_q, "q, {t} tokens");
            assert_eq!(got(nh, nkv), want_k, "k, {t} tokens");
            assert_eq!(got(nh + nkv, nkv), v_before, "v untouched, {t} tokens");
            assert!(rotated.inplace_op3(&cos, &sin, &RopeInPlace { heads: nh + 2 * nkv + 1 }).is_err(), "more heads than the row holds");
        }
    }

    /// New K/V rows, a strided view as the decode path passes them, land in the head-major cache
    /// with the bits candle's transpose, `to_dtype` and `slice_set` gave, in f16 and f32; rows
    /// past the capacity are refused.
    #[test]
    fn kv_store_matches_candle_conversion() {
        use candle_core::{DType, Device, Tensor};
        let dev = Device::Cpu;
        let (hkv, d, cap, at, t) = (2, 64, 12, 5, 3);
        let wide = Tensor::from_vec(rand_vec(t * (hkv + 1) * d, 31), (t, hkv + 1, d), &dev).unwrap();
        let rows = wide.narrow(1, 1, hkv).unwrap();
        for dtype in [DType::F16, DType::F32] {
            let want = Tensor::zeros((hkv, cap, d), dtype, &dev).unwrap();
            want.slice_set(&rows.transpose(0, 1).unwrap().to_dtype(dtype).unwrap().contiguous().unwrap(), 1, at).unwrap();
            let got = Tensor::zeros((hkv, cap, d), dtype, &dev).unwrap();
            got.inplace_op2(&rows, &KvStore { at }).unwrap();
            let bits = |x: &Tensor| x.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(bits(&got), bits(&want), "{dtype:?}");
            assert!(got.inplace_op2(&rows, &KvStore { at: cap - 1 }).is_err(), "{dtype:?}: past the capacity");
        }
    }

    /// The softmax normaliser: close to f64, and the AVX-512 path gives the portable bits.
    #[test]
    fn sum_exp_below_is_accurate_and_path_independent() {
        for n in [0usize, 1, 15, 16, 17, 1000] {
            let xs: Vec<f32> = rand_vec(n, 40 + n as u64).iter().map(|x| x * 30.0).collect();
            let max = xs.iter().cloned().fold(0f32, f32::max);
            let got = sum_exp_below(&xs, max);
            let want: f64 = xs.iter().map(|&x| ((x - max) as f64).exp()).sum();
            assert!((got as f64 - want).abs() <= 1e-5 * want.max(1e-30), "n={n}: {got} vs {want}");
            assert_eq!(got, sum_exp_below_portable(&xs, max), "n={n}: SIMD and portable bits");
            #[cfg(target_arch = "x86_64")]
            if has_avx2() {
                assert_eq!(unsafe { attend256::sum_exp_below(&xs, max) }, got, "n={n}: AVX2 bits");
            }
        }
    }

    #[test]
    fn simd_attention_matches_the_reference_bit_for_bit() {
        let (hkv, d) = (3, 64);
        let slots = 70;
        let k = rand_vec(slots * hkv * d, 5);
        let v = rand_vec(slots * hkv * d, 6);
        let q = rand_vec(d, 7).iter().map(|x| x * 8.0).collect::<Vec<_>>();
        for n in [1, 15, 16, 17, 40, 70] {
            // Every other slot past 10 is masked, as a tree node skips its siblings.
            let keys: Vec<usize> = (0..slots).filter(|&j| j < 10 || j % 2 == 0).take(n).collect();
            let kv = KvHead { k: &k, v: &v, head_stride: slots * d, kvh: 1, d, scale: 0.125 };
            let (mut s1, mut s2) = (Scratch::default(), Scratch::default());
            let mut want = vec![0f32; d];
            attend_head(&kv, &q, &keys, &mut s1, &mut want);
            // Against f64 softmax attention.
            let sc: Vec<f64> = keys.iter().map(|&j| (0..d).map(|e| q[e] as f64 * k[(slots + j) * d + e] as f64).sum::<f64>() * 0.125).collect();
            let mx = sc.iter().cloned().fold(f64::MIN, f64::max);
            let z: f64 = sc.iter().map(|s| (s - mx).exp()).sum();
            for e in 0..d {
                let r: f64 = keys.iter().zip(&sc).map(|(&j, s)| (s - mx).exp() / z * v[(slots + j) * d + e] as f64).sum();
                assert!((r - want[e] as f64).abs() < 1e-5, "n={n} dim {e}: {r} vs {}", want[e]);
            }
            #[cfg(target_arch = "x86_64")]
            if isa() == Isa::Avx512 {
                let mut got = vec![0f32; d];
                unsafe { attend512::attend_head(&kv, &q, &keys, &mut s2, &mut got) };
                assert_eq!(got, want, "AVX-512 attention differs from the reference for {n} keys");
            }
            #[cfg(target_arch = "x86_64")]
            if has_avx2() {
                let mut got = vec![0f32; d];
                let pairs = [Pair { q: &q, keys: &keys, out: OutPtr(got.as_mut_ptr()) }];
                unsafe { attend256::attend_group(&kv, &pairs, 0, &mut s2) };
                assert_eq!(got, want, "AVX2 attention differs from the reference for {n} keys");
            }
        }
    }

    /// The AVX2 attention over a task of pairs that share a prefix (taken in blocks) and then
    /// have keys of their own, in f32 and f16, gives each pair the one-pair reference's bits;
    /// head sizes of 32 to 128 take their own register counts.
    #[test]
    fn avx2_attention_groups_match_the_reference_bits() {
        if !has_avx2() {
            return;
        }
        use half::f16;
        for d in [32usize, 64, 96, 128] {
            let slots = 300;
            let k = rand_vec(2 * slots * d, 50 + d as u64);
            let v = rand_vec(2 * slots * d, 51 + d as u64);
            let (k16, v16): (Vec<f16>, Vec<f16>) = (k.iter().map(|&x| f16::from_f32(x)).collect(), v.iter().map(|&x| f16::from_f32(x)).collect());
            for prefix in [0usize, 3, 130, 290] {
                // Five pairs: the prefix, then 1-5 keys of their own past it (a node sees itself).
                let lists: Vec<Vec<usize>> = (0..5).map(|p| (0..prefix).chain((prefix..slots).step_by(2).take(p + 1)).collect()).collect();
                let qs: Vec<Vec<f32>> = (0..5).map(|p| rand_vec(d, 60 + p as u64).iter().map(|x| x * 4.0).collect()).collect();
                fn check<E: Elem>(kv: &KvHead<E>, qs: &[Vec<f32>], lists: &[Vec<usize>], prefix: usize, what: &str) {
                    let d = kv.d;
                    let mut got = vec![0f32; qs.len() * d];
                    let pairs: Vec<Pair> = (0..qs.len()).map(|p| Pair { q: &qs[p], keys: &lists[p], out: OutPtr(got[p * d..].as_mut_ptr()) }).collect();
                    #[cfg(target_arch = "x86_64")]
                    unsafe { attend256::attend_group(kv, &pairs, prefix, &mut Scratch::default()) };
                    for p in 0..qs.len() {
                        let mut want = vec![0f32; d];
                        attend_head(kv, &qs[p], &lists[p], &mut Scratch::default(), &mut want);
                        assert_eq!(&got[p * d..(p + 1) * d], &want[..], "{what}: pair {p}, d {d}, prefix {prefix}");
                    }
                }
                check(&KvHead { k: &k[..], v: &v[..], head_stride: slots * d, kvh: 1, d, scale: 0.125 }, &qs, &lists, prefix, "f32");
                check(&KvHead { k: &k16[..], v: &v16[..], head_stride: slots * d, kvh: 1, d, scale: 0.125 }, &qs, &lists, prefix, "f16");
            }
        }
    }

    /// The attention op, whatever its task split and however many rows and heads share the
    /// prefix's K/V rows, gives every (row, head) the bits of the portable one-pair reference.
    #[test]
    fn tree_attention_op_matches_one_pair_reference() {
        use candle_core::{Device, Tensor};
        use half::f16;
        let (h, hkv, d) = (6, 2, 64);
        let parents = [None, Some(0), Some(0), Some(1), Some(1), Some(2), Some(3), Some(6), Some(0), Some(8), Some(9), Some(9), Some(4), Some(12), Some(13), Some(14), Some(15)];
        for (t, prefix) in [(1, 0), (1, 70), (3, 15), (5, 16), (17, 64), (17, 130), (12, 200)] {
            let mask = TreeMask::from_parents(&parents[..t]).unwrap();
            let s = prefix + t;
            // K/V as the cache hands them over: a view of the first s slots of a larger buffer.
            let cap = s + 5;
            let q = rand_vec(t * h * d, 11 + t as u64);
            let k = rand_vec(hkv * cap * d, 12 + prefix as u64);
            let v = rand_vec(hkv * cap * d, 13);
            let (k16, v16): (Vec<f16>, Vec<f16>) = (k.iter().map(|&x| f16::from_f32(x)).collect(), v.iter().map(|&x| f16::from_f32(x)).collect());
            let dev = Device::Cpu;
            let op = TreeAttention { mask: std::sync::Arc::new(mask.clone()), prefix_len: prefix, scale: 0.125 };
            let qt = Tensor::from_vec(q.clone(), (t, h, d), &dev).unwrap();
            let view = |t: Tensor| t.reshape((hkv, cap, d)).unwrap().narrow(1, 0, s).unwrap();
            let run = |k: Tensor, v: Tensor| -> Vec<f32> { qt.apply_op3_no_bwd(&view(k), &view(v), &op).unwrap().flatten_all().unwrap().to_vec1().unwrap() };
            let got32 = run(Tensor::new(k.as_slice(), &dev).unwrap(), Tensor::new(v.as_slice(), &dev).unwrap());
            let got16 = run(Tensor::new(k16.as_slice(), &dev).unwrap(), Tensor::new(v16.as_slice(), &dev).unwrap());
            // q as the decode path passes it: the first h heads of wider rows (fused q/k/v).
            let wide = Tensor::cat(&[&qt, &Tensor::ones((t, 3, d), candle_core::DType::F32, &dev).unwrap()], 1).unwrap();
            let qv = wide.narrow(1, 0, h).unwrap();
            assert!(!qv.is_contiguous() || t == 1);
            let got_view: Vec<f32> = qv.apply_op3_no_bwd(&view(Tensor::new(k.as_slice(), &dev).unwrap()), &view(Tensor::new(v.as_slice(), &dev).unwrap()), &op).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(got_view, got32, "q as a view, t={t} prefix={prefix}");
            for i in 0..t {
                let keys: Vec<usize> = (0..prefix).chain((0..t).filter(|&j| mask.sees(i, j)).map(|j| prefix + j)).collect();
                for hh in 0..h {
                    let (q0, kvh) = ((i * h + hh) * d, hh / (h / hkv));
                    let mut want = vec![0f32; d];
                    let kv = KvHead { k: &k, v: &v, head_stride: cap * d, kvh, d, scale: 0.125 };
                    attend_head(&kv, &q[q0..q0 + d], &keys, &mut Scratch::default(), &mut want);
                    assert_eq!(&got32[q0..q0 + d], &want[..], "f32 t={t} prefix={prefix} row {i} head {hh}");
                    let kv = KvHead { k: &k16, v: &v16, head_stride: cap * d, kvh, d, scale: 0.125 };
                    attend_head(&kv, &q[q0..q0 + d], &keys, &mut Scratch::default(), &mut want);
                    assert_eq!(&got16[q0..q0 + d], &want[..], "f16 t={t} prefix={prefix} row {i} head {hh}");
                }
            }
        }
        // Mixed K/V types are refused, not misread.
        let k = Tensor::zeros((1, 1, 16), candle_core::DType::F16, &dev_cpu()).unwrap();
        let v = Tensor::zeros((1, 1, 16), candle_core::DType::F32, &dev_cpu()).unwrap();
        let q = Tensor::zeros((1, 1, 16), candle_core::DType::F32, &dev_cpu()).unwrap();
        let op = TreeAttention { mask: std::sync::Arc::new(TreeMask::causal(1)), prefix_len: 0, scale: 0.25 };
        assert!(q.apply_op3_no_bwd(&k, &v, &op).is_err());
    }

    fn dev_cpu() -> candle_core::Device {
        candle_core::Device::Cpu
    }

    /// The fused SwiGLU agrees with candle's `silu(g) * u` to a few ulp, over the whole range
    /// (large |g| included), and its SIMD and portable paths give the same bits.
    #[test]
    fn swiglu_matches_candle_and_portable_bits() {
        use candle_core::{Device, Tensor};
        let (t, n) = (5, 37);
        let mut x: Vec<f32> = rand_vec(t * 2 * n, 21).iter().map(|v| v * 24.0).collect();
        x[0] = 0.0;
        x[1] = -0.0;
        x[2] = 95.0;
        x[3] = -120.0;
        x[4] = 1e-30;
        let xt = Tensor::from_vec(x.clone(), (t, 2 * n), &Device::Cpu).unwrap();
        let got: Vec<f32> = xt.apply_op1_no_bwd(&SwiGlu).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let g = xt.narrow(1, 0, n).unwrap();
        let u = xt.narrow(1, n, n).unwrap();
        let want: Vec<f32> = (candle_nn::ops::silu(&g).unwrap() * u).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!((a - b).abs() <= 4e-7 * b.abs().max(1e-30) + 1e-37, "[{i}] x {} -> {a} vs {b}", x[(i / n) * 2 * n + i % n]);
        }
        let mut port = vec![0f32; t * n];
        for i in 0..t {
            let row = &x[i * 2 * n..(i + 1) * 2 * n];
            swiglu_row(&row[..n], &row[n..], &mut port[i * n..(i + 1) * n]);
        }
        assert_eq!(port, got);
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            let mut avx2 = vec![0f32; t * n];
            for i in 0..t {
                let row = &x[i * 2 * n..(i + 1) * 2 * n];
                unsafe { swiglu256(&row[..n], &row[n..], &mut avx2[i * n..(i + 1) * n]) };
            }
            assert_eq!(avx2, got, "AVX2 SwiGLU bits");
        }
        assert!(Tensor::zeros((2, 5), candle_core::DType::F32, &Device::Cpu).unwrap().apply_op1_no_bwd(&SwiGlu).is_err());
    }

    #[test]
    fn tree_mask_from_parents() {
        // 0 <- 1, 0 <- 2, 1 <- 3
        let m = TreeMask::from_parents(&[None, Some(0), Some(0), Some(1)]).unwrap();
        assert!(m.sees(3, 1) && m.sees(3, 0) && !m.sees(3, 2) && !m.sees(2, 1));
        assert_eq!(TreeMask::from_parents(&[None, Some(0)]).unwrap(), TreeMask::causal(2));
        assert!(TreeMask::from_parents(&[None, Some(1)]).is_err());
        let add = m.additive(2, 0);
        assert_eq!(add.len(), 4 * 6);
        assert_eq!(add[3 * 6 + 2 + 2], f32::NEG_INFINITY);
        assert_eq!(add[3 * 6 + 2 + 1], 0.0);
        assert_eq!(m.additive(2, 3), add[3 * 6..].to_vec(), "the last rows alone");
    }
}
