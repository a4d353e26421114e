//! One sequence's self-speculative decoding as a machine that moves a step at a time, so that a
//! driver can put many sequences' steps into one target forward: the sequence proposes its
//! work ([`Sequence::next_work`]: a chunk of prompt, or a drafted tree), the driver runs the
//! forward (alone: [`crate::spec::generate_spec`]; batched: the server's scheduler), and the
//! sequence takes its rows back ([`Sequence::finish_work`]: verification, emission, KV commit).
//!
//! Every decision a step makes is the sequence's own (its tree, its draws, its penalties); the
//! only thing a batch shares is the forward, whose rows do not depend on one another. So a
//! sequence emits the same tokens alone or beside any others.
use std::time::Instant;

use candle_core::Tensor;

use crate::cpu::attention::TreeMask;
use crate::cpu::reduce::{row_to_vec, with_rows};
use crate::decode::generate::{check_budget, Flow, GenStats, StopRule};
use crate::decode::sampling::{token_logprobs, Rng64, SamplingParams, TokenLogprobs};
use crate::draft::budget::{choose_at_least, choose_nodes, probe_size, Budget, Calibration, CostCurve, Draft, LiveCosts, AFFORDABLE_COST, AUTO_NODES, EXPLORE_EVERY};
use crate::draft::choice::TreeChoice;
use crate::draft::drafter::{DraftState, Drafter};
use crate::draft::lookup::Lookup;
use crate::draft::tree::{Tree, MAX_TREE_NODES};
use crate::model::kv_cache::KvCache;
use crate::model::Llama;
use crate::spec::prefix::Prefix;
use crate::spec::verify::{verify, Rule};
use crate::draft::datastore::Datastore;
use crate::{Error, Result};

/// Skipped steps a drafter catches up on when drafting resumes: the most recent ones, which a
/// draft layer mostly drafts from. Replaying every skipped step (over 100 rows of the draft
/// layer per request after a busy spell) kept the drafter server 1-3% behind the plain one at 4
/// and 8 concurrent requests (SmolLM2 native, 2-core Xeon); with no replay at all the two were
/// level. Older skipped steps are simply absent from the draft layer's cache, which costs
/// drafting quality only, never exactness.
pub const LAG_KEEP: usize = 16;

/// Ranks kept for per-head top-5 accuracy.
const ACC_K: usize = 5;

/// For `auto` trees: the path probability below which a node is not expanded. Expanding one
/// costs a verification row (the curve's first step, relative to a plain step) and, when it
/// opens a new level, a forward of the draft layer; a level is worth its time when the tokens it
/// may add, relative to the step's τ, exceed its time relative to the step's. Measured on this
/// Xeon with bf16 weights, `auto+lookup:6` went from 1.68× to 1.79–1.81× with a floor 0.05–0.1
/// higher than the first term alone, τ 2.50 → 2.47–2.49 (a level there is ~0.27 ms of a 9 ms
/// step); with f32 weights a level is a smaller share of a 16 ms step.
pub(crate) fn expansion_floor(costs: &CostCurve, stats: &SpecStats, levels: usize, emitted: usize) -> f64 {
    let steps = stats.gen.target_forwards;
    if steps == 0 || levels == 0 {
        return costs.first_step();
    }
    let step_ms = (stats.time.draft + stats.time.forward) * 1e3 / steps as f64;
    let level_ms = stats.time.draft * 1e3 / levels as f64;
    let tau = emitted.saturating_sub(1) as f64 / steps as f64;
    costs.first_step() + tau * level_ms / step_ms
}

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
    /// Steps that verified a larger `auto` tree than the cut would have kept, because the run's
    /// forwards came out cheaper than the start-up curve said ([`LiveCosts::start_overpriced`];
    /// a sequence cut alone, as `generate` and `eval` cut).
    pub explored: usize,
    /// Prompt tokens taken from a kept [`Prefix`] instead of being run (OpenAI's
    /// `usage.prompt_tokens_details.cached_tokens`).
    pub cached_prompt_tokens: usize,
}

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct StepTimes {
    pub draft: f64,
    pub forward: f64,
    pub verify: f64,
    pub commit: f64,
}

impl StepTimes {
    /// The share of a step spent outside the target's forward (drafting, verification,
    /// commit): the overhead a speculative step pays beyond the forward it shares with plain
    /// decoding. 0 when nothing was timed.
    pub fn outside_forward(&self) -> f64 {
        let outside = self.draft + self.verify + self.commit;
        let total = outside + self.forward;
        if total > 0.0 { outside / total } else { 0.0 }
    }
}

