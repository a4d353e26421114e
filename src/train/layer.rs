//! Training an EAGLE-style draft layer with the backbone frozen.
//!
//! Same data path as the heads ([`crate::train`]: chunks, cached hidden states, held-out split,
//! batches, AdamW, checkpoints, exact resume). The loss at step s of the training-time test is
//! the cross-entropy between the layer's guess for token t+s+2 and the target's own distribution
//! there (softmax of lm_head over the real feature f_{t+s+1}), plus optionally a smooth-L1
//! regression of the predicted feature onto f_{t+s+1}, weighted `decay^s`.
use std::collections::HashMap;
use std::path::Path;

use candle_core::{Tensor, D};
use candle_nn::VarMap;

use crate::draft::layer::{DraftLayer, DraftLayerConfig, TrainLayer};
use crate::model::loader::Target;
use crate::data::Document;
use crate::train::loss::soft_cross_entropy;
use crate::train::parallel::{split_groups, GroupRunner};
use crate::train::{epoch_batches, frequent_tokens, prepare, resume_from, run_steps, AdamW, Example, HeadAccuracy, Prepared, Progress, StepsSetup, TrainConfig, TrainReport};
use crate::{Error, Result};

/// Levels the validation reports (guesses 1..=VAL_LEVELS tokens past the root).
pub const VAL_LEVELS: usize = 4;
const LEVELS_NOTE: &str = " (levels 1..4)";

/// Inputs of one chunk for `steps` steps: the real features and, per step, the embeddings of
/// the tokens each row's pair carries (past the chunk's end: token 0, masked out of the loss).
fn chunk_inputs(target: &Target, toks: &[u32], h: &Tensor, steps: usize) -> Result<(Tensor, Vec<Tensor>)> {
    let t = toks.len() - 1;
    // All of each row: the layer takes the columns it reads (final states or tapped layers).
    let feats = h.narrow(0, 0, t)?;
    let mut embs = Vec::with_capacity(steps);
    for s in 0..steps {
        let ids: Vec<u32> = (0..t).map(|r| toks.get(r + s + 1).copied().unwrap_or(0)).collect();
        embs.push(target.model.embed(&ids)?);
    }
    Ok((feats, embs))
}

/// Whether the guess of token `i` counts. The target's own prediction after the chunk's last
/// token (i = len) is a label too; it continues whatever the last token belongs to.
fn scored_at(ex: &Example, i: usize) -> bool {
    let s = ex.scored();
    s.get(i).or(s.last()).copied().unwrap_or(false)
}

fn smooth_l1(d: &Tensor) -> Result<Tensor> {
    let a = d.abs()?;
    let m = a.minimum(1.0)?;
    Ok(((m.sqr()? * 0.5)? + (a - m)?)?.mean_all()?)
}

/// Loss of one chunk (a mean over its scored positions), and step 0's (hits, rows) against the
/// target's own top token.
fn chunk_loss(layer: &TrainLayer, target: &Target, ex: &Example, cfg: &TrainConfig) -> Result<(Tensor, (usize, usize))> {
    let (toks, h) = (ex.tokens(), &ex.h()?);
    let t = toks.len() - 1;
    let steps = cfg.unroll.min(t);
    let (feats, embs) = chunk_inputs(target, toks, h, steps)?;
    let preds = layer.forward_unrolled(&feats, &embs)?;
    // The target's own distribution after every position, once for all steps.
    let p_all = candle_nn::ops::softmax_last_dim(&layer.target_logits(&h.narrow(0, 1, t)?)?)?;
    let mut total: Option<Tensor> = None;
    let mut acc = (0, 0);
    for (s, pred) in preds.iter().enumerate() {
        let rows = t - s;
        let truth = h.narrow(0, s + 1, rows)?.narrow(1, 0, target.model.config().hidden_size)?;
        let pred = pred.narrow(0, 0, rows)?;
        let p = p_all.narrow(0, s, rows)?;
        // Row r guesses token r + s + 2.
        let keep: Vec<f32> = (0..rows).map(|r| scored_at(ex, r + s + 2) as u8 as f32).collect();
        let kept = keep.iter().sum::<f32>();
        if kept == 0.0 {
            continue;
        }
        let weights: Vec<f32> = keep.iter().map(|k| k / kept).collect();
        let (x, readout) = layer.head(&pred)?;
        let (mut l, a) = soft_cross_entropy(&x, readout, &p, &weights)?;
        if cfg.feature_weight > 0.0 {
            let keep = Tensor::from_vec(keep, rows, h.device())?;
            let d = (pred - &truth)?.broadcast_mul(&keep.unsqueeze(1)?)?;
            l = (l + (smooth_l1(&d)? * (cfg.feature_weight * rows as f64 / kept as f64))?)?;
        }
        if s == 0 {
            let b: Vec<u32> = p.argmax(D::Minus1)?.to_vec1()?;
            let hits = (0..rows).filter(|&r| scored_at(ex, r + 2) && a[r] == b[r]).count();
            acc = (hits, kept as usize);
        }
        let term = (l * cfg.decay.powi(s as i32))?;
        total = Some(match total {
            None => term,
            Some(x) => (x + term)?,
        });
    }
    // A chunk whose scored tokens all lie before the first guess contributes nothing.
    let total = match total {
        Some(t) => t,
        None => Tensor::zeros((), candle_core::DType::F32, h.device())?,
    };
    Ok((total, acc))
}

