//! Self-speculative decoding: a [`plan::Plan`] says how each step drafts, the drafter proposes a
//! tree, one target forward checks it, [`verify`] decides what is emitted (exactly), and the KV
//! cache is compacted to the accepted path. [`session::Sequence`] is one generation as a step
//! machine (proposer and verifier); [`driver::generate_spec`] drives one alone, the server's
//! scheduler drives many through one forward.
pub mod conversation;
pub mod driver;
pub mod plan;
pub mod prefix;
pub mod session;
pub mod verify;

pub use conversation::{Conversation, Reply};
pub use driver::*;
pub use prefix::{Prefix, PrefixCache};
pub use session::{Sequence, SpecOptions, SpecStats, StepTimes, Work};
