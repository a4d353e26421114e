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

/// Sampling and length fields common to both endpoints.
#[derive(Debug, Deserialize, Default)]
pub struct Common {
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
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<u64>,
    /// Accepted (OpenAI's end-user id: nothing to do with decoding).
    pub user: Option<String>,
    /// Everything else, refused by name.
    #[serde(flatten)]
    pub other: BTreeMap<String, Value>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    #[serde(flatten)]
    pub common: Common,
}

#[derive(Debug, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: Content,
}

/// A message's content: a string, or a list of text parts.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Value>),
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Value,
    #[serde(flatten)]
    pub common: Common,
}

/// The most new tokens a request may ask for when it says nothing (as llama.cpp's server, the
/// context is the other limit).
pub const DEFAULT_MAX_TOKENS: u64 = 512;
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
    pub stream: bool,
    pub include_usage: bool,
}

/// Parse a JSON body into `T`, as a 400 naming what is wrong.
pub fn parse<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::invalid(None, format!("the request body is not valid JSON for this endpoint: {e}")))
}

impl Common {
    /// Check the fields against what the server does and turn them into decoding parameters.
    /// OpenAI's defaults: temperature 1, top_p 1; `model` must name the served model.
    pub fn decoding(&self, served: &str) -> Result<Decoding, ApiError> {
        if let Some((k, _)) = self.other.iter().find(|(_, v)| !v.is_null()) {
            let what = match k.as_str() {
                "tools" | "tool_choice" | "functions" | "function_call" | "parallel_tool_calls" => "tool calling is not supported",
                "logprobs" | "top_logprobs" | "echo" | "best_of" | "suffix" => "log-probabilities, echo, best_of and suffix are not supported",
                "response_format" => "structured output (response_format) is not supported",
                "logit_bias" => "logit_bias is not supported",
                _ => "unknown or unsupported parameter",
            };
            // `logprobs: false` asks for nothing.
            if !(k == "logprobs" && self.other[k] == Value::Bool(false)) {
                return Err(ApiError::invalid(Some(k), format!("{k}: {what}")));
            }
        }
        match self.model.as_deref() {
            None => return Err(ApiError::invalid(Some("model"), format!("model is required (this server serves '{served}')"))),
            Some(m) if m != served => {
                return Err(ApiError { status: 404, message: format!("the model '{m}' does not exist (this server serves '{served}')"), kind: "invalid_request_error", param: Some("model".into()), code: Some("model_not_found") });
            }
            Some(_) => {}
        }
        if let Some(n) = self.n.filter(|&n| n != 1) {
            return Err(ApiError::invalid(Some("n"), format!("n = {n}: only one choice per request is supported")));
        }
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
        params.validate().map_err(|e| ApiError::invalid(None, e.to_string()))?;
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop.len() > MAX_STOPS || stop.iter().any(|s| s.len() > MAX_STOP_LEN) {
            return Err(ApiError::invalid(Some("stop"), format!("at most {MAX_STOPS} stop strings of at most {MAX_STOP_LEN} bytes")));
        }
        Ok(Decoding {
            params,
            max_tokens: usize::try_from(max_tokens).unwrap_or(usize::MAX),
            seed: self.seed,
            stop,
            stream: self.stream,
            include_usage: self.stream_options.as_ref().is_some_and(|o| o.include_usage),
        })
    }
}

impl ChatRequest {
    /// The conversation as the chat template's messages (system, user and assistant turns).
    pub fn messages(&self) -> Result<Vec<Message>, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::invalid(Some("messages"), "messages is empty"));
        }
        self.messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let role = match m.role.as_str() {
                    "system" | "developer" => "system",
                    "user" => "user",
                    "assistant" => "assistant",
                    other => return Err(ApiError::invalid(Some(&format!("messages[{i}].role")), format!("role '{other}' is not supported (system, user, assistant)"))),
                };
                let content = match &m.content {
                    Content::Text(s) => s.clone(),
                    Content::Parts(parts) => {
                        let mut s = String::new();
                        for p in parts {
                            match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                                (Some("text"), Some(t)) => s.push_str(t),
                                _ => return Err(ApiError::invalid(Some(&format!("messages[{i}].content")), "only text content parts are supported")),
                            }
                        }
                        s
                    }
                };
                Ok(Message { role: role.into(), content })
            })
            .collect()
    }
}

