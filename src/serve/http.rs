//! The HTTP side (axum): OpenAI's endpoints, `/health`, `/metrics` and the page at `/`.
//! Handlers parse, check and tokenize; the engine decodes; its events become a JSON answer or
//! server-sent events. A client that goes away drops its receiver, which the engine sees and
//! ends the sequence (freeing its KV cache).
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::model::loader::Target;
use crate::serve::api::{parse, ApiError, Decoding, DetokenizeRequest, Prompt, Request as ApiRequest, TokenizeRequest, MAX_CHOICES};
use crate::serve::engine::{EngineHandle, Event, Job, Refused, Summary, TokenLogprob};

/// The page at `/`: one self-contained file (no framework, no CDN).
pub const PAGE: &str = include_str!("page.html");

/// What every handler shares.
pub struct AppState {
    pub engine: EngineHandle,
    pub target: Arc<Target>,
    /// The name requests must give as `model`.
    pub model_name: String,
    pub api_key: Option<String>,
    pub drafter: Option<String>,
    /// Requests the engine's queue holds (`--queue`): a request's choices must fit in it.
    pub queue: usize,
    pub started: u64,
    pub next_id: AtomicU64,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::BAD_REQUEST);
        (status, Json(self.body())).into_response()
    }
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The router: the API under `/v1` (behind the key when there is one), the rest open.
pub fn router(state: Arc<AppState>, body_limit: usize) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route("/metrics", get(metrics))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/tokenizer_info", get(tokenizer_info))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .route("/", get(|| async { Html(PAGE) }))
        .route("/health", get(health))
        .merge(api)
        .fallback(|| async { ApiError { status: 404, message: "no such endpoint".into(), kind: "invalid_request_error", param: None, code: Some("not_found") } })
        .method_not_allowed_fallback(|req: Request| async move { ApiError { status: 405, message: format!("{} is not allowed on {}", req.method(), req.uri().path()), kind: "invalid_request_error", param: None, code: Some("method_not_allowed") } })
        .layer(tower_http::limit::RequestBodyLimitLayer::new(body_limit))
        .layer(axum::middleware::map_response(json_payload_too_large))
        .with_state(state)
}

/// The body limit's 413 (plain text from tower-http, or from the JSON extractor when a streamed
/// body passes the limit) as the same JSON error object every other refusal is.
async fn json_payload_too_large(res: Response) -> Response {
    let is_json = res.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|v| v.starts_with("application/json"));
    if res.status() != StatusCode::PAYLOAD_TOO_LARGE || is_json {
        return res;
    }
    ApiError { status: 413, message: "the request body is larger than this server accepts (--max-body)".into(), kind: "invalid_request_error", param: None, code: Some("request_too_large") }.into_response()
}

async fn auth(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &s.api_key {
        let given = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(bearer);
        if !given.is_some_and(|g| same_key(g.as_bytes(), key.as_bytes())) {
            return ApiError { status: 401, message: "a valid API key is required (Authorization: Bearer KEY)".into(), kind: "invalid_request_error", param: None, code: Some("invalid_api_key") }.into_response();
        }
    }
    next.run(req).await
}

/// The credentials of an `Authorization: Bearer ...` header (the scheme's name is
/// case-insensitive, RFC 7235).
fn bearer(v: &str) -> Option<&str> {
    let (scheme, rest) = v.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
}

/// Compare keys in time that depends on their lengths only, not on where they first differ.
fn same_key(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// 200 while the engine decodes; 503 once it has stopped (a load balancer then looks elsewhere).
async fn health(State(s): State<Arc<AppState>>) -> Response {
    if s.engine.is_running() {
        Json(json!({"status": "ok"})).into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "engine stopped"}))).into_response()
    }
}

/// The served model as `/v1/models` lists it.
fn model_card(s: &AppState) -> Value {
    json!({"id": s.model_name, "object": "model", "created": s.started, "owned_by": "selfspec",
        "selfspec": {"path": s.target.path.display().to_string(), "weights": s.target.model.weight_format().to_string(), "context": s.target.model.config().max_position, "drafter": s.drafter}})
}

