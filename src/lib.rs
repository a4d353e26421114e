//! selfspec: self-speculative decoding with Medusa-style draft heads and exact tree verification.
//!
//! Data flows one way: [`loader`] builds a [`loader::Target`] (a [`model::Llama`] plus tokenizer),
//! [`generate`] decodes plainly, and the speculative modules build on the same forward.
pub mod bench;
pub mod data;
pub mod distill;
pub mod error;
pub mod eval;
pub mod fixtures;
pub mod generate;
pub mod heads;
pub mod kernels;
pub mod kv_cache;
pub mod loader;
pub mod model;
pub mod quant;
pub mod sampling;
pub mod spec;
pub mod tokenizer;
pub mod train;
pub mod tree;
pub mod verify;

pub use error::{Error, Result};