impl CompletionRequest {
    /// The raw prompt (one string; a list of one string is taken too).
    pub fn prompt(&self) -> Result<String, ApiError> {
        match &self.prompt {
            Value::String(s) => Ok(s.clone()),
            Value::Array(a) if a.len() == 1 && a[0].is_string() => Ok(a[0].as_str().unwrap_or_default().to_string()),
            _ => Err(ApiError::invalid(Some("prompt"), "prompt must be a string (batches of prompts are not supported: send one request each)")),
        }
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
        serde_json::from_value::<Common>(v).unwrap().decoding("m")
    }

    #[test]
    fn requests_become_decoding_parameters_or_name_what_is_refused() {
        let d = common(serde_json::json!({"model": "m", "temperature": 0, "max_tokens": 5, "stop": "\n", "top_k": 40, "seed": 3, "logprobs": false})).unwrap();
        assert_eq!((d.params.temperature, d.params.top_k, d.max_tokens, d.seed, d.stop.clone()), (0.0, 40, 5, Some(3), vec!["\n".to_string()]));
        let d = common(serde_json::json!({"model": "m"})).unwrap();
        assert_eq!((d.params.temperature, d.max_tokens as u64), (1.0, DEFAULT_MAX_TOKENS), "OpenAI's defaults");
        for (body, param, status) in [
            (serde_json::json!({"model": "m", "n": 2}), "n", 400),
            (serde_json::json!({"model": "m", "tools": [{"type": "function"}]}), "tools", 400),
            (serde_json::json!({"model": "m", "logit_bias": {"1": 2}}), "logit_bias", 400),
            (serde_json::json!({"model": "m", "frobnicate": 1}), "frobnicate", 400),
            (serde_json::json!({"model": "other"}), "model", 404),
            (serde_json::json!({}), "model", 400),
            (serde_json::json!({"model": "m", "max_tokens": 0}), "max_tokens", 400),
            (serde_json::json!({"model": "m", "top_k": -3}), "top_k", 400),
            (serde_json::json!({"model": "m", "stop": ["a", "b", "c", "d", "e"]}), "stop", 400),
        ] {
            let e = common(body.clone()).unwrap_err();
            assert_eq!((e.status, e.param.as_deref()), (status, Some(param)), "{body}: {e:?}");
        }
        let e = common(serde_json::json!({"model": "m", "top_p": 0})).unwrap_err();
        assert!(e.message.contains("top-p"), "{e:?}");
        assert_eq!(e.body()["error"]["type"], "invalid_request_error");
    }

    #[test]
    fn chat_messages_take_strings_and_text_parts_only() {
        let r: ChatRequest = parse(br#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi "},{"type":"text","text":"there"}]}]}"#).unwrap();
        let m = r.messages().unwrap();
        assert_eq!((m[0].role.as_str(), m[1].content.as_str()), ("system", "hi there"));
        let r: ChatRequest = parse(br#"{"model":"m","messages":[{"role":"tool","content":"x"}]}"#).unwrap();
        assert_eq!(r.messages().unwrap_err().param.as_deref(), Some("messages[0].role"));
        let r: ChatRequest = parse(br#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{}}]}]}"#).unwrap();
        assert!(r.messages().is_err());
        assert!(parse::<ChatRequest>(b"{not json").unwrap_err().message.contains("not valid JSON"));
        let c: CompletionRequest = parse(br#"{"model":"m","prompt":["a", "b"]}"#).unwrap();
        assert!(c.prompt().is_err());
    }
}
