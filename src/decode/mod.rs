//! Plain decoding: the sampling distribution and the token-by-token loop every speculative run
//! must reproduce.
pub mod generate;
pub mod sampling;
