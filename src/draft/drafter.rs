//! What proposes each step's tree: Medusa heads or an EAGLE-style draft layer, behind the one
//! interface the speculative loop uses. Either way the proposal is a [`Tree`] of rank paths plus
//! the token in every node; verification never looks at how it was made.
use std::collections::HashMap;
use std::path::Path;

use candle_core::Tensor;

use crate::draft::layer::{DraftLayer, LAYER_CONFIG_FILE};
use crate::draft::heads::Heads;
use crate::cpu::TreeMask;
use crate::model::kv_cache::KvCache;
use crate::model::loader::Target;
use crate::model::Llama;
use crate::cpu::quant::WeightFormat;
use crate::draft::choice::{TreeChoice, TOP_K_LIMIT};
use crate::draft::budget::Budget;
use crate::draft::tree::{dynamic_tree, Tree};
use crate::{Error, Result};

/// Deepest tree a draft layer is asked to fill: it can go on guessing, but each level costs one
/// more (small) forward.
pub const LAYER_MAX_DEPTH: usize = 8;

/// The CPU weight format drafters run in, whatever the target's. Drafts need not match the
/// target's numerics (verification decides what is emitted), only be cheap: with an f32 target,
/// an f32 draft layer re-read its 17 MB of weights and a 19 MB slice of lm_head at every level,
/// 1–2 ms each, a large share of a 20 ms step. `Native` here means 8-bit blocks for heads
/// ([`Heads::set_draft_format`]) and 4-bit blocks for a draft layer
/// ([`DraftLayer::set_format`]): an eighth of the f32 bytes, the top guesses mostly unchanged.
pub const DRAFTING_FORMAT: WeightFormat = WeightFormat::Native;

/// One drafter per run, so the variants' size difference costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
pub enum Drafter {
    Heads(Heads),
    Layer(DraftLayer),
}

impl Drafter {
    /// A draft layer when `dir` holds `draft.json`, heads otherwise (selfspec or Medusa format),
    /// set up to draft in [`DRAFTING_FORMAT`].
    pub fn from_dir(dir: &Path, target: &Target) -> Result<Self> {
        Self::from_dir_as(dir, target, DRAFTING_FORMAT)
    }

    /// [`Drafter::from_dir`], drafting in `format` instead. Why a choice: 4-bit blocks draft
    /// fastest, but their guesses drift a little from the trained weights', which costs deep
    /// trees more than shallow ones (bf16 `dynamic:32+lookup:16`: τ 2.94 with 4-bit drafting,
    /// 3.00 with 8-bit, at the same speed).
    pub fn from_dir_as(dir: &Path, target: &Target, format: WeightFormat) -> Result<Self> {
        Ok(Self::from_dir_noted(dir, target, format)?.0)
    }

    /// [`Drafter::from_dir_as`], with a note for the user when the drafter could not take
    /// `format` and drafts in another one (see [`Drafter::set_format`]).
    pub fn from_dir_noted(dir: &Path, target: &Target, format: WeightFormat) -> Result<(Self, Option<String>)> {
        let mut d = if dir.join(LAYER_CONFIG_FILE).exists() || crate::draft::eagle3::is_eagle3_dir(dir) {
            Drafter::Layer(load_layer(dir, target)?)
        } else {
            Drafter::Heads(Heads::from_dir(dir, target)?)
        };
        let used = d.set_format(format)?;
        let note = (used != format).then(|| {
            format!("{}: this {}'s matrices are not whole blocks of 32 values, so it drafts in {used} instead of {format} (drafts need not be exact; verification is)", dir.display(), d.kind())
        });
        Ok((d, note))
    }

