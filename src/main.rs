//! The `selfspec` command line: parses flags, loads files, and hands off to the library.
use std::io::{IsTerminal, Write};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};

use selfspec::generate::{generate_plain, StopRule, TextStream};
use selfspec::loader::{parse_device, Target};
use selfspec::sampling::{rng, SamplingParams};

#[derive(Parser)]
#[command(name = "selfspec", version, about = "Self-speculative decoding with Medusa-style heads and exact tree verification")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Args, Clone)]
struct ModelArgs {
    /// A GGUF file or a Hugging Face model directory.
    #[arg(long)]
    model: PathBuf,
    /// cpu, cuda, cuda:N or metal.
    #[arg(long, default_value = "cpu")]
    device: String,
}

#[derive(Args, Clone)]
struct SamplingArgs {
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f32,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    presence_penalty: f32,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    frequency_penalty: f32,
    #[arg(long, default_value_t = 299792458)]
    seed: u64,
}

impl SamplingArgs {
    fn params(&self) -> selfspec::Result<SamplingParams> {
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

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt (plain decoding, or self-speculative with --heads).
    Generate {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long)]
        prompt: String,
        /// Wrap the prompt in the model's chat template.
        #[arg(long)]
        chat: bool,
        #[arg(long, default_value_t = 128)]
        max_tokens: usize,
        #[command(flatten)]
        sampling: SamplingArgs,
    },
    /// Time one forward over T new tokens after a context, for each T.
    Bench {
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
    },
}

fn load(m: &ModelArgs) -> Result<Target> {
    let device = parse_device(&m.device)?;
    Ok(Target::load(&m.model, &device)?)
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Generate { model, prompt, chat, max_tokens, sampling } => {
            let params = sampling.params()?;
            if max_tokens == 0 {
                bail!("--max-tokens must be at least 1");
            }
            let target = load(&model)?;
            let ids = target.encode_prompt(&prompt, chat)?;
            let stop = StopRule { max_new_tokens: max_tokens, eos_ids: &target.tokenizer.eos_ids };
            let mut stream = TextStream::new(&target.tokenizer);
            let mut stdout = std::io::stdout().lock();
            let mut r = rng(sampling.seed);
            let (_, stats) = generate_plain(&target.model, &ids, &params, &stop, &mut r, &mut |t| {
                if let Some(s) = stream.push(t)? {
                    let _ = stdout.write_all(s.as_bytes());
                    let _ = stdout.flush();
                }
                Ok(())
            })?;
            if let Some(s) = stream.finish()? {
                stdout.write_all(s.as_bytes())?;
            }
            writeln!(stdout)?;
            eprintln!(
                "prompt {} tokens, {} new tokens | prefill {:.1} tok/s | decode {:.1} tok/s",
                stats.prompt_tokens,
                stats.new_tokens,
                stats.prefill_tok_s(),
                stats.decode_tok_s()
            );
        }
        Command::Bench { model, context, tokens, reps, json } => {
            if tokens.is_empty() || tokens.contains(&0) {
                bail!("--tokens needs positive counts");
            }
            let target = load(&model)?;
            let rows = selfspec::bench::bench_forward(&target.model, context, &tokens, reps.max(1)).context("benchmark failed")?;
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                println!("forward cost over a {context}-token context ({})", model.device);
                println!("{:>6} {:>10} {:>8}", "tokens", "median ms", "ratio");
                for r in rows {
                    println!("{:>6} {:>10.2} {:>8.2}", r.tokens, r.median_ms, r.ratio);
                }
            }
            let _ = std::io::stderr().is_terminal();
        }
    }
    Ok(())
}
