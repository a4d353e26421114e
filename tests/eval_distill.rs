//! `eval` reports and self-distillation resume, on the tiny model.
mod common;

use common::*;
use selfspec::data::{read_prompts, PromptItem};
use selfspec::train::distill::{answer, answer_batch, append_record, done_ids, self_prompt_ids, write_prompts, write_prompts_file};
use selfspec::eval::report::{to_markdown, to_svg};
use selfspec::eval::{evaluate, mark_drafted, EvalOptions};
use selfspec::decode::sampling::SamplingParams;
use selfspec::draft::choice::TreeChoice;
use selfspec::spec::plan::Plan;
use selfspec::draft::tree::Tree;

fn prompts() -> Vec<PromptItem> {
    vec![
        PromptItem { id: "1".into(), category: "a".into(), turns: vec!["the cat".into(), "and then".into()] },
        PromptItem { id: "2".into(), category: "b".into(), turns: vec!["in the".into()] },
    ]
}

#[test]
fn eval_reports_tau_identity_and_files() {
    let (_, t) = tiny_gguf("eval", 31);
    let cfg = selfspec::train::TrainConfig { num_heads: 2, epochs: 1, seq_len: 32, batch_tokens: 64, draft_vocab: 0, val_fraction: 0.0, ..Default::default() };
    let docs = vec![selfspec::data::Document::plain("the cat sat on the mat and the dog ran in the sun ".repeat(8))];
    let (heads, _) = selfspec::train::train(&t, &docs, &cfg, &scratch("eval-train"), false, None, &mut |_, _, _, _, _| {}, &mut |_| {}).unwrap();
    let mut calls = 0;
    let mut prog = |_: usize, _: usize| calls += 1;
    let mut opts = EvalOptions {
        trees: vec![
            ("chain".into(), Plan { tree: TreeChoice::Static(Tree::chain(2)), lookup: None }),
            ("dyn".into(), Plan { tree: TreeChoice::Dynamic(5), lookup: None }),
            ("chain:2+lookup:3".into(), Plan::parse("chain:2+lookup:3").unwrap()),
            // Cut per step by this machine's measured forward costs.
            ("auto:6+lookup:3".into(), Plan::parse("auto:6+lookup:3").unwrap()),
        ],
        params: SamplingParams::greedy(),
        max_tokens: 12,
        seed: 1,
        datastore: None,
        progress: &mut prog,
    };
    let r = evaluate(&t, &selfspec::draft::drafter::Drafter::Heads(heads), &prompts(), &mut opts).unwrap();
    assert_eq!(calls, 3, "one progress tick per turn");
    assert_eq!(r.turns.len(), 3);
    assert_eq!(r.per_category.len(), 2);
    for s in &r.overall {
        assert_eq!(s.all_identical, Some(true));
        assert!(s.tau >= 1.0 && s.speedup > 0.0);
        assert_eq!(s.head_top1.len(), 2);
        let steps: usize = s.accept_hist.iter().sum();
        assert_eq!(steps, s.target_forwards);
        // Every step runs a tree forward; its time per step is a positive, finite number.
        assert!(s.step_ms.forward > 0.0 && s.step_ms.forward.is_finite() && s.step_ms.draft >= 0.0, "{:?}", s.step_ms);
    }
    assert_eq!(r.overall[0].node_accept_rate.len(), 3);
    let md = to_markdown(&r);
    assert!(md.contains("bonus token counted") && md.contains("| chain |") && md.contains("Where a step's time went") && md.contains("outside the forward"));
    let svg = to_svg(&r);
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    // Marking: drafted runs are bracketed, the rest is plain.
    let ids = t.tokenizer.encode("the cat sat", false).unwrap();
    let flags: Vec<bool> = (0..ids.len()).map(|i| i % 2 == 1).collect();
    let marked = mark_drafted(&t, &ids, &flags).unwrap();
    assert_eq!(marked.replace(['[', ']'], ""), t.tokenizer.decode(&ids).unwrap());
    assert!(marked.contains('['));
}

