//! The target model: its config, the Llama-family forward, the KV cache, the tokenizer, and the
//! loaders that build a [`loader::Target`] from a GGUF file or a Hugging Face directory.
//!
//! Depends only on [`crate::cpu`].
pub mod fixtures;
pub mod gguf;
pub mod kv_cache;
pub mod llama;
pub mod loader;
pub mod timing;
pub mod tokenizer;

pub use llama::*;