impl SpecStats {
    /// Tokens per target forward, the bonus token counted (plain decoding = 1.0).
    pub fn tau(&self) -> f64 {
        self.gen.tau()
    }
}

#[derive(Clone)]
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

/// What a sequence asks of the next target forward.
pub enum Work {
    /// The next chunk of the prompt, run causally after what is cached. `all_logits`: every
    /// row's logits are read (the prompt's own log-probabilities), not the last row's alone.
    Prefill { tokens: Vec<u32>, positions: Vec<usize>, mask: TreeMask, all_logits: bool },
    /// A drafted tree under the last emitted token (a root-only tree without a drafter: plain
    /// decoding). [`Sequence::cut`] trims it to what is worth verifying before it runs.
    Tree { draft: Draft, positions: Vec<usize>, mask: TreeMask },
}

impl Work {
    pub fn tokens(&self) -> &[u32] {
        match self {
            Work::Prefill { tokens, .. } => tokens,
            Work::Tree { draft, .. } => &draft.tokens,
        }
    }
    pub fn positions(&self) -> &[usize] {
        match self {
            Work::Prefill { positions, .. } | Work::Tree { positions, .. } => positions,
        }
    }
    pub fn mask(&self) -> &TreeMask {
        match self {
            Work::Prefill { mask, .. } | Work::Tree { mask, .. } => mask,
        }
    }
    /// The rows whose logits [`Sequence::finish_work`] reads (all of a tree; the last row of the
    /// prompt's final chunk; none of an earlier chunk; every row of a chunk whose prompt
    /// log-probabilities were asked for).
    pub fn logit_rows(&self, prompt_done: bool) -> std::ops::Range<usize> {
        match self {
            Work::Prefill { tokens, all_logits: true, .. } => 0..tokens.len(),
            Work::Prefill { tokens, .. } if prompt_done => tokens.len() - 1..tokens.len(),
            Work::Prefill { .. } => 0..0,
            Work::Tree { draft, .. } => 0..draft.tokens.len(),
        }
    }
}

enum Phase<'d> {
    /// `hidden` holds the final hidden states of the prompt's chunks run so far (a draft layer
    /// reads all of them when it starts).
    Prefill { done: usize, hidden: Vec<Tensor> },
    Decode(Option<DraftState<'d>>),
    Done,
}

/// One generation, stepped from outside.
pub struct Sequence<'d> {
    drafter: Option<&'d Drafter>,
    opts: SpecOptions<'d>,
    choice: TreeChoice,
    live: Option<LiveCosts>,
    refit: bool,
    calib: Calibration,
    /// Draft-layer levels run so far (a drafted tree of depth d took d - 1), to price one more.
    levels: usize,
    budget: usize,
    max_pos: usize,
    cache: KvCache,
    prompt_len: usize,
    history: Vec<u32>,
    out: Vec<u32>,
    phase: Phase<'d>,
    rng: Rng64,
    stats: SpecStats,
    /// (index in `out` of the root, per level top-5 draft ids) for accuracy after the fact.
    drafts: Vec<(usize, Vec<Vec<u32>>)>,
    started: Instant,
    /// Steps decoded without drafting (`next_work(.., draft: false)`) whose features the
    /// drafter has not seen yet: the accepted root's hidden row and the token that followed.
    /// Handed to the drafter in one call when drafting resumes, so a step that skips drafting
    /// costs no drafter work at all. Rows are copies, not views of a batch's forward. Only the
    /// last [`LAG_KEEP`] are kept.
    lag: Vec<(Tensor, u32)>,
    /// Whether the work out now skipped drafting.
    skipping: bool,
    /// The work out now is an exploring step: its cut keeps at least this many nodes.
    exploring: Option<usize>,
    /// Alternatives to list beside each emitted token's log-probability; `None`: none recorded.
    logprobs: Option<usize>,
    /// Per token of `out`, when `logprobs` asks for them.
    token_logprobs: Vec<TokenLogprobs>,
    /// Alternatives per prompt token, and per prompt token so far its log-probability (`None`
    /// for the first, which nothing predicts), when asked for.
    prompt_logprobs: Option<(usize, Vec<Option<TokenLogprobs>>)>,
    /// The target's states of the committed tokens, in order, kept for [`Self::finish_keeping_prefix`]
    /// when a drafter reads them (`None`: not kept).
    kept_states: Option<Vec<Tensor>>,
    /// The drafter's cache of committed pairs once decoding ended (kept with `kept_states`).
    kept_draft: Option<KvCache>,
    /// How many of the drafter's pairs line up with target positions (pair p read the target's
    /// state at p): all (`None`) until a skipped step's pair is dropped from `lag`, which the
    /// drafter then never sees; the pairs it held at that moment stay aligned.
    draft_aligned: Option<usize>,
    /// Pairs a resumed sequence's drafter starts with ([`Drafter::start_after`]).
    resume_draft: Option<KvCache>,
}