    /// Load `dir` to draft with and for nothing else (not to train from, re-pack or save): only
    /// the packed copies it drafts from are kept ([`Drafter::release_f32_weights`]), and a draft
    /// layer stored in 4-bit blocks is read straight into them when it drafts in those
    /// ([`DraftLayer::from_dir_packed`]), with the same drafts as [`Drafter::from_dir_noted`].
    pub fn for_drafting(dir: &Path, target: &Target, format: WeightFormat) -> Result<(Self, Option<String>)> {
        if dir.join(LAYER_CONFIG_FILE).exists() {
            if let Some(l) = DraftLayer::from_dir_packed(dir, target, format)? {
                return Ok((Drafter::Layer(l), None));
            }
        }
        let (mut d, note) = Self::from_dir_noted(dir, target, format)?;
        d.release_f32_weights();
        Ok((d, note))
    }

    /// The target layers whose inputs it reads beside the final states (an EAGLE-3 layer's;
    /// none for the others).
    pub fn feature_layers(&self) -> &[usize] {
        match self {
            Drafter::Layer(l) => l.feature_layers(),
            Drafter::Heads(_) => &[],
        }
    }

    /// Make `target`'s forwards return what this drafter reads (see
    /// [`Llama::set_feature_layers`]); an EAGLE-3 layer given the final states alone refuses
    /// to draft rather than draft from the wrong features.
    pub fn attach(&self, target: &mut Target) -> Result<()> {
        target.model.set_feature_layers(self.feature_layers())
    }

    /// Keep only the packed copies it drafts with (see [`DraftLayer::release_f32_weights`]); for
    /// a drafter loaded to draft, not to train, save or export. Heads keep theirs (a few MB).
    pub fn release_f32_weights(&mut self) {
        if let Drafter::Layer(l) = self {
            l.release_f32_weights();
        }
    }

    /// How many levels below the root it can fill.
    pub fn max_depth(&self) -> usize {
        match self {
            Drafter::Heads(h) => h.num_heads(),
            Drafter::Layer(_) => LAYER_MAX_DEPTH,
        }
    }

    /// "heads" or "draft layer", for reports.
    pub fn kind(&self) -> &'static str {
        match self {
            Drafter::Heads(_) => "heads",
            Drafter::Layer(l) if !l.feature_layers().is_empty() => "EAGLE-3 draft layer",
            Drafter::Layer(_) => "draft layer",
        }
    }

    /// Set the format of the drafter's own fast copies; returns the format it drafts in. The
    /// block formats (`native`, `q8_0`) need every matrix's rows in whole blocks of 32 values; a
    /// drafter trained on a model whose widths are not (stories260K's FFN is 172 wide) drafts in
    /// f16 instead, rather than failing: drafts need not be exact.
    pub fn set_format(&mut self, format: WeightFormat) -> Result<WeightFormat> {
        crate::cpu::quant::with_block_fallback(format, |f| match self {
            Drafter::Heads(h) => h.set_draft_format(f),
            Drafter::Layer(l) => l.set_format(f),
        })
    }

    /// The tree choice as this drafter runs it: bare `chain` becomes a chain as deep as it drafts.
    pub fn resolve(&self, choice: &TreeChoice) -> TreeChoice {
        match choice {
            TreeChoice::Chain => TreeChoice::Static(Tree::chain(self.max_depth())),
            other => other.clone(),
        }
    }

    pub fn validate_tree(&self, choice: &TreeChoice) -> Result<()> {
        match choice {
            TreeChoice::Chain => Ok(()),
            TreeChoice::Static(t) => match self {
                Drafter::Heads(_) => t.validate_for(self.max_depth(), TOP_K_LIMIT),
                Drafter::Layer(_) => t.validate_against(self.max_depth(), "levels a draft layer drafts", TOP_K_LIMIT),
            },
            TreeChoice::Dynamic(_) | TreeChoice::Auto(_) => Ok(()),
        }
    }

    /// Drafting state for one generation, after the target's prefill: `hidden` holds the
    /// prompt's features `[n, d]`, `first` is the token the target chose after the prompt.
    pub fn start<'a>(&'a self, model: &Llama, hidden: &Tensor, prompt: &[u32], first: u32) -> Result<DraftState<'a>> {
        self.start_after(model, hidden, prompt, first, None)
    }

    /// [`Self::start`], with a draft layer's first pairs taken from `kept` (a finished
    /// generation's draft cache, [`DraftState::into_layer_cache`], whose pair p read the
    /// target's state at p and token p + 1): at most `prompt.len() - 1` of them are used, and
    /// the caller must give only pairs whose tokens are this prompt's (as
    /// [`crate::spec::Sequence::resume_from`] cuts them). The layer then runs over the prompt's
    /// other rows only. Each pair depends only on its own inputs and those before it, so the
    /// state is the one a fresh start reaches. Heads ignore `kept`.
    pub fn start_after<'a>(&'a self, model: &Llama, hidden: &Tensor, prompt: &[u32], first: u32, kept: Option<&KvCache>) -> Result<DraftState<'a>> {
        let n = prompt.len();
        if n == 0 {
            return Err(Error::InvalidArgument("a drafter starts after a prompt of at least one token".into()));
        }
        match self {
            Drafter::Heads(h) => Ok(DraftState::Heads { heads: h, h_last: hidden.narrow(0, n - 1, 1)? }),
            Drafter::Layer(l) => {
                l.check_target_states(hidden)?;
                let (k, mut cache) = match kept {
                    Some(c) => {
                        let k = c.len().min(n - 1);
                        (k, c.prefix_copy(k)?)
                    }
                    None => (0, l.new_cache()?),
                };
                let mut next: Vec<u32> = prompt[k + 1..].to_vec();
                next.push(first);
                let rows = n - k;
                let out = l.forward(&hidden.narrow(0, k, rows)?, &next, &(k..n).collect::<Vec<_>>(), &TreeMask::causal(rows), &mut cache, model)?;
                Ok(DraftState::Layer { layer: l, cache, root_feat: out.narrow(0, rows - 1, 1)? })
            }
        }
    }
}

