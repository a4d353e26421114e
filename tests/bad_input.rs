//! The bad-input table: every subcommand, given missing, truncated or garbage files, a drafter
//! for another model, empty or non-UTF-8 corpora, a prompt past the context, invalid sampling
//! values and trees, or an output it cannot write, exits non-zero with one `error:` line naming
//! the file or flag, never panics, leaves no output behind and never clobbers an existing one.
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

fn run(args: &[String]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_selfspec")).args(args).env_remove("RUST_BACKTRACE").output().unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into())
}

fn s(p: &Path) -> String {
    p.to_str().unwrap().to_string()
}

#[test]
fn every_subcommand_refuses_bad_input_cleanly() {
    let dir = scratch("bad-input");
    let (tiny, t) = tiny_gguf("bad-input-model", 4);
    let (other, _) = tiny_gguf("bad-input-other", 77);
    let m = s(&tiny);
    // A drafter for the tiny model.
    let cfg = selfspec::train::TrainConfig { num_heads: 2, epochs: 1, seq_len: 32, batch_tokens: 64, draft_vocab: 0, val_fraction: 0.0, ..Default::default() };
    let docs = vec![selfspec::data::Document::plain("the cat sat on the mat and the dog ran in the sun ".repeat(8))];
    let (h, _) = selfspec::train::train(&t, &docs, &cfg, &dir.join("ck"), false, None, &mut |_, _, _, _, _| {}, &mut |_| {}).unwrap();
    let heads = dir.join("heads");
    h.save(&heads).unwrap();
    let d = s(&heads);
    // Files, good and bad.
    let write = |name: &str, bytes: &[u8]| -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    };
    let prompts = s(&write("prompts.txt", b"the cat\nthe dog\n"));
    let empty = s(&write("empty.txt", b""));
    let latin1 = s(&write("latin1.txt", &[b'c', b'a', b'f', 0xe9, b'\n']));
    let garbage = s(&write("garbage.gguf", b"GGUF but not really a model at all"));
    let good = std::fs::read(&tiny).unwrap();
    let truncated = s(&write("truncated.gguf", &good[..good.len() / 2]));
    let bad_manifest = s(&write("corpus.toml", b"[[set]]\nid = 1\n"));
    let file = write("a-file", b"x");
    let under_file = |name: &str| s(&file.join(name)); // a path whose parent is a file
    let long_prompt = "word ".repeat(600);
    let missing = s(&dir.join("missing.gguf"));
    // Outputs that exist must survive a failing run untouched.
    let kept = write("kept.json", b"keep me");

    let args = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let gen = |extra: &[&str]| {
        let mut v = args(&["generate", "--model", &m, "--prompt", "the cat", "--max-tokens", "4"]);
        v.extend(args(extra));
        v
    };
    let table: Vec<(Vec<String>, &[&str])> = vec![
        (args(&["generate", "--model", &missing, "--prompt", "x"]), &["missing.gguf"]),
        (args(&["generate", "--model", &garbage, "--prompt", "x"]), &["garbage.gguf"]),
        (args(&["generate", "--model", &truncated, "--prompt", "x"]), &["truncated.gguf"]),
        (args(&["generate", "--model", &s(&other), "--prompt", "x", "--drafter", &d]), &["trained for", "heads"]),
        (gen(&["--drafter", &s(&dir.join("no-drafter"))]), &["no-drafter"]),
        (args(&["generate", "--model", &m, "--prompt", &long_prompt]), &["context"]),
        (gen(&["--temperature", "-1"]), &["temperature"]),
        (gen(&["--top-p", "0"]), &["top-p"]),
        (gen(&["--presence-penalty", "nan"]), &["presence penalty"]),
        (gen(&["--frequency-penalty", "inf"]), &["frequency penalty"]),
        (gen(&["--drafter", &d, "--tree", "chain:100000"]), &["chain:100000", "64"]),
        (gen(&["--drafter", &d, "--tree", "dynamic:100000"]), &["dynamic:100000", "64"]),
        (gen(&["--drafter", &d, "--tree", "garbage"]), &["'garbage'", "chain:N"]),
        (gen(&["--drafter", &d, "--tree", "chain:2+lookup:100"]), &["lookup:100", "64"]),
        (gen(&["--lossy-typical"]), &["--lossy-typical", "--drafter"]),
        (gen(&["--drafter", &d, "--datastore", &s(&dir)]), &["not a directory"]),
        (gen(&["--drafter", &d, "--datastore", &bad_manifest]), &["corpus.toml", "not a corpus manifest"]),
        (args(&["eval", "--model", &m, "--prompts", &prompts]), &["--drafter"]),
        (args(&["eval", "--model", &m, "--drafter", &d, "--prompts", &s(&dir.join("nope.txt"))]), &["nope.txt"]),
        (args(&["eval", "--model", &m, "--drafter", &d, "--prompts", &empty]), &["empty.txt", "no prompts"]),
        (args(&["eval", "--model", &m, "--drafter", &d, "--prompts", &empty, "--out", &s(&dir.join("kept"))]), &["empty.txt"]),
        (args(&["eval", "--model", &m, "--drafter", &d, "--prompts", &prompts, "--out", &under_file("r")]), &["cannot be written"]),
        (args(&["eval", "--model", &m, "--drafter", &d, "--prompts", &prompts, "--temperature", "nan"]), &["temperature"]),
        (args(&["tune", "--model", &m, "--drafter", &d, "--prompts", &prompts, "--out", &under_file("t.json")]), &["cannot be written"]),
        (args(&["tune", "--model", &m, "--drafter", &d, "--prompts", &prompts, "--out", &s(&dir.join("t.json")), "--max-nodes", "1"]), &["--max-nodes"]),
        (args(&["tune", "--model", &m, "--drafter", &d, "--prompts", &prompts, "--out", &s(&dir.join("t.json")), "--max-nodes", "59"]), &["--max-nodes", "58"]),
        (args(&["train", "--model", &m, "--data", &empty, "--out", &s(&dir.join("o1"))]), &["empty corpus"]),
        (args(&["train", "--model", &m, "--data", &latin1, "--out", &s(&dir.join("o2"))]), &["latin1.txt", "UTF-8"]),
        (args(&["train", "--model", &m, "--data", &prompts, "--out", &under_file("o3")]), &["cannot be written"]),
        (args(&["train", "--model", &m, "--data", &bad_manifest, "--out", &s(&dir.join("o4"))]), &["not a corpus manifest"]),
        (args(&["train", "--model", &m, "--data", &prompts, "--out", &s(&dir.join("o5")), "--num-heads", "0"]), &["--num-heads"]),
        (args(&["distill", "--model", &m, "--prompts", &s(&dir.join("nope.txt")), "--out", &s(&dir.join("d.jsonl"))]), &["nope.txt"]),
        (args(&["distill", "--model", &m, "--prompts", &prompts, "--out", &under_file("d.jsonl")]), &["cannot be written"]),
        (args(&["distill", "--model", &m, "--prompts", &prompts, "--out", &s(&dir.join("d2.jsonl")), "--temperature", "nan"]), &["temperature"]),
        (args(&["bench", "--model", &m, "--tokens", "0"]), &["--tokens"]),
        // Sizes past the context used to abort on their allocation; zero repetitions and
        // limits were quietly taken as one.
        (args(&["bench", "--model", &m, "--tokens", "100000000", "--reps", "1"]), &["--tokens 100000000", "context"]),
        (args(&["bench", "--model", &m, "--tokens", "1", "--reps", "0"]), &["--reps"]),
        (args(&["eval", "--model", &m, "--drafter", &d, "--prompts", &prompts, "--limit", "0"]), &["--limit"]),
        (args(&["tune", "--model", &m, "--drafter", &d, "--prompts", &prompts, "--out", &s(&dir.join("t.json")), "--check-prompts", "0"]), &["--check-prompts"]),
        // A device that never ends, as a prompts or tree file: refused, not read until memory
        // runs out.
        (args(&["eval", "--model", &m, "--drafter", &d, "--prompts", "/dev/zero"]), &["/dev/zero", "not a regular file"]),
        (gen(&["--drafter", &d, "--tree", "/dev/zero"]), &["/dev/zero"]),
        (gen(&["--drafter", &d, "--tree", &s(&write("rank-20.json", b"[[0],[20]]"))]), &["rank-20.json", "rank 20"]),
        (args(&["generate", "--model", &m, "--prompt", ""]), &["--prompt"]),
        // Read before the model loads (a missing model here): the prompt file, the drafter
        // directory, drafter flags without a drafter.
        (args(&["generate", "--model", &missing, "--prompt-file", &s(&dir.join("no-prompt.txt"))]), &["--prompt-file", "no-prompt.txt"]),
        (args(&["generate", "--model", &missing, "--prompt-file", &s(&dir)]), &["--prompt-file", "not a file"]),
        (args(&["generate", "--model", &missing, "--prompt-file", &s(&write("bin.txt", b"ok \xff\xfe"))]), &["--prompt-file", "bin.txt", "UTF-8"]),
        (args(&["generate", "--model", &missing, "--prompt", "x", "--prompt-file", &prompts]), &["--prompt", "cannot be used with"]),
        (args(&["generate", "--model", &missing, "--prompt", "x", "--system", "be brief"]), &["--chat"]),
        (args(&["generate", "--model", &missing, "--prompt", "x", "--stop", ""]), &["--stop", "empty"]),
        (args(&["generate", "--model", &missing, "--prompt", "x", "--seed", "-2"]), &["--seed", "-1 (random)"]),
        (args(&["generate", "--model", &missing, "--prompt", "x", "--drafter", "none"]), &["--drafter", "none", "no such directory"]),
        (args(&["generate", "--model", &missing, "--prompt", "x", "--drafter", &prompts]), &["--drafter", "not a drafter directory"]),
        (args(&["generate", "--model", &missing, "--prompt", "x", "--datastore", &prompts]), &["--drafter"]),
        (args(&["generate", "--model", &missing, "--prompt", "x", "--draft-weights", "f16"]), &["--drafter"]),
        (args(&["generate", "--model", &missing, "--prompt", "x", "--threads", "0"]), &["--threads", "1..=1024"]),
        (args(&["train", "--model", &m, "--data", &prompts, "--out", &s(&dir.join("o6")), "--lr", "inf"]), &["--lr"]),
        (args(&["train", "--model", &m, "--data", &prompts, "--out", &s(&dir.join("o7")), "--layers", "100000"]), &["--layers", "16"]),
        (args(&["train", "--model", &m, "--data", &s(&dir.join("nope.txt")), "--out", &s(&dir.join("o8"))]), &["--data", "nope.txt"]),
        (args(&["distill", "--model", &m, "--prompts", &prompts, "--out", &s(&dir.join("d3.jsonl")), "--batch", "0"]), &["--batch"]),
        (args(&["distill", "--model", &m, "--prompts", &prompts, "--out", &s(&write("not-distill.jsonl", b"garbage\n{\"x\":1}\n"))]), &["not-distill.jsonl", "line 1"]),
        // distill --self-prompts: refused before the model loads (the model here does not
        // exist, so a check after the load would report that instead).
        (args(&["distill", "--model", &missing, "--self-prompts", "0", "--out", &s(&dir.join("d4.jsonl"))]), &["--self-prompts", "not in 1..="]),
        (args(&["distill", "--model", &missing, "--self-prompts", "3", "--prompts", &prompts, "--out", &s(&dir.join("d4.jsonl"))]), &["--self-prompts", "--prompts", "cannot be used with"]),
        (args(&["distill", "--model", &missing, "--out", &s(&dir.join("d4.jsonl"))]), &["--self-prompts", "--prompts"]),
        (args(&["distill", "--model", &missing, "--self-prompts", "3", "--out", &s(&dir.join("d4.jsonl"))]), &["--temperature", "every prompt would be the same"]),
        (args(&["distill", "--model", &missing, "--self-prompts", "3", "--temperature", "1", "--max-tokens", "0", "--out", &s(&dir.join("d4.jsonl"))]), &["--max-tokens"]),
        (args(&["distill", "--model", &missing, "--self-prompts", "3", "--temperature", "1", "--out", &s(&dir.join("not-distill.jsonl"))]), &["not-distill.jsonl", "--self-prompts"]),
        (args(&["distill", "--model", &missing, "--self-prompts", "3", "--temperature", "1", "--out", &s(&write("note.txt", b"a note without a newline"))]), &["note.txt", "not one of this command's records"]),
        (args(&["export", "--model", &m, "--drafter", &d, "--out", &d, "--format", "f16"]), &["--out", "--drafter directory itself"]),
        (args(&["bench", "--model", &garbage]), &["garbage.gguf"]),
        (args(&["export", "--model", &m, "--drafter", &s(&dir.join("nope")), "--out", &s(&dir.join("e"))]), &["nope"]),
        (args(&["export", "--model", &m, "--drafter", &d, "--out", &s(&dir.join("e2")), "--format", "q8"]), &["q8", "heads"]),
    ];
    for (argv, needles) in &table {
        let (code, err) = run(argv);
        assert_ne!(code, 0, "{argv:?} succeeded");
        assert!(!err.contains("panicked") && !err.contains("RUST_BACKTRACE"), "{argv:?} panicked: {err}");
        let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error")).collect();
        assert_eq!(errors.len(), 1, "{argv:?}: one error line expected: {err}");
        for n in *needles {
            assert!(err.contains(n), "{argv:?}: stderr {err:?} lacks {n:?}");
        }
    }
    // Nothing half-made was left behind, and the existing output was not touched.
    for p in ["o1", "o2", "o4", "o5", "o6", "o7", "o8", "d.jsonl", "d2.jsonl", "d3.jsonl", "d4.jsonl", "e", "e2", "kept.md", "kept.svg", "t.json"] {
        let p = dir.join(p);
        assert!(!p.exists(), "{} was left behind", p.display());
    }
    assert_eq!(std::fs::read(&kept).unwrap(), b"keep me");
    assert_eq!(std::fs::read(dir.join("not-distill.jsonl")).unwrap(), b"garbage\n{\"x\":1}\n", "nothing appended");
    assert_eq!(std::fs::read(dir.join("note.txt")).unwrap(), b"a note without a newline", "not cut as a torn line");
    // With a drafter, --lossy-typical runs and says it is lossy.
    let (code, err) = run(&gen(&["--drafter", &d, "--lossy-typical", "--temperature", "0.7"]));
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("LOSSY"), "{err}");
}

