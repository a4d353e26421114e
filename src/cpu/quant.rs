//! Weight formats for the CPU fast path: f32, f16, bf16 (its kernels in [`crate::cpu::bf16`]), and
//! GGUF Q8_0 / Q4_0 / Q4_1 / Q4_K kept quantized.
//!
//! Why: decoding one token reads every weight once, so bytes per weight set the speed floor
//! (SmolLM2-135M: 538 MB in f32, 145 MB in Q8_0, ~90 MB in Q4_1). Keeping the GGUF's own blocks
//! and doing the arithmetic in 8-bit integers (as llama.cpp does) reads 4-6x fewer bytes.
//!
//! Batch invariance, which greedy exactness needs, holds by construction:
//! - each activation row is quantized on its own (per 32-value block, like llama.cpp's Q8_0),
//!   so its codes do not depend on the other rows in the call;
//! - the integer dot product of one 32-value block is exact, so its order does not matter;
//! - the per-block float terms are added to each output in block order, one fused multiply-add
//!   chain per output, on every instruction-set path (AVX-512 VNNI and portable code give the
//!   same bits).
//!
//! Weights are repacked at load into panels of 16 output columns so one 512-bit integer
//! multiply-add instruction (`vpdpbusd`) serves 16 outputs, and each panel is read once for all
//! activation rows.
use std::str::FromStr;
use std::sync::Arc;

use half::f16;
use rayon::prelude::*;

use crate::cpu::isa::{isa, vnni, Isa};
use crate::cpu::team::for_each_panel_range;
use crate::cpu::matmul::{written_by, OutPtr, PackedWeight, PANEL};
use crate::{Error, Result};

/// Values per quantization block of the kernels (Q8_0, Q4_0, Q4_1 and Q5_0 blocks; Q4_K's and
/// Q6_K's 256-value super-blocks are read as eight of them).
pub const QK: usize = 32;

/// Bytes of a panel-block's fifth-bit plane (5-bit codes): one bit per code, 16 x 32 codes.
const HIGH_PLANE: usize = 64;

/// How the block quantizers' errors begin: a matrix whose rows are not whole blocks.
pub const CANNOT_QUANTIZE: &str = "cannot quantize";

/// Run `set` with `format`; when the format's blocks do not fit the matrices (rows not whole
/// blocks of [`QK`]), run it with f16 instead. Returns the format used. For drafters, whose
/// drafts need not be exact: a draft layer trained on stories260K (FFN 172 wide) must still load.
pub fn with_block_fallback(format: WeightFormat, mut set: impl FnMut(WeightFormat) -> Result<()>) -> Result<WeightFormat> {
    match set(format) {
        Ok(()) => Ok(format),
        Err(Error::InvalidArgument(m)) if m.starts_with(CANNOT_QUANTIZE) => {
            set(WeightFormat::F16)?;
            Ok(WeightFormat::F16)
        }
        Err(e) => Err(e),
    }
}

/// What `--weights` selects: the number format of the CPU fast path's weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    /// Dequantised f32: the reference every other format is tested against.
    F32,
    /// Half precision, f32 arithmetic: half the bytes, results within f16 rounding of f32.
    F16,
    /// bfloat16 weights and activations, f32 sums, on AMX tiles where the CPU has them (see
    /// [`crate::cpu::bf16`]): half f32's bytes, and on AMX the arithmetic of a 16-row tree costs no
    /// more than one row's.
    Bf16,
    /// 8-bit blocks requantised from f32 (GGUF Q8_0 layout), int8 arithmetic.
    Q8_0,
    /// Each tensor in the GGUF's own format where a kernel exists (F32, F16, Q8_0, Q4_0, Q4_1,
    /// Q4_K); other GGUF types (Q5_*, Q6_K, ...) are requantised to Q8_0. Hugging Face models have no native quantization
    /// and use f32.
    Native,
}

impl WeightFormat {
    pub const ALL: [WeightFormat; 5] = [WeightFormat::F32, WeightFormat::F16, WeightFormat::Bf16, WeightFormat::Q8_0, WeightFormat::Native];
    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::F32 => "f32",
            WeightFormat::F16 => "f16",
            WeightFormat::Bf16 => "bf16",
            WeightFormat::Q8_0 => "q8_0",
            WeightFormat::Native => "native",
        }
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for WeightFormat {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Ok(WeightFormat::F32),
            "f16" => Ok(WeightFormat::F16),
            "bf16" => Ok(WeightFormat::Bf16),
            "q8_0" | "q8" => Ok(WeightFormat::Q8_0),
            "native" => Ok(WeightFormat::Native),
            _ => Err(Error::InvalidArgument(format!("unknown weight format '{s}' (expected f32, f16, bf16, q8_0 or native)"))),
        }
    }
}

/// GGUF block types the kernels read directly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantKind {
    Q8_0,
    Q4_0,
    Q4_1,
    /// 5-bit codes, value = d * (q - 16): the low 4 bits as Q4_0's nibbles, the fifth bits in
    /// one 32-bit word per block (Gemma 3's Q4_K_M files keep most projections in it).
    Q5_0,
    /// 256-value super-blocks of sixteen 16-value sub-blocks, 6-bit codes, value = d * sc *
    /// (q - 32) with an 8-bit scale `sc` per sub-block (the lm_head and half the down
    /// projections of common Q4_K_M files). Each sub-block's d·sc is kept in f16, as Q4_K's.
    Q6K,
    /// 256-value super-blocks of eight 32-value sub-blocks with 6-bit scales and mins (the
    /// format of the common Q4_K_M files). Each sub-block's scale d·sc and offset -dmin·m are
    /// stored in f16 in the panels: within 2^-12 relative of the file's own, far below the
    /// 4-bit rounding they scale.
    Q4K,
}

impl QuantKind {
    /// Values per GGUF block.
    pub fn block_values(self) -> usize {
        match self {
            QuantKind::Q4K | QuantKind::Q6K => 256,
            _ => QK,
        }
    }
    /// Bytes of one GGUF block.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantKind::Q8_0 => 34,
            QuantKind::Q4_0 => 18,
            QuantKind::Q4_1 => 20,
            QuantKind::Q5_0 => 22,
            QuantKind::Q6K => 210,
            QuantKind::Q4K => 144,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            QuantKind::Q8_0 => "q8_0",
            QuantKind::Q4_0 => "q4_0",
            QuantKind::Q4_1 => "q4_1",
            QuantKind::Q5_0 => "q5_0",
            QuantKind::Q6K => "q6_k",
            QuantKind::Q4K => "q4_k",
        }
    }
    /// The kind of a GGUF tensor type, when the kernels read it directly.
    pub fn from_ggml(dtype: candle_core::quantized::GgmlDType) -> Option<QuantKind> {
        use candle_core::quantized::GgmlDType as G;
        match dtype {
            G::Q8_0 => Some(QuantKind::Q8_0),
            G::Q4_0 => Some(QuantKind::Q4_0),
            G::Q4_1 => Some(QuantKind::Q4_1),
            G::Q5_0 => Some(QuantKind::Q5_0),
            G::Q6K => Some(QuantKind::Q6K),
            G::Q4K => Some(QuantKind::Q4K),
            _ => None,
        }
    }
}

/// Q4_K's packed 6-bit scale and min of sub-block `j` (llama.cpp's `get_scale_min_k4`).
fn q4k_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Bytes shared without copying: a buffer of its own, or a range of a memory-mapped file.
pub type SharedBytes = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// One stretch of rows of a [`QuantRows`]: `n` rows of `bytes[start..]`, in file order or
/// reordered by `perm` (row `i` is stored row `perm[i]`).
#[derive(Clone)]
struct Segment {
    bytes: SharedBytes,
    start: usize,
    n: usize,
    perm: Option<Arc<[usize]>>,
}

/// A weight matrix `[n, k]` as raw GGUF blocks, row by row (one row = one output). A view:
/// stacking matrices ([`QuantRows::concat_rows`]) and reordering rows
/// ([`QuantRows::permute_rows`]) copy no bytes, and the bytes may lie in a memory-mapped file,
/// so a loader packs each weight straight from the file with no copy in between (on an 8B
/// model, 1.7 GB of transient copies and a third of the load time).
#[derive(Clone)]
pub struct QuantRows {
    pub kind: QuantKind,
    pub n: usize,
    pub k: usize,
    segments: Vec<Segment>,
}

impl std::fmt::Debug for QuantRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "QuantRows({} [{}, {}], {} segments)", self.kind.name(), self.n, self.k, self.segments.len())
    }
}

impl QuantRows {
    pub fn new(kind: QuantKind, n: usize, k: usize, bytes: Vec<u8>) -> Result<Self> {
        let len = bytes.len();
        Self::shared(kind, n, k, Arc::new(bytes), 0, len)
    }

