//! Heads files, Medusa format, and training: loss goes down, the backbone never learns, an
//! interrupted run resumes to the same weights, bad input is refused.
mod common;

use candle_core::{Device, Tensor};
use common::*;
use selfspec::draft::heads::Heads;
use selfspec::train::{train, LossKind, TrainConfig};


fn quick_cfg() -> TrainConfig {
    TrainConfig {
        num_heads: 3,
        epochs: 3,
        lr: 3e-3,
        warmup_steps: 2,
        seq_len: 64,
        batch_tokens: 128,
        val_fraction: 0.2,
        checkpoint_every: 2,
        draft_vocab: 0,
        loss: LossKind::Hard,
        ..Default::default()
    }
}

fn run(t: &selfspec::model::loader::Target, cfg: &TrainConfig, out: &std::path::Path, resume: bool) -> (Heads, selfspec::train::TrainReport) {
    train(t, &corpus(), cfg, out, resume, None, &mut |_, _, _, _, _| {}, &mut |_| {}).unwrap()
}

fn weights(h: &Heads, dir: &std::path::Path) -> Vec<(String, Vec<f32>)> {
    h.save(dir).unwrap();
    let m = candle_core::safetensors::load(dir.join("heads.safetensors"), &Device::Cpu).unwrap();
    let mut v: Vec<(String, Vec<f32>)> = m.into_iter().map(|(k, t)| (k, t.flatten_all().unwrap().to_vec1().unwrap())).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// A chunk longer than the row kernel's limit is run in pieces; its states are then exactly what
/// decoding the chunk one token at a time computes (the row kernel and attention are
/// batch-invariant), so the drafters train on decoding's own numerics.
#[test]
fn chunk_states_equal_token_by_token_decoding() {
    let (_, t) = tiny_gguf("train-pieces", 22);
    let toks: Vec<u32> = (0..150).map(|i| (i * 41 + 9) % 260).collect();
    let h: Vec<f32> = selfspec::train::hidden_states(&t, &toks, None).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let mut cache = t.model.new_cache().unwrap();
    let mut seq = Vec::new();
    for &x in &toks {
        seq.extend(t.model.forward_causal(&[x], &mut cache).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap());
    }
    assert_eq!(h, seq);
}

#[test]
fn loss_decreases_and_backbone_is_frozen() {
    let (_, mut t) = tiny_gguf("train-loss", 21);
    let before: Vec<f32> = t.model.lm_head().weight().unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let toks = t.tokenizer.encode("the cat sat on the mat", false).unwrap();
    let h = selfspec::train::hidden_states(&t, &toks, None).unwrap();
    assert!(!h.track_op(), "backbone hidden states must carry no gradient graph");
    // The on-disk cache returns exactly what was computed.
    let cache_dir = scratch("hidden-cache");
    let cache = selfspec::train::HiddenCache::new(&cache_dir, &t).unwrap();
    let a: Vec<f32> = selfspec::train::hidden_states(&t, &toks, Some(&cache)).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let b: Vec<f32> = selfspec::train::hidden_states(&t, &toks, Some(&cache)).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(a, b);
    assert_eq!(a, h.flatten_all().unwrap().to_vec1::<f32>().unwrap());
    // States from other numerics (here an f32 KV cache) are kept apart, never served for these.
    t.model.set_kv_dtype(candle_core::DType::F32).unwrap();
    let cache32 = selfspec::train::HiddenCache::new(&cache_dir, &t).unwrap();
    let c: Vec<f32> = selfspec::train::hidden_states(&t, &toks, Some(&cache32)).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let fresh: Vec<f32> = selfspec::train::hidden_states(&t, &toks, None).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(c, fresh);
    assert_ne!(c, a, "f16 and f32 KV caches gave identical states, so this check proves nothing");
    // f32 weights with an f32 KV cache keep the file names caches had before the key carried the
    // numerics (sha256 of the tokens and the target's hash), so older caches stay valid.
    let legacy = {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        for tok in &toks {
            h.update(tok.to_le_bytes());
        }
        h.update(t.fingerprint().unwrap().hash.as_bytes());
        let name: String = h.finalize().iter().take(12).map(|b| format!("{b:02x}")).collect();
        cache_dir.join(format!("{name}.safetensors"))
    };
    assert!(legacy.exists(), "f32/f32 states were not written under their pre-key name {}", legacy.display());
    t.model.set_kv_dtype(candle_core::DType::F16).unwrap();
    for loss in [LossKind::Hard, LossKind::Soft] {
        let dir = scratch(&format!("train-loss-{loss:?}"));
        let cfg = TrainConfig { loss, ..quick_cfg() };
        let (_, rep) = run(&t, &cfg, &dir, false);
        let n = rep.losses.len();
        let first: f64 = rep.losses[..3].iter().sum::<f64>() / 3.0;
        let last: f64 = rep.losses[n - 3..].iter().sum::<f64>() / 3.0;
        assert!(last < first * 0.9, "{loss:?}: loss {first} -> {last}");
        // Gradients in groups (the default two) or in one pass: the same losses up to rounding
        // (each group's heads are normalised by the whole batch's valid rows).
        assert_eq!(cfg.grad_groups, 2);
        let (_, one) = run(&t, &TrainConfig { grad_groups: 1, ..cfg }, &scratch(&format!("train-loss-{loss:?}-one")), false);
        for (a, b) in one.losses.iter().zip(&rep.losses) {
            assert!((a - b).abs() <= 1e-3 * a.abs().max(1.0), "{loss:?}: one group {:?} vs two {:?}", one.losses, rep.losses);
        }
    }
    let after: Vec<f32> = t.model.lm_head().weight().unwrap().flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(before, after, "the backbone changed during training");
}

#[test]
fn conversations_train_on_the_answers_only() {
    let (_, t) = tiny_gguf("train-scored", 24);
    let msg = |role: &str, content: &str| selfspec::model::tokenizer::Message::new(role, content);
    let render = |m: &[selfspec::model::tokenizer::Message]| -> selfspec::Result<String> {
        Ok(m.iter().map(|x| format!("<{}> {} </{}>\n", x.role, x.content, x.role)).collect())
    };
    let conv = [msg("system", "you are a cat"), msg("user", "what do you sit on"), msg("assistant", "the mat, the mat, always the mat")];
    let doc = selfspec::data::Document::conversation(&conv, &render).unwrap();
    let chunks = selfspec::train::chunk_documents(&t, &[doc.clone()], 1000, 1).unwrap();
    assert_eq!(chunks.len(), 1);
    let c = &chunks[0];
    let answer: Vec<u32> = c.tokens.iter().zip(&c.scored).filter(|(_, &s)| s).map(|(&x, _)| x).collect();
    assert_eq!(t.tokenizer.decode(&answer).unwrap().trim(), "the mat, the mat, always the mat");
    assert!(c.scored.iter().filter(|&&s| !s).count() > 5, "the template and question are not scored");
    // The offsets line up with plain encoding.
    assert_eq!(c.tokens, t.tokenizer.encode(&doc.text, true).unwrap());
    // A chunk holding only prompt text is dropped; plain text is scored throughout.
    let chunks = selfspec::train::chunk_documents(&t, &[doc], 8, 1).unwrap();
    assert!(chunks.iter().all(|c| c.scored.iter().any(|&s| s)));
    let plain = selfspec::train::chunk_documents(&t, &corpus()[..1], 64, 1).unwrap();
    assert!(plain.iter().all(|c| c.scored.iter().all(|&s| s)));
}

#[test]
fn resumed_run_matches_uninterrupted_run() {
    let (_, t) = tiny_gguf("train-resume", 22);
    let full_dir = scratch("train-resume-full");
    let (full, rep) = run(&t, &quick_cfg(), &full_dir, false);
    let total = rep.steps;
    assert!(total >= 6);
    let part_dir = scratch("train-resume-part");
    let (_, partial) = run(&t, &TrainConfig { max_steps: total / 2, ..quick_cfg() }, &part_dir, false);
    assert_eq!(partial.steps, total / 2);
    let (resumed, rep2) = run(&t, &quick_cfg(), &part_dir, true);
    assert_eq!(rep2.steps, total);
    assert_eq!(weights(&full, &scratch("w-full")), weights(&resumed, &scratch("w-resumed")), "resumed weights differ");
    // The checkpoint is one file: its step and settings travel in the safetensors header.
    assert!(part_dir.join("checkpoint.safetensors").exists() && !part_dir.join("checkpoint.json").exists());
    // --resume with nothing to resume starts afresh, and says so.
    let mut lines = Vec::new();
    let cfg = TrainConfig { max_steps: 1, ..quick_cfg() };
    train(&t, &corpus(), &cfg, &scratch("train-resume-none"), true, None, &mut |_, _, _, _, _| {}, &mut |l| lines.push(l)).unwrap();
    assert!(lines.iter().any(|l| l.contains("no checkpoint") && l.contains("step 0")), "{lines:?}");
}

/// `--resume` on other data is refused: the checkpoint records the documents' fingerprint.
#[test]
fn resume_on_other_data_is_refused() {
    let (_, t) = tiny_gguf("train-resume-data", 22);
    let dir = scratch("train-resume-data-out");
    run(&t, &TrainConfig { max_steps: 2, ..quick_cfg() }, &dir, false);
    let mut other = corpus();
    other[0] = selfspec::data::Document::plain("a different first document, with other words in it. ".repeat(6));
    let e = train(&t, &other, &quick_cfg(), &dir, true, None, &mut |_, _, _, _, _| {}, &mut |_| {}).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("other data") && e.contains("checkpoint.safetensors"), "{e}");
    // The same data resumes.
    run(&t, &quick_cfg(), &dir, true);
}