/// A draft layer from `dir` in either of the formats it comes in: ours (`draft.json`), or an
/// EAGLE-3 checkpoint (SpecForge/vLLM `config.json`, [`crate::draft::eagle3`]). With its f32
/// weights, e.g. to train from.
pub fn load_layer(dir: &Path, target: &Target) -> Result<DraftLayer> {
    if !dir.join(LAYER_CONFIG_FILE).exists() && crate::draft::eagle3::is_eagle3_dir(dir) {
        return crate::draft::eagle3::import(dir, target);
    }
    DraftLayer::from_dir(dir, target)
}

/// One step's proposal.
pub struct Proposal {
    pub tree: Tree,
    /// The token in every node; the root's is the last emitted token.
    pub tokens: Vec<u32>,
    /// Per level below the root (per head for heads, level 1 only for a layer), the top guesses
    /// made from the root, for accuracy against what the target then emits.
    pub guesses: Vec<Vec<u32>>,
    /// Per node, the drafter's own probability of the path to it (product of its guesses'
    /// probabilities; root 1), for choosing which nodes are worth verifying.
    pub scores: Vec<f64>,
}

pub enum DraftState<'a> {
    Heads { heads: &'a Heads, h_last: Tensor },
    /// `cache` holds one pair per committed target token the layer has seen (fewer while
    /// skipped steps wait in the sequence's lag); `root_feat` is the layer's predicted feature
    /// at the root, from which the first level is guessed.
    Layer { layer: &'a DraftLayer, cache: KvCache, root_feat: Tensor },
}

impl DraftState<'_> {
    /// Committed pairs in a draft layer's cache (0 for heads).
    pub fn pairs(&self) -> usize {
        match self {
            DraftState::Layer { cache, .. } => cache.len(),
            DraftState::Heads { .. } => 0,
        }
    }

    /// A draft layer's cache of committed pairs (None for heads), for
    /// [`Drafter::start_after`] in a later generation that starts the same way.
    pub fn into_layer_cache(self) -> Option<KvCache> {
        match self {
            DraftState::Layer { cache, .. } => Some(cache),
            DraftState::Heads { .. } => None,
        }
    }

    /// Draft a tree under `root` (the last emitted token). `keep` = guesses recorded per level.
    /// `min_expand`: for `auto` trees, a path probability below which a node is not expanded
    /// (nothing under it could be worth verifying).
    #[allow(clippy::too_many_arguments)]
    pub fn propose(&mut self, model: &Llama, root: u32, choice: &TreeChoice, keep: usize, max_nodes: usize, min_expand: f64) -> Result<Proposal> {
        match self {
            DraftState::Heads { heads, h_last } => {
                let want = match choice {
                    TreeChoice::Static(t) => t.ranks_per_depth().into_iter().max().unwrap_or(1),
                    TreeChoice::Dynamic(n) | TreeChoice::Auto(Budget { max_nodes: n, .. }) => (*n).min(TOP_K_LIMIT),
                    TreeChoice::Chain => 1,
                };
                let top = heads.draft_top_k(h_last, root, model, want.max(keep))?;
                let guesses = top.iter().map(|r| r.iter().take(keep).map(|x| x.0).collect()).collect();
                let mut tree = match choice {
                    TreeChoice::Static(t) => t.clone(),
                    // An auto tree grows as a dynamic one; the loop cuts it afterwards.
                    TreeChoice::Dynamic(n) | TreeChoice::Auto(Budget { max_nodes: n, .. }) => {
                        dynamic_tree(&top.iter().map(|r| r[..want.min(r.len())].to_vec()).collect::<Vec<_>>(), *n)
                    }
                    TreeChoice::Chain => Tree::chain(heads.num_heads()),
                };
                if tree.len() > max_nodes {
                    tree = Tree::from_paths(&[]).expect("root-only tree");
                }
                let tokens = tree.nodes().iter().map(|n| if n.depth == 0 { root } else { top[n.depth - 1][n.rank].0 }).collect();
                let mut scores = vec![1.0f64; tree.len()];
                for (i, n) in tree.nodes().iter().enumerate().skip(1) {
                    scores[i] = scores[n.parent.expect("non-root")] * top[n.depth - 1][n.rank].1 as f64;
                }
                Ok(Proposal { tree, tokens, guesses, scores })
            }
            DraftState::Layer { layer, cache, root_feat } => {
                let grown = match choice {
                    TreeChoice::Static(t) => grow_static(layer, cache, root_feat, model, root, t, keep)?,
                    TreeChoice::Dynamic(n) => grow_dynamic(layer, cache, root_feat, model, root, *n, keep, 0.0)?,
                    TreeChoice::Auto(b) => grow_dynamic(layer, cache, root_feat, model, root, b.max_nodes, keep, min_expand)?,
                    TreeChoice::Chain => grow_static(layer, cache, root_feat, model, root, &Tree::chain(LAYER_MAX_DEPTH), keep)?,
                };
                if grown.tree.len() > max_nodes {
                    return Ok(Proposal { tree: Tree::from_paths(&[]).expect("root-only tree"), tokens: vec![root], guesses: grown.guesses, scores: vec![1.0] });
                }
                Ok(grown)
            }
        }
    }

    /// After verification: `hidden` holds the target's features for every tree node, the
    /// path `accepted` (tree indices from the root) was kept, and `emitted` are the tokens that
    /// followed each accepted node (the drafted ones and the correction/bonus token).
    pub fn commit(&mut self, model: &Llama, hidden: &Tensor, accepted: &[usize], emitted: &[u32]) -> Result<()> {
        match self {
            DraftState::Heads { h_last, .. } => {
                // A copy: `hidden` may be a whole batch's forward, which a view would keep alive.
                *h_last = hidden.narrow(0, *accepted.last().expect("the root is always accepted"), 1)?.copy()?;
                Ok(())
            }
            DraftState::Layer { layer, cache, root_feat } => {
                if emitted.len() != accepted.len() {
                    return Err(Error::InvalidArgument(format!("{} tokens emitted after {} accepted nodes", emitted.len(), accepted.len())));
                }
                layer.check_target_states(hidden)?;
                let idx: Vec<u32> = accepted.iter().map(|&a| a as u32).collect();
                let feats = hidden.index_select(&Tensor::new(idx.as_slice(), hidden.device())?, 0)?;
                let c = cache.len();
                let m = accepted.len();
                let out = layer.forward(&feats, emitted, &(c..c + m).collect::<Vec<_>>(), &TreeMask::causal(m), cache, model)?;
                *root_feat = out.narrow(0, m - 1, 1)?;
                Ok(())
            }
        }
    }
}

