//! Cost-aware trees (`--tree auto[:N]`): per step, keep the draft nodes that maximise expected
//! tokens per millisecond on this device.
//!
//! A node is worth verifying when the tokens it is expected to add outweigh what it adds to the
//! forward's cost. Both halves are measured: the forward's cost for T nodes comes from timing
//! this model on this machine ([`CostCurve::measure`], as `bench` does), and each node's chance
//! of acceptance is the drafter's path probability, corrected during the run by how often such
//! nodes were actually accepted ([`Calibration`]). So a confident step verifies a deep chain, an
//! unsure one verifies little more than the root, and a device whose cost curve is flat (a GPU)
//! gets big trees while this 2-core CPU, where each extra row costs, gets small ones. The choice
//! depends only on the drafts and the emitted text, never on the target's verdict for this step,
//! so both acceptance rules stay exact.
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use crate::model::Llama;
use crate::draft::tree::Tree;
use crate::Result;

static COST_CACHE: OnceLock<Option<PathBuf>> = OnceLock::new();

/// Keep measured cost curves in `dir` between runs (the CLI passes
/// [`crate::files::cache_dir`]); until this is called, nothing is cached. The first call wins.
pub fn cache_costs_in(dir: Option<PathBuf>) {
    let _ = COST_CACHE.set(dir);
}

/// What a forward's cost depends on: the model's shapes and the bytes its weights stream (not
/// their values), the weight and KV formats, the CPU and its kernel path, the thread count, the
/// device, and this program's version and build (kernels change between builds).
fn cost_key(model: &Llama, max_tokens: usize) -> String {
    let cfg = serde_json::to_string(model.config()).unwrap_or_default();
    let what = format!(
        "{cfg}|{}|{:?}|{}|{}|{}|{:?}|{max_tokens}|{}|{}",
        model.weight_format(),
        model.kv_dtype(),
        model.weight_bytes_per_forward(),
        crate::cpu::isa::cpu_identity(),
        crate::cpu::team::threads(),
        model.device().location(),
        env!("CARGO_PKG_VERSION"),
        crate::files::build_identity(),
    );
    crate::files::cache_key(&[what.as_bytes()])
}

/// Median forward time in ms (with logits for every row) for T = 1..=len new tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct CostCurve {
    ms: Vec<f64>,
}

impl CostCurve {
    /// From measured points `(tokens, ms)`, interpolated linearly in between (and held flat per
    /// token past the last point). Costs never fall as T grows.
    pub fn from_points(points: &[(usize, f64)], max_tokens: usize) -> Result<Self> {
        let mut pts: Vec<(usize, f64)> = points.iter().copied().filter(|p| p.0 >= 1 && p.1.is_finite() && p.1 > 0.0).collect();
        pts.sort_by_key(|p| p.0);
        if pts.first().map(|p| p.0) != Some(1) {
            return Err(crate::Error::InvalidArgument("a cost curve needs a positive time for T = 1".into()));
        }
        let mut ms = Vec::with_capacity(max_tokens);
        for t in 1..=max_tokens.max(1) {
            let v = match pts.iter().position(|p| p.0 >= t) {
                Some(j) if pts[j].0 == t => pts[j].1,
                Some(j) => {
                    let (a, b) = (pts[j - 1], pts[j]);
                    a.1 + (b.1 - a.1) * (t - a.0) as f64 / (b.0 - a.0) as f64
                }
                None => {
                    let last = *pts.last().unwrap();
                    last.1 * t as f64 / last.0 as f64
                }
            };
            ms.push(v);
        }
        for i in 1..ms.len() {
            ms[i] = ms[i].max(ms[i - 1]);
        }
        Ok(CostCurve { ms })
    }

    /// Time this model's forward for the token counts a tree of up to `max_tokens` nodes uses,
    /// or take the points measured by an earlier run from the cache ([`cache_costs_in`]).
    /// Why cache: timing takes about 0.9 s (SmolLM2 native, 2-core Xeon), four times what
    /// loading the model and decoding a first token take.
    pub fn measure(model: &Llama, max_tokens: usize) -> Result<Self> {
        Self::measure_cached(model, max_tokens, COST_CACHE.get().and_then(|d| d.as_deref()))
    }