impl<'d> Sequence<'d> {
    /// Check everything about the request before any forward: sampling parameters, the tree
    /// against the drafter, the prompt against the context. `drafter: None` decodes plainly
    /// (one row a step), through the same verification, so its tokens are plain decoding's.
    pub fn new(model: &Llama, drafter: Option<&'d Drafter>, prompt: &[u32], opts: SpecOptions<'d>, rng: Rng64) -> Result<Self> {
        opts.params.validate()?;
        if prompt.is_empty() {
            return Err(Error::InvalidArgument("the prompt is empty".into()));
        }
        let max_pos = model.config().max_position;
        let budget = check_budget(prompt.len(), opts.stop.max_new_tokens, max_pos)?;
        let (choice, live, refit) = match drafter {
            Some(d) => {
                d.validate_tree(&opts.tree)?;
                let choice = d.resolve(&opts.tree).with_costs(model, opts.lookup.map_or(0, |l| l.max_tokens))?;
                let (live, refit) = match &choice {
                    TreeChoice::Auto(b) => (b.costs.as_deref().map(LiveCosts::new), b.fit_to_device),
                    _ => (None, false),
                };
                (choice, live, refit)
            }
            None => (TreeChoice::Static(Tree::from_paths(&[]).expect("a root-only tree")), None, false),
        };
        let mut stats = SpecStats::default();
        if let TreeChoice::Static(t) = &choice {
            stats.node_tries_hits = vec![(0, 0); t.len()];
        }
        Ok(Sequence {
            drafter,
            opts,
            choice,
            live,
            refit,
            calib: Calibration::default(),
            levels: 0,
            budget,
            max_pos,
            cache: model.new_cache()?,
            prompt_len: prompt.len(),
            history: prompt.to_vec(),
            out: Vec::new(),
            phase: Phase::Prefill { done: 0, hidden: Vec::new() },
            rng,
            stats,
            drafts: Vec::new(),
            exploring: None,
            started: Instant::now(),
            lag: Vec::new(),
            skipping: false,
            logprobs: None,
            token_logprobs: Vec::new(),
            prompt_logprobs: None,
            kept_states: None,
            kept_draft: None,
            draft_aligned: None,
            resume_draft: None,
        })
    }

    /// Start from a kept generation's first `n` tokens instead of running them: `n` must be
    /// at most [`Prefix::usable`] for this prompt (the prefix's tokens are the prompt's start,
    /// and the prompt's last token still runs). Called before any work. The K/V are copied,
    /// so one prefix serves many sequences; with a drafter the prefix must carry the target's
    /// states, and the draft layer's pairs below `n - 1` (those that read only this prompt's
    /// tokens) are copied too: the drafter starts as it would from a fresh prefill.
    pub fn resume_from(mut self, prefix: &Prefix, n: usize) -> Result<Self> {
        let Phase::Prefill { done: 0, hidden } = &mut self.phase else {
            return Err(Error::InvalidArgument("a sequence resumes from a prefix before it starts".into()));
        };
        if n == 0 {
            return Ok(self);
        }
        if n > prefix.usable(&self.history[..self.prompt_len]) {
            return Err(Error::InvalidArgument(format!("the prefix does not cover the prompt's first {n} tokens")));
        }
        if self.prompt_logprobs.is_some() {
            return Err(Error::InvalidArgument("prompt log-probabilities need every prompt row run".into()));
        }
        if self.drafter.is_some() {
            let states = prefix.states().ok_or_else(|| Error::InvalidArgument("the prefix has no target states for the drafter".into()))?;
            // A copy: a view would keep the whole prefix's states alive after it is evicted.
            let rows = states.narrow(0, 0, n)?.copy()?;
            if let Some(k) = self.kept_states.as_mut() {
                k.push(rows.clone());
            }
            hidden.push(rows);
            // Pair p also read token p + 1: the prompt's own only below n.
            self.resume_draft = prefix.draft().map(|d| d.prefix_copy(d.len().min(n - 1))).transpose()?;
        }
        // Room for the rest of the prompt and a first stretch of answer: no regrowing copy at
        // the first chunk.
        self.cache = prefix.cache().prefix_copy_with_room(n, self.prompt_len - n + 256)?;
        self.phase = Phase::Prefill { done: n, hidden: std::mem::take(hidden) };
        self.stats.cached_prompt_tokens = n;
        Ok(self)
    }

