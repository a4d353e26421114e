//! What proposes each step's tree: token trees, the two drafters (Medusa-style [`heads`] and the
//! EAGLE-style draft [`layer`]) behind one [`drafter::Drafter`], how a step's tree is chosen
//! ([`choice`], with the cost-aware [`budget`]), and the copied branches ([`lookup`] from the
//! context, [`datastore`] from the target's earlier answers).
pub mod budget;
pub mod choice;
pub mod datastore;
pub mod drafter;
pub mod eagle3;
pub mod export;
pub mod grad;
pub mod heads;
pub mod layer;
pub mod lookup;
pub mod tree;
