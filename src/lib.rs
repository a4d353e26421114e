//! selfspec: self-speculative decoding with Medusa-style draft heads or an EAGLE-style draft
//! layer, and exact tree verification.
//!
//! Data flows one way: [`loader`] builds a [`loader::Target`] (a [`model::Llama`] plus tokenizer),
//! [`generate`] decodes plainly, and the speculative modules build on the same forward:
//! [`drafter`] proposes a tree (with [`heads`] or a [`draft_layer`]), [`spec`] runs the loop and
//! [`verify`] decides what is emitted.
pub mod bench;
pub mod bf16;
pub mod budget;
pub mod data;
pub mod datastore;
pub mod distill;
pub mod draft_layer;
pub mod drafter;
pub mod error;
pub mod eval;
pub mod fixtures;
pub mod generate;
pub mod heads;
pub mod kernels;
pub mod kv_cache;
pub mod loader;
pub mod lookup;
pub mod model;
pub mod quant;
pub mod roofline;
pub mod sampling;
pub mod spec;
pub mod team;
pub mod tokenizer;
pub mod train;
pub mod train_layer;
pub mod tree;
pub mod verify;

pub use error::{Error, Result};
