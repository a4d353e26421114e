//! A step's whole draft: the drafter's tree choice plus, optionally, a branch copied from the
//! context or a datastore.
use crate::draft::choice::TreeChoice;
use crate::draft::lookup::Lookup;
use crate::draft::tree::MAX_TREE_NODES;
use crate::{Error, Result};

/// The tree `generate` and `eval` use unless told otherwise, and what `tune` measures its pick
/// against: grown per step and cut by this device's measured costs, plus a copied branch of up
/// to 6 tokens.
pub const DEFAULT_TREE: &str = "auto+lookup:6";

/// A step's whole draft: the drafter's tree and, optionally, a branch copied from the context.
#[derive(Debug, Clone)]
pub struct Plan {
    pub tree: TreeChoice,
    pub lookup: Option<Lookup>,
}

impl Plan {
    /// A tree spec (see [`TreeChoice::parse`]), optionally followed by `+lookup` or `+lookup:N`.
    /// A tree file from `tune` may carry `"lookup": N` (kept when it measured faster).
    pub fn parse(spec: &str) -> Result<Self> {
        let (tree, lookup) = Lookup::split_spec(spec)?;
        let choice = TreeChoice::parse(tree)?;
        let lookup = match lookup {
            Some(l) => Some(l),
            None if std::path::Path::new(tree).is_file() => Lookup::from_tree_file(std::path::Path::new(tree))?,
            None => None,
        };
        if let Some(l) = &lookup {
            let tree_nodes = match &choice {
                TreeChoice::Static(t) => t.len(),
                TreeChoice::Dynamic(n) => *n,
                TreeChoice::Auto(b) => b.max_nodes,
                TreeChoice::Chain => 1 + crate::draft::drafter::LAYER_MAX_DEPTH,
            };
            if l.max_tokens > MAX_TREE_NODES || tree_nodes + l.max_tokens > MAX_TREE_NODES {
                return Err(Error::InvalidTree(format!(
                    "'{spec}': up to {tree_nodes} tree nodes and {} copied tokens; one step verifies at most {MAX_TREE_NODES} nodes, the root included",
                    l.max_tokens
                )));
            }
        }
        Ok(Plan { tree: choice, lookup })
    }
}


#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_parse_tree_and_lookup() {
        let p = Plan::parse(DEFAULT_TREE).unwrap();
        assert!(matches!(p.tree, TreeChoice::Auto(_)));
        assert_eq!(p.lookup.map(|l| l.max_tokens), Some(6));
        let p = Plan::parse("chain:3").unwrap();
        assert!(matches!(p.tree, TreeChoice::Static(_)) && p.lookup.is_none());
        assert!(Plan::parse("dynamic:1").is_err());
        // The tree and its copied branch together stay within one verification forward's rows.
        assert!(Plan::parse("dynamic:40+lookup:24").is_ok());
        let e = Plan::parse("dynamic:48+lookup:24").unwrap_err().to_string();
        assert!(e.contains("at most 64"), "{e}");
        assert!(Plan::parse("gpu+lookup").is_err());
    }
}
