//! `tune`: pick the static tree that maximises expected speed-up on this device, from the
//! drafter's measured accuracy per rank and level and this model's measured forward costs; then
//! check it (with and without a copied branch, and against the default tree) in one eval run.
use std::path::Path;

use serde::Serialize;

use crate::data::PromptItem;
use crate::decode::generate::{generate_plain, Flow, StopRule};
use crate::decode::sampling::{rng, SamplingParams};
use crate::draft::choice::TreeChoice;
use crate::draft::datastore::Datastore;
use crate::draft::drafter::Drafter;
use crate::draft::lookup::Lookup;
use crate::draft::tree::Tree;
use crate::eval::run::{evaluate, EvalOptions, Summary};
use crate::files::write_atomic;
use crate::model::loader::Target;
use crate::model::timing::bench_forward;
use crate::spec::plan::{Plan, DEFAULT_TREE};
use crate::{Error, Result};

/// What `tune` is asked to do.
pub struct TuneOptions<'a> {
    /// Largest tree considered.
    pub max_nodes: usize,
    /// Tokens generated per prompt to measure the drafter's accuracy.
    pub max_tokens: usize,
    /// Prompts used afterwards to measure the chosen tree against plain decoding.
    pub check_prompts: usize,
    pub datastore: Option<&'a Datastore>,
    /// Progress lines (stderr in the CLI).
    pub log: &'a mut dyn FnMut(String),
}

/// What `tune` measured and chose; the tree file it wrote holds the same.
#[derive(Debug, Clone, Serialize)]
pub struct TuneOutcome {
    /// `rank_accuracy[k][r]`: how often the rank-r guess at level k+1 was the target's token.
    pub rank_accuracy: Vec<Vec<f64>>,
    /// Expected τ and speed-up per tree size.
    pub points: Vec<TunePoint>,
    /// Nodes in the chosen tree.
    pub chosen_nodes: usize,
    /// Measured in one eval run: the tuned tree without and with copied branches, then the
    /// default tree.
    pub measured: Vec<(String, Summary)>,
    /// The copied branch kept in the tree file (`+lookup:N`), when one measured fastest.
    pub lookup: Option<usize>,
    /// The default tree measured faster than every tuned variant.
    pub default_faster: bool,
}

/// The copied branches the tuned tree is checked with, besides none: short and long ones (extra
/// nodes cost more with fast weights).
const CHECK_LOOKUPS: [Option<usize>; 3] = [None, Some(3), Some(6)];

/// Check [`TuneOptions`]' sizes (`--max-nodes`, `--max-tokens`, `--check-prompts`) without a
/// model, so a command line can refuse them before loading one.
pub fn check_sizes(max_nodes: usize, max_tokens: usize, check_prompts: usize) -> Result<()> {
    // The tuned tree is also checked with copied branches (CHECK_LOOKUPS): tree and branch
    // together must fit one step's MAX_TREE_NODES.
    let longest = CHECK_LOOKUPS.iter().flatten().max().copied().unwrap_or(0);
    let most = crate::draft::tree::MAX_TREE_NODES - longest;
    if !(2..=most).contains(&max_nodes) {
        return Err(Error::InvalidArgument(format!("--max-nodes must be from 2 to {most} (with a {longest}-token copied branch, one step verifies at most {} nodes)", crate::draft::tree::MAX_TREE_NODES)));
    }
    if max_tokens == 0 {
        return Err(Error::InvalidArgument("--max-tokens must be at least 1".into()));
    }
    if check_prompts == 0 {
        return Err(Error::InvalidArgument("--check-prompts must be at least 1 (the chosen tree is measured on them)".into()));
    }
    Ok(())
}