    /// `n` rows of `k` values in `bytes[start..start + len]` (a range of a memory-mapped file),
    /// checked to be exactly that many blocks.
    pub fn shared(kind: QuantKind, n: usize, k: usize, bytes: SharedBytes, start: usize, len: usize) -> Result<Self> {
        if !k.is_multiple_of(kind.block_values()) {
            return Err(Error::InvalidArgument(format!("{} rows of {k} values: not a multiple of {}", kind.name(), kind.block_values())));
        }
        let want = n.checked_mul(k / kind.block_values() * kind.block_bytes());
        if want != Some(len) || start.checked_add(len).is_none_or(|end| end > (*bytes).as_ref().len()) {
            return Err(Error::InvalidArgument(format!("{} [{n}, {k}]: {len} bytes, expected {}", kind.name(), want.map_or("too many".into(), |w| w.to_string()))));
        }
        Ok(QuantRows { kind, n, k, segments: vec![Segment { bytes, start, n, perm: None }] })
    }

    /// Quantize f32 rows to Q8_0 the way llama.cpp does (scale = max|x| / 127, round half away).
    pub fn quantize_q8_0(w: &[f32], n: usize, k: usize) -> Result<Self> {
        if !k.is_multiple_of(QK) || w.len() != n * k {
            return Err(Error::InvalidArgument(format!("{CANNOT_QUANTIZE} [{n}, {k}] ({} values) to q8_0 blocks of {QK}", w.len())));
        }
        let mut bytes = Vec::with_capacity(n * k / QK * 34);
        for block in w.chunks_exact(QK) {
            let amax = block.iter().fold(0f32, |a, &x| a.max(x.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            bytes.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
            bytes.extend(block.iter().map(|&x| (x * id).round() as i8 as u8));
        }
        Self::new(QuantKind::Q8_0, n, k, bytes)
    }

    /// Quantize f32 rows to Q4_1 (per block: offset = min, scale = (max - min) / 15), the
    /// format of the SmolLM2 GGUF; for benchmarks and tests of the 4-bit kernel.
    pub fn quantize_q4_1(w: &[f32], n: usize, k: usize) -> Result<Self> {
        if !k.is_multiple_of(QK) || w.len() != n * k {
            return Err(Error::InvalidArgument(format!("{CANNOT_QUANTIZE} [{n}, {k}] ({} values) to q4_1 blocks of {QK}", w.len())));
        }
        let mut bytes = Vec::with_capacity(n * k / QK * 20);
        for block in w.chunks_exact(QK) {
            let lo = block.iter().cloned().fold(f32::INFINITY, f32::min);
            let hi = block.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let d = (hi - lo) / 15.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            bytes.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
            bytes.extend_from_slice(&f16::from_f32(lo).to_bits().to_le_bytes());
            let q: Vec<u8> = block.iter().map(|&v| (((v - lo) * id).round() as i32).clamp(0, 15) as u8).collect();
            for i in 0..16 {
                bytes.push(q[i] | (q[i + 16] << 4));
            }
        }
        Self::new(QuantKind::Q4_1, n, k, bytes)
    }

    fn row_bytes(&self) -> usize {
        self.k / self.kind.block_values() * self.kind.block_bytes()
    }

    /// The rows of `parts` one after another (for fusing projections of the same input).
    pub fn concat_rows(parts: &[&QuantRows]) -> Result<Self> {
        let first = parts.first().ok_or_else(|| Error::InvalidArgument("nothing to concatenate".into()))?;
        if let Some(p) = parts.iter().find(|p| p.kind != first.kind || p.k != first.k) {
            return Err(Error::InvalidArgument(format!("cannot stack {} rows of {} with {} rows of {}", p.kind.name(), p.k, first.kind.name(), first.k)));
        }
        let segments = parts.iter().flat_map(|p| p.segments.iter().cloned()).collect();
        Ok(QuantRows { kind: first.kind, n: parts.iter().map(|p| p.n).sum(), k: first.k, segments })
    }

    /// Rows reordered: output row `i` is input row `perm[i]` (for GGUF's permuted q/k rows).
    pub fn permute_rows(&self, perm: &[usize]) -> Result<Self> {
        if perm.len() != self.n || perm.iter().any(|&p| p >= self.n) {
            return Err(Error::InvalidArgument(format!("a row order of {} entries for {} rows", perm.len(), self.n)));
        }
        // Each new row names the segment row it reads: one segment per new row would be costly,
        // so the order is resolved into a single permuted segment where the rows share one.
        let resolved: Vec<(usize, usize)> = perm.iter().map(|&p| self.locate(p)).collect();
        if self.segments.len() == 1 {
            let seg = &self.segments[0];
            let order: Arc<[usize]> = resolved.iter().map(|&(_, r)| r).collect();
            return Ok(QuantRows { segments: vec![Segment { perm: Some(order), ..seg.clone() }], ..self.clone() });
        }
        let segments = resolved.iter().map(|&(s, r)| Segment { perm: Some(Arc::from(vec![r])), n: 1, ..self.segments[s].clone() }).collect();
        Ok(QuantRows { segments, ..self.clone() })
    }

    /// Row `j` as (segment, stored row within it).
    fn locate(&self, mut j: usize) -> (usize, usize) {
        for (i, s) in self.segments.iter().enumerate() {
            if j < s.n {
                return (i, s.perm.as_ref().map_or(j, |p| p[j]));
            }
            j -= s.n;
        }
        unreachable!("row past the matrix: callers index rows below n")
    }

    /// Rows `a..b`'s bytes, copied out in row order.
    pub fn row_range(&self, a: usize, b: usize) -> Vec<u8> {
        (a..b.min(self.n)).flat_map(|j| self.row(j).iter().copied()).collect()
    }

    /// The stored bytes of row `j`.
    fn row(&self, j: usize) -> &[u8] {
        let (s, r) = self.locate(j);
        let seg = &self.segments[s];
        let rb = self.row_bytes();
        let at = seg.start + r * rb;
        &(*seg.bytes).as_ref()[at..at + rb]
    }

    /// The block `b` of a row's bytes as (scale, offset, 32 unsigned codes): value = d * code + m.
    /// Q8_0 codes are stored +128 so every format feeds the unsigned operand of `vpdpbusd`.
    /// Q6_K has no offset but two scales: (d·sc of values 0..16, d·sc of 16..32, codes), value
    /// = scale * (code - 32).
    fn block_of(&self, row: &[u8], b: usize) -> (f16, f16, [u8; QK]) {
        let half = |s: &[u8], at: usize| f16::from_bits(u16::from_le_bytes([s[at], s[at + 1]]));
        let mut q = [0u8; QK];
        match self.kind {
            QuantKind::Q8_0 => {
                let s = &row[b * 34..(b + 1) * 34];
                let d = half(s, 0);
                for (i, q) in q.iter_mut().enumerate() {
                    *q = (s[2 + i] as i8 as i16 + 128) as u8;
                }
                (d, f16::from_f32(-128.0 * d.to_f32()), q)
            }
            QuantKind::Q4_0 | QuantKind::Q4_1 => {
                let bb = self.kind.block_bytes();
                let s = &row[b * bb..(b + 1) * bb];
                let d = half(s, 0);
                let (m, qs) = if self.kind == QuantKind::Q4_1 {
                    (half(s, 2), &s[4..20])
                } else {
                    // Q4_0 is d * (q - 8): an offset of -8d, exact in f16 (a power-of-two scaling).
                    (f16::from_f32(-8.0 * d.to_f32()), &s[2..18])
                };
                for i in 0..16 {
                    q[i] = qs[i] & 0x0f;
                    q[i + 16] = qs[i] >> 4;
                }
                (d, m, q)
            }
            QuantKind::Q5_0 => {
                let s = &row[b * 22..(b + 1) * 22];
                let d = half(s, 0);
                let qh = u32::from_le_bytes([s[2], s[3], s[4], s[5]]);
                for i in 0..16 {
                    q[i] = (s[6 + i] & 0x0f) | (((qh >> i) & 1) << 4) as u8;
                    q[i + 16] = (s[6 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4) as u8;
                }
                // d * (q - 16): an offset of -16d, exact in f16 (a power-of-two scaling).
                (d, f16::from_f32(-16.0 * d.to_f32()), q)
            }
            QuantKind::Q6K => {
                // llama.cpp's layout: 128 bytes of low nibbles, 64 of high bit pairs, 16 scales,
                // d. Per 128-value half: value l + 32j has nibble j / 2 of ql[l + 32 (j % 2)]
                // and bit pair j of qh[l].
                let s = &row[(b / 8) * 210..(b / 8 + 1) * 210];
                let d = half(s, 208).to_f32();
                let (half128, j) = ((b % 8) / 4, (b % 8) % 4);
                let (ql, qh) = (&s[64 * half128..], &s[128 + 32 * half128..]);
                for (l, o) in q.iter_mut().enumerate() {
                    let nib = (ql[l + 32 * (j % 2)] >> (4 * (j / 2))) & 0x0f;
                    *o = nib | (((qh[l] >> (2 * j)) & 3) << 4);
                }
                let sc = |i: usize| s[192 + 8 * half128 + i] as i8 as f32;
                (f16::from_f32(d * sc(2 * j)), f16::from_f32(d * sc(2 * j + 1)), q)
            }
            QuantKind::Q4K => {
                let s = &row[(b / 8) * 144..(b / 8 + 1) * 144];
                let (d, dmin) = (half(s, 0).to_f32(), half(s, 2).to_f32());
                let sub = b % 8;
                let (sc, m) = q4k_scale_min(sub, &s[4..16]);
                // Sub-blocks pair up on 32 bytes: even ones in the low nibbles, odd in the high.
                let qs = &s[16 + 32 * (sub / 2)..][..32];
                let shift = 4 * (sub % 2);
                for (o, &byte) in q.iter_mut().zip(qs) {
                    *o = (byte >> shift) & 0x0f;
                }
                (f16::from_f32(d * sc as f32), f16::from_f32(-dmin * m as f32), q)
            }
        }
    }

    /// Dequantised f32 `[n, k]`, the reference the kernels are tested against.
    pub fn dequantize(&self) -> Vec<f32> {
        let nb = self.k / QK;
        let mut out = Vec::with_capacity(self.n * self.k);
        for j in 0..self.n {
            let row = self.row(j);
            for b in 0..nb {
                let (d, m, q) = self.block_of(row, b);
                let (d, m) = (d.to_f32(), m.to_f32());
                if self.kind == QuantKind::Q8_0 {
                    out.extend(q.iter().map(|&c| d * (c as i32 - 128) as f32));
                } else if self.kind == QuantKind::Q5_0 {
                    out.extend(q.iter().map(|&c| d * (c as i32 - 16) as f32));
                } else if self.kind == QuantKind::Q6K {
                    out.extend(q.iter().enumerate().map(|(t, &c)| (if t < 16 { d } else { m }) * (c as i32 - 32) as f32));
                } else {
                    out.extend(q.iter().map(|&c| d * c as f32 + m));
                }
            }
        }
        out
    }
}

/// Half-precision weights in the f32 kernel's panel layout (`[k][16]` per panel).
pub struct PackedF16 {
    k: usize,
    n: usize,
    data: Vec<f16>,
}

impl PackedF16 {
    pub fn pack(w: &[f32], n: usize, k: usize) -> Self {
        assert_eq!(w.len(), n * k);
        let panels = n.div_ceil(PANEL);
        let mut data = vec![f16::ZERO; panels * k * PANEL];
        data.par_chunks_mut(k * PANEL).enumerate().for_each(|(p, panel)| {
            for c in 0..PANEL {
                let j = p * PANEL + c;
                if j < n {
                    for kk in 0..k {
                        panel[kk * PANEL + c] = f16::from_f32(w[j * k + kk]);
                    }
                }
            }
        });
        PackedF16 { k, n, data }
    }
}

/// Integer blocks in panels of 16 columns. Per panel and block: the codes, then 16 f16 scales
/// `d`, then (Q4_1, Q4_K) 16 f16 offsets `m`: value = d * code + m. Q8_0 and Q4_0 store no
/// offset: theirs is a fixed code, value = d * (code - zero) with zero = 128 or 8, so the kernel
/// subtracts `zero * sum(x codes)` from the exact integer sum instead of reading and applying
/// `m` (6% fewer bytes for Q8_0 and one multiply-add less per block and row).
///
/// Codes: for 8-bit, 8 groups of `[16 columns][4 values]` (512 bytes); for 4-bit, 4 groups of
/// `[16 columns][4 bytes]` (256 bytes) whose low nibbles are values 4g..4g+4 and high nibbles
/// values 16+4g..16+4g+4, which is GGUF's own nibble order, so packing only regroups bytes.
/// 5-bit codes (Q5_0) are 4-bit codes plus a plane of their fifth bits after them: per group,
/// a 64-bit mask for the low nibbles' values, then one for the high nibbles' (bit `4c + t` is
/// the byte `[c][t]`'s), 64 bytes in all, so a 512-bit register's 64 codes take one masked add.
/// 6-bit codes (Q6_K) have two such planes per group: per nibble half, the fifth bits' mask and
/// then the sixth bits'. Their blocks store two scales per column (values 0..16 and 16..32,
/// one per sub-block) where others store a scale and an offset.
pub struct PackedQuant {
    k: usize,
    n: usize,
    bits4: bool,
    /// Planes of higher bits after the 4-bit codes: 1 (Q5_0) or 2 (Q6_K, which also has two
    /// scales per block).
    high: u8,
    /// The code that means zero (Q8_0: 128, Q4_0: 8, Q5_0: 16, Q6_K: 32), or `None` when
    /// offsets `m` are stored (Q4_1, Q4_K). Q6_K's offset slot holds its second scales.
    zero: Option<u8>,
    data: Vec<u8>,
}

impl PackedQuant {
    /// Where a panel-block's scales start: after its codes (and higher-bit planes).
    fn codes_bytes(bits4: bool, high: u8) -> usize {
        if bits4 {
            256 + HIGH_PLANE * high as usize
        } else {
            512
        }
    }
    /// Bytes per panel-block: codes, then 16 f16 scales, then 16 f16 offsets (or Q6_K's second
    /// scales).
    fn stride(bits4: bool, high: u8, offsets: bool) -> usize {
        Self::codes_bytes(bits4, high) + if offsets || high == 2 { 64 } else { 32 }
    }

    pub fn pack(q: &QuantRows) -> Self {
        let (n, k) = (q.n, q.k);
        let bits4 = q.kind != QuantKind::Q8_0;
        let high = match q.kind {
            QuantKind::Q5_0 => 1,
            QuantKind::Q6K => 2,
            _ => 0,
        };
        let zero = match q.kind {
            QuantKind::Q8_0 => Some(128),
            QuantKind::Q4_0 => Some(8),
            QuantKind::Q5_0 => Some(16),
            QuantKind::Q6K => Some(32),
            QuantKind::Q4_1 | QuantKind::Q4K => None,
        };
        let nb = k / QK;
        let stride = Self::stride(bits4, high, zero.is_none());
        let codes = Self::codes_bytes(bits4, high);
        let panels = n.div_ceil(PANEL);
        let mut data = vec![0u8; panels * nb * stride];
        data.par_chunks_mut(nb * stride).enumerate().for_each(|(p, panel)| {
            for c in 0..PANEL {
                let j = p * PANEL + c;
                if j >= n {
                    continue;
                }
                let row = q.row(j);
                for b in 0..nb {
                    let dst = &mut panel[b * stride..(b + 1) * stride];
                    // Q8_0, Q4_0 and Q4_1 blocks hold their codes in the packed order already
                    // (bytes regrouped; Q8_0's signed codes offset by 128): copied as they are,
                    // which made packing an 8B model's weights about twice as fast.
                    let bb = q.kind.block_bytes();
                    let blk = &row[(b * bb).min(row.len())..((b + 1) * bb).min(row.len())];
                    match q.kind {
                        QuantKind::Q8_0 => {
                            for g in 0..8 {
                                for i in 0..4 {
                                    dst[g * 64 + c * 4 + i] = blk[2 + 4 * g + i] ^ 0x80;
                                }
                            }
                            dst[codes + 2 * c..codes + 2 * c + 2].copy_from_slice(&blk[0..2]);
                            continue;
                        }
                        QuantKind::Q4_0 | QuantKind::Q4_1 => {
                            let qs = &blk[bb - 16..];
                            for g in 0..4 {
                                dst[g * 64 + c * 4..g * 64 + c * 4 + 4].copy_from_slice(&qs[4 * g..4 * g + 4]);
                            }
                            dst[codes + 2 * c..codes + 2 * c + 2].copy_from_slice(&blk[0..2]);
                            if q.kind == QuantKind::Q4_1 {
                                dst[codes + 32 + 2 * c..codes + 34 + 2 * c].copy_from_slice(&blk[2..4]);
                            }
                            continue;
                        }
                        QuantKind::Q5_0 => {
                            let qs = &blk[6..22];
                            for g in 0..4 {
                                dst[g * 64 + c * 4..g * 64 + c * 4 + 4].copy_from_slice(&qs[4 * g..4 * g + 4]);
                            }
                            let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                            for g in 0..4 {
                                for t in 0..4 {
                                    let (lo, hi) = ((qh >> (4 * g + t)) & 1, (qh >> (16 + 4 * g + t)) & 1);
                                    let bit = 4 * c + t;
                                    dst[256 + 16 * g + bit / 8] |= (lo as u8) << (bit % 8);
                                    dst[256 + 16 * g + 8 + bit / 8] |= (hi as u8) << (bit % 8);
                                }
                            }
                            dst[codes + 2 * c..codes + 2 * c + 2].copy_from_slice(&blk[0..2]);
                            continue;
                        }
                        QuantKind::Q4K | QuantKind::Q6K => {}
                    }
                    let (d, m, vals) = q.block_of(row, b);
                    if bits4 {
                        for g in 0..4 {
                            for i in 0..4 {
                                let (lo, hi) = (vals[4 * g + i], vals[16 + 4 * g + i]);
                                dst[g * 64 + c * 4 + i] = (lo & 0x0f) | ((hi & 0x0f) << 4);
                                // Higher bits into their planes (Q6_K: two per nibble half).
                                let bit = 4 * c + i;
                                for h in 0..high as usize {
                                    let plane = 256 + g * 16 * high as usize;
                                    dst[plane + 8 * h + bit / 8] |= ((lo >> (4 + h)) & 1) << (bit % 8);
                                    dst[plane + 8 * (high as usize + h) + bit / 8] |= ((hi >> (4 + h)) & 1) << (bit % 8);
                                }
                            }
                        }
                    } else {
                        for g in 0..8 {
                            for i in 0..4 {
                                dst[g * 64 + c * 4 + i] = vals[4 * g + i];
                            }
                        }
                    }
                    dst[codes + 2 * c..codes + 2 * c + 2].copy_from_slice(&d.to_bits().to_le_bytes());
                    if zero.is_none() || high == 2 {
                        dst[codes + 32 + 2 * c..codes + 34 + 2 * c].copy_from_slice(&m.to_bits().to_le_bytes());
                    }
                }
            }
        });
        PackedQuant { k, n, bits4, high, zero, data }
    }
}

/// One weight on its way into the fast path, before packing: a GGUF's own blocks (what
/// `--weights native` keeps), or f32 values with the format to pack them in. Why a stage: the
/// loader reads one tensor at a time and packs it at once (no f32 copy of the whole model is
/// ever held), and projections of the same input (q/k/v, gate/up) are stacked here first so
/// they are packed once, into one fused kernel's weight.
pub enum Staged {
    Blocks(QuantRows),
    Values { data: Vec<f32>, n: usize, k: usize, format: WeightFormat },
}

impl Staged {
    /// `[out, in]`.
    pub fn dims(&self) -> (usize, usize) {
        match self {
            Staged::Blocks(q) => (q.n, q.k),
            Staged::Values { n, k, .. } => (*n, *k),
        }
    }

    /// Whether `parts` can share one kernel: all blocks of one kind, or all values in one
    /// format, with the same input width. (A Q4_K_M file keeps some tensors in Q6_K: its q/k/v
    /// then stay apart.)
    pub fn can_stack(parts: &[Staged]) -> bool {
        let same = |a: &Staged, b: &Staged| match (a, b) {
            (Staged::Blocks(x), Staged::Blocks(y)) => x.kind == y.kind && x.k == y.k,
            (Staged::Values { k: ka, format: fa, .. }, Staged::Values { k: kb, format: fb, .. }) => ka == kb && fa == fb,
            _ => false,
        };
        parts.len() > 1 && parts.iter().all(|p| same(p, &parts[0]))
    }

    /// The rows of `parts` one after another (checked with [`Staged::can_stack`]).
    pub fn stack(parts: Vec<Staged>) -> Result<Staged> {
        if !Self::can_stack(&parts) {
            return Err(Error::InvalidArgument("projections of different formats or widths cannot be stacked".into()));
        }
        if let Staged::Values { k, format, .. } = parts[0] {
            let n = parts.iter().map(|p| p.dims().0).sum();
            let mut data = Vec::with_capacity(n * k);
            for p in parts {
                if let Staged::Values { data: d, .. } = p {
                    data.extend_from_slice(&d);
                }
            }
            return Ok(Staged::Values { data, n, k, format });
        }
        let blocks: Vec<&QuantRows> = parts.iter().filter_map(|p| if let Staged::Blocks(q) = p { Some(q) } else { None }).collect();
        Ok(Staged::Blocks(QuantRows::concat_rows(&blocks)?))
    }

    /// Pack for the fast path's kernel.
    pub fn pack(self) -> Result<CpuWeight> {
        match self {
            Staged::Blocks(q) => Ok(CpuWeight::Quant(PackedQuant::pack(&q))),
            Staged::Values { data, n, k, format } => pack_values(&data, n, k, format),
        }
    }
}

/// Pack f32 `[n, k]` values in `format` ([`WeightFormat::Native`] without blocks means f32;
/// Q8_0 of rows that are not whole blocks stays f32, as the drafters' odd widths need).
pub fn pack_values(data: &[f32], n: usize, k: usize, format: WeightFormat) -> Result<CpuWeight> {
    if data.len() != n * k {
        return Err(Error::InvalidArgument(format!("{} values for a [{n}, {k}] weight", data.len())));
    }
    Ok(match format {
        WeightFormat::F32 | WeightFormat::Native => CpuWeight::F32(PackedWeight::pack(data, n, k)),
        WeightFormat::F16 => CpuWeight::F16(PackedF16::pack(data, n, k)),
        WeightFormat::Bf16 => CpuWeight::Bf16(crate::cpu::bf16::PackedBf16::pack(data, n, k)),
        WeightFormat::Q8_0 if !k.is_multiple_of(QK) => CpuWeight::F32(PackedWeight::pack(data, n, k)),
        WeightFormat::Q8_0 => CpuWeight::Quant(PackedQuant::pack(&QuantRows::quantize_q8_0(data, n, k)?)),
    })
}

/// A CPU weight in one of the fast-path formats.
pub enum CpuWeight {
    F32(PackedWeight),
    F16(PackedF16),
    Bf16(crate::cpu::bf16::PackedBf16),
    Quant(PackedQuant),
}

impl CpuWeight {
    pub fn rows(&self) -> usize {
        match self {
            CpuWeight::F32(w) => w.rows(),
            CpuWeight::F16(w) => w.n,
            CpuWeight::Bf16(w) => w.rows(),
            CpuWeight::Quant(w) => w.n,
        }
    }
    pub fn cols(&self) -> usize {
        match self {
            CpuWeight::F32(w) => w.cols(),
            CpuWeight::F16(w) => w.k,
            CpuWeight::Bf16(w) => w.cols(),
            CpuWeight::Quant(w) => w.k,
        }
    }
    /// Bytes the kernel streams per call: what sets the memory-bound speed floor.
    pub fn bytes(&self) -> usize {
        match self {
            CpuWeight::F32(w) => w.rows().div_ceil(PANEL) * PANEL * w.cols() * 4,
            CpuWeight::F16(w) => w.data.len() * 2,
            CpuWeight::Bf16(w) => w.bytes(),
            CpuWeight::Quant(w) => w.data.len(),
        }
    }
    pub fn format_name(&self) -> &'static str {
        match self {
            CpuWeight::F32(_) => "f32",
            CpuWeight::F16(_) => "f16",
            CpuWeight::Bf16(_) => "bf16",
            CpuWeight::Quant(w) if w.high == 2 => "q6",
            CpuWeight::Quant(w) if w.high == 1 => "q5",
            CpuWeight::Quant(w) if w.bits4 => "q4",
            CpuWeight::Quant(_) => "q8_0",
        }
    }

    /// `out[m][n] = sum_k x[m][k] * w[n][k]`, batch-invariant.
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        match self {
            CpuWeight::F32(w) => crate::cpu::matmul_packed(x, m, w),
            CpuWeight::F16(w) => matmul_f16(x, m, w),
            CpuWeight::Bf16(w) => crate::cpu::bf16::matmul_bf16(x, m, w),
            CpuWeight::Quant(w) => matmul_quant(x, m, w),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// f16

fn matmul_f16(x: &[f32], m: usize, w: &PackedF16) -> Vec<f32> {
    assert_eq!(x.len(), m * w.k, "x has {} values, expected {m}x{}", x.len(), w.k);
    let isa = isa();
    // SAFETY: the panel ranges cover every column, and each panel writes all rows.
    unsafe {
        written_by(m * w.n, |ptr| {
            for_each_panel_range(w.n.div_ceil(PANEL), 4, |p0, p1| match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => crate::cpu::matmul::avx512_packed::block_of(x, m, w.k, w.n, w.data.as_ptr(), p0, p1, ptr),
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => crate::cpu::matmul::avx2_packed::block_of(x, m, w.k, w.n, w.data.as_ptr(), p0, p1, ptr),
                Isa::Portable => f16_block(x, m, w, p0, p1, ptr),
            })
        })
    }
}

/// Portable f16 kernel: the same single FMA chain per output as the AVX-512 one.
fn f16_block(x: &[f32], m: usize, w: &PackedF16, p0: usize, p1: usize, out: OutPtr) {
    let (k, n) = (w.k, w.n);
    for p in p0..p1 {
        let panel = &w.data[p * k * PANEL..(p + 1) * k * PANEL];
        for i in 0..m {
            let xr = &x[i * k..(i + 1) * k];
            let mut acc = [0f32; PANEL];
            for kk in 0..k {
                for c in 0..PANEL {
                    acc[c] = xr[kk].mul_add(panel[kk * PANEL + c].to_f32(), acc[c]);
                }
            }
            for (c, a) in acc.iter().enumerate() {
                let j = p * PANEL + c;
                if j < n {
                    unsafe { *out.0.add(i * n + j) = *a };
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Integer blocks

/// Activation rows quantized per 32-value block: codes, scale, and code sum per block.
struct QuantActs {
    q: Vec<i8>,
    d: Vec<f32>,
    sum: Vec<i32>,
    /// `d * sum` per block (rounded to f32 once, as every path computes it), for the Q4_1
    /// offset term: the kernel broadcasts it from memory instead of multiplying and
    /// broadcasting from a register once per block, row and panel.
    dsum: Vec<f32>,
    /// The code sum of each block's first 16 values, for Q6_K weights only (their two
    /// sub-blocks subtract their zero codes apart); empty otherwise.
    sum_lo: Vec<i32>,
}

/// Rounds to nearest, ties to even, for |x| < 2^22 with plain adds the compiler vectorises
/// (`f32::round` is a libm call per value and was 6% of a 16-token forward).
#[inline(always)]
fn round_small(x: f32) -> f32 {
    const MAGIC: f32 = 12582912.0; // 1.5 * 2^23
    (x + MAGIC) - MAGIC
}

impl QuantActs {
    /// Fill `sum_lo`, which Q6_K weights need (the kernels check it is there).
    fn add_half_sums(&mut self) {
        self.sum_lo = self.q.chunks_exact(QK).map(|b| b[..16].iter().map(|&c| c as i32).sum()).collect();
    }
}

fn quantize_acts(x: &[f32], m: usize, k: usize) -> QuantActs {
    let nb = k / QK;
    let mut a = QuantActs { q: vec![0; m * k], d: vec![0.0; m * nb], sum: vec![0; m * nb], dsum: Vec::new(), sum_lo: Vec::new() };
    let (simd, avx2) = (vnni(), crate::cpu::isa::has_avx2());
    let row = |x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [i32]| {
        #[cfg(target_arch = "x86_64")]
        if simd {
            unsafe { quantize_row_avx512(x, q, d, sum) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            unsafe { quantize_row_avx2(x, q, d, sum) };
            return;
        }
        let _ = (simd, avx2);
        quantize_row(x, q, d, sum);
    };
    if m * k >= crate::cpu::team::PAR_MIN_VALUES {
        let mut rows: Vec<_> = x.chunks(k).zip(a.q.chunks_mut(k)).zip(a.d.chunks_mut(nb).zip(a.sum.chunks_mut(nb))).collect();
        crate::cpu::team::for_each_mut(&mut rows, |_, ((x, q), (d, sum))| row(x, q, d, sum));
    } else {
        for (((x, q), d), sum) in x.chunks(k).zip(a.q.chunks_mut(k)).zip(a.d.chunks_mut(nb)).zip(a.sum.chunks_mut(nb)) {
            row(x, q, d, sum);
        }
    }
    a.dsum = a.d.iter().zip(&a.sum).map(|(&d, &s)| d * s as f32).collect();
    a
}

/// One activation row to 8-bit codes per 32-value block: `d = max|x| / 127`, codes
/// `round(x / d)` (ties to even), and the codes' sum (for the Q4_1 offset term).
fn quantize_row(x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [i32]) {
    for (((block, out), d), sum) in x.chunks_exact(QK).zip(q.chunks_exact_mut(QK)).zip(d.iter_mut()).zip(sum.iter_mut()) {
        let amax = block.iter().fold(0f32, |a, &v| a.max(v.abs()));
        let scale = amax / 127.0;
        let id = if scale != 0.0 { 1.0 / scale } else { 0.0 };
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

/// [`quantize_row`] 32 values at a time, with the same operations (so the same bits): the max
/// of absolute values is exact in any order, and the multiply and the rounding adds are the
/// scalar ones per lane. The scalar loop was 5% of a 16-token forward, all on one thread.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn quantize_row_avx512(x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [i32]) {
    use std::arch::x86_64::*;
    let magic = _mm512_set1_ps(12582912.0);
    for (b, (d, sum)) in d.iter_mut().zip(sum.iter_mut()).enumerate() {
        let p = x.as_ptr().add(b * QK);
        let (lo, hi) = (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)));
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        let scale = amax / 127.0;
        let id = _mm512_set1_ps(if scale != 0.0 { 1.0 / scale } else { 0.0 });
        let round = |v: __m512| _mm512_cvtps_epi32(_mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(v, id), magic), magic));
        let (cl, ch) = (round(lo), round(hi));
        let out = q.as_mut_ptr().add(b * QK) as *mut __m128i;
        _mm_storeu_si128(out, _mm512_cvtepi32_epi8(cl));
        _mm_storeu_si128(out.add(1), _mm512_cvtepi32_epi8(ch));
        *d = scale;
        *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(cl, ch));
    }
}

/// [`quantize_row`] on AVX2, with the same operations per lane (so the same bits). On the
/// 2-core Zen 3 the scalar loop, run on one thread before every integer matmul, was 2% of an
/// 8-token native forward's samples (`perf`), a share that grows with the rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_row_avx2(x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [i32]) {
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
        let id = _mm256_set1_ps(if scale != 0.0 { 1.0 / scale } else { 0.0 });
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

fn matmul_quant(x: &[f32], m: usize, w: &PackedQuant) -> Vec<f32> {
    assert_eq!(x.len(), m * w.k, "x has {} values, expected {m}x{}", x.len(), w.k);
    let mut acts = quantize_acts(x, m, w.k);
    if w.high == 2 {
        acts.add_half_sums();
    }
    let vnni = vnni();
    let avx2 = crate::cpu::isa::has_avx2();
    // SAFETY: the panel ranges cover every column, and each panel writes all rows.
    unsafe {
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
    }
}

/// Portable integer kernel with the same per-block float steps as the VNNI one:
/// `acc = fma(isum, d_w * d_x, acc); acc = fma(m_w, d_x * sum_x, acc)` with stored offsets, and
/// `acc = fma(isum - zero * sum_x, d_w * d_x, acc)` without; Q6_K takes the last step once per
/// 16-value half with its own scale, first half first.
fn quant_block(a: &QuantActs, m: usize, w: &PackedQuant, p0: usize, p1: usize, out: OutPtr) {
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

#[cfg(target_arch = "x86_64")]
mod avx512_quant {
    use super::{OutPtr, PackedQuant, QuantActs, QK};
    use std::arch::x86_64::*;

    /// How far ahead (in blocks of one panel) the weight stream is prefetched into L2.
    const PREFETCH_BLOCKS: usize = 24;

    /// `MR` rows x `NR` panels; 8-bit or 4-bit codes, the latter with `H` planes of higher
    /// bits (each set bit adds 16 or 32 to its code with one masked byte add); with two (Q6_K)
    /// each half of a block keeps its own integer sum for its own scale.
    #[inline(always)]
    unsafe fn tile<const MR: usize, const NR: usize, const B4: bool, const H: u8, const OFS: bool>(a: &QuantActs, w: &PackedQuant, i0: usize, p0: usize, out: OutPtr) {
        let (k, n) = (w.k, w.n);
        let nb = k / QK;
        let stride = PackedQuant::stride(B4, H, OFS);
        let zero = w.zero.unwrap_or(0) as i32;
        let codes = PackedQuant::codes_bytes(B4, H);
        let (sixteen, thirty_two) = (_mm512_set1_epi8(16), _mm512_set1_epi8(32));
        // Tiles with few outputs use two integer accumulators per output (exact, so
        // splitting changes no bits) for enough independent chains to hide vpdpbusd's
        // latency; 4x2 tiles have enough already and would run out of registers. Q6_K's
        // halves need theirs apart anyway.
        let split = H == 2 || MR <= 2 || (NR == 1 && MR <= 8);
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
                            if split {
                                isum2[ii][jj] = _mm512_dpbusd_epi32(isum2[ii][jj], hi[jj], xh);
                            } else {
                                isum[ii][jj] = _mm512_dpbusd_epi32(isum[ii][jj], hi[jj], xh);
                            }
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
                            if split {
                                isum2[ii][jj] = _mm512_dpbusd_epi32(isum2[ii][jj], wb[jj], xb);
                            } else {
                                isum[ii][jj] = _mm512_dpbusd_epi32(isum[ii][jj], wb[jj], xb);
                            }
                        }
                    }
                }
            }
            if split && H != 2 {
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

    #[inline(always)]
    unsafe fn panels<const NR: usize, const B4: bool, const H: u8, const OFS: bool>(a: &QuantActs, m: usize, w: &PackedQuant, p: usize, out: OutPtr) {
        let mut i = 0;
        if NR == 1 {
            while i + 8 <= m {
                tile::<8, 1, B4, H, OFS>(a, w, i, p, out);
                i += 8;
            }
        }
        while i + 4 <= m {
            tile::<4, NR, B4, H, OFS>(a, w, i, p, out);
            i += 4;
        }
        match m - i {
            3 => tile::<3, NR, B4, H, OFS>(a, w, i, p, out),
            2 => tile::<2, NR, B4, H, OFS>(a, w, i, p, out),
            1 => tile::<1, NR, B4, H, OFS>(a, w, i, p, out),
            _ => {}
        }
    }

    #[inline(always)]
    unsafe fn panels_of<const NR: usize>(a: &QuantActs, m: usize, w: &PackedQuant, p: usize, out: OutPtr) {
        // Higher bits come only with a fixed zero code (Q5_0, Q6_K).
        match (w.bits4, w.high, w.zero.is_none()) {
            (true, 1, _) => panels::<NR, true, 1, false>(a, m, w, p, out),
            (true, 2, _) => panels::<NR, true, 2, false>(a, m, w, p, out),
            (true, _, true) => panels::<NR, true, 0, true>(a, m, w, p, out),
            (true, _, false) => panels::<NR, true, 0, false>(a, m, w, p, out),
            (false, _, true) => panels::<NR, false, 0, true>(a, m, w, p, out),
            (false, _, false) => panels::<NR, false, 0, false>(a, m, w, p, out),
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn block(a: &QuantActs, m: usize, w: &PackedQuant, p0: usize, p1: usize, out: OutPtr) {
        // From 8 rows on, tiles of 8 rows x 1 panel: the panel's codes, unpacked once, serve
        // twice as many rows as in a 4x2 tile (5% faster 8- and 16-row forwards, native).
        // Q6_K keeps each half's sums apart, so 4x2 tiles would run out of registers: 1 panel.
        let mut p = p0;
        while m < 8 && w.high != 2 && p + 2 <= p1 {
            panels_of::<2>(a, m, w, p, out);
            p += 2;
        }
        while p < p1 {
            panels_of::<1>(a, m, w, p, out);
            p += 1;
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
mod avx2_quant {
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
            // Higher bits come only with a fixed zero code (Q5_0, Q6_K).
            match (w.bits4, w.high, w.zero.is_none()) {
                (true, 1, _) => panel::<true, 1, false>(a, m, w, p, out),
                (true, 2, _) => panel::<true, 2, false>(a, m, w, p, out),
                (true, _, true) => panel::<true, 0, true>(a, m, w, p, out),
                (true, _, false) => panel::<true, 0, false>(a, m, w, p, out),
                (false, _, true) => panel::<false, 0, true>(a, m, w, p, out),
                (false, _, false) => panel::<false, 0, false>(a, m, w, p, out),
            }
        }
    }
}

/// candle op: `x [.., k] x w -> [.., n]` with any fast-path weight.
pub struct CpuMatmul(pub std::sync::Arc<CpuWeight>);

impl candle_core::CustomOp1 for CpuMatmul {
    fn name(&self) -> &'static str {
        "selfspec-cpu-matmul"
    }
    fn cpu_fwd(&self, s: &candle_core::CpuStorage, l: &candle_core::Layout) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let x = crate::cpu::storage::contiguous(s, l, "cpu-matmul x")?;
        let k = self.0.cols();
        let xd = l.shape().dims();
        if xd.last() != Some(&k) {
            candle_core::bail!("cpu-matmul: x {:?} does not match weight [{}, {k}]", l.shape(), self.0.rows())
        }
        let out = self.0.matmul(x, x.len() / k);
        let mut od = xd.to_vec();
        *od.last_mut().unwrap() = self.0.rows();
        Ok((candle_core::CpuStorage::F32(out), candle_core::Shape::from(od)))
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
                ((s >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn reference(x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k).map(|t| x[i * k + t] as f64 * w[j * k + t] as f64).sum::<f64>() as f32;
            }
        }
        out
    }

    #[test]
    fn stacked_weights_give_each_part_its_own_bits() {
        // q/k/v stacked into one kernel: every output column is the same bits as its part alone.
        let (k, m) = (64, 3);
        let x = rand_vec(m * k, 9);
        let sizes = [32usize, 16, 16];
        let ws: Vec<Vec<f32>> = sizes.iter().enumerate().map(|(i, &n)| rand_vec(n * k, 10 + i as u64)).collect();
        for blocks in [false, true] {
            let stage = |w: &[f32], n: usize| if blocks { Staged::Blocks(q4_1_rows(w, n, k)) } else { Staged::Values { data: w.to_vec(), n, k, format: WeightFormat::Q8_0 } };
            let parts: Vec<Staged> = ws.iter().zip(sizes).map(|(w, n)| stage(w, n)).collect();
            assert!(Staged::can_stack(&parts));
            let joined = Staged::stack(parts).unwrap().pack().unwrap().matmul(&x, m);
            let total: usize = sizes.iter().sum();
            let mut col = 0;
            for (w, n) in ws.iter().zip(sizes) {
                let alone = stage(w, n).pack().unwrap().matmul(&x, m);
                for r in 0..m {
                    assert_eq!(&joined[r * total + col..r * total + col + n], &alone[r * n..(r + 1) * n]);
                }
                col += n;
            }
        }
        // Different kinds or formats stay apart.
        let a = Staged::Blocks(q4_1_rows(&ws[1], 16, k));
        let b = Staged::Values { data: ws[2].clone(), n: 16, k, format: WeightFormat::Q8_0 };
        assert!(!Staged::can_stack(&[a, b]));
        assert!(pack_values(&ws[1], 16, k + 1, WeightFormat::F32).is_err());
        assert_eq!(QuantKind::from_ggml(candle_core::quantized::GgmlDType::Q4K), Some(QuantKind::Q4K));
        assert_eq!(QuantKind::from_ggml(candle_core::quantized::GgmlDType::Q6K), Some(QuantKind::Q6K));
        assert_eq!(QuantKind::from_ggml(candle_core::quantized::GgmlDType::Q5_1), None);
    }

    fn q4_1_rows(w: &[f32], n: usize, k: usize) -> QuantRows {
        QuantRows::quantize_q4_1(w, n, k).unwrap()
    }

    fn q4_0_rows(w: &[f32], n: usize, k: usize) -> QuantRows {
        let mut bytes = Vec::new();
        for block in w.chunks_exact(QK) {
            // llama.cpp's rule: the value of largest magnitude maps to code 0 (d = max / -8).
            let max = block.iter().cloned().fold(0f32, |a, v| if v.abs() > a.abs() { v } else { a });
            let d = max / -8.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            bytes.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
            let q: Vec<u8> = block.iter().map(|&v| ((v * id + 8.5) as i32).clamp(0, 15) as u8).collect();
            for i in 0..16 {
                bytes.push(q[i] | (q[i + 16] << 4));
            }
        }
        QuantRows::new(QuantKind::Q4_0, n, k, bytes).unwrap()
    }

    /// Q5_0 blocks by llama.cpp's rule (the value of largest magnitude maps to code 0, d = max
    /// / -16), so every code 0..=31 and both fifth bits occur.
    fn q5_0_rows(w: &[f32], n: usize, k: usize) -> QuantRows {
        let mut bytes = Vec::new();
        for block in w.chunks_exact(QK) {
            let max = block.iter().cloned().fold(0f32, |a, v| if v.abs() > a.abs() { v } else { a });
            let d = max / -16.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let q: Vec<u32> = block.iter().map(|&v| ((v * id + 16.5) as i32).clamp(0, 31) as u32).collect();
            let qh = q.iter().enumerate().fold(0u32, |h, (i, &c)| h | ((c >> 4) << i));
            bytes.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
            bytes.extend_from_slice(&qh.to_le_bytes());
            for i in 0..16 {
                bytes.push(((q[i] & 15) | ((q[i + 16] & 15) << 4)) as u8);
            }
        }
        QuantRows::new(QuantKind::Q5_0, n, k, bytes).unwrap()
    }

    /// Q5_0 dequantises to d * (q - 16) with the fifth bit from `qh`, and its codes span 0..=31.
    #[test]
    fn q5_0_blocks_read_their_fifth_bits() {
        let (n, k) = (3, 64);
        let w = rand_vec(n * k, 31);
        let q = q5_0_rows(&w, n, k);
        let deq = q.dequantize();
        let mut codes = std::collections::BTreeSet::new();
        for j in 0..n {
            for b in 0..k / QK {
                let (d, _, c) = q.block_of(q.row(j), b);
                codes.extend(c);
                for (t, &code) in c.iter().enumerate() {
                    assert_eq!(deq[j * k + b * QK + t], d.to_f32() * (code as f32 - 16.0));
                    let want = w[j * k + b * QK + t];
                    assert!((deq[j * k + b * QK + t] - want).abs() <= d.to_f32().abs() * 0.51 + 1e-3, "[{j}, {}]", b * QK + t);
                }
            }
        }
        assert!(codes.contains(&0) && codes.contains(&31) && codes.len() > 28, "{codes:?}");
        assert_eq!(QuantKind::from_ggml(candle_core::quantized::GgmlDType::Q5_0), Some(QuantKind::Q5_0));
    }

    /// Q5_0 and Q6_K rows decode as candle's own dequantisation of the same bytes: Q5_0 exactly,
    /// Q6_K within the f16 rounding of each sub-block's d·sc.
    #[test]
    fn q5_0_and_q6_k_decode_as_candle_does() {
        use candle_core::quantized::{GgmlDType, QTensor};
        use candle_core::{Device, Tensor};
        let (n, k) = (6, 512);
        let w = Tensor::from_vec(rand_vec(n * k, 41), (n, k), &Device::Cpu).unwrap();
        for (dtype, kind) in [(GgmlDType::Q5_0, QuantKind::Q5_0), (GgmlDType::Q6K, QuantKind::Q6K)] {
            let q = QTensor::quantize(&w, dtype).unwrap();
            let rows = QuantRows::new(kind, n, k, q.data().unwrap().to_vec()).unwrap();
            let want: Vec<f32> = q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            let got = rows.dequantize();
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                let tol = if kind == QuantKind::Q5_0 { 0.0 } else { b.abs() * 1e-3 + 1e-6 };
                assert!((a - b).abs() <= tol, "{kind:?} [{i}]: {a} vs {b}");
            }
        }
    }

    /// Q6_K rows as candle quantizes them (k = 512: two super-blocks).
    fn q6_k_rows(w: &[f32], n: usize, k: usize) -> QuantRows {
        use candle_core::quantized::{GgmlDType, QTensor};
        let t = candle_core::Tensor::from_vec(w.to_vec(), (n, k), &candle_core::Device::Cpu).unwrap();
        let q = QTensor::quantize(&t, GgmlDType::Q6K).unwrap();
        QuantRows::new(QuantKind::Q6K, n, k, q.data().unwrap().to_vec()).unwrap()
    }

    /// Q6_K through every kernel: close to f32 arithmetic on its dequantised weights, the same
    /// bits for any row count, and the same bits on the portable, AVX2 and AVX-512 paths,
    /// including codes of 63 against activations of 127 (the AVX2 16-bit sums' worst case).
    #[test]
    fn q6_k_kernels_agree_and_are_batch_invariant() {
        let (n, k) = (40, 512);
        let w = rand_vec(n * k, 43);
        // Row 0: every code 63 with scale 1 (ql and qh all ones, scales 1, d 1).
        let mut bytes = q6_k_rows(&w, n, k).row_range(0, n);
        for sb in 0..k / 256 {
            let blk = &mut bytes[sb * 210..(sb + 1) * 210];
            blk[..192].fill(0xff);
            blk[192..208].fill(1);
            blk[208..210].copy_from_slice(&f16::from_f32(1.0).to_bits().to_le_bytes());
        }
        let q = QuantRows::new(QuantKind::Q6K, n, k, bytes).unwrap();
        let wd = q.dequantize();
        assert!(wd[..k].iter().all(|&v| v == 31.0));
        let cw = CpuWeight::Quant(PackedQuant::pack(&q));
        let CpuWeight::Quant(pq) = &cw else { unreachable!() };
        let mut x = rand_vec(13 * k, 44);
        x[..k].fill(1.0);
        let all = cw.matmul(&x, 13);
        let want = reference(&x, 13, k, &wd, n);
        for i in 0..13 {
            for j in 0..n {
                let mag: f32 = (0..k).map(|t| (x[i * k + t] * wd[j * k + t]).abs()).sum();
                assert!((all[i * n + j] - want[i * n + j]).abs() <= 0.02 * mag + 1e-6, "[{i},{j}] {} vs {}", all[i * n + j], want[i * n + j]);
            }
        }
        for m in [1usize, 2, 3, 4, 5, 8, 9, 12] {
            assert_eq!(cw.matmul(&x[..m * k], m), all[..m * n].to_vec(), "rows differ between m={m} and m=13");
            let mut acts = quantize_acts(&x[..m * k], m, k);
            acts.add_half_sums();
            let mut port = vec![0f32; m * n];
            quant_block(&acts, m, pq, 0, n.div_ceil(PANEL), OutPtr(port.as_mut_ptr()));
            assert_eq!(port, all[..m * n].to_vec(), "portable at m={m}");
            #[cfg(target_arch = "x86_64")]
            if crate::cpu::isa::has_avx2() {
                let mut got = vec![f32::NAN; m * n];
                unsafe { avx2_quant::block(&acts, m, pq, 0, n.div_ceil(PANEL), OutPtr(got.as_mut_ptr())) };
                assert_eq!(got, port, "AVX2 at m={m}");
            }
        }
    }

    /// Each format against f32 arithmetic on its own dequantised weights, within the error of
    /// quantizing the activations (8-bit per 32-value block: well under 2% of sum |x w|).
    #[test]
    fn formats_match_reference_and_are_batch_invariant() {
        let (n, k) = (75, 96);
        let w = rand_vec(n * k, 1);
        let x = rand_vec(37 * k, 2);
        let cases: Vec<(&str, CpuWeight, Vec<f32>, f32)> = vec![
            ("f32", CpuWeight::F32(PackedWeight::pack(&w, n, k)), w.clone(), 1e-5),
            ("f16", CpuWeight::F16(PackedF16::pack(&w, n, k)), w.iter().map(|&v| f16::from_f32(v).to_f32()).collect(), 1e-5),
            {
                let q = QuantRows::quantize_q8_0(&w, n, k).unwrap();
                ("q8_0", CpuWeight::Quant(PackedQuant::pack(&q)), q.dequantize(), 0.02)
            },
            {
                let q = q4_1_rows(&w, n, k);
                ("q4_1", CpuWeight::Quant(PackedQuant::pack(&q)), q.dequantize(), 0.02)
            },
            {
                let q = q4_0_rows(&w, n, k);
                ("q4_0", CpuWeight::Quant(PackedQuant::pack(&q)), q.dequantize(), 0.02)
            },
            {
                let q = q5_0_rows(&w, n, k);
                ("q5_0", CpuWeight::Quant(PackedQuant::pack(&q)), q.dequantize(), 0.02)
            },
        ];
        for (name, cw, wd, tol) in cases {
            // The weight itself is close to the original (sanity check of the packing).
            let werr = w.iter().zip(&wd).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(werr < 0.13, "{name}: dequantised weight off by {werr}");
            let all = cw.matmul(&x, 37);
            let want = reference(&x, 37, k, &wd, n);
            for i in 0..37 {
                for j in 0..n {
                    let mag: f32 = (0..k).map(|t| (x[i * k + t] * wd[j * k + t]).abs()).sum();
                    let err = (all[i * n + j] - want[i * n + j]).abs();
                    assert!(err <= tol * mag + 1e-6, "{name}: [{i},{j}] {} vs {} (|x||w| {mag})", all[i * n + j], want[i * n + j]);
                }
            }
            for m in [1usize, 2, 3, 5, 7, 8, 10, 12, 13, 16] {
                let part = cw.matmul(&x[..m * k], m);
                assert_eq!(part, all[..m * n].to_vec(), "{name}: rows differ between m={m} and m=37");
            }
            let one = cw.matmul(&x[20 * k..21 * k], 1);
            assert_eq!(one, all[20 * n..21 * n].to_vec(), "{name}: row 20 alone differs");
        }
    }

    /// The portable kernels give the same bits as the SIMD ones, so results do not depend on
    /// the machine's instruction set.
    #[test]
    fn portable_kernels_match_simd_bits() {
        let (n, k) = (40, 64);
        let w = rand_vec(n * k, 3);
        let x = rand_vec(6 * k, 4);
        let f = PackedF16::pack(&w, n, k);
        let mut port = vec![0f32; 6 * n];
        f16_block(&x, 6, &f, 0, n.div_ceil(PANEL), OutPtr(port.as_mut_ptr()));
        assert_eq!(port, matmul_f16(&x, 6, &f));
        for q in [QuantRows::quantize_q8_0(&w, n, k).unwrap(), q4_1_rows(&w, n, k), q4_0_rows(&w, n, k), q5_0_rows(&w, n, k)] {
            let pq = PackedQuant::pack(&q);
            let mut port = vec![0f32; 6 * n];
            quant_block(&quantize_acts(&x, 6, k), 6, &pq, 0, n.div_ceil(PANEL), OutPtr(port.as_mut_ptr()));
            assert_eq!(port, matmul_quant(&x, 6, &pq), "{:?}", q.kind);
        }
    }

    /// The AVX2 kernels (f16 tiles, integer blocks) give the portable kernels' bits for every
    /// row count, wherever AVX2 runs: Q8_0 with every code including 0 (-128 after centring,
    /// the one whose size needs the unsigned byte), Q4_1, Q4_0 and Q5_0 (activations of
    /// full scale against codes up to 31: the 16-bit sums' worst case).
    #[test]
    fn avx2_kernels_match_portable_bits() {
        if !crate::cpu::isa::has_avx2() {
            return;
        }
        let (n, k) = (40, 96);
        let w = rand_vec(n * k, 23);
        let f = PackedF16::pack(&w, n, k);
        // Codes -128 and 127 in the first block of row 0 (GGUF's Q8_0: f16 scale, 32 i8).
        let mut bytes = QuantRows::quantize_q8_0(&w, n, k).unwrap().row_range(0, n);
        bytes[2] = 0x80;
        bytes[3] = 0x7f;
        let q8 = QuantRows::new(QuantKind::Q8_0, n, k, bytes).unwrap();
        for m in [1usize, 2, 3, 4, 5, 7, 8, 13, 16] {
            let x: Vec<f32> = rand_vec(m * k, 24 + m as u64).iter().map(|v| v * 3.0).collect();
            let panels = n.div_ceil(PANEL);
            let mut port = vec![0f32; m * n];
            f16_block(&x, m, &f, 0, panels, OutPtr(port.as_mut_ptr()));
            let mut got = vec![f32::NAN; m * n];
            #[cfg(target_arch = "x86_64")]
            unsafe { crate::cpu::matmul::avx2_packed::block_of(&x, m, k, n, f.data.as_ptr(), 0, panels, OutPtr(got.as_mut_ptr())) };
            assert_eq!(got, port, "f16 at m={m}");
            let acts = quantize_acts(&x, m, k);
            for q in [&q8, &q4_1_rows(&w, n, k), &q4_0_rows(&w, n, k), &q5_0_rows(&w, n, k)] {
                let pq = PackedQuant::pack(q);
                let mut port = vec![0f32; m * n];
                quant_block(&acts, m, &pq, 0, panels, OutPtr(port.as_mut_ptr()));
                let mut got = vec![f32::NAN; m * n];
                #[cfg(target_arch = "x86_64")]
                unsafe { avx2_quant::block(&acts, m, &pq, 0, panels, OutPtr(got.as_mut_ptr())) };
                assert_eq!(got, port, "{:?} at m={m}", q.kind);
            }
        }
        // Q5_0's worst case for 16-bit sums: code 31 everywhere but one, activations all 127.
        let ws: Vec<f32> = (0..n * k).map(|i| if i % QK == 0 { -1.0 } else { 0.9375 }).collect();
        let q5 = q5_0_rows(&ws, n, k);
        let x = vec![1.0f32; 3 * k];
        let acts = quantize_acts(&x, 3, k);
        let pq = PackedQuant::pack(&q5);
        let mut port = vec![0f32; 3 * n];
        quant_block(&acts, 3, &pq, 0, n.div_ceil(PANEL), OutPtr(port.as_mut_ptr()));
        let mut got = vec![f32::NAN; 3 * n];
        #[cfg(target_arch = "x86_64")]
        unsafe { avx2_quant::block(&acts, 3, &pq, 0, n.div_ceil(PANEL), OutPtr(got.as_mut_ptr())) };
        assert_eq!(got, port, "Q5_0 at full scale");
        let want = q5.dequantize()[..k].iter().sum::<f32>();
        assert!((port[0] - want).abs() < 1e-3 * want.abs(), "{} vs {want}", port[0]);
    }

    /// The SIMD activation quantizer gives the scalar one's codes, scales and sums, including
    /// an all-zero block, exact ties (x / d = n + 0.5) and large values.
    #[test]
    fn activation_quantizers_agree() {
        let k = 6 * QK;
        let mut x = rand_vec(k, 9);
        x[QK..2 * QK].fill(0.0);
        for (i, v) in x[2 * QK..3 * QK].iter_mut().enumerate() {
            *v = (i as f32 - 15.5) * 2.0; // amax 31 -> d = 31/127; many near-ties
        }
        x[3 * QK] = 1e6;
        x[4 * QK + 7] = -3.0e-7;
        let nb = k / QK;
        let (mut q1, mut d1, mut s1) = (vec![0i8; k], vec![0f32; nb], vec![0i32; nb]);
        quantize_row(&x, &mut q1, &mut d1, &mut s1);
        assert_eq!(d1[1], 0.0);
        assert_eq!(s1[0], q1[..QK].iter().map(|&c| c as i32).sum::<i32>());
        assert!(q1.iter().all(|&c| (-127..=127).contains(&c)));
        #[cfg(target_arch = "x86_64")]
        if vnni() {
            let (mut q2, mut d2, mut s2) = (vec![0i8; k], vec![0f32; nb], vec![0i32; nb]);
            unsafe { quantize_row_avx512(&x, &mut q2, &mut d2, &mut s2) };
            assert_eq!((q1.clone(), d1.clone(), s1.clone()), (q2, d2, s2));
        }
        #[cfg(target_arch = "x86_64")]
        if crate::cpu::isa::has_avx2() {
            let (mut q3, mut d3, mut s3) = (vec![0i8; k], vec![0f32; nb], vec![0i32; nb]);
            unsafe { quantize_row_avx2(&x, &mut q3, &mut d3, &mut s3) };
            assert_eq!((q1.clone(), d1.clone(), s1.clone()), (q3, d3, s3));
        }
        // Many rows (the threaded path) give each row's own result.
        let many: Vec<f32> = (0..5).flat_map(|_| x.clone()).collect();
        let a = quantize_acts(&many, 5, k);
        assert_eq!(&a.q[4 * k..], &q1[..]);
        assert_eq!(&a.d[4 * nb..], &d1[..]);
    }

    /// A Q4_1 block re-quantized from its own dequantized values is the same block: what makes
    /// a draft layer stored in 4-bit blocks draft exactly as its f32 weights do.
    #[test]
    fn q4_1_blocks_survive_requantization() {
        for seed in 0..4 {
            let mut w = rand_vec(64 * 96, 40 + seed);
            // Weights of a trained layer's scale, and a block with an offset far from zero.
            w.iter_mut().for_each(|x| *x *= 0.05);
            w[..32].iter_mut().for_each(|x| *x += 0.3);
            let q = QuantRows::quantize_q4_1(&w, 64, 96).unwrap();
            let again = QuantRows::quantize_q4_1(&q.dequantize(), 64, 96).unwrap();
            assert_eq!(again.row_range(0, 64), q.row_range(0, 64), "seed {seed}");
        }
    }

    #[test]
    fn quant_rows_reject_bad_shapes_and_permute() {
        assert!(QuantRows::new(QuantKind::Q8_0, 2, 33, vec![0; 68]).is_err());
        assert!(QuantRows::new(QuantKind::Q4_1, 2, 32, vec![0; 39]).is_err());
        assert!(QuantRows::quantize_q8_0(&[0.0; 40], 1, 40).is_err());
        let w = rand_vec(3 * 32, 5);
        let q = QuantRows::quantize_q8_0(&w, 3, 32).unwrap();
        let p = q.permute_rows(&[2, 0, 1]).unwrap().dequantize();
        let d = q.dequantize();
        assert_eq!(&p[..32], &d[64..]);
        assert_eq!(&p[32..64], &d[..32]);
        assert!(q.permute_rows(&[0, 1]).is_err() && q.permute_rows(&[0, 1, 3]).is_err());
        let both = QuantRows::concat_rows(&[&q, &q.permute_rows(&[2, 0, 1]).unwrap()]).unwrap();
        assert_eq!(both.n, 6);
        assert_eq!(both.dequantize(), [d.clone(), p.clone()].concat());
        // Views compose without copies: a permutation of a stack reads the right rows, and the
        // packed weight of a view is the packed weight of the same rows copied out.
        let mixed = both.permute_rows(&[5, 0, 3, 1, 4, 2]).unwrap();
        let rows: Vec<Vec<f32>> = both.dequantize().chunks(32).map(|c| c.to_vec()).collect();
        assert_eq!(mixed.dequantize(), [5, 0, 3, 1, 4, 2].iter().flat_map(|&i| rows[i].clone()).collect::<Vec<_>>());
        let copied = QuantRows::new(QuantKind::Q8_0, 6, 32, mixed.row_range(0, 6)).unwrap();
        let x = rand_vec(2 * 32, 6);
        assert_eq!(PackedQuant::pack(&mixed).data, PackedQuant::pack(&copied).data);
        assert_eq!(CpuWeight::Quant(PackedQuant::pack(&mixed)).matmul(&x, 2), CpuWeight::Quant(PackedQuant::pack(&copied)).matmul(&x, 2));
        // A shared buffer too short for the rows it claims is refused.
        let buf: SharedBytes = Arc::new(vec![0u8; 100]);
        assert!(QuantRows::shared(QuantKind::Q8_0, 3, 32, buf.clone(), 0, 102).is_err());
        assert!(QuantRows::shared(QuantKind::Q8_0, 2, 32, buf.clone(), 40, 68).is_err());
        assert!(QuantRows::shared(QuantKind::Q8_0, 2, 32, buf, 32, 68).is_ok());
        assert!(QuantRows::concat_rows(&[&q, &QuantRows::quantize_q4_1(&w, 3, 32).unwrap()]).is_err());
        assert_eq!("Q8_0".parse::<WeightFormat>().unwrap(), WeightFormat::Q8_0);
        assert!("q5".parse::<WeightFormat>().is_err());
    }
}
