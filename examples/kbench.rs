//! Micro-benchmark of the batch-invariant CPU matmuls, per weight format, on SmolLM2 shapes.
//! `cargo run --release --example kbench [n k]` (default: lm_head, 49152 x 576).
use std::time::Instant;

use selfspec::kernels::PackedWeight;
use selfspec::quant::{CpuWeight, PackedF16, PackedQuant, QuantRows};

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let (n, k) = if args.len() == 2 { (args[0], args[1]) } else { (49152, 576) };
    let w: Vec<f32> = (0..n * k).map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5).collect();
    let q8 = QuantRows::quantize_q8_0(&w, n, k).unwrap();
    let q4 = QuantRows::quantize_q4_1(&w, n, k).unwrap();
    let formats = [
        ("f32", CpuWeight::F32(PackedWeight::pack(&w, n, k))),
        ("f16", CpuWeight::F16(PackedF16::pack(&w, n, k))),
        ("q8_0", CpuWeight::Quant(PackedQuant::pack(&q8))),
        ("q4_1", CpuWeight::Quant(PackedQuant::pack(&q4))),
    ];
    println!("weight [{n}, {k}]");
    for (name, cw) in &formats {
        let gb = cw.bytes() as f64 / 1e9;
        let mut line = format!("{name:>5}:");
        for m in [1usize, 2, 4, 8, 16, 32] {
            let x: Vec<f32> = (0..m * k).map(|i| (i % 13) as f32 * 0.1 - 0.6).collect();
            cw.matmul(&x, m);
            let reps = 20;
            let t = Instant::now();
            for _ in 0..reps {
                std::hint::black_box(cw.matmul(&x, m));
            }
            let s = t.elapsed().as_secs_f64() / reps as f64;
            line += &format!("  m={m} {:.2} ms ({:.0} GB/s)", s * 1e3, gb / s);
        }
        println!("{line}");
    }
}