#[test]
fn heads_round_trip_and_reject_other_targets() {
    let (_, t) = tiny_gguf("heads-rt", 23);
    // Plain Medusa heads (exportable); token-aware heads are covered below.
    let cfg = TrainConfig { epochs: 1, token_aware: false, ..quick_cfg() };
    let (h, _) = run(&t, &cfg, &scratch("heads-rt-train"), false);
    let x = Tensor::randn(0f32, 1., (1, t.model.config().hidden_size), &Device::Cpu).unwrap();
    let want: Vec<Vec<f32>> = h.draft_logits(&x, 7, &t.model).unwrap().to_vec2().unwrap();
    let dir = scratch("heads-rt-out");
    h.save(&dir).unwrap();
    let back = Heads::from_dir(&dir, &t).unwrap();
    assert_eq!(back.draft_logits(&x, 7, &t.model).unwrap().to_vec2::<f32>().unwrap(), want);
    // Medusa format round trip.
    let mdir = scratch("heads-rt-medusa");
    h.export_medusa(&mdir, &t).unwrap();
    assert!(mdir.join("medusa_lm_head.safetensors").exists() && mdir.join("config.json").exists());
    let imported = Heads::import_medusa(&mdir, &t).unwrap();
    assert!(!imported.config().own_lm_head, "a copied lm_head is recognised as shared");
    assert_eq!(imported.draft_logits(&x, 7, &t.model).unwrap().to_vec2::<f32>().unwrap(), want);
    assert_eq!(Heads::from_dir(&mdir, &t).unwrap().num_heads(), h.num_heads());
    // vLLM's Medusa layout round-trips too, with the full vocabulary and with a reduced one
    // (its token_map), and names its tensors as vLLM loads them.
    let vdir = scratch("heads-rt-vllm");
    h.export_medusa_vllm(&vdir, &t).unwrap();
    let vcfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(vdir.join("config.json")).unwrap()).unwrap();
    assert_eq!(vcfg["architectures"][0], "MedusaModel");
    assert_eq!(vcfg["num_heads"], h.num_heads());
    let names: Vec<String> = candle_core::safetensors::load(vdir.join("model.safetensors"), &Device::Cpu).unwrap().into_keys().collect();
    assert!(names.iter().any(|n| n == "blocks.0.layers.0.weight") && names.iter().any(|n| n == "lm_heads.0.weight"), "{names:?}");
    let back = Heads::from_dir(&vdir, &t).unwrap();
    assert!(!back.config().own_lm_head);
    assert_eq!(back.draft_logits(&x, 7, &t.model).unwrap().to_vec2::<f32>().unwrap(), want);
    let (hv, _) = run(&t, &TrainConfig { epochs: 1, token_aware: false, draft_vocab: 40, ..quick_cfg() }, &scratch("heads-rt-train-dv"), false);
    assert!(hv.draft_vocab().is_some());
    let vdir2 = scratch("heads-rt-vllm-dv");
    hv.export_medusa_vllm(&vdir2, &t).unwrap();
    let back = Heads::from_dir(&vdir2, &t).unwrap();
    assert_eq!(back.draft_vocab(), hv.draft_vocab());
    assert_eq!(back.draft_logits(&x, 7, &t.model).unwrap().to_vec2::<f32>().unwrap(), hv.draft_logits(&x, 7, &t.model).unwrap().to_vec2::<f32>().unwrap());
    let (_, other) = tiny_gguf("heads-rt-other-vllm", 98);
    assert!(Heads::from_dir(&vdir2, &other).is_err(), "another model is refused");
    // Another target (different weights) is refused, naming both.
    let (_, other) = tiny_gguf("heads-rt-other", 99);
    let e = Heads::from_dir(&dir, &other).err().expect("must refuse").to_string();
    assert!(e.contains("trained for") && e.contains("hash"), "{e}");
    // The Medusa export records the model's name (not a local path) and its fingerprint, so an
    // import refuses another model even where the shapes agree.
    let mcfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(mdir.join("config.json")).unwrap()).unwrap();
    assert_eq!(mcfg["base_model_name_or_path"], "tiny");
    let e = Heads::import_medusa(&mdir, &other).err().expect("must refuse").to_string();
    assert!(e.contains("trained for") && e.contains("hash"), "{e}");
    // Token-aware heads round-trip too, depend on the root token, and refuse Medusa export.
    let (ta, _) = run(&t, &TrainConfig { epochs: 1, ..quick_cfg() }, &scratch("heads-rt-ta"), false);
    assert!(ta.config().token_aware);
    let tdir = scratch("heads-rt-ta-out");
    ta.save(&tdir).unwrap();
    let ta2 = Heads::from_dir(&tdir, &t).unwrap();
    let a: Vec<Vec<f32>> = ta2.draft_logits(&x, 7, &t.model).unwrap().to_vec2().unwrap();
    assert_eq!(a, ta.draft_logits(&x, 7, &t.model).unwrap().to_vec2::<f32>().unwrap());
    assert_ne!(a, ta2.draft_logits(&x, 8, &t.model).unwrap().to_vec2::<f32>().unwrap(), "the root token must matter");
    assert!(ta.export_medusa(&scratch("heads-rt-ta-medusa"), &t).is_err());
    assert!(ta.export_medusa_vllm(&scratch("heads-rt-ta-vllm"), &t).is_err());
    // Missing files.
    let empty = scratch("heads-rt-empty");
    assert!(Heads::from_dir(&empty, &t).err().unwrap().to_string().contains("heads.json"));
}

