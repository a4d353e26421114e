//! The OpenAI request and response shapes the server speaks, and how a request becomes a
//! [`crate::serve::engine::Job`]'s parameters. Every field a request may carry is either used
//! or refused with a 400 naming it: a parameter silently ignored is a wrong answer.
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::decode::sampling::SamplingParams;
use crate::model::tokenizer::Message;

/// An error as OpenAI's API returns it: an HTTP status and `{"error": {...}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> Self {
        ApiError { status: 400, message: message.into(), kind: "invalid_request_error", param: param.map(str::to_string), code: None }
    }
    /// A server-side failure (`status` 500 or 503), OpenAI's "server_error".
    pub fn server(status: u16, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), kind: "server_error", param: None, code: None }
    }
    pub fn body(&self) -> Value {
        serde_json::json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

/// A request body of either endpoint: chat's `messages` or completions' `prompt`, beside the
/// sampling and length fields both take. One flat struct (no nested `#[serde(flatten)]`), so a
/// field of the wrong type is named by its path in the 400.
#[derive(Debug, Deserialize, Default)]
#[serde(expecting = "a JSON object")]
pub struct Request {
    /// `/v1/chat/completions`.
    pub messages: Option<Vec<ChatMessage>>,
    /// `/v1/completions`: a string, a list of one string, token ids, or a list of one list of
    /// token ids.
    pub prompt: Option<Value>,
    pub model: Option<String>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// Extensions (as vLLM and llama.cpp's server take them).
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    /// vLLM's extension: decode past the end-of-sequence token, to `max_tokens`.
    pub ignore_eos: Option<bool>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<u64>,
    /// Chat: true for each answer token's log-probability; completions: how many alternatives
    /// to list per token (0 to 20).
    pub logprobs: Option<Value>,
    /// Chat: alternatives per token (0 to 20), with `logprobs: true`.
    pub top_logprobs: Option<Value>,
    /// Completions: the answer starts with the prompt (and the log-probabilities with the
    /// prompt's, the first `null`).
    pub echo: Option<bool>,
    /// llama.cpp's extension: `false` neither reuses a kept prompt's cache nor keeps this one's
    /// (default true; `--prompt-cache 0` turns caching off for every request).
    pub cache_prompt: Option<bool>,
    /// Accepted (OpenAI's end-user id: nothing to do with decoding).
    pub user: Option<String>,
    /// Everything else: refused by name unless it asks for nothing ([`asks_for_nothing`]).
    #[serde(flatten)]
    pub other: BTreeMap<String, Value>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "expected a string or a list of strings")]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize, Default)]
#[serde(expecting = "an object")]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
    /// vLLM's extension: usage in every chunk.
    pub continuous_usage_stats: Option<bool>,
    #[serde(flatten)]
    pub other: BTreeMap<String, Value>,
}

#[derive(Debug, Deserialize)]
#[serde(expecting = "a message object ({\"role\": ..., \"content\": ...})")]
pub struct ChatMessage {
    pub role: String,
    /// Null only in an assistant turn (OpenAI's schema: an assistant message that called tools).
    pub content: Option<Content>,
    /// The participant's name, passed to the chat template (as vLLM does; most ignore it).
    pub name: Option<String>,
    #[serde(flatten)]
    pub other: BTreeMap<String, Value>,
}

/// A message's content: a string, or a list of text parts.
#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "expected a string or a list of content parts")]
pub enum Content {
    Text(String),
    Parts(Vec<Value>),
}

/// A completion's prompt after [`Request::prompt`]: text to tokenize, or token ids as given.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

