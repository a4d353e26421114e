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

/// Output pointer shared across rayon tasks that write disjoint columns.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub(crate) *mut f32);
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

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

pub(crate) fn isa() -> Isa {
    static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512dq") {
                return Isa::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
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
    let mut out = vec![0f32; m * n];
    let ptr = OutPtr(out.as_mut_ptr());
    // Blocks of columns large enough to amortise task overhead, small enough to balance 2+ cores.
    let block = (n / (rayon::current_num_threads() * 8)).clamp(16, 512) / 4 * 4;
    let block = block.max(4);
    let nblocks = n.div_ceil(block);
    let isa = isa();
    (0..nblocks).into_par_iter().for_each(|b| {
        let n0 = b * block;
        let n1 = (n0 + block).min(n);
        let ptr = ptr;
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { avx512::block(x, m, k, w, n0, n1, n, ptr) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { matmul_block_avx2(x, m, k, w, n0, n1, n, ptr) },
            Isa::Portable => matmul_block(x, m, k, w, n0, n1, n, ptr),
        }
    });
    out
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

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512_packed {
    use super::{OutPtr, PackedWeight, PANEL};
    use std::arch::x86_64::*;

    /// A panel element type: 16 of them load as 16 f32 lanes (f32 as is, f16 converted), so
    /// one kernel serves both formats.
    pub(crate) trait PanelElem: Copy {
        /// # Safety
        /// `p` must point at 16 readable elements, on a CPU with AVX-512F.
        unsafe fn load16(p: *const Self) -> __m512;
    }
    impl PanelElem for f32 {
        #[inline(always)]
        unsafe fn load16(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
    }
    /// f16 bits.
    impl PanelElem for u16 {
        #[inline(always)]
        unsafe fn load16(p: *const u16) -> __m512 {
            _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
        }
    }

    /// `MR` activation rows x `NR` panels (16 columns each).
    #[inline(always)]
    unsafe fn tile<E: PanelElem, const MR: usize, const NR: usize>(x: *const f32, k: usize, w: *const E, i0: usize, p0: usize, n: usize, out: OutPtr) {
        let mut acc = [[_mm512_setzero_ps(); NR]; MR];
        let panel_len = k * PANEL;
        for kk in 0..k {
            let mut wv = [_mm512_setzero_ps(); NR];
            for (jj, wv) in wv.iter_mut().enumerate() {
                *wv = E::load16(w.add((p0 + jj) * panel_len + kk * PANEL));
            }
            for (ii, row) in acc.iter_mut().enumerate() {
                let xb = _mm512_set1_ps(*x.add((i0 + ii) * k + kk));
                for jj in 0..NR {
                    row[jj] = _mm512_fmadd_ps(xb, wv[jj], row[jj]);
                }
            }
        }
        store_tile(&acc, i0, p0, n, out);
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

    #[inline(always)]
    unsafe fn panels<E: PanelElem, const NR: usize>(x: *const f32, m: usize, k: usize, w: *const E, p: usize, n: usize, out: OutPtr) {
        let mut i = 0;
        while i + 4 <= m {
            tile::<E, 4, NR>(x, k, w, i, p, n, out);
            i += 4;
        }
        match m - i {
            3 => tile::<E, 3, NR>(x, k, w, i, p, n, out),
            2 => tile::<E, 2, NR>(x, k, w, i, p, n, out),
            1 => tile::<E, 1, NR>(x, k, w, i, p, n, out),
            _ => {}
        }
    }

    /// Panels `p0..p1` of a `[n, k]` weight stored as `[panel][k][16]` elements at `w`.
    ///
    /// # Safety
    /// AVX-512F must be present; `w` must hold `ceil(n/16) * k * 16` elements and `x` `m * k`.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn block_of<E: PanelElem>(x: &[f32], m: usize, k: usize, n: usize, w: *const E, p0: usize, p1: usize, out: OutPtr) {
        let xp = x.as_ptr();
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

    #[target_feature(enable = "avx512f")]
    pub unsafe fn block(x: &[f32], m: usize, pw: &PackedWeight, p0: usize, p1: usize, out: OutPtr) {
        block_of(x, m, pw.k, pw.n, pw.data.as_ptr(), p0, p1, out)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn packed_block_avx2(x: &[f32], m: usize, pw: &PackedWeight, p0: usize, p1: usize, out: OutPtr) {
    packed_block(x, m, pw, p0, p1, out)
}

/// `out[m][n] = sum_k x[m][k] * w[n][k]` with a packed weight; batch-invariant (one in-order FMA
/// chain per output, the same on every instruction-set path).
pub fn matmul_packed(x: &[f32], m: usize, pw: &PackedWeight) -> Vec<f32> {
    assert_eq!(x.len(), m * pw.k, "x has {} values, expected {m}x{}", x.len(), pw.k);
    let n = pw.n;
    let mut out = vec![0f32; m * n];
    let ptr = OutPtr(out.as_mut_ptr());
    let panels = n.div_ceil(PANEL);
    // Groups of 4 panels (64 columns); enough tasks to balance the cores.
    let per_task = (panels / (rayon::current_num_threads() * 8)).clamp(4, 32) / 4 * 4;
    let tasks = panels.div_ceil(per_task);
    let isa = isa();
    (0..tasks).into_par_iter().for_each(|t| {
        let p0 = t * per_task;
        let p1 = (p0 + per_task).min(panels);
        let ptr = ptr;
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { avx512_packed::block(x, m, pw, p0, p1, ptr) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { packed_block_avx2(x, m, pw, p0, p1, ptr) },
            Isa::Portable => packed_block(x, m, pw, p0, p1, ptr),
        }
    });
    out
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
/// (`prefix_len` slots); among the new tokens it sees itself and its ancestors only.
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

    /// Additive mask `[t, prefix_len + t]` (0 or -inf) for devices that use candle's ops.
    pub fn additive(&self, prefix_len: usize) -> Vec<f32> {
        let s = prefix_len + self.t;
        let mut m = vec![0f32; self.t * s];
        for i in 0..self.t {
            for j in 0..self.t {
                if !self.sees(i, j) {
                    m[i * s + prefix_len + j] = f32::NEG_INFINITY;
                }
            }
        }
        m
    }
}

/// Tree attention on the CPU: `q [t, h, d]`, `k, v [s, hkv, d]` with `s = prefix_len + t`.
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
        let q = contiguous(sq, lq, "attention q")?;
        let k = contiguous(sk, lk, "attention k")?;
        let v = contiguous(sv, lv, "attention v")?;
        let (t, h, d) = lq.shape().dims3()?;
        let (s, hkv, d2) = lk.shape().dims3()?;
        if d != d2 || lv.shape().dims3()? != (s, hkv, d) || s != self.prefix_len + t || t != self.mask.len() || h % hkv != 0 {
            candle_core::bail!("tree attention: shapes q {:?} k {:?} v {:?} prefix {}", lq.shape(), lk.shape(), lv.shape(), self.prefix_len)
        }
        let group = h / hkv;
        let mut out = vec![0f32; t * h * d];
        let prefix = self.prefix_len;
        let mask = &self.mask;
        let scale = self.scale;
        let isa = isa();
        // One task per (row, key/value head): the query heads sharing that K/V head (grouped-
        // query attention) read each key and value row once between them.
        out.par_chunks_mut(group * d).enumerate().for_each_init(
            || (Vec::<f32>::new(), Vec::<usize>::new()),
            |(scores, keys), (task, o)| {
                let (i, kvh) = (task / hkv, task % hkv);
                let q0 = (i * h + kvh * group) * d;
                keys.clear();
                keys.extend(0..prefix);
                keys.extend((0..t).filter(|&j| mask.sees(i, j)).map(|j| prefix + j));
                let args = AttendRow { q: &q[q0..q0 + group * d], k, v, keys, hkv, kvh, d, group, scale };
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 => unsafe { attend_row_avx512(&args, scores, o) },
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => unsafe { attend_row_fma(&args, scores, o) },
                    _ => attend_row(&args, scores, o),
                }
            },
        );
        Ok((CpuStorage::F32(out), Shape::from((t, h, d))))
    }
}

struct AttendRow<'a> {
    /// The `group` query vectors (`[group][d]`) that share K/V head `kvh`.
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    keys: &'a [usize],
    hkv: usize,
    kvh: usize,
    d: usize,
    group: usize,
    scale: f32,
}

/// `e^x` for x <= 0 (softmax after subtracting the max), within ~2 ulp: Cody-Waite range
/// reduction and a degree-6 polynomial, all fused multiply-adds in a fixed order, so it gives
/// the same bits on every instruction-set path and vectorises (libm's expf is a call per value).
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const MAGIC: f32 = 12582912.0; // 1.5 * 2^23: adding it rounds to an integer
    let x = x.max(-87.0);
    let n = (x * LOG2E + MAGIC) - MAGIC;
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    let mut p = 1.987_569_1e-4f32;
    p = p.mul_add(r, 1.398_199_9e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 1.666_666_5e-1);
    p = p.mul_add(r, 5e-1);
    let e = (r * r).mul_add(p, r) + 1.0;
    e * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// The query heads of one row that share a K/V head: scores over `keys` in slot order, softmax,
/// weighted sum of V. Each head's arithmetic is the same whatever the number of rows or heads.
#[inline(always)]
fn attend_row(a: &AttendRow, scores: &mut Vec<f32>, o: &mut [f32]) {
    let (d, hkv, kvh, g) = (a.d, a.hkv, a.kvh, a.group);
    let n = a.keys.len();
    scores.clear();
    scores.resize(g * n, 0.0);
    for (jj, &j) in a.keys.iter().enumerate() {
        let kv = &a.k[(j * hkv + kvh) * d..(j * hkv + kvh + 1) * d];
        for hh in 0..g {
            scores[hh * n + jj] = dot_fixed(&a.q[hh * d..(hh + 1) * d], kv) * a.scale;
        }
    }
    let mut inv = [0f32; 16];
    let mut inv_big = Vec::new();
    let inv: &mut [f32] = if g <= 16 { &mut inv[..g] } else { inv_big.resize(g, 0.0); &mut inv_big };
    for hh in 0..g {
        let row = &mut scores[hh * n..(hh + 1) * n];
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        for sc in row.iter_mut() {
            *sc = exp_nonpositive(*sc - max);
        }
        let mut sum = 0f32;
        for &sc in row.iter() {
            sum += sc;
        }
        inv[hh] = 1.0 / sum;
    }
    o.fill(0.0);
    for (jj, &j) in a.keys.iter().enumerate() {
        let vv = &a.v[(j * hkv + kvh) * d..(j * hkv + kvh + 1) * d];
        for hh in 0..g {
            let p = scores[hh * n + jj];
            for (o, &x) in o[hh * d..(hh + 1) * d].iter_mut().zip(vv) {
                *o = p.mul_add(x, *o);
            }
        }
    }
    for hh in 0..g {
        for o in o[hh * d..(hh + 1) * d].iter_mut() {
            *o *= inv[hh];
        }
    }
}

/// The same code compiled with hardware FMA (identical results, as FMA is exactly rounded).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_row_fma(a: &AttendRow, scores: &mut Vec<f32>, o: &mut [f32]) {
    attend_row(a, scores, o)
}

