//! selfspec: self-speculative decoding. A drafter that reads the target model's own hidden
//! states (Medusa-style heads, or an EAGLE-style draft layer) proposes a small token tree; one
//! target forward with tree attention checks it with an exact acceptance rule, so the output is
//! what the target alone would produce: bit-identical under greedy decoding, the same
//! distribution under sampling.
//!
//! # Using it as a library
//!
//! ```no_run
//! use selfspec::{generate_spec, rng, Drafter, Flow, Plan, Rule, SamplingParams, SpecOptions, StopRule, Target};
//!
//! # fn main() -> selfspec::Result<()> {
//! let target = Target::load(std::path::Path::new("models/smollm2.gguf"), &candle_core::Device::Cpu)?;
//! let drafter = Drafter::from_dir(std::path::Path::new("training/drafters/smollm2-layer"), &target)?;
//! let prompt = target.encode_prompt("Write a haiku about the sea.", true)?;
//! let params = SamplingParams::greedy();
//! let plan = Plan::parse(selfspec::DEFAULT_TREE)?;
//! let stop = StopRule { max_new_tokens: 64, eos_ids: &target.tokenizer.eos_ids };
//! let opts = SpecOptions { tree: plan.tree, lookup: plan.lookup, datastore: None, rule: Rule::for_params(&params, false), params, stop };
//! let (tokens, stats) = generate_spec(&target.model, &drafter, &prompt, &opts, &mut rng(0), &mut |_| Ok(Flow::Continue))?;
//! println!("{} (tau {:.2} tokens per target forward, bonus token counted)", target.tokenizer.decode(&tokens)?, stats.tau());
//! # Ok(())
//! # }
//! ```
//!
//! # Where things are
//!
//! Modules from the bottom up; each imports only modules below it (`tests/layers.rs` checks):
//!
//! | module | what it holds |
//! |---|---|
//! | [`error`], [`files`] | the error type; atomic writes |
//! | [`cpu`] | batch-invariant CPU kernels per weight format, tree attention, the thread team |
//! | [`model`] | config, the Llama-family forward, KV cache, tokenizer, loaders ([`Target`]) |
//! | [`data`] | prompt files, distill records, corpora, the corpus manifest |
//! | [`decode`] | sampling and plain decoding, the reference every speculative run reproduces |
//! | [`draft`] | trees, Medusa heads, the draft layer ([`Drafter`]), lookup and datastore branches |
//! | [`spec`] | the plan of a step, exact verification, the speculative loop |
//! | [`train`] | self-distillation, training heads and draft layers, recipes |
//! | [`eval`] | evaluation, tree tuning, forward benchmarks, the roofline |
//! | [`serve`] | the OpenAI-compatible server: batched, exact self-speculation over HTTP |
pub mod cpu;
pub mod data;
pub mod decode;
pub mod draft;
pub mod error;
pub mod eval;
pub mod files;
pub mod model;
pub mod serve;
pub mod spec;
pub mod train;

pub use cpu::quant::WeightFormat;
pub use decode::generate::{generate_plain, Flow, GenStats, StopMatch, StopRule, TextStream};
pub use decode::sampling::{rng, token_logprobs, SamplingParams, TokenLogprobs};
pub use draft::drafter::Drafter;
pub use error::{Error, Result};
pub use model::loader::Target;
pub use spec::plan::{Plan, DEFAULT_TREE};
pub use spec::verify::Rule;
pub use spec::{generate_spec, SpecOptions, SpecStats};