/// Whether an unsupported field's value asks for nothing, so a client that sends every field
/// at its default is served: an empty `logit_bias` or `tools`, `tool_choice` "none", `echo`
/// false, `best_of` 1, `response_format` text, and so on.
pub fn asks_for_nothing(key: &str, v: &Value) -> bool {
    let empty = |v: &Value| v.as_object().is_some_and(|o| o.is_empty()) || v.as_array().is_some_and(|a| a.is_empty());
    match key {
        _ if v.is_null() => true,
        "logit_bias" | "tools" | "functions" => empty(v),
        "tool_choice" | "function_call" => v == "none" || v == "auto",
        // Without tools there is nothing to call in parallel; metadata only tags stored output.
        "parallel_tool_calls" => v.is_boolean(),
        "metadata" => v.is_object(),
        "store" => v == false,
        "best_of" => v == 1,
        "response_format" => v.get("type").is_some_and(|t| t == "text") && v.as_object().is_some_and(|o| o.len() == 1),
        "service_tier" => v == "auto" || v == "default",
        "suffix" => v == "",
        _ => false,
    }
}

/// The most new tokens a request may ask for when it says nothing (as llama.cpp's server, the
/// context is the other limit).
pub const DEFAULT_MAX_TOKENS: u64 = 512;
/// Choices a request may ask for at most, over its prompts (`n` for each): each is a sequence
/// of its own in the engine's queue.
pub const MAX_CHOICES: usize = 64;
/// Stop strings at most, and their length at most (OpenAI allows 4).
pub const MAX_STOPS: usize = 4;
pub const MAX_STOP_LEN: usize = 256;

/// What a request asks of decoding, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Decoding {
    pub params: SamplingParams,
    pub max_tokens: usize,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    pub stream: bool,
    /// A last chunk with the usage (`stream_options.include_usage`; the others carry `"usage": null`).
    pub include_usage: bool,
    /// The usage so far in every chunk (vLLM's `stream_options.continuous_usage_stats`).
    pub continuous_usage: bool,
    /// Each answer token's log-probability with this many alternatives (`None`: not asked).
    pub logprobs: Option<usize>,
    /// Completions' `echo`: the prompt first.
    pub echo: bool,
    /// Reuse and keep prompt caches (llama.cpp's `cache_prompt`).
    pub cache_prompt: bool,
    /// Choices per prompt (`n`), each seeded `seed + its index`.
    pub n: usize,
}

/// Parse a JSON body into `T`, as a 400 naming what is wrong: the body when it is not JSON,
/// the field (by its path, e.g. `messages[1].content`) when one has the wrong type.
pub fn parse<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ApiError> {
    let not_json = |e: serde_json::Error| ApiError::invalid(None, format!("the request body is not valid JSON: {e}"));
    let de = &mut serde_json::Deserializer::from_slice(body);
    let v = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        match (inner.classify(), path.as_str()) {
            (serde_json::error::Category::Data, ".") => ApiError::invalid(None, format!("the request body: {inner}")),
            (serde_json::error::Category::Data, p) => ApiError::invalid(Some(p), format!("{p}: {inner}")),
            _ => not_json(inner),
        }
    })?;
    de.end().map_err(not_json)?;
    Ok(v)
}

/// The message of a sampling parameter out of range, as [`SamplingParams::validate`] words it.
fn range_error(p: SamplingParams) -> Option<String> {
    p.validate().err().map(|e| match e {
        crate::error::Error::InvalidArgument(m) => m,
        e => e.to_string(),
    })
}

