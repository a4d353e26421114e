//! The server: a request's tokens equal `generate`'s whatever is served beside it (greedy and
//! seeded sampling, 8 at once), and its edges answer as OpenAI's API does (400, 401, 404, 413,
//! 503 with Retry-After, cancellation on disconnect, stop strings).
mod common;

use std::path::PathBuf;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use candle_core::Device;
use common::*;
use http_body_util::BodyExt;
use selfspec::cpu::quant::WeightFormat;
use selfspec::decode::generate::{generate_plain, Flow, StopRule};
use selfspec::decode::sampling::{rng, SamplingParams};
use selfspec::draft::drafter::{Drafter, DRAFTING_FORMAT};
use selfspec::model::loader::Target;
use selfspec::model::tokenizer::Message;
use selfspec::serve::{http, prepare, ServeConfig};
use selfspec::spec::plan::{Plan, DEFAULT_TREE};
use selfspec::spec::verify::Rule;
use selfspec::spec::{generate_spec, SpecOptions};
use serde_json::{json, Value};
use tower::ServiceExt;

fn layer_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("training/drafters/smollm2-layer")
}

fn load() -> (Target, Drafter) {
    let t = Target::load_with(&smollm2_path(), &Device::Cpu, WeightFormat::Native).unwrap();
    let mut d = Drafter::from_dir_noted(&layer_dir(), &t, DRAFTING_FORMAT).unwrap().0;
    d.release_f32_weights();
    (t, d)
}

/// `always_draft`: every step drafts, so the exactness test does not depend on whether drafting
/// happened to measure faster than plain batched decoding on this machine.
fn config(max_batch: usize, queue: usize, api_key: Option<&str>) -> ServeConfig {
    ServeConfig {
        addr: "127.0.0.1:0".parse().unwrap(),
        model_name: "smollm2".into(),
        plan: Plan::parse(DEFAULT_TREE).unwrap(),
        always_draft: true,
        max_batch,
        queue,
        body_limit: 64 * 1024,
        api_key: api_key.map(str::to_string),
        drafter_path: None,
        prompt_cache: 512 << 20,
    }
}

async fn call(app: &axum::Router, path: &str, body: Value, key: Option<&str>) -> (StatusCode, Value, Option<String>) {
    let mut req = Request::post(path).header("content-type", "application/json");
    if let Some(k) = key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let resp = app.clone().oneshot(req.body(Body::from(body.to_string())).unwrap()).await.unwrap();
    let status = resp.status();
    let retry = resp.headers().get("retry-after").map(|v| v.to_str().unwrap().to_string());
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null), retry)
}

fn prompts() -> Vec<String> {
    let p = selfspec::data::read_prompts(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("training/prompts/eval.jsonl")).unwrap();
    p.iter().take(8).map(|x| x.turns[0].clone()).collect()
}