async fn models(State(s): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_card(&s)]}))
}

/// `GET /v1/models/{id}` (the SDKs' `models.retrieve`).
async fn model(State(s): State<Arc<AppState>>, axum::extract::Path(id): axum::extract::Path<String>) -> Response {
    if id == s.model_name {
        Json(model_card(&s)).into_response()
    } else {
        ApiError { status: 404, message: format!("the model '{id}' does not exist (this server serves '{}')", s.model_name), kind: "invalid_request_error", param: Some("model".into()), code: Some("model_not_found") }.into_response()
    }
}

async fn metrics(State(s): State<Arc<AppState>>) -> impl IntoResponse {
    let m = &s.engine.metrics;
    let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let steps = g(&m.sequence_steps);
    let decode_tokens = g(&m.decode_tokens);
    let busy = g(&m.busy_micros) as f64 / 1e6;
    let mut out = String::new();
    let mut put = |name: &str, kind: &str, help: &str, v: f64| {
        out.push_str(&format!("# HELP selfspec_{name} {help}\n# TYPE selfspec_{name} {kind}\nselfspec_{name} {v}\n"));
    };
    put("requests_total", "counter", "Sequences admitted to decoding (each choice of a request with n or a prompt batch counts).", g(&m.requests) as f64);
    put("requests_failed_total", "counter", "Sequences that ended in an error.", g(&m.requests_failed) as f64);
    put("requests_rejected_total", "counter", "Requests refused because the queue had no room for all their choices.", g(&m.requests_rejected) as f64);
    put("requests_cancelled_total", "counter", "Requests whose client went away before the end.", g(&m.requests_cancelled) as f64);
    put("requests_length_total", "counter", "Requests that ran out of tokens rather than stopping.", g(&m.requests_length) as f64);
    put("prompt_tokens_total", "counter", "Prompt tokens of admitted sequences (cached ones included).", g(&m.prompt_tokens) as f64);
    put("cached_prompt_tokens_total", "counter", "Prompt tokens taken from the prompt cache instead of being run.", g(&m.cached_prompt_tokens) as f64);
    put("prompt_cache_hits_total", "counter", "Sequences that started from a kept prompt's cache.", g(&m.prompt_cache_hits) as f64);
    put("prompt_cache_bytes", "gauge", "Bytes the prompt cache holds (KV caches, and target states for the drafter).", m.prompt_cache_bytes.load(Ordering::Relaxed) as f64);
    put("completion_tokens_total", "counter", "Tokens generated.", g(&m.completion_tokens) as f64);
    put("accepted_draft_tokens_total", "counter", "Generated tokens the drafter proposed and the target accepted.", g(&m.accepted_draft_tokens) as f64);
    put("sequence_steps_total", "counter", "Decode steps summed over sequences (one per sequence per forward).", steps as f64);
    put("forwards_total", "counter", "Target forwards (each over every active sequence).", g(&m.forwards) as f64);
    put("forward_rows_total", "counter", "Rows (tree nodes and prompt tokens) through the target.", g(&m.forward_rows) as f64);
    put("tau", "gauge", "Tokens emitted per target forward per sequence, the bonus token counted (plain decoding = 1.0).", if steps == 0 { 1.0 } else { decode_tokens as f64 / steps as f64 });
    put("accepted_tokens_per_step", "gauge", "Drafted tokens accepted per sequence-step.", if steps == 0 { 0.0 } else { g(&m.accepted_draft_tokens) as f64 / steps as f64 });
    put("tokens_per_second", "gauge", "Generated tokens per second of decoding (busy time).", if busy > 0.0 { g(&m.completion_tokens) as f64 / busy } else { 0.0 });
    put("last_step_tokens_per_second", "gauge", "Tokens per second of the last step.", g(&m.last_tok_s_milli) as f64 / 1e3);
    put("queue_depth", "gauge", "Requests waiting for a place in the batch.", m.queue_depth.load(Ordering::Relaxed) as f64);
    put("batch_size", "gauge", "Sequences being decoded (0 when idle).", m.batch_size.load(Ordering::Relaxed) as f64);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out)
}

