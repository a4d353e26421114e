//! Integer blocks repacked into panels of 16 columns for the integer kernels.
use super::*;

/// Bytes of a panel-block's fifth-bit plane (5-bit codes): one bit per code, 16 x 32 codes.
const HIGH_PLANE: usize = 64;

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
    pub(super) k: usize,
    pub(super) n: usize,
    pub(super) bits4: bool,
    /// Planes of higher bits after the 4-bit codes: 1 (Q5_0) or 2 (Q6_K, which also has two
    /// scales per block).
    pub(super) high: u8,
    /// The code that means zero (Q8_0: 128, Q4_0: 8, Q5_0: 16, Q6_K: 32), or `None` when
    /// offsets `m` are stored (Q4_1, Q4_K). Q6_K's offset slot holds its second scales.
    pub(super) zero: Option<u8>,
    pub(super) data: Vec<u8>,
}

impl PackedQuant {
    /// Where a panel-block's scales start: after its codes (and higher-bit planes).
    pub(super) fn codes_bytes(bits4: bool, high: u8) -> usize {
        if bits4 {
            256 + HIGH_PLANE * high as usize
        } else {
            512
        }
    }
    /// Bytes per panel-block: codes, then 16 f16 scales, then 16 f16 offsets (or Q6_K's second
    /// scales).
    pub(super) fn stride(bits4: bool, high: u8, offsets: bool) -> usize {
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
                match q.kind {
                    QuantKind::Q4K => pack_q4k_column(row, c, panel, stride, codes),
                    QuantKind::Q6K => pack_q6k_column(row, c, panel, stride, codes),
                    // Q8_0, Q4_0 and Q4_1 blocks hold their codes in the packed order already
                    // (bytes regrouped; Q8_0's signed codes offset by 128): copied as they are,
                    // which made packing an 8B model's weights about twice as fast. Q5_0's
                    // nibbles are copied too and its fifth bits moved into their plane.
                    QuantKind::Q8_0 | QuantKind::Q4_0 | QuantKind::Q4_1 | QuantKind::Q5_0 => {
                        let bb = q.kind.block_bytes();
                        for (b, blk) in row.chunks_exact(bb).enumerate().take(nb) {
                            let dst = &mut panel[b * stride..(b + 1) * stride];
                            if q.kind == QuantKind::Q8_0 {
                                for g in 0..8 {
                                    for i in 0..4 {
                                        dst[g * 64 + c * 4 + i] = blk[2 + 4 * g + i] ^ 0x80;
                                    }
                                }
                            } else if q.kind == QuantKind::Q5_0 {
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
                            } else {
                                // Q4_0, Q4_1: the 16 code bytes end the block.
                                let qs = &blk[bb - 16..];
                                for g in 0..4 {
                                    dst[g * 64 + c * 4..g * 64 + c * 4 + 4].copy_from_slice(&qs[4 * g..4 * g + 4]);
                                }
                                if q.kind == QuantKind::Q4_1 {
                                    dst[codes + 32 + 2 * c..codes + 34 + 2 * c].copy_from_slice(&blk[2..4]);
                                }
                            }
                            // Every one of these blocks starts with its f16 scale.
                            dst[codes + 2 * c..codes + 2 * c + 2].copy_from_slice(&blk[0..2]);
                        }
                    }
                }
            }
        });
        PackedQuant { k, n, bits4, high, zero, data }
    }
}

