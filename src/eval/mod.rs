//! Measuring: acceptance length and speed-up against plain decoding in one run ([`run`]), with
//! reports ([`report`]); the tree tuned for this device ([`tune`]); forward costs per weight
//! format ([`mod@bench`]) beside this machine's roofline ([`roofline`]); the target's perplexity
//! over a text, as llama.cpp scores it ([`perplexity`]).
pub mod bench;
pub mod perplexity;
pub mod report;
pub mod roofline;
pub mod run;
pub mod tune;

pub use run::*;