/// Which endpoint answers: shapes its JSON.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Completion,
}

async fn chat(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    let st = s.clone();
    let parsed = blocking(move || {
        let req: ApiRequest = parse(&body)?;
        let d = req.decoding(&st.model_name, true)?;
        let messages = req.messages()?;
        let ids = st.target.prompt_ids(&messages).map_err(|e| ApiError::invalid(Some("messages"), e.to_string()))?;
        Ok((ids, d))
    })
    .await;
    match parsed {
        Ok((ids, d)) => answer(&s, Kind::Chat, vec![ids], vec![None], d).await,
        Err(e) => e.into_response(),
    }
}

async fn completions(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    let st = s.clone();
    let parsed = blocking(move || {
        let req: ApiRequest = parse(&body)?;
        let d = req.decoding(&st.model_name, false)?;
        let prompts = req.prompt(st.target.model.config().vocab_size)?;
        let tok = &st.target.tokenizer;
        let bad = |e: crate::Error| ApiError::invalid(Some("prompt"), e.to_string());
        let (mut ids, mut echoes) = (Vec::with_capacity(prompts.len()), Vec::with_capacity(prompts.len()));
        for p in prompts {
            let (i, text) = match p {
                Prompt::Text(text) => (tok.encode(&text, true).map_err(bad)?, text),
                Prompt::Ids(i) => {
                    let text = if d.echo { tok.decode_with_special(&i).map_err(bad)? } else { String::new() };
                    (i, text)
                }
            };
            ids.push(i);
            echoes.push(d.echo.then_some(text));
        }
        if ids.len() * d.n > MAX_CHOICES {
            return Err(ApiError::invalid(Some("n"), format!("{} prompts x n = {} asks for {} choices; at most {MAX_CHOICES} a request", ids.len(), d.n, ids.len() * d.n)));
        }
        Ok((ids, echoes, d))
    })
    .await;
    match parsed {
        Ok((ids, echoes, d)) => answer(&s, Kind::Completion, ids, echoes, d).await,
        Err(e) => e.into_response(),
    }
}

/// Parsing, the chat template and tokenization run off the async workers: a 1 MiB prompt takes
/// the tokenizer a while, and the runtime has one worker, which every stream shares.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T, ApiError> + Send + 'static) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| Err(ApiError::server(500, format!("internal error while reading the request: {e}"))))
}

/// `POST /tokenize` (vLLM's and llama.cpp's server's): `{"tokens", "count", "max_model_len"}`.
/// With `/detokenize` and `/tokenizer_info`, what lm-evaluation-harness's remote tokenizer asks
/// for, so it runs against this server with no tokenizer files of its own.
async fn tokenize(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    let st = s.clone();
    let r = blocking(move || {
        let req: TokenizeRequest = parse(&body)?;
        let (text, special) = req.text(&st.model_name)?;
        let ids = st.target.tokenizer.encode(text, special).map_err(|e| ApiError::invalid(Some("prompt"), e.to_string()))?;
        Ok(json!({"tokens": ids, "count": ids.len(), "max_model_len": st.target.model.config().max_position}))
    })
    .await;
    r.map(Json).into_response()
}

/// `POST /detokenize`: `{"prompt": text}` (vLLM's name) with `content` (llama.cpp's) beside it.
async fn detokenize(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    let st = s.clone();
    let r = blocking(move || {
        let req: DetokenizeRequest = parse(&body)?;
        let ids = req.ids(&st.model_name, st.target.tokenizer.vocab_size())?;
        let text = st.target.tokenizer.decode(&ids).map_err(|e| ApiError::invalid(Some("tokens"), e.to_string()))?;
        Ok(json!({"prompt": text, "content": text}))
    })
    .await;
    r.map(Json).into_response()
}

