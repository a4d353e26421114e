//! CPU kernels: the lowest floor of the crate. Nothing here knows about models or speculation.
//!
//! Why custom kernels at all: greedy self-speculation must emit exactly what plain greedy decoding
//! emits, so a row's result must not depend on how many rows share the forward. candle's CPU
//! matmul picks another summation order for one row than for many; these kernels fix one order
//! per output element whatever the row count (`docs/kernels.md`).
//!
//! Files, lowest first (a file imports only files above it in this list):
//! - `isa`: which instructions this CPU has (AVX2, AVX-512, VNNI, AMX), detected once.
//! - `team`: the spinning thread team every kernel runs on.
//! - `exp`: the exp polynomial every path shares.
//! - `lanes`: the transposing 16-lane reduction tree (attention's scores, activation quantizing).
//! - `storage`: candle CPU storage as slices, with layout checks.
//! - `matmul`: the f32/f16 batch-invariant matmuls and their packed weights.
//! - [`bf16`]: bf16 weights on AMX tiles.
//! - [`quant`]: the weight formats, and 8-bit integer kernels for GGUF blocks.
//! - `ops`: the small per-row ops of a forward as candle custom ops (norm, RoPE, SwiGLU, KV stores).
//! - `attention`: tree attention and its exp.
//! - [`reduce`]: argmax, top-k, softmax over rows of logits.
pub(crate) mod attention;
pub mod bf16;
pub(crate) mod exp;
pub(crate) mod isa;
pub(crate) mod lanes;
pub(crate) mod matmul;
pub(crate) mod ops;
pub mod quant;
pub mod reduce;
pub(crate) mod storage;
pub(crate) mod team;
#[cfg(test)]
mod testutil;

pub use attention::{sum_exp_below, TreeAttention, TreeMask};
pub use isa::cpu_kernels;
pub use matmul::{matmul_packed, matmul_xwt, PackedWeight, PANEL, ROW_KERNEL_MAX_ROWS};
pub use ops::{GeluTanhGlu, KvCompact, KvStore, RmsNormRows, RopeInPlace, RopeThd, RowMatmul, SwiGlu};
