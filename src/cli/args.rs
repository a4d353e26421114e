//! Flag groups shared by several subcommands, one per concern (model, sampling, drafter), so
//! each flag is defined and documented once.
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use clap::Args;
use selfspec::cpu::quant::WeightFormat;
use selfspec::decode::sampling::SamplingParams;
use selfspec::draft::datastore::Datastore;
use selfspec::draft::drafter::{Drafter, DRAFTING_FORMAT};
use selfspec::model::loader::{parse_device, Target};

/// The seed every subcommand uses unless given `--seed`.
pub const DEFAULT_SEED: u64 = 0;

#[derive(Args, Clone)]
#[command(next_help_heading = "Model")]
pub struct ModelArgs {
    /// A GGUF file or a Hugging Face model directory.
    #[arg(long)]
    pub model: PathBuf,
    /// cpu, cuda, cuda:N or metal.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// CPU weight format: f32 (dequantised reference), f16, bf16 (AMX tiles where the CPU has
    /// them, slow elsewhere), q8_0, or native (the GGUF's own Q8_0/Q4_0/Q4_1/Q5_0/Q4_K/Q6_K
    /// blocks, int8 arithmetic; F32/F16 tensors kept as they are, other types requantised to Q8_0). GPUs always use f32. [default: native on the CPU, f32 on GPUs; train: f32; bench: all]
    #[arg(long)]
    pub weights: Option<WeightFormat>,
    /// KV cache element type: f16 (half the bytes for attention to read; the default on the
    /// CPU) or f32 (exact K/V; the default on GPUs).
    #[arg(long, value_parser = ["f16", "f32"])]
    pub kv_cache: Option<String>,
}

impl ModelArgs {
    /// Load the target in the format asked for, else the file's own blocks on the CPU, as
    /// llama.cpp runs a GGUF (an f32 copy of a 4-bit file is 7x the memory and decodes 7x
    /// slower), and f32 on GPUs.
    pub fn load(&self) -> Result<Target> {
        let device = parse_device(&self.device)?;
        let weights = self.weights.unwrap_or(if device.is_cpu() { WeightFormat::Native } else { WeightFormat::F32 });
        self.load_on(device, weights)
    }

    pub fn load_as(&self, weights: WeightFormat) -> Result<Target> {
        self.load_on(parse_device(&self.device)?, weights)
    }

    fn load_on(&self, device: candle_core::Device, weights: WeightFormat) -> Result<Target> {
        if weights != WeightFormat::F32 && !device.is_cpu() {
            bail!("--weights {weights} is a CPU format; on {} the model runs candle's f32 kernels", self.device);
        }
        let mut target = Target::load_with(&self.model, &device, weights)?;
        match self.kv_cache.as_deref() {
            Some("f32") => target.model.set_kv_dtype(candle_core::DType::F32)?,
            Some(_) => target.model.set_kv_dtype(candle_core::DType::F16)?,
            None => {}
        }
        Ok(target)
    }
}

#[derive(Args, Clone)]
#[command(next_help_heading = "Sampling")]
pub struct SamplingArgs {
    /// 0 = greedy. Applied first, then top-k, top-p and min-p (as Hugging Face and vLLM order
    /// them; llama.cpp applies it last).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Keep the k likeliest tokens (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Keep the likeliest tokens whose probabilities sum to p (1: all).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Drop tokens less likely than min-p times the likeliest (0: none).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Hugging Face's: positive logits of tokens already in the context divided by it, negative
    /// ones multiplied (1: none).
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// OpenAI's: subtracted once from the logit of every token already present, in [-2, 2].
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// OpenAI's: subtracted per occurrence, in [-2, 2].
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// Seed of the sampler (with eval and distill: of the first prompt; prompt i uses seed + i);
    /// -1 or `random` draws one (llama.cpp's -1), which `generate` prints so a run can be repeated.
    #[arg(long, default_value_t = DEFAULT_SEED, value_parser = parse_seed, allow_negative_numbers = true)]
    pub seed: u64,
}

/// `--seed`: a number, or -1 / `random` for a seed drawn from the OS's hash keys and the clock.
fn parse_seed(s: &str) -> std::result::Result<u64, String> {
    match s {
        "-1" | "random" => {
            use std::hash::{BuildHasher, Hasher};
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
            Ok(h.finish())
        }
        _ => s.parse::<u64>().map_err(|_| format!("{s:?} is not a seed: a whole number from 0 to {}, or -1 (random)", u64::MAX)),
    }
}

impl SamplingArgs {
    /// The parameters, validated.
    pub fn params(&self) -> Result<SamplingParams> {
        let p = SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
        };
        p.validate()?;
        Ok(p)
    }
}

