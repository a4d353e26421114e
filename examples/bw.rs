use rayon::prelude::*;
use std::time::Instant;
fn main() {
    let n = 64 << 20; // 256 MB of f32
    let v: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    for _ in 0..3 {
        let t = Instant::now();
        let s: f32 = v.par_chunks(1 << 16).map(|c| { let mut acc = [0f32; 16]; for ch in c.chunks_exact(16) { for l in 0..16 { acc[l] += ch[l]; } } acc.iter().sum::<f32>() }).sum();
        let dt = t.elapsed().as_secs_f64();
        println!("{:.1} GB/s ({s})", (n * 4) as f64 / dt / 1e9);
    }
}
