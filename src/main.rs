//! The `selfspec` command line: parses flags, loads files, and hands off to the library.
use std::io::{IsTerminal, Write};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};

use selfspec::generate::{generate_plain, GenStats, StopRule, TextStream};
use selfspec::eval::{choose_tree, evaluate, rank_accuracy, to_markdown, to_svg, EvalOptions, EvalReport};
use selfspec::drafter::Drafter;
use selfspec::draft_layer::StoreFormat;
use selfspec::spec::{generate_spec, Plan, SpecOptions, SpecStats, TreeChoice};
use selfspec::train::{describe_inputs, train, LossKind, TrainConfig};
use selfspec::verify::Rule;
use selfspec::loader::{parse_device, Target};
use selfspec::quant::WeightFormat;
use selfspec::sampling::{rng, SamplingParams};

// Training allocates and frees tensors of hundreds of MB each step; mimalloc reuses that memory
// instead of returning it to the kernel and faulting it back in (which cost more than the math).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

// mimalloc's own C API (the library is linked through the `mimalloc` crate; its Rust bindings for
// options sit behind a feature whose dependency is not vendored here).
extern "C" {
    fn mi_option_set(option: std::os::raw::c_int, value: std::os::raw::c_long);
    #[cfg(test)]
    fn mi_option_get(option: std::os::raw::c_int) -> std::os::raw::c_long;
}
/// `mi_option_purge_delay` in mimalloc 2 and 3's `mi_option_e`.
const MI_OPTION_PURGE_DELAY: std::os::raw::c_int = 15;

/// mimalloc hands freed memory back to the kernel a while after its last use (1 s by default in
/// mimalloc 3) and faults it in again when it is reused. Decoding reuses the same buffers every
/// step, yet with the default a 200-token `generate` on native weights still took 12-20k page
/// faults (211k with a 10 ms delay). A CLI run's memory peaks early and stays there, so nothing
/// is handed back: 1.3k faults, and `bench` on native weights ran 3-12% faster at T = 1, 4 and 8
/// (5 interleaved rounds). `MIMALLOC_PURGE_DELAY` in the environment wins.
fn keep_freed_pages_warm() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: sets one integer option; valid at any time, from any thread.
        unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, -1) }
    }
}

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
    /// CPU weight format: f32 (dequantised reference), f16, bf16 (AMX tiles where the CPU has
    /// them, slow elsewhere), q8_0, or native (the GGUF's own Q8_0/Q4_0/Q4_1/Q4_K blocks, int8
    /// arithmetic; other types as Q8_0). GPUs always use f32. [default: f32; bench: all]
    #[arg(long)]
    weights: Option<WeightFormat>,
    /// KV cache element type: f16 (half the bytes for attention to read; the default on the
    /// CPU) or f32 (exact K/V; the default on GPUs).
    #[arg(long, value_parser = ["f16", "f32"])]
    kv_cache: Option<String>,
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

/// The tree `generate` and `eval` use unless told otherwise, and what `tune` measures its pick
/// against.
const DEFAULT_TREE: &str = "auto+lookup:6";