    /// [`CostCurve::measure`] with the cache in `dir` (none: always measure).
    pub fn measure_cached(model: &Llama, max_tokens: usize, dir: Option<&std::path::Path>) -> Result<Self> {
        let key = cost_key(model, max_tokens);
        if let Some(bytes) = dir.and_then(|d| crate::files::cache_read(d, "costs", &key, 1 << 16)) {
            if let Ok(c) = serde_json::from_slice::<Vec<(usize, f64)>>(&bytes).map_err(|e| e.to_string()).and_then(|p| Self::from_points(&p, max_tokens).map_err(|e| e.to_string())) {
                return Ok(c);
            }
        }
        let counts: Vec<usize> = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64].into_iter().filter(|&t| t <= max_tokens.max(1)).collect();
        // Nine rounds: bare `auto` sizes its trees from this curve, so one slow round must not move it.
        let rows = crate::model::timing::bench_forward(model, 128, &counts, 9)?;
        let points: Vec<(usize, f64)> = rows.iter().map(|r| (r.tokens, r.median_ms)).collect();
        let curve = Self::from_points(&points, max_tokens)?;
        if let (Some(d), Ok(json)) = (dir, serde_json::to_vec(&points)) {
            crate::files::cache_write(d, "costs", &key, &json);
        }
        Ok(curve)
    }

    /// Cost of a forward over `t` tokens (t >= 1).
    pub fn at(&self, t: usize) -> f64 {
        let i = t.clamp(1, self.ms.len()) - 1;
        self.ms[i] * (t.max(1) as f64 / (i + 1) as f64).max(1.0)
    }

    pub fn max_tokens(&self) -> usize {
        self.ms.len()
    }

    /// The most tokens a forward may hold while costing at most `ratio` times one token.
    pub fn affordable(&self, ratio: f64) -> usize {
        (1..=self.ms.len()).take_while(|&t| self.at(t) <= ratio * self.at(1)).last().unwrap_or(1)
    }

    /// The relative price of the first node past the root, `(cost(2) - cost(1)) / cost(1)`. Most
    /// steps verify few nodes, so a node expected to add fewer tokens than this is not worth
    /// growing: drafting below it costs time that the cut would then throw away.
    pub fn first_step(&self) -> f64 {
        ((self.at(2) - self.at(1)) / self.at(1)).max(0.0)
    }
}

/// `auto[:N]`: grow up to `max_nodes` nodes as `dynamic:N` does, then cut per step by cost.
#[derive(Debug, Clone)]
pub struct Budget {
    pub max_nodes: usize,
    /// Measured on first use when absent; `eval` measures once and shares it.
    pub costs: Option<Arc<CostCurve>>,
    /// Bare `auto`: once the costs are measured, lower `max_nodes` to what this device affords
    /// ([`CostCurve::affordable`] at [`AFFORDABLE_COST`]), and refit it per step to the costs
    /// the run observes ([`LiveCosts`]), up to [`AUTO_NODES`]; `auto:N` keeps N.
    pub fit_to_device: bool,
}

/// The most nodes bare `auto` grows, on a device whose cost curve is flat.
pub const AUTO_NODES: usize = 16;

/// The forward cost, relative to one token, up to which bare `auto` grows trees. Growing a node
/// costs drafting time whether or not the cut keeps it, and with a drafter whose first guess is
/// right about half the time a step seldom gains more than a token or two, so nodes past this
/// cost are grown only to be cut. Measured here: 4-bit SmolLM2 affords 4–5 nodes (cost(4) ≈
/// 1.3×) and `auto:4+lookup:3` ran at 1.12× plain against 1.03× for 16; f32 affords about 7, and
/// `auto:6`/`auto:8` ran at 1.45×/1.42× against 1.39× (same runs, 12 prompts, a 2-core Zen4).
/// After the f32 kernel learned to overlap rows with the weight stream, f32 affords 12–14 nodes
/// (a 2-core Xeon) and `auto+lookup:6` ran at 1.70×. A GPU's flat curve keeps all 16.
pub const AFFORDABLE_COST: f64 = 1.5;

impl Budget {
    /// This budget with `costs` measured in, and `max_nodes` fitted to them when asked.
    pub fn with_measured(self, costs: CostCurve) -> Budget {
        let max_nodes = if self.fit_to_device { costs.affordable(AFFORDABLE_COST).clamp(2, self.max_nodes.max(2)) } else { self.max_nodes };
        Budget { max_nodes, costs: Some(Arc::new(costs)), fit_to_device: self.fit_to_device }
    }
}

/// The forward's cost as this run finds it: a line `a + b * t` fitted to the verification
/// forwards' own times, seeded with the start-up curve.
///
/// Why: on a shared host the cost curve moves during a run. On the 2-core Zen 3 VM, five
/// start-up timings minutes apart (`selfspec bench --context 128`, f32) put cost(4)/cost(1)
/// between 1.22 and 1.68 and cost(8) between 1.58 and 2.41: one token's forward, bound by memory,
/// ran at 12.5 or 17.3 ms as other tenants' traffic came and went, while 8 tokens, bound by
/// arithmetic, took 27-30 ms either way. A curve timed once at start-up then sized every tree of
/// the run for whichever regime the start-up met (bare `auto` grew 3 nodes in one fresh-clone
/// demo and 6 in the next). The times are weighed down by `FORGET` per step, so the fit follows
/// the last few dozen steps; the start-up points keep a small fixed weight, which holds the slope
/// near the start-up one when the steps happen to verify trees of one size only.
#[derive(Debug, Clone)]
pub struct LiveCosts {
    /// Weighted sums over the observed steps: (w, w t, w t^2, w ms, w t ms).
    seen: [f64; 5],
    /// The same sums over the start-up curve's points, never forgotten.
    prior: [f64; 5],
    max_tokens: usize,
    /// The start-up curve, and what it predicted for the observed steps (weighted as `seen`).
    start: CostCurve,
    predicted: f64,
}

/// Weight kept per step by older observations (about 30 steps' memory).
const FORGET: f64 = 0.97;
/// Total weight of the start-up curve, in steps.
const PRIOR_WEIGHT: f64 = 2.0;

impl LiveCosts {
    /// Seeded with `start` at 1..=8 tokens (or its length), the sizes trees mostly take.
    pub fn new(start: &CostCurve) -> Self {
        let n = start.max_tokens().clamp(1, 8);
        let mut prior = [0.0; 5];
        for t in 1..=n {
            add(&mut prior, PRIOR_WEIGHT / n as f64, t as f64, start.at(t));
        }
        LiveCosts { seen: [0.0; 5], prior, max_tokens: start.max_tokens(), start: start.clone(), predicted: 0.0 }
    }

