//! `selfspec bench`: time one forward over T new tokens after a context, per weight format.
use anyhow::Result;
use clap::Args;
use selfspec::cpu::quant::WeightFormat;
use selfspec::eval::bench::{bench, BenchOptions, FormatBench};
use selfspec::model::timing::DRAM_BYTES_PER_S;

use crate::cli::args::ModelArgs;

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value_t = 256)]
    context: usize,
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64")]
    tokens: Vec<usize>,
    #[arg(long, default_value_t = 7)]
    reps: usize,
    #[arg(long)]
    json: bool,
    /// Also measure this machine's read bandwidth (from DRAM, and over the forward's own working
    /// set, which may fit in cache) and arithmetic peaks (about a second and 1 GiB of memory,
    /// before each format) and print each forward's floor, max(bytes read / bandwidth,
    /// multiply-adds / peak), with the weights, KV cache and attention counted: how flat a cost
    /// curve this hardware allows at all
    #[arg(long)]
    roofline: bool,
}

pub fn run(a: BenchArgs) -> Result<()> {
    // Loaded in the first format asked for (an 8B model would not fit in f32 first).
    let mut target = a.model.load_as(a.model.weights.unwrap_or(WeightFormat::F32))?;
    let formats = match a.model.weights {
        Some(w) => vec![w],
        None if target.model.device().is_cpu() => WeightFormat::ALL.to_vec(),
        None => vec![WeightFormat::F32],
    };
    let opts = BenchOptions { formats, context: a.context, tokens: a.tokens.clone(), reps: a.reps, roofline: a.roofline };
    let json = a.json;
    let device = a.model.device.clone();
    let all = bench(&mut target, &opts, &mut |f| {
        if !json {
            print_format(f, a.context, &device)
        }
    })?;
    if json {
        println!("{}", serde_json::to_string_pretty(&all)?);
    }
    Ok(())
}

fn print_format(f: &FormatBench, context: usize, device: &str) {
    if let Some(r) = &f.roofline {
        println!(
            "roofline ({} threads, {}): read {:.1} GB/s from DRAM{}, f32 {:.0} GMAC/s, int8 {:.0} GMAC/s (best of a few runs; the floors count weights, KV cache and attention, and assume reads and arithmetic overlap perfectly)",
            r.threads,
            r.isa,
            r.read_bytes_per_s / 1e9,
            match r.working_set_bytes {
                0 => String::new(),
                ws => format!(
                    ", {:.1} GB/s over the forward's {:.0} MB{}",
                    r.working_set_read_bytes_per_s / 1e9,
                    ws as f64 / 1e6,
                    if r.working_set_in_cache() { " (in cache: the floors use it)" } else { "" }
                ),
            },
            r.f32_macs_per_s / 1e9,
            r.int8_macs_per_s / 1e9
        );
    }
    let (bw, measured) = f.roofline.map_or((DRAM_BYTES_PER_S, ""), |r| (r.forward_read_bytes_per_s(), " measured"));
    println!(
        "weights {}: {:.0} MB of weights read per forward (their floor at{measured} {:.1} GB/s: {:.1} ms); {context}-token context, {} KV cache, {device}{}",
        f.weights,
        f.weight_bytes as f64 / 1e6,
        bw / 1e9,
        f.weight_bytes as f64 / bw * 1e3,
        f.kv_cache,
        if f.kernels.is_empty() { String::new() } else { format!(" ({} kernels)", f.kernels) }
    );
    match (&f.floor_ms, f.base_floor_ms) {
        (Some(fl), Some(f1)) => {
            // floor ratio: the flattest curve the hardware allows (floor(T) / floor(1)); of
            // floor: how much of this row's time the floor is.
            println!("{:>6} {:>10} {:>8} {:>8} {:>9} {:>12} {:>9}", "tokens", "median ms", "ratio", "min ms", "floor ms", "floor ratio", "of floor");
            for (r, fl) in f.rows.iter().zip(fl) {
                println!("{:>6} {:>10.2} {:>8.2} {:>8.2} {:>9.2} {:>12.2} {:>8.0}%", r.tokens, r.median_ms, r.ratio, r.min_ms, fl, fl / f1, 100.0 * fl / r.median_ms);
            }
        }
        _ => {
            println!("{:>6} {:>10} {:>8} {:>8}", "tokens", "median ms", "ratio", "min ms");
            for r in &f.rows {
                println!("{:>6} {:>10.2} {:>8.2} {:>8.2}", r.tokens, r.median_ms, r.ratio, r.min_ms);
            }
        }
    }
}
