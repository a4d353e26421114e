//! Micro-benchmark of the batch-invariant CPU matmuls on SmolLM2's lm_head shape (49152 x 576).
//! `cargo run --release --example kbench`
use std::time::Instant;
fn main() {
    let (k, n) = (576usize, 49152usize);
    let w: Vec<f32> = (0..n * k).map(|i| ((i * 7919) % 1000) as f32 * 1e-3).collect();
    let pw = selfspec::kernels::PackedWeight::pack(&w, n, k);
    let gb = (n * k * 4) as f64 / 1e9;
    for m in [1usize, 2, 4, 8, 12, 16, 32, 64] {
        let x: Vec<f32> = (0..m * k).map(|i| (i % 13) as f32 * 0.1).collect();
        let time = |f: &dyn Fn()| {
            f();
            let t = Instant::now();
            for _ in 0..10 {
                f();
            }
            t.elapsed().as_secs_f64() / 10.0
        };
        let a = time(&|| drop(selfspec::kernels::matmul_xwt(&x, m, k, &w, n)));
        let b = time(&|| drop(selfspec::kernels::matmul_packed(&x, m, &pw)));
        println!("m={m:>2}  row-dot {:.2} ms ({:.1} GB/s)   packed {:.2} ms ({:.1} GB/s)", a * 1e3, gb / a, b * 1e3, gb / b);
    }
}