/// Top-1/top-5 per level on held-out chunks, against the target's own greedy tokens: level k
/// guesses the token k places past the root, drafted along the true tokens above it (the
/// unrolled forward, which attends exactly as a drafted chain does).
pub fn validate_layer(layer: &TrainLayer, ids: &[u32], target: &Target, chunks: &[Example]) -> Result<HeadAccuracy> {
    let lm = &target.model.lm_head_weight()?;
    let mut top1 = vec![0usize; VAL_LEVELS];
    let mut top5 = vec![0usize; VAL_LEVELS];
    let mut counts = vec![0usize; VAL_LEVELS];
    let mut tau = crate::train::heads::TauEstimate::default();
    for ex in chunks {
        let (toks, h) = (ex.tokens(), &ex.h()?);
        let t = toks.len() - 1;
        let steps = VAL_LEVELS.min(t);
        let d = target.model.config().hidden_size;
        let own: Vec<u32> = h.narrow(1, 0, d)?.matmul(&lm.t()?)?.argmax(D::Minus1)?.to_vec1()?; // own[i] = target's token i+1
        let (feats, embs) = chunk_inputs(target, toks, h, steps)?;
        let preds = layer.forward_unrolled(&feats, &embs)?;
        let mut ranks = vec![vec![None; steps]; t];
        for (s, pred) in preds.iter().enumerate() {
            let rows = t - s;
            let top = crate::cpu::reduce::top_k_rows(&layer.logits(&pred.narrow(0, 0, rows)?)?, 5)?;
            for (r, row) in top.iter().enumerate().filter(|(r, _)| scored_at(ex, r + s + 2)) {
                let truth = own[r + s + 1];
                counts[s] += 1;
                top1[s] += (ids[row[0].0 as usize] == truth) as usize;
                top5[s] += row.iter().any(|x| ids[x.0 as usize] == truth) as usize;
                ranks[r][s] = row.iter().position(|x| ids[x.0 as usize] == truth);
            }
        }
        // Level s of row r drafts along the true tokens above it: the run of levels whose truth
        // ranks within reach is what verification would accept.
        tau.push_chunk(ranks.into_iter().enumerate().map(|(r, rk)| scored_at(ex, r + 2).then_some(rk)).collect());
    }
    let frac = |a: &[usize]| a.iter().zip(&counts).map(|(&x, &c)| x as f64 / c.max(1) as f64).collect();
    let (tau_chain, tau_tree) = tau.both();
    Ok(HeadAccuracy { positions: counts[0], top1: frac(&top1), top5: frac(&top5), tau_chain, tau_tree })
}

/// `old` (a trained layer's draft vocabulary) grown to `n` tokens with the most frequent of the
/// others in `chunks` (ties to the lower id), in id order as every draft vocabulary is. Why: a
/// vocabulary is fixed when a layer is first trained, from that run's corpus; data on new
/// subjects brings words it lacks (8% of SmolLM2's tokens on the bundled eval prompts lay outside
/// the committed layer's 8,191), and only training with them in the vocabulary teaches the
/// layer to guess them (reading them untrained through the target's rows changed nothing).
pub fn widened_vocab<'a>(old: &[u32], chunks: impl Iterator<Item = &'a [u32]>, n: usize) -> Result<Vec<u32>> {
    if n < old.len() {
        return Err(Error::InvalidArgument(format!("--widen-vocab {n}: the draft layer already has {} tokens", old.len())));
    }
    let mut ids: Vec<u32> = old.to_vec();
    ids.extend(crate::train::heads::tokens_by_frequency(chunks, &old.iter().copied().collect()).into_iter().take(n - old.len()));
    ids.sort_unstable();
    Ok(ids)
}