/// `GET /tokenizer_info`: the special tokens, the chat template and the context, as vLLM lists them.
async fn tokenizer_info(State(s): State<Arc<AppState>>) -> Json<Value> {
    let t = &s.target.tokenizer;
    Json(json!({
        "tokenizer_class": "selfspec",
        "eos_token": t.eos_token,
        "bos_token": t.bos_id.map(|_| t.bos_token.clone()),
        "add_bos_token": t.add_bos,
        "pad_token": null,
        "chat_template": s.target.chat_template.as_ref().map(|c| c.source()),
        "model_max_length": s.target.model.config().max_position,
    }))
}

/// Queue a request's choices (`n` for each of `prompts`) and answer them, whole or streamed.
/// `echoes`: per prompt, the text `echo` sends back (the request's own string, or its ids
/// decoded with the special tokens kept).
async fn answer(s: &Arc<AppState>, kind: Kind, prompts: Vec<Vec<u32>>, echoes: Vec<Option<String>>, d: Decoding) -> Response {
    let context = s.target.model.config().max_position;
    let param = if kind == Kind::Chat { "messages" } else { "prompt" };
    for (i, ids) in prompts.iter().enumerate() {
        let which = if prompts.len() > 1 { format!("prompt {i}") } else { "the prompt".into() };
        if ids.is_empty() {
            return ApiError::invalid(Some(param), format!("{which} is empty")).into_response();
        }
        if ids.len() >= context {
            return ApiError { status: 400, message: format!("{which} is {} tokens; this model's context is {context}", ids.len()), kind: "invalid_request_error", param: Some(param.into()), code: Some("context_length_exceeded") }.into_response();
        }
    }
    let choices = prompts.len() * d.n;
    if choices > s.queue {
        return ApiError::invalid(Some("n"), format!("{choices} choices (prompts x n) are more than this server queues at once (--queue {})", s.queue)).into_response();
    }
    let prompt_tokens = prompts.iter().map(Vec::len).sum();
    let seed = d.seed.unwrap_or_else(|| now() ^ s.next_id.load(Ordering::Relaxed).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    // Choice k = prompt k / n, its (k % n)-th sample, seeded seed + k (OpenAI's order: a
    // prompt's n choices side by side). Each is a sequence of its own in the engine, queued
    // all together or not at all.
    let (mut jobs, mut receivers) = (Vec::with_capacity(choices), Vec::with_capacity(choices));
    for (k, (ids, echo)) in prompts.iter().zip(&echoes).flat_map(|p| std::iter::repeat_n(p, d.n)).enumerate() {
        let (tx, rx) = unbounded_channel();
        jobs.push(Job { prompt: ids.clone(), params: d.params.clone(), max_tokens: d.max_tokens, seed: seed.wrapping_add(k as u64), stop: d.stop.clone(), ignore_eos: d.ignore_eos, logprobs: d.logprobs, echo: echo.clone(), cache_prompt: d.cache_prompt, events: tx });
        receivers.push(rx);
    }
    match s.engine.submit_all(jobs) {
        Ok(()) => {}
        Err(Refused::Full) => {
            let mut r = ApiError { status: 503, message: "the server is at capacity; try again shortly".into(), kind: "server_error", param: None, code: Some("server_busy") }.into_response();
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            return r;
        }
        Err(Refused::Stopped) => return ApiError::server(503, "the server is shutting down").into_response(),
    }
    let id = format!("{}-{}", if kind == Kind::Chat { "chatcmpl" } else { "cmpl" }, s.next_id.fetch_add(1, Ordering::Relaxed));
    let meta = Meta { id, created: now(), model: s.model_name.clone(), kind, n: d.n };
    let logprobs = d.logprobs.is_some();
    if d.stream {
        stream(meta, receivers, &d, prompt_tokens).into_response()
    } else {
        whole(meta, receivers, logprobs, prompt_tokens).await
    }
}

struct Meta {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
    /// Choices per prompt.
    n: usize,
}

impl Meta {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }
}

