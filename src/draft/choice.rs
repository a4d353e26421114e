//! How each step's tree is chosen: a fixed tree, one grown per step from the drafter's
//! probabilities, or one grown and then cut by this device's measured costs.
use crate::draft::budget::{Budget, CostCurve, AUTO_NODES};
use crate::draft::tree::Tree;
use crate::model::Llama;
use crate::{Error, Result};

/// Deepest rank a tree may use: heads report this many candidates per position.
pub const TOP_K_LIMIT: usize = 16;

/// How each step's tree is chosen.
#[derive(Debug, Clone)]
pub enum TreeChoice {
    Static(Tree),
    /// Grow per step from the heads' probabilities, keeping this many nodes (root included).
    Dynamic(usize),
    /// Grow as `Dynamic`, then verify only the nodes worth their cost on this device
    /// ([`crate::draft::budget`]).
    Auto(Budget),
}

impl TreeChoice {
    /// `cpu`, `gpu`, `chain`, `chain:N`, `dynamic`, `dynamic:N`, `auto`, `auto:N`, or a tree file.
    pub fn parse(spec: &str) -> Result<Self> {
        if spec == "auto" {
            return Ok(TreeChoice::Auto(Budget { max_nodes: AUTO_NODES, costs: None, fit_to_device: true }));
        }
        if let Some(n) = spec.strip_prefix("auto:") {
            let n: usize = n.parse().map_err(|_| Error::InvalidTree(format!("bad node count in '{spec}'")))?;
            if !(2..=64).contains(&n) {
                return Err(Error::InvalidTree(format!("'{spec}': an auto tree grows 2 to 64 nodes")));
            }
            return Ok(TreeChoice::Auto(Budget { max_nodes: n, costs: None, fit_to_device: false }));
        }
        if spec == "dynamic" {
            return Ok(TreeChoice::Dynamic(8));
        }
        if let Some(n) = spec.strip_prefix("dynamic:") {
            let n: usize = n.parse().map_err(|_| Error::InvalidTree(format!("bad node count in '{spec}'")))?;
            if n < 2 {
                return Err(Error::InvalidTree("a dynamic tree needs at least 2 nodes".into()));
            }
            return Ok(TreeChoice::Dynamic(n));
        }
        Ok(TreeChoice::Static(Tree::parse_spec(spec)?))
    }

    /// For `auto`: measure this device's forward costs now (once, for many generations) unless
    /// they are known. `extra` = nodes a lookup branch may add.
    pub fn with_costs(self, model: &Llama, extra: usize) -> Result<Self> {
        match self {
            TreeChoice::Auto(b @ Budget { costs: None, .. }) => {
                let costs = CostCurve::measure(model, b.max_nodes + extra)?;
                Ok(TreeChoice::Auto(b.with_measured(costs)))
            }
            other => Ok(other),
        }
    }
}