#[test]
fn distill_appends_and_resumes() {
    let (_, t) = tiny_gguf("distill", 32);
    let dir = scratch("distill-out");
    let out = dir.join("d.jsonl");
    let items = prompts();
    let r0 = answer(&t, &items[0], &SamplingParams::greedy(), 8, 0).unwrap();
    assert_eq!(r0.messages.len(), 4, "two user turns and two answers");
    append_record(&out, &r0).unwrap();
    // A killed run can leave a torn line; it is ignored and the next record starts cleanly.
    std::fs::OpenOptions::new().append(true).open(&out).and_then(|mut f| std::io::Write::write_all(&mut f, b"{\"id\": \"2\", \"mess")).unwrap();
    let done = done_ids(&out).unwrap();
    assert!(done.contains("1") && !done.contains("2"));
    let r1 = answer(&t, &items[1], &SamplingParams::greedy(), 8, 0).unwrap();
    append_record(&out, &r1).unwrap();
    let done = done_ids(&out).unwrap();
    assert!(done.contains("1") && done.contains("2"));
    // The file is a valid corpus for training.
    let docs = selfspec::data::read_corpus(&[out.clone()], &|m| Ok(m.iter().map(|x| x.content.clone()).collect::<Vec<_>>().join("\n"))).unwrap();
    assert_eq!(docs.len(), 2, "the torn line was dropped, both answers kept");
    let p = dir.join("p.txt");
    std::fs::write(&p, "one\ntwo\n").unwrap();
    assert_eq!(read_prompts(&p).unwrap().len(), 2);
    // Some other file as --out is refused, not appended to (it would then be neither).
    let other = dir.join("other.jsonl");
    std::fs::write(&other, "garbage\n{\"x\":1}\n").unwrap();
    let e = done_ids(&other).unwrap_err().to_string();
    assert!(e.contains("other.jsonl") && e.contains("line 1") && e.contains("--out"), "{e}");
}

/// Batched distillation answers every prompt exactly as answering it alone does (greedy and
/// sampled, one- and two-turn prompts), at any batch size.
#[test]
fn batched_distill_matches_one_prompt_at_a_time() {
    let (_, t) = tiny_gguf("distill-batch", 33);
    let items: Vec<PromptItem> = (0..5)
        .map(|i| PromptItem {
            id: format!("p{i}"),
            category: "c".into(),
            turns: if i % 2 == 0 { vec![format!("the {i} cat"), "and".into()] } else { vec![format!("once {i}")] },
        })
        .collect();
    let seeds: Vec<u64> = (0..5).map(|i| 40 + i).collect();
    for params in [SamplingParams::greedy(), SamplingParams { temperature: 1.0, ..Default::default() }] {
        let alone: Vec<_> = items.iter().zip(&seeds).map(|(it, &s)| answer(&t, it, &params, 9, s).unwrap()).collect();
        for batch in [1, 3, 8] {
            let mut got = Vec::new();
            answer_batch(&t, &items, &seeds, &params, 9, batch, &mut |r| {
                got.push(r);
                Ok(())
            })
            .unwrap();
            got.sort_by(|a, b| a.id.cmp(&b.id));
            assert_eq!(got, alone, "batch {batch}, temperature {}", params.temperature);
        }
    }
    assert!(answer_batch(&t, &items, &seeds[..2], &SamplingParams::greedy(), 9, 2, &mut |_| Ok(())).is_err());
    assert!(answer_batch(&t, &items, &seeds, &SamplingParams::greedy(), 9, 0, &mut |_| Ok(())).is_err());
    // A prompt past the context is refused by name; the records finished before it were handed out.
    let mut long = items.clone();
    long[3].turns = vec!["the cat ".repeat(400)];
    let mut done = Vec::new();
    let err = answer_batch(&t, &long, &seeds, &SamplingParams::greedy(), 9, 1, &mut |r| {
        done.push(r.id);
        Ok(())
    })
    .unwrap_err();
    assert!(err.to_string().contains("prompt \"p3\"") && err.to_string().contains("context"), "{err}");
    assert_eq!(done, ["p0", "p1", "p2"]);
}

