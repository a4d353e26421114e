//! GGUF weight blocks as the file holds them: the block kinds the kernels read, and a matrix
//! of them row by row ([`QuantRows`]), a view that may lie in a memory-mapped file.
use super::*;

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
pub(super) fn q4k_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
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
pub(super) struct Segment {
    pub(super) bytes: SharedBytes,
    pub(super) start: usize,
    pub(super) n: usize,
    pub(super) perm: Option<Arc<[usize]>>,
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
    pub(super) segments: Vec<Segment>,
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

    pub(super) fn row_bytes(&self) -> usize {
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
    pub(super) fn locate(&self, mut j: usize) -> (usize, usize) {
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
    pub(super) fn row(&self, j: usize) -> &[u8] {
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
    pub(super) fn block_of(&self, row: &[u8], b: usize) -> (f16, f16, [u8; QK]) {
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