    /// A verification forward over `tokens` rows took `ms` (logits included).
    pub fn observe(&mut self, tokens: usize, ms: f64) {
        if !(ms.is_finite() && ms > 0.0) || tokens == 0 {
            return;
        }
        for v in self.seen.iter_mut() {
            *v *= FORGET;
        }
        self.predicted = self.predicted * FORGET + self.start.at(tokens);
        add(&mut self.seen, 1.0, tokens as f64, ms);
    }

    /// Whether the run's forwards have been clearly cheaper than the start-up curve predicted
    /// for their sizes (below [`EXPLORE_BELOW`] of it, over at least [`EXPLORE_AFTER`] of
    /// observed weight). Then that curve was timed in a slow moment, and it also overprices the sizes the
    /// run never tries: a sequence then probes a larger tree now and then
    /// ([`EXPLORE_EVERY`]), so the fit meets those sizes' real cost.
    pub fn start_overpriced(&self) -> bool {
        self.seen[0] >= EXPLORE_AFTER && self.seen[3] < EXPLORE_BELOW * self.predicted
    }

    /// The fitted line as a cost curve (cost(1) above zero, costs never falling).
    pub fn curve(&self) -> CostCurve {
        let [w, wt, wtt, wy, wty]: [f64; 5] = std::array::from_fn(|i| self.seen[i] + self.prior[i]);
        let den = w * wtt - wt * wt;
        let slope = if den > 1e-9 { ((w * wty - wt * wy) / den).max(0.0) } else { 0.0 };
        let base = ((wy - slope * wt) / w + slope).max(1e-3);
        let last = self.max_tokens.max(1);
        CostCurve::from_points(&[(1, base), (last, base + slope * (last - 1) as f64)], last).expect("a positive cost at T = 1")
    }
}

/// [`LiveCosts::start_overpriced`]: observed cost below this share of the start-up curve's.
pub const EXPLORE_BELOW: f64 = 0.9;
/// [`LiveCosts::start_overpriced`]: after this much observed weight (five steps, as the weights
/// decay by `FORGET`).
pub const EXPLORE_AFTER: f64 = 4.0;
/// While the start-up curve is overpriced, one step in this many grows and verifies
/// [`EXPLORE_EXTRA`] nodes more than the cut has been keeping on average (the sizes where the
/// fitted slope decides what the cut keeps).
///
/// Why: the cost curve `auto` starts from is cached per build, so one timed while the host was
/// busy sized every later run's trees. `scripts/headline` on the 2-core Zen 4 (at `fa41106`) met such a
/// curve (8 tokens at 7.4 ms against 5.3 in `bench` a minute later): `auto` grew at most 5
/// nodes and verified 3.1 on average, native τ 2.03 and 1.40× plain, where the same build had
/// kept 4.2–4.6 nodes at τ 2.2–2.3. The per-step refit alone could not recover, because a line
/// fitted to trees of 3–5 nodes keeps the start-up slope for the larger ones it never tries.
pub const EXPLORE_EVERY: usize = 8;
/// See [`EXPLORE_EVERY`].
pub const EXPLORE_EXTRA: usize = 2;

/// An exploring step's size: [`EXPLORE_EXTRA`] nodes past the mean a sequence's steps have
/// verified so far (`nodes_total` over `steps`), within 2..=[`AUTO_NODES`].
pub fn probe_size(nodes_total: usize, steps: usize) -> usize {
    let kept = (nodes_total as f64 / steps.max(1) as f64).round() as usize;
    (kept + EXPLORE_EXTRA).clamp(2, AUTO_NODES)
}

fn add(sums: &mut [f64; 5], w: f64, t: f64, ms: f64) {
    sums[0] += w;
    sums[1] += w * t;
    sums[2] += w * t * t;
    sums[3] += w * ms;
    sums[4] += w * t * ms;
}

/// Running correction of the drafter's probabilities: accepted nodes / predicted acceptances,
/// with a prior of a few nodes at face value so early steps are not swung by one outcome. The
/// copied branch has no probabilities; its per-depth precision is counted the same way, apart
/// for copies from the context and from a datastore (a stock phrase from other answers is
/// right less often than this answer repeating itself, and on a steep cost curve only the
/// better of the two may pay).
#[derive(Debug, Clone)]
pub struct Calibration {
    predicted: f64,
    accepted: f64,
    /// Per source (context, datastore), per position along the copied branch: (tries, hits)
    /// where its parent was accepted.
    lookup: [Vec<(f64, f64)>; 2],
}

const PRIOR_NODES: f64 = 4.0;
/// Prior precision of a copied token, from `examples/lookup.rs` on the target's own answers.
const LOOKUP_PRIOR: f64 = 0.75;
/// Prior precision of a token copied from the datastore: lower, until the run says otherwise.
const STORE_PRIOR: f64 = 0.5;

impl Default for Calibration {
    fn default() -> Self {
        Calibration { predicted: PRIOR_NODES, accepted: PRIOR_NODES, lookup: [Vec::new(), Vec::new()] }
    }
}

