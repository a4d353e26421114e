//! Training drafters with the target frozen: self-distillation ([`distill`]), the shared training
//! loop and Medusa-style heads ([`heads`]), the EAGLE-style draft layer ([`layer`]), the fused
//! soft-label loss both use ([`loss`]), data-parallel gradients ([`parallel`]), and one run end
//! to end with its recorded recipe ([`recipe`]).
pub mod distill;
pub mod heads;
pub mod layer;
pub mod loss;
pub mod parallel;
pub mod recipe;

pub use heads::*;