/// A node grown by the layer: where it hangs and what it holds.
struct Grown {
    parent: Option<usize>,
    depth: usize,
    rank: usize,
    token: u32,
    score: f64,
}

/// The draft tree's levels run so far, kept in the layer's cache after the committed pairs: the
/// node held by each cached slot, and each slot's parent slot (for the tree mask).
#[derive(Default)]
struct Levels {
    slot_of: HashMap<usize, usize>,
    parents: Vec<Option<usize>>,
}

/// Run the layer over one level's `frontier` (nodes whose parents ran at earlier levels, or hang
/// at the root) so that each gets its predicted feature. Their K/V stay in the cache after the
/// earlier levels', so the next level attends to them without running them again; the caller
/// truncates the cache back to the committed pairs when the tree is grown.
#[allow(clippy::too_many_arguments)]
fn run_level(layer: &DraftLayer, cache: &mut KvCache, root_feat: &Tensor, model: &Llama, nodes: &[Grown], feats: &mut HashMap<usize, Tensor>, levels: &mut Levels, frontier: &[usize]) -> Result<()> {
    let tail = levels.parents.len();
    let c = cache.len() - tail;
    let mut inputs = Vec::with_capacity(frontier.len());
    let mut parents = levels.parents.clone();
    for &i in frontier {
        let p = nodes[i].parent.expect("speculative nodes have parents");
        if p == 0 {
            inputs.push(root_feat.clone());
            parents.push(None);
        } else {
            let (Some(f), Some(&slot)) = (feats.get(&p), levels.slot_of.get(&p)) else {
                return Err(Error::InvalidArgument("draft tree: a parent was never run".into()));
            };
            inputs.push(f.clone());
            parents.push(Some(slot));
        }
    }
    let x = Tensor::cat(&inputs, 0)?;
    let tokens: Vec<u32> = frontier.iter().map(|&i| nodes[i].token).collect();
    let positions: Vec<usize> = frontier.iter().map(|&i| c + nodes[i].depth - 1).collect();
    let out = layer.forward_after(&x, &tokens, &positions, &TreeMask::from_parents(&parents)?, tail, cache, model)?;
    for (r, &i) in frontier.iter().enumerate() {
        feats.insert(i, out.narrow(0, r, 1)?);
        levels.slot_of.insert(i, tail + r);
    }
    levels.parents = parents;
    Ok(())
}

