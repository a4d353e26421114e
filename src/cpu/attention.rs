//! Tree attention: each new row attends over the committed prefix and its own ancestors in the
//! step's tree ([`TreeMask`]), with one fixed summation order per row whatever the row count.
//! Also the exp polynomial its softmax (and drafting's top-k) uses.
use candle_core::{CpuStorage, CustomOp3, Layout, Shape};

use crate::cpu::isa::{isa, Isa};
use crate::cpu::matmul::*;
use crate::cpu::exp::*;
use crate::cpu::storage::*;

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

/// Tree attention on the CPU: `q [t, h, d]`, `k, v [hkv, s, d]` (head-major, as the KV cache
/// holds them; a view whose heads lie apart is fine) with `s = prefix_len + mask.len()`.
/// The queries are the mask's last `t` nodes; its first `mask.len() - t` are already in the
/// cache after the prefix (a drafter's earlier tree levels), seen only by their descendants.
/// Keys are visited in slot order and masked keys are skipped, so a node's output is
/// bit-identical to the one computed when its path is decoded one token at a time.
#[derive(Clone)]
pub struct TreeAttention {
    pub mask: std::sync::Arc<TreeMask>,
    pub prefix_len: usize,
    pub scale: f32,
    /// A sliding window: per query row, the first key slot it sees (earlier slots, cached or
    /// new, are outside its window). None: every row sees every slot its mask allows.
    pub first_key: Option<std::sync::Arc<Vec<usize>>>,
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
        let first_key = |i: usize| self.first_key.as_ref().map_or(0, |f| f.get(i).copied().unwrap_or(0));
        if self.first_key.as_ref().is_some_and(|f| f.len() != t) {
            candle_core::bail!("tree attention: a window start for each of {t} rows expected")
        }
        // The K/V rows of the cached prefix that every row sees are fetched once per task; a
        // window that clips any row's prefix leaves none shared (each row's list is its own).
        let shared = if (0..t).any(|i| first_key(i) > 0) { 0 } else { prefix };
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
        //
        // An even run where that still leaves two tasks a thread: the AVX-512 score loop takes
        // pairs two at a time, and an odd run leaves one pair on the slower single-pair loop
        // (8-row calls at a 2,048-token context 293 -> 255 us, `examples/attention_bench`).
        let threads = crate::cpu::team::threads();
        // About four tasks a thread, in whole units, at most MAX_PAIRS_PER_TASK (or one unit).
        let run_of = |unit: usize| {
            let wanted = (t * h / (threads * 4)).clamp(1, MAX_PAIRS_PER_TASK);
            (wanted.div_ceil(unit) * unit).min((MAX_PAIRS_PER_TASK / unit).max(1) * unit)
        };
        let pairs_loop = matches!(isa, Isa::Avx512) && d % LANES == 0 && d / LANES <= attend512::PAIRED_MAX_CHUNKS;
        let per_task = match run_of(2 * group) {
            even if pairs_loop && 2 * group <= MAX_PAIRS_PER_TASK && hkv * (t * group).div_ceil(even) >= 2 * threads => even,
            _ => run_of(group),
        };
        let tasks: Vec<(usize, usize, usize)> = (0..hkv)
            .flat_map(|g| (0..t * group).step_by(per_task).map(move |s| (g, s, (t * group - s).min(per_task))))
            .collect();
        thread_local! {
            static SCRATCH: std::cell::RefCell<(Scratch, Vec<usize>)> = Default::default();
        }
        crate::cpu::team::run(tasks.len(), &|task| {
            let (g, first, count) = tasks[task];
            SCRATCH.with_borrow_mut(|(scratch, keys)| {
                // Key lists of the task's rows, one after another (pairs of a row share one).
                let (r0, r1) = (first / group, (first + count - 1) / group + 1);
                keys.clear();
                let mut bounds = Vec::with_capacity(r1 - r0 + 1);
                for i in r0..r1 {
                    bounds.push(keys.len());
                    let first = first_key(i);
                    keys.extend(first.min(prefix)..prefix);
                    keys.extend((0..n).filter(|&j| mask.sees(n - t + i, j) && prefix + j >= first).map(|j| prefix + j));
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
                    Isa::Avx512 if d % LANES == 0 && d <= attend512::MAX_D => unsafe { attend512::attend_group(&kv, &pairs, shared, scratch) },
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 if d % LANES == 0 && d <= attend256::MAX_D => unsafe { attend256::attend_group(&kv, &pairs, shared, scratch) },
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

/// `$call` with the const `$c` set to `$chunks` (a head's 16-value chunks, 1 to 16), else
/// `$other`: the SIMD paths compile one `group` per head size so its vectors live in registers.
#[cfg(target_arch = "x86_64")]
macro_rules! by_chunks {
    ($chunks:expr, |$c:ident| $call:expr, $other:block) => {
        match $chunks {
            1 => { const $c: usize = 1; $call }
            2 => { const $c: usize = 2; $call }
            3 => { const $c: usize = 3; $call }
            4 => { const $c: usize = 4; $call }
            5 => { const $c: usize = 5; $call }
            6 => { const $c: usize = 6; $call }
            7 => { const $c: usize = 7; $call }
            8 => { const $c: usize = 8; $call }
            9 => { const $c: usize = 9; $call }
            10 => { const $c: usize = 10; $call }
            11 => { const $c: usize = 11; $call }
            12 => { const $c: usize = 12; $call }
            13 => { const $c: usize = 13; $call }
            14 => { const $c: usize = 14; $call }
            15 => { const $c: usize = 15; $call }
            16 => { const $c: usize = 16; $call }
            _ => $other,
        }
    };
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
        crate::cpu::exp::avx2::exp8_in_range(_mm256_max_ps(x, _mm256_set1_ps(EXP_MIN)))
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

    /// Larger heads take the portable path. 256: Gemma's heads.
    pub const MAX_D: usize = 256;

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
        by_chunks!(kv.d / LANES, |C| group::<E, C>(kv, pairs, prefix, scratch), {
            for pr in pairs {
                super::attend_head(kv, pr.q, pr.keys, scratch, std::slice::from_raw_parts_mut(pr.out.0, kv.d));
            }
        })
    }

    /// [`attend_group`] for a head of `C` 16-value chunks.
    #[inline(always)]
    unsafe fn group<E: Elem, const C: usize>(kv: &KvHead<E>, pairs: &[Pair], prefix: usize, scratch: &mut Scratch) {
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
                values_all(kv, &pr.keys[k0..k1], sp.add(pi * stride + k0), ap.add(pi * d));
            }
            k0 = k1;
        }
        for (pi, pr) in pairs.iter().enumerate() {
            let chains = ap.add(pi * d);
            values_all(kv, &pr.keys[common..], sp.add(pi * stride + common), chains);
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

    /// [`values`] over the whole head, 64 elements (8 registers) per pass: each element is its
    /// own chain, so the split changes no bits.
    #[inline(always)]
    unsafe fn values_all<E: Elem>(kv: &KvHead<E>, keys: &[usize], probs: *const f32, chains: *mut f32) {
        let d = kv.d;
        let mut e0 = 0;
        while e0 + 64 <= d {
            values::<E, 8>(kv, keys, probs, chains, e0);
            e0 += 64;
        }
        match (d - e0) / 8 {
            6 => values::<E, 6>(kv, keys, probs, chains, e0),
            4 => values::<E, 4>(kv, keys, probs, chains, e0),
            2 => values::<E, 2>(kv, keys, probs, chains, e0),
            _ => {}
        }
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
    use crate::cpu::lanes::tree16;
    use std::arch::x86_64::*;

    /// Larger heads take the portable path. 256: Gemma's heads.
    pub const MAX_D: usize = 256;

    /// `exp_nonpositive` on 16 values with the same operations in the same order.
    #[inline(always)]
    unsafe fn exp16(x: __m512) -> __m512 {
        crate::cpu::exp::avx512::exp16_in_range(_mm512_max_ps(x, _mm512_set1_ps(EXP_MIN)))
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
        by_chunks!(kv.d / LANES, |C| group::<E, C>(kv, pairs, prefix, scratch), {
            for pr in pairs {
                super::attend_head(kv, pr.q, pr.keys, scratch, std::slice::from_raw_parts_mut(pr.out.0, kv.d));
            }
        })
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
        _mm512_mul_ps(tree16::reduce::<tree16::AddF32>(&acc), scale)
    }

    /// Largest head (in 16-value chunks) whose score loop takes pairs two at a time: both
    /// queries stay in registers beside the chains up to 128-wide heads.
    pub const PAIRED_MAX_CHUNKS: usize = 8;

    /// Tasks with more pairs than this widen an f16 K/V block to f32 once for all of them; with
    /// fewer, each pair (or two) converts as it loads. Single tokens' tasks of three pairs were
    /// 12-15% faster without the widening (`examples/attention_bench`, f16, 256-2,048 keys).
    const WIDEN_MIN_PAIRS: usize = 3;

    /// Sixteen scores to `at` and into the running lane maxima at `max`.
    #[inline(always)]
    unsafe fn put_scores(at: *mut f32, max: *mut f32, s: __m512) {
        _mm512_storeu_ps(at, s);
        _mm512_storeu_ps(max, _mm512_max_ps(_mm512_loadu_ps(max), s));
    }

    /// [`scores16`] for two pairs at once, the same bits for each: every K chunk is loaded once
    /// for both queries (held in registers), and each pair's lane tree runs its first two steps
    /// as each group of four keys is done ([`tree16::fold_four`]).
    /// Why: one pair alone makes one load per multiply-add, and the score phase ran at about
    /// 40% of this core's multiply-add rate while the output phase, which shares its V loads
    /// between pairs, ran near 80% (`perf`, `examples/attention_bench`, 2-core Zen 4).
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // chunk c indexes both queries' registers and the K rows
    unsafe fn scores16_pairs<E: Elem, const C: usize, const P: usize>(q: [*const f32; P], rows: &[*const E; 16], scale: __m512) -> [__m512; P] {
        let mut qv = [[_mm512_setzero_ps(); C]; P];
        for (p, qv) in qv.iter_mut().enumerate() {
            for (c, v) in qv.iter_mut().enumerate() {
                *v = _mm512_loadu_ps(q[p].add(c * LANES));
            }
        }
        let mut s2 = [[_mm512_setzero_ps(); 4]; P];
        for g in 0..4 {
            let mut acc = [[_mm512_setzero_ps(); 4]; P];
            for c in 0..C {
                for u in 0..4 {
                    let k = E::load16(rows[4 * g + u].add(c * LANES));
                    for p in 0..P {
                        acc[p][u] = _mm512_fmadd_ps(qv[p][c], k, acc[p][u]);
                    }
                }
            }
            for p in 0..P {
                s2[p][g] = tree16::fold_four::<tree16::AddF32>(&acc[p]);
            }
        }
        let mut out = [_mm512_setzero_ps(); P];
        for p in 0..P {
            out[p] = _mm512_mul_ps(tree16::finish::<tree16::AddF32>(&s2[p]), scale);
        }
        out
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

    /// Keys ahead of the score loop whose K rows are fetched into L2 meanwhile (and the output
    /// loop fetches the next step's V rows), for tasks of more than `WIDEN_MIN_PAIRS`: their K/V come
    /// from DRAM at long contexts (47 MB for SmolLM2 at 2,048 tokens, past this VM's L3), and
    /// 8- and 16-token forwards there were 4% faster (two of three interleaved rounds; the
    /// third met one of the VM's slow phases). Single tokens' three-pair tasks were 14% slower
    /// with them, so they go without.
    const K_AHEAD: usize = 64;

    /// Fetch 16 rows of one head of `src` (K or V) from slot `first` (those below `end`) into L2.
    #[inline(always)]
    unsafe fn prefetch_rows<E: Elem>(kv: &KvHead<E>, src: *const E, first: usize, end: usize) {
        if first >= end {
            return;
        }
        let from = src.add(kv.row(first)) as *const i8;
        let bytes = (end - first).min(LANES) * kv.d * std::mem::size_of::<E>();
        let mut o = 0;
        while o < bytes {
            _mm_prefetch::<_MM_HINT_T1>(from.add(o));
            o += 64;
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
        let (kp, sp) = (kv.k.as_ptr(), scores.as_mut_ptr());
        let scale = _mm512_set1_ps(kv.scale);
        // Scores, 16 keys at a time: first the blocks inside the shared prefix, for all pairs
        // while the 16 K rows are hot, then each pair's own remaining keys.
        // With more than WIDEN_MIN_PAIRS pairs and an f16 cache, each block of rows is widened
        // to f32 once (into L1-resident scratch) rather than once per pair; the widening is
        // exact, so the bits are the same either way.
        let widen = np > WIDEN_MIN_PAIRS && std::mem::size_of::<E>() != 4;
        let wp = if widen {
            widened.clear();
            widened.resize(V_STEP.max(LANES) * C * LANES, 0.0);
            widened.as_mut_ptr()
        } else {
            std::ptr::null_mut()
        };
        let shared = (prefix / LANES) * LANES;
        for b in (0..shared).step_by(LANES) {
            if np > WIDEN_MIN_PAIRS {
                prefetch_rows(kv, kp, b + K_AHEAD, shared);
            }
            let rows: [*const E; 16] = std::array::from_fn(|u| kp.add(kv.row(b + u)));
            // (A null `wp` when not widening: never read, so offset without `add`'s rules.)
            let wide: [*const f32; 16] = std::array::from_fn(|u| wp.wrapping_add(u * C * LANES) as *const f32);
            if widen {
                widen_rows::<E, C>(kv, kp, b, LANES, wp);
            }
            // PP pairs at a time while their queries fit in registers beside the chains.
            const PP: usize = 2;
            let twos = if C <= PAIRED_MAX_CHUNKS { np / PP * PP } else { 0 };
            for pi in (0..twos).step_by(PP) {
                let q: [*const f32; PP] = std::array::from_fn(|i| pairs[pi + i].q.as_ptr());
                let s = if widen { scores16_pairs::<f32, C, PP>(q, &wide, scale) } else { scores16_pairs::<E, C, PP>(q, &rows, scale) };
                for (i, &s) in s.iter().enumerate() {
                    put_scores(sp.add((pi + i) * stride + b), maxv.as_mut_ptr().add((pi + i) * LANES), s);
                }
            }
            for (pi, pr) in pairs.iter().enumerate().skip(twos) {
                let s = if widen { scores16::<f32, C>(pr.q.as_ptr(), &wide, scale) } else { scores16::<E, C>(pr.q.as_ptr(), &rows, scale) };
                put_scores(sp.add(pi * stride + b), maxv.as_mut_ptr().add(pi * LANES), s);
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
        // Outputs, in chunks of at most 8 vectors of the head (each output element is its own
        // chain, so splitting the head changes no bits): 8 vectors of chains per pair and one V
        // row already fill most of the 32 registers.
        let mut c0 = 0;
        while c0 < C {
            let at = Chunk { e0: c0 * LANES, stride, widen, wp, inv };
            match (C - c0).min(8) {
                8 => outputs::<E, 8>(kv, pairs, prefix, sp, accs, &at),
                7 => outputs::<E, 7>(kv, pairs, prefix, sp, accs, &at),
                6 => outputs::<E, 6>(kv, pairs, prefix, sp, accs, &at),
                5 => outputs::<E, 5>(kv, pairs, prefix, sp, accs, &at),
                4 => outputs::<E, 4>(kv, pairs, prefix, sp, accs, &at),
                3 => outputs::<E, 3>(kv, pairs, prefix, sp, accs, &at),
                2 => outputs::<E, 2>(kv, pairs, prefix, sp, accs, &at),
                _ => outputs::<E, 1>(kv, pairs, prefix, sp, accs, &at),
            }
            c0 += 8;
        }
    }

    /// Where one chunk of the output phase reads and writes: its first element `e0` within the
    /// head, the pairs' probabilities (`stride` apart), the widened-V scratch, 1 / softmax sums.
    struct Chunk<'a> {
        e0: usize,
        stride: usize,
        widen: bool,
        wp: *mut f32,
        inv: &'a [f32],
    }

    /// The output phase for head elements `at.e0..at.e0 + 16 CV`: the shared prefix in steps of
    /// V_STEP keys for all pairs (chains parked in scratch between steps), pairs in blocks that
    /// share each V row's loads, then each pair's own keys.
    #[target_feature(enable = "avx512f")]
    unsafe fn outputs<E: Elem, const CV: usize>(kv: &KvHead<E>, pairs: &[Pair], prefix: usize, sp: *mut f32, accs: &mut Vec<f32>, at: &Chunk) {
        let np = pairs.len();
        let Chunk { e0, stride, widen, wp, inv } = *at;
        let vp = kv.v.as_ptr();
        accs.clear();
        accs.resize(np * CV * LANES, 0.0);
        let ap = accs.as_mut_ptr();
        let vshared = (prefix / V_STEP) * V_STEP;
        // Pairs per block: their chains and one V row fill most of the 32 vector registers.
        const fn block(c: usize) -> usize {
            if c <= 4 { 4 } else { 2 }
        }
        let pb_max = block(CV);
        for j0 in (0..vshared).step_by(V_STEP) {
            if e0 == 0 && np > WIDEN_MIN_PAIRS {
                for j in (j0 + V_STEP..j0 + 2 * V_STEP).step_by(LANES) {
                    prefetch_rows(kv, vp, j, vshared);
                }
            }
            if widen {
                widen_rows::<E, CV>(kv, vp.add(e0), j0, V_STEP, wp);
            }
            let mut pi = 0;
            while pi < np {
                let pb = pb_max.min(np - pi);
                macro_rules! run {
                    ($pb:literal) => {{
                        let mut acc: [[__m512; CV]; $pb] = std::array::from_fn(|b| std::array::from_fn(|c| _mm512_loadu_ps(ap.add(((pi + b) * CV + c) * LANES))));
                        let probs: [*const f32; $pb] = std::array::from_fn(|b| sp.add((pi + b) * stride) as *const f32);
                        if widen {
                            values::<f32, $pb, CV>(&mut acc, probs, |j| wp.add((j - j0) * CV * LANES) as *const f32, j0, j0 + V_STEP);
                        } else {
                            values::<E, $pb, CV>(&mut acc, probs, |j| vp.add(kv.row(j) + e0), j0, j0 + V_STEP);
                        }
                        for (b, acc) in acc.iter().enumerate() {
                            for (c, a) in acc.iter().enumerate() {
                                _mm512_storeu_ps(ap.add(((pi + b) * CV + c) * LANES), *a);
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
            let mut acc: [[__m512; CV]; 1] = [std::array::from_fn(|c| _mm512_loadu_ps(ap.add((pi * CV + c) * LANES)))];
            values::<E, 1, CV>(&mut acc, [sp.add(pi * stride) as *const f32], |j| vp.add(kv.row(pr.keys[j]) + e0), vshared, n);
            let invv = _mm512_set1_ps(inv[pi]);
            for (c, a) in acc[0].iter().enumerate() {
                _mm512_storeu_ps(pr.out.0.add(e0 + c * LANES), _mm512_mul_ps(*a, invv));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::isa::has_avx2;
    use crate::cpu::testutil::*;

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

    /// The AVX2 and AVX-512 attention over a task of pairs that share a prefix (taken in
    /// blocks) and then have keys of their own, in f32 and f16, give each pair the one-pair
    /// reference's bits; head sizes of 32 to 256 (Gemma's) take their own register counts, and
    /// those over 128 go through the output phase in chunks (80 and 144 leave odd remainders).
    #[test]
    fn simd_attention_groups_match_the_reference_bits() {
        if !has_avx2() {
            return;
        }
        use half::f16;
        for d in [32usize, 64, 80, 96, 128, 144, 192, 256] {
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
                    let paths: &[&str] = if isa() == Isa::Avx512 { &["AVX2", "AVX-512"] } else { &["AVX2"] };
                    for &path in paths {
                        let mut got = vec![0f32; qs.len() * d];
                        let pairs: Vec<Pair> = (0..qs.len()).map(|p| Pair { q: &qs[p], keys: &lists[p], out: OutPtr(got[p * d..].as_mut_ptr()) }).collect();
                        #[cfg(target_arch = "x86_64")]
                        unsafe {
                            if path == "AVX2" {
                                attend256::attend_group(kv, &pairs, prefix, &mut Scratch::default())
                            } else {
                                attend512::attend_group(kv, &pairs, prefix, &mut Scratch::default())
                            }
                        };
                        for p in 0..qs.len() {
                            let mut want = vec![0f32; d];
                            attend_head(kv, &qs[p], &lists[p], &mut Scratch::default(), &mut want);
                            assert_eq!(&got[p * d..(p + 1) * d], &want[..], "{what} {path}: pair {p}, d {d}, prefix {prefix}");
                        }
                    }
                }
                // One to five pairs: one alone, pairs two at a time with one left over or not,
                // f16 K/V widened once per task (more than three pairs) or read as they are.
                for n in 1..=5 {
                    check(&KvHead { k: &k[..], v: &v[..], head_stride: slots * d, kvh: 1, d, scale: 0.125 }, &qs[..n], &lists[..n], prefix, "f32");
                    check(&KvHead { k: &k16[..], v: &v16[..], head_stride: slots * d, kvh: 1, d, scale: 0.125 }, &qs[..n], &lists[..n], prefix, "f16");
                }
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
            let op = TreeAttention { mask: std::sync::Arc::new(mask.clone()), prefix_len: prefix, scale: 0.125, first_key: None };
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
        let op = TreeAttention { mask: std::sync::Arc::new(TreeMask::causal(1)), prefix_len: 0, scale: 0.25, first_key: None };
        assert!(q.apply_op3_no_bwd(&k, &v, &op).is_err());
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
