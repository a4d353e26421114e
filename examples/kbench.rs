use std::time::Instant;
fn main() {
    let (k, n) = (576usize, 49152usize);
    let w: Vec<f32> = (0..n * k).map(|i| ((i * 7919) % 1000) as f32 * 1e-3).collect();
    for m in [1usize, 2, 4, 8, 16, 32, 64] {
        let x: Vec<f32> = (0..m * k).map(|i| (i % 13) as f32 * 0.1).collect();
        let _ = selfspec::kernels::matmul_xwt(&x, m, k, &w, n);
        let t = Instant::now();
        for _ in 0..10 { let _ = selfspec::kernels::matmul_xwt(&x, m, k, &w, n); }
        println!("m={m} {:.2} ms ({:.1} GB/s)", t.elapsed().as_secs_f64() * 100.0, (n * k * 4) as f64 / (t.elapsed().as_secs_f64() / 10.0) / 1e9);
    }
}