/// Held-out accuracy per level of the draft layer in `cfg.init` on the chunks a `train
/// --draft-layer` run with `cfg` and these `docs` holds out, computing hidden states for those
/// chunks only (see [`crate::train::held_out_accuracy`]).
pub fn held_out_layer_accuracy(target: &Target, docs: &[Document], cfg: &TrainConfig, cache_hidden: Option<&Path>, log: &mut dyn FnMut(String)) -> Result<HeadAccuracy> {
    let dir = cfg.init.as_deref().ok_or_else(|| Error::InvalidArgument("--validate-only needs --init: the drafter to measure".into()))?;
    let from = crate::draft::drafter::load_layer(dir, target)?;
    held_out_accuracy_of(&from, target, docs, cfg, cache_hidden, log)
}

/// [`held_out_layer_accuracy`] of a layer already loaded from `cfg.init` (read once: an EAGLE-3
/// layer's file also says which target layers to attach before the states are computed).
pub(crate) fn held_out_accuracy_of(from: &DraftLayer, target: &Target, docs: &[Document], cfg: &TrainConfig, cache_hidden: Option<&Path>, log: &mut dyn FnMut(String)) -> Result<HeadAccuracy> {
    let (dir, val_set) = crate::train::held_out_set(target, docs, cfg, cfg.unroll + 2, cache_hidden, log)?;
    let ids = from.draft_vocab().to_vec();
    let varmap = VarMap::new();
    let layer = TrainLayer::init(&varmap, from.config().clone(), &ids, &target.model, cfg.seed)?;
    crate::train::warm_start(&varmap, from.weights()?, dir)?;
    validate_layer(&layer, &ids, target, &val_set)
}

#[allow(clippy::too_many_arguments)]
/// Train a draft layer on `docs`, writing checkpoints into `out`.
pub fn train_layer(
    target: &Target,
    docs: &[Document],
    cfg: &TrainConfig,
    out: &Path,
    resume: bool,
    cache_hidden: Option<&Path>,
    progress: Progress,
    log: &mut dyn FnMut(String),
) -> Result<(DraftLayer, TrainReport)> {
    cfg.validate()?;
    if !cfg.draft_layer {
        return Err(Error::InvalidArgument("train_layer needs a draft-layer configuration".into()));
    }
    let layers = cfg.feature_layers_for(target.model.config().num_layers);
    if target.model.feature_layers() != layers.as_slice() {
        return Err(Error::InvalidArgument(format!(
            "this run trains on the inputs of target layers {layers:?}, but the target returns {:?}: call target.model.set_feature_layers first",
            target.model.feature_layers()
        )));
    }
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    // The starting layer first: a wrong --widen-vocab is refused before the hidden states are computed.
    let init = cfg.init.as_deref().map(|dir| crate::draft::drafter::load_layer(dir, target)).transpose()?;
    if let Some(l) = init.as_ref().filter(|_| cfg.widen_vocab > 0) {
        widened_vocab(l.draft_vocab(), std::iter::empty(), cfg.widen_vocab)?;
    }
    let Prepared { train_set, val_set, train_tokens, val_tokens, hidden_secs } = prepare(target, docs, cfg, cfg.unroll + 2, cache_hidden, true, log)?;
    let (per_epoch, batches_for_epoch) = epoch_batches(&train_set, cfg);
    let total_steps = per_epoch * cfg.epochs;
    let device = target.model.device().clone();
    let vocab = target.model.config().vocab_size;
    let ids = match &init {
        Some(l) if cfg.widen_vocab > 0 => widened_vocab(l.draft_vocab(), train_set.iter().map(|c| c.tokens()), cfg.widen_vocab.min(vocab))?,
        Some(l) => l.draft_vocab().to_vec(),
        None => frequent_tokens(train_set.iter().map(|c| c.tokens()), cfg.draft_vocab.min(vocab), &target.tokenizer.eos_ids),
    };
    log(format!(
        "draft vocabulary: {} tokens{}",
        ids.len(),
        match (&init, cfg.widen_vocab) {
            (Some(l), w) if w > 0 => format!(", --init's {} and this corpus's most frequent others", l.draft_vocab().len()),
            (Some(_), _) => ", as --init's".into(),
            (None, _) => ", the corpus's most frequent".into(),
        }
    ));
    let lcfg = if cfg.eagle3 { DraftLayerConfig::for_target_eagle3(target, ids.len(), &layers)? } else { DraftLayerConfig::for_target(target, ids.len())? };
    if let Some(l) = &init {
        if l.config().arch != lcfg.arch {
            return Err(Error::InvalidArgument(format!("--init holds a {:?} layer; this run trains a {:?} one", l.config().arch, lcfg.arch)));
        }
    }
    let varmap = VarMap::new();
    let layer = TrainLayer::init(&varmap, lcfg.clone(), &ids, &target.model, cfg.seed)?;
    if let (Some(l), Some(dir)) = (&init, &cfg.init) {
        let mut from = l.weights()?.clone();
        if ids != l.draft_vocab() {
            if let Some(old) = from.get("lm_head.weight") {
                // EAGLE-3's own head: its trained rows where it had them, the target's rows for
                // the added tokens (as a fresh layer starts).
                let fresh = target.model.lm_head_rows(&ids)?;
                let row_of: HashMap<u32, usize> = l.draft_vocab().iter().enumerate().map(|(i, &t)| (t, i)).collect();
                let rows = ids.iter().enumerate().map(|(i, t)| match row_of.get(t) {
                    Some(&r) => old.narrow(0, r, 1),
                    None => fresh.narrow(0, i, 1),
                }).collect::<candle_core::Result<Vec<_>>>()?;
                from.insert("lm_head.weight".into(), Tensor::cat(&rows, 0)?.to_dtype(candle_core::DType::F32)?);
            }
        }
        crate::train::warm_start(&varmap, &from, dir)?;
        log(format!("starting from the draft layer in {}", dir.display()));
    }
    let mut opt = AdamW::new(&varmap, cfg.weight_decay)?;
    let data = crate::train::heads::data_fingerprint(docs);
    let mut losses = if resume { resume_from(out, cfg, &data, &mut opt, &device, total_steps, log)? } else { Vec::new() };

    let runner = GroupRunner::new()?;
    let vars: Vec<Tensor> = varmap.all_vars().iter().map(|v| v.as_tensor().clone()).collect();
    let done = run_steps(
        StepsSetup { cfg, out, data: &data, train_set: &train_set, per_epoch, total_steps, batches_for_epoch: &batches_for_epoch, val_levels: LEVELS_NOTE },
        &mut opt,
        &mut losses,
        progress,
        log,
        &mut |batch| {
            let whole = batch.len() as f64;
            runner.grads(split_groups(batch, cfg.grad_groups), &vars, &|group: Vec<usize>| {
                let mut loss: Option<Tensor> = None;
                let (mut hits, mut rows) = (0, 0);
                for i in group {
                    let (l, (a, b)) = chunk_loss(&layer, target, &train_set[i], cfg)?;
                    hits += a;
                    rows += b;
                    loss = Some(match loss {
                        None => l,
                        Some(x) => (x + l)?,
                    });
                }
                // A share of the batch's mean, so that the groups sum to it.
                let loss = (loss.ok_or_else(|| Error::InvalidArgument("an empty group".into()))? / whole)?;
                Ok((loss, vec![(hits, rows)]))
            })
        },
        &mut || if val_set.is_empty() { Ok(None) } else { validate_layer(&layer, &ids, target, &val_set).map(Some) },
    )?;
    let val = if val_set.is_empty() { HeadAccuracy::default() } else { validate_layer(&layer, &ids, target, &val_set)? };
    let report = TrainReport::new((train_tokens, val_tokens, hidden_secs), done.step, &losses, val, done.secs, done.tokens_seen);
    let mut trained = DraftLayer::from_tensors(layer.tensors()?, ids, lcfg, &target.model)?;
    crate::cpu::quant::with_block_fallback(target.model.weight_format(), |f| trained.set_format(f))?;
    Ok((trained, report))
}