#[test]
fn draft_vocabulary_restricts_drafts() {
    let (_, t) = tiny_gguf("heads-dv", 24);
    let cfg = TrainConfig { epochs: 1, draft_vocab: 20, loss: LossKind::Soft, ..quick_cfg() };
    let (h, _) = run(&t, &cfg, &scratch("heads-dv-train"), false);
    let vocab = h.draft_vocab().unwrap().to_vec();
    assert!(vocab.len() <= 20 && vocab.windows(2).all(|w| w[0] < w[1]));
    // A fixed input, so the f16 drift bound below is checked on the same point every run.
    let d = t.model.config().hidden_size;
    let x = Tensor::from_vec((0..d).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect::<Vec<f32>>(), (1, d), &Device::Cpu).unwrap();
    for row in h.draft_top_k(&x, 7, &t.model, 5).unwrap() {
        assert!(row.iter().all(|(id, _)| vocab.contains(id)));
    }
    let dir = scratch("heads-dv-out");
    h.save(&dir).unwrap();
    assert_eq!(Heads::from_dir(&dir, &t).unwrap().draft_vocab().unwrap(), vocab.as_slice());
    // The compact f16 copy keeps token ids exact and logits close.
    let half = scratch("heads-dv-f16");
    h.save_as(&half, true).unwrap();
    let hh = Heads::from_dir(&half, &t).unwrap();
    assert_eq!(hh.draft_vocab().unwrap(), vocab.as_slice());
    let a: Vec<f32> = h.draft_logits(&x, 7, &t.model).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let b: Vec<f32> = hh.draft_logits(&x, 7, &t.model).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let d = a.iter().zip(&b).map(|(p, q)| (p - q).abs()).fold(0.0f32, f32::max);
    assert!(d < 2e-2, "f16 heads drift by {d}");
    assert!(std::fs::metadata(half.join("heads.safetensors")).unwrap().len() < std::fs::metadata(dir.join("heads.safetensors")).unwrap().len());
}

