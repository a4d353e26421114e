//! Reductions over rows of logits: argmax, top-k with probabilities, softmax, and host copies.
//! Plain decoding, verification and drafting all pick tokens through these, so they share one
//! tie-break (the lowest index wins).
use candle_core::{DType, Tensor, D};

use crate::Result;

/// Argmax with the lowest index winning ties: the one tie-break plain and speculative decoding
/// share. NaNs are never picked (unless the first value is one: then 0, as the scalar scan gives).
/// Why SIMD: the scalar scan of SmolLM2's 49,152 logits took 24 µs, once per emitted token in
/// plain decoding and once per visited node in verification (1% of a 4-bit token).
pub fn argmax(xs: &[f32]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::isa::isa() == crate::cpu::isa::Isa::Avx512 {
        // SAFETY: AVX-512F is present.
        return unsafe { argmax_avx512(xs) };
    }
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::isa::has_avx2() {
        // SAFETY: AVX2 is present.
        return unsafe { argmax_avx2(xs) };
    }
    argmax_scalar(xs)
}

/// [`argmax_avx512`] in 8 lanes: the largest non-NaN value, then the first index holding it.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn argmax_avx2(xs: &[f32]) -> u32 {
    use std::arch::x86_64::*;
    if xs.is_empty() || xs[0].is_nan() {
        return 0;
    }
    let n = xs.len();
    let p = xs.as_ptr();
    let body = n / 8 * 8;
    let mut acc = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    while i < body {
        // max(x, acc) is x > acc ? x : acc, so a NaN x leaves acc as it was.
        acc = _mm256_max_ps(_mm256_loadu_ps(p.add(i)), acc);
        i += 8;
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
    let best = lanes.iter().chain(&xs[body..]).fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
    let m = _mm256_set1_ps(best);
    let mut i = 0;
    while i < body {
        let hit = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_loadu_ps(p.add(i)), m));
        if hit != 0 {
            return (i + hit.trailing_zeros() as usize) as u32;
        }
        i += 8;
    }
    (body + xs[body..].iter().position(|&x| x == best).unwrap_or(0)) as u32
}

/// The reference scan [`argmax`] reproduces.
fn argmax_scalar(xs: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &x) in xs.iter().enumerate() {
        if x > xs[best] {
            best = i;
        }
    }
    best as u32
}

/// [`argmax_scalar`]'s answer in two vector passes: the largest non-NaN value (a NaN lane keeps
/// the running maximum), then the first index holding a value equal to it (the scan keeps the
/// first of equal values, and -0.0 == 0.0 there as here).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn argmax_avx512(xs: &[f32]) -> u32 {
    use std::arch::x86_64::*;
    if xs.is_empty() || xs[0].is_nan() {
        return 0;
    }
    let n = xs.len();
    let p = xs.as_ptr();
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    let mask = |i: usize| crate::cpu::matmul::tail_mask(n - i);
    let mut acc = ninf;
    let mut i = 0;
    while i < n {
        // max(x, acc) is x > acc ? x : acc, so a NaN x leaves acc as it was.
        acc = _mm512_max_ps(_mm512_mask_loadu_ps(ninf, mask(i), p.add(i)), acc);
        i += 16;
    }
    let m = _mm512_set1_ps(_mm512_reduce_max_ps(acc));
    let mut i = 0;
    while i < n {
        let k = mask(i);
        let hit = _mm512_mask_cmp_ps_mask::<_CMP_EQ_OQ>(k, _mm512_maskz_loadu_ps(k, p.add(i)), m);
        if hit != 0 {
            return (i + hit.trailing_zeros() as usize) as u32;
        }
        i += 16;
    }
    0 // unreachable: the maximum is one of the values, xs[0] being a number
}

/// Logits of row `row` of a `[T, vocab]` tensor as a host vector.
pub fn row_to_vec(logits: &Tensor, row: usize) -> Result<Vec<f32>> {
    Ok(logits.get(row)?.to_dtype(DType::F32)?.to_vec1()?)
}