/// The target writes prompts itself: each depends on its index alone (any batch size, any
/// subset), the file resumes, `distill --prompts` reads it (skipping unfinished prompts), and
/// some other file is refused as --out.
#[test]
fn self_prompts_are_batch_invariant_and_resume() {
    let (_, t) = tiny_gguf("self-prompts", 34);
    let params = SamplingParams { temperature: 1.0, top_p: 0.9, ..Default::default() };
    let collect = |indices: &[usize], batch: usize| {
        let mut got = Vec::new();
        write_prompts(&t, indices, &params, 6, 70, batch, &mut |p| {
            got.push(p);
            Ok(())
        })
        .unwrap();
        got.sort_by(|a, b| a.question_id.cmp(&b.question_id));
        got
    };
    // The prompts follow the template's opening of a user turn (ChatML here).
    let prefix = t.tokenizer.decode(&t.user_turn_prefix_ids().unwrap()).unwrap();
    assert!(prefix.ends_with("user\n") && !prefix.contains("assistant"), "{prefix:?}");
    let all = collect(&[0, 1, 2, 3, 4, 5], 1);
    assert_eq!(all.len(), 6);
    assert_eq!(collect(&[0, 1, 2, 3, 4, 5], 4), all);
    assert_eq!(collect(&[4, 1], 2), vec![all[1].clone(), all[4].clone()]);
    // The tiny model's random weights rarely end a turn within 6 tokens: unfinished ones are
    // cut at the budget; a finished one has text and ended with the end-of-turn token.
    for p in &all {
        assert!(p.tokens <= 6 && p.tokens >= 1);
        assert!(!p.finished || !p.prompt.is_empty(), "{p:?}");
        assert!(p.finished || p.tokens == 6 || p.prompt.is_empty(), "{p:?}");
    }
    assert_ne!(all[0].prompt, all[1].prompt, "each index has its own seed");
    // The file: a killed run (here: a shorter one, then a torn line) resumes to the same prompts.
    let dir = scratch("self-prompts-out");
    let out = dir.join("p.jsonl");
    write_prompts_file(&t, 3, &out, &params, 6, 70, 2, &mut |_| {}).unwrap();
    std::fs::OpenOptions::new().append(true).open(&out).and_then(|mut f| std::io::Write::write_all(&mut f, b"{\"question_id\": \"self-3\", \"pro")).unwrap();
    let s = write_prompts_file(&t, 6, &out, &params, 6, 70, 3, &mut |_| {}).unwrap();
    assert_eq!((s.already_done, s.answered), (3, 3));
    // In prompt order, whatever the completion order was.
    let lines: Vec<_> = std::fs::read_to_string(&out).unwrap().lines().map(|l| serde_json::from_str::<selfspec::train::distill::SelfPrompt>(l).unwrap()).collect();
    assert_eq!(lines, all);
    assert_eq!(self_prompt_ids(&out).unwrap().len(), 6);
    // `distill --prompts` reads the finished ones only.
    let finished = all.iter().filter(|p| p.finished).count();
    match read_prompts(&out) {
        Ok(items) => assert_eq!(items.len(), finished),
        Err(e) => assert!(finished == 0 && e.to_string().contains("6 unfinished"), "{e}"),
    }
    // A write torn inside a multi-byte character still resumes.
    let torn = dir.join("torn.jsonl");
    let mut bytes = std::fs::read(&out).unwrap();
    bytes.extend_from_slice("{\"question_id\": \"self-9\", \"prompt\": \"caf\u{e9}".as_bytes());
    bytes.pop();
    std::fs::write(&torn, &bytes).unwrap();
    assert_eq!(self_prompt_ids(&torn).unwrap().len(), 6);
    // Greedy, every prompt would be the same: refused.
    let e = write_prompts(&t, &[0, 1], &SamplingParams::greedy(), 6, 70, 2, &mut |_| Ok(())).unwrap_err().to_string();
    assert!(e.contains("--temperature"), "{e}");
    // A distill answers file, or anything else, is not a prompts file to append to.
    let other = dir.join("answers.jsonl");
    std::fs::write(&other, "{\"id\": \"1\", \"messages\": [], \"new_tokens\": 0}\n").unwrap();
    let e = write_prompts_file(&t, 2, &other, &params, 6, 70, 2, &mut |_| {}).unwrap_err().to_string();
    assert!(e.contains("answers.jsonl") && e.contains("--self-prompts"), "{e}");
    assert!(write_prompts(&t, &[0], &params, 6, 70, 0, &mut |_| Ok(())).is_err(), "batch 0");
}