#[derive(Args, Clone)]
struct SpecArgs {
    /// Draft heads directory (heads.json + heads.safetensors, or Medusa format): enables
    /// self-speculative decoding.
    #[arg(long)]
    heads: Option<PathBuf>,
    /// cpu (8 nodes), gpu (64), chain, chain:N, dynamic, dynamic:N, auto, auto:N (cut per step by this device's measured costs), or a tree JSON file;
    /// append +lookup[:N] to graft up to N tokens copied from the context (prompt lookup).
    /// The default, auto+lookup:6, was the fastest tree for both drafters and weight formats
    /// measured here; it times the forward once at start-up (under a second on this CPU).
    #[arg(long, default_value = DEFAULT_TREE)]
    tree: String,
    /// Medusa's typical acceptance. LOSSY: the output no longer follows the target's distribution.
    #[arg(long)]
    lossy_typical: bool,
    /// Text the +lookup branch may also copy from (REST-style retrieval): files or
    /// directories as `train --data` takes them, e.g. the self-distilled answers in
    /// training/data. Where its longest match with the text so far beats the context's, the
    /// branch copies what most often followed it there.
    #[arg(long, num_args = 1..)]
    datastore: Vec<PathBuf>,
    /// Weight format the drafter runs in: native (4-bit blocks for a draft layer, 8-bit for
    /// heads: the fastest), q8_0 (8-bit: guesses a little closer to the trained weights', worth
    /// it for deep trees), f16, bf16 or f32. Drafts need not be exact; verification is.
    #[arg(long, default_value_t = selfspec::drafter::DRAFTING_FORMAT)]
    draft_weights: WeightFormat,
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
        #[command(flatten)]
        spec: SpecArgs,
        /// Also run plain decoding on the same prompt and print both speeds and the speed-up.
        #[arg(long, requires = "heads")]
        compare: bool,
    },
    /// Self-distillation: the target answers each prompt through its chat template; one JSONL
    /// record per answer, appended as soon as it is done (a killed run resumes).
    Distill {
        #[command(flatten)]
        model: ModelArgs,
        /// One prompt per line, or JSONL with "prompt" or "turns".
        #[arg(long)]
        prompts: PathBuf,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 256)]
        max_tokens: usize,
        #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
        temperature: f32,
        /// Prompt i samples with seed + i (its line in the prompt file), so a resumed run
        /// answers exactly as an uninterrupted one.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Conversations decoded side by side, one token each per forward: each weight is read
        /// once per step for all of them. Answers are the same at any batch size.
        #[arg(long, default_value_t = 8)]
        batch: usize,
    },
    /// Train draft heads on a corpus with the backbone frozen.
    Train {
        #[command(flatten)]
        model: ModelArgs,
        /// Text files, directories of text files, or distill JSONL (rendered through the chat template).
        #[arg(long, num_args = 1.., required = true)]
        data: Vec<PathBuf>,
        /// Output directory: heads.json, heads.safetensors, report.json, checkpoints.
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 4)]
        heads: usize,
        #[arg(long, default_value_t = 1)]
        layers: usize,
        /// Give each head its own vocabulary projection (initialised from lm_head).
        #[arg(long)]
        own_lm_head: bool,
        #[arg(long, default_value_t = 2)]
        epochs: usize,
        #[arg(long, default_value_t = 1e-3)]
        lr: f64,
        #[arg(long, default_value_t = 256)]
        seq_len: usize,
        #[arg(long, default_value_t = 512)]
        batch_tokens: usize,
        /// hard: the corpus token; soft: the target's own distribution.
        #[arg(long, default_value = "soft", value_parser = ["hard", "soft"])]
        loss: String,
        #[arg(long, default_value_t = 0.8)]
        decay: f64,
        #[arg(long, default_value_t = 0.05)]
        val_fraction: f64,
        #[arg(long, default_value_t = 20)]
        warmup: usize,
        #[arg(long, default_value_t = 50)]
        checkpoint_every: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Continue a killed run from its last checkpoint in --out.
        #[arg(long)]
        resume: bool,
        /// Keep the backbone's hidden states here, so later runs and epochs cost only the heads.
        #[arg(long)]
        cache_hidden: Option<PathBuf>,
        /// Stop after this many steps (the checkpoint stays; --resume continues).
        #[arg(long, default_value_t = 0)]
        max_steps: usize,
        /// Heads draft from the N most frequent corpus tokens (FR-Spec style; 0 = full vocabulary).
        /// Cheaper to train and to run; verification still uses the full vocabulary.
        #[arg(long, default_value_t = 8192)]
        draft_vocab: usize,
        /// Plain Medusa heads that do not read the root token's embedding (exportable to the
        /// Medusa format).
        #[arg(long)]
        no_root_token: bool,
        /// Train an EAGLE-style draft layer (one decoder layer over the target's features,
        /// drafting autoregressively) instead of Medusa heads; --out then gets draft.json and
        /// draft.safetensors, used wherever --heads takes a directory.
        #[arg(long)]
        draft_layer: bool,
        /// Draft layer: steps of training-time test (each row also drafts this many tokens ahead
        /// from its own predictions, as at inference).
        #[arg(long, default_value_t = 1)]
        unroll: usize,
        /// Draft layer: weight of the feature-regression loss next to the token loss (EAGLE uses 1).
        #[arg(long, default_value_t = 0.0)]
        feature_weight: f64,
        /// Train nothing: print the held-out accuracy of the drafter in --init on the chunks
        /// this run's data, --seq-len, --seed, --val-fraction and --heads/--unroll hold out
        /// (hidden states of those chunks only), to compare drafters on one validation set.
        #[arg(long, requires = "init")]
        validate_only: bool,
        /// Start from the trained heads or draft layer in this directory (same kind and shape;
        /// its draft vocabulary is kept) instead of fresh weights: fine-tune on new data, or
        /// train more epochs with a new schedule.
        #[arg(long)]
        init: Option<PathBuf>,
    },
    /// Acceptance length, per-head accuracy and speed-up against plain decoding, in one run.
    Eval {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long)]
        heads: PathBuf,
        /// One prompt per line, JSONL with "prompt", or MT-Bench/Spec-Bench style "turns".
        #[arg(long)]
        prompts: PathBuf,
        /// Trees to compare (repeatable): cpu, gpu, chain[:N], dynamic[:N], auto[:N], or a tree file, each
        /// optionally with +lookup[:N] (a branch copied from the context).
        #[arg(long, default_values_t = vec![DEFAULT_TREE.to_string()])]
        tree: Vec<String>,
        #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
        temperature: f32,
        #[arg(long, default_value_t = 128)]
        max_tokens: usize,
        /// Only the first N prompts.
        #[arg(long)]
        limit: Option<usize>,
        /// Write PREFIX.json, PREFIX.md and PREFIX.svg.
        #[arg(long)]
        out: Option<PathBuf>,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Text the +lookup branch may also copy from (REST-style retrieval): files or
        /// directories as `train --data` takes them, e.g. the self-distilled answers in
        /// training/data. Where its longest match with the text so far beats the context's, the
        /// branch copies what most often followed it there.
        #[arg(long, num_args = 1..)]
        datastore: Vec<PathBuf>,
        /// Weight format the drafter runs in (see `generate --draft-weights`).
        #[arg(long, default_value_t = selfspec::drafter::DRAFTING_FORMAT)]
        draft_weights: WeightFormat,
    },
    /// Measure head accuracies and this device's forward costs; write the tree that maximises
    /// expected speed-up.
    Tune {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long)]
        heads: PathBuf,
        #[arg(long)]
        prompts: PathBuf,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 24)]
        max_nodes: usize,
        /// Tokens generated per prompt to measure head accuracy.
        #[arg(long, default_value_t = 96)]
        max_tokens: usize,
        /// Prompts used afterwards to measure the chosen tree against plain decoding.
        #[arg(long, default_value_t = 6)]
        check_prompts: usize,
        /// Text the +lookup branch may also copy from (REST-style retrieval): files or
        /// directories as `train --data` takes them, e.g. the self-distilled answers in
        /// training/data. Where its longest match with the text so far beats the context's, the
        /// branch copies what most often followed it there.
        #[arg(long, num_args = 1..)]
        datastore: Vec<PathBuf>,
        /// Weight format the drafter runs in (see `generate --draft-weights`).
        #[arg(long, default_value_t = selfspec::drafter::DRAFTING_FORMAT)]
        draft_weights: WeightFormat,
    },
    /// Re-save heads: in the FasterDecoding/Medusa format (vLLM, TGI), or as f16 or f32 selfspec heads;
    /// a draft layer as f32, f16 or q8 (8-bit blocks, a quarter of f32).
    ExportHeads {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long)]
        heads: PathBuf,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value = "medusa", value_parser = ["medusa", "f16", "f32", "q8"])]
        format: String,
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
        /// Also measure this machine's read bandwidth and arithmetic peaks (about a second and
        /// 1 GiB of memory, before each format) and print each forward's floor, max(bytes read /
        /// bandwidth, multiply-adds / peak), with the weights, KV cache and attention counted:
        /// how flat a cost curve this hardware allows at all
        #[arg(long)]
        roofline: bool,
    },
}

