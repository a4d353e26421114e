//! The small per-row operations of a forward as candle custom ops, batch-invariant like the
//! matmuls: RMSNorm, RoPE, SwiGLU, the row matmul op, and KV-cache stores and compaction.
use std::mem::MaybeUninit;

use candle_core::{CpuStorage, CustomOp2, Layout, Shape};

use crate::cpu::isa::{isa, Isa};
use crate::cpu::matmul::*;
use crate::cpu::exp::*;
use crate::cpu::storage::*;

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
        glu_fwd::<false>(s, l, "swiglu")
    }
}

/// `gelu_tanh(g) * u` per row of `x = [g | u]` (Gemma's MLP), as [`SwiGlu`] does for SiLU.
/// `0.5 g (1 + tanh(a))` is `g / (1 + e^(-2a))` exactly, with `a = sqrt(2/pi) (g + 0.044715
/// g^3)`, so it is SiLU's formula with another exponent: no cancellation, no libm `tanhf` per
/// value. Why: candle's GELU (libm `tanhf` and `expm1f`, then a separate multiply) was 14% of
/// an 8-token Gemma-3-270M forward on a 2-core Zen 4.
pub struct GeluTanhGlu;

impl candle_core::CustomOp1 for GeluTanhGlu {
    fn name(&self) -> &'static str {
        "selfspec-gelu-tanh-glu"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        glu_fwd::<true>(s, l, "gelu-tanh glu")
    }
}

