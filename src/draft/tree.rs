//! Token trees for one speculative step.
//!
//! A node is a path of ranks from the root, Medusa-style: `[0, 1]` means "head 0's best guess,
//! then head 1's second-best". A [`Tree`] can only be built prefix-closed (every node's parent is
//! in the tree) and parents always precede children (breadth-first from rank paths; grafted
//! nodes are appended), which is what the tree mask, the positions and KV compaction rely on.
use std::path::Path;

use crate::cpu::TreeMask;
use crate::{Error, Result};

/// The most nodes (the root included) one step may verify, copied branches included: far past
/// where a forward stops being nearly free (64 rows cost 4.3x one row for SmolLM2 f32 on the
/// 2-core AVX-512 Xeon), and it keeps ranks and a step's work small. Every tree spec is checked
/// against it before anything is built.
pub const MAX_TREE_NODES: usize = 64;
// Sliding-window layers clip only the cached prefix: a tree (its drafted and copied nodes
// together, at most MAX_TREE_NODES deep) must fit inside the narrowest window a model may have.
const _: () = assert!(MAX_TREE_NODES < crate::model::llama::MIN_SLIDING_WINDOW);

/// The largest tree file read: 63 paths of at most 63 ranks fit in a few kilobytes.
pub const MAX_TREE_FILE_BYTES: u64 = 1 << 16;

/// Deepest rank a tree may use: drafters report this many candidates per position at most.
pub const MAX_RANK: usize = 16;

/// The tree forms a `--tree` spec may take, for error messages.
pub const TREE_FORMS: &str = "cpu, gpu, chain, chain:N, dynamic, dynamic:N, auto, auto:N, or a tree JSON file, each optionally with +lookup[:N]";

#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    pub parent: Option<usize>,
    pub depth: usize,
    /// Which rank of head `depth - 1`'s top-k fills this node (unused for the root).
    pub rank: usize,
    /// Children in rank order: the fixed order verification tries them in.
    pub children: Vec<usize>,
    /// The full rank path from the root.
    pub path: Vec<usize>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Tree {
    nodes: Vec<Node>,
}

impl Tree {
    /// From Medusa-style rank paths (the root is implicit). Rejects trees that are not
    /// prefix-closed and duplicate paths.
    pub fn from_paths(paths: &[Vec<usize>]) -> Result<Self> {
        if paths.len() + 1 > MAX_TREE_NODES {
            return Err(Error::InvalidTree(format!("{} paths: a tree verifies at most {MAX_TREE_NODES} nodes, the root included", paths.len())));
        }
        let mut sorted: Vec<Vec<usize>> = paths.to_vec();
        sorted.sort_by(|a, b| a.len().cmp(&b.len()).then_with(|| a.cmp(b)));
        let mut nodes = vec![Node { parent: None, depth: 0, rank: 0, children: vec![], path: vec![] }];
        let mut index: std::collections::HashMap<Vec<usize>, usize> = std::collections::HashMap::new();
        index.insert(vec![], 0);
        for p in sorted {
            if p.is_empty() {
                return Err(Error::InvalidTree("an empty path (the root is implicit)".into()));
            }
            if let Some(r) = p.iter().find(|&&r| r >= MAX_TREE_NODES) {
                return Err(Error::InvalidTree(format!("path {p:?} uses rank {r}; drafts rank at most {} candidates", MAX_TREE_NODES)));
            }
            if index.contains_key(&p) {
                return Err(Error::InvalidTree(format!("path {p:?} appears twice")));
            }
            let parent = *index
                .get(&p[..p.len() - 1])
                .ok_or_else(|| Error::InvalidTree(format!("path {p:?} has no parent {:?}: trees must be prefix-closed", &p[..p.len() - 1])))?;
            let id = nodes.len();
            nodes.push(Node { parent: Some(parent), depth: p.len(), rank: *p.last().unwrap(), children: vec![], path: p.clone() });
            nodes[parent].children.push(id);
            index.insert(p, id);
        }
        for n in nodes.iter_mut() {
            // Already rank-ordered by the sort; keep it explicit.
            n.children.sort();
        }
        Ok(Tree { nodes })
    }

    /// A chain of `depth` drafts: each head's best guess.
    pub fn chain(depth: usize) -> Self {
        let paths: Vec<Vec<usize>> = (1..=depth).map(|d| vec![0; d]).collect();
        Self::from_paths(&paths).expect("a chain is prefix-closed")
    }

    /// 8 nodes: on a 2-core CPU a forward of 8 tokens costs about 1.3x one token and 12 already
    /// 1.6x, so with heads of ~0.3 top-1 accuracy small trees win (see `tune`).
    pub fn cpu_default() -> Self {
        let p: Vec<Vec<usize>> = vec![vec![0], vec![1], vec![2], vec![0, 0], vec![0, 1], vec![1, 0], vec![0, 0, 0]];
        Self::from_paths(&p).expect("built-in tree is valid")
    }