impl Request {
    /// Check the fields against what the server does and turn them into decoding parameters.
    /// OpenAI's defaults: temperature 1, top_p 1; `model` must name the served model.
    /// `chat` says which endpoint: `logprobs` is a flag with `top_logprobs` beside it in chat,
    /// a count in completions.
    pub fn decoding(&self, served: &str, chat: bool) -> Result<Decoding, ApiError> {
        if let Some((k, _)) = self.other.iter().find(|(k, v)| !asks_for_nothing(k, v)) {
            let what = match k.as_str() {
                "tools" | "tool_choice" | "functions" | "function_call" => "tool calling is not supported",
                "best_of" | "suffix" => "best_of and suffix are not supported",
                "response_format" => "structured output (response_format other than text) is not supported",
                "logit_bias" => "logit_bias is not supported",
                "store" => "stored completions are not supported",
                "service_tier" => "only the default service tier is served",
                _ => "unknown or unsupported parameter",
            };
            return Err(ApiError::invalid(Some(k), format!("{k}: {what}")));
        }
        if self.model.is_none() {
            return Err(ApiError::invalid(Some("model"), format!("model is required (this server serves '{served}')")));
        }
        check_model(self.model.as_deref(), served)?;
        let n = match self.n.unwrap_or(1) {
            n if (1..=MAX_CHOICES as u64).contains(&n) => n as usize,
            n => return Err(ApiError::invalid(Some("n"), format!("n = {n}: from 1 to {MAX_CHOICES} choices a request"))),
        };
        let max_tokens = match (self.max_tokens, self.max_completion_tokens) {
            (Some(a), Some(b)) if a != b => return Err(ApiError::invalid(Some("max_tokens"), "max_tokens and max_completion_tokens disagree")),
            (Some(a), _) | (None, Some(a)) => a,
            (None, None) => DEFAULT_MAX_TOKENS,
        };
        if max_tokens == 0 {
            return Err(ApiError::invalid(Some("max_tokens"), "max_tokens must be at least 1"));
        }
        let top_k = match self.top_k {
            None | Some(-1) => 0,
            Some(k) if k >= 0 => k as usize,
            Some(k) => return Err(ApiError::invalid(Some("top_k"), format!("top_k must be >= 0 (or -1 for none), got {k}"))),
        };
        let params = SamplingParams {
            temperature: self.temperature.unwrap_or(1.0),
            top_k,
            top_p: self.top_p.unwrap_or(1.0),
            min_p: self.min_p.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
        };
        if params.temperature > 100.0 {
            return Err(ApiError::invalid(Some("temperature"), format!("temperature must be in [0, 100], got {}", params.temperature)));
        }
        // Each field alone against the defaults, so the 400 names the one out of range.
        let d = SamplingParams::default();
        for (name, alone) in [
            ("temperature", SamplingParams { temperature: params.temperature, ..d }),
            ("top_p", SamplingParams { top_p: params.top_p, ..d }),
            ("min_p", SamplingParams { min_p: params.min_p, ..d }),
            ("repetition_penalty", SamplingParams { repetition_penalty: params.repetition_penalty, ..d }),
            ("presence_penalty", SamplingParams { presence_penalty: params.presence_penalty, ..d }),
            ("frequency_penalty", SamplingParams { frequency_penalty: params.frequency_penalty, ..d }),
        ] {
            if let Some(m) = range_error(alone) {
                return Err(ApiError::invalid(Some(name), m));
            }
        }
        if let Some(m) = range_error(params.clone()) {
            return Err(ApiError::invalid(None, m));
        }
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop.len() > MAX_STOPS || stop.iter().any(|s| s.len() > MAX_STOP_LEN) {
            return Err(ApiError::invalid(Some("stop"), format!("at most {MAX_STOPS} stop strings of at most {MAX_STOP_LEN} bytes")));
        }
        let logprobs = self.logprobs(chat)?;
        let echo = self.echo.unwrap_or(false);
        if echo && chat {
            return Err(ApiError::invalid(Some("echo"), "echo is for /v1/completions: a chat answer does not repeat the conversation"));
        }
        let stream = self.stream.unwrap_or(false);
        let opts = self.stream_options.as_ref();
        if let Some(o) = opts {
            if !stream {
                return Err(ApiError::invalid(Some("stream_options"), "stream_options is only allowed when stream is true"));
            }
            if let Some((k, _)) = o.other.iter().find(|(_, v)| !v.is_null()) {
                return Err(ApiError::invalid(Some(&format!("stream_options.{k}")), format!("stream_options.{k}: unknown or unsupported option")));
            }
        }
        Ok(Decoding {
            params,
            max_tokens: usize::try_from(max_tokens).unwrap_or(usize::MAX),
            seed: self.seed,
            stop,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            cache_prompt: self.cache_prompt.unwrap_or(true),
            stream,
            include_usage: opts.and_then(|o| o.include_usage).unwrap_or(false),
            continuous_usage: opts.and_then(|o| o.continuous_usage_stats).unwrap_or(false),
            logprobs,
            echo,
            n,
        })
    }

