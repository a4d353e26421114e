//! Self-speculative decoding: heads draft a tree from the last accepted hidden state, one target
//! forward checks the whole tree, [`crate::spec::verify`] decides what is emitted, and the KV cache is
//! compacted to the accepted path.
use std::time::Instant;

use crate::draft::budget::{Budget, Calibration, CostCurve, Draft, LiveCosts, AFFORDABLE_COST, AUTO_NODES};

use crate::decode::generate::{check_budget, prefill, GenStats, StopRule};
use crate::draft::datastore::Datastore;
use crate::draft::lookup::Lookup;
use crate::draft::drafter::Drafter;
use crate::cpu::reduce::row_to_vec;
use crate::model::Llama;
use crate::decode::sampling::{Rng64, SamplingParams};
use crate::draft::choice::TreeChoice;
use crate::spec::verify::{verify, Rule};
use crate::Result;

/// For `auto` trees: the path probability below which a node is not expanded. Expanding one
/// costs a verification row (the curve's first step, relative to a plain step) and, when it
/// opens a new level, a forward of the draft layer; a level is worth its time when the tokens it
/// may add, relative to the step's τ, exceed its time relative to the step's. Measured on this
/// Xeon with bf16 weights, `auto+lookup:6` went from 1.68× to 1.79–1.81× with a floor 0.05–0.1
/// higher than the first term alone, τ 2.50 → 2.47–2.49 (a level there is ~0.27 ms of a 9 ms
/// step); with f32 weights a level is a smaller share of a 16 ms step.
fn expansion_floor(costs: &CostCurve, stats: &SpecStats, levels: usize, emitted: usize) -> f64 {
    let steps = stats.gen.target_forwards;
    if steps == 0 || levels == 0 {
        return costs.first_step();
    }
    let step_ms = (stats.time.draft + stats.time.forward) * 1e3 / steps as f64;
    let level_ms = stats.time.draft * 1e3 / levels as f64;
    let tau = emitted.saturating_sub(1) as f64 / steps as f64;
    costs.first_step() + tau * level_ms / step_ms
}

/// Ranks kept for per-head top-5 accuracy.
const ACC_K: usize = 5;

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SpecStats {
    pub gen: GenStats,
    /// `accept_hist[m]` = steps that accepted m drafted tokens (plus one correction/bonus token).
    pub accept_hist: Vec<usize>,
    /// For a static tree: per node, (times its parent was accepted, times it was accepted).
    pub node_tries_hits: Vec<(usize, usize)>,
    /// Per head: (positions checked, top-1 hits, top-5 hits) against the target's own tokens.
    pub head_acc: Vec<(usize, usize, usize)>,
    pub tree_nodes_total: usize,
    /// Per emitted token: true when it was a drafted token the target accepted, false for the
    /// target's own (first, correction or bonus) tokens. For showing what speculation did.
    pub drafted: Vec<bool>,
    /// Where decode time went, in seconds: drafting the trees, the target's tree forwards
    /// (with logits), verification, and updating the KV cache and the drafter's state.
    pub time: StepTimes,
    /// Nodes the context lookup added to the drafter's trees, and how many of them were accepted.
    pub lookup_nodes: usize,
    pub lookup_accepted: usize,
}

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct StepTimes {
    pub draft: f64,
    pub forward: f64,
    pub verify: f64,
    pub commit: f64,
}

impl SpecStats {
    /// Tokens per target forward, the bonus token counted (plain decoding = 1.0).
    pub fn tau(&self) -> f64 {
        self.gen.tau()
    }
}

pub struct SpecOptions<'a> {
    pub tree: TreeChoice,
    /// Graft a continuation copied from the context onto every tree.
    pub lookup: Option<Lookup>,
    /// A second source for the copied branch: the target's own earlier answers. Used only with
    /// `lookup`, whose token count it shares.
    pub datastore: Option<&'a Datastore>,
    pub rule: Rule,
    pub params: SamplingParams,
    pub stop: StopRule<'a>,
}