    /// Keep what [`Self::finish_keeping_prefix`] hands back: with a drafter, a copy of the
    /// target's states of every committed token (its width in f32 per token).
    pub fn keeping_prefix(mut self) -> Self {
        if self.drafter.is_some() && self.kept_states.is_none() {
            self.kept_states = Some(Vec::new());
        }
        self
    }

    /// Record each prompt token's log-probability under the target given the tokens before it,
    /// with its `top` likeliest alternatives (what `echo` with `logprobs` returns, and what
    /// lm-evaluation-harness scores continuations by). Every prompt row's logits are then
    /// computed: one `[rows, vocabulary]` product per prompt chunk instead of one row.
    pub fn with_prompt_logprobs(mut self, top: usize) -> Self {
        self.prompt_logprobs = Some((top, vec![None]));
        self
    }

    /// Per prompt token, its log-probabilities (`None` for the first) once the prompt has been
    /// read; `None` unless [`Self::with_prompt_logprobs`] asked for them.
    pub fn prompt_logprobs(&self) -> Option<&[Option<TokenLogprobs>]> {
        self.prompt_logprobs.as_ref().map(|(_, v)| v.as_slice())
    }

    /// Record each emitted token's log-probability under the target and its `top` likeliest
    /// alternatives (at most [`crate::decode::sampling::MAX_TOP_LOGPROBS`]), from the very
    /// logits rows verification read: the same numbers with or without a drafter, alone or in a
    /// batch. Costs one pass over a logits row per emitted token.
    pub fn with_logprobs(mut self, top: usize) -> Self {
        self.logprobs = Some(top);
        self
    }

    /// Per token of [`Self::output`], its log-probabilities (empty unless
    /// [`Self::with_logprobs`] asked for them).
    pub fn logprobs(&self) -> &[TokenLogprobs] {
        &self.token_logprobs
    }

    pub fn is_done(&self) -> bool {
        matches!(self.phase, Phase::Done)
    }
    /// Whether the prompt has been run through the target in full.
    pub fn is_decoding(&self) -> bool {
        matches!(self.phase, Phase::Decode(_))
    }
    /// Tokens emitted so far.
    pub fn output(&self) -> &[u32] {
        &self.out
    }
    pub fn stats(&self) -> &SpecStats {
        &self.stats
    }
    pub fn cache_mut(&mut self) -> &mut KvCache {
        &mut self.cache
    }
    /// Whether the last emitted token is an end-of-sequence token.
    pub fn ended_on_eos(&self) -> bool {
        self.out.last().is_some_and(|t| self.opts.stop.eos_ids.contains(t))
    }
    /// Prompt tokens not yet run through the target.
    pub fn prompt_left(&self) -> usize {
        match &self.phase {
            Phase::Prefill { done, .. } => self.prompt_len - done,
            _ => 0,
        }
    }
    /// Whether this sequence's trees are `auto` trees, which a driver may cut by cost.
    pub fn is_auto(&self) -> bool {
        self.live.is_some()
    }
    /// End the sequence now (a stop string matched, the client left): no more work.
    pub fn stop(&mut self) {
        self.end();
    }

    /// Phase `Done`, keeping the draft layer's committed pairs that line up with target
    /// positions when the prefix is kept.
    fn end(&mut self) {
        if let Phase::Decode(Some(state)) = std::mem::replace(&mut self.phase, Phase::Done) {
            if self.kept_states.is_some() {
                self.kept_draft = state.into_layer_cache().map(|mut c| {
                    c.truncate(self.draft_aligned.unwrap_or(usize::MAX));
                    c
                });
            }
        }
    }

