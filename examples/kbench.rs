//! Micro-benchmark of the batch-invariant CPU matmuls, per weight format, on SmolLM2 shapes:
//! time per call and GB/s of weights streamed, which separates the kernels from the rest of
//! the forward. Calls cycle through copies of the weight totalling over `STREAM_MB` (default
//! 1000), so each one streams from DRAM as in a real forward: one repeated matrix would sit in
//! the L3, and some Xeons have 480 MB of it (there, 128 MB of copies measured the L3: 45 GB/s
//! against 32 from DRAM). `CACHED=1` repeats one copy instead, to see the arithmetic alone. Reported: the median call
//! and, in brackets, the fastest (the least disturbed by other load on a shared machine).
//! `cargo run --release --example kbench [n k]` (default: lm_head, 49152 x 576); row counts
//! via `ROWS=1,4`, formats via `FORMATS=f32,q4_1`.
use std::time::Instant;

use selfspec::cpu::bf16::PackedBf16;
use selfspec::cpu::PackedWeight;
use selfspec::cpu::quant::{CpuWeight, PackedF16, PackedQuant, QuantRows};

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let (n, k) = if args.len() == 2 { (args[0], args[1]) } else { (49152, 576) };
    let rows: Vec<usize> = std::env::var("ROWS").map(|v| v.split(',').filter_map(|x| x.parse().ok()).collect()).unwrap_or(vec![1, 2, 4, 8, 16, 32]);
    let cached = std::env::var("CACHED").is_ok_and(|v| v == "1");
    let w: Vec<f32> = (0..n * k).map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5).collect();
    let q8 = QuantRows::quantize_q8_0(&w, n, k).unwrap();
    let q4 = QuantRows::quantize_q4_1(&w, n, k).unwrap();
    let make = |name: &str| match name {
        "f32" => CpuWeight::F32(PackedWeight::pack(&w, n, k)),
        "f16" => CpuWeight::F16(PackedF16::pack(&w, n, k)),
        "bf16" => CpuWeight::Bf16(PackedBf16::pack(&w, n, k)),
        "q8_0" => CpuWeight::Quant(PackedQuant::pack(&q8)),
        _ => CpuWeight::Quant(PackedQuant::pack(&q4)),
    };
    println!("weight [{n}, {k}], {}", if cached { "one copy (cache-resident when it fits)" } else { "copies > STREAM_MB (streamed from DRAM)" });
    let formats = std::env::var("FORMATS").unwrap_or("f32,f16,bf16,q8_0,q4_1".into());
    for name in formats.split(',') {
        let first = make(name);
        let bytes = first.bytes() as f64;
        let stream = std::env::var("STREAM_MB").ok().and_then(|v| v.parse::<f64>().ok()).unwrap_or(1000.0) * 1e6;
        let copies = if cached { 1 } else { ((stream / bytes).ceil() as usize).max(1) };
        let ws: Vec<CpuWeight> = std::iter::once(first).chain((1..copies).map(|_| make(name))).collect();
        let mut line = format!("{name:>5} x{copies}:");
        for &m in &rows {
            let x: Vec<f32> = (0..m * k).map(|i| (i % 13) as f32 * 0.1 - 0.6).collect();
            let reps = (20usize).max(copies * 3);
            let mut times = Vec::with_capacity(reps);
            for r in 0..reps + 1 {
                let t = Instant::now();
                std::hint::black_box(ws[r % copies].matmul(&x, m));
                if r > 0 {
                    times.push(t.elapsed().as_secs_f64());
                }
            }
            times.sort_by(|a, b| a.total_cmp(b));
            let (med, best) = (times[times.len() / 2], times[0]);
            line += &format!("  m={m} {:.3} ms {:.0} GB/s ({:.0})", med * 1e3, bytes / med / 1e9, bytes / best / 1e9);
        }
        println!("{line}");
    }
}