#[test]
fn training_can_start_from_trained_heads() {
    let (_, t) = tiny_gguf("heads-init", 25);
    let cfg = TrainConfig { epochs: 1, draft_vocab: 20, loss: LossKind::Soft, ..quick_cfg() };
    let (a, _) = run(&t, &cfg, &scratch("heads-init-a"), false);
    let dir = scratch("heads-init-a-out");
    a.save(&dir).unwrap();
    // One step at a vanishing learning rate from those heads: the same weights and vocabulary
    // (a fresh start would differ; the corpus's own vocabulary is not recomputed).
    let cont = TrainConfig { init: Some(dir.clone()), max_steps: 1, lr: 1e-12, warmup_steps: 1, draft_vocab: 10, ..cfg.clone() };
    let (b, _) = run(&t, &cont, &scratch("heads-init-b"), false);
    assert_eq!(b.draft_vocab(), a.draft_vocab());
    let (wa, wb) = (weights(&a, &scratch("heads-init-wa")), weights(&b, &scratch("heads-init-wb")));
    let close = |x: &[(String, Vec<f32>)], y: &[(String, Vec<f32>)]| {
        x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.0 == q.0 && p.1.iter().zip(&q.1).all(|(u, v)| (u - v).abs() <= 1e-6))
    };
    assert!(close(&wa, &wb), "warm start did not load the heads");
    let (fresh, _) = run(&t, &TrainConfig { init: None, ..cont.clone() }, &scratch("heads-init-c"), false);
    assert!(!close(&wa, &weights(&fresh, &scratch("heads-init-wc"))), "the check cannot tell a fresh start");
    // Heads of another shape are refused, naming their directory.
    let other = TrainConfig { num_heads: 2, ..cont };
    let e = train(&t, &corpus(), &other, &scratch("heads-init-d"), false, None, &mut |_, _, _, _, _| {}, &mut |_| {}).err().expect("shape mismatch").to_string();
    assert!(e.contains("heads-init-a-out") && e.contains("--init"), "{e}");
}

