//! A linear map for the training forwards whose backward pass computes only what is read.
//!
//! Why: `x.matmul(&w.t())` puts a transpose node between the product and the weight, so
//! candle's backward gives each use of a weight two zeroed `[out, in]` buffers and two adds, one
//! of them strided (the transposed gradient), and it computes the input's gradient even where the
//! input is data (the target's states, which train nothing). A draft layer uses each weight
//! once per unrolled step; under `perf` those adds were the largest cost after gemm.
use candle_core::{CpuStorage, CustomOp2, Device, Layout, Shape, Tensor};

use crate::Result;

/// `x · wᵀ` for `x [rows, in]` and `w [out, in]`, differentiable in both. On the CPU in f32 one
/// op (its backward: `g · w` where `x` needs it, `gᵀ · x` where `w` does); elsewhere candle's
/// matmul.
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if !(cpu_f32(x) && cpu_f32(w)) || x.rank() != 2 || w.rank() != 2 {
        return Ok(x.matmul(&w.t()?)?);
    }
    Ok(x.contiguous()?.apply_op2_arc(w, std::sync::Arc::new(Box::new(Linear { w: w.detach() })))?)
}

/// Whether the custom ops here can take `t`: an f32 tensor on the CPU (elsewhere candle's own
/// ops run).
pub(crate) fn cpu_f32(t: &Tensor) -> bool {
    matches!(t.device(), Device::Cpu) && t.dtype() == candle_core::DType::F32
}

/// A custom op's input as a tensor of its own (a copy): the ops here hand over contiguous f32
/// inputs only ([`crate::cpu::storage::contiguous`] refuses anything else, naming `op`).
pub(crate) fn input_tensor(s: &CpuStorage, l: &Layout, op: &str) -> candle_core::Result<Tensor> {
    Tensor::from_slice(crate::cpu::storage::contiguous(s, l, op)?, l.shape(), &Device::Cpu)
}

struct Linear {
    /// `w`, detached: the forward reads its values without a copy, the graph keeps the original.
    w: Tensor,
}

impl CustomOp2 for Linear {
    fn name(&self) -> &'static str {
        "linear"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, _s2: &CpuStorage, _l2: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = input_tensor(s1, l1, "linear")?;
        let y = x.matmul(&self.w.t()?)?;
        let shape = y.shape().clone();
        Ok((CpuStorage::F32(y.flatten_all()?.to_vec1()?), shape))
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