/// `act(g) * u` per row of `[g | u]`: SiLU, or GELU (tanh) when `GELU`.
fn glu_fwd<const GELU: bool>(s: &CpuStorage, l: &Layout, what: &str) -> candle_core::Result<(CpuStorage, Shape)> {
    let x = contiguous(s, l, what)?;
    let (t, w) = l.shape().dims2()?;
    if w % 2 != 0 {
        candle_core::bail!("{what}: width {w} is not [gate | up]")
    }
    let n = w / 2;
    let simd = isa();
    let row = |(x, o): (&[f32], &mut [MaybeUninit<f32>])| {
        let (g, u) = x.split_at(n);
        #[cfg(target_arch = "x86_64")]
        if simd == Isa::Avx512 {
            unsafe { glu512::<GELU>(g, u, o) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if simd == Isa::Avx2 {
            unsafe { glu256::<GELU>(g, u, o) };
            return;
        }
        let _ = simd;
        glu_row::<GELU>(g, u, o);
    };
    // SAFETY: the rows cover all `t * n` values and each row kernel stores its whole row.
    let out = unsafe { filled(t * n, |out| {
        if t * w >= crate::cpu::team::PAR_MIN_VALUES {
            let mut rows: Vec<(&[f32], &mut [MaybeUninit<f32>])> = x.chunks(w).zip(out.chunks_mut(n)).collect();
            crate::cpu::team::for_each_mut(&mut rows, |_, (x, o)| row((x, o)));
        } else {
            x.chunks(w).zip(out.chunks_mut(n)).for_each(row);
        }
    }) };
    Ok((CpuStorage::F32(out), Shape::from((t, n))))
}

/// RMS norm per row with candle's own arithmetic (`candle_nn::ops::rms_norm`: a row's squares
/// summed in order in f32, then `x / sqrt(mean + eps) * w`), so it gives the same bits. Why:
/// candle sums one row at a time, a chain of dependent adds, on the calling thread while the
/// team waits (3% of an 8-row native forward); here eight rows' chains run side by side.
pub struct RmsNormRows {
    pub eps: f32,
}

/// `&mut [f32]` as `&mut [MaybeUninit<f32>]`, for tests that hand the kernels ordinary buffers.
///
/// # Safety
/// Only initialised values may be written through the result (the kernels write nothing else).
#[cfg(test)]
unsafe fn as_uninit(s: &mut [f32]) -> &mut [MaybeUninit<f32>] {
    // SAFETY: same layout; the caller writes only initialised f32 values through it.
    unsafe { &mut *(s as *mut [f32] as *mut [MaybeUninit<f32>]) }
}

/// Rows summed side by side in [`RmsNormRows`].
const NORM_ROWS: usize = 8;

/// Runs `$f(args)` compiled for AVX-512 or AVX2 where this CPU has them, else as it is: the
/// same scalar code, vectorised wider by the compiler. The bits do not change (IEEE operations,
/// and Rust never contracts a multiply and an add into one FMA). Why: the crate is built for
/// baseline x86-64, so these loops ran 4 lanes wide on the calling thread while the team waited.
/// (The closure runs with the wider features once the compiler inlines it into the wrapper, as
/// it does for these one-call closures; were it not inlined, it would run as before, with the
/// same bits. A macro rather than one generic function: written as a function taking the
/// closure, the wrappers were left calling it out of line, 4 lanes wide.)
macro_rules! wide {
    ($f:ident($($a:expr),*) as $t512:ident, $t256:ident) => {{
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx512f,avx512dq")]
        unsafe fn $t512(f: impl FnOnce()) {
            f()
        }
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2")]
        unsafe fn $t256(f: impl FnOnce()) {
            f()
        }
        // SAFETY: `isa()` reports AVX-512 (F and DQ, the features enabled) or AVX2 only where
        // the CPU has them.
        match isa() {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { $t512(|| $f($($a),*)) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { $t256(|| $f($($a),*)) },
            _ => $f($($a),*),
        }
    }};
}

fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [MaybeUninit<f32>]) {
    wide!(rms_norm_rows_body(x, w, eps, out) as norm512, norm256)
}

#[inline(always)]
fn rms_norm_rows_body(x: &[f32], w: &[f32], eps: f32, out: &mut [MaybeUninit<f32>]) {
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
            o.write(v / m * a);
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
        let group = NORM_ROWS * n;
        // SAFETY: the groups cover all values and each group's rows are written whole.
        let out = unsafe { filled(x.len(), |out| {
            if x.len() >= crate::cpu::team::PAR_MIN_VALUES {
                let mut parts: Vec<(&[f32], &mut [MaybeUninit<f32>])> = x.chunks(group).zip(out.chunks_mut(group)).collect();
                crate::cpu::team::for_each_mut(&mut parts, |_, (x, o)| rms_norm_rows(x, w, self.eps, o));
            } else {
                x.chunks(group).zip(out.chunks_mut(group)).for_each(|(x, o)| rms_norm_rows(x, w, self.eps, o));
            }
        }) };
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
        wide!(rope_rows_in_place(x, w, self.heads, cos, sin, half) as rope512, rope256);
        Ok(())
    }
}

#[inline(always)]
fn rope_rows_in_place(x: &mut [f32], w: usize, heads: usize, cos: &[f32], sin: &[f32], half: usize) {
    let d = 2 * half;
    for (i, row) in x.chunks_mut(w).enumerate() {
        let (c, s) = (&cos[i * half..(i + 1) * half], &sin[i * half..(i + 1) * half]);
        for head in row[..heads * d].chunks_mut(d) {
            let (x1, x2) = head.split_at_mut(half);
            for j in 0..half {
                let (a, b) = (x1[j], x2[j]);
                x1[j] = a * c[j] - b * s[j];
                x2[j] = a * s[j] + b * c[j];
            }
        }
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

/// `-2 sqrt(2/pi)`: GELU's exponent factor.
const GELU_C: f32 = -1.595_769_2;
const GELU_K: f32 = 0.044_715;

/// The exponent `x` of `act(g) = g / (1 + e^x)`: `-g` for SiLU; for GELU (tanh)
/// `(g * GELU_C) * fma(g * g, GELU_K, 1)`, which the SIMD paths compute in the same steps.
#[inline(always)]
fn glu_exponent<const GELU: bool>(g: f32) -> f32 {
    if GELU {
        (g * GELU_C) * (g * g).mul_add(GELU_K, 1.0)
    } else {
        -g
    }
}

#[inline(always)]
fn glu_row<const GELU: bool>(g: &[f32], u: &[f32], o: &mut [MaybeUninit<f32>]) {
    for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
        o.write(g / (1.0 + exp_clamped(glu_exponent::<GELU>(g))) * u);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn glu512<const GELU: bool>(g: &[f32], u: &[f32], o: &mut [MaybeUninit<f32>]) {
    use std::arch::x86_64::*;
    let n = g.len();
    let mut i = 0;
    let one = _mm512_set1_ps(1.0);
    while i < n {
        let m = if n - i >= LANES { 0xffff } else { ((1u32 << (n - i)) - 1) as __mmask16 };
        let gv = _mm512_maskz_loadu_ps(m, g.as_ptr().add(i));
        let uv = _mm512_maskz_loadu_ps(m, u.as_ptr().add(i));
        let arg = if GELU {
            let inner = _mm512_fmadd_ps(_mm512_mul_ps(gv, gv), _mm512_set1_ps(GELU_K), one);
            _mm512_mul_ps(_mm512_mul_ps(gv, _mm512_set1_ps(GELU_C)), inner)
        } else {
            _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gv), _mm512_set1_epi32(i32::MIN)))
        };
        let x = _mm512_min_ps(_mm512_max_ps(arg, _mm512_set1_ps(EXP_MIN)), _mm512_set1_ps(EXP_MAX));
        let e = crate::cpu::exp::avx512::exp16_in_range(x);
        let y = _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), uv);
        _mm512_mask_storeu_ps(o.as_mut_ptr().add(i) as *mut f32, m, y);
        i += LANES;
    }
}