    /// The next piece of work: up to `prefill_chunk` prompt tokens while the prompt is being
    /// read, else a drafted (uncut) tree, or the root alone when `draft` is false (a driver
    /// whose machine is full skips drafting; the drafter still follows the tokens). None once
    /// the sequence is done.
    pub fn next_work(&mut self, model: &Llama, prefill_chunk: usize, draft: bool) -> Result<Option<Work>> {
        let t_step = Instant::now();
        match &mut self.phase {
            Phase::Done => Ok(None),
            Phase::Prefill { done, .. } => {
                let end = done.saturating_add(prefill_chunk.max(1)).min(self.prompt_len);
                let tokens = self.history[*done..end].to_vec();
                let positions: Vec<usize> = (*done..end).collect();
                Ok(Some(Work::Prefill { mask: TreeMask::causal(tokens.len()), tokens, positions, all_logits: self.prompt_logprobs.is_some() }))
            }
            Phase::Decode(state) => {
                self.exploring = None;
                let committed = self.cache.len();
                if committed + 1 >= self.max_pos {
                    self.end();
                    return Ok(None);
                }
                let root = *self.out.last().expect("decoding starts after the first token");
                self.skipping = !draft && state.is_some();
                if let (Some(state), true, false) = (state.as_mut(), draft, self.lag.is_empty()) {
                    let rows: Vec<Tensor> = self.lag.iter().map(|(h, _)| h.clone()).collect();
                    let tokens: Vec<u32> = self.lag.iter().map(|&(_, t)| t).collect();
                    let n = rows.len();
                    state.commit(model, &Tensor::cat(&rows, 0)?, &(0..n).collect::<Vec<_>>(), &tokens)?;
                    self.lag.clear();
                }
                let Some(state) = state.as_mut().filter(|_| draft) else {
                    let draft = Draft { tree: Tree::from_paths(&[]).expect("a root-only tree"), tokens: vec![root], scores: vec![1.0], drafted_nodes: 1, branch: Vec::new(), stored: false };
                    return Ok(Some(Work::Tree { positions: draft.tree.positions(committed), mask: draft.tree.mask(), draft }));
                };
                let costs = self.live.as_ref().map(LiveCosts::curve);
                let min_expand = costs.as_ref().map_or(0.0, |c| expansion_floor(c, &self.stats, self.levels, self.out.len()) / self.calib.drafter_factor());
                let refitted;
                let choice = match &costs {
                    Some(c) if self.refit => {
                        let mut max_nodes = c.affordable(AFFORDABLE_COST).clamp(2, AUTO_NODES);
                        let step = self.stats.gen.target_forwards;
                        if self.live.as_ref().is_some_and(LiveCosts::start_overpriced) && step % EXPLORE_EVERY == EXPLORE_EVERY - 1 {
                            // Grown here, forced by `cut` (a batch's cut prices the rows itself and
                            // ignores it: then only this step's drafting grew a little more).
                            let probe = probe_size(self.stats.tree_nodes_total, step);
                            max_nodes = max_nodes.max(probe);
                            self.exploring = Some(probe);
                        }
                        refitted = TreeChoice::Auto(Budget { max_nodes, costs: None, fit_to_device: true });
                        &refitted
                    }
                    _ => &self.choice,
                };
                let proposal = state.propose(model, root, choice, ACC_K, self.max_pos - committed, min_expand)?;
                self.levels += proposal.tree.depth().saturating_sub(1);
                self.drafts.push((self.out.len() - 1, proposal.guesses));
                let (mut tree, mut tokens) = (proposal.tree, proposal.tokens);
                // The lookup grafts its nodes after the drafter's; `branch` is the copied path.
                let drafted_nodes = tree.len();
                let (branch, stored) = match &self.opts.lookup {
                    Some(l) => {
                        let (copied, stored) = l.copy(&self.history, self.opts.datastore);
                        (Lookup::graft(&mut tree, &mut tokens, &copied, (self.max_pos - committed).min(MAX_TREE_NODES)), stored)
                    }
                    None => (Vec::new(), false),
                };
                let draft = Draft { tree, tokens, scores: proposal.scores, drafted_nodes, branch, stored };
                self.stats.time.draft += t_step.elapsed().as_secs_f64();
                Ok(Some(Work::Tree { positions: draft.tree.positions(committed), mask: draft.tree.mask(), draft }))
            }
        }
    }

    /// The cost curve this sequence prices its trees with, when its trees are `auto`.
    pub fn costs(&self) -> Option<CostCurve> {
        self.live.as_ref().map(LiveCosts::curve)
    }

    /// Each node's estimated chance of acceptance (root 1), as the cut ranks them: the
    /// drafter's scores scaled by what this sequence has learned of its calibration, and the
    /// copied branch's running precision.
    pub fn estimates(&self, draft: &Draft) -> Vec<f64> {
        self.calib.estimates(draft)
    }