#[test]
fn eight_concurrent_requests_get_exactly_what_generate_gives_them() {
    let (target, drafter) = load();
    let prompts = prompts();
    let sampled = SamplingParams { temperature: 0.8, top_p: 0.95, frequency_penalty: 0.2, ..Default::default() };
    // What `generate` gives, alone, for each prompt: greedy, and sampled with seed 100 + i.
    let plan = Plan::parse(DEFAULT_TREE).unwrap();
    let mut want = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let ids = target.prompt_ids(&[Message::new("user", p.clone())]).unwrap();
        for (params, seed) in [(SamplingParams::greedy(), 0u64), (sampled.clone(), 100 + i as u64)] {
            let stop = StopRule { max_new_tokens: 48, eos_ids: &target.tokenizer.eos_ids };
            let opts = SpecOptions { tree: plan.tree.clone(), lookup: plan.lookup, datastore: None, rule: Rule::for_params(&params, false), params: params.clone(), stop };
            let (out, _) = generate_spec(&target.model, &drafter, &ids, &opts, &mut rng(seed), &mut |_| Ok(Flow::Continue)).unwrap();
            let (plain, _) = generate_plain(&target.model, &ids, &params, &stop, &mut rng(seed), &mut |_| Ok(Flow::Continue)).unwrap();
            assert_eq!(out, plain, "prompt {i}: speculative and plain decoding differ");
            let eos = target.tokenizer.eos_ids.contains(out.last().unwrap());
            let text = target.tokenizer.decode(&out[..out.len() - eos as usize]).unwrap();
            want.push((text, out.len()));
        }
    }
    let (state, engine) = prepare(target, Some(drafter), None, &config(8, 64, None)).unwrap();
    let app = http::router(state, 64 * 1024);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        // All sixteen at once: eight decode side by side, eight wait in the queue and join as
        // places free up, so every request shares its forwards with varying company.
        let mut tasks = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            for (temp, seed) in [(0.0, 0u64), (0.8, 100 + i as u64)] {
                let mut body = json!({"model": "smollm2", "messages": [{"role": "user", "content": p}], "temperature": temp, "max_tokens": 48, "seed": seed});
                if temp > 0.0 {
                    body["top_p"] = json!(0.95);
                    body["frequency_penalty"] = json!(0.2);
                }
                let app = app.clone();
                tasks.push(tokio::spawn(async move { call(&app, "/v1/chat/completions", body, None).await }));
            }
        }
        let mut drafted = 0;
        for (k, t) in tasks.into_iter().enumerate() {
            let (status, v, _) = t.await.unwrap();
            assert_eq!(status, StatusCode::OK, "{v}");
            let text = v["choices"][0]["message"]["content"].as_str().unwrap();
            assert_eq!(text, want[k].0, "request {k} ({} prompt {}) differs from generate", if k % 2 == 0 { "greedy" } else { "sampled" }, k / 2);
            assert_eq!(v["usage"]["completion_tokens"].as_u64().unwrap() as usize, want[k].1);
            drafted += v["selfspec"]["accepted_draft_tokens"].as_u64().unwrap();
            assert!(v["selfspec"]["tau"].as_f64().unwrap() >= 1.0);
        }
        assert!(drafted > 50, "the drafter hardly ran ({drafted} accepted tokens): the test shows nothing");
        // Streaming gives the same text in OpenAI's chunks, ending with [DONE].
        let body = json!({"model": "smollm2", "messages": [{"role": "user", "content": prompts[0]}], "temperature": 0, "max_tokens": 48, "stream": true, "stream_options": {"include_usage": true}});
        let resp = app.clone().oneshot(Request::post("/v1/chat/completions").header("content-type", "application/json").body(Body::from(body.to_string())).unwrap()).await.unwrap();
        assert_eq!(resp.headers()["content-type"], "text/event-stream");
        let raw = String::from_utf8(resp.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
        let events: Vec<&str> = raw.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).collect();
        assert_eq!(*events.last().unwrap(), "[DONE]");
        let mut text = String::new();
        let mut marks = 0;
        // With include_usage, every chunk carries "usage": null and a last one, without
        // choices, the usage.
        let usage: Value = serde_json::from_str(events[events.len() - 2]).unwrap();
        assert_eq!((usage["choices"].as_array().map(Vec::len), usage["usage"]["completion_tokens"].as_u64()), (Some(0), Some(want[0].1 as u64)), "{usage}");
        for e in &events[..events.len() - 2] {
            let v: Value = serde_json::from_str(e).unwrap();
            assert_eq!(v["object"], "chat.completion.chunk");
            assert!(v.get("usage").is_some_and(Value::is_null), "{v}");
            text.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
            marks += v["selfspec"]["tokens"].as_array().map_or(0, |a| a.iter().filter(|m| m[1] == json!(true)).count());
        }
        assert_eq!(text, want[0].0);
        assert!(marks > 0, "no token was marked as drafted");
        // vLLM's continuous_usage_stats: every chunk the usage so far, ending at the final count.
        let body = json!({"model": "smollm2", "messages": [{"role": "user", "content": prompts[1]}], "temperature": 0, "max_tokens": 12, "stream": true, "stream_options": {"include_usage": true, "continuous_usage_stats": true}});
        let resp = app.clone().oneshot(Request::post("/v1/chat/completions").header("content-type", "application/json").body(Body::from(body.to_string())).unwrap()).await.unwrap();
        let raw = String::from_utf8(resp.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
        let counts: Vec<u64> = raw.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).filter(|e| *e != "[DONE]").map(|e| serde_json::from_str::<Value>(e).unwrap()["usage"]["completion_tokens"].as_u64().unwrap()).collect();
        assert!(counts.len() > 2 && counts.windows(2).all(|w| w[0] <= w[1]) && *counts.last().unwrap() == 12, "{counts:?}");
        let m = app.clone().oneshot(Request::get("/metrics").body(Body::empty()).unwrap()).await.unwrap();
        let m = String::from_utf8(m.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
        let requests: f64 = m.lines().find_map(|l| l.strip_prefix("selfspec_requests_total ")).unwrap().parse().unwrap();
        assert_eq!(requests, 18.0);
        assert!(m.contains("selfspec_tau ") && m.contains("# TYPE selfspec_batch_size gauge"), "{m}");
    });
    drop(app);
    rt.shutdown_background();
    engine.join().unwrap();
}

