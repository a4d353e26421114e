//! The drafters' training loss against soft labels, fused: `Σ_r weight_r · CE(p_r, softmax(x_r ·
//! Wᵀ))` with its backward pass in one candle op, and each row's argmax for the accuracy figures.
//! The draft layers use it, and the heads for soft labels (hard labels keep candle's ops).
//!
//! Why fused: built from candle ops, every unrolled step made about six `[rows, vocabulary]`
//! tensors on the gradient's path (logits, the log-softmax's shifted values, their exponentials,
//! the log-probabilities, their product with the labels), and candle's backward pass gives each
//! one a zeroed buffer and an add beside its own op. Its matmul backward also computes the
//! gradient of both sides, so the EAGLE layer's frozen lm_head rows got a `[vocabulary, hidden]`
//! gradient no one reads, as dear as the forward product. `perf` on a draft-layer run (SmolLM2,
//! 12,288-token draft vocabulary, `--unroll 3`, 2-core Zen 4): 58% of the samples in gemm, 17%
//! in candle's element-wise maps, memsets and `expf`. Here the forward is one product (inputs
//! read in place, rows then worked on in its own buffer) and one pass per row; the backward one
//! pass and one product per trained side.
//!
//! [`soft_cross_entropy_ops`] is the same loss from candle's own ops: the reference the tests
//! compare against, and the path on devices other than the CPU.
use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp2, Device, Layout, Shape, Tensor, D};

pub use crate::draft::grad::Readout;
use crate::{Error, Result};

/// `Σ_r weights[r] · CE(p_r, softmax(x_r · Wᵀ))`, a scalar, and each row's argmax of `x · Wᵀ`.
///
/// `x` is `[rows, hidden]`, `w` `[vocabulary, hidden]`, `p` `[rows, vocabulary]` (the labels'
/// distributions, constants: no gradient reaches them; their sums need not be exactly 1, the
/// loss is `-Σ_i p_i · log q_i` as written). The gradient reaches `x`, and `w` only when it is
/// [`Readout::Trained`]. On the CPU in f32 this runs fused; elsewhere from candle's ops (where
/// `w` gets a gradient whenever it is a variable).
pub fn soft_cross_entropy(x: &Tensor, readout: Readout, p: &Tensor, weights: &[f32]) -> Result<(Tensor, Vec<u32>)> {
    let w = readout.w();
    let (rows, hidden) = x.dims2()?;
    let (vocab, w_hidden) = w.dims2()?;
    if vocab == 0 || w_hidden != hidden || p.dims2()? != (rows, vocab) || weights.len() != rows {
        return Err(Error::InvalidArgument(format!(
            "soft cross-entropy: x {:?}, w {:?}, p {:?} and {} weights do not fit (or an empty vocabulary)",
            x.dims(),
            w.dims(),
            p.dims(),
            weights.len()
        )));
    }
    use crate::draft::grad::cpu_f32;
    if !(cpu_f32(x) && cpu_f32(w) && cpu_f32(p)) {
        return soft_cross_entropy_ops(x, w, p, weights);
    }
    let x = x.contiguous()?;
    let wt = match readout {
        Readout::Frozen { wt: Some(wt), .. } => {
            if wt.dims() != [hidden, vocab] || !cpu_f32(wt) || !wt.is_contiguous() {
                return Err(Error::InvalidArgument(format!(
                    "soft cross-entropy: wt {:?} does not have the shape of w {:?} transposed, or is not contiguous f32 on the CPU",
                    wt.dims(),
                    w.dims()
                )));
            }
            Some(wt.detach())
        }
        _ => None,
    };
    let op = FusedSoftCe {
        w: w.detach(),
        wt,
        p: p.detach().contiguous()?,
        weights: weights.to_vec(),
        train_w: matches!(readout, Readout::Trained(_)),
        saved: Arc::new(Mutex::new(None)),
    };
    let saved = op.saved.clone();
    let loss = x.apply_op2_arc(w, Arc::new(Box::new(op)))?;
    let argmax = saved.lock().map_err(|_| Error::InvalidArgument("soft cross-entropy: a poisoned lock".into()))?.as_ref().map(|s| s.argmax.clone()).unwrap_or_default();
    Ok((loss, argmax))
}

/// The same loss from candle's ops (log-softmax, product, sums): the reference, and the path on
/// other devices. The gradient reaches `w` whenever `w` is a variable.
pub fn soft_cross_entropy_ops(x: &Tensor, w: &Tensor, p: &Tensor, weights: &[f32]) -> Result<(Tensor, Vec<u32>)> {
    let logits = x.matmul(&w.t()?)?;
    let logq = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
    let wt = Tensor::from_slice(weights, weights.len(), x.device())?;
    let loss = ((p.detach() * logq)?.sum(D::Minus1)?.neg()? * wt)?.sum_all()?;
    let argmax = logits.argmax(D::Minus1)?.to_vec1()?;
    Ok((loss, argmax))
}