impl Calibration {
    pub fn drafter_factor(&self) -> f64 {
        (self.accepted / self.predicted).clamp(0.2, 5.0)
    }

    /// Chance that the copied token at position `j` (0-based) is accepted when its parent is;
    /// `stored`: copied from the datastore rather than the context.
    pub fn lookup_precision(&self, stored: bool, j: usize) -> f64 {
        let (tries, hits) = self.lookup[stored as usize].get(j).copied().unwrap_or((0.0, 0.0));
        let prior = if stored { STORE_PRIOR } else { LOOKUP_PRIOR };
        (hits + prior * PRIOR_NODES) / (tries + PRIOR_NODES)
    }

    /// Learn from one verified step: `scores` are the drafter's raw path probabilities of the
    /// kept drafter nodes, `hits` how many of them were accepted; `lookup` the copied branch's
    /// outcome per position (tried, accepted) where its parent was accepted, `stored` its source.
    pub fn record(&mut self, drafted: &[f64], hits: usize, lookup: &[bool], stored: bool) {
        self.predicted += drafted.iter().sum::<f64>();
        self.accepted += hits as f64;
        let counts = &mut self.lookup[stored as usize];
        for (j, &ok) in lookup.iter().enumerate() {
            if counts.len() <= j {
                counts.resize(j + 1, (0.0, 0.0));
            }
            counts[j].0 += 1.0;
            counts[j].1 += ok as u8 as f64;
        }
    }
}

/// One step's draft: the drafter's nodes (`0..drafted_nodes`, root included; `scores` holds
/// their path probabilities), then the nodes the copied branch added; `branch` holds the node of
/// each copied token (the drafter's where they merged), `stored` whether it came from the
/// datastore rather than the context.
pub struct Draft {
    pub tree: Tree,
    pub tokens: Vec<u32>,
    pub scores: Vec<f64>,
    pub drafted_nodes: usize,
    pub branch: Vec<usize>,
    pub stored: bool,
}

impl Draft {
    /// Keep the nodes `keep` (tree indices, root included, parents first), with their tokens,
    /// scores and the part of the copied branch that survives.
    pub fn restrict(self, keep: &[usize]) -> Result<Draft> {
        let Draft { tree, tokens, scores, drafted_nodes, branch, stored } = self;
        let mut new_of = vec![usize::MAX; tree.len()];
        for (j, &i) in keep.iter().enumerate() {
            new_of[i] = j;
        }
        Ok(Draft {
            tree: tree.restrict(keep)?,
            tokens: keep.iter().map(|&i| tokens[i]).collect(),
            scores: keep.iter().filter(|&&i| i < drafted_nodes).map(|&i| scores[i]).collect(),
            drafted_nodes: keep.iter().filter(|&&i| i < drafted_nodes).count(),
            branch: branch.iter().map(|&i| new_of[i]).take_while(|&i| i != usize::MAX).collect(),
            stored,
        })
    }
}

impl Calibration {
    /// Keep the part of `draft` worth verifying on a device with `costs` (see [`choose_nodes`]);
    /// `fixed_ms` is the step's cost besides the forward (drafting).
    pub fn cut(&self, draft: Draft, costs: &CostCurve, fixed_ms: f64) -> Result<Draft> {
        let keep = choose_nodes(&draft.tree, &self.estimates(&draft), costs, fixed_ms);
        draft.restrict(&keep)
    }

    /// Each node's chance of acceptance as the cut ranks them (root 1): the drafter's path
    /// scores scaled by its learned calibration, and the copied branch's running precision.
    pub fn estimates(&self, draft: &Draft) -> Vec<f64> {
        let f = self.drafter_factor();
        let mut est: Vec<f64> = (0..draft.tree.len()).map(|i| if i < draft.drafted_nodes { draft.scores[i] * f } else { 0.0 }).collect();
        let mut q = 1.0;
        for (j, &i) in draft.branch.iter().enumerate() {
            q *= self.lookup_precision(draft.stored, j);
            est[i] = est[i].max(q);
        }
        est
    }

    /// Learn from the verdict on a verified draft: `accepted` holds its accepted node indices.
    pub fn learn(&mut self, draft: &Draft, accepted: &[usize]) {
        let hits = accepted.iter().filter(|&&a| a != 0 && a < draft.drafted_nodes).count();
        // The copied branch's outcome at each position its parent reached.
        let mut parent = 0;
        let mut outcome = Vec::new();
        for &i in &draft.branch {
            if !accepted.contains(&parent) {
                break;
            }
            outcome.push(accepted.contains(&i));
            parent = i;
        }
        self.record(&draft.scores[1..draft.drafted_nodes], hits, &outcome, draft.stored);
    }
}

/// Which nodes to verify: `estimates[i]` is node i's chance of acceptance (root: 1). Keeps the
/// root and the k likeliest other nodes, for the k that maximises
/// `(1 + sum of their estimates) / (cost(k + 1) + fixed_ms)`; `fixed_ms` is what the step costs
/// anyway (drafting). Returns kept node indices in tree order (parents first), root included.
pub fn choose_nodes(tree: &Tree, estimates: &[f64], costs: &CostCurve, fixed_ms: f64) -> Vec<usize> {
    choose_at_least(tree, estimates, costs, fixed_ms, 1)
}