    /// The alternatives per token a request asks for with its log-probabilities, if it asks:
    /// chat's `logprobs: true` with `top_logprobs` (0 to 20), completions' `logprobs` (0 to 20).
    /// A default sent for nothing (`false`, `null`, `top_logprobs: 0`) asks for nothing.
    fn logprobs(&self, chat: bool) -> Result<Option<usize>, ApiError> {
        let max = crate::decode::sampling::MAX_TOP_LOGPROBS as u64;
        let count = |name: &str, v: &Value| match v.as_u64() {
            Some(n) if n <= max => Ok(n as usize),
            _ => Err(ApiError::invalid(Some(name), format!("{name} must be an integer from 0 to {max}, got {v}"))),
        };
        let (lp, top) = (self.logprobs.as_ref().filter(|v| !v.is_null()), self.top_logprobs.as_ref().filter(|v| !v.is_null()));
        if !chat {
            if let Some(t) = top.filter(|&t| t != 0) {
                return Err(ApiError::invalid(Some("top_logprobs"), format!("top_logprobs: {t} is chat's parameter; /v1/completions takes logprobs as the number of alternatives")));
            }
            return match lp {
                None => Ok(None),
                Some(v) if v == false => Ok(None),
                Some(v) if v.is_boolean() => Err(ApiError::invalid(Some("logprobs"), "logprobs in /v1/completions is the number of alternatives per token (0 to 20), not a flag")),
                Some(v) => count("logprobs", v).map(Some),
            };
        }
        let on = match lp {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => return Err(ApiError::invalid(Some("logprobs"), format!("logprobs in /v1/chat/completions is true or false (top_logprobs gives the alternatives), got {v}"))),
        };
        let n = top.map(|t| count("top_logprobs", t)).transpose()?.unwrap_or(0);
        match (on, n) {
            (true, n) => Ok(Some(n)),
            (false, 0) => Ok(None),
            (false, _) => Err(ApiError::invalid(Some("top_logprobs"), "top_logprobs needs logprobs: true")),
        }
    }