/// What the forward pass leaves for the backward: the softmax of every row and each row's label
/// mass, and the argmaxes the caller reads.
struct Saved {
    softmax: Vec<f32>,
    mass: Vec<f32>,
    argmax: Vec<u32>,
}

struct FusedSoftCe {
    /// `w`, detached, for the backward's products and the vocabulary size (the forward reads
    /// the op's own storages, or `wt`).
    w: Tensor,
    /// A frozen `w`'s contiguous transpose, which the forward product reads where given.
    wt: Option<Tensor>,
    p: Tensor,
    weights: Vec<f32>,
    train_w: bool,
    saved: Arc<Mutex<Option<Saved>>>,
}

fn op_err(m: impl Into<String>) -> candle_core::Error {
    candle_core::Error::Msg(m.into())
}

/// A CPU tensor's storage and layout, borrowed.
fn with_cpu<R>(t: &Tensor, f: impl FnOnce(&CpuStorage, &Layout) -> candle_core::Result<R>) -> candle_core::Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cpu(s) => f(s, layout),
        _ => Err(op_err("soft cross-entropy needs CPU tensors")),
    }
}

/// The f32 values of a contiguous CPU tensor, borrowed.
fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> candle_core::Result<R> {
    with_cpu(t, |s, layout| Ok(f(crate::cpu::storage::contiguous(s, layout, "soft cross-entropy")?)))
}

impl CustomOp2 for FusedSoftCe {
    fn name(&self) -> &'static str {
        "fused-soft-cross-entropy"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, _) = l1.shape().dims2()?;
        let vocab = self.w.dim(0)?;
        // One product, then per row: max, the log of the sum of exponentials, Σ p, Σ p·(z − max).
        let z = match &self.wt {
            Some(wt) => with_cpu(wt, |st, layout| crate::draft::grad::product_xw(s1, l1, st, layout, "soft cross-entropy"))?.0,
            None => crate::draft::grad::product_xwt(s1, l1, s2, l2, "soft cross-entropy")?.0,
        };
        let CpuStorage::F32(mut softmax) = z else { return Err(op_err("soft cross-entropy: the product is not f32")) };
        let mut mass = vec![0f32; rows];
        let mut argmax = vec![0u32; rows];
        let mut loss = 0f64;
        with_f32(&self.p, |p| {
            for r in 0..rows {
                let (zr, pr) = (&mut softmax[r * vocab..(r + 1) * vocab], &p[r * vocab..(r + 1) * vocab]);
                let (arg, sp, row) = wide_rows(Pass::Forward, zr, pr, 0.0, 0.0);
                argmax[r] = arg;
                mass[r] = sp;
                loss += (self.weights[r] * row) as f64;
            }
        })?;
        *self.saved.lock().map_err(|_| op_err("a poisoned lock"))? = Some(Saved { softmax, mass, argmax: argmax.clone() });
        Ok((CpuStorage::F32(vec![loss as f32]), Shape::from(())))
    }

    fn bwd(&self, x: &Tensor, _w: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let g = grad.to_dtype(candle_core::DType::F32)?.to_scalar::<f32>()?;
        let saved = self.saved.lock().map_err(|_| op_err("a poisoned lock"))?.take();
        let Saved { softmax: mut dz, mass, .. } = saved.ok_or_else(|| op_err("soft cross-entropy: backward without a forward, or twice"))?;
        let rows = mass.len();
        let vocab = self.w.dim(0)?;
        // d loss / d z = weight · (softmax · Σp − p), times the incoming gradient.
        with_f32(&self.p, |p| {
            for r in 0..rows {
                let (zr, pr) = (&mut dz[r * vocab..(r + 1) * vocab], &p[r * vocab..(r + 1) * vocab]);
                wide_rows(Pass::Backward, zr, pr, g * self.weights[r], mass[r]);
            }
        })?;
        let dz = Tensor::from_vec(dz, (rows, vocab), &Device::Cpu)?;
        let dx = dz.matmul(&self.w)?;
        let dw = if self.train_w { Some(dz.t()?.matmul(&x.detach())?) } else { None };
        Ok((Some(dx), dw))
    }
}

