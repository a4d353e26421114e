//! Time of the CPU tree-attention op alone for one layer's shapes (SmolLM2: 9 query heads,
//! 3 K/V heads of 64), per K/V dtype, context length and tree size. Each call's K/V (a few MB)
//! stays in cache, so this is the op's arithmetic and bookkeeping, not DRAM; the fastest of
//! 200 calls is reported, the least disturbed by other load on a shared machine.
//! `cargo run --release --example attention_bench`
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use selfspec::cpu::{TreeAttention, TreeMask};

fn main() -> anyhow::Result<()> {
    let (h, hkv, d) = (9, 3, 64);
    let dev = Device::Cpu;
    for (dtype, prefix) in [DType::F32, DType::F16].into_iter().flat_map(|d| [256usize, 1024, 2048].map(|p| (d, p))) {
        let mut line = format!("{dtype:?} prefix {prefix:5}:");
        for t in [1usize, 2, 4, 8, 16] {
            let s = prefix + t;
            let q = Tensor::randn(0f32, 1., (t, h, d), &dev)?;
            let k = Tensor::randn(0f32, 1., (hkv, s, d), &dev)?.to_dtype(dtype)?;
            let v = Tensor::randn(0f32, 1., (hkv, s, d), &dev)?.to_dtype(dtype)?;
            let op = TreeAttention { mask: Arc::new(TreeMask::causal(t)), prefix_len: prefix, scale: 0.125, first_key: None };
            let mut times = Vec::new();
            for _ in 0..200 {
                let t0 = Instant::now();
                std::hint::black_box(q.apply_op3_no_bwd(&k, &v, &op)?);
                times.push(t0.elapsed().as_secs_f64());
            }
            times.sort_by(|a, b| a.partial_cmp(b).unwrap());
            let best = times[0];
            let bytes = (2 * hkv * s * d * dtype.size_in_bytes()) as f64;
            line += &format!("  T={t} {:.1} us ({:.1} GB/s of K/V)", best * 1e6, bytes / best / 1e9);
        }
        println!("{line}");
    }
    Ok(())
}