    /// The conversation as the chat template's messages (system, user and assistant turns), for
    /// `/v1/chat/completions`.
    pub fn messages(&self) -> Result<Vec<Message>, ApiError> {
        if self.prompt.is_some() {
            return Err(ApiError::invalid(Some("prompt"), "prompt is for /v1/completions; a chat request sends messages"));
        }
        let Some(messages) = &self.messages else {
            return Err(ApiError::invalid(Some("messages"), "messages is required"));
        };
        if messages.is_empty() {
            return Err(ApiError::invalid(Some("messages"), "messages is empty"));
        }
        messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let field = |f: &str| format!("messages[{i}].{f}");
                let role = match m.role.as_str() {
                    "system" | "developer" => "system",
                    "user" => "user",
                    "assistant" => "assistant",
                    other => return Err(ApiError::invalid(Some(&field("role")), format!("role '{other}' is not supported (system, user, assistant)"))),
                };
                if let Some((k, _)) = m.other.iter().find(|(k, v)| !(v.is_null() || (k.as_str() == "tool_calls" && v.as_array().is_some_and(|a| a.is_empty())))) {
                    let why = if k == "tool_calls" { "tool calling is not supported" } else { "unknown or unsupported message field" };
                    return Err(ApiError::invalid(Some(&field(k)), format!("{}: {why}", field(k))));
                }
                let content = match &m.content {
                    None if role == "assistant" => String::new(),
                    None => return Err(ApiError::invalid(Some(&field("content")), format!("{}: a {role} message needs content", field("content")))),
                    Some(Content::Text(s)) => s.clone(),
                    // Text parts joined by newlines, as vLLM joins them.
                    Some(Content::Parts(parts)) => {
                        let mut texts = Vec::with_capacity(parts.len());
                        for p in parts {
                            match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                                (Some("text"), Some(t)) => texts.push(t),
                                _ => return Err(ApiError::invalid(Some(&field("content")), "only text content parts are supported")),
                            }
                        }
                        texts.join("\n")
                    }
                };
                Ok(Message { role: role.into(), content, name: m.name.clone() })
            })
            .collect()
    }

    /// The prompts of `/v1/completions`: one string or one list of token ids below `vocab`, or a
    /// batch: a list of strings, or a list of such lists (at most [`MAX_CHOICES`]).
    pub fn prompt(&self, vocab: usize) -> Result<Vec<Prompt>, ApiError> {
        if self.messages.is_some() {
            return Err(ApiError::invalid(Some("messages"), "messages is for /v1/chat/completions; a completion request sends prompt"));
        }
        let ids = |a: &[Value]| -> Result<Prompt, ApiError> {
            let mut out = Vec::with_capacity(a.len());
            for v in a {
                match v.as_u64() {
                    Some(id) if usize::try_from(id).is_ok_and(|id| id < vocab) => out.push(id as u32),
                    _ => return Err(ApiError::invalid(Some("prompt"), format!("prompt: token ids must be integers in [0, {vocab}), got {v}"))),
                }
            }
            Ok(Prompt::Ids(out))
        };
        let one = |v: &Value| match v {
            Value::String(s) => Ok(Prompt::Text(s.clone())),
            Value::Array(inner) if inner.iter().all(Value::is_number) => ids(inner),
            _ => Err(ApiError::invalid(Some("prompt"), "prompt must be a string, a list of token ids, or a list of either")),
        };
        match &self.prompt {
            None => Err(ApiError::invalid(Some("prompt"), "prompt is required")),
            Some(Value::String(s)) => Ok(vec![Prompt::Text(s.clone())]),
            Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_number) => Ok(vec![ids(a)?]),
            Some(Value::Array(a)) if a.is_empty() => Err(ApiError::invalid(Some("prompt"), "prompt is empty")),
            Some(Value::Array(a)) if a.len() > MAX_CHOICES => Err(ApiError::invalid(Some("prompt"), format!("a batch of {} prompts; at most {MAX_CHOICES} a request", a.len()))),
            Some(Value::Array(a)) => a.iter().map(one).collect(),
            Some(_) => Err(ApiError::invalid(Some("prompt"), "prompt must be a string, a list of token ids, or a list of either")),
        }
    }
}

/// `POST /tokenize`: text to token ids, as vLLM (`prompt`) and llama.cpp's server (`content`)
/// take it; `add_special_tokens` (default true) adds BOS where the model adds one.
#[derive(Debug, Deserialize)]
#[serde(expecting = "a JSON object")]
pub struct TokenizeRequest {
    pub prompt: Option<String>,
    pub content: Option<String>,
    pub add_special_tokens: Option<bool>,
    pub model: Option<String>,
    #[serde(flatten)]
    pub other: BTreeMap<String, Value>,
}

impl TokenizeRequest {
    /// The text to tokenize and whether to add BOS, checked against the served model's name.
    pub fn text(&self, served: &str) -> Result<(&str, bool), ApiError> {
        if let Some((k, _)) = self.other.iter().find(|(_, v)| !v.is_null()) {
            return Err(ApiError::invalid(Some(k), format!("{k}: unknown or unsupported parameter (tokenize takes prompt or content, add_special_tokens, model)")));
        }
        check_model(self.model.as_deref(), served)?;
        match (&self.prompt, &self.content) {
            (Some(t), None) | (None, Some(t)) => Ok((t, self.add_special_tokens.unwrap_or(true))),
            (Some(_), Some(_)) => Err(ApiError::invalid(Some("content"), "give prompt or content, not both")),
            (None, None) => Err(ApiError::invalid(Some("prompt"), "prompt (or content) is required")),
        }
    }
}

/// `POST /detokenize`: token ids back to text.
#[derive(Debug, Deserialize)]
#[serde(expecting = "a JSON object")]
pub struct DetokenizeRequest {
    pub tokens: Vec<u64>,
    pub model: Option<String>,
    #[serde(flatten)]
    pub other: BTreeMap<String, Value>,
}

