//! Bad input gets one clear line on stderr naming the file and the problem, a non-zero exit and
//! no panic.
mod common;

use std::process::Command;

use candle_core::quantized::gguf_file::{self, Value};
use common::*;

fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_selfspec")).args(args).output().unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

fn expect_error(args: &[&str], needles: &[&str]) {
    let (code, _, err) = run(args);
    assert_ne!(code, 0, "{args:?} succeeded");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    for n in needles {
        assert!(err.contains(n), "{args:?}: stderr {err:?} lacks {n:?}");
    }
    assert!(err.trim().lines().count() <= 2, "{args:?}: error should be short: {err}");
}

fn write_meta_only(path: &std::path::Path, md: &[(&str, Value)]) {
    let mut f = std::fs::File::create(path).unwrap();
    let r: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (*k, v)).collect();
    gguf_file::write(&mut f, &r, &[]).unwrap();
}

#[test]
fn bad_model_files() {
    let dir = scratch("cli-errors");
    let missing = dir.join("nope.gguf");
    expect_error(&["generate", "--model", missing.to_str().unwrap(), "--prompt", "x"], &["nope.gguf", "No such file"]);

    let junk = dir.join("junk.bin");
    std::fs::write(&junk, b"hello world, not a model").unwrap();
    expect_error(&["generate", "--model", junk.to_str().unwrap(), "--prompt", "x"], &["junk.bin", "neither a GGUF"]);

    let (tiny, _) = tiny_gguf("cli-errors-tiny", 1);
    let bytes = std::fs::read(&tiny).unwrap();
    let trunc = dir.join("trunc.gguf");
    std::fs::write(&trunc, &bytes[..bytes.len() * 6 / 10]).unwrap();
    expect_error(&["generate", "--model", trunc.to_str().unwrap(), "--prompt", "x"], &["trunc.gguf", "truncated"]);

    let arch = dir.join("falcon.gguf");
    write_meta_only(&arch, &[("general.architecture", Value::String("falcon".into()))]);
    expect_error(&["generate", "--model", arch.to_str().unwrap(), "--prompt", "x"], &["falcon.gguf", "unsupported", "falcon"]);

    let notok = dir.join("notok.gguf");
    write_meta_only(
        &notok,
        &[
            ("general.architecture", Value::String("llama".into())),
            ("llama.embedding_length", Value::U32(64)),
            ("llama.attention.head_count", Value::U32(4)),
            ("llama.block_count", Value::U32(1)),
            ("llama.feed_forward_length", Value::U32(128)),
        ],
    );
    expect_error(&["generate", "--model", notok.to_str().unwrap(), "--prompt", "x"], &["notok.gguf", "no tokenizer"]);

    let hf = dir.join("hf-no-tok");
    std::fs::create_dir_all(&hf).unwrap();
    let cfg = selfspec::model::fixtures::tiny_config();
    let w = selfspec::model::fixtures::random_weights(&cfg, 1).unwrap();
    selfspec::model::fixtures::write_hf(&hf, &cfg, &w).unwrap();
    std::fs::remove_file(hf.join("tokenizer.json")).unwrap();
    expect_error(&["generate", "--model", hf.to_str().unwrap(), "--prompt", "x"], &["hf-no-tok", "tokenizer.json"]);
}