fn load(m: &ModelArgs) -> Result<Target> {
    let device = parse_device(&m.device)?;
    let weights = m.weights.unwrap_or(WeightFormat::F32);
    if weights != WeightFormat::F32 && !device.is_cpu() {
        bail!("--weights {weights} is a CPU format; on {} the model runs candle's f32 kernels", m.device);
    }
    let mut target = Target::load_with(&m.model, &device, weights)?;
    match m.kv_cache.as_deref() {
        Some("f32") => target.model.set_kv_dtype(candle_core::DType::F32)?,
        Some(_) => target.model.set_kv_dtype(candle_core::DType::F16)?,
        None => {}
    }
    Ok(target)
}

/// A progress bar on stderr, hidden when stderr is not a terminal.
fn progress(len: u64, what: &str) -> indicatif::ProgressBar {
    let bar = if std::io::stderr().is_terminal() { indicatif::ProgressBar::new(len) } else { indicatif::ProgressBar::hidden() };
    bar.set_style(indicatif::ProgressStyle::with_template(&format!("{what} {{bar:30}} {{pos}}/{{len}} {{elapsed}} eta {{eta}} {{msg}}")).unwrap());
    bar
}

fn print_eval(r: &EvalReport) {
    println!("tau = tokens emitted per target forward, the bonus token counted (plain decoding = 1.00); copied = of those, accepted tokens from the +lookup branch");
    println!("speed-up = median over turns of tok/s, each way; overall = all tokens / all decoding time, each way");
    println!("{:<24} {:>6} {:>6} {:>7} {:>11} {:>12} {:>9} {:>8} {:>10}", "tree", "nodes", "tau", "copied", "spec tok/s", "plain tok/s", "speed-up", "overall", "identical");
    for (name, s) in r.trees.iter().zip(&r.overall) {
        println!(
            "{:<24} {:>6.1} {:>6.2} {:>7.2} {:>11.1} {:>12.1} {:>8.2}x {:>7.2}x {:>10}",
            name,
            s.mean_tree_nodes,
            s.tau,
            s.copied_per_forward,
            s.spec_tok_s_median,
            s.plain_tok_s_median,
            s.speedup,
            s.speedup_total,
            s.all_identical.map_or("n/a", |b| if b { "yes" } else { "NO" })
        );
    }
    println!("per category ({}):", r.trees[0]);
    for (c, v) in &r.per_category {
        println!("  {:<12} turns {:>3}  tau {:.2}  speed-up {:.2}x", c, v[0].turns, v[0].tau, v[0].speedup);
    }
    if let Some(s) = r.overall.first() {
        let f = |v: &[f64]| v.iter().map(|x| format!("{x:.2}")).collect::<Vec<_>>().join(" ");
        println!("{} guesses from the root, top-1 per level vs the target's tokens: {}", r.drafter, f(&s.head_top1));
        println!("{} guesses from the root, top-5 per level vs the target's tokens: {}", r.drafter, f(&s.head_top5));
        println!("drafted tokens accepted per step (0, 1, 2, ...): {:?}", s.accept_hist);
    }
    println!("sample ({}; accepted draft tokens in [brackets]):\n{}", r.trees[0], r.sample_marked);
}

