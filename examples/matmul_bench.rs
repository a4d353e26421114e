//! Throughput of the CPU matmul kernels alone, per format and row count, in GB/s of weights
//! streamed: separates the kernel from the rest of the forward. Calls cycle through copies of
//! the weight totalling over 128 MB, so every call streams from DRAM as in a real forward (one
//! repeated matrix would sit in the 32 MB L3).
//! `cargo run --release --example matmul_bench [n k]`, rows via `ROWS=1,4`.
use selfspec::quant::{CpuWeight, PackedQuant, QuantRows};
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let (n, k) = if args.len() == 2 { (args[0], args[1]) } else { (49152, 576) };
    let rows: Vec<usize> = std::env::var("ROWS").map(|v| v.split(',').filter_map(|x| x.parse().ok()).collect()).unwrap_or(vec![1, 2, 4, 8, 16]);
    let w: Vec<f32> = (0..n * k).map(|i| ((i * 2654435761usize) % 1000) as f32 / 1000.0 - 0.5).collect();
    let q8 = QuantRows::quantize_q8_0(&w, n, k)?;
    let q4 = QuantRows::quantize_q4_1(&w, n, k)?;
    for (name, q) in [("q8_0", &q8), ("q4_1", &q4)] {
        let one = CpuWeight::Quant(PackedQuant::pack(q));
        let bytes = one.bytes() as f64;
        let copies = ((128e6 / bytes).ceil() as usize).max(1);
        let ws: Vec<CpuWeight> = (0..copies).map(|_| CpuWeight::Quant(PackedQuant::pack(q))).collect();
        let mut line = format!("{name} {n}x{k} {:.1} MB x{copies}:", bytes / 1e6);
        for &m in &rows {
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 40503) % 997) as f32 / 997.0 - 0.5).collect();
            let reps = ((4e9 / bytes) as usize + 3).max(copies * 3);
            let mut times = Vec::new();
            for r in 0..reps {
                let t = Instant::now();
                std::hint::black_box(ws[r % copies].matmul(&x, m));
                times.push(t.elapsed().as_secs_f64());
            }
            times.sort_by(|a, b| a.partial_cmp(b).unwrap());
            let med = times[times.len() / 2];
            line += &format!("  M={m} {:.3} ms ({:.1} GB/s)", med * 1e3, bytes / med / 1e9);
        }
        println!("{line}");
    }
    Ok(())
}