/// Grow a tree with `grow`, then drop its levels from the cache (also when growing fails), so
/// the cache again holds the committed pairs only.
fn growing(cache: &mut KvCache, grow: impl FnOnce(&mut KvCache) -> Result<Proposal>) -> Result<Proposal> {
    let c = cache.len();
    let out = grow(cache);
    cache.truncate(c);
    out
}

fn proposal_from(nodes: &[Grown], keep_idx: &[usize], guesses: Vec<Vec<u32>>) -> Result<Proposal> {
    let path_of = |mut i: usize| {
        let mut p = Vec::new();
        while i != 0 {
            p.push(nodes[i].rank);
            i = nodes[i].parent.unwrap_or(0);
        }
        p.reverse();
        p
    };
    let mut node_of: HashMap<Vec<usize>, usize> = HashMap::new();
    let paths: Vec<Vec<usize>> = keep_idx.iter().filter(|&&i| i != 0).map(|&i| {
        let p = path_of(i);
        node_of.insert(p.clone(), i);
        p
    }).collect();
    let tree = Tree::from_paths(&paths)?;
    let source = |n: &crate::draft::tree::Node| if n.depth == 0 { 0 } else { node_of[&n.path] };
    let tokens = tree.nodes().iter().map(|n| nodes[source(n)].token).collect();
    let scores = tree.nodes().iter().map(|n| nodes[source(n)].score).collect();
    Ok(Proposal { tree, tokens, guesses, scores })
}