/// Measure, choose, write the tree file at `out` (atomically) and check it.
pub fn tune(target: &Target, drafter: &Drafter, items: &[PromptItem], out: &Path, opts: &mut TuneOptions) -> Result<TuneOutcome> {
    check_sizes(opts.max_nodes, opts.max_tokens, opts.check_prompts)?;
    (opts.log)(format!("measuring {} accuracy on {} prompts...", drafter.kind(), items.len()));
    let acc = rank_accuracy(target, drafter, items, opts.max_tokens, 8)?;
    for (k, row) in acc.iter().enumerate() {
        let r: Vec<String> = row.iter().map(|x| format!("{x:.3}")).collect();
        (opts.log)(format!("  level {} rank accuracy: {}", k + 1, r.join(" ")));
    }
    (opts.log)(format!("measuring forward cost for 1..{} tokens...", opts.max_nodes));
    let counts: Vec<usize> = (1..=opts.max_nodes).collect();
    let cost_ms: Vec<f64> = bench_forward(&target.model, 256, &counts, 3)?.iter().map(|r| r.median_ms).collect();
    let draft_ms = drafter.draft_cost_ms(&target.model)?;
    let (best, points) = choose_tree(&acc, &cost_ms, draft_ms, opts.max_nodes);
    let paths: serde_json::Value = serde_json::from_str::<serde_json::Value>(&best.to_json()).map_err(|e| Error::InvalidTree(e.to_string()))?["paths"].clone();
    let mut doc = serde_json::json!({
        "paths": paths,
        "expected": points.iter().find(|p| p.nodes == best.len()),
        "rank_accuracy": acc,
        "forward_ms": cost_ms,
        "draft_ms": {"per_step": draft_ms.0, "per_extra_level": draft_ms.1},
        "lookup": null,
        "note": "tau = tokens per target forward, bonus token counted",
    });
    let write = |doc: &serde_json::Value| write_atomic(out, serde_json::to_string_pretty(doc).expect("a JSON value serialises").as_bytes());
    write(&doc)?;
    // The context lookup's worth depends on how often the text repeats itself and on what
    // extra nodes cost here, so it is measured, with and without, in the same run.
    let check: Vec<_> = items.iter().take(opts.check_prompts).cloned().collect();
    (opts.log)(format!("wrote {} ({} nodes); checking it with and without +lookup on {} prompts...", out.display(), best.len(), check.len()));
    let mut plans: Vec<(String, Plan)> = CHECK_LOOKUPS
        .iter()
        .map(|n| {
            let lookup = n.map(|max_tokens| Lookup { max_tokens, ..Default::default() });
            let name = n.map_or("tuned".to_string(), |n| format!("tuned+lookup:{n}"));
            (name, Plan { tree: TreeChoice::Static(best.clone()), lookup })
        })
        .collect();
    // The default tree, cut per step by this device's costs: a static tree is worth keeping
    // only if it beats it.
    plans.push((DEFAULT_TREE.to_string(), Plan::parse(DEFAULT_TREE)?));
    let mut eval_opts = EvalOptions { trees: plans, params: SamplingParams::greedy(), max_tokens: opts.max_tokens, seed: 1, datastore: opts.datastore, progress: &mut |_, _| {} };
    let report = evaluate(target, drafter, &check, &mut eval_opts)?;
    let fastest = (0..CHECK_LOOKUPS.len()).max_by(|&a, &b| report.overall[a].speedup.total_cmp(&report.overall[b].speedup)).unwrap_or(0);
    let default_faster = report.overall.get(CHECK_LOOKUPS.len()).is_some_and(|auto| auto.speedup > report.overall[fastest].speedup);
    if let Some(n) = CHECK_LOOKUPS[fastest] {
        doc["lookup"] = serde_json::json!(n);
        write(&doc)?;
    }
    Ok(TuneOutcome {
        rank_accuracy: acc,
        points,
        chosen_nodes: best.len(),
        measured: report.trees.iter().cloned().zip(report.overall.iter().cloned()).collect(),
        lookup: CHECK_LOOKUPS[fastest],
        default_faster,
    })
}

/// `acc[k][r]`: how often the rank-r guess at level k+1 below the root equals the target's own
/// greedy token there (for a draft layer: given the true tokens above it), measured on the
/// target's greedy continuations of `prompts`.
pub fn rank_accuracy(target: &Target, drafter: &Drafter, prompts: &[PromptItem], max_tokens: usize, ranks: usize) -> Result<Vec<Vec<f64>>> {
    let mut hits: Vec<Vec<usize>> = Vec::new();
    let mut counts: Vec<usize> = Vec::new();
    let eos = target.tokenizer.eos_ids.clone();
    for item in prompts {
        let ids = target.prompt_ids(&[crate::model::tokenizer::Message::new("user", item.turns[0].clone())])?;
        let stop = StopRule { max_new_tokens: max_tokens, eos_ids: &eos };
        let (out, _) = generate_plain(&target.model, &ids, &SamplingParams::greedy(), &stop, &mut rng(0), &mut |_| Ok(Flow::Continue))?;
        let mut seq = ids.clone();
        seq.extend(&out);
        let mut cache = target.model.new_cache()?;
        let hidden = target.model.forward_causal(&seq, &mut cache)?;
        let (h, c) = drafter.rank_hits(&target.model, &hidden, &seq, ids.len() - 1, ranks)?;
        if hits.is_empty() {
            (hits, counts) = (h, c);
        } else {
            for (k, row) in h.iter().enumerate() {
                counts[k] += c[k];
                for (r, x) in row.iter().enumerate() {
                    hits[k][r] += x;
                }
            }
        }
    }
    Ok(hits.iter().zip(&counts).map(|(h, &c)| h.iter().map(|&x| x as f64 / c.max(1) as f64).collect()).collect())
}

