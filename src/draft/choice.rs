//! How each step's tree is chosen: a fixed tree, one grown per step from the drafter's
//! probabilities, or one grown and then cut by this device's measured costs.
use crate::draft::budget::{Budget, CostCurve, AUTO_NODES};
use crate::draft::tree::{Tree, MAX_RANK, MAX_TREE_NODES};
use crate::model::Llama;
use crate::{Error, Result};

/// Deepest rank a tree may use: heads report this many candidates per position.
pub const TOP_K_LIMIT: usize = MAX_RANK;

/// How each step's tree is chosen.
#[derive(Debug, Clone)]
pub enum TreeChoice {
    Static(Tree),
    /// Bare `chain`: each level's best guess, as deep as the drafter drafts
    /// ([`crate::draft::drafter::Drafter::resolve`] turns it into a static chain).
    Chain,
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
            if !(2..=MAX_TREE_NODES).contains(&n) {
                return Err(Error::InvalidTree(format!("'{spec}': an auto tree grows 2 to {MAX_TREE_NODES} nodes")));
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
            if n > MAX_TREE_NODES {
                return Err(Error::InvalidTree(format!("'{spec}': a dynamic tree keeps 2 to {MAX_TREE_NODES} nodes (the root included)")));
            }
            return Ok(TreeChoice::Dynamic(n));
        }
        if spec == "chain" {
            return Ok(TreeChoice::Chain);
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


#[cfg(test)]
mod tests {
    use super::*;

    /// Sizes are checked against the documented maximum before anything is built: a
    /// `chain:100000` once built 10^10 path entries and took the host down.
    #[test]
    fn tree_sizes_are_bounded_before_building() {
        for spec in ["chain:100000", "chain:64", "dynamic:100000", "dynamic:65", "auto:65"] {
            let e = TreeChoice::parse(spec).unwrap_err().to_string();
            assert!(e.contains(&MAX_TREE_NODES.to_string()), "{spec}: {e}");
        }
        assert!(matches!(TreeChoice::parse("chain:63"), Ok(TreeChoice::Static(t)) if t.len() == MAX_TREE_NODES));
        assert!(matches!(TreeChoice::parse("dynamic:64"), Ok(TreeChoice::Dynamic(64))));
        let paths: Vec<Vec<usize>> = (0..64).map(|r| vec![r]).collect();
        assert!(Tree::from_paths(&paths).unwrap_err().to_string().contains("at most"));
    }

    /// Bare `chain` is as deep as the drafter drafts; an unknown form names the valid ones.
    #[test]
    fn bare_chain_and_unknown_forms() {
        assert!(matches!(TreeChoice::parse("chain"), Ok(TreeChoice::Chain)));
        let e = TreeChoice::parse("garbage").unwrap_err().to_string();
        assert!(e.contains("'garbage'") && e.contains("chain:N") && e.contains("dynamic:N"), "{e}");
        let big = std::env::temp_dir().join(format!("selfspec-bigtree-{}.json", std::process::id()));
        std::fs::write(&big, vec![b' '; (crate::draft::tree::MAX_TREE_FILE_BYTES + 1) as usize]).unwrap();
        let e = TreeChoice::parse(big.to_str().unwrap()).unwrap_err().to_string();
        assert!(e.contains("a tree file is read whole only up to"), "{e}");
        std::fs::remove_file(&big).ok();
    }
}