#[test]
fn bad_requests_get_openai_errors_and_the_server_keeps_going() {
    let (target, drafter) = load();
    let context = target.model.config().max_position;
    // The stop-string request below, decoded plainly: `usage` counts its tokens up to and
    // including the one that completes " 7", not those a step emitted after it.
    let ids = target.tokenizer.encode("1, 2, 3, 4,", true).unwrap();
    let (plain, _) = generate_plain(&target.model, &ids, &SamplingParams::greedy(), &StopRule { max_new_tokens: 30, eos_ids: &target.tokenizer.eos_ids }, &mut rng(0), &mut |_| Ok(Flow::Continue)).unwrap();
    let through_stop = (1..=plain.len()).find(|&n| target.tokenizer.decode(&plain[..n]).unwrap().contains(" 7")).expect("the plain answer reaches 7");
    // A character whose tokens run out at the end is dropped, not sent as U+FFFD.
    let cat = target.tokenizer.encode("猫", false).unwrap();
    assert!(cat.len() >= 2, "{cat:?}: the test needs a character of several tokens");
    let mut text = selfspec::TextStream::new(&target.tokenizer);
    assert_eq!(text.push(cat[0]).unwrap(), None);
    assert_eq!(text.finish().unwrap(), None);
    let mut text = selfspec::TextStream::new(&target.tokenizer);
    let whole: String = cat.iter().filter_map(|&t| text.push(t).unwrap()).collect();
    assert_eq!(whole + &text.finish().unwrap().unwrap_or_default(), "猫");
    let france = target.tokenizer.encode("The capital of France is", true).unwrap();
    let (state, engine) = prepare(target, Some(drafter), None, &config(1, 1, Some("sesame"))).unwrap();
    let app = http::router(state, 64 * 1024);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let key = Some("sesame");
        let ok = json!({"model": "smollm2", "prompt": "The capital of France is", "temperature": 0, "max_tokens": 4});
        let (s, v, _) = call(&app, "/v1/completions", ok.clone(), None).await;
        assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::UNAUTHORIZED, Some("invalid_api_key")));
        let (s, _, _) = call(&app, "/v1/completions", ok.clone(), Some("wrong")).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED);
        let (s, _, _) = call(&app, "/tokenize", json!({"prompt": "hi"}), None).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED, "the tokenizer endpoints are behind the key too");
        let (s, v, _) = call(&app, "/v1/completions", ok.clone(), key).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(v["object"], "text_completion");
        assert!(!v["choices"][0]["text"].as_str().unwrap().is_empty());
        // The same prompt as token ids; the scheme's name in any case (RFC 7235).
        let resp = app.clone().oneshot(Request::post("/v1/completions").header("authorization", "bearer sesame").body(Body::from(json!({"model": "smollm2", "prompt": france, "temperature": 0, "max_tokens": 4}).to_string())).unwrap()).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let by_ids: Value = serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
        assert_eq!(by_ids["choices"][0]["text"], v["choices"][0]["text"]);
        // vLLM's ignore_eos: a question answered in a few tokens runs on to max_tokens.
        let q = json!({"model": "smollm2", "messages": [{"role": "user", "content": "What is 2+2? Answer with one digit."}], "temperature": 0, "max_tokens": 40});
        let (_, short, _) = call(&app, "/v1/chat/completions", q.clone(), key).await;
        let mut long_q = q.clone();
        long_q["ignore_eos"] = json!(true);
        let (s, long_v, _) = call(&app, "/v1/chat/completions", long_q, key).await;
        assert_eq!(s, StatusCode::OK, "{long_v}");
        assert!(short["usage"]["completion_tokens"].as_u64().unwrap() < 40 && short["choices"][0]["finish_reason"] == "stop", "{short}");
        assert_eq!((long_v["usage"]["completion_tokens"].as_u64(), long_v["choices"][0]["finish_reason"].as_str()), (Some(40), Some("length")), "{long_v}");
        // The model by id; a wrong method is a JSON 405.
        let get = |path: &str| Request::get(path).header("authorization", "Bearer sesame").body(Body::empty()).unwrap();
        let r = app.clone().oneshot(get("/v1/models/smollm2")).await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        let r = app.clone().oneshot(get("/v1/models/openai/gpt-4")).await.unwrap();
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
        let v404: Value = serde_json::from_slice(&r.into_body().collect().await.unwrap().to_bytes()).unwrap();
        assert_eq!((v404["error"]["code"].as_str(), v404["error"]["param"].as_str()), (Some("model_not_found"), Some("model")));
        let r = app.clone().oneshot(get("/v1/chat/completions")).await.unwrap();
        assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
        let v405: Value = serde_json::from_slice(&r.into_body().collect().await.unwrap().to_bytes()).unwrap();
        assert_eq!(v405["error"]["code"], "method_not_allowed");
        // Malformed JSON, an unknown model, unsupported parameters, a prompt past the context.
        let resp = app.clone().oneshot(Request::post("/v1/chat/completions").header("authorization", "Bearer sesame").body(Body::from("{\"model\": ")).unwrap()).await.unwrap();
        assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
        let (s, v, _) = call(&app, "/v1/chat/completions", json!({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}), key).await;
        assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::NOT_FOUND, Some("model_not_found")));
        // More choices than the queue holds (--queue 1 here), or than a request may ask.
        for n in [3, 65] {
            let (s, v, _) = call(&app, "/v1/chat/completions", json!({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "n": n}), key).await;
            assert_eq!((s, v["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some("n")), "n = {n}: {v}");
        }
        let (s, v, _) = call(&app, "/v1/chat/completions", json!({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}), key).await;
        assert_eq!((s, v["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some("tools")));
        let long = "word ".repeat(context + 10);
        let (s, v, _) = call(&app, "/v1/completions", json!({"model": "smollm2", "prompt": long.clone()}), key).await;
        assert_eq!((s, v["error"]["code"].as_str(), v["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some("context_length_exceeded"), Some("prompt")));
        // A body over the limit: 413 before it is parsed.
        let huge = json!({"model": "smollm2", "prompt": "x".repeat(100_000)});
        let (s, v, _) = call(&app, "/v1/completions", huge, key).await;
        assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::PAYLOAD_TOO_LARGE, Some("request_too_large")), "{v}");
        // A stop string ends the answer before it, with finish_reason "stop".
        let (s, v, _) = call(&app, "/v1/completions", json!({"model": "smollm2", "prompt": "1, 2, 3, 4,", "temperature": 0, "max_tokens": 30, "stop": [" 7"]}), key).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        let text = v["choices"][0]["text"].as_str().unwrap();
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{text:?}");
        assert!(text.contains('6') && !text.contains('7'), "{text:?}");
        assert_eq!(v["usage"]["completion_tokens"].as_u64().unwrap() as usize, through_stop, "{v}");
        assert!(through_stop < plain.len(), "the test needs tokens after the stop string");
        // One place in the batch and one in the queue: of six long requests at once, some are
        // refused with 503 and Retry-After, and the rest are answered.
        let mut tasks = Vec::new();
        for _ in 0..6 {
            let app = app.clone();
            let body = json!({"model": "smollm2", "prompt": "Once upon a time", "temperature": 0, "max_tokens": 120});
            tasks.push(tokio::spawn(async move { call(&app, "/v1/completions", body, Some("sesame")).await }));
        }
        let (mut served, mut refused) = (0, 0);
        for t in tasks {
            match t.await.unwrap() {
                (StatusCode::OK, _, _) => served += 1,
                (StatusCode::SERVICE_UNAVAILABLE, v, retry) => {
                    assert_eq!(retry.as_deref(), Some("1"));
                    assert_eq!(v["error"]["code"], "server_busy");
                    refused += 1;
                }
                other => panic!("{other:?}"),
            }
        }
        assert!(served >= 1 && refused >= 1 && served + refused == 6, "{served} served, {refused} refused");
        // A client that leaves mid-stream: its sequence is cancelled and the server goes on.
        let body = json!({"model": "smollm2", "prompt": "Once upon a time", "temperature": 0, "max_tokens": 400, "stream": true});
        let resp = app.clone().oneshot(Request::post("/v1/completions").header("authorization", "Bearer sesame").body(Body::from(body.to_string())).unwrap()).await.unwrap();
        let mut b = resp.into_body();
        let first = b.frame().await.unwrap().unwrap();
        assert!(first.is_data());
        drop(b);
        let metrics = async || {
            let r = app.clone().oneshot(Request::get("/metrics").header("authorization", "Bearer sesame").body(Body::empty()).unwrap()).await.unwrap();
            String::from_utf8(r.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap()
        };
        let mut cancelled = false;
        for _ in 0..100 {
            if metrics().await.lines().any(|l| l == "selfspec_requests_cancelled_total 1") {
                cancelled = true;
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        assert!(cancelled, "{}", metrics().await);
        let (s, _, _) = call(&app, "/v1/completions", ok, key).await;
        assert_eq!(s, StatusCode::OK);
        let health = app.clone().oneshot(Request::get("/health").body(Body::empty()).unwrap()).await.unwrap();
        assert_eq!(health.status(), StatusCode::OK, "the engine runs on after errors and cancellations");
        // The page is served without the key, as one self-contained file.
        let page = app.clone().oneshot(Request::get("/").body(Body::empty()).unwrap()).await.unwrap();
        assert_eq!(page.status(), StatusCode::OK);
        let html = String::from_utf8(page.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
        assert!(html.contains("/v1/chat/completions") && !html.contains("http://") && !html.contains("https://"));
    });
    drop(app);
    rt.shutdown_background();
    engine.join().unwrap();
}

/// A token's text, its log-probability and the alternatives', as the server should list them.
type Expected = (String, f32, Vec<(String, f32)>);

/// Log-probabilities in OpenAI's shapes (chat's `content` list, completions' parallel lists),
/// streamed or whole: with the drafter and three requests in each forward they are exactly
/// plain decoding's, alone, token for token.
#[test]
fn logprobs_come_back_as_plain_decoding_gives_them_in_each_endpoints_shape() {
    use selfspec::cpu::reduce::row_to_vec;
    use selfspec::decode::sampling::token_logprobs;
    use selfspec::spec::Sequence;
    let (target, drafter) = load();
    let prompts = prompts();
    // Plain decoding's log-probabilities, alone, for the first three prompts (greedy, 24 tokens).
    let mut want = Vec::new();
    for p in &prompts[..3] {
        let ids = target.prompt_ids(&[Message::new("user", p.clone())]).unwrap();
        let params = SamplingParams::greedy();
        let stop = StopRule { max_new_tokens: 24, eos_ids: &target.tokenizer.eos_ids };
        let plan = Plan::parse("chain:1").unwrap();
        let opts = SpecOptions { tree: plan.tree, lookup: None, datastore: None, rule: Rule::Greedy, params, stop };
        let mut seq = Sequence::new(&target.model, None, &ids, opts, rng(0)).unwrap().with_logprobs(2);
        run_alone(&target.model, &mut seq);
        let lps: Vec<Expected> = seq
            .logprobs()
            .iter()
            .map(|l| (target.tokenizer.token_bytes(l.token).unwrap().0, l.logprob, l.top.iter().map(|&(id, x)| (target.tokenizer.token_bytes(id).unwrap().0, x)).collect()))
            .collect();
        want.push(lps);
    }
    // lm-evaluation-harness's scoring request (token ids, echo, one new token, logprobs 1):
    // each prompt token's log-probability given those before it, from one causal forward.
    let scored = target.tokenizer.encode("The quick brown fox jumps over the lazy dog.", true).unwrap();
    let mut cache = target.model.new_cache().unwrap();
    let hidden = target.model.forward_causal(&scored, &mut cache).unwrap();
    let logits = target.model.logits(&hidden).unwrap();
    let prompt_want: Vec<f32> = (1..scored.len()).map(|i| token_logprobs(&row_to_vec(&logits, i - 1).unwrap(), scored[i], 1).logprob).collect();
    // Two prompts x n = 2, sampled with seed 5: choice k is prompt k / 2 decoded alone with seed
    // 5 + k, as plain sampling gives it.
    // SmolLM2's pieces are GPT-2 byte-level: "Ġthe" is " the".
    let the = target.tokenizer.token_to_id("\u{0120}the").unwrap();
    assert_eq!(target.tokenizer.token_bytes(the).unwrap(), (" the".to_string(), b" the".to_vec()));
    let batch = ["The sea is", "My favourite book"];
    let sampled = SamplingParams { temperature: 0.8, ..Default::default() };
    let mut choices_want = Vec::new();
    for k in 0..4 {
        let ids = target.tokenizer.encode(batch[k / 2], true).unwrap();
        let stop = StopRule { max_new_tokens: 12, eos_ids: &target.tokenizer.eos_ids };
        let (out, _) = generate_plain(&target.model, &ids, &sampled, &stop, &mut rng(5 + k as u64), &mut |_| Ok(Flow::Continue)).unwrap();
        let eos = target.tokenizer.eos_ids.contains(out.last().unwrap());
        choices_want.push(target.tokenizer.decode(&out[..out.len() - eos as usize]).unwrap());
    }
    let batch_prompt_tokens: usize = batch.iter().map(|p| target.tokenizer.encode(p, true).unwrap().len()).sum();
    let (state, engine) = prepare(target, Some(drafter), None, &config(4, 8, None)).unwrap();
    let app = http::router(state, 64 * 1024);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let (s, v, _) = call(&app, "/v1/completions", json!({"model": "smollm2", "prompt": scored, "temperature": 0, "max_tokens": 1, "logprobs": 1, "echo": true, "seed": 1234}), None).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        let lp = &v["choices"][0]["logprobs"];
        let got = lp["token_logprobs"].as_array().unwrap();
        assert_eq!(got.len(), scored.len() + 1, "{v}");
        assert!(got[0].is_null() && lp["top_logprobs"][0].is_null(), "{v}");
        for (i, w) in prompt_want.iter().enumerate() {
            assert_eq!(got[i + 1].as_f64().unwrap() as f32, *w, "prompt token {}", i + 1);
        }
        let text = v["choices"][0]["text"].as_str().unwrap();
        assert!(text.starts_with("The quick brown fox jumps over the lazy dog."), "{text:?}");
        let tokens: Vec<&str> = lp["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
        assert_eq!(tokens.concat(), text);
        assert_eq!(v["usage"]["completion_tokens"], 1);
        // The tokenizer endpoints lm-evaluation-harness's remote tokenizer reads (vLLM's shapes,
        // llama.cpp's `content` too): ids and text round-trip, specials and the template listed.
        let (s, v, _) = call(&app, "/tokenize", json!({"prompt": "The quick brown fox jumps over the lazy dog.", "add_special_tokens": true}), None).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(v["tokens"], json!(scored));
        assert_eq!((v["count"].as_u64(), v["max_model_len"].as_u64()), (Some(scored.len() as u64), Some(8192)), "{v}");
        let (_, v2, _) = call(&app, "/tokenize", json!({"content": "<|im_end|>", "add_special_tokens": false}), None).await;
        assert_eq!(v2["tokens"].as_array().map(Vec::len), Some(1), "an end-of-sequence marker is one token: {v2}");
        let (s, v, _) = call(&app, "/detokenize", json!({"tokens": scored}), None).await;
        assert_eq!((s, v["prompt"].as_str(), v["content"].as_str()), (StatusCode::OK, Some("The quick brown fox jumps over the lazy dog."), Some("The quick brown fox jumps over the lazy dog.")), "{v}");
        let info = app.clone().oneshot(Request::get("/tokenizer_info").body(Body::empty()).unwrap()).await.unwrap();
        let info: Value = serde_json::from_slice(&info.into_body().collect().await.unwrap().to_bytes()).unwrap();
        assert_eq!(info["eos_token"], "<|im_end|>");
        assert!(info["chat_template"].as_str().is_some_and(|t| t.contains("im_start")), "{info}");
        for (path, body, param) in [
            ("/tokenize", json!({"prompt": "a", "content": "b"}), "content"),
            ("/tokenize", json!({"text": "a"}), "text"),
            ("/tokenize", json!({}), "prompt"),
            ("/detokenize", json!({"tokens": [1, 10000000]}), "tokens"),
            ("/detokenize", json!({"tokens": [-1]}), "tokens[0]"),
        ] {
            let (s, v, _) = call(&app, path, body.clone(), None).await;
            assert_eq!((s, v["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some(param)), "{path} {body}: {v}");
        }
        let (s, _, _) = call(&app, "/tokenize", json!({"prompt": "a", "model": "other"}), None).await;
        assert_eq!(s, StatusCode::NOT_FOUND);
        // n choices per prompt, prompts in a batch: OpenAI's order, each seeded by its index.
        let (s, v, _) = call(&app, "/v1/completions", json!({"model": "smollm2", "prompt": batch, "n": 2, "temperature": 0.8, "seed": 5, "max_tokens": 12}), None).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        let got: Vec<(u64, &str)> = v["choices"].as_array().unwrap().iter().map(|c| (c["index"].as_u64().unwrap(), c["text"].as_str().unwrap())).collect();
        assert_eq!(got, choices_want.iter().enumerate().map(|(k, t)| (k as u64, t.as_str())).collect::<Vec<_>>());
        assert_eq!(v["usage"]["prompt_tokens"].as_u64(), Some(batch_prompt_tokens as u64), "each prompt counted once: {v}");
        assert!(v["choices"][3]["selfspec"]["tau"].as_f64().unwrap() >= 1.0 && v["selfspec"]["target_forwards"].as_u64().unwrap() > 0, "{v}");
        // Streamed, the choices interleave by index and add up to the same texts.
        let body = json!({"model": "smollm2", "prompt": batch, "n": 2, "temperature": 0.8, "seed": 5, "max_tokens": 12, "stream": true, "stream_options": {"include_usage": true}});
        let resp = app.clone().oneshot(Request::post("/v1/completions").header("content-type", "application/json").body(Body::from(body.to_string())).unwrap()).await.unwrap();
        let raw = String::from_utf8(resp.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
        let mut texts = vec![String::new(); 4];
        let mut finished = 0;
        let events: Vec<Value> = raw.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).filter(|e| *e != "[DONE]").map(|e| serde_json::from_str(e).unwrap()).collect();
        for e in &events {
            if let Some(c) = e["choices"].as_array().and_then(|c| c.first()) {
                texts[c["index"].as_u64().unwrap() as usize].push_str(c["text"].as_str().unwrap());
                finished += c["finish_reason"].is_string() as usize;
            }
        }
        assert_eq!((texts, finished), (choices_want.clone(), 4));
        assert_eq!(events.last().unwrap()["usage"]["completion_tokens"], v["usage"]["completion_tokens"]);
        // Echo on chat is refused.
        let (s, v, _) = call(&app, "/v1/chat/completions", json!({"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "echo": true}), None).await;
        assert_eq!((s, v["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some("echo")), "{v}");
        let chat = |p: &str| json!({"model": "smollm2", "messages": [{"role": "user", "content": p}], "temperature": 0, "max_tokens": 24, "logprobs": true, "top_logprobs": 2});
        let mut tasks = Vec::new();
        for p in &prompts[..3] {
            let (app, body) = (app.clone(), chat(p));
            tasks.push(tokio::spawn(async move { call(&app, "/v1/chat/completions", body, None).await }));
        }
        let mut tau = 0.0;
        for (k, t) in tasks.into_iter().enumerate() {
            let (s, v, _) = t.await.unwrap();
            assert_eq!(s, StatusCode::OK, "{v}");
            let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
            assert_eq!(content.len(), want[k].len(), "{v}");
            for (c, (tok, lp, top)) in content.iter().zip(&want[k]) {
                assert_eq!((c["token"].as_str().unwrap(), c["logprob"].as_f64().unwrap() as f32), (tok.as_str(), *lp), "request {k}");
                assert_eq!(c["bytes"].as_array().unwrap().len(), tok.len());
                let got: Vec<(String, f32)> = c["top_logprobs"].as_array().unwrap().iter().map(|t| (t["token"].as_str().unwrap().to_string(), t["logprob"].as_f64().unwrap() as f32)).collect();
                assert_eq!(&got, top);
            }
            tau += v["selfspec"]["tau"].as_f64().unwrap();
        }
        assert!(tau > 3.3, "the drafter hardly ran (τ summed over three requests {tau:.2})");
        // Streamed, the chunks' entries add up to the whole answer's.
        let mut body = chat(&prompts[0]);
        body["stream"] = json!(true);
        let resp = app.clone().oneshot(Request::post("/v1/chat/completions").header("content-type", "application/json").body(Body::from(body.to_string())).unwrap()).await.unwrap();
        let raw = String::from_utf8(resp.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
        let streamed: Vec<(String, f32)> = raw
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter(|e| *e != "[DONE]")
            .flat_map(|e| serde_json::from_str::<Value>(e).unwrap()["choices"][0]["logprobs"]["content"].as_array().cloned().unwrap_or_default())
            .map(|c| (c["token"].as_str().unwrap().to_string(), c["logprob"].as_f64().unwrap() as f32))
            .collect();
        assert_eq!(streamed, want[0].iter().map(|w| (w.0.clone(), w.1)).collect::<Vec<_>>());
        // Completions: tokens, their log-probabilities, maps of the alternatives with the chosen
        // token, and where each token's text starts.
        let (s, v, _) = call(&app, "/v1/completions", json!({"model": "smollm2", "prompt": "The capital of France is", "temperature": 0, "max_tokens": 8, "logprobs": 2}), None).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        let (text, lp) = (v["choices"][0]["text"].as_str().unwrap(), &v["choices"][0]["logprobs"]);
        let tokens: Vec<&str> = lp["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
        assert_eq!(tokens.concat(), text);
        let offsets: Vec<usize> = lp["text_offset"].as_array().unwrap().iter().map(|o| o.as_u64().unwrap() as usize).collect();
        let starts: Vec<usize> = tokens.iter().scan(0, |at, t| Some(std::mem::replace(at, *at + t.chars().count()))).collect();
        assert_eq!(offsets, starts);
        for (i, m) in lp["top_logprobs"].as_array().unwrap().iter().enumerate() {
            let m = m.as_object().unwrap();
            assert!((2..=3).contains(&m.len()) && m[tokens[i]] == lp["token_logprobs"][i], "{m:?}");
        }
        // Without asking: null, as OpenAI answers.
        let (_, v, _) = call(&app, "/v1/completions", json!({"model": "smollm2", "prompt": "Hi", "max_tokens": 2}), None).await;
        assert!(v["choices"][0]["logprobs"].is_null(), "{v}");
        let (s, v, _) = call(&app, "/v1/chat/completions", json!({"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 3}), None).await;
        assert_eq!((s, v["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some("top_logprobs")), "{v}");
    });
    drop(app);
    rt.shutdown_background();
    engine.join().unwrap();
}

/// A chat's second turn starts from the first turn's kept cache: it runs only its new tokens,
/// says so in `usage.prompt_tokens_details.cached_tokens`, and answers exactly what `generate`
/// gives on the whole conversation (greedy and seeded sampling, with the drafter), as it does
/// with `cache_prompt: false` or the cache turned off.
#[test]
fn a_second_turn_reuses_the_first_turns_cache_and_answers_the_same() {
    let (target, drafter) = load();
    let p = prompts();
    let turn1 = vec![Message::new("user", p[2].clone())];
    let sampled = SamplingParams { temperature: 0.8, top_p: 0.95, ..Default::default() };
    let generate = |msgs: &[Message], params: &SamplingParams, seed: u64| -> String {
        let ids = target.prompt_ids(msgs).unwrap();
        let stop = StopRule { max_new_tokens: 40, eos_ids: &target.tokenizer.eos_ids };
        let (out, _) = generate_plain(&target.model, &ids, params, &stop, &mut rng(seed), &mut |_| Ok(Flow::Continue)).unwrap();
        let eos = target.tokenizer.eos_ids.contains(out.last().unwrap());
        target.tokenizer.decode(&out[..out.len() - eos as usize]).unwrap()
    };
    let answer1 = generate(&turn1, &SamplingParams::greedy(), 0);
    let mut turn2 = turn1.clone();
    turn2.push(Message::new("assistant", answer1.clone()));
    turn2.push(Message::new("user", "Now say it again in fewer words.".to_string()));
    let turn1_len = target.prompt_ids(&turn1).unwrap().len();
    let want_greedy = generate(&turn2, &SamplingParams::greedy(), 0);
    let want_sampled = generate(&turn2, &sampled, 5);
    // A fixed tree: the drafter's work is then deterministic, so a drafter that resumed from
    // the kept states drafts exactly as one started on a fresh prefill does.
    let cfg = ServeConfig { plan: Plan::parse("chain:3").unwrap(), ..config(4, 16, None) };
    let (state, engine) = prepare(target, Some(drafter), None, &cfg).unwrap();
    let app = http::router(state, 64 * 1024);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let mut greedy_runs = Vec::new();
        let chat = |msgs: Value, extra: Value| {
            let mut body = json!({"model": "smollm2", "messages": msgs, "temperature": 0, "max_tokens": 40});
            body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            body
        };
        let m1 = json!([{"role": "user", "content": p[2]}]);
        let (s, v, _) = call(&app, "/v1/chat/completions", chat(m1, json!({})), None).await;
        assert_eq!((s, v["choices"][0]["message"]["content"].as_str()), (StatusCode::OK, Some(answer1.as_str())), "{v}");
        let m2 = json!([{"role": "user", "content": p[2]}, {"role": "assistant", "content": answer1}, {"role": "user", "content": "Now say it again in fewer words."}]);
        for (extra, want, cached) in [
            (json!({}), &want_greedy, true),
            (json!({"temperature": 0.8, "top_p": 0.95, "seed": 5}), &want_sampled, true),
            (json!({"cache_prompt": false}), &want_greedy, false),
            (json!({"stream": true, "stream_options": {"include_usage": true}}), &want_greedy, true),
        ] {
            let streamed = extra.get("stream").is_some();
            let body = chat(m2.clone(), extra.clone());
            let (text, usage, ext) = if streamed {
                let resp = app.clone().oneshot(Request::post("/v1/chat/completions").header("content-type", "application/json").body(Body::from(body.to_string())).unwrap()).await.unwrap();
                let raw = String::from_utf8(resp.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
                let chunks: Vec<Value> = raw.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).filter(|e| *e != "[DONE]").map(|e| serde_json::from_str(e).unwrap()).collect();
                let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
                let last = chunks.last().unwrap();
                (text, last["usage"].clone(), last["selfspec"].clone())
            } else {
                let (s, v, _) = call(&app, "/v1/chat/completions", body, None).await;
                assert_eq!(s, StatusCode::OK, "{v}");
                (v["choices"][0]["message"]["content"].as_str().unwrap().to_string(), v["usage"].clone(), v["selfspec"].clone())
            };
            assert_eq!(&text, want, "{extra}: the second turn differs from generate's");
            let hit = usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() as usize;
            let prompt = usage["prompt_tokens"].as_u64().unwrap() as usize;
            if cached {
                // At least the first turn's prompt (and most of its answer) came from the cache.
                assert!(hit > turn1_len && hit < prompt, "{extra}: {hit} of {prompt} cached, first turn {turn1_len}");
            } else {
                assert_eq!(hit, 0, "{extra}");
            }
            assert!(ext["accepted_draft_tokens"].as_u64().unwrap() > 0, "{extra}: the drafter accepted nothing");
            if extra.get("seed").is_none() {
                greedy_runs.push((ext["accepted_draft_tokens"].clone(), ext["target_forwards"].clone()));
            }
        }
        assert!(greedy_runs.windows(2).all(|w| w[0] == w[1]), "the drafter drafted differently after resuming: {greedy_runs:?}");
        let m = app.clone().oneshot(Request::get("/metrics").body(Body::empty()).unwrap()).await.unwrap();
        let m = String::from_utf8(m.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
        let hits: f64 = m.lines().find_map(|l| l.strip_prefix("selfspec_prompt_cache_hits_total ")).unwrap().parse().unwrap();
        assert_eq!(hits, 3.0, "{m}");
        assert!(m.lines().any(|l| l.strip_prefix("selfspec_prompt_cache_bytes ").is_some_and(|v| v.parse::<f64>().unwrap() > 0.0)), "{m}");
    });
    drop(app);
    rt.shutdown_background();
    engine.join().unwrap();
}