/// [`choose_nodes`], keeping at least `min_nodes` nodes (root included) where the tree has
/// them: the likeliest, prefix-closed as ever (an exploring step, see [`EXPLORE_EVERY`]).
pub fn choose_at_least(tree: &Tree, estimates: &[f64], costs: &CostCurve, fixed_ms: f64, min_nodes: usize) -> Vec<usize> {
    assert_eq!(estimates.len(), tree.len(), "one estimate per node");
    // A child can never look likelier than its parent, which keeps every prefix of the ranking
    // prefix-closed (ties go to the earlier node, and parents come first).
    let mut e = estimates.to_vec();
    e[0] = 1.0;
    for i in 1..tree.len() {
        let p = tree.node(i).parent.expect("non-root nodes have parents");
        e[i] = e[i].clamp(0.0, 1.0).min(e[p]);
    }
    let mut order: Vec<usize> = (1..tree.len()).collect();
    order.sort_by(|&a, &b| e[b].total_cmp(&e[a]).then(a.cmp(&b)));
    let mut best = (1.0 / (costs.at(1) + fixed_ms), 0);
    let mut gain = 1.0;
    for (k, &i) in order.iter().enumerate() {
        gain += e[i];
        let v = gain / (costs.at(k + 2) + fixed_ms);
        if v > best.0 {
            best = (v, k + 1);
        }
    }
    let k = best.1.max(min_nodes.saturating_sub(1).min(order.len()));
    let mut kept: Vec<usize> = std::iter::once(0).chain(order[..k].iter().copied()).collect();
    kept.sort_unstable();
    kept
}

