//! `selfspec train`: train Medusa-style heads or an EAGLE-style draft layer on a corpus.
use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use selfspec::train::recipe::{train_drafter, validate_drafter, TrainRun};
use selfspec::train::{LossKind, TrainConfig};

use crate::cli::args::{fmt_acc, progress, ModelArgs, DEFAULT_SEED};

#[derive(Args)]
pub struct TrainArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Text files, directories of text files, distill JSONL (rendered through the chat
    /// template), or a corpus manifest (training/corpus.toml: every set's answers).
    #[arg(long, num_args = 1.., required = true)]
    data: Vec<PathBuf>,
    /// Output directory: the drafter (heads.json + heads.safetensors, or draft.json +
    /// draft.safetensors), report.json, checkpoints.
    #[arg(long)]
    out: PathBuf,
    /// Medusa heads: how many (head k guesses token t+k+2).
    #[arg(long, alias = "heads", default_value_t = 4)]
    num_heads: usize,
    /// Residual blocks per head.
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
    #[arg(long, default_value_t = DEFAULT_SEED)]
    seed: u64,
    /// Continue a killed run from its last checkpoint in --out.
    #[arg(long)]
    resume: bool,
    /// Keep the backbone's hidden states here, so later runs and epochs cost only the drafter.
    #[arg(long)]
    cache_hidden: Option<PathBuf>,
    /// Stop after this many steps (0: no limit; the checkpoint stays, --resume continues).
    #[arg(long, default_value_t = 0)]
    max_steps: usize,
    /// Draft from the N most frequent corpus tokens (FR-Spec style; 0 = full vocabulary).
    /// Cheaper to train and to run; verification still uses the full vocabulary.
    #[arg(long, default_value_t = 8192)]
    draft_vocab: usize,
    /// Plain Medusa heads that do not read the root token's embedding (exportable as
    /// medusa-vllm; with --draft-vocab 0 also as FasterDecoding's medusa).
    #[arg(long)]
    no_root_token: bool,
    /// Train an EAGLE-style draft layer (one decoder layer over the target's features,
    /// drafting autoregressively) instead of Medusa heads; --out then gets draft.json and
    /// draft.safetensors.
    #[arg(long)]
    draft_layer: bool,
    /// Draft layer: steps of training-time test (each row also drafts this many tokens ahead
    /// from its own predictions, as at inference).
    #[arg(long, default_value_t = 1)]
    unroll: usize,
    /// Draft layer: weight of the feature-regression loss next to the token loss (EAGLE uses 1).
    #[arg(long, default_value_t = 0.0)]
    feature_weight: f64,
    /// Draft layer in EAGLE-3's layout: it reads a low, a middle and a high layer of the target
    /// and has its own lm_head; `export --format eagle3` then writes it for vLLM, SGLang and
    /// llama.cpp.
    #[arg(long, requires = "draft_layer")]
    eagle3: bool,
    /// EAGLE-3: the target layers whose inputs it reads, e.g. 2,15,27 (default: 2, n/2, n-3 of
    /// the target's n layers, as vLLM and llama.cpp assume).
    #[arg(long, value_delimiter = ',', requires = "eagle3")]
    feature_layers: Vec<usize>,
    /// Train nothing: print the held-out accuracy of the drafter in --init on the chunks this
    /// run's data, --seq-len, --seed, --val-fraction and --num-heads/--unroll hold out (hidden
    /// states of those chunks only), to compare drafters on one validation set.
    #[arg(long, requires = "init")]
    validate_only: bool,
    /// Start from the drafter in this directory (same kind and shape; its draft vocabulary is
    /// kept) instead of fresh weights: fine-tune on new data, or train more epochs.
    #[arg(long)]
    init: Option<PathBuf>,
    /// Split each batch into N groups whose gradients are computed side by side, one thread
    /// each, and summed. The numbers depend on N (not on the thread count), so resume with the
    /// same N; 1 is the single-pass training of earlier versions.
    #[arg(long, default_value_t = 2)]
    grad_groups: usize,
    /// With --init (a draft layer): grow its draft vocabulary to N tokens, adding this data's
    /// most frequent tokens it lacks, so new data brings its words along. An EAGLE layer reads
    /// them through the target's own lm_head rows (no new weights); an EAGLE-3 layer's head gets
    /// the target's rows for them to start from.
    #[arg(long, value_name = "N", requires = "init", conflicts_with = "validate_only")]
    widen_vocab: Option<usize>,
}