/// OpenAI's usage for a request's choices (`n` per prompt, in order): each prompt's tokens
/// once, every choice's answer; `cached_tokens` counts the prompt tokens the prompt cache
/// supplied, a prompt's once (its first choice's).
fn usage(prompt_tokens: usize, n: usize, sums: &[Summary]) -> Value {
    let completion: usize = sums.iter().map(|s| s.completion_tokens).sum();
    let cached: usize = sums.iter().step_by(n.max(1)).map(|s| s.cached_tokens).sum();
    json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}})
}

/// The request's extension field over all its choices: τ as answer tokens per target forward
/// over them all (one choice: its own), their accepted draft tokens and forwards, the first seed.
fn extension_all(sums: &[Summary]) -> Value {
    if let [one] = sums {
        return extension(one);
    }
    let forwards: usize = sums.iter().map(|s| s.target_forwards).sum();
    let weighted: f64 = sums.iter().map(|s| s.tau * s.target_forwards as f64).sum();
    json!({"tau": if forwards > 0 { weighted / forwards as f64 } else { 1.0 }, "accepted_draft_tokens": sums.iter().map(|s| s.accepted_draft_tokens).sum::<usize>(), "target_forwards": forwards, "seed": sums.first().map_or(0, |s| s.seed)})
}

/// selfspec's extension field: τ counts the bonus token (plain decoding = 1.0).
fn extension(sum: &Summary) -> Value {
    json!({"tau": sum.tau, "accepted_draft_tokens": sum.accepted_draft_tokens, "target_forwards": sum.target_forwards, "seed": sum.seed})
}

/// A log-probability as JSON: OpenAI's floor (-9999) for a token the model ruled out, whose
/// -inf JSON cannot carry; `null` for an echoed prompt's first token.
fn finite(x: Option<f32>) -> Value {
    x.map_or(Value::Null, |x| json!((x as f64).max(-9999.0)))
}

/// Log-probabilities in each endpoint's shape: chat's `{"content": [{"token", "logprob",
/// "bytes", "top_logprobs"}], "refusal": null}`, completions' parallel lists (`tokens`,
/// `token_logprobs`, `top_logprobs` as token-to-logprob maps holding the chosen token too,
/// `text_offset`: where each token's text starts, in characters, counting the token texts
/// before it from `offset`, as vLLM counts). `null` when the request did not ask.
#[derive(Default)]
struct Logprobs {
    on: bool,
    entries: Vec<TokenLogprob>,
    offset: usize,
}

impl Logprobs {
    fn json(&self, kind: Kind) -> Value {
        if !self.on {
            return Value::Null;
        }
        match kind {
            Kind::Chat => {
                let one = |t: &str, b: &[u8], x: Option<f32>| json!({"token": t, "logprob": finite(x), "bytes": b});
                let content: Vec<Value> = self
                    .entries
                    .iter()
                    .map(|e| {
                        let mut v = one(&e.token, &e.bytes, e.logprob);
                        v["top_logprobs"] = e.top.iter().map(|(t, b, x)| one(t, b, Some(*x))).collect();
                        v
                    })
                    .collect();
                json!({"content": content, "refusal": null})
            }
            Kind::Completion => {
                let top: Vec<Value> = self
                    .entries
                    .iter()
                    .map(|e| {
                        if e.logprob.is_none() {
                            return Value::Null;
                        }
                        let mut m = serde_json::Map::new();
                        for (t, _, x) in &e.top {
                            m.entry(t.clone()).or_insert(finite(Some(*x)));
                        }
                        m.insert(e.token.clone(), finite(e.logprob));
                        Value::Object(m)
                    })
                    .collect();
                let offsets: Vec<usize> = self.entries.iter().scan(self.offset, |at, e| Some(std::mem::replace(at, *at + e.token.chars().count()))).collect();
                json!({
                    "tokens": self.entries.iter().map(|e| e.token.clone()).collect::<Vec<_>>(),
                    "token_logprobs": self.entries.iter().map(|e| finite(e.logprob)).collect::<Vec<_>>(),
                    "top_logprobs": top,
                    "text_offset": offsets,
                })
            }
        }
    }