/// Which pass [`wide_rows`] runs over one row.
#[derive(Clone, Copy)]
enum Pass {
    /// `z` (the row's logits) becomes its softmax; returns (argmax, Σp, the row's loss).
    Forward,
    /// `z` (the row's softmax) becomes `scale · (softmax · mass − p)`, the logits' gradient.
    Backward,
}

/// Lanes the forward's sums keep side by side (a fixed order, so the same bits every run).
const LANES: usize = 16;

/// One row of a pass, compiled for AVX-512 or AVX2 with FMA where the CPU has them: the crate is
/// built for baseline x86-64, where `mul_add` is a library call per value and the loops run 4
/// lanes wide. The same operations either way (IEEE arithmetic, fused multiply-adds spelled
/// out), so the same bits.
fn wide_rows(pass: Pass, z: &mut [f32], p: &[f32], scale: f32, mass: f32) -> (u32, f32, f32) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512dq,fma")]
        unsafe fn w512(pass: Pass, z: &mut [f32], p: &[f32], scale: f32, mass: f32) -> (u32, f32, f32) {
            row_pass(pass, z, p, scale, mass)
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn w256(pass: Pass, z: &mut [f32], p: &[f32], scale: f32, mass: f32) -> (u32, f32, f32) {
            row_pass(pass, z, p, scale, mass)
        }
        use crate::cpu::isa::{has_avx2, isa, Isa};
        // SAFETY: `isa()` reports AVX-512 (F and DQ) and `has_avx2()` AVX2 with FMA only where
        // the CPU has them.
        match isa() {
            Isa::Avx512 if has_avx2() => return unsafe { w512(pass, z, p, scale, mass) },
            Isa::Avx2 => return unsafe { w256(pass, z, p, scale, mass) },
            _ => {}
        }
    }
    row_pass(pass, z, p, scale, mass)
}