    /// Trim an `auto` tree to what is worth verifying for this sequence alone (a driver that
    /// prices a whole batch cuts with [`crate::draft::budget::choose_nodes_batch`] instead).
    /// Other work passes unchanged.
    /// An exploring step ([`crate::draft::budget::EXPLORE_EVERY`]) keeps at least its probe's
    /// nodes, and counts in [`SpecStats::explored`] when that kept more than the cut would.
    pub fn cut(&mut self, work: Work) -> Result<Work> {
        match (work, self.costs()) {
            (Work::Tree { draft, .. }, Some(costs)) => {
                let drafting_ms = self.stats.time.draft * 1e3 / self.stats.gen.target_forwards.max(1) as f64;
                let draft = match self.exploring {
                    Some(probe) => {
                        // The estimates once, for the cut alone and for the probe's cut.
                        let est = self.calib.estimates(&draft);
                        let plain = choose_nodes(&draft.tree, &est, &costs, drafting_ms).len();
                        let keep = choose_at_least(&draft.tree, &est, &costs, drafting_ms, probe);
                        self.stats.explored += usize::from(keep.len() > plain);
                        draft.restrict(&keep)?
                    }
                    None => self.calib.cut(draft, &costs, drafting_ms)?,
                };
                let committed = self.cache.len();
                Ok(Work::Tree { positions: draft.tree.positions(committed), mask: draft.tree.mask(), draft })
            }
            (w, _) => Ok(w),
        }
    }

    /// Keep the nodes `keep` (tree indices, root included, parents first) of a tree.
    pub fn restrict(&self, work: Work, keep: &[usize]) -> Result<Work> {
        match work {
            Work::Tree { draft, .. } => {
                let draft = draft.restrict(keep)?;
                let committed = self.cache.len();
                Ok(Work::Tree { positions: draft.tree.positions(committed), mask: draft.tree.mask(), draft })
            }
            w => Ok(w),
        }
    }

