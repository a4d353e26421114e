//! `bench`: the cost of one forward over T new tokens in each weight format, optionally beside
//! this machine's measured roofline floor for the same work.
use serde::Serialize;

use crate::cpu::quant::WeightFormat;
use crate::eval::roofline::Roofline;
use crate::model::loader::Target;
use crate::model::timing::{bench_forward, BenchRow};
use crate::{Error, Result};

/// What to time.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Formats in order; each is loaded in turn from the same file.
    pub formats: Vec<WeightFormat>,
    /// Tokens already in the KV cache before the timed forwards.
    pub context: usize,
    /// Rows per timed forward, one row of results each.
    pub tokens: Vec<usize>,
    /// Repetitions per row (the median is reported).
    pub reps: usize,
    /// Also measure this machine's peaks (and its read bandwidth over each format's working set)
    /// and give each row its floor.
    pub roofline: bool,
}

/// One weight format's timings.
#[derive(Debug, Clone, Serialize)]
pub struct FormatBench {
    pub weights: &'static str,
    /// Weight bytes one forward reads.
    pub weight_bytes: usize,
    pub rows: Vec<BenchRow>,
    /// Each row's floor, max(bytes / bandwidth, multiply-adds / peak), with `--roofline`.
    pub floor_ms: Option<Vec<f64>>,
    /// The floor of the row the ratios divide by (T = 1 where timed, else the first).
    pub base_floor_ms: Option<f64>,
    pub roofline: Option<Roofline>,
    /// KV cache element type, as candle names it.
    pub kv_cache: String,
    /// The CPU kernels' instruction-set paths, empty off the CPU.
    pub kernels: String,
}

/// Time every format in `opts.formats` on `target` (reloaded per format), calling `each` as soon
/// as a format is done so a caller can print while the next one runs.
pub fn bench(target: &mut Target, opts: &BenchOptions, each: &mut dyn FnMut(&FormatBench)) -> Result<Vec<FormatBench>> {
    if opts.tokens.is_empty() || opts.tokens.contains(&0) {
        return Err(Error::InvalidArgument("--tokens needs positive counts".into()));
    }
    if opts.reps == 0 {
        return Err(Error::InvalidArgument("--reps must be at least 1".into()));
    }
    // Before any allocation: the cache holds the context and then each forward's rows.
    let max_pos = target.model.config().max_position;
    let most = opts.tokens.iter().max().copied().unwrap_or(0);
    if opts.context.saturating_add(most) > max_pos {
        return Err(Error::InvalidArgument(format!("--context {} plus --tokens {most} is past the model's context of {max_pos} tokens", opts.context)));
    }
    let cpu = target.model.device().is_cpu();
    if opts.roofline && !cpu {
        return Err(Error::InvalidArgument("--roofline measures the CPU; on a GPU it would say nothing about the forward".into()));
    }
    let base = if opts.tokens.contains(&1) { 1 } else { opts.tokens[0] };
    let mut all = Vec::new();
    for &f in &opts.formats {
        target.set_weights(f)?;
        // Measured again for each format, just before its forwards: a shared host's bandwidth
        // and arithmetic move by a quarter from one minute to the next. The read bandwidth is
        // measured over this forward's own working set as well, which may fit in cache.
        let roof = opts.roofline.then(|| Roofline::measure_for(Roofline::working_set(&target.model, opts.context)));
        let rows = bench_forward(&target.model, opts.context, &opts.tokens, opts.reps)?;
        let r = FormatBench {
            weights: f.name(),
            weight_bytes: target.model.weight_bytes_per_forward(),
            rows,
            floor_ms: roof.map(|r| r.floors_ms(&target.model, opts.context, &opts.tokens)),
            base_floor_ms: roof.map(|r| r.floors_ms(&target.model, opts.context, &[base])[0]),
            roofline: roof,
            kv_cache: format!("{:?}", target.model.kv_dtype()),
            kernels: if cpu { crate::cpu::cpu_kernels() } else { String::new() },
        };
        each(&r);
        all.push(r);
    }
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bench_times_each_format_and_refuses_empty_counts() {
        let dir = std::env::temp_dir().join(format!("selfspec-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = crate::model::fixtures::tiny_config();
        let w = crate::model::fixtures::random_weights(&cfg, 1).unwrap();
        let path = dir.join("tiny.gguf");
        crate::model::fixtures::write_gguf(&path, &cfg, &w).unwrap();
        let mut t = Target::load(&path, &candle_core::Device::Cpu).unwrap();
        let mut opts = BenchOptions { formats: vec![WeightFormat::F32, WeightFormat::Q8_0], context: 8, tokens: vec![1, 2], reps: 1, roofline: false };
        let mut seen = 0;
        let r = bench(&mut t, &opts, &mut |_| seen += 1).unwrap();
        assert_eq!((r.len(), seen), (2, 2));
        assert_eq!(r[1].weights, "q8_0");
        assert!(r.iter().all(|f| f.rows.len() == 2 && f.rows[0].ratio == 1.0 && f.floor_ms.is_none()));
        opts.tokens = vec![0];
        assert!(bench(&mut t, &opts, &mut |_| {}).is_err());
        // Sizes past the model's context, and no repetitions, are refused before any work (a
        // huge --tokens used to abort on its allocation).
        let past = cfg.max_position;
        opts.tokens = vec![1, usize::MAX / 2];
        let e = bench(&mut t, &opts, &mut |_| panic!("nothing may run")).unwrap_err().to_string();
        assert!(e.contains("--context 8") && e.contains(&format!("context of {past} tokens")), "{e}");
        opts.tokens = vec![1];
        opts.context = past;
        assert!(bench(&mut t, &opts, &mut |_| panic!("nothing may run")).unwrap_err().to_string().contains("--context"));
        opts.context = 8;
        opts.reps = 0;
        assert!(bench(&mut t, &opts, &mut |_| panic!("nothing may run")).unwrap_err().to_string().contains("--reps"));
        std::fs::remove_dir_all(&dir).ok();
    }
}