fn grow_static(layer: &DraftLayer, cache: &mut KvCache, root_feat: &Tensor, model: &Llama, root: u32, t: &Tree, keep: usize) -> Result<Proposal> {
    growing(cache, |cache| grow_static_in(layer, cache, root_feat, model, root, t, keep))
}

fn grow_static_in(layer: &DraftLayer, cache: &mut KvCache, root_feat: &Tensor, model: &Llama, root: u32, t: &Tree, keep: usize) -> Result<Proposal> {
    let want = t.ranks_per_depth().into_iter().max().unwrap_or(1).max(keep);
    let first = layer.top_k(root_feat, want)?.remove(0);
    let guesses = vec![first.iter().take(keep).map(|x| x.0).collect()];
    // Grow in the tree's own (breadth-first) order, so node i of `nodes` is node i of `t`.
    let mut nodes = vec![Grown { parent: None, depth: 0, rank: 0, token: root, score: 1.0 }];
    let mut tops: HashMap<usize, Vec<(u32, f32)>> = HashMap::from([(0, first)]);
    let mut feats: HashMap<usize, Tensor> = HashMap::new();
    let mut levels = Levels::default();
    for d in 1..=t.depth() {
        let level: Vec<usize> = (0..t.len()).filter(|&i| t.node(i).depth == d).collect();
        for &i in &level {
            let n = t.node(i);
            let p = n.parent.expect("non-root");
            let (token, prob) = tops[&p][n.rank];
            nodes.push(Grown { parent: Some(p), depth: d, rank: n.rank, token, score: nodes[p].score * prob as f64 });
        }
        let expand: Vec<usize> = level.iter().copied().filter(|&i| !t.node(i).children.is_empty()).collect();
        if expand.is_empty() {
            continue;
        }
        if cache.len() + expand.len() > cache.max_len() {
            // Near the end of the context: no room for this level's K/V, so no draft at all.
            return Ok(Proposal { tree: Tree::from_paths(&[]).expect("root-only tree"), tokens: vec![root], guesses, scores: vec![1.0] });
        }
        run_level(layer, cache, root_feat, model, &nodes, &mut feats, &mut levels, &expand)?;
        let x = Tensor::cat(&expand.iter().map(|i| feats[i].clone()).collect::<Vec<_>>(), 0)?;
        for (i, top) in expand.iter().zip(layer.top_k(&x, want)?) {
            tops.insert(*i, top);
        }
    }
    let all: Vec<usize> = (0..nodes.len()).collect();
    proposal_from(&nodes, &all, guesses)
}

/// EAGLE-2's dynamic tree: level by level, expand the few most probable nodes (probability =
/// product of the layer's own probabilities along the path) by their top children, then keep the
/// `max_nodes` most probable nodes overall. A child never scores above its parent, so the kept
/// set is prefix-closed.
#[allow(clippy::too_many_arguments)]
fn grow_dynamic(layer: &DraftLayer, cache: &mut KvCache, root_feat: &Tensor, model: &Llama, root: u32, max_nodes: usize, keep: usize, min_expand: f64) -> Result<Proposal> {
    growing(cache, |cache| grow_dynamic_in(layer, cache, root_feat, model, root, max_nodes, keep, min_expand))
}

