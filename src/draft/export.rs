//! Re-saving a drafter: heads in the FasterDecoding/Medusa format or as f16/f32 selfspec heads, a
//! draft layer as f32, f16 or 8-bit blocks.
use std::path::Path;
use std::str::FromStr;

use crate::draft::drafter::Drafter;
use crate::draft::layer::StoreFormat;
use crate::model::loader::Target;
use crate::{Error, Result};

/// The formats `export` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportFormat {
    /// FasterDecoding/Medusa's layout (TGI reads it; heads only, full vocabulary, no
    /// root-token input).
    Medusa,
    /// vLLM's Medusa layout (`MedusaModel`: `blocks.*`, `lm_heads.*`, a reduced vocabulary as
    /// `token_map`; no root-token input).
    MedusaVllm,
    F16,
    F32,
    /// 8-bit blocks, a quarter of f32 (draft layers only).
    Q8,
    /// 4-bit blocks (Q4_1), about a sixth of f32: what native drafting reads (draft layers only).
    Q4,
    /// An EAGLE-3 layer as SpecForge and vLLM write it and llama.cpp converts it
    /// ([`crate::draft::eagle3`]).
    Eagle3,
}

impl FromStr for ExportFormat {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "medusa" => ExportFormat::Medusa,
            "medusa-vllm" => ExportFormat::MedusaVllm,
            "f16" => ExportFormat::F16,
            "f32" => ExportFormat::F32,
            "q8" => ExportFormat::Q8,
            "q4" => ExportFormat::Q4,
            "eagle3" => ExportFormat::Eagle3,
            _ => return Err(Error::InvalidArgument(format!("unknown export format '{s}' (medusa, medusa-vllm, eagle3, f16, f32, q8, q4)"))),
        })
    }
}

/// Write `drafter` (loaded from `from`, named in errors) to `out` in `format`; returns what was
/// written, for the summary line.
pub fn export(drafter: &Drafter, from: &Path, target: &Target, out: &Path, format: ExportFormat) -> Result<String> {
    match (drafter, format) {
        (Drafter::Heads(h), ExportFormat::Medusa) => h.export_medusa(out, target)?,
        (Drafter::Heads(h), ExportFormat::MedusaVllm) => h.export_medusa_vllm(out, target)?,
        (Drafter::Layer(_), ExportFormat::MedusaVllm) => return Err(Error::bad_file(from, "a draft layer has no Medusa-format equivalent (Medusa heads read one hidden state; the layer attends over the prefix); an EAGLE-3 layer exports as eagle3")),
        (Drafter::Heads(_), ExportFormat::Eagle3) => return Err(Error::bad_file(from, "Medusa heads have no EAGLE-3 form (train --draft-layer --eagle3)")),
        (Drafter::Layer(l), ExportFormat::Eagle3) => crate::draft::eagle3::export(l, target, out).map_err(|e| Error::bad_file(from, e.to_string()))?,
        (Drafter::Heads(_), ExportFormat::Q8 | ExportFormat::Q4) => return Err(Error::bad_file(from, "q8 and q4 storage are for draft layers; store heads as f16 or f32")),
        (Drafter::Heads(h), f) => h.save_as(out, f == ExportFormat::F16)?,
        (Drafter::Layer(_), ExportFormat::Medusa) => {
            return Err(Error::bad_file(from, "a draft layer has no Medusa-format equivalent (Medusa heads read one hidden state; the layer attends over the prefix)"))
        }
        (Drafter::Layer(l), f) => {
            let store = match f {
                ExportFormat::F32 => StoreFormat::F32,
                ExportFormat::F16 => StoreFormat::F16,
                ExportFormat::Q4 => StoreFormat::Q4,
                _ => StoreFormat::Q8,
            };
            l.save_as(out, store)?
        }
    }
    Ok(match drafter {
        Drafter::Heads(h) => format!("{} heads", h.num_heads()),
        Drafter::Layer(_) => "the draft layer".to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_parse_and_unknown_ones_are_named() {
        assert_eq!("medusa".parse::<ExportFormat>().unwrap(), ExportFormat::Medusa);
        assert_eq!("q8".parse::<ExportFormat>().unwrap(), ExportFormat::Q8);
        assert_eq!("q4".parse::<ExportFormat>().unwrap(), ExportFormat::Q4);
        let e = "gguf".parse::<ExportFormat>().unwrap_err().to_string();
        assert!(e.contains("gguf") && e.contains("medusa"), "{e}");
    }
}