impl TrainArgs {
    fn config(&self) -> TrainConfig {
        TrainConfig {
            num_heads: self.num_heads,
            num_layers: self.layers,
            own_lm_head: self.own_lm_head,
            epochs: self.epochs,
            lr: self.lr,
            weight_decay: 0.0,
            warmup_steps: self.warmup,
            grad_clip: 1.0,
            seq_len: self.seq_len,
            batch_tokens: self.batch_tokens,
            loss: if self.loss == "hard" { LossKind::Hard } else { LossKind::Soft },
            decay: self.decay,
            val_fraction: self.val_fraction,
            seed: self.seed,
            checkpoint_every: self.checkpoint_every.max(1),
            max_steps: self.max_steps,
            draft_vocab: self.draft_vocab,
            token_aware: !self.no_root_token,
            draft_layer: self.draft_layer,
            unroll: self.unroll,
            feature_weight: self.feature_weight,
            eagle3: self.eagle3,
            feature_layers: self.feature_layers.clone(),
            init: self.init.clone(),
            grad_groups: self.grad_groups,
            widen_vocab: self.widen_vocab.unwrap_or(0),
        }
    }
}

pub fn run(a: TrainArgs) -> Result<()> {
    // Before any candle op and while this process has no other thread: the gradient groups
    // run side by side, and candle's own element-wise pool would only queue them behind its lock.
    selfspec::train::parallel::single_threaded_candle_ops();
    let cfg = a.config();
    cfg.validate()?;
    // Paths first: these used to be found missing only after the model load (or the target's
    // hidden states, for --init).
    for d in &a.data {
        if !d.exists() {
            anyhow::bail!("--data {}: no such file or directory", d.display());
        }
    }
    if let Some(i) = &a.init {
        if !i.is_dir() {
            anyhow::bail!("--init {}: not a drafter directory", i.display());
        }
    }
    if !a.validate_only {
        selfspec::files::check_writable_dir(&a.out)?;
    }
    // f32 unless asked: the reference states the recipes that rely on the default recorded.
    let mut target = a.model.load_as(a.model.weights.unwrap_or(selfspec::WeightFormat::F32))?;
    let docs = selfspec::data::read_corpus(&a.data, &|m| target.render_conversation(m))?;
    let kind = if cfg.draft_layer { "a draft layer".to_string() } else { format!("{} heads", cfg.num_heads) };
    if a.validate_only {
        let t0 = std::time::Instant::now();
        let v = validate_drafter(&mut target, &docs, &cfg, a.cache_hidden.as_deref(), &mut |s| eprintln!("{s}"))?;
        let init = a.init.as_ref().map(|p| p.display().to_string()).unwrap_or_default();
        let per = if cfg.draft_layer { "level" } else { "head" };
        println!(
            "{kind} in {init}: held-out top-1 {:?} top-5 {:?} per {per} over {} positions (vs the target's own greedy tokens); estimated τ (bonus token counted) chain {:.2}, tree {:?} {:.2}; {:.0}s",
            fmt_acc(&v.top1),
            fmt_acc(&v.top5),
            v.positions,
            v.tau_chain,
            selfspec::train::heads::TREE_WIDTHS,
            v.tau_tree,
            t0.elapsed().as_secs_f64()
        );
        return Ok(());
    }
    let bar = progress(0, "train");
    let mut prog = |step: usize, total: usize, loss: f64, acc: &[f64], tps: f64| {
        bar.set_length(total as u64);
        bar.set_position(step as u64);
        let a: Vec<String> = acc.iter().map(|x| format!("{x:.2}")).collect();
        bar.set_message(format!("loss {loss:.3} acc [{}] {tps:.0} tok/s", a.join(" ")));
    };
    let quiet = !std::io::stderr().is_terminal();
    let mut log = |s: String| if quiet { eprintln!("{s}") } else { bar.println(s) };
    let run = TrainRun { data: &a.data, out: &a.out, resume: a.resume, cache_hidden: a.cache_hidden.as_deref(), command: std::env::args().collect::<Vec<_>>().join(" ") };
    let (_, report, _) = train_drafter(&mut target, &docs, &cfg, &run, &mut prog, &mut log)?;
    bar.finish_and_clear();
    if cfg.max_steps > 0 && report.steps == cfg.max_steps {
        eprintln!("stopped at step {} (--max-steps); continue with --resume", report.steps);
    }
    let v = report.val.last().cloned().unwrap_or_default();
    eprintln!(
        "trained {kind}: {} steps, {} train tokens, loss {:.3}, {:.0} tok/s | held-out top-1 {:?} top-5 {:?} (vs the target's own greedy tokens), estimated τ (bonus token counted) chain {:.2}, tree {:?} {:.2} -> {}",
        report.steps,
        report.train_tokens,
        report.final_loss,
        report.train_tokens_per_sec,
        fmt_acc(&v.top1),
        fmt_acc(&v.top5),
        v.tau_chain,
        selfspec::train::heads::TREE_WIDTHS,
        v.tau_tree,
        a.out.display()
    );
    Ok(())
}
