//! One error type for the library. Every variant that concerns a file names it, because the
//! person reading the message usually has several model, heads and corpus files in play.
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    // The io error is part of the message rather than a `source`, so it is printed once.
    #[error("{path}: {err}")]
    Io { path: PathBuf, err: std::io::Error },
    /// The file exists but its content is not what we can use (truncated, wrong format, ...).
    #[error("{path}: {msg}")]
    BadFile { path: PathBuf, msg: String },
    /// A valid file describing something we do not support (an architecture, a tokenizer kind).
    #[error("{path}: unsupported: {msg}")]
    Unsupported { path: PathBuf, msg: String },
    /// A drafter (heads or a draft layer) whose fingerprint does not match the target model.
    #[error("the drafter {heads} was trained for {heads_target}, but the model is {model_target}")]
    HeadsMismatch { heads: PathBuf, heads_target: String, model_target: String },
    #[error("invalid tree: {0}")]
    InvalidTree(String),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), err: source }
    }
    pub fn bad_file(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::BadFile { path: path.into(), msg: msg.into() }
    }
    pub fn unsupported(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Unsupported { path: path.into(), msg: msg.into() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn errors_name_the_file() {
        let e = Error::bad_file("x.gguf", "truncated");
        assert_eq!(e.to_string(), "x.gguf: truncated");
    }
}