#[cfg(test)]
mod tests {
    use super::widened_vocab;

    #[test]
    fn widened_vocab_keeps_the_old_ids_and_adds_the_most_frequent_others_in_id_order() {
        let chunks: Vec<Vec<u32>> = vec![vec![5, 9, 9, 2, 7, 7, 7], vec![9, 8, 3, 3, 1]];
        // Others by count: 7 (3), 9 (3), 3 (2), then 2, 8 once each (ties to the lower id).
        let w = widened_vocab(&[1, 5], chunks.iter().map(|c| c.as_slice()), 5).unwrap();
        assert_eq!(w, vec![1, 3, 5, 7, 9]);
        let w = widened_vocab(&[1, 5], chunks.iter().map(|c| c.as_slice()), 6).unwrap();
        assert_eq!(w, vec![1, 2, 3, 5, 7, 9]);
        // Fewer new tokens than asked for: all of them.
        assert_eq!(widened_vocab(&[1, 5], chunks.iter().map(|c| c.as_slice()), 50).unwrap(), vec![1, 2, 3, 5, 7, 8, 9]);
        // The same size: unchanged; smaller: refused, naming the flag.
        assert_eq!(widened_vocab(&[1, 5], chunks.iter().map(|c| c.as_slice()), 2).unwrap(), vec![1, 5]);
        let e = widened_vocab(&[1, 5], chunks.iter().map(|c| c.as_slice()), 1).unwrap_err().to_string();
        assert!(e.contains("--widen-vocab"), "{e}");
    }
}