#[derive(Args, Clone)]
#[command(next_help_heading = "Drafter")]
pub struct DrafterArgs {
    /// A drafter directory: Medusa-style heads (heads.json + heads.safetensors, or the Medusa
    /// format) or a draft layer (draft.json + draft.safetensors, as `train` writes, or an EAGLE-3
    /// checkpoint in the SpecForge/vLLM layout: config.json + model.safetensors).
    #[arg(long, alias = "heads", value_name = "DIR", value_parser = drafter_dir)]
    pub drafter: Option<PathBuf>,
    /// Weight format the drafter runs in: native (4-bit blocks for a draft layer, 8-bit for
    /// heads: the fastest), q8_0 (8-bit: guesses a little closer to the trained weights', worth
    /// it for deep trees), f16, bf16 or f32. Drafts need not be exact; verification is.
    #[arg(long, default_value_t = DRAFTING_FORMAT, requires = "drafter")]
    pub draft_weights: WeightFormat,
    /// Text the +lookup branch may also copy from (REST-style retrieval): a corpus manifest
    /// (training/corpus.toml: its sets marked `datastore = true`) or distill JSONL / text
    /// files. Where its longest match with the text so far beats the context's, the branch
    /// copies what most often followed it there.
    #[arg(long, num_args = 1.., requires = "drafter")]
    pub datastore: Vec<PathBuf>,
}

/// `--drafter`'s value: an existing directory, checked as the flags are read (before a model
/// loads for seconds only to find the drafter missing).
fn drafter_dir(s: &str) -> std::result::Result<PathBuf, String> {
    let p = PathBuf::from(s);
    match std::fs::metadata(&p) {
        Ok(m) if m.is_dir() => Ok(p),
        Ok(_) => Err("a file, not a drafter directory (leave --drafter out to decode plainly)".into()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err("no such directory (leave --drafter out to decode plainly)".into()),
        Err(e) => Err(format!("{e}")),
    }
}

impl DrafterArgs {
    /// The drafter directory, or an error naming the subcommand that needs one.
    pub fn dir(&self, subcommand: &str) -> Result<&Path> {
        match &self.drafter {
            Some(d) => Ok(d),
            None => bail!("{subcommand} needs --drafter DIR (a directory that `selfspec train` wrote, e.g. training/drafters/smollm2-eagle3)"),
        }
    }

    /// Load the drafter, if one was named, and attach it to `target` (an EAGLE-3 layer makes
    /// the target's forwards return the layers it reads).
    pub fn load(&self, target: &mut Target) -> Result<Option<Drafter>> {
        Ok(match &self.drafter {
            Some(dir) => {
                // Loaded to draft: no f32 weights are kept (or, from 4-bit files, made).
                let (d, note) = Drafter::for_drafting(dir, target, self.draft_weights)?;
                d.attach(target)?;
                if let Some(n) = note {
                    eprintln!("note: {n}");
                }
                Some(d)
            }
            None => None,
        })
    }

    /// Load the target (`model`), this drafter and its datastore, and say on stderr what was
    /// loaded and, for a model without a chat template, that `joined` reach it as plain text:
    /// what the commands that hold a conversation (`serve`, `chat`) start with.
    pub fn load_with(&self, model: &ModelArgs, joined: &str) -> Result<(Target, Option<Drafter>, Option<Datastore>)> {
        let t0 = std::time::Instant::now();
        let mut target = model.load()?;
        let drafter = self.load(&mut target)?;
        let datastore = self.datastore(&target)?;
        eprintln!("loaded {} ({} weights){} in {:.2} s", target.path.display(), target.model.weight_format(), if drafter.is_some() { " and its drafter" } else { "" }, t0.elapsed().as_secs_f64());
        if let Some(n) = target.plain_prompts_note() {
            eprintln!("{n} ({joined} are joined as plain text)");
        }
        Ok((target, drafter, datastore))
    }

    /// Index the `--datastore` inputs, if any were named.
    pub fn datastore(&self, target: &Target) -> Result<Option<Datastore>> {
        if self.datastore.is_empty() {
            return Ok(None);
        }
        let t0 = std::time::Instant::now();
        let ds = Datastore::from_inputs_cached(target, &self.datastore, selfspec::files::cache_dir().as_deref())?;
        eprintln!("datastore: {} tokens ready in {:.1}s (indexes are cached between runs)", ds.len(), t0.elapsed().as_secs_f64());
        Ok(Some(ds))
    }
}

/// A progress bar on stderr, hidden when stderr is not a terminal.
pub fn progress(len: u64, what: &str) -> indicatif::ProgressBar {
    let bar = if std::io::stderr().is_terminal() { indicatif::ProgressBar::new(len) } else { indicatif::ProgressBar::hidden() };
    let style = indicatif::ProgressStyle::with_template(&format!("{what} {{bar:30}} {{pos}}/{{len}} {{elapsed}} eta {{eta}} {{msg}}")).unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    bar.set_style(style);
    bar
}

/// Accuracies as three-decimal strings, for summaries.
pub fn fmt_acc(v: &[f64]) -> Vec<String> {
    v.iter().map(|x| format!("{x:.3}")).collect()
}
