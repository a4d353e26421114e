//! Self-speculative decoding: a [`plan::Plan`] says how each step drafts, the drafter proposes a
//! tree, one target forward checks it, [`verify`] decides what is emitted (exactly), and the KV
//! cache is compacted to the accepted path ([`driver::generate_spec`]).
pub mod driver;
pub mod plan;
pub mod verify;

pub use driver::*;