/// A base model (no chat template) is evaluated on its prompts as plain text, warm-up included.
#[test]
fn eval_takes_a_model_without_a_chat_template() {
    use selfspec::model::fixtures;
    let dir = scratch("eval-no-template");
    let cfg = fixtures::tiny_config();
    fixtures::write_hf(&dir, &cfg, &fixtures::random_weights(&cfg, 5).unwrap()).unwrap();
    let tc = dir.join("tokenizer_config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&tc).unwrap()).unwrap();
    v.as_object_mut().unwrap().remove("chat_template");
    std::fs::write(&tc, v.to_string()).unwrap();
    let t = selfspec::model::loader::Target::load(&dir, &candle_core::Device::Cpu).unwrap();
    let cfg = selfspec::train::TrainConfig { num_heads: 1, epochs: 1, seq_len: 32, batch_tokens: 64, draft_vocab: 0, val_fraction: 0.0, ..Default::default() };
    let docs = vec![selfspec::data::Document::plain("the cat sat on the mat ".repeat(8))];
    let (heads, _) = selfspec::train::train(&t, &docs, &cfg, &scratch("eval-no-template-train"), false, None, &mut |_, _, _, _, _| {}, &mut |_| {}).unwrap();
    let mut prog = |_: usize, _: usize| {};
    let mut opts = EvalOptions {
        trees: vec![("chain".into(), Plan { tree: TreeChoice::Static(Tree::chain(1)), lookup: None })],
        params: SamplingParams::greedy(),
        max_tokens: 6,
        seed: 1,
        datastore: None,
        progress: &mut prog,
    };
    let r = evaluate(&t, &selfspec::draft::drafter::Drafter::Heads(heads), &prompts()[1..], &mut opts).unwrap();
    assert_eq!(r.turns.len(), 1);
    assert_eq!(r.overall[0].all_identical, Some(true));
}

/// The committed corpus is what `training/corpus.toml` says it is: each set's answers file has
/// its recorded sha256, record count and token count (the sum of the records' new_tokens), so a
/// set edited in place, or answers regenerated with other flags, cannot pass unnoticed.
#[test]
fn committed_corpus_matches_its_manifest() {
    use sha2::{Digest, Sha256};
    let m = selfspec::data::manifest::Manifest::read(&std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("training/corpus.toml")).unwrap();
    assert!(m.sets.len() >= 11);
    for set in &m.sets {
        let bytes = std::fs::read(&set.answers).unwrap_or_else(|e| panic!("{}: {e}", set.answers.display()));
        let sha: String = Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(Some(&sha), set.sha256.as_ref(), "{}: sha256", set.id);
        let text = String::from_utf8(bytes).unwrap();
        let recs: Vec<selfspec::data::DistillRecord> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(Some(recs.len() as u64), set.records, "{}: records", set.id);
        assert_eq!(Some(recs.iter().map(|r| r.new_tokens as u64).sum::<u64>()), set.tokens, "{}: tokens", set.id);
    }
}
