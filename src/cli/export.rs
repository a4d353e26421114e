//! `selfspec export`: re-save a drafter in another format.
use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use selfspec::draft::drafter::Drafter;
use selfspec::draft::export::{export, ExportFormat};

use crate::cli::args::ModelArgs;

#[derive(Args)]
pub struct ExportArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The drafter directory to re-save.
    #[arg(long, alias = "heads", value_name = "DIR")]
    drafter: PathBuf,
    #[arg(long)]
    out: PathBuf,
    /// medusa (FasterDecoding/Medusa layout, as TGI reads it; heads only), medusa-vllm
    /// (vLLM's Medusa layout; heads only), eagle3 (an EAGLE-3 layer as
    /// SpecForge/vLLM write it and llama.cpp converts it), f16 or f32 (selfspec heads or draft
    /// layer), q8 (a draft layer in 8-bit blocks, a quarter of f32), q4 (a draft layer in the
    /// 4-bit blocks native drafting reads, a sixth of f32).
    #[arg(long, default_value = "medusa", value_parser = ["medusa", "medusa-vllm", "eagle3", "f16", "f32", "q8", "q4"])]
    format: String,
}

pub fn run(a: ExportArgs) -> Result<()> {
    let format: ExportFormat = a.format.parse()?;
    if !a.drafter.is_dir() {
        anyhow::bail!("--drafter {}: not a drafter directory", a.drafter.display());
    }
    // Writing over the drafter being read would leave it half one format, half the other.
    if let (Ok(from), Ok(to)) = (a.drafter.canonicalize(), a.out.canonicalize()) {
        if from == to {
            anyhow::bail!("--out {} is the --drafter directory itself; export to another directory", a.out.display());
        }
    }
    selfspec::files::check_writable_dir(&a.out)?;
    let target = a.model.load()?;
    let drafter = Drafter::from_dir(&a.drafter, &target)?;
    let what = export(&drafter, &a.drafter, &target, &a.out, format)?;
    eprintln!("wrote {what} ({}) to {}", a.format, a.out.display());
    Ok(())
}