impl DetokenizeRequest {
    /// The ids, each below `vocab`.
    pub fn ids(&self, served: &str, vocab: usize) -> Result<Vec<u32>, ApiError> {
        if let Some((k, _)) = self.other.iter().find(|(_, v)| !v.is_null()) {
            return Err(ApiError::invalid(Some(k), format!("{k}: unknown or unsupported parameter (detokenize takes tokens, model)")));
        }
        check_model(self.model.as_deref(), served)?;
        self.tokens
            .iter()
            .map(|&t| match u32::try_from(t) {
                Ok(id) if (id as usize) < vocab => Ok(id),
                _ => Err(ApiError::invalid(Some("tokens"), format!("tokens: ids must be below the vocabulary's {vocab}, got {t}"))),
            })
            .collect()
    }
}

/// A `model` a request may omit, but when given must name the served model (404 otherwise).
fn check_model(model: Option<&str>, served: &str) -> Result<(), ApiError> {
    match model {
        Some(m) if m != served => Err(ApiError { status: 404, message: format!("the model '{m}' does not exist (this server serves '{served}')"), kind: "invalid_request_error", param: Some("model".into()), code: Some("model_not_found") }),
        _ => Ok(()),
    }
}

/// Usage, with selfspec's own fields beside OpenAI's.
#[derive(Debug, Serialize, Clone)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn common(v: Value) -> Result<Decoding, ApiError> {
        serde_json::from_value::<Request>(v).unwrap().decoding("m", true)
    }

    fn completion(v: Value) -> Result<Decoding, ApiError> {
        serde_json::from_value::<Request>(v).unwrap().decoding("m", false)
    }

    /// Chat's flag and count, completions' count; defaults sent for nothing ask for nothing.
    #[test]
    fn logprobs_are_asked_for_as_each_endpoint_asks() {
        use serde_json::json;
        let lp = |v: Value| common(v).map(|d| d.logprobs);
        assert_eq!(lp(json!({"model": "m"})), Ok(None));
        assert_eq!(lp(json!({"model": "m", "logprobs": true})), Ok(Some(0)));
        assert_eq!(lp(json!({"model": "m", "logprobs": true, "top_logprobs": 5})), Ok(Some(5)));
        assert_eq!(lp(json!({"model": "m", "logprobs": false, "top_logprobs": 0})), Ok(None));
        assert_eq!(lp(json!({"model": "m", "logprobs": null, "top_logprobs": null})), Ok(None));
        let clp = |v: Value| completion(v).map(|d| d.logprobs);
        assert_eq!(clp(json!({"model": "m", "logprobs": 3})), Ok(Some(3)));
        assert_eq!(clp(json!({"model": "m", "logprobs": 0})), Ok(Some(0)));
        assert_eq!(clp(json!({"model": "m", "logprobs": false})), Ok(None));
        assert!(completion(json!({"model": "m", "echo": true, "logprobs": 1})).unwrap().echo);
        assert_eq!(common(json!({"model": "m", "echo": true})).unwrap_err().param.as_deref(), Some("echo"));
        assert!(!common(json!({"model": "m", "echo": false})).unwrap().echo);
        for (body, param) in [
            (json!({"model": "m", "top_logprobs": 2}), "top_logprobs"),
            (json!({"model": "m", "logprobs": true, "top_logprobs": 21}), "top_logprobs"),
            (json!({"model": "m", "logprobs": true, "top_logprobs": -1}), "top_logprobs"),
            (json!({"model": "m", "logprobs": 3}), "logprobs"),
        ] {
            assert_eq!(common(body.clone()).unwrap_err().param.as_deref(), Some(param), "{body}");
        }
        for (body, param) in [
            (json!({"model": "m", "logprobs": true}), "logprobs"),
            (json!({"model": "m", "logprobs": 21}), "logprobs"),
            (json!({"model": "m", "logprobs": 2.5}), "logprobs"),
            (json!({"model": "m", "top_logprobs": 2}), "top_logprobs"),
        ] {
            assert_eq!(completion(body.clone()).unwrap_err().param.as_deref(), Some(param), "{body}");
        }
    }

    #[test]
    fn requests_become_decoding_parameters_or_name_what_is_refused() {
        let d = common(serde_json::json!({"model": "m", "temperature": 0, "max_tokens": 5, "stop": "\n", "top_k": 40, "seed": 3, "logprobs": false})).unwrap();
        assert_eq!((d.params.temperature, d.params.top_k, d.max_tokens, d.seed, d.stop.clone()), (0.0, 40, 5, Some(3), vec!["\n".to_string()]));
        let d = common(serde_json::json!({"model": "m"})).unwrap();
        assert_eq!((d.params.temperature, d.max_tokens as u64), (1.0, DEFAULT_MAX_TOKENS), "OpenAI's defaults");
        for (body, param, status) in [
            (serde_json::json!({"model": "m", "n": 0}), "n", 400),
            (serde_json::json!({"model": "m", "n": 65}), "n", 400),
            (serde_json::json!({"model": "m", "tools": [{"type": "function"}]}), "tools", 400),
            (serde_json::json!({"model": "m", "logit_bias": {"1": 2}}), "logit_bias", 400),
            (serde_json::json!({"model": "m", "echo": true}), "echo", 400),
            (serde_json::json!({"model": "m", "response_format": {"type": "json_object"}}), "response_format", 400),
            (serde_json::json!({"model": "m", "frobnicate": 1}), "frobnicate", 400),
            (serde_json::json!({"model": "other"}), "model", 404),
            (serde_json::json!({}), "model", 400),
            (serde_json::json!({"model": "m", "max_tokens": 0}), "max_tokens", 400),
            (serde_json::json!({"model": "m", "top_k": -3}), "top_k", 400),
            (serde_json::json!({"model": "m", "top_p": 1.5}), "top_p", 400),
            (serde_json::json!({"model": "m", "temperature": -1}), "temperature", 400),
            (serde_json::json!({"model": "m", "min_p": 2}), "min_p", 400),
            (serde_json::json!({"model": "m", "presence_penalty": 3}), "presence_penalty", 400),
            (serde_json::json!({"model": "m", "repetition_penalty": 0}), "repetition_penalty", 400),
            (serde_json::json!({"model": "m", "stop": ["a", "b", "c", "d", "e"]}), "stop", 400),
            (serde_json::json!({"model": "m", "stream_options": {"include_usage": true}}), "stream_options", 400),
            (serde_json::json!({"model": "m", "stream": true, "stream_options": {"frob": 1}}), "stream_options.frob", 400),
        ] {
            let e = common(body.clone()).unwrap_err();
            assert_eq!((e.status, e.param.as_deref()), (status, Some(param)), "{body}: {e:?}");
        }
        let e = common(serde_json::json!({"model": "m", "top_p": 0})).unwrap_err();
        assert!(e.message.starts_with("top-p"), "{e:?}");
        assert_eq!(e.body()["error"]["type"], "invalid_request_error");
        // Unsupported fields at values that ask for nothing are served, as vLLM serves them.
        let d = common(serde_json::json!({"model": "m", "logit_bias": {}, "tools": [], "tool_choice": "none", "parallel_tool_calls": false, "response_format": {"type": "text"},
            "echo": false, "best_of": 1, "top_logprobs": 0, "store": false, "metadata": {"a": "b"}, "service_tier": "auto", "stream": null, "suffix": null}));
        assert!(d.is_ok(), "{d:?}");
        let d = common(serde_json::json!({"model": "m", "stream": true, "stream_options": {"include_usage": true, "continuous_usage_stats": true}, "ignore_eos": true})).unwrap();
        assert!(d.stream && d.include_usage && d.continuous_usage && d.ignore_eos);
    }

    #[test]
    fn a_field_of_the_wrong_type_is_named_by_its_path() {
        for (body, param) in [
            (r#"{"model":"m","max_tokens":"5"}"#, Some("max_tokens")),
            (r#"{"model":"m","stream":3}"#, Some("stream")),
            (r#"{"model":"m","messages":[{"role":"user","content":7}]}"#, Some("messages[0].content")),
            (r#"{"model":"m","stop":[1]}"#, Some("stop")),
            (r#"[1, 2]"#, None),
        ] {
            let e = parse::<Request>(body.as_bytes()).unwrap_err();
            assert_eq!(e.param.as_deref(), param, "{body}: {e:?}");
            assert!(!e.message.contains("not valid JSON") && !e.message.contains("struct") && !e.message.contains("enum") && e.message.contains("expected"), "{body}: {e:?}");
        }
        for body in ["{not json", "", r#"{"model":"m"} x"#] {
            let e = parse::<Request>(body.as_bytes()).unwrap_err();
            assert!(e.message.contains("not valid JSON") && e.param.is_none(), "{body:?}: {e:?}");
        }
    }

    #[test]
    fn chat_messages_take_strings_and_text_parts_only() {
        let r: Request = parse(br#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","name":"ann","content":[{"type":"text","text":"hi"},{"type":"text","text":"there"}]},{"role":"assistant","content":null,"tool_calls":[]}]}"#).unwrap();
        let m = r.messages().unwrap();
        assert_eq!((m[0].role.as_str(), m[1].content.as_str(), m[1].name.as_deref(), m[2].content.as_str()), ("system", "hi\nthere", Some("ann"), ""));
        for (body, param) in [
            (r#"{"model":"m","messages":[{"role":"tool","content":"x"}]}"#, "messages[0].role"),
            (r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{}}]}]}"#, "messages[0].content"),
            (r#"{"model":"m","messages":[{"role":"user","content":null}]}"#, "messages[0].content"),
            (r#"{"model":"m","messages":[{"role":"assistant","content":"x","tool_calls":[{"id":"1"}]}]}"#, "messages[0].tool_calls"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x","frob":1}]}"#, "messages[0].frob"),
            (r#"{"model":"m","messages":[]}"#, "messages"),
            (r#"{"model":"m"}"#, "messages"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"prompt":"y"}"#, "prompt"),
        ] {
            let e = parse::<Request>(body.as_bytes()).unwrap().messages().unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e:?}");
        }
    }

    #[test]
    fn completion_prompts_are_strings_or_token_ids_one_or_a_batch() {
        let p = |body: &str| parse::<Request>(body.as_bytes()).unwrap().prompt(100);
        assert_eq!(p(r#"{"prompt":"a"}"#).unwrap(), vec![Prompt::Text("a".into())]);
        assert_eq!(p(r#"{"prompt":["a"]}"#).unwrap(), vec![Prompt::Text("a".into())]);
        assert_eq!(p(r#"{"prompt":[5, 99]}"#).unwrap(), vec![Prompt::Ids(vec![5, 99])]);
        assert_eq!(p(r#"{"prompt":[[5]]}"#).unwrap(), vec![Prompt::Ids(vec![5])]);
        assert_eq!(p(r#"{"prompt":["a","b"]}"#).unwrap(), vec![Prompt::Text("a".into()), Prompt::Text("b".into())]);
        assert_eq!(p(r#"{"prompt":[[1],"b"]}"#).unwrap(), vec![Prompt::Ids(vec![1]), Prompt::Text("b".into())]);
        for body in [r#"{"prompt":[100]}"#, r#"{"prompt":[-1]}"#, r#"{"prompt":[1.5]}"#, r#"{"prompt":7}"#, r#"{}"#, r#"{"prompt":[]}"#, r#"{"prompt":[1,"a"]}"#, r#"{"prompt":[[1],[200]]}"#, r#"{"prompt":"a","messages":[]}"#] {
            let e = p(body).unwrap_err();
            assert!(e.param.as_deref() == Some("prompt") || e.param.as_deref() == Some("messages"), "{body}: {e:?}");
        }
        let many = format!(r#"{{"prompt":{}}}"#, serde_json::json!(vec!["a"; MAX_CHOICES + 1]));
        assert!(p(&many).unwrap_err().message.contains("at most 64"));
        assert!(p(r#"{"prompt":[100]}"#).unwrap_err().message.contains("[0, 100)"));
    }
}