/// Drafter files (heads.json, draft.json, their safetensors) and tree files, mutated: loading
/// ends in an error or a drafter that works, never a panic.
#[test]
fn mutated_drafter_and_tree_files_fail_cleanly() {
    let dir = scratch("bad-drafters");
    let (_, t) = tiny_gguf("bad-drafters-model", 4);
    let docs = vec![selfspec::data::Document::plain("the cat sat on the mat and the dog ran in the sun ".repeat(8))];
    let heads_cfg = selfspec::train::TrainConfig { num_heads: 2, epochs: 1, seq_len: 32, batch_tokens: 64, draft_vocab: 0, val_fraction: 0.0, ..Default::default() };
    let (h, _) = selfspec::train::train(&t, &docs, &heads_cfg, &dir.join("ck-h"), false, None, &mut |_, _, _, _, _| {}, &mut |_| {}).unwrap();
    let heads = dir.join("heads");
    h.save(&heads).unwrap();
    let layer_cfg = selfspec::train::TrainConfig { draft_layer: true, unroll: 1, epochs: 1, seq_len: 32, batch_tokens: 64, draft_vocab: 32, val_fraction: 0.0, ..Default::default() };
    let (l, _) = selfspec::train::layer::train_layer(&t, &docs, &layer_cfg, &dir.join("ck-l"), false, None, &mut |_, _, _, _, _| {}, &mut |_| {}).unwrap();
    let layer = dir.join("layer");
    l.save_as(&layer, selfspec::draft::layer::StoreFormat::F32).unwrap();

    let mut s = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let mut loads = 0;
    for (src, files) in [(&heads, ["heads.json", "heads.safetensors"]), (&layer, ["draft.json", "draft.safetensors"])] {
        for file in files {
            let good = std::fs::read(src.join(file)).unwrap();
            let mut variants: Vec<Vec<u8>> = [0, 1, good.len() / 2, good.len() - 1].iter().map(|&n| good[..n].to_vec()).collect();
            for _ in 0..40 {
                let mut b = good.clone();
                // Edit the first KiB: the JSON, or the safetensors header.
                let at = (next() as usize) % good.len().min(1024);
                b[at] = match next() % 3 {
                    0 => next() as u8,
                    1 => b'9',
                    _ => b'"',
                };
                variants.push(b);
            }
            if file.ends_with(".json") {
                let text = String::from_utf8(good.clone()).unwrap();
                for (k, v) in [("num_heads", "1000000000000000000"), ("num_layers", "4294967296"), ("hidden_size", "0"), ("vocab_size", "18446744073709551615"), ("draft_vocab_size", "99999999999")] {
                    let re = format!("\"{k}\":");
                    if let Some(i) = text.find(&re) {
                        let j = i + re.len() + text[i + re.len()..].find([',', '\n', '}']).unwrap();
                        variants.push(format!("{}{} {}{}", &text[..i], re, v, &text[j..]).into_bytes());
                    }
                }
            }
            for b in variants {
                let case = dir.join("case");
                let _ = std::fs::remove_dir_all(&case);
                std::fs::create_dir_all(&case).unwrap();
                for f in std::fs::read_dir(src).unwrap() {
                    let f = f.unwrap().path();
                    std::fs::copy(&f, case.join(f.file_name().unwrap())).unwrap();
                }
                std::fs::write(case.join(file), &b).unwrap();
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| selfspec::draft::drafter::Drafter::from_dir(&case, &t).map(|_| ())));
                assert!(r.is_ok(), "{file} mutated: loading panicked");
                loads += 1;
            }
        }
    }
    assert!(loads > 150);
    // Tree files: truncated, garbage, huge ranks, deep paths.
    for text in ["", "[", "[[0],[1]", "{\"paths\": 7}", "[[18446744073709551615]]", "[[0],[0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0]]", "[[-1]]", "[[0.5]]"] {
        let p = dir.join("tree.json");
        std::fs::write(&p, text).unwrap();
        let r = std::panic::catch_unwind(|| selfspec::spec::plan::Plan::parse(p.to_str().unwrap()).map(|_| ()));
        assert!(matches!(r, Ok(Err(_))), "tree file {text:?} must be refused cleanly");
    }
}