/// Calls `f` with an accessor for the rows of a `[T, vocab]` tensor: each row borrowed where the
/// tensor lies contiguous in CPU memory as f32, else copied to the host when first asked for (a
/// GPU's logits: a verification walk reads only the rows it visits). A row past `T` is an
/// error. The storage's read lock is held while `f` runs: `f` must not write to `logits`.
/// Why: verification reads a few rows of SmolLM2's 49,152 logits a step, and copying each row
/// out was most of its 0.04 ms.
pub fn with_rows<R>(logits: &Tensor, f: impl for<'a> FnOnce(&mut dyn FnMut(usize) -> Result<&'a [f32]>) -> Result<R>) -> Result<R> {
    let (t, vocab) = logits.dims2()?;
    let missing = |i: usize| crate::Error::InvalidArgument(format!("no logits row {i} of {t}"));
    if logits.dtype() == DType::F32 {
        let (storage, layout) = logits.storage_and_layout();
        if let (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(data)), Some((a, b))) = (&*storage, layout.contiguous_offsets()) {
            let data = &data[a..b];
            return f(&mut |i| data.get(i * vocab..(i + 1) * vocab).ok_or_else(|| missing(i)));
        }
    }
    let copied: Vec<std::cell::OnceCell<Vec<f32>>> = (0..t).map(|_| std::cell::OnceCell::new()).collect();
    f(&mut |i| {
        let cell = copied.get(i).ok_or_else(|| missing(i))?;
        if cell.get().is_none() {
            let _ = cell.set(row_to_vec(logits, i)?);
        }
        Ok(cell.get().expect("just set").as_slice())
    })
}

/// All rows of a `[T, vocab]` tensor, one host copy.
pub fn rows_to_vec(logits: &Tensor) -> Result<Vec<Vec<f32>>> {
    Ok(logits.to_dtype(DType::F32)?.to_vec2()?)
}

/// Last-dim softmax helper for tests and training code.
pub fn softmax(x: &Tensor) -> Result<Tensor> {
    Ok(candle_nn::ops::softmax(x, D::Minus1)?)
}

/// Top-`k` token ids of each row of `[K, vocab]` draft logits, best first (ties: lower id first),
/// with their softmax probabilities.
///
/// Why not candle's softmax and a sort: drafting calls this once per tree level, and the full
/// softmax tensor, an index vector per row and `select_nth_unstable_by` took about a quarter of
/// the draft layer's time per step. One pass keeps the best `k` logits; the normaliser is
/// [`crate::cpu::sum_exp_below`].
pub fn top_k_rows(logits: &Tensor, k: usize) -> Result<Vec<Vec<(u32, f32)>>> {
    let t = logits.dim(0)?;
    with_rows(logits, |row| (0..t).map(|i| Ok(top_k_of_row(row(i)?, k))).collect())
}