    /// The driver ran `work`'s rows through the target (`forward_ms` for the whole forward,
    /// over `rows` rows in all): `hidden` holds this sequence's rows' final hidden states and
    /// `logits` the logits of its [`Work::logit_rows`]. Verifies, emits (each new token passed
    /// to `on_token` with whether it was drafted; a [`Flow::Stop`] ends the sequence after that
    /// token) and commits. Returns the tokens emitted.
    #[allow(clippy::too_many_arguments)]
    pub fn finish_work(&mut self, model: &Llama, work: Work, hidden: Tensor, logits: Option<Tensor>, rows: usize, forward_ms: f64, on_token: &mut dyn FnMut(u32, bool) -> Result<Flow>) -> Result<usize> {
        let before = self.out.len();
        match (work, &mut self.phase) {
            (Work::Prefill { tokens, .. }, Phase::Prefill { done, hidden: hs }) => {
                // Row r predicts the prompt token after position done + r.
                if let (Some((top, lps)), Some(l)) = (self.prompt_logprobs.as_mut(), logits.as_ref()) {
                    let next = &self.history[*done + 1..self.prompt_len];
                    with_rows(l, |row| {
                        for (r, &t) in next.iter().take(tokens.len()).enumerate() {
                            lps.push(Some(token_logprobs(row(r)?, t, *top)));
                        }
                        Ok(())
                    })?;
                }
                *done += tokens.len();
                // Only a drafter reads the prompt's states, and a copy: `hidden` may be a view
                // of a whole batch's forward, which it would otherwise keep alive.
                if self.drafter.is_some() {
                    hs.push(hidden.copy()?);
                }
                self.stats.gen.prefill_secs += forward_ms / 1e3;
                if *done < self.prompt_len {
                    return Ok(0);
                }
                let states = match hs.len() {
                    0 => None,
                    1 => hs.pop(),
                    _ => Some(Tensor::cat(hs, 0)?),
                };
                if let (Some(k), Some(s)) = (self.kept_states.as_mut(), states.as_ref()) {
                    // Rows taken from a prefix were pushed by `resume_from`; the rest are new.
                    let from: usize = k.iter().map(|t| t.dim(0)).sum::<candle_core::Result<usize>>()?;
                    k.push(s.narrow(0, from, s.dim(0)? - from)?);
                }
                let logits = logits.ok_or_else(|| Error::InvalidArgument("the prompt's last row needs its logits".into()))?;
                let row = row_to_vec(&logits, logits.dim(0)? - 1)?;
                let first = self.opts.params.choose(&row, &self.history, &mut self.rng);
                if let Some(top) = self.logprobs {
                    self.token_logprobs.push(token_logprobs(&row, first, top));
                }
                self.started = Instant::now();
                let done = self.emit(first, false, on_token)?;
                self.phase = match (done, self.drafter, states) {
                    (true, _, _) => Phase::Done,
                    (false, Some(d), Some(states)) => Phase::Decode(Some(d.start_after(model, &states, &self.history[..self.prompt_len], first, self.resume_draft.take().as_ref())?)),
                    (false, _, _) => Phase::Decode(None),
                };
            }
            (Work::Tree { draft, .. }, Phase::Decode(_)) => {
                let t_verify = Instant::now();
                self.stats.time.forward += forward_ms / 1e3;
                let logits = logits.ok_or_else(|| Error::InvalidArgument("a tree needs its logits".into()))?;
                if let Some(live) = self.live.as_mut() {
                    live.observe(rows, forward_ms);
                }
                let (tree, tokens, drafted_nodes) = (&draft.tree, &draft.tokens, draft.drafted_nodes);
                self.stats.lookup_nodes += tree.len() - drafted_nodes;
                let (history, params, rule, rng) = (&self.history, &self.opts.params, self.opts.rule, &mut self.rng);
                // Log-probabilities from the rows the walk just read (a GPU's rows are copied once):
                // token i was chosen at accepted node i.
                let top = self.logprobs;
                let (verdict, lps) = with_rows(&logits, |row| {
                    let v = verify(tree, tokens, history, params, rule, rng, row)?;
                    let lps = match top {
                        Some(top) => v.accepted.iter().zip(&v.emitted).map(|(&a, &t)| Ok(token_logprobs(row(a)?, t, top))).collect::<Result<Vec<_>>>()?,
                        None => Vec::new(),
                    };
                    Ok((v, lps))
                })?;
                let mut lps = lps.into_iter();
                let t_commit = Instant::now();
                let committed = self.cache.len() - tree.len();
                let slots: Vec<usize> = verdict.accepted.iter().map(|&a| committed + a).collect();
                self.cache.compact(committed, &slots)?;
                if let Some(k) = self.kept_states.as_mut() {
                    let idx: Vec<u32> = verdict.accepted.iter().map(|&a| a as u32).collect();
                    k.push(hidden.index_select(&Tensor::new(idx.as_slice(), hidden.device())?, 0)?);
                }
                let s = &mut self.stats;
                s.gen.target_forwards += 1;
                s.tree_nodes_total += tree.len();
                let m = verdict.accepted.len() - 1;
                if s.accept_hist.len() <= m {
                    s.accept_hist.resize(m + 1, 0);
                }
                s.accept_hist[m] += 1;
                s.lookup_accepted += verdict.accepted.iter().filter(|&&a| a >= drafted_nodes).count();
                if self.live.is_some() {
                    self.calib.learn(&draft, &verdict.accepted);
                }
                if let TreeChoice::Static(_) = &self.choice {
                    for (i, n) in tree.nodes().iter().enumerate().take(drafted_nodes).skip(1) {
                        if verdict.accepted.contains(&n.parent.expect("non-root")) {
                            s.node_tries_hits[i].0 += 1;
                            if verdict.accepted.contains(&i) {
                                s.node_tries_hits[i].1 += 1;
                            }
                        }
                    }
                }
                let mut done = false;
                for (i, &tok) in verdict.emitted.iter().enumerate() {
                    self.token_logprobs.extend(lps.next());
                    done = self.emit(tok, i + 1 < verdict.emitted.len(), on_token)?;
                    if done {
                        break;
                    }
                }
                match (&mut self.phase, done) {
                    (Phase::Decode(Some(state)), false) if self.skipping => {
                        if self.lag.len() == LAG_KEEP {
                            self.draft_aligned.get_or_insert(state.pairs());
                            self.lag.remove(0);
                        }
                        self.lag.push((hidden.narrow(0, 0, 1)?.copy()?, verdict.emitted[0]));
                    }
                    (Phase::Decode(Some(state)), false) => state.commit(model, &hidden, &verdict.accepted, &verdict.emitted)?,
                    (_, true) => self.end(),
                    _ => {}
                }
                self.stats.time.verify += (t_commit - t_verify).as_secs_f64();
                self.stats.time.commit += t_commit.elapsed().as_secs_f64();
            }
            (_, Phase::Done) => {}
            _ => return Err(Error::InvalidArgument("work handed back to a sequence in another phase".into())),
        }
        self.stats.gen.decode_secs = self.started.elapsed().as_secs_f64();
        Ok(self.out.len() - before)
    }

