//! Data-parallel gradients: a batch split into a fixed number of groups, each group's loss and
//! backward pass run on its own thread, the gradients summed in group order.
//!
//! Why: candle's backward pass over the small matrices of a drafter parallelises poorly. Each
//! op splits its few thousand rows across the threads and waits at a barrier; under `perf`, an
//! EAGLE-3 run spent 41% of its samples in candle's `BarrierGuard::drop` and 2 threads trained
//! only 1.3× faster than one (2-core Xeon, 5 December 2026). Whole groups per thread have no
//! barrier inside a step, only the sum at its end.
//!
//! The result depends on the number of groups (which decides the order of the floating-point
//! sums), never on the number of threads that run them: a run resumed with another
//! `RAYON_NUM_THREADS` continues bit for bit. (Not on another CPU: the gemm kernels and their
//! blocking follow the CPU's vector width and caches.) Each group's loss must already be scaled
//! to its share of the whole batch, so that the sum is the batch's gradient.
//!
//! Candle's element-wise ops have their own pool (a barrier pool sized by `CANDLE_NUM_THREADS`)
//! that serialises concurrent callers behind a lock; with groups running side by side it only
//! adds spinning threads. [`single_threaded_candle_ops`] turns it off; call it before the
//! first candle op of the process (the `train` command does).
use candle_core::backprop::GradStore;
use candle_core::Tensor;

use crate::{Error, Result};

/// One group's contribution: its loss (already scaled to its share of the batch) and its
/// per-output (hits, rows).
pub type GroupLoss = (Tensor, Vec<(usize, usize)>);

/// A batch's summed loss value, gradients and per-output (hits, rows).
pub struct BatchGrads {
    pub loss: f64,
    pub grads: GradStore,
    pub acc: Vec<(usize, usize)>,
}

/// Threads that run the groups side by side; the gemm calls inside a group split their work
/// across the same pool, so a thread whose group is done helps the others.
pub struct GroupRunner {
    pool: rayon::ThreadPool,
}

impl GroupRunner {
    /// A runner on as many threads as the CPU kernels use (`RAYON_NUM_THREADS` when set, else
    /// the machine's available parallelism).
    pub fn new() -> Result<Self> {
        Self::with_threads(crate::cpu::team::threads())
    }

    /// A runner on exactly `threads` threads (at least one).
    pub fn with_threads(threads: usize) -> Result<Self> {
        let threads = threads.max(1);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("selfspec-grad-{i}"))
            .build()
            .map_err(|e| Error::InvalidArgument(format!("cannot start {threads} training threads: {e}")))?;
        Ok(GroupRunner { pool })
    }

    /// Run `loss_of` on every group (in parallel), back-propagate each, and sum the gradients
    /// of `vars` and the losses in group order.
    pub fn grads<G: Send>(&self, groups: Vec<G>, vars: &[Tensor], loss_of: &(dyn Fn(G) -> Result<GroupLoss> + Sync)) -> Result<BatchGrads> {
        use rayon::prelude::*;
        if groups.is_empty() {
            return Err(Error::InvalidArgument("an empty batch".into()));
        }
        let parts: Vec<Result<BatchGrads>> = self.pool.install(|| {
            groups
                .into_par_iter()
                .map(|g| {
                    let (loss, acc) = loss_of(g)?;
                    let grads = loss.backward()?;
                    Ok(BatchGrads { loss: loss.to_scalar::<f32>()? as f64, grads, acc })
                })
                .collect()
        });
        let mut parts = parts.into_iter();
        let BatchGrads { mut loss, mut grads, mut acc } = parts.next().expect("at least one group")?;
        for part in parts {
            let BatchGrads { loss: l, grads: mut g, acc: a } = part?;
            loss += l;
            for var in vars {
                match (grads.remove(var), g.remove(var)) {
                    (Some(x), Some(y)) => {
                        grads.insert(var, (x + y)?);
                    }
                    (x, y) => {
                        if let Some(v) = x.or(y) {
                            grads.insert(var, v);
                        }
                    }
                }
            }
            acc.resize(acc.len().max(a.len()), (0, 0));
            for (k, (h, n)) in a.into_iter().enumerate() {
                acc[k].0 += h;
                acc[k].1 += n;
            }
        }
        Ok(BatchGrads { loss, grads, acc })
    }
}