/// `--validate-only`: the saved heads measured alone on a run's held-out chunks score what the
/// run's own last validation scored, and nothing is measured without a drafter to measure.
#[test]
fn held_out_accuracy_repeats_the_runs_validation() {
    let (_, t) = tiny_gguf("heads-heldout", 26);
    let cfg = TrainConfig { epochs: 2, draft_vocab: 20, loss: LossKind::Soft, ..quick_cfg() };
    let (h, rep) = run(&t, &cfg, &scratch("heads-heldout-run"), false);
    let dir = scratch("heads-heldout-out");
    h.save(&dir).unwrap();
    let v = selfspec::train::held_out_accuracy(&t, &corpus(), &TrainConfig { init: Some(dir), ..cfg.clone() }, None, &mut |_| {}).unwrap();
    assert_eq!(v, rep.val.last().unwrap().clone());
    assert!(v.top1.iter().any(|&a| a > 0.0), "{v:?}");
    let e = selfspec::train::held_out_accuracy(&t, &corpus(), &cfg, None, &mut |_| {}).err().unwrap().to_string();
    assert!(e.contains("--init"), "{e}");
}

#[test]
fn corpus_errors_are_clear() {
    let (p, _) = tiny_gguf("train-cli", 25);
    let dir = scratch("train-cli-data");
    let empty = dir.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let bin = dir.join("latin1.txt");
    std::fs::write(&bin, [b'c', b'a', b'f', 0xe9, b'\n']).unwrap();
    for (f, needle) in [(&empty, "empty corpus"), (&bin, "not UTF-8")] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_selfspec"))
            .args(["train", "--model", p.to_str().unwrap(), "--data", f.to_str().unwrap(), "--out", dir.join("o").to_str().unwrap()])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(needle) && !err.contains("panicked"), "{err}");
    }
}

/// Validation is held out by content: a corpus listed twice (oversampling) must not train on a
/// copy of a validation chunk, so a corpus of one repeated document leaves nothing to train on.
#[test]
fn validation_chunks_are_held_out_by_content() {
    let (_, t) = tiny_gguf("train-holdout", 26);
    let cfg = TrainConfig { epochs: 1, ..quick_cfg() };
    let same = vec![selfspec::data::Document::plain("the cat sat on the mat and the dog ran in the sun all day long. ".repeat(4)); 10];
    let e = train(&t, &same, &cfg, &scratch("holdout-same"), false, None, &mut |_, _, _, _, _| {}, &mut |_| {}).err().expect("must refuse");
    assert!(e.to_string().contains("no training chunk is left"), "{e}");
}