/// Medusa's best-first growth: repeatedly add the frontier node with the highest product of
/// rank accuracies along its path. Returns the paths in order of addition and the expected τ
/// after each addition (τ = 1 + sum of path values).
pub fn grow_tree(acc: &[Vec<f64>], max_nodes: usize) -> (Vec<Vec<usize>>, Vec<f64>) {
    let value = |p: &[usize]| p.iter().enumerate().map(|(d, &r)| acc[d].get(r).copied().unwrap_or(0.0)).product::<f64>();
    let mut chosen: Vec<Vec<usize>> = Vec::new();
    let mut taus = Vec::new();
    let mut frontier: Vec<Vec<usize>> = vec![vec![0]];
    let mut tau = 1.0;
    while chosen.len() + 1 < max_nodes && !frontier.is_empty() {
        let (bi, _) = frontier.iter().enumerate().map(|(i, p)| (i, value(p))).max_by(|a, b| a.1.total_cmp(&b.1)).unwrap();
        let p = frontier.swap_remove(bi);
        tau += value(&p);
        let mut sib = p.clone();
        *sib.last_mut().unwrap() += 1;
        if *sib.last().unwrap() < acc[p.len() - 1].len() {
            frontier.push(sib);
        }
        if p.len() < acc.len() {
            let mut child = p.clone();
            child.push(0);
            frontier.push(child);
        }
        chosen.push(p);
        taus.push(tau);
    }
    (chosen, taus)
}

#[derive(Debug, Clone, Serialize)]
pub struct TunePoint {
    pub nodes: usize,
    pub expected_tau: f64,
    pub cost_ratio: f64,
    pub expected_speedup: f64,
}

/// Pick the tree size maximising expected τ / relative cost: a forward of `nodes` tokens plus
/// drafting (`draft_ms.0` per step and `draft_ms.1` per level below the first), over a
/// one-token forward.
pub fn choose_tree(acc: &[Vec<f64>], cost_ms: &[f64], draft_ms: (f64, f64), max_nodes: usize) -> (Tree, Vec<TunePoint>) {
    let (paths, taus) = grow_tree(acc, max_nodes);
    let mut points = vec![TunePoint { nodes: 1, expected_tau: 1.0, cost_ratio: 1.0, expected_speedup: 1.0 }];
    for (i, tau) in taus.iter().enumerate() {
        let n = i + 2;
        let depth = paths[..=i].iter().map(|p| p.len()).max().unwrap_or(1);
        let c = cost_ms.get(n - 1).copied().unwrap_or(*cost_ms.last().unwrap());
        let ratio = (c + draft_ms.0 + draft_ms.1 * (depth - 1) as f64) / cost_ms[0];
        points.push(TunePoint { nodes: n, expected_tau: *tau, cost_ratio: ratio, expected_speedup: tau / ratio });
    }
    let best = points.iter().skip(1).max_by(|a, b| a.expected_speedup.total_cmp(&b.expected_speedup)).map(|p| p.nodes).unwrap_or(2);
    let tree = Tree::from_paths(&paths[..best - 1]).expect("grown trees are prefix-closed");
    (tree, points)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_first_growth_and_choice() {
        let acc = vec![vec![0.6, 0.2, 0.1], vec![0.5, 0.2], vec![0.4]];
        let (paths, taus) = grow_tree(&acc, 6);
        assert_eq!(paths[0], vec![0]);
        assert_eq!(paths[1], vec![0, 0]);
        assert!((taus[0] - 1.6).abs() < 1e-12 && (taus[1] - 1.9).abs() < 1e-12);
        assert!(Tree::from_paths(&paths).is_ok());
        // Flat cost: the biggest tree wins; steep cost: a small one.
        let (big, _) = choose_tree(&acc, &[10.0; 8], (0.0, 0.0), 6);
        assert_eq!(big.len(), 6);
        let steep: Vec<f64> = (1..=8).map(|n| 10.0 * n as f64).collect();
        let (small, pts) = choose_tree(&acc, &steep, (0.0, 0.0), 6);
        assert!(small.len() <= 3, "{pts:?}");
    }
}