/// Split `items` into `groups` contiguous parts whose sizes differ by at most one (fewer parts
/// when there are fewer items), in order.
pub fn split_groups<T: Clone>(items: &[T], groups: usize) -> Vec<Vec<T>> {
    let n = groups.clamp(1, items.len().max(1));
    let (base, extra) = (items.len() / n, items.len() % n);
    let mut out = Vec::with_capacity(n);
    let mut at = 0;
    for g in 0..n {
        let len = base + (g < extra) as usize;
        out.push(items[at..at + len].to_vec());
        at += len;
    }
    out
}

/// Make candle's element-wise pool single-threaded (`CANDLE_NUM_THREADS=1`) unless the user
/// set it, so that groups running side by side do not queue behind its lock. Only effective
/// before the process's first candle op; call it while the process has no other threads
/// (setting the environment races with threads that read it).
pub fn single_threaded_candle_ops() {
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn split_groups_keeps_order_and_balance() {
        let v: Vec<usize> = (0..7).collect();
        assert_eq!(split_groups(&v, 3), vec![vec![0, 1, 2], vec![3, 4], vec![5, 6]]);
        assert_eq!(split_groups(&v, 1), vec![v.clone()]);
        assert_eq!(split_groups(&v[..1], 4), vec![vec![0]]);
        assert_eq!(split_groups::<usize>(&[], 2), vec![Vec::<usize>::new()]);
    }

    #[test]
    fn grouped_gradients_sum_to_the_whole_batch() -> Result<()> {
        let dev = Device::Cpu;
        let w = Var::new(&[1.5f32, -2.0, 0.25], &dev)?;
        let xs: Vec<[f32; 3]> = vec![[1.0, 2.0, 3.0], [0.5, -1.0, 2.0], [3.0, 0.0, -1.0], [2.0, 2.0, 2.0], [-1.0, 4.0, 0.5]];
        let n = xs.len() as f64;
        // Loss per item: (w·x)², scaled by 1/n so the groups' sum is the batch mean.
        let loss_of = |items: Vec<[f32; 3]>| -> Result<GroupLoss> {
            let mut total = Tensor::zeros((), candle_core::DType::F32, &dev)?;
            for x in &items {
                let d = (w.as_tensor() * Tensor::new(x, &dev)?)?.sum_all()?;
                total = (total + d.sqr()?)?;
            }
            Ok(((total / n)?, vec![(items.len(), 1)]))
        };
        let vars = [w.as_tensor().clone()];
        let whole = GroupRunner::new()?.grads(vec![xs.clone()], &vars, &loss_of)?;
        for groups in [2, 3, 5] {
            let split = GroupRunner::new()?.grads(split_groups(&xs, groups), &vars, &loss_of)?;
            assert!((split.loss - whole.loss).abs() < 1e-5, "{groups} groups: loss {} vs {}", split.loss, whole.loss);
            let (a, b): (Vec<f32>, Vec<f32>) = (whole.grads.get(&vars[0]).unwrap().to_vec1()?, split.grads.get(&vars[0]).unwrap().to_vec1()?);
            for (x, y) in a.iter().zip(&b) {
                assert!((x - y).abs() < 1e-4, "{groups} groups: gradient {b:?} vs {a:?}");
            }
            assert_eq!(split.acc, vec![(5, groups)]);
        }
        // The same groups on another number of threads: the same bits.
        let one = GroupRunner::with_threads(1)?.grads(split_groups(&xs, 3), &vars, &loss_of)?;
        let three = GroupRunner::with_threads(3)?.grads(split_groups(&xs, 3), &vars, &loss_of)?;
        assert_eq!(one.grads.get(&vars[0]).unwrap().to_vec1::<f32>()?, three.grads.get(&vars[0]).unwrap().to_vec1::<f32>()?);
        Ok(())
    }
}