/// Generate with self-speculation. `on_token` sees each emitted token as soon as it is accepted.
pub fn generate_spec(
    model: &Llama,
    drafter: &Drafter,
    prompt: &[u32],
    opts: &SpecOptions,
    rng: &mut Rng64,
    on_token: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<(Vec<u32>, SpecStats)> {
    opts.params.validate()?;
    drafter.validate_tree(&opts.tree)?;
    let choice = drafter.resolve(&opts.tree);
    let (mut live, refit) = match choice.clone().with_costs(model, opts.lookup.map_or(0, |l| l.max_tokens))? {
        TreeChoice::Auto(b) => (b.costs.as_deref().map(LiveCosts::new), b.fit_to_device),
        _ => (None, false),
    };
    let mut calib = Calibration::default();
    // Draft-layer levels run so far (a drafted tree of depth d took d - 1), to price one more.
    let mut levels = 0usize;
    let max_pos = model.config().max_position;
    let budget = check_budget(prompt.len(), opts.stop.max_new_tokens, max_pos)?;
    let t0 = Instant::now();
    let (mut cache, logits, prompt_hidden) = prefill(model, prompt)?;
    let prefill_secs = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut history = prompt.to_vec();
    let mut out: Vec<u32> = Vec::new();
    let mut stats = SpecStats::default();
    if let TreeChoice::Static(t) = &choice {
        stats.node_tries_hits = vec![(0, 0); t.len()];
    }
    // (index in `out` of the root, per level top-5 draft ids) for accuracy after the fact.
    let mut drafts: Vec<(usize, Vec<Vec<u32>>)> = Vec::new();

    let first = opts.params.choose(&logits, &history, rng);
    let mut done = emit(first, &mut out, &mut history, opts, budget, on_token)?;
    stats.drafted.push(false);
    let mut state = if done { None } else { Some(drafter.start(model, &prompt_hidden, prompt, first)?) };
    while !done && cache.len() + 1 < max_pos {
        let Some(state) = state.as_mut() else { break };
        let committed = cache.len();
        let root = *out.last().unwrap();
        let t_step = Instant::now();
        let costs = live.as_ref().map(LiveCosts::curve);
        let min_expand = costs.as_ref().map_or(0.0, |c| expansion_floor(c, &stats, levels, out.len()) / calib.drafter_factor());
        let refitted;
        let choice = match &costs {
            Some(c) if refit => {
                refitted = TreeChoice::Auto(Budget { max_nodes: c.affordable(AFFORDABLE_COST).clamp(2, AUTO_NODES), costs: None, fit_to_device: true });
                &refitted
            }
            _ => &choice,
        };
        let proposal = state.propose(model, root, choice, ACC_K, max_pos - committed, min_expand)?;
        levels += proposal.tree.depth().saturating_sub(1);
        drafts.push((out.len() - 1, proposal.guesses));
        let (mut tree, mut tokens) = (proposal.tree, proposal.tokens);
        // The lookup grafts its nodes after the drafter's; `branch` is the copied path.
        let drafted_nodes = tree.len();
        let (branch, stored) = match &opts.lookup {
            Some(l) => {
                let (copied, stored) = l.copy(&history, opts.datastore);
                (Lookup::graft(&mut tree, &mut tokens, &copied, max_pos - committed), stored)
            }
            None => (Vec::new(), false),
        };
        let mut draft = Draft { tree, tokens, scores: proposal.scores, drafted_nodes, branch, stored };
        if let Some(costs) = &costs {
            let drafting_ms = stats.time.draft * 1e3 / stats.gen.target_forwards.max(1) as f64;
            draft = calib.cut(draft, costs, drafting_ms)?;
        }
        let (tree, tokens, drafted_nodes) = (&draft.tree, &draft.tokens, draft.drafted_nodes);
        stats.lookup_nodes += tree.len() - drafted_nodes;
        let t_fwd = Instant::now();
        let hidden = model.forward(tokens, &tree.positions(committed), &tree.mask(), &mut cache)?;
        let all_logits = model.logits(&hidden)?;
        let t_verify = Instant::now();
        if let Some(live) = live.as_mut() {
            live.observe(tree.len(), (t_verify - t_fwd).as_secs_f64() * 1e3);
        }
        let verdict = verify(tree, tokens, &history, &opts.params, opts.rule, rng, &mut |i| row_to_vec(&all_logits, i))?;
        let t_commit = Instant::now();
        let slots: Vec<usize> = verdict.accepted.iter().map(|&a| committed + a).collect();
        cache.compact(committed, &slots)?;
        stats.gen.target_forwards += 1;
        stats.tree_nodes_total += tree.len();
        let m = verdict.accepted.len() - 1;
        if stats.accept_hist.len() <= m {
            stats.accept_hist.resize(m + 1, 0);
        }
        stats.accept_hist[m] += 1;
        stats.lookup_accepted += verdict.accepted.iter().filter(|&&a| a >= drafted_nodes).count();
        if costs.is_some() {
            calib.learn(&draft, &verdict.accepted);
        }
        if let TreeChoice::Static(_) = &choice {
            for (i, n) in tree.nodes().iter().enumerate().take(drafted_nodes).skip(1) {
                if verdict.accepted.contains(&n.parent.unwrap()) {
                    stats.node_tries_hits[i].0 += 1;
                    if verdict.accepted.contains(&i) {
                        stats.node_tries_hits[i].1 += 1;
                    }
                }
            }
        }
        for (i, &tok) in verdict.emitted.iter().enumerate() {
            stats.drafted.push(i + 1 < verdict.emitted.len());
            done = emit(tok, &mut out, &mut history, opts, budget, on_token)?;
            if done {
                break;
            }
        }
        if !done {
            state.commit(model, &hidden, &verdict.accepted, &verdict.emitted)?;
        }
        let t_end = Instant::now();
        stats.time.draft += (t_fwd - t_step).as_secs_f64();
        stats.time.forward += (t_verify - t_fwd).as_secs_f64();
        stats.time.verify += (t_commit - t_verify).as_secs_f64();
        stats.time.commit += (t_end - t_commit).as_secs_f64();
    }
    // Drafting accuracy against what the target actually emitted.
    let levels = drafts.iter().map(|d| d.1.len()).max().unwrap_or(0);
    stats.head_acc = vec![(0, 0, 0); levels];
    for (root_idx, per_level) in &drafts {
        for (k, cands) in per_level.iter().enumerate() {
            if let Some(&truth) = out.get(root_idx + 1 + k) {
                let a = &mut stats.head_acc[k];
                a.0 += 1;
                a.1 += (cands.first() == Some(&truth)) as usize;
                a.2 += cands.contains(&truth) as usize;
            }
        }
    }
    stats.gen.prompt_tokens = prompt.len();
    stats.gen.new_tokens = out.len();
    stats.gen.prefill_secs = prefill_secs;
    stats.gen.decode_secs = t1.elapsed().as_secs_f64();
    Ok((out, stats))
}

fn emit(
    tok: u32,
    out: &mut Vec<u32>,
    history: &mut Vec<u32>,
    opts: &SpecOptions,
    budget: usize,
    on_token: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<bool> {
    out.push(tok);
    history.push(tok);
    on_token(tok)?;
    Ok(opts.stop.eos_ids.contains(&tok) || out.len() >= budget)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expansion_floor_prices_a_draft_level_once_the_loop_has_timings() {
        let costs = CostCurve::from_points(&[(1, 10.0), (2, 10.5), (16, 14.0)], 16).unwrap();
        let mut stats = SpecStats::default();
        assert_eq!(expansion_floor(&costs, &stats, 0, 1), costs.first_step(), "no steps yet: the verification row only");
        // 10 steps of 12 ms (2 of them drafting, 20 levels in all), 25 tokens after the first:
        // a level is 1 ms of a 12 ms step that yields 2.5 tokens.
        stats.gen.target_forwards = 10;
        stats.time.draft = 0.02;
        stats.time.forward = 0.10;
        let floor = expansion_floor(&costs, &stats, 20, 26);
        assert!((floor - (0.05 + 2.5 * 1.0 / 12.0)).abs() < 1e-9, "{floor}");
    }
}
