//! Reading candle's CPU storage as plain slices, with the layout checks the custom ops need.
use candle_core::{CpuStorage, Layout};

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
pub(crate) fn rows_apart<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> candle_core::Result<(&'a [f32], usize)> {
    match s {
        CpuStorage::F32(d) => head_major(d, l, what),
        _ => candle_core::bail!("{what}: batch-invariant kernels take f32"),
    }
}

/// A head-major K or V (`[hkv, s, d]`) whose rows are contiguous within each head: its data
/// from the first element on, and the distance between heads (outer entries may lie apart, the
/// inner `[s, d]` must be contiguous).
pub(crate) fn head_major<'a, E>(data: &'a [E], l: &Layout, what: &str) -> candle_core::Result<(&'a [E], usize)> {
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