    fn emit(&mut self, tok: u32, drafted: bool, on_token: &mut dyn FnMut(u32, bool) -> Result<Flow>) -> Result<bool> {
        self.out.push(tok);
        self.history.push(tok);
        self.stats.drafted.push(drafted);
        let flow = on_token(tok, drafted)?;
        Ok(flow == Flow::Stop || self.opts.stop.eos_ids.contains(&tok) || self.out.len() >= self.budget)
    }

    /// The tokens, the run's statistics (drafting accuracy scored against what the target
    /// emitted) and the random generator (handed back to a caller that lent it).
    pub fn finish(mut self) -> (Vec<u32>, SpecStats, Rng64) {
        self.score_drafts();
        (self.out, self.stats, self.rng)
    }

    /// [`Self::finish`], also handing back the committed tokens (prompt and answer: every
    /// token whose K/V the cache holds, which is all but the last emitted one, or all of them
    /// when the last step stopped partway through its accepted tokens) with their KV cache and,
    /// when [`Self::keeping_prefix`] kept them, the target's states and the draft layer's pairs:
    /// for a later prompt that starts the same way. `None` when nothing was committed, a
    /// drafter's states were not kept (or fell short, as when the prompt was cut off midway), or
    /// the copy failed: the answer stands either way.
    pub fn finish_keeping_prefix(mut self) -> (Vec<u32>, SpecStats, Rng64, Option<Prefix>) {
        self.score_drafts();
        self.end();
        let prefix = kept_prefix(self.drafter.is_some(), &self.history, self.cache, self.kept_states.take(), self.kept_draft.take()).ok().flatten();
        (self.out, self.stats, self.rng, prefix)
    }

    /// Drafting accuracy per level, scored against what the target emitted.
    fn score_drafts(&mut self) {
        let levels = self.drafts.iter().map(|d| d.1.len()).max().unwrap_or(0);
        self.stats.head_acc = vec![(0, 0, 0); levels];
        for (root_idx, per_level) in &self.drafts {
            for (k, cands) in per_level.iter().enumerate() {
                if let Some(&truth) = self.out.get(root_idx + 1 + k) {
                    let a = &mut self.stats.head_acc[k];
                    a.0 += 1;
                    a.1 += (cands.first() == Some(&truth)) as usize;
                    a.2 += cands.contains(&truth) as usize;
                }
            }
        }
        self.stats.gen.prompt_tokens = self.prompt_len;
        self.stats.gen.new_tokens = self.out.len();
    }
}

/// The prefix a finished sequence leaves: its committed tokens (`history`'s first
/// `cache.len()`, fewer when the history is shorter) with their K/V, and for a drafter the
/// target's states (at least one row per token, else nothing is kept) and the draft layer's
/// pairs.
fn kept_prefix(drafting: bool, history: &[u32], mut cache: KvCache, states: Option<Vec<Tensor>>, draft: Option<KvCache>) -> Result<Option<Prefix>> {
    // A step that stopped partway through its emitted tokens committed the K/V of accepted
    // tokens past the last one emitted: keep only those of emitted ones.
    let n = cache.len().min(history.len());
    if n == 0 {
        return Ok(None);
    }
    cache.truncate(n);
    let states = match (drafting, states) {
        (false, _) => None,
        (true, Some(rows)) if !rows.is_empty() => {
            let all = Tensor::cat(&rows, 0)?;
            if all.dim(0)? < n {
                return Ok(None);
            }
            Some(all.narrow(0, 0, n)?.copy()?)
        }
        _ => return Ok(None),
    };
    // Grown by doubling, a cache may hold up to twice the slots it uses: kept so, it would
    // count double against the prompt cache's budget, so a roomy one is copied down to size.
    let tight = |mut c: KvCache, n: usize| -> Result<KvCache> {
        c.truncate(n);
        let n = c.len();
        let enough = n.max(256) * c.bytes_per_token();
        if c.bytes() > enough + enough / 4 {
            c.prefix_copy(n)
        } else {
            Ok(c)
        }
    };
    let draft = draft.map(|d| tight(d, n)).transpose()?;
    Ok(Some(Prefix::new(history[..n].to_vec(), tight(cache, n)?, states, draft)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::draft::budget::CostCurve;

    #[test]
    fn outside_forward_is_the_share_beside_the_tree_forward() {
        let t = StepTimes { draft: 0.3, forward: 5.0, verify: 0.05, commit: 0.15 };
        assert!((t.outside_forward() - 0.5 / 5.5).abs() < 1e-12);
        assert_eq!(StepTimes::default().outside_forward(), 0.0);
    }

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