fn finish_stream(stream: &mut TextStream, stdout: &mut impl Write) -> Result<()> {
    if let Some(s) = stream.finish()? {
        stdout.write_all(s.as_bytes())?;
    }
    writeln!(stdout)?;
    stdout.flush()?;
    Ok(())
}

fn plain_summary(s: &GenStats) -> String {
    format!(
        "plain: prompt {} tokens, {} new tokens | prefill {:.1} tok/s | decode {:.1} tok/s",
        s.prompt_tokens,
        s.new_tokens,
        s.prefill_tok_s(),
        s.decode_tok_s()
    )
}

fn spec_summary(s: &SpecStats, lossy: bool) -> String {
    let steps = s.gen.target_forwards.max(1) as f64;
    format!(
        "self-speculative{}: prompt {} tokens, {} new tokens, {} target forwards | tau {:.2} tokens/forward (bonus token counted; plain = 1.00) | prefill {:.1} tok/s | decode {:.1} tok/s | per step: draft {:.2} ms, tree forward {:.2} ms, verify {:.2} ms, commit {:.2} ms{}",
        if lossy { " (LOSSY typical acceptance: output does not follow the target's distribution)" } else { "" },
        s.gen.prompt_tokens,
        s.gen.new_tokens,
        s.gen.target_forwards,
        s.tau(),
        s.gen.prefill_tok_s(),
        s.gen.decode_tok_s(),
        s.time.draft * 1e3 / steps,
        s.time.forward * 1e3 / steps,
        s.time.verify * 1e3 / steps,
        s.time.commit * 1e3 / steps,
        if s.lookup_nodes > 0 { format!(" | lookup: {} of {} copied tokens accepted", s.lookup_accepted, s.lookup_nodes) } else { String::new() },
    )
}