    /// 64 nodes, for GPUs where verifying 64 tokens costs about as much as one: grown best-first
    /// (like `tune`) from typical Medusa per-rank accuracies, so it is prefix-closed by construction.
    pub fn gpu_default() -> Self {
        let typical: [&[f32]; 4] = [
            &[0.60, 0.12, 0.05, 0.03, 0.02, 0.015, 0.01, 0.01],
            &[0.40, 0.10, 0.05, 0.03, 0.02, 0.015, 0.01, 0.01],
            &[0.30, 0.08, 0.04, 0.03, 0.02, 0.01, 0.01, 0.01],
            &[0.25, 0.07, 0.04, 0.02, 0.02, 0.01, 0.01, 0.01],
        ];
        let top: Vec<Vec<(u32, f32)>> = typical.iter().map(|row| row.iter().enumerate().map(|(r, &p)| (r as u32, p)).collect()).collect();
        dynamic_tree(&top, 64)
    }

    /// Parse a tree file: `[[0],[1],[0,0]]` or `{"paths": [...]}` (what `tune` writes).
    pub fn from_json(text: &str) -> Result<Self> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| Error::InvalidTree(format!("not JSON: {e}")))?;
        let arr = v.get("paths").unwrap_or(&v);
        let paths: Vec<Vec<usize>> = serde_json::from_value(arr.clone())
            .map_err(|e| Error::InvalidTree(format!("expected a list of rank paths like [[0],[1],[0,0]]: {e}")))?;
        if paths.is_empty() {
            return Err(Error::InvalidTree("no paths".into()));
        }
        Self::from_paths(&paths)
    }

    /// `cpu`, `gpu`, `chain` (4 deep here; [`crate::draft::choice::TreeChoice`] makes a bare
    /// `chain` as deep as the drafter drafts), `chain:N`, or a JSON file.
    pub fn parse_spec(spec: &str) -> Result<Self> {
        match spec {
            "cpu" => Ok(Self::cpu_default()),
            "gpu" => Ok(Self::gpu_default()),
            "chain" => Ok(Self::chain(4)),
            s if s.starts_with("chain:") => {
                let n: usize = s[6..].parse().map_err(|_| Error::InvalidTree(format!("bad chain length in '{s}'")))?;
                if n == 0 {
                    return Err(Error::InvalidTree("chain:0 drafts nothing".into()));
                }
                if n + 1 > MAX_TREE_NODES {
                    return Err(Error::InvalidTree(format!("'{s}': a tree verifies at most {MAX_TREE_NODES} nodes, the root included (chain:{} at most)", MAX_TREE_NODES - 1)));
                }
                Ok(Self::chain(n))
            }
            path => {
                let p = Path::new(path);
                if !p.exists() {
                    return Err(Error::InvalidTree(format!("'{path}' is neither a tree form nor a file; --tree takes {TREE_FORMS}")));
                }
                let text = crate::files::read_text(p, MAX_TREE_FILE_BYTES, "a tree file")?;
                let t = Self::from_json(&text).map_err(|e| Error::bad_file(p, e.to_string()))?;
                // Checked here too (a drafter checks again), so the message names the file
                // before a model is loaded.
                if let Some(n) = t.nodes.iter().skip(1).find(|n| n.rank >= MAX_RANK) {
                    return Err(Error::bad_file(p, format!("node {:?} uses rank {}, but drafts give at most their top {MAX_RANK}", n.path, n.rank)));
                }
                Ok(t)
            }
        }
    }

    /// Check the tree against the drafter that will fill it: `levels` deep at most (one per
    /// head, or a draft layer's limit), ranks below `max_rank`.
    pub fn validate_for(&self, levels: usize, max_rank: usize) -> Result<()> {
        self.validate_against(levels, "heads", max_rank)
    }

    /// As [`Tree::validate_for`], naming what has `levels` levels in the message.
    pub fn validate_against(&self, levels: usize, what: &str, max_rank: usize) -> Result<()> {
        let depth = self.depth();
        if depth > levels {
            return Err(Error::InvalidTree(format!("the tree is {depth} deep but there are only {levels} {what}")));
        }
        if let Some(n) = self.nodes.iter().skip(1).find(|n| n.rank >= max_rank) {
            return Err(Error::InvalidTree(format!("node {:?} uses rank {} but drafts give their top {max_rank}", n.path, n.rank)));
        }
        Ok(())
    }

    pub fn to_json(&self) -> String {
        let paths: Vec<&Vec<usize>> = self.nodes.iter().skip(1).map(|n| &n.path).collect();
        serde_json::json!({ "paths": paths }).to_string()
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }
    pub fn is_empty(&self) -> bool {
        false
    }
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }
    pub fn node(&self, i: usize) -> &Node {
        &self.nodes[i]
    }
    pub fn depth(&self) -> usize {
        self.nodes.iter().map(|n| n.depth).max().unwrap_or(0)
    }
    /// Highest rank used at each depth (1-based depth -> index depth-1), for top-k sizing.
    pub fn ranks_per_depth(&self) -> Vec<usize> {
        let mut r = vec![0; self.depth()];
        for n in self.nodes.iter().skip(1) {
            r[n.depth - 1] = r[n.depth - 1].max(n.rank + 1);
        }
        r
    }
    pub fn parents(&self) -> Vec<Option<usize>> {
        self.nodes.iter().map(|n| n.parent).collect()
    }
    pub fn mask(&self) -> TreeMask {
        TreeMask::from_parents(&self.parents()).expect("trees are built parents-first")
    }
    /// Node i sits at position `committed + depth(i)`: siblings share a position.
    pub fn positions(&self, committed: usize) -> Vec<usize> {
        self.nodes.iter().map(|n| committed + n.depth).collect()
    }
    /// Add a node under `parent` with the next free rank there (after its other children, so it
    /// is tried last) and return its index. Appended at the end: parents still come first, which
    /// is all the mask, positions and compaction need.
    pub fn add_child(&mut self, parent: usize) -> usize {
        let p = &self.nodes[parent];
        let rank = p.children.iter().map(|&c| self.nodes[c].rank + 1).max().unwrap_or(0);
        let mut path = p.path.clone();
        path.push(rank);
        let id = self.nodes.len();
        self.nodes.push(Node { parent: Some(parent), depth: p.depth + 1, rank, children: vec![], path });
        self.nodes[parent].children.push(id);
        id
    }

    /// The tree of the nodes `keep` (ascending, root included, every node's parent kept too),
    /// siblings in their old order; node `keep[j]` becomes node `j`.
    pub fn restrict(&self, keep: &[usize]) -> Result<Tree> {
        if keep.first() != Some(&0) || keep.windows(2).any(|w| w[0] >= w[1]) || keep.last().is_some_and(|&l| l >= self.len()) {
            return Err(Error::InvalidTree(format!("nodes to keep must ascend from the root within {} nodes: {keep:?}", self.len())));
        }
        let mut new_of = vec![usize::MAX; self.len()];
        new_of[0] = 0;
        let mut t = Tree::from_paths(&[])?;
        for &i in &keep[1..] {
            let p = self.nodes[i].parent.expect("non-root");
            if new_of[p] == usize::MAX {
                return Err(Error::InvalidTree(format!("node {i} is kept without its parent {p}")));
            }
            new_of[i] = t.add_child(new_of[p]);
        }
        Ok(t)
    }

    /// Node indices from the root to `i`.
    pub fn path_to(&self, mut i: usize) -> Vec<usize> {
        let mut p = vec![i];
        while let Some(q) = self.nodes[i].parent {
            p.push(q);
            i = q;
        }
        p.reverse();
        p
    }
    /// Root-to-leaf paths of node indices.
    pub fn leaf_paths(&self) -> Vec<Vec<usize>> {
        (0..self.len()).filter(|&i| self.nodes[i].children.is_empty()).map(|i| self.path_to(i)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restrict_keeps_a_prefix_closed_subset() {
        // 0 -> {1, 2}, 1 -> {3, 4}, 3 -> {5}
        let t = Tree::from_json("[[0],[1],[0,0],[0,1],[0,0,0]]").unwrap();
        let r = t.restrict(&[0, 2, 1, 3]).expect_err("unsorted");
        assert!(r.to_string().contains("ascend"));
        assert!(t.restrict(&[0, 1, 5]).is_err(), "5 without its parent 3");
        assert!(t.restrict(&[0, 9]).is_err());
        let s = t.restrict(&[0, 1, 2, 4]).unwrap();
        assert_eq!(s.len(), 4);
        assert_eq!(s.node(0).children, vec![1, 2], "siblings keep their order");
        assert_eq!(s.node(3).parent, Some(1));
        assert_eq!(s.positions(0), vec![0, 1, 1, 2]);
    }

    #[test]
    fn builds_prefix_closed_breadth_first() {
        let t = Tree::from_json("[[0],[1],[0,0],[0,1],[0,0,0]]").unwrap();
        assert_eq!(t.len(), 6);
        assert_eq!(t.node(3).parent, Some(1));
        assert_eq!(t.node(0).children, vec![1, 2]);
        assert_eq!(t.positions(10), vec![10, 11, 11, 12, 12, 13]);
        assert_eq!(t.path_to(5), vec![0, 1, 3, 5]);
        assert_eq!(t.leaf_paths().len(), 3);
        assert_eq!(t.ranks_per_depth(), vec![2, 2, 1]);
        assert!(t.mask().sees(5, 1) && !t.mask().sees(5, 2));
        assert_eq!(Tree::from_json(&t.to_json()).unwrap(), t);
    }

    #[test]
    fn rejects_invalid_trees() {
        assert!(Tree::from_json("[[0,0]]").unwrap_err().to_string().contains("prefix-closed"));
        assert!(Tree::from_json("[[0],[0]]").is_err());
        assert!(Tree::from_json("{\"x\": 1}").is_err());
        assert!(Tree::chain(5).validate_for(4, 10).is_err());
        assert!(Tree::from_json("[[0],[7]]").unwrap().validate_for(4, 5).is_err());
        assert!(Tree::parse_spec("chain:0").is_err());
        let cpu = Tree::cpu_default();
        assert!((8..=16).contains(&cpu.len()));
        let gpu = Tree::gpu_default();
        assert_eq!(gpu.len(), 64);
        assert!(gpu.validate_for(4, 8).is_ok());
        assert!(gpu.depth() >= 3);
        // A tree file's ranks are checked as it is read, the file named.
        let dir = std::env::temp_dir().join(format!("selfspec-tree-rank-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("deep-rank.json");
        std::fs::write(&f, format!("[[0],[{MAX_RANK}]]")).unwrap();
        let e = Tree::parse_spec(f.to_str().unwrap()).unwrap_err().to_string();
        assert!(e.contains("deep-rank.json") && e.contains(&format!("rank {MAX_RANK}")), "{e}");
        std::fs::write(&f, format!("[[0],[{}]]", MAX_RANK - 1)).unwrap();
        assert!(Tree::parse_spec(f.to_str().unwrap()).is_ok());
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// EAGLE-2-style dynamic tree for one step: grow best-first by the product of the heads' own
/// probabilities along each path and keep the best `max_nodes` (root included). Scores only
/// shrink from a node to its children and next siblings, so the result is prefix-closed.
/// `top[d]` is head d's top-k as (token, probability), best first.
pub fn dynamic_tree(top: &[Vec<(u32, f32)>], max_nodes: usize) -> Tree {
    #[derive(PartialEq)]
    struct Cand(f64, Vec<usize>);
    impl Eq for Cand {}
    impl PartialOrd for Cand {
        fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
            Some(self.cmp(o))
        }
    }
    impl Ord for Cand {
        fn cmp(&self, o: &Self) -> std::cmp::Ordering {
            self.0.total_cmp(&o.0).then_with(|| o.1.cmp(&self.1))
        }
    }
    let mut heap = std::collections::BinaryHeap::new();
    let mut paths: Vec<Vec<usize>> = Vec::new();
    if let Some(first) = top.first().and_then(|r| r.first()) {
        heap.push(Cand(first.1 as f64, vec![0]));
    }
    while paths.len() + 1 < max_nodes {
        let Some(Cand(score, path)) = heap.pop() else { break };
        let d = path.len() - 1;
        let r = *path.last().unwrap();
        // Next sibling: same parent, next rank.
        if let (Some(cur), Some(next)) = (top[d].get(r), top[d].get(r + 1)) {
            let mut p = path.clone();
            *p.last_mut().unwrap() = r + 1;
            heap.push(Cand(score / (cur.1 as f64).max(1e-30) * next.1 as f64, p));
        }
        // First child: the next head's best guess.
        if let Some(child) = top.get(d + 1).and_then(|row| row.first()) {
            let mut p = path.clone();
            p.push(0);
            heap.push(Cand(score * child.1 as f64, p));
        }
        paths.push(path);
    }
    Tree::from_paths(&paths).expect("best-first growth is prefix-closed")
}

#[cfg(test)]
mod dynamic_tests {
    use super::*;
    #[test]
    fn confident_heads_grow_chains_uncertain_ones_fans() {
        let conf: Vec<Vec<(u32, f32)>> = (0..4).map(|_| vec![(1, 0.95), (2, 0.03), (3, 0.01)]).collect();
        let t = dynamic_tree(&conf, 5);
        assert_eq!(t.depth(), 4);
        let unsure: Vec<Vec<(u32, f32)>> = (0..4).map(|_| vec![(1, 0.3), (2, 0.3), (3, 0.3)]).collect();
        let t = dynamic_tree(&unsure, 4);
        assert_eq!(t.depth(), 1);
        assert_eq!(t.len(), 4);
    }
}