/// [`glu512`] in 8 lanes: the same operations per value.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn glu256<const GELU: bool>(g: &[f32], u: &[f32], o: &mut [MaybeUninit<f32>]) {
    use std::arch::x86_64::*;
    let n = g.len();
    let body = n / 8 * 8;
    let one = _mm256_set1_ps(1.0);
    let mut i = 0;
    while i < body {
        let gv = _mm256_loadu_ps(g.as_ptr().add(i));
        let uv = _mm256_loadu_ps(u.as_ptr().add(i));
        let arg = if GELU {
            let inner = _mm256_fmadd_ps(_mm256_mul_ps(gv, gv), _mm256_set1_ps(GELU_K), one);
            _mm256_mul_ps(_mm256_mul_ps(gv, _mm256_set1_ps(GELU_C)), inner)
        } else {
            _mm256_xor_ps(gv, _mm256_set1_ps(-0.0))
        };
        let x = _mm256_min_ps(_mm256_max_ps(arg, _mm256_set1_ps(EXP_MIN)), _mm256_set1_ps(EXP_MAX));
        let e = crate::cpu::exp::avx2::exp8_in_range(x);
        _mm256_storeu_ps(o.as_mut_ptr().add(i) as *mut f32, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), uv));
        i += 8;
    }
    // The tail through the scalar code, compiled here with FMA (the same rounding).
    glu_row::<GELU>(&g[body..], &u[body..], &mut o[body..]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::isa::has_avx2;
    use crate::cpu::testutil::*;

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

    /// The portable and AVX2 GLU rows give `got`'s bits (the op's own path on this machine).
    fn same_bits_on_every_path<const GELU: bool>(x: &[f32], t: usize, n: usize, got: &[f32]) {
        // NaN-filled, so a value a kernel leaves unwritten fails the comparison.
        let mut port = vec![f32::NAN; t * n];
        for i in 0..t {
            let row = &x[i * 2 * n..(i + 1) * 2 * n];
            glu_row::<GELU>(&row[..n], &row[n..], unsafe { as_uninit(&mut port[i * n..(i + 1) * n]) });
        }
        assert_eq!(port, got, "portable bits (GELU: {GELU})");
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            let mut avx2 = vec![f32::NAN; t * n];
            for i in 0..t {
                let row = &x[i * 2 * n..(i + 1) * 2 * n];
                unsafe { glu256::<GELU>(&row[..n], &row[n..], as_uninit(&mut avx2[i * n..(i + 1) * n])) };
            }
            assert_eq!(avx2, got, "AVX2 bits (GELU: {GELU})");
        }
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
        same_bits_on_every_path::<false>(&x, t, n, &got);
        assert!(Tensor::zeros((2, 5), candle_core::DType::F32, &Device::Cpu).unwrap().apply_op1_no_bwd(&SwiGlu).is_err());
    }

    /// The fused GELU (tanh) GLU agrees with candle's `gelu(g) * u` (libm `tanhf`) to a few
    /// ulp of the larger of the result and `u` (near g = 0 the result is small against its
    /// inputs), over the whole range, and its SIMD and portable paths give the same bits.
    #[test]
    fn gelu_tanh_glu_matches_candle_and_portable_bits() {
        use candle_core::{Device, Tensor};
        let (t, n) = (5, 37);
        let mut x: Vec<f32> = rand_vec(t * 2 * n, 22).iter().map(|v| v * 12.0).collect();
        for (i, v) in [0.0, -0.0, 95.0, -120.0, 1e-30, -3.0, 3.0, -0.5].into_iter().enumerate() {
            x[i] = v;
        }
        let xt = Tensor::from_vec(x.clone(), (t, 2 * n), &Device::Cpu).unwrap();
        let got: Vec<f32> = xt.apply_op1_no_bwd(&GeluTanhGlu).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let g = xt.narrow(1, 0, n).unwrap();
        let u = xt.narrow(1, n, n).unwrap();
        let want: Vec<f32> = (g.gelu().unwrap() * &u).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let us: Vec<f32> = u.flatten_all().unwrap().to_vec1().unwrap();
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            let gi = x[(i / n) * 2 * n + i % n];
            let tol = 1e-6 * b.abs().max(us[i].abs() * gi.abs().min(1.0)) + 1e-37;
            assert!((a - b).abs() <= tol, "[{i}] g {gi} -> {a} vs {b}");
        }
        same_bits_on_every_path::<true>(&x, t, n, &got);
        assert!(Tensor::zeros((2, 5), candle_core::DType::F32, &Device::Cpu).unwrap().apply_op1_no_bwd(&GeluTanhGlu).is_err());
    }
}