/// And with AVX-512 (again identical results: same operations, wider registers).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn attend_row_avx512(a: &AttendRow, scores: &mut Vec<f32>, o: &mut [f32]) {
    attend_row(a, scores, o)
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
        let x = rand_vec(9 * k, 4);
        let pw = PackedWeight::pack(&w, n, k);
        let full = matmul_packed(&x, 9, &pw);
        for i in 0..9 {
            let one = matmul_packed(&x[i * k..(i + 1) * k], 1, &pw);
            assert_eq!(one, full[i * n..(i + 1) * n].to_vec(), "row {i} differs between M=1 and M=9");
            for j in 0..n {
                let r: f64 = (0..k).map(|q| x[i * k + q] as f64 * w[j * k + q] as f64).sum();
                assert!((r - full[i * n + j] as f64).abs() < 1e-4);
            }
        }
        // The portable path computes the very same chains.
        let mut port = vec![0f32; 9 * n];
        packed_block(&x, 9, &pw, 0, n.div_ceil(PANEL), OutPtr(port.as_mut_ptr()));
        assert_eq!(port, full);
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
    fn tree_mask_from_parents() {
        // 0 <- 1, 0 <- 2, 1 <- 3
        let m = TreeMask::from_parents(&[None, Some(0), Some(0), Some(1)]).unwrap();
        assert!(m.sees(3, 1) && m.sees(3, 0) && !m.sees(3, 2) && !m.sees(2, 1));
        assert_eq!(TreeMask::from_parents(&[None, Some(0)]).unwrap(), TreeMask::causal(2));
        assert!(TreeMask::from_parents(&[None, Some(1)]).is_err());
        let add = m.additive(2);
        assert_eq!(add.len(), 4 * 6);
        assert_eq!(add[3 * 6 + 2 + 2], f32::NEG_INFINITY);
        assert_eq!(add[3 * 6 + 2 + 1], 0.0);
    }
}
