//! The `selfspec` command line: one file per subcommand, each parsing its flags, calling one
//! library function and printing. Flags shared by several subcommands live in [`args`].
pub mod args;
pub mod bench;
pub mod chat;
pub mod distill;
pub mod eval;
pub mod export;
pub mod generate;
pub mod perplexity;
pub mod serve;
pub mod train;
pub mod tune;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "selfspec", version, about = "Self-speculative decoding: a drafter reads the target's own hidden states, one target forward verifies its token tree exactly")]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Threads for the CPU kernels and training (as llama.cpp's `-t`; sets RAYON_NUM_THREADS).
    /// Default: RAYON_NUM_THREADS if set, else every core.
    #[arg(long, global = true, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub threads: Option<u16>,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt (plain decoding, or self-speculative with --drafter).
    Generate(generate::GenerateArgs),
    /// An interactive conversation (llama-cli's conversation mode): each turn decoded from the
    /// last turn's cache, self-speculatively with --drafter.
    Chat(chat::ChatArgs),
    /// Self-distillation: the target answers each prompt through its chat template (as plain
    /// text for a base model without one); one JSONL
    /// record per answer, appended as soon as it is done (a killed run resumes).
    Distill(distill::DistillArgs),
    /// Train a drafter (Medusa-style heads or an EAGLE-style draft layer) with the target frozen.
    Train(train::TrainArgs),
    /// τ, per-level accuracy and speed-up against plain decoding, measured in one run.
    Eval(eval::EvalArgs),
    /// Measure the drafter's accuracy and this device's forward costs; write the tree that
    /// maximises expected speed-up.
    Tune(tune::TuneArgs),
    /// Re-save a drafter: heads in the Medusa layout (FasterDecoding/TGI or vLLM) or as f16/f32;
    /// a draft layer as f32, f16, q8, q4 or an EAGLE-3 checkpoint (SpecForge/vLLM).
    #[command(alias = "export-heads")]
    Export(export::ExportArgs),
    /// Time one forward over T new tokens after a context, for each T and weight format.
    Bench(bench::BenchArgs),
    /// The target's perplexity over a text file, scored as llama.cpp's llama-perplexity scores
    /// it: a check that a weight format keeps the model's quality.
    Perplexity(perplexity::PerplexityArgs),
    /// An OpenAI-compatible HTTP server (chat and completions, streaming, /metrics, a page at
    /// /) that decodes all its requests together, each with self-speculation when --drafter.
    Serve(serve::ServeArgs),
}

/// Run the subcommand the command line names.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Chat(a) => chat::run(a),
        Command::Distill(a) => distill::run(a),
        Command::Train(a) => train::run(a),
        Command::Eval(a) => eval::run(a),
        Command::Tune(a) => tune::run(a),
        Command::Export(a) => export::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Perplexity(a) => perplexity::run(a),
        Command::Serve(a) => serve::run(a),
    }
}
