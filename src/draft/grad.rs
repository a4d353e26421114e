//! The training forwards' own ops: a linear map whose backward pass computes only what is read,
//! the products the custom ops compute in place, and the readout weight of the fused loss.
//!
//! Why a linear op: `x.matmul(&w.t())` puts a transpose node between the product and the
//! weight, so candle's backward gives each use of a weight two zeroed `[out, in]` buffers and two
//! adds, one of them strided (the transposed gradient), and it computes the input's gradient even
//! where the input is data (the target's states, which train nothing). A draft layer uses each
//! weight once per unrolled step; under `perf` those adds were the largest cost after gemm.
//! [`Readout`] lives here, not beside the loss in `train`, because the draft layer's training
//! copy hands it out and `draft` may not import from `train`.
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Device, Layout, Shape, Tensor};

use crate::Result;

/// `x · wᵀ` for `x [rows, in]` and `w [out, in]`, differentiable in both. On the CPU in f32 with
/// a contiguous `w` one op (its backward: `g · w` where `x` needs it, `gᵀ · x` where `w` does);
/// otherwise candle's matmul.
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if !(cpu_f32(x) && cpu_f32(w)) || x.rank() != 2 || w.rank() != 2 || !w.is_contiguous() {
        return Ok(x.matmul(&w.t()?)?);
    }
    Ok(x.contiguous()?.apply_op2_arc(w, std::sync::Arc::new(Box::new(Linear { w: w.detach() })))?)
}

/// Whether the custom ops here can take `t`: an f32 tensor on the CPU (elsewhere candle's own
/// ops run).
pub(crate) fn cpu_f32(t: &Tensor) -> bool {
    matches!(t.device(), Device::Cpu) && t.dtype() == candle_core::DType::F32
}

/// `x · wᵀ` for `x [rows, in]` and `w [out, in]` read in place from the ops' storages: the
/// product `x.matmul(&w.t())` computes (the same gemm call, so the same bits), without copying
/// the input into a tensor of its own or the result out of one. Why: a 256 × 8,192 product
/// copied out was 8 MB a call, and each fresh buffer met the kernel's page clearing
/// (`clear_page_erms`, 2% of a training run's samples). Both must be contiguous f32.
pub(crate) fn product_xwt(x: &CpuStorage, xl: &Layout, w: &CpuStorage, wl: &Layout, op: &str) -> candle_core::Result<(CpuStorage, Shape)> {
    crate::cpu::storage::contiguous(w, wl, op)?;
    product(x, xl, w, &wl.transpose(0, 1)?, op)
}

/// `x · w` for `x [rows, k]` and a contiguous `w [k, out]`, read in place like [`product_xwt`].
pub(crate) fn product_xw(x: &CpuStorage, xl: &Layout, w: &CpuStorage, wl: &Layout, op: &str) -> candle_core::Result<(CpuStorage, Shape)> {
    crate::cpu::storage::contiguous(w, wl, op)?;
    product(x, xl, w, wl, op)
}

/// `x [rows, k] · w`, `w` seen through `wkn` as `[k, out]` (its storage checked by the caller).
fn product(x: &CpuStorage, xl: &Layout, w: &CpuStorage, wkn: &Layout, op: &str) -> candle_core::Result<(CpuStorage, Shape)> {
    let ((rows, k), (k2, out)) = (xl.shape().dims2()?, wkn.shape().dims2()?);
    if k != k2 {
        candle_core::bail!("{op}: x {:?} and w (as [k, out]) {:?} do not fit", xl.dims(), wkn.dims())
    }
    // The check the tensor path would make: f32, and a layout gemm can read.
    crate::cpu::storage::contiguous(x, xl, op)?;
    Ok((x.matmul(w, (1, rows, out, k), xl, wkn)?, Shape::from((rows, out))))
}

/// The readout weight `w [vocabulary, hidden]` of the fused training loss
/// ([`crate::train::loss::soft_cross_entropy`]).
#[derive(Clone, Copy)]
pub enum Readout<'a> {
    /// A variable: the gradient reaches it.
    Trained(&'a Tensor),
    /// A constant (the target's lm_head rows): no gradient, not even a discarded one. `wt`,
    /// where given, is `w`'s transpose made contiguous once ([`Readout::transposed`]); the
    /// forward product reads it instead of `w`. Why: gemm packs a row-major `w` element by
    /// element, a `[hidden, vocabulary]` copy with vector moves (256 rows × 576 × 8,192, one
    /// thread, Zen 4: 25.4 ms through `wt` against 27.1 through `w`). The bits are the same on
    /// gemm's blocked path, which training always takes (two rows or more, rows × vocabulary
    /// above 256); one row, or a tiny product, takes other gemm kernels that may round
    /// differently. The copy costs `w`'s size again (19 MB for 8,192 × 576 rows).
    Frozen { w: &'a Tensor, wt: Option<&'a Tensor> },
}

impl<'a> Readout<'a> {
    /// `w`'s transpose, contiguous: the `wt` of [`Readout::Frozen`].
    pub fn transposed(w: &Tensor) -> Result<Tensor> {
        Ok(w.t()?.contiguous()?)
    }

    /// The weight itself.
    pub fn w(&self) -> &'a Tensor {
        match *self {
            Readout::Trained(w) | Readout::Frozen { w, .. } => w,
        }
    }
}

struct Linear {
    /// `w`, detached, for the backward's `g · w` (the forward reads the op's own storages).
    w: Tensor,
}

impl CustomOp2 for Linear {
    fn name(&self) -> &'static str {
        "linear"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        product_xwt(s1, l1, s2, l2, "linear")
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let dx = if x.track_op() { Some(grad.matmul(&self.w)?) } else { None };
        let dw = if w.track_op() { Some(grad.t()?.matmul(&x.detach())?) } else { None };
        Ok((dx, dw))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;

    fn random(shape: (usize, usize), seed: u64) -> Tensor {
        let mut rng = crate::decode::sampling::rng(seed);
        let v: Vec<f32> = (0..shape.0 * shape.1).map(|_| rand::Rng::random::<f32>(&mut rng) - 0.5).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// Values and gradients as `x.matmul(&w.t())` gives them; a data input gets no gradient.
    #[test]
    fn linear_matches_candles_matmul_and_skips_data_inputs() {
        let x = Var::from_tensor(&random((5, 12), 1)).unwrap();
        let w = Var::from_tensor(&random((7, 12), 2)).unwrap();
        let up = random((5, 7), 3);
        let want = x.as_tensor().matmul(&w.as_tensor().t().unwrap()).unwrap();
        let got = linear(x.as_tensor(), w.as_tensor()).unwrap();
        assert_eq!(got.to_vec2::<f32>().unwrap(), want.to_vec2::<f32>().unwrap());
        let gw = (want * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let gg = (got * &up).unwrap().sum_all().unwrap().backward().unwrap();
        for v in [x.as_tensor(), w.as_tensor()] {
            let d = (gw.get(v).unwrap() - gg.get(v).unwrap()).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap();
            assert!(d.to_scalar::<f32>().unwrap() < 1e-6);
        }
        let data = random((5, 12), 4);
        let g = (linear(&data, w.as_tensor()).unwrap() * &up).unwrap().sum_all().unwrap().backward().unwrap();
        assert!(g.get(&data).is_none() && g.get(w.as_tensor()).is_some());
    }
}
