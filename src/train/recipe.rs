//! One training run end to end, as `selfspec train` does it: train the drafter the config asks
//! for, then save it beside its recipe (the command, the data, the config and the results), so a
//! drafter directory always says how it was made.
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::data::Document;
use crate::draft::drafter::Drafter;
use crate::draft::layer::StoreFormat;
use crate::files::write_atomic;
use crate::model::loader::Target;
use crate::train::heads::{describe_inputs, held_out_accuracy, train, HeadAccuracy, Progress, TrainConfig, TrainReport};
use crate::train::layer::train_layer;
use crate::{Error, Result};

/// Where a run reads and writes, besides its [`TrainConfig`].
pub struct TrainRun<'a> {
    /// The `--data` inputs as given (recorded in the recipe).
    pub data: &'a [PathBuf],
    /// The drafter directory: weights, config with the recipe, `report.json`, checkpoints.
    pub out: &'a Path,
    /// Continue from the last checkpoint in `out`.
    pub resume: bool,
    /// Keep the backbone's hidden states here between runs.
    pub cache_hidden: Option<&'a Path>,
    /// The command line, recorded in the recipe.
    pub command: String,
}

/// Train the drafter `cfg` describes (heads, or a draft layer when `cfg.draft_layer`), save it
/// to `run.out` in f32 with its recipe, and write `report.json` there (atomically).
pub fn train_drafter(target: &mut Target, docs: &[Document], cfg: &TrainConfig, run: &TrainRun, progress: Progress, log: &mut dyn FnMut(String)) -> Result<(Drafter, TrainReport, serde_json::Value)> {
    let t0 = Instant::now();
    // An EAGLE-3 run reads tapped layers from every forward of the target: the ones named, or
    // those of the layer it starts from (--init), or the default ones.
    let mut cfg = cfg.clone();
    if let (true, true, Some(init)) = (cfg.eagle3, cfg.feature_layers.is_empty(), &cfg.init) {
        cfg.feature_layers = crate::draft::drafter::load_layer(init, target)?.feature_layers().to_vec();
    }
    let cfg = &cfg;
    target.model.set_feature_layers(&cfg.feature_layers_for(target.model.config().num_layers))?;
    let target = &*target;
    let (trained, report) = if cfg.draft_layer {
        let (l, r) = train_layer(target, docs, cfg, run.out, run.resume, run.cache_hidden, progress, log)?;
        (Drafter::Layer(l), r)
    } else {
        let (h, r) = train(target, docs, cfg, run.out, run.resume, run.cache_hidden, progress, log)?;
        (Drafter::Heads(h), r)
    };
    let recipe = recipe(cfg, run, &report, t0.elapsed().as_secs_f64());
    let trained = match trained {
        Drafter::Heads(h) => {
            let h = h.with_recipe(recipe.clone());
            h.save(run.out)?;
            Drafter::Heads(h)
        }
        Drafter::Layer(l) => {
            let l = l.with_recipe(recipe.clone());
            l.save_as(run.out, StoreFormat::F32)?;
            Drafter::Layer(l)
        }
    };
    let json = serde_json::to_string_pretty(&recipe).map_err(|e| Error::InvalidArgument(e.to_string()))?;
    write_atomic(&run.out.join("report.json"), json.as_bytes())?;
    Ok((trained, report, recipe))
}

/// The record saved with a trained drafter.
pub fn recipe(cfg: &TrainConfig, run: &TrainRun, report: &TrainReport, wall_secs: f64) -> serde_json::Value {
    serde_json::json!({
        "command": run.command,
        "data": describe_inputs(run.data),
        "config": cfg,
        "train_tokens": report.train_tokens,
        "val_tokens": report.val_tokens,
        "steps": report.steps,
        "final_loss": report.final_loss,
        "val_top1": report.val.last().map(|v| v.top1.clone()),
        "val_top5": report.val.last().map(|v| v.top5.clone()),
        // Estimated from held-out acceptance runs; τ counts the bonus token.
        "val_tau_chain": report.val.last().map(|v| v.tau_chain),
        "val_tau_tree": report.val.last().map(|v| v.tau_tree),
        "hidden_secs": report.hidden_secs,
        "train_secs": report.train_secs,
        "train_tokens_per_sec": report.train_tokens_per_sec,
        "wall_secs": wall_secs,
    })
}

/// Train nothing: the held-out accuracy of the drafter in `cfg.init` on the chunks this data
/// and config hold out, so drafters can be compared on one validation set.
pub fn validate_drafter(target: &mut Target, docs: &[Document], cfg: &TrainConfig, cache_hidden: Option<&Path>, log: &mut dyn FnMut(String)) -> Result<HeadAccuracy> {
    let Some(init) = &cfg.init else {
        return Err(Error::InvalidArgument("validating needs --init DIR: the drafter to validate".into()));
    };
    if cfg.draft_layer {
        // The layer in --init says which target layers it reads: attach them, then measure it.
        let layer = crate::draft::drafter::load_layer(init, target)?;
        target.model.set_feature_layers(layer.feature_layers())?;
        crate::train::layer::held_out_accuracy_of(&layer, target, docs, cfg, cache_hidden, log)
    } else {
        target.model.set_feature_layers(&[])?;
        held_out_accuracy(target, docs, cfg, cache_hidden, log)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recipe_records_command_data_config_and_results() {
        let cfg = TrainConfig::default();
        let data = vec![PathBuf::from("/nonexistent/corpus.txt")];
        let run = TrainRun { data: &data, out: Path::new("/tmp/x"), resume: false, cache_hidden: None, command: "selfspec train".into() };
        let report = TrainReport { train_tokens: 10, val_tokens: 2, steps: 3, final_loss: 1.5, losses: vec![2.0, 1.5], val: vec![], hidden_secs: 0.0, train_secs: 1.0, train_tokens_per_sec: 10.0 };
        let r = recipe(&cfg, &run, &report, 2.0);
        assert_eq!(r["command"], "selfspec train");
        assert_eq!(r["steps"], 3);
        assert_eq!(r["config"]["num_heads"], cfg.num_heads);
        assert!(r["val_top1"].is_null());
        assert_eq!(r["data"].as_array().unwrap().len(), 1);
    }

    #[test]
    fn validating_needs_a_drafter() {
        let cfg = TrainConfig::default();
        let dir = std::env::temp_dir().join(format!("selfspec-recipe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let c = crate::model::fixtures::tiny_config();
        let w = crate::model::fixtures::random_weights(&c, 1).unwrap();
        crate::model::fixtures::write_gguf(&dir.join("t.gguf"), &c, &w).unwrap();
        let mut t = Target::load(&dir.join("t.gguf"), &candle_core::Device::Cpu).unwrap();
        let e = validate_drafter(&mut t, &[], &cfg, None, &mut |_| {}).unwrap_err();
        assert!(e.to_string().contains("--init"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