fn top_k_of_row(row: &[f32], k: usize) -> Vec<(u32, f32)> {
    let k = k.min(row.len());
    if k == 0 {
        return Vec::new();
    }
    // Best first; a value joins after the equal ones already kept, so ties keep the lower id.
    let mut top: Vec<(f32, u32)> = Vec::with_capacity(k + 1);
    for (i, &x) in row.iter().enumerate() {
        // Full and not above the last kept (NaN included): skip.
        if top.len() == k && x.partial_cmp(&top[k - 1].0) != Some(std::cmp::Ordering::Greater) {
            continue;
        }
        let at = top.partition_point(|&(v, _)| v >= x);
        top.insert(at, (x, i as u32));
        top.truncate(k);
    }
    let Some(&(max, _)) = top.first() else {
        // Every logit NaN: no ranking to give.
        return Vec::new();
    };
    let z = crate::cpu::sum_exp_below(row, max);
    // Each kept logit's term through the same function, so its arithmetic matches the sum's.
    top.into_iter().map(|(x, i)| (i, crate::cpu::sum_exp_below(&[x], max) / z)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn rows_are_the_tensors_rows_borrowed_or_copied() {
        let l = Tensor::new(&[[0.5f32, -1.0, 2.0], [3.0, 4.0, -5.0], [6.0, 7.5, 8.0]], &Device::Cpu).unwrap();
        let want = l.to_vec2::<f32>().unwrap();
        // Contiguous f32 and a view of its last two rows are borrowed; a transposed copy's
        // transpose (not contiguous) and f16 are copied row by row: the same rows either way.
        let back = l.t().unwrap().contiguous().unwrap().t().unwrap();
        let cases = [(l.clone(), 0), (l.narrow(0, 1, 2).unwrap(), 1), (back, 0), (l.to_dtype(DType::F16).unwrap(), 0)];
        for (t, skip) in cases {
            let rows = want.len() - skip;
            let got = with_rows(&t, |row| {
                assert!(row(rows).is_err(), "a row past the tensor");
                (0..rows).map(|i| Ok(row(i)?.to_vec())).collect::<Result<Vec<_>>>()
            })
            .unwrap();
            assert_eq!(got, want[skip..].to_vec());
            assert_eq!(top_k_rows(&t, 2).unwrap(), top_k_rows(&l, 2).unwrap()[skip..].to_vec());
        }
    }

    #[test]
    fn top_k_orders_by_probability() {
        let l = Tensor::new(&[[0.0f32, 3.0, 1.0, 3.0], [5.0, 0.0, 0.0, 0.0]], &Device::Cpu).unwrap();
        let t = top_k_rows(&l, 2).unwrap();
        assert_eq!(t[0].iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3]);
        assert_eq!(t[1][0].0, 0);
        assert!(top_k_rows(&l, 0).unwrap().iter().all(|r| r.is_empty()));
        assert_eq!(top_k_rows(&l, 9).unwrap()[0].len(), 4, "k past the vocabulary");
    }

    /// Against candle's softmax and a full sort, on rows long enough for the 16-lane sums.
    #[test]
    fn top_k_matches_softmax_and_sort() {
        let (rows, vocab) = (3, 1000);
        let data: Vec<f32> = (0..rows * vocab).map(|i| ((i * 7919 % 1009) as f32 / 1009.0 - 0.5) * 12.0).collect();
        let l = Tensor::from_vec(data.clone(), (rows, vocab), &Device::Cpu).unwrap();
        let probs = candle_nn::ops::softmax(&l, D::Minus1).unwrap().to_vec2::<f32>().unwrap();
        let got = top_k_rows(&l, 7).unwrap();
        for (r, (row, p)) in got.iter().zip(&probs).enumerate() {
            let mut idx: Vec<usize> = (0..vocab).collect();
            idx.sort_by(|&a, &b| data[r * vocab + b].total_cmp(&data[r * vocab + a]).then(a.cmp(&b)));
            assert_eq!(row.iter().map(|x| x.0 as usize).collect::<Vec<_>>(), idx[..7].to_vec(), "row {r}");
            for &(i, q) in row {
                assert!((q - p[i as usize]).abs() <= 1e-5 * p[i as usize].max(1e-3), "row {r} id {i}: {q} vs {}", p[i as usize]);
            }
        }
    }

    #[test]
    fn argmax_matches_the_scalar_scan_with_ties_nans_and_signed_zeros() {
        let mut cases: Vec<Vec<f32>> = vec![vec![], vec![1.0], vec![f32::NAN, 5.0, 2.0], vec![-0.0, 0.0, -1.0], vec![0.0, -0.0], vec![f32::NEG_INFINITY; 20]];
        let mut s = 12345u64;
        for n in [1usize, 15, 16, 17, 33, 100, 49152] {
            for kind in 0..4 {
                let v: Vec<f32> = (0..n)
                    .map(|_| {
                        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        let r = (s >> 40) as u32;
                        match kind {
                            0 => r as f32 / 1e6,
                            1 => (r % 5) as f32, // many ties
                            2 if r % 7 == 0 => f32::NAN,
                            3 if r % 11 == 0 => f32::INFINITY,
                            _ => -(r as f32) / 1e3,
                        }
                    })
                    .collect();
                cases.push(v);
            }
        }
        for v in &cases {
            assert_eq!(argmax(v), argmax_scalar(v), "{:?}", &v[..v.len().min(24)]);
            #[cfg(target_arch = "x86_64")]
            if crate::cpu::isa::has_avx2() {
                assert_eq!(unsafe { argmax_avx2(v) }, argmax_scalar(v), "AVX2: {:?}", &v[..v.len().min(24)]);
            }
        }
    }
}
