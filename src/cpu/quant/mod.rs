//! Weight formats for the CPU fast path: f32, f16, bf16 (its kernels in [`crate::cpu::bf16`]), and
//! GGUF Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q4_K / Q6_K kept quantized.
//!
//! Here: the formats ([`WeightFormat`]), a weight on its way in ([`Staged`]) and packed
//! ([`CpuWeight`]), and the candle op that runs it. Beside: `blocks` (the GGUF blocks as the file
//! holds them), `packed_int` (integer blocks regrouped into panels), `acts` (activations quantized
//! per 32 values), `int_kernels` (the integer matmul: portable, AVX-512 VNNI, AVX2), and
//! `packed_f16` (half-precision panels and their kernel).
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
    /// Q5_0, Q4_K, Q6_K); other GGUF types (Q5_1, Q2_K, Q3_K, Q5_K, ...) are requantised to
    /// Q8_0. Hugging Face models have no native quantization and use f32.
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


mod acts;
mod blocks;
mod int_kernels;
mod packed_f16;
mod packed_int;
#[cfg(test)]
mod tests;

use acts::*;
use int_kernels::*;
use packed_f16::*;
pub use blocks::{QuantKind, QuantRows, SharedBytes};
pub use packed_f16::PackedF16;
pub use packed_int::PackedQuant;