    /// Where the next chunk's tokens start: after these entries' texts.
    fn end(&self) -> usize {
        self.offset + self.entries.iter().map(|e| e.token.chars().count()).sum::<usize>()
    }
}

/// Every choice's whole answer, in choice order. The engine decodes them side by side; each
/// receiver is read to its end in turn.
async fn whole(meta: Meta, receivers: Vec<UnboundedReceiver<Event>>, logprobs: bool, prompt_tokens: usize) -> Response {
    let several = receivers.len() > 1;
    let (mut choices, mut sums) = (Vec::with_capacity(receivers.len()), Vec::with_capacity(receivers.len()));
    for (index, mut rx) in receivers.into_iter().enumerate() {
        let mut text = String::new();
        let mut lps = Logprobs { on: logprobs, ..Default::default() };
        let sum = loop {
            match rx.recv().await {
                Some(Event::Text { text: t, logprobs, .. }) => {
                    lps.entries.extend(logprobs);
                    text.push_str(&t);
                }
                Some(Event::Failed(e)) => return ApiError::server(500, e).into_response(),
                Some(Event::Done(sum)) => break sum,
                None => return ApiError::server(500, "the engine stopped before the answer was complete").into_response(),
            }
        };
        let mut choice = match meta.kind {
            Kind::Chat => json!({"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": sum.finish_reason, "logprobs": lps.json(meta.kind)}),
            Kind::Completion => json!({"index": index, "text": text, "finish_reason": sum.finish_reason, "logprobs": lps.json(meta.kind)}),
        };
        if several {
            choice["selfspec"] = extension(&sum);
        }
        choices.push(choice);
        sums.push(sum);
    }
    Json(json!({"id": meta.id, "object": meta.object(false), "created": meta.created, "model": meta.model, "choices": choices, "usage": usage(prompt_tokens, meta.n, &sums), "selfspec": extension_all(&sums)})).into_response()
}

/// Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`: each chunk one
/// choice's (by `index`), the choices interleaved as the engine emits them. A task forwards the
/// engine's events and drops them (so the engine ends the sequences) when the client is gone.
/// With `stream_options.include_usage` every chunk carries `"usage": null` and a last chunk
/// with no choices the usage; with vLLM's `continuous_usage_stats` too, every chunk the usage
/// so far.
fn stream(meta: Meta, receivers: Vec<UnboundedReceiver<Event>>, d: &Decoding, prompt_tokens: usize) -> impl IntoResponse {
    let (tx, out) = unbounded_channel::<Result<SseEvent, Infallible>>();
    let (include_usage, continuous) = (d.include_usage, d.include_usage && d.continuous_usage);
    let logprobs = d.logprobs.is_some();
    let choices = receivers.len();
    let mut events = tokio_stream::StreamMap::new();
    for (index, rx) in receivers.into_iter().enumerate() {
        events.insert(index, UnboundedReceiverStream::new(rx));
    }
    tokio::spawn(async move {
        use tokio_stream::StreamExt;
        let mut completion_tokens = 0;
        let mut offsets = vec![0usize; choices];
        // Tokens sent per choice, so a choice's end can settle its count to its usage.
        let mut counted = vec![0usize; choices];
        let mut sums: Vec<Option<Summary>> = vec![None; choices];
        let chunk = |index: usize, delta: Value, finish: Option<&str>, extra: Option<Value>, done: usize, lps: &Logprobs| -> SseEvent {
            let choice = match meta.kind {
                Kind::Chat => json!({"index": index, "delta": delta, "finish_reason": finish, "logprobs": lps.json(meta.kind)}),
                Kind::Completion => json!({"index": index, "text": delta.get("content").cloned().unwrap_or(json!("")), "finish_reason": finish, "logprobs": lps.json(meta.kind)}),
            };
            let mut v = json!({"id": meta.id, "object": meta.object(true), "created": meta.created, "model": meta.model, "choices": [choice]});
            if continuous {
                v["usage"] = json!({"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done});
            } else if include_usage {
                v["usage"] = Value::Null;
            }
            if let Some(x) = extra {
                v["selfspec"] = x;
            }
            SseEvent::default().data(v.to_string())
        };
        if meta.kind == Kind::Chat {
            for index in 0..choices {
                let _ = tx.send(Ok(chunk(index, json!({"role": "assistant", "content": ""}), None, None, 0, &Logprobs::default())));
            }
        }
        loop {
            let next = tokio::select! {
                next = events.next() => next,
                _ = tx.closed() => return,
            };
            // The map drops a receiver once it ends; with every choice done it is empty.
            let Some((index, ev)) = next else { break };
            let sent = match ev {
                Event::Text { text, tokens, logprobs: entries } => {
                    completion_tokens += tokens.len();
                    counted[index] += tokens.len();
                    let marks: Vec<Value> = tokens.iter().map(|&(id, d)| json!([id, d])).collect();
                    let lps = Logprobs { on: logprobs, entries, offset: offsets[index] };
                    offsets[index] = lps.end();
                    tx.send(Ok(chunk(index, json!({"content": text}), None, Some(json!({"tokens": marks})), completion_tokens, &lps)))
                }
                Event::Failed(e) => {
                    let _ = tx.send(Ok(SseEvent::default().data(ApiError::server(500, e).body().to_string())));
                    let _ = tx.send(Ok(SseEvent::default().data("[DONE]")));
                    return;
                }
                Event::Done(sum) => {
                    completion_tokens = completion_tokens + sum.completion_tokens - counted[index].min(completion_tokens);
                    let sent = tx.send(Ok(chunk(index, json!({}), Some(sum.finish_reason), Some(extension(&sum)), completion_tokens, &Logprobs::default())));
                    sums[index] = Some(sum);
                    sent
                }
            };
            if sent.is_err() {
                return;
            }
        }
        let Some(sums) = sums.into_iter().collect::<Option<Vec<Summary>>>() else {
            let _ = tx.send(Ok(SseEvent::default().data(ApiError::server(500, "the engine stopped before the answer was complete").body().to_string())));
            let _ = tx.send(Ok(SseEvent::default().data("[DONE]")));
            return;
        };
        if include_usage {
            let v = json!({"id": meta.id, "object": meta.object(true), "created": meta.created, "model": meta.model, "choices": [], "usage": usage(prompt_tokens, meta.n, &sums), "selfspec": extension_all(&sums)});
            let _ = tx.send(Ok(SseEvent::default().data(v.to_string())));
        }
        let _ = tx.send(Ok(SseEvent::default().data("[DONE]")));
    });
    Sse::new(UnboundedReceiverStream::new(out)).keep_alive(KeepAlive::default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_keys_are_read_and_compared_whole() {
        assert_eq!(bearer("Bearer k1"), Some("k1"));
        assert_eq!(bearer("bearer k1"), Some("k1"));
        assert_eq!(bearer("BEARER  k1 "), Some("k1"));
        assert_eq!(bearer("Basic k1"), None);
        assert_eq!(bearer("Bearerk1"), None);
        assert!(same_key(b"sesame", b"sesame"));
        for wrong in [&b"sesamf"[..], b"Sesame", b"sesam", b"sesame!", b""] {
            assert!(!same_key(wrong, b"sesame"), "{wrong:?}");
        }
    }
}