#[allow(clippy::too_many_arguments)]
fn grow_dynamic_in(layer: &DraftLayer, cache: &mut KvCache, root_feat: &Tensor, model: &Llama, root: u32, max_nodes: usize, keep: usize, min_expand: f64) -> Result<Proposal> {
    // Each level costs one small forward of the layer, so the beam and depth scale with the
    // node budget: a few wide levels for a small tree, deeper chains for a big one.
    const CHILDREN: usize = 4;
    let budget = max_nodes.saturating_sub(1);
    let beam = (budget / 3).clamp(1, 4);
    let max_depth = (budget / 2 + 1).clamp(2, LAYER_MAX_DEPTH);
    let first = layer.top_k(root_feat, CHILDREN.max(keep))?.remove(0);
    let guesses = vec![first.iter().take(keep).map(|x| x.0).collect()];
    let mut nodes = vec![Grown { parent: None, depth: 0, rank: 0, token: root, score: 1.0 }];
    let mut feats: HashMap<usize, Tensor> = HashMap::new();
    let mut levels = Levels::default();
    let mut frontier_tops: Vec<(usize, Vec<(u32, f32)>)> = vec![(0, first)];
    for d in 1..=max_depth {
        let start = nodes.len();
        for (p, top) in &frontier_tops {
            for (rank, &(token, prob)) in top.iter().take(CHILDREN).enumerate() {
                nodes.push(Grown { parent: Some(*p), depth: d, rank, token, score: nodes[*p].score * prob as f64 });
            }
        }
        if d == max_depth || budget == 0 {
            break;
        }
        // The budget-th best score so far: a node below it (and so its whole subtree) can
        // never be kept.
        let mut scores: Vec<f64> = nodes[1..].iter().map(|n| n.score).collect();
        scores.sort_by(|a, b| b.total_cmp(a));
        let floor = scores.get(budget - 1).copied().unwrap_or(0.0);
        let mut level: Vec<usize> =
            (start..nodes.len()).filter(|&i| (nodes[i].score > floor || scores.len() < budget) && nodes[i].score >= min_expand).collect();
        level.sort_by(|&a, &b| nodes[b].score.total_cmp(&nodes[a].score).then(a.cmp(&b)));
        level.truncate(beam);
        if level.is_empty() || cache.len() + level.len() > cache.max_len() {
            break;
        }
        run_level(layer, cache, root_feat, model, &nodes, &mut feats, &mut levels, &level)?;
        let x = Tensor::cat(&level.iter().map(|i| feats[i].clone()).collect::<Vec<_>>(), 0)?;
        frontier_tops = level.iter().copied().zip(layer.top_k(&x, CHILDREN)?).collect();
    }
    let mut order: Vec<usize> = (1..nodes.len()).collect();
    order.sort_by(|&a, &b| nodes[b].score.total_cmp(&nodes[a].score).then(a.cmp(&b)));
    order.truncate(budget);
    // Ties can put a child before its parent's cut-off twin; keep only prefix-closed nodes.
    let kept: std::collections::HashSet<usize> = order.iter().copied().collect();
    let mut keep_idx = vec![0];
    for &i in &order {
        let mut ok = true;
        let mut j = i;
        while let Some(p) = nodes[j].parent {
            if p != 0 && !kept.contains(&p) {
                ok = false;
                break;
            }
            j = p;
        }
        if ok {
            keep_idx.push(i);
        }
    }
    proposal_from(&nodes, &keep_idx, guesses)
}

/// Levels measured by [`Drafter::rank_hits`] for a draft layer.
pub const LAYER_TUNE_DEPTH: usize = 5;