fn main() {
    keep_freed_pages_warm();
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Generate { model, prompt, chat, max_tokens, sampling, spec, compare } => {
            let params = sampling.params()?;
            if max_tokens == 0 {
                bail!("--max-tokens must be at least 1");
            }
            let plan = Plan::parse(&spec.tree)?;
            let target = load(&model)?;
            let heads = match &spec.heads {
                Some(dir) => Some(Drafter::from_dir_as(dir, &target, spec.draft_weights)?),
                None => None,
            };
            let ids = target.encode_prompt(&prompt, chat)?;
            let stop = StopRule { max_new_tokens: max_tokens, eos_ids: &target.tokenizer.eos_ids };
            let mut stream = TextStream::new(&target.tokenizer);
            let mut stdout = std::io::stdout().lock();
            let mut print = |t: u32| -> selfspec::Result<()> {
                if let Some(s) = stream.push(t)? {
                    let _ = stdout.write_all(s.as_bytes());
                    let _ = stdout.flush();
                }
                Ok(())
            };
            let mut r = rng(sampling.seed);
            match &heads {
                None => {
                    let (_, stats) = generate_plain(&target.model, &ids, &params, &stop, &mut r, &mut print)?;
                    finish_stream(&mut stream, &mut stdout)?;
                    eprintln!("{}", plain_summary(&stats));
                }
                Some(heads) => {
                    let rule = Rule::for_params(&params, spec.lossy_typical);
                    let ds = load_datastore(&target, &spec.datastore)?;
                    let opts = SpecOptions { tree: plan.tree, lookup: plan.lookup, datastore: ds.as_ref(), rule, params: params.clone(), stop };
                    let (spec_out, stats) = generate_spec(&target.model, heads, &ids, &opts, &mut r, &mut print)?;
                    finish_stream(&mut stream, &mut stdout)?;
                    eprintln!("{}", spec_summary(&stats, spec.lossy_typical));
                    if compare {
                        let stop = StopRule { max_new_tokens: max_tokens, eos_ids: &target.tokenizer.eos_ids };
                        let (plain_out, plain) = generate_plain(&target.model, &ids, &params, &stop, &mut rng(sampling.seed), &mut |_| Ok(()))?;
                        eprintln!("{}", plain_summary(&plain));
                        eprintln!(
                            "speed-up {:.2}x (self-speculative {:.1} tok/s vs plain {:.1} tok/s){}",
                            stats.gen.decode_tok_s() / plain.decode_tok_s(),
                            stats.gen.decode_tok_s(),
                            plain.decode_tok_s(),
                            if params.is_greedy() && !spec.lossy_typical {
                                if spec_out == plain_out { "; outputs identical" } else { "; OUTPUTS DIFFER" }
                            } else {
                                ""
                            }
                        );
                    }
                }
            }
        }
        Command::Distill { model, prompts, out, max_tokens, temperature, seed, batch } => {
            let params = SamplingParams { temperature, ..Default::default() };
            params.validate()?;
            if max_tokens == 0 {
                bail!("--max-tokens must be at least 1");
            }
            let items = selfspec::data::read_prompts(&prompts)?;
            let target = load(&model)?;
            let done = selfspec::distill::done_ids(&out)?;
            let (todo, seeds): (Vec<_>, Vec<u64>) =
                items.iter().enumerate().filter(|(_, i)| !done.contains(&i.id)).map(|(n, i)| (i.clone(), seed.wrapping_add(n as u64))).unzip();
            let bar = progress(todo.len() as u64, "distill");
            let t0 = std::time::Instant::now();
            let mut tokens = 0usize;
            selfspec::distill::answer_batch(&target, &todo, &seeds, &params, max_tokens, batch, &mut |rec| {
                tokens += rec.new_tokens;
                selfspec::distill::append_record(&out, &rec)?;
                bar.set_message(format!("{:.1} tok/s", tokens as f64 / t0.elapsed().as_secs_f64()));
                bar.inc(1);
                Ok(())
            })?;
            bar.finish_and_clear();
            eprintln!(
                "distill: {} answered now, {} already done, {} tokens in {:.0}s ({:.1} tok/s) -> {}",
                todo.len(),
                done.len(),
                tokens,
                t0.elapsed().as_secs_f64(),
                tokens as f64 / t0.elapsed().as_secs_f64().max(1e-9),
                out.display()
            );
        }
        Command::Train {
            model, data, out, heads, layers, own_lm_head, epochs, lr, seq_len, batch_tokens, loss, decay,
            val_fraction, warmup, checkpoint_every, seed, resume, cache_hidden, max_steps, draft_vocab, no_root_token,
            draft_layer, unroll, feature_weight, init, validate_only,
        } => {
            let cfg = TrainConfig {
                num_heads: heads,
                num_layers: layers,
                own_lm_head,
                epochs,
                lr,
                weight_decay: 0.0,
                warmup_steps: warmup,
                grad_clip: 1.0,
                seq_len,
                batch_tokens,
                loss: if loss == "hard" { LossKind::Hard } else { LossKind::Soft },
                decay,
                val_fraction,
                seed,
                checkpoint_every: checkpoint_every.max(1),
                max_steps,
                draft_vocab,
                token_aware: !no_root_token,
                draft_layer,
                unroll,
                feature_weight,
                init,
            };
            cfg.validate()?;
            let target = load(&model)?;
            let docs = selfspec::data::read_corpus(&data, &|m| target.render_conversation(m))?;
            let bar = progress(0, "train");
            let mut prog = |step: usize, total: usize, loss: f64, acc: &[f64], tps: f64| {
                bar.set_length(total as u64);
                bar.set_position(step as u64);
                let a: Vec<String> = acc.iter().map(|x| format!("{x:.2}")).collect();
                bar.set_message(format!("loss {loss:.3} acc [{}] {tps:.0} tok/s", a.join(" ")));
            };
            let quiet = !std::io::stderr().is_terminal();
            let mut log = |s: String| {
                if quiet { eprintln!("{s}") } else { bar.println(s) }
            };
            let t0 = std::time::Instant::now();
            if validate_only {
                bar.finish_and_clear();
                let v = if cfg.draft_layer {
                    selfspec::train_layer::held_out_layer_accuracy(&target, &docs, &cfg, cache_hidden.as_deref(), &mut |s| eprintln!("{s}"))?
                } else {
                    selfspec::train::held_out_accuracy(&target, &docs, &cfg, cache_hidden.as_deref(), &mut |s| eprintln!("{s}"))?
                };
                println!(
                    "{} in {}: held-out top-1 {:?} top-5 {:?} per {} over {} positions (vs the target's own greedy tokens), {:.0}s",
                    if cfg.draft_layer { "draft layer" } else { "heads" },
                    cfg.init.as_ref().expect("clap requires --init").display(),
                    fmt_acc(&v.top1),
                    fmt_acc(&v.top5),
                    if cfg.draft_layer { "level" } else { "head" },
                    v.positions,
                    t0.elapsed().as_secs_f64()
                );
                return Ok(());
            }
            let trained = if cfg.draft_layer {
                let (l, r) = selfspec::train_layer::train_layer(&target, &docs, &cfg, &out, resume, cache_hidden.as_deref(), &mut prog, &mut log)?;
                (Drafter::Layer(l), r)
            } else {
                let (h, r) = train(&target, &docs, &cfg, &out, resume, cache_hidden.as_deref(), &mut prog, &mut log)?;
                (Drafter::Heads(h), r)
            };
            let (trained, report) = trained;
            bar.finish_and_clear();
            if cfg.max_steps > 0 && report.steps == cfg.max_steps {
                eprintln!("stopped at step {} (--max-steps); continue with --resume", report.steps);
            }
            let recipe = serde_json::json!({
                "command": std::env::args().collect::<Vec<_>>().join(" "),
                "data": describe_inputs(&data),
                "config": cfg,
                "train_tokens": report.train_tokens,
                "val_tokens": report.val_tokens,
                "steps": report.steps,
                "final_loss": report.final_loss,
                "val_top1": report.val.last().map(|v| v.top1.clone()),
                "val_top5": report.val.last().map(|v| v.top5.clone()),
                "hidden_secs": report.hidden_secs,
                "train_secs": report.train_secs,
                "train_tokens_per_sec": report.train_tokens_per_sec,
                "wall_secs": t0.elapsed().as_secs_f64(),
            });
            match trained {
                Drafter::Heads(h) => h.with_recipe(recipe.clone()).save(&out)?,
                Drafter::Layer(l) => l.with_recipe(recipe.clone()).save_as(&out, StoreFormat::F32)?,
            }
            selfspec::error::write_atomic(&out.join("report.json"), serde_json::to_string_pretty(&recipe)?.as_bytes())?;
            let v = report.val.last().cloned().unwrap_or_default();
            eprintln!(
                "trained {}: {} steps, {} train tokens, loss {:.3}, {:.0} tok/s | held-out top-1 {:?} top-5 {:?} (vs the target's own greedy tokens) -> {}",
                if cfg.draft_layer { "a draft layer".to_string() } else { format!("{} heads", cfg.num_heads) },
                report.steps,
                report.train_tokens,
                report.final_loss,
                report.train_tokens_per_sec,
                v.top1.iter().map(|x| format!("{x:.3}")).collect::<Vec<_>>(),
                v.top5.iter().map(|x| format!("{x:.3}")).collect::<Vec<_>>(),
                out.display()
            );
        }
        Command::Eval { model, heads, prompts, tree, temperature, max_tokens, limit, out, seed, datastore, draft_weights } => {
            let params = SamplingParams { temperature, ..Default::default() };
            params.validate()?;
            if max_tokens == 0 {
                bail!("--max-tokens must be at least 1");
            }
            let trees = tree.iter().map(|t| Ok((t.clone(), Plan::parse(t)?))).collect::<Result<Vec<_>>>()?;
            let mut items = selfspec::data::read_prompts(&prompts)?;
            if let Some(n) = limit {
                items.truncate(n.max(1));
            }
            let target = load(&model)?;
            let h = Drafter::from_dir_as(&heads, &target, draft_weights)?;
            for (_, p) in &trees {
                p.tree.validate_for(&h)?;
            }
            let bar = progress(items.iter().map(|i| i.turns.len() as u64).sum(), "eval");
            let mut prog = |done: usize, _total: usize| bar.set_position(done as u64);
            let ds = load_datastore(&target, &datastore)?;
            let mut opts = EvalOptions { trees, params, max_tokens, seed, datastore: ds.as_ref(), progress: &mut prog };
            let mut report = evaluate(&target, &h, &items, &mut opts)?;
            bar.finish_and_clear();
            report.heads = heads.display().to_string();
            print_eval(&report);
            if let Some(prefix) = out {
                let with = |ext: &str| PathBuf::from(format!("{}.{ext}", prefix.display()));
                selfspec::error::write_atomic(&with("json"), serde_json::to_string_pretty(&report)?.as_bytes())?;
                selfspec::error::write_atomic(&with("md"), to_markdown(&report).as_bytes())?;
                selfspec::error::write_atomic(&with("svg"), to_svg(&report).as_bytes())?;
                eprintln!("wrote {0}.json, {0}.md, {0}.svg", prefix.display());
            }
        }
        Command::Tune { model, heads, prompts, out, max_nodes, max_tokens, check_prompts, datastore, draft_weights } => {
            if max_nodes < 2 {
                bail!("--max-nodes must be at least 2");
            }
            let items = selfspec::data::read_prompts(&prompts)?;
            let target = load(&model)?;
            let h = Drafter::from_dir_as(&heads, &target, draft_weights)?;
            eprintln!("measuring {} accuracy on {} prompts...", h.kind(), items.len());
            let acc = rank_accuracy(&target, &h, &items, max_tokens, 8)?;
            for (k, row) in acc.iter().enumerate() {
                let r: Vec<String> = row.iter().map(|x| format!("{x:.3}")).collect();
                eprintln!("  level {} rank accuracy: {}", k + 1, r.join(" "));
            }
            eprintln!("measuring forward cost for 1..{max_nodes} tokens...");
            let counts: Vec<usize> = (1..=max_nodes).collect();
            let costs = selfspec::bench::bench_forward(&target.model, 256, &counts, 3)?;
            let cost_ms: Vec<f64> = costs.iter().map(|r| r.median_ms).collect();
            let draft_ms = h.draft_cost_ms(&target.model)?;
            let (best, points) = choose_tree(&acc, &cost_ms, draft_ms, max_nodes);
            println!("{:>5} {:>12} {:>10} {:>17}", "nodes", "expected tau", "cost/plain", "expected speed-up");
            for p in &points {
                println!("{:>5} {:>12.2} {:>10.2} {:>16.2}x{}", p.nodes, p.expected_tau, p.cost_ratio, p.expected_speedup, if p.nodes == best.len() { "  <- chosen" } else { "" });
            }
            let mut doc = serde_json::json!({
                "paths": serde_json::from_str::<serde_json::Value>(&best.to_json())?["paths"],
                "expected": points.iter().find(|p| p.nodes == best.len()),
                "rank_accuracy": acc,
                "forward_ms": cost_ms,
                "draft_ms": {"per_step": draft_ms.0, "per_extra_level": draft_ms.1},
                "lookup": null,
                "note": "tau = tokens per target forward, bonus token counted",
            });
            selfspec::error::write_atomic(&out, serde_json::to_string_pretty(&doc)?.as_bytes())?;
            // The context lookup's worth depends on how often the text repeats itself and on what
            // extra nodes cost here, so it is measured, with and without, in the same run.
            let check: Vec<_> = items.iter().take(check_prompts.max(1)).cloned().collect();
            eprintln!("wrote {} ({} nodes); checking it with and without +lookup on {} prompts...", out.display(), best.len(), check.len());
            // Short and long copied branches: extra nodes cost more with fast weights.
            let lookups = [None, Some(3), Some(6)];
            let mut plans: Vec<(String, Plan)> = lookups
                .iter()
                .map(|n| {
                    let lookup = n.map(|max_tokens| selfspec::lookup::Lookup { max_tokens, ..Default::default() });
                    let name = n.map_or("tuned".to_string(), |n| format!("tuned+lookup:{n}"));
                    (name, Plan { tree: TreeChoice::Static(best.clone()), lookup })
                })
                .collect();
            // The default tree, cut per step by this device's costs, for comparison: a static
            // tree is worth keeping only if it beats it.
            plans.push((DEFAULT_TREE.to_string(), Plan::parse(DEFAULT_TREE)?));
            let ds = load_datastore(&target, &datastore)?;
            let mut opts = EvalOptions { trees: plans, params: SamplingParams::greedy(), max_tokens, seed: 1, datastore: ds.as_ref(), progress: &mut |_, _| {} };
            let report = evaluate(&target, &h, &check, &mut opts)?;
            for (name, s) in report.trees.iter().zip(&report.overall) {
                println!("measured {name}: tau {:.2} tokens/forward (bonus counted), speed-up {:.2}x ({:.1} vs {:.1} tok/s)", s.tau, s.speedup, s.spec_tok_s_median, s.plain_tok_s_median);
            }
            let fastest = (0..lookups.len()).max_by(|&a, &b| report.overall[a].speedup.total_cmp(&report.overall[b].speedup)).unwrap_or(0);
            if let Some(auto) = report.overall.get(lookups.len()) {
                if auto.speedup > report.overall[fastest].speedup {
                    println!("the default tree ({DEFAULT_TREE}, no tree file needed) measured faster than the tuned tree here");
                }
            }
            if let Some(n) = lookups[fastest] {
                doc["lookup"] = serde_json::json!(n);
                selfspec::error::write_atomic(&out, serde_json::to_string_pretty(&doc)?.as_bytes())?;
                println!("kept +lookup:{n} in {} (`--tree {}` uses it)", out.display(), out.display());
            }
        }
        Command::ExportHeads { model, heads, out, format } => {
            let target = load(&model)?;
            match Drafter::from_dir(&heads, &target)? {
                Drafter::Heads(h) => {
                    match format.as_str() {
                        "medusa" => h.export_medusa(&out, &target)?,
                        "q8" => bail!("{}: q8 storage is for draft layers; store heads as f16 or f32", heads.display()),
                        f => h.save_as(&out, f == "f16")?,
                    }
                    eprintln!("wrote {} heads ({format}) to {}", h.num_heads(), out.display());
                }
                Drafter::Layer(l) => {
                    if format == "medusa" {
                        bail!("{}: a draft layer has no Medusa-format equivalent (Medusa heads read one hidden state; the layer attends over the prefix)", heads.display());
                    }
                    let store = match format.as_str() {
                        "f32" => StoreFormat::F32,
                        "f16" => StoreFormat::F16,
                        _ => StoreFormat::Q8,
                    };
                    l.save_as(&out, store)?;
                    eprintln!("wrote the draft layer ({format}) to {}", out.display());
                }
            }
        }
        Command::Bench { model, context, tokens, reps, json, roofline } => {
            if tokens.is_empty() || tokens.contains(&0) {
                bail!("--tokens needs positive counts");
            }
            let mut target = load(&ModelArgs { weights: Some(WeightFormat::F32), ..model.clone() })?;
            let formats: Vec<WeightFormat> = match model.weights {
                Some(w) => vec![w],
                None if target.model.device().is_cpu() => WeightFormat::ALL.to_vec(),
                None => vec![WeightFormat::F32],
            };
            if roofline && !target.model.device().is_cpu() {
                bail!("--roofline measures the CPU; on {} it would say nothing about the forward", model.device);
            }
            let mut all = Vec::new();
            for f in formats {
                target.set_weights(f)?;
                // Measured again for each format, just before its forwards: a shared host's
                // bandwidth and arithmetic move by a quarter from one minute to the next.
                let roof = roofline.then(selfspec::roofline::Roofline::measure);
                if let (Some(r), false) = (&roof, json) {
                    println!(
                        "roofline ({} threads, {}): read {:.1} GB/s, f32 {:.0} GMAC/s, int8 {:.0} GMAC/s (best of a few runs; the floors count weights, KV cache and attention, and assume reads and arithmetic overlap perfectly)",
                        r.threads,
                        r.isa,
                        r.read_bytes_per_s / 1e9,
                        r.f32_macs_per_s / 1e9,
                        r.int8_macs_per_s / 1e9
                    );
                }
                let rows = selfspec::bench::bench_forward(&target.model, context, &tokens, reps.max(1)).context("benchmark failed")?;
                let bytes = target.model.weight_bytes_per_forward();
                // Each row's floor, and the floor of the row the ratios divide by (T = 1 where
                // it was timed, else the first).
                let base = if tokens.contains(&1) { 1 } else { tokens[0] };
                let floors: Option<(Vec<f64>, f64)> = roof.map(|r| (r.floors_ms(&target.model, context, &tokens), r.floors_ms(&target.model, context, &[base])[0]));
                all.push(serde_json::json!({"weights": f.name(), "weight_bytes": bytes, "rows": rows, "floor_ms": floors.as_ref().map(|f| &f.0), "roofline": roof}));
                if !json {
                    let (bw, measured) = roof.map_or((selfspec::bench::DRAM_BYTES_PER_S, ""), |r| (r.read_bytes_per_s, " measured"));
                    println!(
                        "weights {f}: {:.0} MB of weights read per forward (their floor at{measured} {:.1} GB/s: {:.1} ms); {context}-token context, {:?} KV cache, {}{}",
                        bytes as f64 / 1e6,
                        bw / 1e9,
                        bytes as f64 / bw * 1e3,
                        target.model.kv_dtype(),
                        model.device,
                        if target.model.device().is_cpu() { format!(" ({} kernels)", selfspec::kernels::cpu_kernels()) } else { String::new() }
                    );
                    match &floors {
                        None => {
                            println!("{:>6} {:>10} {:>8} {:>8}", "tokens", "median ms", "ratio", "min ms");
                            for r in &rows {
                                println!("{:>6} {:>10.2} {:>8.2} {:>8.2}", r.tokens, r.median_ms, r.ratio, r.min_ms);
                            }
                        }
                        Some((fl, f1)) => {
                            // floor ratio: the flattest curve the hardware allows (floor(T) /
                            // floor(1)); of floor: how much of this row's time the floor is.
                            println!("{:>6} {:>10} {:>8} {:>8} {:>9} {:>12} {:>9}", "tokens", "median ms", "ratio", "min ms", "floor ms", "floor ratio", "of floor");
                            for (r, fl) in rows.iter().zip(fl) {
                                println!("{:>6} {:>10.2} {:>8.2} {:>8.2} {:>9.2} {:>12.2} {:>8.0}%", r.tokens, r.median_ms, r.ratio, r.min_ms, fl, fl / f1, 100.0 * fl / r.median_ms);
                            }
                        }
                    }
                }
            }
            if json {
                println!("{}", serde_json::to_string_pretty(&all)?);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The option number is hard-coded from mimalloc's header; a mimalloc that renumbered its
    /// options would make us set some other option. Option 15 must read as the purge delay's
    /// default in mimalloc 3 (1000 ms) before we set it, and as "never" after.
    #[test]
    fn purge_delay_option_is_the_one_we_set() {
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
            return;
        }
        // SAFETY: reads and sets one integer option.
        unsafe {
            assert_eq!(mi_option_get(MI_OPTION_PURGE_DELAY), 1000);
        }
        keep_freed_pages_warm();
        unsafe {
            assert_eq!(mi_option_get(MI_OPTION_PURGE_DELAY), -1);
        }
    }
}

fn fmt_acc(v: &[f64]) -> Vec<String> {
    v.iter().map(|x| format!("{x:.3}")).collect()
}

/// The `--datastore` files indexed for copying, if any were named.
fn load_datastore(target: &Target, paths: &[PathBuf]) -> Result<Option<selfspec::datastore::Datastore>> {
    if paths.is_empty() {
        return Ok(None);
    }
    let t0 = std::time::Instant::now();
    let ds = selfspec::datastore::Datastore::from_corpus(target, paths)?;
    eprintln!("datastore: {} tokens indexed in {:.1}s", ds.len(), t0.elapsed().as_secs_f64());
    Ok(Some(ds))
}