/// [`choose_nodes`] for a batch: one forward verifies every sequence's tree, so nodes compete
/// across sequences. Every root is kept (each sequence's next token needs its row); of the
/// other nodes, the k likeliest over the whole batch are kept, for the k that maximises
/// `(roots + sum of their estimates) / (cost(roots + k) + fixed_ms)`. As the batch grows, its
/// roots alone climb the cost curve, each extra row costs more relative to what the step
/// already yields, and trees shrink, down to none where plain batched decoding already fills
/// the machine. Returns per tree its kept node indices in tree order.
pub fn choose_nodes_batch(trees: &[(&Tree, Vec<f64>)], costs: &CostCurve, fixed_ms: f64) -> Vec<Vec<usize>> {
    let roots = trees.len();
    // (estimate, tree, node), each tree's nodes clamped so none outranks its parent, which
    // keeps every tree's share of any prefix of the ranking prefix-closed.
    let mut all: Vec<(f64, usize, usize)> = Vec::new();
    for (t, (tree, est)) in trees.iter().enumerate() {
        assert_eq!(est.len(), tree.len(), "one estimate per node");
        let mut e = est.clone();
        e[0] = 1.0;
        for i in 1..tree.len() {
            let p = tree.node(i).parent.expect("non-root nodes have parents");
            e[i] = e[i].clamp(0.0, 1.0).min(e[p]);
            all.push((e[i], t, i));
        }
    }
    all.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let mut best = (roots as f64 / (costs.at(roots) + fixed_ms), 0);
    let mut gain = roots as f64;
    for (k, &(e, _, _)) in all.iter().enumerate() {
        gain += e;
        let v = gain / (costs.at(roots + k + 1) + fixed_ms);
        if v > best.0 {
            best = (v, k + 1);
        }
    }
    let mut kept: Vec<Vec<usize>> = vec![vec![0]; roots];
    for &(_, t, i) in &all[..best.1] {
        kept[t].push(i);
    }
    kept.iter_mut().for_each(|k| k.sort_unstable());
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measured_costs_are_cached_per_model_and_format() {
        let dir = std::env::temp_dir().join(format!("selfspec-costs-{}", std::process::id()));
        let cfg = crate::model::fixtures::tiny_config();
        let w = crate::model::fixtures::random_weights(&cfg, 3).unwrap();
        let vb = candle_nn::VarBuilder::from_tensors(w, candle_core::DType::F32, &candle_core::Device::Cpu);
        let mut model = Llama::load(vb, &cfg).unwrap();
        let measured = CostCurve::measure_cached(&model, 4, Some(&dir)).unwrap();
        let key = cost_key(&model, 4);
        assert!(dir.join("costs").join(&key).exists());
        // A later run reads the entry instead of timing (a doctored entry shows it was read).
        crate::files::cache_write(&dir, "costs", &key, b"[[1, 5.0], [4, 8.0]]");
        let cached = CostCurve::measure_cached(&model, 4, Some(&dir)).unwrap();
        assert_eq!(cached.at(1), 5.0);
        assert_eq!(cached.max_tokens(), measured.max_tokens());
        // A corrupt entry is a miss, never an error; another format is another key.
        crate::files::cache_write(&dir, "costs", &key, b"[[2, -1.0]]");
        assert!(CostCurve::measure_cached(&model, 4, Some(&dir)).unwrap().at(1) != 5.0);
        model.set_weights(crate::cpu::quant::WeightFormat::Q8_0, &crate::model::NativeWeights::new()).unwrap();
        assert_ne!(cost_key(&model, 4), key);
        assert_ne!(cost_key(&model, 5), cost_key(&model, 4));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn curve(ms: &[f64]) -> CostCurve {
        CostCurve::from_points(&ms.iter().enumerate().map(|(i, &m)| (i + 1, m)).collect::<Vec<_>>(), ms.len()).unwrap()
    }

    #[test]
    fn cost_curve_interpolates_and_rejects_a_missing_base() {
        let c = CostCurve::from_points(&[(1, 10.0), (3, 14.0), (8, 24.0)], 10).unwrap();
        assert_eq!(c.at(2), 12.0);
        assert_eq!(c.at(8), 24.0);
        assert_eq!(c.at(10), 30.0, "past the last point: the same cost per token");
        assert_eq!(c.at(0), 10.0);
        assert!((c.first_step() - 0.2).abs() < 1e-12, "(12 - 10) / 10: {}", c.first_step());
        assert!(CostCurve::from_points(&[(2, 5.0)], 4).is_err());
        // A noisy measurement that dips is flattened.
        let n = CostCurve::from_points(&[(1, 10.0), (2, 9.0)], 2).unwrap();
        assert_eq!(n.at(2), 10.0);
    }

    #[test]
    fn cuts_by_expected_tokens_per_ms() {
        // Root, a confident chain 1 -> 2, an unlikely sibling 3.
        let tree = Tree::from_paths(&[vec![0], vec![0, 0], vec![1]]).unwrap();
        let order: Vec<Vec<usize>> = tree.nodes().iter().map(|n| n.path.clone()).collect();
        let est: Vec<f64> = order.iter().map(|p| match p.as_slice() { [] => 1.0, [0] => 0.9, [0, 0] => 0.8, _ => 0.05 }).collect();
        let idx = |path: &[usize]| order.iter().position(|p| p == path).unwrap();
        // Flat costs: everything is worth it.
        assert_eq!(choose_nodes(&tree, &est, &curve(&[10.0, 10.0, 10.0, 10.0]), 0.0).len(), 4);
        // Each node costs 30% more: the chain pays (2.7 / 16 > 1 / 10), the long shot does not.
        let kept = choose_nodes(&tree, &est, &curve(&[10.0, 13.0, 16.0, 19.0]), 0.0);
        assert_eq!(kept, { let mut k = vec![0, idx(&[0]), idx(&[0, 0])]; k.sort(); k });
        // Very expensive rows: the root alone.
        assert_eq!(choose_nodes(&tree, &est, &curve(&[10.0, 30.0, 50.0, 70.0]), 0.0), vec![0]);
        // A child never outranks its parent, so the kept set is a tree.
        let odd: Vec<f64> = order.iter().map(|p| match p.as_slice() { [] => 1.0, [0] => 0.1, [0, 0] => 0.9, _ => 0.5 }).collect();
        let kept = choose_nodes(&tree, &odd, &curve(&[10.0, 10.5, 11.0, 30.0]), 0.0);
        assert!(kept.iter().all(|&i| i == 0 || kept.contains(&tree.node(i).parent.unwrap())), "{kept:?}");
    }

    #[test]
    fn cut_keeps_likely_nodes_and_learning_follows_the_verdict() {
        // Drafter: root -> a (0.9) -> b (0.2); the lookup added c under a, copying "a c".
        let mut tree = Tree::from_paths(&[vec![0], vec![0, 0]]).unwrap();
        let c = tree.add_child(1);
        let draft = Draft { tree, tokens: vec![5, 6, 7, 8], scores: vec![1.0, 0.9, 0.18], drafted_nodes: 3, branch: vec![1, c], stored: false };
        let calib = Calibration::default();
        // Each extra node costs 30%: a (0.9) and c (0.75 * 0.75, the copied prior) pay, b (0.18)
        // does not.
        let cut = calib.cut(draft, &curve(&[10.0, 13.0, 16.0, 19.0]), 0.0).unwrap();
        assert_eq!(cut.tokens, vec![5, 6, 8]);
        assert_eq!((cut.drafted_nodes, cut.branch.clone(), cut.scores.clone()), (2, vec![1, 2], vec![1.0, 0.9]));
        assert_eq!(cut.tree.node(2).parent, Some(1));
        // a accepted, the copied c rejected.
        let mut learned = calib.clone();
        learned.learn(&cut, &[0, 1]);
        assert!(learned.drafter_factor() > 1.0, "0.9 predicted, 1 accepted");
        assert!(learned.lookup_precision(false, 0) > LOOKUP_PRIOR && learned.lookup_precision(false, 1) < LOOKUP_PRIOR);
        assert_eq!(learned.lookup_precision(true, 0), STORE_PRIOR, "the datastore's counts are apart");
        // The same branch from the datastore starts at its lower prior: c (0.5 * 0.5) no
        // longer pays, a still does.
        let mut tree = Tree::from_paths(&[vec![0], vec![0, 0]]).unwrap();
        let c = tree.add_child(1);
        let stored = Draft { tree, tokens: vec![5, 6, 7, 8], scores: vec![1.0, 0.9, 0.18], drafted_nodes: 3, branch: vec![1, c], stored: true };
        assert_eq!(calib.cut(stored, &curve(&[10.0, 13.0, 16.0, 19.0]), 0.0).unwrap().tokens, vec![5, 6]);
    }

    #[test]
    fn live_costs_follow_the_run_and_keep_the_start_up_slope_when_blind() {
        let start = CostCurve::from_points(&[(1, 17.0), (4, 21.0), (8, 27.0)], 22).unwrap();
        let fresh = LiveCosts::new(&start).curve();
        assert_eq!(fresh.max_tokens(), 22);
        assert!((fresh.at(1) - 17.0).abs() < 1.0 && (fresh.at(8) - 27.0).abs() < 1.0, "{fresh:?}");
        // The machine's memory gets faster: one token 12.5 ms, eight still 27.
        let mut live = LiveCosts::new(&start);
        for step in 0..60 {
            let t = [1, 3, 5, 8][step % 4];
            live.observe(t, 12.5 + (t - 1) as f64 * 14.5 / 7.0);
        }
        let c = live.curve();
        assert!((c.at(1) - 12.5).abs() < 0.6 && (c.at(8) - 27.0).abs() < 0.6, "{c:?}");
        assert!(c.affordable(AFFORDABLE_COST) < fresh.affordable(AFFORDABLE_COST), "steeper now: smaller trees");
        // Steps of one size only: their level moves, the slope stays near the start-up one.
        let mut blind = LiveCosts::new(&start);
        for _ in 0..200 {
            blind.observe(4, 19.0);
        }
        let b = blind.curve();
        assert!((b.at(4) - 19.0).abs() < 0.25, "{b:?}");
        let (slope, start_slope) = ((b.at(8) - b.at(1)) / 7.0, (fresh.at(8) - fresh.at(1)) / 7.0);
        assert!((slope / start_slope - 1.0).abs() < 0.2, "slope {slope} against {start_slope} at start-up");
        // Junk times are ignored, and a falling fit is clamped flat.
        blind.observe(3, f64::NAN);
        blind.observe(0, 5.0);
        assert_eq!(blind.curve(), b);
        let mut falling = LiveCosts::new(&start);
        for step in 0..100 {
            falling.observe(1 + step % 2 * 7, if step % 2 == 0 { 30.0 } else { 10.0 });
        }
        let f = falling.curve();
        assert!(f.at(8) >= f.at(1) && f.at(1) > 0.0, "{f:?}");
    }

    /// A start-up curve timed in a slow moment is found out by steps that verify 3-5 nodes, and
    /// probes at larger sizes pull the fitted slope toward the real one. A right curve, or a run
    /// slower than it, never asks for probes. (Both curves as measured on the 2-core Zen 4: the
    /// cached one a headline met, and `bench --context 128` a few minutes later.)
    #[test]
    fn an_overpriced_start_up_curve_is_found_out_and_probes_correct_its_slope() {
        let slow = CostCurve::from_points(&[(1, 3.59), (2, 3.75), (3, 4.07), (4, 4.47), (6, 5.85), (8, 7.39), (12, 10.31), (16, 12.79)], 16).unwrap();
        let real = CostCurve::from_points(&[(1, 3.31), (2, 3.41), (3, 3.45), (4, 3.59), (6, 4.48), (8, 5.32), (12, 7.46), (16, 9.6)], 16).unwrap();
        let mut live = LiveCosts::new(&slow);
        assert!(!live.start_overpriced(), "nothing observed yet");
        for step in 0..3 {
            live.observe(3 + step % 3, real.at(3 + step % 3));
        }
        assert!(!live.start_overpriced(), "too few steps to judge");
        for step in 3..24 {
            live.observe(3 + step % 3, real.at(3 + step % 3));
        }
        assert!(live.start_overpriced());
        let blind = live.curve();
        // One probe in EXPLORE_EVERY steps, EXPLORE_EXTRA nodes past the 4 kept on average.
        for step in 24..200 {
            let t = if step % EXPLORE_EVERY == EXPLORE_EVERY - 1 { 4 + EXPLORE_EXTRA } else { 3 + step % 3 };
            live.observe(t, real.at(t));
        }
        let probed = live.curve();
        let (before, after) = (blind.affordable(AFFORDABLE_COST), probed.affordable(AFFORDABLE_COST));
        assert!(after > before, "{after} nodes affordable after probing, {before} before");
        assert!((probed.at(8) - real.at(8)).abs() < (blind.at(8) - real.at(8)).abs(), "8 tokens: {} after, {} before, {} real", probed.at(8), blind.at(8), real.at(8));
        // The curve was right, or the run is slower than it said: no probes.
        for (ms, why) in [(1.0, "right"), (1.3, "slower")] {
            let mut l = LiveCosts::new(&slow);
            for step in 0..50 {
                l.observe(3 + step % 3, slow.at(3 + step % 3) * ms);
            }
            assert!(!l.start_overpriced(), "{why}");
        }
    }

    #[test]
    fn probes_go_two_nodes_past_the_mean_kept_size() {
        assert_eq!(probe_size(0, 0), 2, "no steps yet: the smallest probe");
        assert_eq!(probe_size(31, 7), 4 + EXPLORE_EXTRA, "4.4 nodes a step");
        assert_eq!(probe_size(10_000, 10), AUTO_NODES, "never past auto's ceiling");
    }

    #[test]
    fn choose_at_least_keeps_the_likeliest_prefix_closed_nodes() {
        let tree = Tree::from_paths(&[vec![0], vec![0, 0], vec![1], vec![0, 0, 0]]).unwrap();
        let est: Vec<f64> = tree.nodes().iter().map(|n| match n.path.as_slice() { [] => 1.0, [0] => 0.5, [0, 0] => 0.3, [1] => 0.2, _ => 0.1 }).collect();
        let steep = curve(&[10.0, 30.0, 50.0, 70.0, 90.0]);
        assert_eq!(choose_nodes(&tree, &est, &steep, 0.0), vec![0], "the cut alone keeps the root");
        assert_eq!(choose_at_least(&tree, &est, &steep, 0.0, 1), vec![0]);
        let three = choose_at_least(&tree, &est, &steep, 0.0, 3);
        let paths: Vec<&[usize]> = three.iter().map(|&i| tree.node(i).path.as_slice()).collect();
        assert_eq!(paths, vec![&[][..], &[0][..], &[0, 0][..]], "the two likeliest, a chain");
        assert_eq!(choose_at_least(&tree, &est, &steep, 0.0, 99).len(), tree.len(), "no more than the tree has");
        // Where the cut keeps more than asked, the minimum changes nothing.
        let flat = curve(&[10.0; 5]);
        assert_eq!(choose_at_least(&tree, &est, &flat, 0.0, 2), choose_nodes(&tree, &est, &flat, 0.0));
    }

    #[test]
    fn batch_cut_spends_rows_where_they_buy_most_and_stops_when_the_machine_is_full() {
        // Two trees: a root with children at 0.9 then 0.8 below it, and a root with one 0.3 child.
        let a = Tree::from_paths(&[vec![0], vec![0, 0]]).unwrap();
        let b = Tree::from_paths(&[vec![0]]).unwrap();
        let (ea, eb) = (vec![1.0, 0.9, 0.8], vec![1.0, 0.3]);
        // Nearly flat up to 8 rows: everything worth a row is kept, likeliest first.
        let flat = CostCurve::from_points(&[(1, 10.0), (8, 10.7), (64, 60.0)], 64).unwrap();
        let kept = choose_nodes_batch(&[(&a, ea.clone()), (&b, eb.clone())], &flat, 0.0);
        assert_eq!(kept, vec![vec![0, 1, 2], vec![0, 1]]);
        // One sequence alone: the same as choose_nodes.
        assert_eq!(choose_nodes_batch(&[(&a, ea.clone())], &flat, 0.0)[0], choose_nodes(&a, &ea, &flat, 0.0));
        // Each row costs as much as the first (compute-bound): roots only.
        let linear = CostCurve::from_points(&[(1, 10.0), (64, 640.0)], 64).unwrap();
        assert_eq!(choose_nodes_batch(&[(&a, ea.clone()), (&b, eb.clone())], &linear, 0.0), vec![vec![0], vec![0]]);
        // Between: rows are cheap at first and dear past 3, so the two likeliest go in.
        let knee = CostCurve::from_points(&[(1, 10.0), (2, 10.2), (3, 10.5), (4, 20.0), (64, 200.0)], 64).unwrap();
        assert_eq!(choose_nodes_batch(&[(&a, ea), (&b, eb)], &knee, 0.0), vec![vec![0, 1], vec![0]]);
        // A child estimated above its parent cannot jump it.
        let c = Tree::from_paths(&[vec![0], vec![0, 0]]).unwrap();
        let one_pays = CostCurve::from_points(&[(1, 10.0), (2, 10.1), (3, 20.0)], 8).unwrap();
        assert_eq!(choose_nodes_batch(&[(&c, vec![1.0, 0.1, 0.9])], &one_pays, 0.0), vec![vec![0, 1]]);
    }

    #[test]
    fn bare_auto_fits_its_growth_to_the_cost_curve() {
        let cpu = CostCurve::from_points(&[(1, 10.0), (2, 11.0), (4, 14.0), (8, 20.0)], 24).unwrap();
        assert_eq!(cpu.affordable(1.5), 4, "cost(5) = 15.5 > 1.5 x 10");
        let fitted = Budget { max_nodes: 16, costs: None, fit_to_device: true }.with_measured(cpu.clone());
        assert_eq!((fitted.max_nodes, fitted.fit_to_device), (4, true), "fitted, and refitted as a run goes");
        let explicit = Budget { max_nodes: 16, costs: None, fit_to_device: false }.with_measured(cpu);
        assert_eq!(explicit.max_nodes, 16, "auto:N keeps N");
        let flat = CostCurve::from_points(&[(1, 10.0), (64, 11.0)], 80).unwrap();
        assert_eq!(Budget { max_nodes: 16, costs: None, fit_to_device: true }.with_measured(flat).max_nodes, 16, "never above the asked maximum");
        let steep = CostCurve::from_points(&[(1, 10.0), (2, 30.0)], 8).unwrap();
        assert_eq!(Budget { max_nodes: 16, costs: None, fit_to_device: true }.with_measured(steep).max_nodes, 2, "at least a root and one node");
    }

    #[test]
    fn calibration_learns_from_outcomes() {
        let mut c = Calibration::default();
        assert_eq!(c.drafter_factor(), 1.0);
        for _ in 0..50 {
            c.record(&[0.8, 0.6], 0, &[true, false], false);
            c.record(&[], 0, &[false], true);
        }
        assert!(c.drafter_factor() < 0.3, "overconfident drafts are scaled down: {}", c.drafter_factor());
        assert!(c.lookup_precision(false, 0) > 0.9 && c.lookup_precision(false, 1) < 0.1);
        assert_eq!(c.lookup_precision(false, 5), LOOKUP_PRIOR);
        assert!(c.lookup_precision(true, 0) < 0.1);
        assert_eq!(c.lookup_precision(true, 1), STORE_PRIOR);
    }
}