#[inline(always)]
fn row_pass(pass: Pass, z: &mut [f32], p: &[f32], scale: f32, mass: f32) -> (u32, f32, f32) {
    match pass {
        Pass::Backward => {
            for (z, &p) in z.iter_mut().zip(p) {
                *z = scale * z.mul_add(mass, -p);
            }
            (0, 0.0, 0.0)
        }
        Pass::Forward => {
            let arg = crate::cpu::reduce::argmax(z);
            let max = z[arg as usize];
            let (mut sum, mut pz, mut sp) = ([0f32; LANES], [0f32; LANES], [0f32; LANES]);
            let whole = z.len() / LANES * LANES;
            let (body, tail) = z.split_at_mut(whole);
            for (zc, pc) in body.chunks_exact_mut(LANES).zip(p.chunks_exact(LANES)) {
                for i in 0..LANES {
                    let d = zc[i] - max;
                    pz[i] = pc[i].mul_add(d, pz[i]);
                    sp[i] += pc[i];
                    zc[i] = crate::cpu::exp::exp_nonpositive(d);
                    sum[i] += zc[i];
                }
            }
            for (i, (z, &p)) in tail.iter_mut().zip(&p[whole..]).enumerate() {
                let d = *z - max;
                pz[i] = p.mul_add(d, pz[i]);
                sp[i] += p;
                *z = crate::cpu::exp::exp_nonpositive(d);
                sum[i] += *z;
            }
            let total = |a: [f32; LANES]| a.iter().sum::<f32>();
            let (sum, pz, sp) = (total(sum), total(pz), total(sp));
            let inv = 1.0 / sum;
            z.iter_mut().for_each(|z| *z *= inv);
            // -Σ p (d - log Σ e^d), with d = z - max.
            (arg, sp, sp * sum.ln() - pz)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;

    fn random(shape: (usize, usize), seed: u64, scale: f32) -> Tensor {
        let mut rng = crate::decode::sampling::rng(seed);
        let v: Vec<f32> = (0..shape.0 * shape.1).map(|_| (rand::Rng::random::<f32>(&mut rng) - 0.5) * scale).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    /// Loss, argmax and both gradients as candle's own ops give them, for a frozen and a trained
    /// `w`; a broken fused op (a sign, a missing weight) fails this.
    #[test]
    fn fused_loss_and_gradients_match_candles_ops() {
        let (rows, hidden, vocab) = (7, 24, 50);
        let x = Var::from_tensor(&random((rows + 1, hidden), 1, 2.0)).unwrap();
        let xs = x.as_tensor().narrow(0, 1, rows).unwrap();
        let w = Var::from_tensor(&random((vocab, hidden), 2, 1.0)).unwrap();
        // Labels whose rows sum to 0.7, read at an offset (as every unrolled step after the
        // first reads them), and an x at an offset too.
        let p_all = (candle_nn::ops::softmax_last_dim(&random((rows + 2, vocab), 3, 6.0)).unwrap() * 0.7).unwrap();
        let p = p_all.narrow(0, 2, rows).unwrap();
        let weights = [0.5, 0.0, 1.0, 0.25, 1.0, 0.125, 2.0];
        let (want, want_arg) = soft_cross_entropy_ops(&xs, w.as_tensor(), &p, &weights).unwrap();
        let want_g = (&want * 3.0).unwrap().backward().unwrap();
        let wt = Readout::transposed(w.as_tensor()).unwrap();
        // The transposed copy gives the same bits as reading w.
        let via_w = soft_cross_entropy(&xs, Readout::Frozen { w: w.as_tensor(), wt: None }, &p, &weights).unwrap().0;
        let via_wt = soft_cross_entropy(&xs, Readout::Frozen { w: w.as_tensor(), wt: Some(&wt) }, &p, &weights).unwrap().0;
        assert_eq!(via_w.to_scalar::<f32>().unwrap().to_bits(), via_wt.to_scalar::<f32>().unwrap().to_bits());
        for (train_w, readout) in [(true, Readout::Trained(w.as_tensor())), (false, Readout::Frozen { w: w.as_tensor(), wt: None }), (false, Readout::Frozen { w: w.as_tensor(), wt: Some(&wt) })] {
            let (got, got_arg) = soft_cross_entropy(&xs, readout, &p, &weights).unwrap();
            assert!(got.track_op(), "the fused loss is on the graph");
            let (a, b) = (got.to_scalar::<f32>().unwrap(), want.to_scalar::<f32>().unwrap());
            assert!((a - b).abs() <= 1e-4 * b.abs(), "loss {a} against {b}");
            assert_eq!(got_arg, want_arg);
            let got_g = (&got * 3.0).unwrap().backward().unwrap();
            let gx = got_g.get(x.as_tensor()).expect("x has a gradient");
            assert!(max_diff(gx, want_g.get(x.as_tensor()).unwrap()) < 1e-5, "x's gradient");
            match (train_w, got_g.get(w.as_tensor())) {
                (true, Some(gw)) => assert!(max_diff(gw, want_g.get(w.as_tensor()).unwrap()) < 1e-5, "w's gradient"),
                (false, None) => {}
                (t, g) => panic!("train_w {t}: w's gradient present = {}", g.is_some()),
            }
        }
    }

    /// The AVX-512 / AVX2 row passes give the portable code's bits.
    #[test]
    fn row_passes_give_the_same_bits_on_every_path() {
        let (z0, p) = (random((1, 75), 5, 8.0), random((1, 75), 6, 1.0));
        let (z0, p): (Vec<f32>, Vec<f32>) = (z0.flatten_all().unwrap().to_vec1().unwrap(), p.flatten_all().unwrap().to_vec1().unwrap());
        for pass in [Pass::Forward, Pass::Backward] {
            let (mut a, mut b) = (z0.clone(), z0.clone());
            let ra = wide_rows(pass, &mut a, &p, 0.3, 0.9);
            let rb = row_pass(pass, &mut b, &p, 0.3, 0.9);
            assert_eq!((ra.0, ra.1.to_bits(), ra.2.to_bits()), (rb.0, rb.1.to_bits(), rb.2.to_bits()));
            assert_eq!(a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), b.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        }
    }

    #[test]
    fn mismatched_shapes_are_refused() {
        let x = random((3, 4), 1, 1.0);
        let w = random((5, 4), 2, 1.0);
        let p = random((3, 6), 3, 1.0);
        let frozen = Readout::Frozen { w: &w, wt: None };
        assert!(soft_cross_entropy(&x, frozen, &p, &[1.0; 3]).is_err());
        let p = random((3, 5), 3, 1.0);
        assert!(soft_cross_entropy(&x, frozen, &p, &[1.0; 2]).is_err());
        assert!(soft_cross_entropy(&x, Readout::Frozen { w: &w, wt: Some(&w) }, &p, &[1.0; 3]).is_err(), "a wt of the wrong shape");
        let wt = w.t().unwrap();
        assert!(soft_cross_entropy(&x, Readout::Frozen { w: &w, wt: Some(&wt) }, &p, &[1.0; 3]).is_err(), "a wt that is not contiguous");
        let (w0, p0) = (Tensor::zeros((0, 4), candle_core::DType::F32, &Device::Cpu).unwrap(), Tensor::zeros((3, 0), candle_core::DType::F32, &Device::Cpu).unwrap());
        assert!(soft_cross_entropy(&x, Readout::Frozen { w: &w0, wt: None }, &p0, &[1.0; 3]).is_err(), "an empty vocabulary");
    }
}