#[test]
fn bad_arguments() {
    let (tiny, _) = tiny_gguf("cli-args", 2);
    let m = tiny.to_str().unwrap();
    let long = "a b ".repeat(400);
    expect_error(&["generate", "--model", m, "--prompt", &long], &["prompt has", "context is 512"]);
    expect_error(&["generate", "--model", m, "--prompt", "x", "--max-tokens", "0"], &["max-tokens"]);
    expect_error(&["generate", "--model", m, "--prompt", "x", "--temperature", "-1"], &["temperature"]);
    expect_error(&["generate", "--model", m, "--prompt", "x", "--device", "tpu"], &["unknown device", "tpu"]);
    // A bad --weights is caught by the argument parser (clap adds its own "--help" hint line).
    let (code, _, err) = run(&["generate", "--model", m, "--prompt", "x", "--weights", "q5"]);
    assert!(code != 0 && err.contains("unknown weight format 'q5'") && !err.contains("panicked"), "{err}");
    // KV cache types: f16 and f32 run, anything else is refused by name.
    let (code, _, err) = run(&["generate", "--model", m, "--prompt", "x", "--kv-cache", "bf16"]);
    assert!(code != 0 && err.contains("bf16") && err.contains("f16") && !err.contains("panicked"), "{err}");
    for kv in ["f16", "f32"] {
        let (code, out, err) = run(&["generate", "--model", m, "--prompt", "the cat", "--kv-cache", kv, "--max-tokens", "4"]);
        assert!(code == 0 && !out.is_empty(), "--kv-cache {kv}: {err}");
    }
    // And the happy path works on the same file, in every weight format: text on stdout,
    // summary on stderr.
    for w in ["f32", "f16", "q8_0", "native"] {
        let (code, out, err) = run(&["generate", "--model", m, "--prompt", "the", "--max-tokens", "5", "--weights", w]);
        assert_eq!(code, 0, "{w}: {err}");
        assert!(!out.is_empty(), "{w}");
        assert!(err.contains("decode") && err.contains("tok/s"), "{w}: {err}");
    }
    // perplexity: bad flags and texts named before any work; a text scored as llama.cpp does.
    let dir = scratch("cli-ppl");
    let short = dir.join("short.txt");
    std::fs::write(&short, "the cat sat on the mat").unwrap();
    expect_error(&["perplexity", "--model", m, "-f", short.to_str().unwrap(), "--ctx", "4"], &["--ctx 4", "at least 16"]);
    expect_error(&["perplexity", "--model", m, "-f", dir.join("none.txt").to_str().unwrap()], &["none.txt"]);
    expect_error(&["perplexity", "--model", m, "-f", short.to_str().unwrap(), "--ctx", "16"], &["short.txt", "needs at least 32"]);
    let long_text = dir.join("long.txt");
    std::fs::write(&long_text, "the cat sat on the mat and the dog ran in the park ".repeat(20)).unwrap();
    let (code, out, err) = run(&["perplexity", "--model", m, "-f", long_text.to_str().unwrap(), "--ctx", "16", "--chunks", "3"]);
    assert!(code == 0 && out.contains("[3]") && out.contains("Final estimate: PPL = "), "{out} {err}");
    let (code, out, err) = run(&["perplexity", "--model", m, "-f", long_text.to_str().unwrap(), "--ctx", "16", "--chunks", "2", "--weights", "native", "--compare", "f32"]);
    assert!(code == 0 && out.contains("Against f32: PPL(f32) = ") && out.contains("mean KLD"), "{out} {err}");
    // bench times every format by default.
    let (code, out, err) = run(&["bench", "--model", m, "--context", "8", "--tokens", "1,2", "--reps", "1"]);
    assert_eq!(code, 0, "{err}");
    for w in ["f32", "f16", "q8_0", "native"] {
        assert!(out.contains(&format!("weights {w}:")), "bench output lacks {w}: {out}");
    }
    // --roofline adds this machine's peaks and each row's floor, in the table and in JSON.
    let (code, out, err) = run(&["bench", "--model", m, "--weights", "native", "--context", "8", "--tokens", "1,4", "--reps", "1", "--roofline"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("roofline (") && out.contains("GMAC/s") && out.contains("floor ratio"), "{out}");
    let (code, out, err) = run(&["bench", "--model", m, "--weights", "f32", "--context", "8", "--tokens", "1,4", "--reps", "1", "--roofline", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let floors = v[0]["floor_ms"].as_array().expect("floor_ms per row");
    assert_eq!(floors.len(), 2);
    let (f1, f4) = (floors[0].as_f64().unwrap(), floors[1].as_f64().unwrap());
    assert!(f1 > 0.0 && f4 >= f1, "floors {f1} {f4}");
    assert!(v[0]["roofline"]["read_bytes_per_s"].as_f64().unwrap() > 0.0);
    // The bandwidth over the forward's own working set (weights and KV cache) is measured too.
    let ws = v[0]["roofline"]["working_set_bytes"].as_u64().unwrap() as usize;
    assert!(ws > v[0]["weight_bytes"].as_u64().unwrap() as usize, "{ws}");
    assert!(v[0]["roofline"]["working_set_read_bytes_per_s"].as_f64().unwrap() > 0.0);
}

/// `SELFSPEC_ISA` keeps the kernels below the CPU's widest path (how an AVX-512 machine times
/// the AVX2 path); every path writes the same greedy text in every weight format, the report
/// names the path taken, and a value it does not know is reported and ignored.
#[test]
fn every_kernel_path_writes_the_same_text() {
    let (tiny, _) = tiny_gguf("cli-isa", 4);
    let m = tiny.to_str().unwrap();
    let with_isa = |isa: &str, args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_selfspec")).env("SELFSPEC_ISA", isa).args(args).output().unwrap();
        assert!(out.status.success(), "SELFSPEC_ISA={isa} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    for w in ["f32", "f16", "q8_0", "native"] {
        let args = ["generate", "--model", m, "--prompt", "the cat sat", "--max-tokens", "12", "--weights", w];
        let (want, _) = with_isa("avx512", &args);
        for isa in ["avx2", "portable"] {
            assert_eq!(with_isa(isa, &args).0, want, "--weights {w}: SELFSPEC_ISA={isa} wrote other text");
        }
    }
    let (out, _) = with_isa("portable", &["bench", "--model", m, "--weights", "native", "--context", "8", "--tokens", "1", "--reps", "1"]);
    assert!(out.contains("(portable"), "{out}");
    let (_, err) = with_isa("sse9", &["generate", "--model", m, "--prompt", "x", "--max-tokens", "1"]);
    assert!(err.contains("SELFSPEC_ISA=\"sse9\"") && err.contains("ignored"), "{err}");
}

#[test]
fn bad_heads_and_trees() {
    let (tiny, t) = tiny_gguf("cli-heads", 3);
    let m = tiny.to_str().unwrap();
    let dir = scratch("cli-heads-dir");
    // Two heads, trained briefly.
    let cfg = selfspec::train::TrainConfig { num_heads: 2, epochs: 1, seq_len: 32, batch_tokens: 64, draft_vocab: 0, val_fraction: 0.0, ..Default::default() };
    let docs = vec![selfspec::data::Document::plain("the cat sat on the mat and the dog ran in the sun ".repeat(8))];
    let (h, _) = selfspec::train::train(&t, &docs, &cfg, &dir.join("ck"), false, None, &mut |_, _, _, _, _| {}, &mut |_| {}).unwrap();
    let heads = dir.join("heads");
    h.save(&heads).unwrap();
    let hs = heads.to_str().unwrap();
    expect_error(&["generate", "--model", m, "--prompt", "the", "--drafter", hs, "--tree", "chain:3"], &["3 deep", "2 heads"]);
    let bad_tree = dir.join("tree.json");
    std::fs::write(&bad_tree, "[[0,1]]").unwrap();
    expect_error(&["generate", "--model", m, "--prompt", "the", "--drafter", hs, "--tree", bad_tree.to_str().unwrap()], &["tree.json", "prefix-closed"]);
    let (code, _, err) = run(&["generate", "--model", m, "--prompt", "the", "--drafter", dir.join("nothing").to_str().unwrap()]);
    assert!(code != 0 && err.contains("nothing") && err.contains("no such directory"), "{err}");
    let (other, _) = tiny_gguf("cli-heads-other", 4);
    expect_error(&["generate", "--model", other.to_str().unwrap(), "--prompt", "the", "--drafter", hs], &["trained for", "heads"]);
    // And they work on the right model.
    let (code, out, err) = run(&["generate", "--model", m, "--prompt", "the", "--drafter", hs, "--tree", "chain:2", "--max-tokens", "6", "--compare"]);
    assert_eq!(code, 0, "{err}");
    assert!(!out.is_empty() && err.contains("tau") && err.contains("bonus token counted") && err.contains("outputs identical"), "{err}");
    // The default tree (auto+lookup:6) needs no flag: it times this device, then stays exact.
    let (code, _, err) = run(&["generate", "--model", m, "--prompt", "the cat the cat the", "--drafter", hs, "--max-tokens", "8", "--compare"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("outputs identical") && err.contains("tau"), "{err}");
    // A --stop text from the middle of the answer ends it there, unprinted, plainly and with
    // the heads alike (the compared plain run stops at the same place).
    let (code, full, err) = run(&["generate", "--model", m, "--prompt", "the cat", "--max-tokens", "16", "--ignore-eos"]);
    assert_eq!(code, 0, "{err}");
    let full = full.trim_end_matches('\n');
    let at: Vec<usize> = full.char_indices().map(|(i, _)| i).chain([full.len()]).collect();
    assert!(at.len() > 6, "{full:?}");
    let stop_text = &full[at[at.len() / 2]..at[at.len() / 2 + 3]];
    let want = format!("{}\n", &full[..full.find(stop_text).unwrap()]);
    let (code, out, err) = run(&["generate", "--model", m, "--prompt", "the cat", "--max-tokens", "16", "--ignore-eos", "--stop", stop_text]);
    assert_eq!((code, &out), (0, &want), "{err}");
    assert!(err.contains("stopped at a --stop text") && !err.contains(", 16 new tokens"), "decoding ended there: {err}");
    let (code, out, err) = run(&["generate", "--model", m, "--prompt", "the cat", "--max-tokens", "16", "--ignore-eos", "--stop", "never appears", "--stop", stop_text, "--drafter", hs, "--tree", "chain:2", "--compare"]);
    assert_eq!((code, &out), (0, &want), "{err}");
    assert!(err.contains("stopped at a --stop text") && err.contains("outputs identical"), "{err}");
    // One token is the prefill's alone: no decoding to compare, said rather than "NaNx".
    let (code, _, err) = run(&["generate", "--model", m, "--prompt", "the cat", "--drafter", hs, "--max-tokens", "1", "--compare"]);
    assert!(code == 0 && err.contains("speed-up n/a") && !err.contains("NaN"), "{err}");
}

/// `train --draft-layer` end to end through the CLI, then the layer drafts for `generate`,
/// `eval` and `tune`; a Medusa export of a layer is refused with a reason.
#[test]
fn draft_layer_through_the_cli() {
    let (tiny, _) = tiny_gguf("cli-layer", 5);
    let m = tiny.to_str().unwrap();
    let dir = scratch("cli-layer-dir");
    let text = dir.join("corpus.txt");
    std::fs::write(&text, (0..8).map(|i| format!("the cat {i} sat on the mat and the dog ran in the sun. ").repeat(4) + "\n\n").collect::<String>()).unwrap();
    let out = dir.join("layer");
    let os = out.to_str().unwrap();
    let (code, _, err) = run(&["train", "--model", m, "--data", text.to_str().unwrap(), "--out", os, "--draft-layer", "--unroll", "2", "--epochs", "1", "--seq-len", "32", "--batch-tokens", "64", "--draft-vocab", "64", "--val-fraction", "0.2"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("trained a draft layer") && out.join("draft.json").exists(), "{err}");
    let (code, _, err) = run(&["generate", "--model", m, "--prompt", "the cat", "--drafter", os, "--tree", "dynamic:6", "--max-tokens", "8", "--compare"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("outputs identical") && err.contains("per step: draft"), "{err}");
    // Drafting in 8-bit blocks instead of the default 4-bit ones: output still the target's.
    let (code, _, err) = run(&["generate", "--model", m, "--prompt", "the cat", "--drafter", os, "--tree", "dynamic:6", "--max-tokens", "8", "--compare", "--draft-weights", "q8_0"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("outputs identical"), "{err}");
    let (code, _, err) = run(&["generate", "--model", m, "--prompt", "the cat", "--drafter", os, "--draft-weights", "q3"]);
    assert!(code != 0 && err.contains("--draft-weights") && err.contains("unknown weight format 'q3'") && !err.contains("panicked"), "{err}");
    let prompts = dir.join("p.txt");
    std::fs::write(&prompts, "the cat\nthe dog\n").unwrap();
    let (code, out_s, err) = run(&["eval", "--model", m, "--drafter", os, "--prompts", prompts.to_str().unwrap(), "--tree", "chain:3", "--max-tokens", "8"]);
    assert_eq!(code, 0, "{err}");
    assert!(out_s.contains("draft layer guesses"), "{out_s}");
    let tree = dir.join("tree.json");
    let (code, tune_out, err) = run(&["tune", "--model", m, "--drafter", os, "--prompts", prompts.to_str().unwrap(), "--out", tree.to_str().unwrap(), "--max-nodes", "4", "--max-tokens", "8"]);
    assert_eq!(code, 0, "{err}");
    assert!(tree.exists());
    // Its pick is measured against the default tree in the same run.
    assert!(tune_out.contains("measured auto+lookup:6: tau"), "{tune_out}");
    // The tuned file, with a lookup branch written into it or added by hand, drives `eval`.
    let ts = tree.to_str().unwrap();
    let plan = selfspec::spec::plan::Plan::parse(&format!("{ts}+lookup:3")).unwrap();
    assert_eq!(plan.lookup.map(|l| l.max_tokens), Some(3));
    let (code, out_s, err) = run(&["eval", "--model", m, "--drafter", os, "--prompts", prompts.to_str().unwrap(), "--tree", ts, "--tree", &format!("{ts}+lookup:3"), "--max-tokens", "8"]);
    assert_eq!(code, 0, "{err}");
    assert!(out_s.contains("+lookup:3") && out_s.contains("copied"), "{out_s}");
    expect_error(&["eval", "--model", m, "--drafter", os, "--prompts", prompts.to_str().unwrap(), "--tree", "chain:2+ngram"], &["+ngram", "lookup"]);
    expect_error(&["eval", "--model", m, "--drafter", os, "--prompts", prompts.to_str().unwrap(), "--tree", "auto:1"], &["auto:1", "2 to 64"]);
    // The old names still work: `export-heads` and `--heads` are hidden aliases of `export` and `--drafter`.
    expect_error(&["export-heads", "--model", m, "--heads", os, "--out", dir.join("medusa").to_str().unwrap()], &["draft layer", "Medusa"]);
    // 8-bit storage loads back and drafts.
    let q8 = dir.join("layer-q8");
    let (code, _, err) = run(&["export", "--model", m, "--drafter", os, "--out", q8.to_str().unwrap(), "--format", "q8"]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = run(&["generate", "--model", m, "--prompt", "the cat", "--drafter", q8.to_str().unwrap(), "--tree", "chain:2", "--max-tokens", "8", "--compare"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("outputs identical"), "{err}");
    // 4-bit storage is read straight into the drafting blocks: the same drafts (so the same
    // number of target forwards) as the f32 file re-packed into them.
    let q4 = dir.join("layer-q4");
    let (code, _, err) = run(&["export", "--model", m, "--drafter", os, "--out", q4.to_str().unwrap(), "--format", "q4"]);
    assert_eq!(code, 0, "{err}");
    let forwards = |e: &str| e.split(" target forwards").next().and_then(|s| s.rsplit(' ').next()).and_then(|n| n.parse::<usize>().ok()).unwrap();
    let (code, _, from_f32) = run(&["generate", "--model", m, "--prompt", "the cat", "--drafter", os, "--tree", "dynamic:6", "--max-tokens", "12", "--compare"]);
    assert_eq!(code, 0, "{from_f32}");
    let (code, _, from_q4) = run(&["generate", "--model", m, "--prompt", "the cat", "--drafter", q4.to_str().unwrap(), "--tree", "dynamic:6", "--max-tokens", "12", "--compare"]);
    assert_eq!(code, 0, "{from_q4}");
    assert!(from_q4.contains("outputs identical") && forwards(&from_q4) == forwards(&from_f32), "{from_f32}\n{from_q4}");
    expect_error(&["generate", "--model", m, "--prompt", "the", "--drafter", os, "--tree", "chain:9"], &["9 deep", "draft layer"]);
}

/// `generate` as llama-cli is used: the prompt from a file or standard input, a system message,
/// why decoding stopped, and a reader that goes away (`| head`) ending it quietly.
#[test]
fn generate_reads_prompt_files_and_stops_quietly_when_stdout_closes() {
    let (tiny, _) = tiny_gguf("cli-prompt-file", 5);
    let m = tiny.to_str().unwrap();
    let dir = scratch("cli-prompt-file-input");
    let file = dir.join("p.txt");
    // A file's line end is not part of the prompt (as llama-cli's -f reads it).
    std::fs::write(&file, "the cat sat\n").unwrap();
    let (code, by_flag, err) = run(&["generate", "--model", m, "--prompt", "the cat sat", "--max-tokens", "6"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("stopped at --max-tokens 6") || err.contains("stopped at end of sequence"), "{err}");
    let (code, by_file, err) = run(&["generate", "--model", m, "--prompt-file", file.to_str().unwrap(), "--max-tokens", "6"]);
    assert_eq!((code, &by_file), (0, &by_flag), "{err}");
    // One thread (llama.cpp's -t 1): the same text, batch-invariant kernels.
    let (code, one_thread, err) = run(&["--threads", "1", "generate", "--model", m, "--prompt", "the cat sat", "--max-tokens", "6"]);
    assert_eq!((code, &one_thread), (0, &by_flag), "{err}");
    let mut child = Command::new(env!("CARGO_BIN_EXE_selfspec"))
        .args(["generate", "--model", m, "--prompt-file", "-", "--max-tokens", "6"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), b"the cat sat\r\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), by_flag, "{}", String::from_utf8_lossy(&out.stderr));
    // A system message changes the chat prompt; without --chat it is refused.
    let (code, with_system, err) = run(&["generate", "--model", m, "--chat", "--system", "be brief", "--prompt", "the cat sat", "--max-tokens", "6"]);
    assert_eq!(code, 0, "{err}");
    let (_, without, err_without) = run(&["generate", "--model", m, "--chat", "--prompt", "the cat sat", "--max-tokens", "6"]);
    let prompt_tokens = |e: &str| e.split("prompt ").nth(1).and_then(|r| r.split(' ').next()).and_then(|n| n.parse::<usize>().ok()).unwrap();
    assert!(prompt_tokens(&err) > prompt_tokens(&err_without), "{err} / {err_without}: {with_system:?} {without:?}");
    // --seed -1 draws a seed and prints it; given back, that seed repeats the sampled answer.
    let (code, drawn, err) = run(&["generate", "--model", m, "--prompt", "the cat sat", "--max-tokens", "8", "--temperature", "1", "--seed", "-1"]);
    assert_eq!(code, 0, "{err}");
    let seed = err.split("sampling with --seed ").nth(1).and_then(|r| r.split_whitespace().next()).expect("the seed is printed").to_string();
    let (code, again, err) = run(&["generate", "--model", m, "--prompt", "the cat sat", "--max-tokens", "8", "--temperature", "1", "--seed", &seed]);
    assert_eq!((code, &again), (0, &drawn), "{err}");
    // More than fits: said, not silently cut.
    let (code, _, err) = run(&["generate", "--model", m, "--prompt", "the cat sat", "--max-tokens", "100000"]);
    assert!(code == 0 && err.contains("more than fits"), "{err}");
    // Standard output closed before the first token: no error, exit 0, nothing decoded past it.
    let mut child = Command::new(env!("CARGO_BIN_EXE_selfspec"))
        .args(["generate", "--model", m, "--prompt", "the cat sat", "--max-tokens", "400"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(!err.contains("error") && !err.contains("stopped at"), "{err}");
}

/// `chat` as llama-cli's conversation mode is used with piped input: one answer per message,
/// each turn after the first starting from the last turn's cache, `/reset` starting over (the
/// same first message then gets the same greedy answer), and bad flags refused up front.
#[test]
fn chat_answers_each_piped_message_and_reuses_the_last_turn() {
    let (tiny, _) = tiny_gguf("cli-chat", 5);
    let m = tiny.to_str().unwrap();
    let chat = |input: &[u8], extra: &[&str]| {
        let mut child = Command::new(env!("CARGO_BIN_EXE_selfspec"))
            .args(["chat", "--model", m])
            .args(if extra.is_empty() { &["--max-tokens", "6"][..] } else { extra })
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // A run refused at its flags exits before reading: its closed input is no failure here.
        let _ = std::io::Write::write_all(&mut child.stdin.take().unwrap(), input);
        let out = child.wait_with_output().unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (code, out, err) = chat(b"the cat sat\nthe dog \\\nran\n\n/reset\nthe cat sat\n", &[]);
    assert_eq!(code, Some(0), "{err}");
    let answers: Vec<&str> = out.lines().collect();
    assert_eq!(answers.len(), 3, "one line per answer: {out:?}");
    assert_eq!(answers[0], answers[2], "after /reset the same message gets the same greedy answer");
    let cached: Vec<usize> = err.lines().filter_map(|l| l.split(", ").last()?.split(' ').next()?.parse().ok()).collect();
    assert_eq!(cached.len(), 3, "{err}");
    assert!(cached[0] == 0 && cached[1] > 0 && cached[2] == 0, "the second turn starts from the first's cache: {err}");
    assert!(err.contains("tau ") && err.contains("bonus token counted"), "{err}");
    let (code, _, err) = chat(b"hi\n", &["--max-tokens", "0"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("--max-tokens must be at least 1") && !err.contains("panicked"), "{err}");
}

/// `serve`'s sizes are checked before the model loads.
#[test]
fn serve_refuses_out_of_range_sizes_before_loading() {
    expect_error(&["serve", "--model", "never-read.gguf", "--prompt-cache", "2000000"], &["--prompt-cache", "1048576"]);
    expect_error(&["serve", "--model", "never-read.gguf", "--max-batch", "0"], &["--max-batch"]);
    expect_error(&["serve", "--model", "never-read.gguf", "--queue", "0"], &["--queue"]);
}