/// Column `c` of a panel from a Q4_K row, straight from its 144-byte super-blocks (f16 d and
/// dmin, 12 bytes of 6-bit scales and mins, 128 of codes), with the values and rounding
/// [`QuantRows::block_of`] gives (f16 of d·sc and of -dmin·m per 32-value sub-block). Two
/// sub-blocks share 32 code bytes, the even one in the low nibbles, so a packed byte is two
/// nibbles moved, and each super-block's 16 f16 values are converted together. Through
/// `block_of`, each code and each f16 on its own, loading an 8B-shaped Q4_K model took 10-12 s of
/// user CPU time against Q4_0's 2.4-2.9 s; now 4.7-5.2 s (2-core Xeon).
fn pack_q4k_column(row: &[u8], c: usize, panel: &mut [u8], stride: usize, codes: usize) {
    use half::slice::HalfFloatSliceExt;
    for (sbi, sb) in row.chunks_exact(144).enumerate() {
        let (d, dmin) = (f16::from_le_bytes([sb[0], sb[1]]).to_f32(), f16::from_le_bytes([sb[2], sb[3]]).to_f32());
        let mut f = [0f32; 16];
        for sub in 0..8 {
            let (sc, m) = super::blocks::q4k_scale_min(sub, &sb[4..16]);
            f[sub] = d * sc as f32;
            f[8 + sub] = -dmin * m as f32;
        }
        let mut h = [f16::ZERO; 16];
        h.convert_from_f32_slice(&f);
        for sub in 0..8 {
            let dst = &mut panel[(8 * sbi + sub) * stride..][..stride];
            let qs = &sb[16 + 32 * (sub / 2)..][..32];
            for g in 0..4 {
                for i in 0..4 {
                    let (lo, hi) = (qs[4 * g + i], qs[16 + 4 * g + i]);
                    dst[g * 64 + c * 4 + i] = if sub % 2 == 0 { (lo & 0x0f) | (hi << 4) } else { (lo >> 4) | (hi & 0xf0) };
                }
            }
            dst[codes + 2 * c..codes + 2 * c + 2].copy_from_slice(&h[sub].to_le_bytes());
            dst[codes + 32 + 2 * c..codes + 34 + 2 * c].copy_from_slice(&h[8 + sub].to_le_bytes());
        }
    }
}

/// Column `c` of a panel from a Q6_K row, straight from its 210-byte super-blocks (128 bytes of
/// low nibbles, 64 of high bit pairs, 16 signed scales, f16 d), with the values and rounding
/// [`QuantRows::block_of`] gives: the nibbles regrouped, each group's fifth and sixth bits
/// gathered four at a time into the planes, a super-block's 16 f16 scales d·sc converted
/// together. Through `block_of`, each code and bit on its own, packing took 183 ms per
/// 4,096 × 14,336 matrix against Q4_K's 29, now 75 (2 threads; a Q4_K_M file keeps its output and
/// about half its down and value projections in Q6_K).
fn pack_q6k_column(row: &[u8], c: usize, panel: &mut [u8], stride: usize, codes: usize) {
    use half::slice::HalfFloatSliceExt;
    for (sbi, sb) in row.chunks_exact(210).enumerate() {
        let d = f16::from_le_bytes([sb[208], sb[209]]).to_f32();
        let mut f = [0f32; 16];
        for (i, f) in f.iter_mut().enumerate() {
            *f = d * sb[192 + i] as i8 as f32;
        }
        let mut h = [f16::ZERO; 16];
        h.convert_from_f32_slice(&f);
        for sub in 0..8 {
            let (half128, j) = (sub / 4, sub % 4);
            let (ql, qh) = (&sb[64 * half128 + 32 * (j % 2)..][..32], &sb[128 + 32 * half128..][..32]);
            let mut v = [0u8; QK];
            for (l, v) in v.iter_mut().enumerate() {
                *v = ((ql[l] >> (4 * (j / 2))) & 0x0f) | (((qh[l] >> (2 * j)) & 3) << 4);
            }
            let dst = &mut panel[(8 * sbi + sub) * stride..][..stride];
            for g in 0..4 {
                let (lo, hi) = (&v[4 * g..4 * g + 4], &v[16 + 4 * g..16 + 4 * g + 4]);
                for i in 0..4 {
                    dst[g * 64 + c * 4 + i] = (lo[i] & 0x0f) | (hi[i] << 4);
                }
                // Per group: the low nibbles' fifth-bit mask, their sixth, then the high
                // nibbles' two; bit 4c + i of each is the byte [c][i]'s.
                let plane = 256 + 32 * g;
                for (half_at, vals) in [(0, lo), (16, hi)] {
                    for b in 0..2 {
                        let nibble = (0..4).fold(0u8, |acc, i| acc | (((vals[i] >> (4 + b)) & 1) << i));
                        dst[plane + half_at + 8 * b + c / 2] |= nibble << (4 * (c % 2));
                    }
                }
            }
            dst[codes + 2 * c..codes + 2 * c + 2].copy_from_slice(&h[2 * sub].to_le_bytes());
            dst[codes + 32 + 2 * c..codes + 34 + 2 * c].copy_from_slice(&h[2 * sub + 1].to_le_bytes());
        }
    }
}