impl Drafter {
    /// Rank hits along a known continuation: for each position `t >= from` of `seq` (features
    /// `hidden [len, d]` from the target's causal forward), where the level-1 guess (and, for a
    /// layer, each deeper guess made from the true tokens above it) put the true token.
    /// Returns (`hits[level][rank]`, `trials[level]`).
    pub fn rank_hits(&self, model: &Llama, hidden: &Tensor, seq: &[u32], from: usize, ranks: usize) -> Result<(Vec<Vec<usize>>, Vec<usize>)> {
        let levels = match self {
            Drafter::Heads(h) => h.num_heads(),
            Drafter::Layer(_) => LAYER_TUNE_DEPTH,
        };
        let mut hits = vec![vec![0usize; ranks]; levels];
        let mut counts = vec![0usize; levels];
        let mut record = |k: usize, top: &[(u32, f32)], truth: u32| {
            counts[k] += 1;
            if let Some(r) = top.iter().position(|x| x.0 == truth) {
                hits[k][r] += 1;
            }
        };
        match self {
            Drafter::Heads(heads) => {
                // Position t feeds the heads; the root is seq[t+1]; head k guesses seq[t+k+2].
                for t in from..seq.len().saturating_sub(2) {
                    let top = heads.draft_top_k(&hidden.narrow(0, t, 1)?, seq[t + 1], model, ranks)?;
                    for (k, row) in top.iter().enumerate() {
                        if let Some(&truth) = seq.get(t + k + 2) {
                            record(k, row, truth);
                        }
                    }
                }
            }
            Drafter::Layer(layer) => {
                layer.check_target_states(hidden)?;
                let mut cache = layer.new_cache()?;
                if from > 0 {
                    let n = from;
                    layer.forward(&hidden.narrow(0, 0, n)?, &seq[1..n + 1], &(0..n).collect::<Vec<_>>(), &TreeMask::causal(n), &mut cache, model)?;
                }
                for t in from..seq.len().saturating_sub(2) {
                    // Commit the real pair t, then chain along the true tokens.
                    let mut f = layer.forward(&hidden.narrow(0, t, 1)?, &[seq[t + 1]], &[t], &TreeMask::causal(1), &mut cache, model)?;
                    for k in 0..levels {
                        let Some(&truth) = seq.get(t + k + 2) else { break };
                        let top = layer.top_k(&f, ranks)?.remove(0);
                        record(k, &top, truth);
                        if k + 1 < levels && t + k + 3 < seq.len() {
                            let c = cache.len();
                            f = layer.forward(&f, &[truth], &[c], &TreeMask::causal(1), &mut cache, model)?;
                        }
                    }
                    cache.truncate(t + 1);
                }
            }
        }
        Ok((hits, counts))
    }

    /// Drafting cost in ms as (per step, per extra level below the first), medians of a few
    /// runs on a short made-up context.
    pub fn draft_cost_ms(&self, model: &Llama) -> Result<(f64, f64)> {
        // As wide as the target's forward rows (an EAGLE-3 layer's tapped layers included).
        let d = model.config().hidden_size * (1 + model.feature_layers().len());
        let n = 32;
        let hidden = Tensor::zeros((n, d), candle_core::DType::F32, model.device())?;
        let prompt: Vec<u32> = (0..n as u32).collect();
        let mut state = self.start(model, &hidden, &prompt, 0)?;
        let time = |choice: &TreeChoice, state: &mut DraftState| -> Result<f64> {
            let mut v = Vec::new();
            for _ in 0..7 {
                let t = std::time::Instant::now();
                let p = state.propose(model, 0, choice, 1, usize::MAX, 0.0)?;
                let accepted: Vec<usize> = vec![0];
                state.commit(model, &hidden.narrow(0, 0, p.tree.len())?, &accepted, &[1])?;
                v.push(t.elapsed().as_secs_f64() * 1e3);
            }
            v.sort_by(|a, b| a.total_cmp(b));
            Ok(v[v.len() / 2])
        };
        let one = time(&TreeChoice::Static(Tree::chain(1)), &mut state)?;
        if let Drafter::Heads(_) = self {
            return Ok((one, 0.0));
        }
        let three = time(&TreeChoice::Static(Tree::chain(3)), &mut state)?;
        Ok((one, ((three - one) / 2.0).max(0.0)))
    }
}
