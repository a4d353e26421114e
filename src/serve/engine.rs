//! The scheduler: one thread owns the decoding. Every step is one target forward over every
//! active sequence's work (a drafted tree, or a chunk of a new prompt), each sequence with its
//! own KV cache and positions; each sequence then verifies its own rows and emits 1 to τ
//! tokens (ragged acceptance). Requests come in through a bounded queue and leave as events on
//! their own channel, so a slow or vanished client never holds the loop up.
//!
//! Why a request's tokens do not depend on what else is served: every decision in a step is the
//! sequence's own ([`Sequence`]), the forward's rows do not depend on one another (the kernels
//! are batch-invariant), and sampling's draws are plain decoding's whatever the tree
//! ([`crate::spec::verify`]). Trees are cut for the whole batch by the cost curve
//! ([`choose_nodes_batch`]): as load grows, the roots alone climb the curve and extra rows stop
//! paying, so trees shrink and then vanish.
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Tensor;
use tokio::sync::mpsc::UnboundedSender;

use crate::decode::generate::{Flow, StopMatch, StopRule, TextStream};
use crate::decode::sampling::{rng, SamplingParams, TokenLogprobs};
use crate::draft::budget::{choose_nodes_batch, CostCurve, LiveCosts};
use crate::draft::choice::TreeChoice;
use crate::draft::datastore::Datastore;
use crate::draft::drafter::Drafter;
use crate::draft::lookup::Lookup;
use crate::model::loader::Target;
use crate::model::tokenizer::Tokenizer;
use crate::model::BatchEntry;
use crate::spec::prefix::PrefixCache;
use crate::spec::session::{Sequence, SpecOptions, Work};
use crate::spec::verify::Rule;
use crate::{Error, Result};

/// Prompt tokens run per step, over all prefilling sequences: a long prompt is read in pieces
/// between decode steps instead of stalling every other sequence for its whole length.
pub const PREFILL_TOKENS_PER_STEP: usize = 128;

/// One request, tokenized and checked.
pub struct Job {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub max_tokens: usize,
    pub seed: u64,
    /// Strings that end the answer (not included in it).
    pub stop: Vec<String>,
    /// Decode past the end-of-sequence token, to `max_tokens` (vLLM's `ignore_eos`, for
    /// benchmarks of a fixed length).
    pub ignore_eos: bool,
    /// Each answer token's log-probability with this many alternatives (`None`: not asked).
    pub logprobs: Option<usize>,
    /// Send this text back first (completions' `echo`: the prompt), with the prompt tokens'
    /// log-probabilities when `logprobs` asks for them.
    pub echo: Option<String>,
    /// Start from a kept prompt's cache where one matches, and keep this one's afterwards
    /// (llama.cpp's `cache_prompt`).
    pub cache_prompt: bool,
    pub events: UnboundedSender<Event>,
}

impl Job {
    /// Whether this request uses and feeds the prompt cache: asked to (`cache_prompt`), and
    /// not scoring its prompt (echo with log-probabilities runs every prompt row).
    fn caches(&self) -> bool {
        self.cache_prompt && !(self.logprobs.is_some() && self.echo.is_some())
    }
}

/// One answer token's log-probability as an API lists it (the target's raw distribution, see
/// [`crate::decode::sampling::token_logprobs`]): the token's text and bytes, and its likeliest
/// alternatives likewise, best first.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: String,
    pub bytes: Vec<u8>,
    /// `None` for an echoed prompt's first token, which nothing predicts.
    pub logprob: Option<f32>,
    pub top: Vec<(String, Vec<u8>, f32)>,
}

impl TokenLogprob {
    fn describe(tok: &Tokenizer, lp: &TokenLogprobs) -> Self {
        let (token, bytes) = piece(tok, lp.token);
        let top = lp.top.iter().map(|&(id, x)| {
            let (t, b) = piece(tok, id);
            (t, b, x)
        });
        TokenLogprob { token, bytes, logprob: Some(lp.logprob), top: top.collect() }
    }

    /// The echoed prompt's tokens: each with its log-probability where one was recorded.
    fn prompt(tok: &Tokenizer, prompt: &[u32], lps: Option<&[Option<TokenLogprobs>]>) -> Vec<Self> {
        let Some(lps) = lps else { return Vec::new() };
        let entry = |(i, &id): (usize, &u32)| match lps.get(i).and_then(Option::as_ref) {
            Some(lp) => Self::describe(tok, lp),
            None => {
                let (token, bytes) = piece(tok, id);
                TokenLogprob { token, bytes, logprob: None, top: Vec::new() }
            }
        };
        prompt.iter().enumerate().map(entry).collect()
    }
}

/// A token's text and bytes; an id the model scores but the tokenizer lacks (a checkpoint's
/// vocabulary padding) as `token_id:N` without bytes, as vLLM shows it, rather than failing
/// the request.
fn piece(tok: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    tok.token_bytes(id).unwrap_or_else(|_| (format!("token_id:{id}"), Vec::new()))
}

/// What a request hears back.
#[derive(Debug, Clone)]
pub enum Event {
    /// New answer text. `drafted` per token: whether the drafter proposed it and the target
    /// accepted it (false for the target's own tokens).
    /// `logprobs`: per token, when the request asked for them.
    Text { text: String, tokens: Vec<(u32, bool)>, logprobs: Vec<TokenLogprob> },
    Done(Summary),
    Failed(String),
}

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Summary {
    /// "stop" (end of sequence or a stop string) or "length".
    pub finish_reason: &'static str,
    pub prompt_tokens: usize,
    /// Prompt tokens taken from the prompt cache rather than run.
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    /// Target forwards this request took part in after its prompt.
    pub target_forwards: usize,
    /// Tokens emitted per target forward, the bonus token counted (plain decoding = 1.0).
    pub tau: f64,
    /// Emitted tokens that were drafted and accepted.
    pub accepted_draft_tokens: usize,
    pub seed: u64,
}

/// Counters for `/metrics`.
#[derive(Default)]
pub struct Metrics {
    pub requests: AtomicU64,
    pub requests_failed: AtomicU64,
    pub requests_rejected: AtomicU64,
    pub requests_cancelled: AtomicU64,
    /// Requests that ran out of tokens (max_tokens or the context) rather than stopping.
    pub requests_length: AtomicU64,
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens taken from the prompt cache, and the requests that found one there.
    pub cached_prompt_tokens: AtomicU64,
    pub prompt_cache_hits: AtomicU64,
    /// Bytes the prompt cache holds (KV caches and the drafter's states).
    pub prompt_cache_bytes: AtomicUsize,
    pub completion_tokens: AtomicU64,
    pub accepted_draft_tokens: AtomicU64,
    /// Sequence-steps: one per sequence per decode forward (τ = completion tokens / this).
    pub sequence_steps: AtomicU64,
    /// Tokens emitted by those steps (τ = this / sequence_steps; a request's first token comes
    /// from its prompt's forward).
    pub decode_tokens: AtomicU64,
    pub forwards: AtomicU64,
    pub forward_rows: AtomicU64,
    pub busy_micros: AtomicU64,
    pub queue_depth: AtomicUsize,
    pub batch_size: AtomicUsize,
    pub last_tok_s_milli: AtomicU64,
}

/// How the engine decodes.
pub struct EngineConfig {
    /// The tree every request drafts (already resolved against the drafter, with its cost curve
    /// measured for `auto`).
    pub tree: TreeChoice,
    pub lookup: Option<Lookup>,
    /// Sequences decoded side by side at most; more wait in the queue.
    pub max_batch: usize,
    /// Requests waiting at most; past it new ones are refused (503).
    pub queue: usize,
    /// The cost of a forward by rows, for cutting a batch's trees.
    pub costs: Option<CostCurve>,
    /// Draft at every batch size rather than where [`DraftPolicy`] measured it paying.
    pub always_draft: bool,
    /// Bytes of finished sequences' caches kept for prompts that start the same way
    /// ([`PrefixCache`]; 0: none kept).
    pub prompt_cache: usize,
}

/// The handle request handlers submit to.
#[derive(Clone)]
pub struct EngineHandle {
    tx: SyncSender<Job>,
    /// The queue's size (`--queue`): jobs waiting at most.
    capacity: usize,
    pub metrics: Arc<Metrics>,
    running: Arc<std::sync::atomic::AtomicBool>,
}

/// Marks the engine stopped when its thread ends, however it ends.
struct Running(Arc<std::sync::atomic::AtomicBool>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

/// Why a job was not queued.
pub enum Refused {
    Full,
    Stopped,
}

impl EngineHandle {
    /// Whether the engine thread is still decoding (what `/health` reports).
    pub fn is_running(&self) -> bool {
        self.running.load(Ordering::SeqCst)
    }

    /// Queue a request's jobs (its choices) all or none: their places are reserved together
    /// first, so a request never leaves some of its choices queued after being refused.
    pub fn submit_all(&self, jobs: Vec<Job>) -> std::result::Result<(), Refused> {
        let n = jobs.len();
        let depth = &self.metrics.queue_depth;
        if depth.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |d| (d + n <= self.capacity).then_some(d + n)).is_err() {
            self.metrics.requests_rejected.fetch_add(1, Ordering::Relaxed);
            return Err(Refused::Full);
        }
        for (i, job) in jobs.into_iter().enumerate() {
            if let Err(e) = self.tx.try_send(job) {
                // Only a stopped engine (or a place taken by a submitter that did not reserve).
                depth.fetch_sub(n - i, Ordering::SeqCst);
                self.metrics.requests_rejected.fetch_add(1, Ordering::Relaxed);
                return Err(match e {
                    TrySendError::Full(_) => Refused::Full,
                    TrySendError::Disconnected(_) => Refused::Stopped,
                });
            }
        }
        Ok(())
    }
}

/// Start the engine thread. It runs until every [`EngineHandle`] is dropped and the sequences in
/// flight have finished.
pub fn start(target: Arc<Target>, drafter: Option<Arc<Drafter>>, datastore: Option<Arc<Datastore>>, cfg: EngineConfig) -> Result<(EngineHandle, std::thread::JoinHandle<()>)> {
    if cfg.max_batch == 0 || cfg.queue == 0 {
        return Err(Error::InvalidArgument("--max-batch and --queue must be at least 1".into()));
    }
    let cfg_queue = cfg.queue;
    let (tx, rx) = std::sync::mpsc::sync_channel::<Job>(cfg.queue);
    let metrics = Arc::new(Metrics::default());
    let m = metrics.clone();
    let running = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let guard = Running(running.clone());
    let thread = std::thread::Builder::new()
        .name("selfspec-engine".into())
        .spawn(move || {
            let _guard = guard;
            run(&target, drafter.as_deref(), datastore.as_deref(), &cfg, rx, &m)
        })
        .map_err(|e| Error::InvalidArgument(format!("cannot start the engine thread: {e}")))?;
    Ok((EngineHandle { tx, capacity: cfg_queue, metrics, running }, thread))
}

/// A sequence in flight and what its request needs besides.
struct Active<'d> {
    seq: Sequence<'d>,
    job: Job,
    tok: &'d Tokenizer,
    text: TextStream<'d>,
    stop: StopMatch,
    /// Tokens of `seq.output()` handled so far: sent, or dropped after a stop string.
    sent_tokens: usize,
    /// Tokens that are part of the answer: up to and including the one that completed a stop
    /// string (what `usage` counts; tokens emitted after it in the same step are not).
    answer_tokens: usize,
    /// Whether the text stream's held-back bytes were sent (once, at the end).
    flushed: bool,
    /// Whether the prompt was sent back (`echo`), once the prompt has been read.
    echoed: bool,
    /// The sequence hit an error of its own and was told so; it leaves at the next retirement.
    failed: bool,
}

impl Active<'_> {
    /// End this sequence alone with an error (the others in the batch go on).
    fn fail(&mut self, e: impl std::fmt::Display) {
        if !self.failed {
            let _ = self.job.events.send(Event::Failed(format!("decoding failed: {e}")));
        }
        self.failed = true;
        self.seq.stop();
    }
}

fn run(target: &Target, drafter: Option<&Drafter>, datastore: Option<&Datastore>, cfg: &EngineConfig, rx: Receiver<Job>, m: &Metrics) {
    let model = &target.model;
    let mut active: Vec<Active> = Vec::new();
    let mut open = true;
    let mut batch_costs = cfg.costs.as_ref().map(LiveCosts::new);
    let mut policy = DraftPolicy::new(cfg.max_batch);
    let mut step_no = 0u64;
    let mut prefixes = PrefixCache::new(cfg.prompt_cache);
    while open || !active.is_empty() {
        // Admit: wait when idle, else take what is queued without waiting.
        while open && active.len() < cfg.max_batch {
            let job = if active.is_empty() {
                match rx.recv_timeout(Duration::from_millis(200)) {
                    Ok(j) => j,
                    Err(RecvTimeoutError::Timeout) => break,
                    Err(RecvTimeoutError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            } else {
                match rx.try_recv() {
                    Ok(j) => j,
                    Err(std::sync::mpsc::TryRecvError::Empty) => break,
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            };
            m.queue_depth.fetch_sub(1, Ordering::SeqCst);
            if job.events.is_closed() {
                // Its client left while it waited: nothing to decode.
                m.requests_cancelled.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            m.requests.fetch_add(1, Ordering::Relaxed);
            m.prompt_tokens.fetch_add(job.prompt.len() as u64, Ordering::Relaxed);
            let rule = Rule::for_params(&job.params, false);
            let opts = SpecOptions {
                tree: cfg.tree.clone(),
                lookup: cfg.lookup,
                datastore,
                rule,
                params: job.params.clone(),
                stop: StopRule { max_new_tokens: job.max_tokens, eos_ids: if job.ignore_eos { &[] } else { &target.tokenizer.eos_ids } },
            };
            let scoring = job.logprobs.is_some() && job.echo.is_some();
            let caching = cfg.prompt_cache > 0 && job.caches();
            let fresh = || -> Result<Sequence> {
                let seq = Sequence::new(model, drafter, &job.prompt, opts.clone(), rng(job.seed))?;
                let seq = match (job.logprobs, scoring) {
                    (Some(top), true) => seq.with_logprobs(top).with_prompt_logprobs(top),
                    (Some(top), false) => seq.with_logprobs(top),
                    (None, _) => seq,
                };
                Ok(if caching { seq.keeping_prefix() } else { seq })
            };
            let start = || {
                let seq = fresh()?;
                let Some((p, n)) = caching.then(|| prefixes.lookup(&job.prompt)).flatten() else { return Ok(seq) };
                match seq.resume_from(p, n) {
                    Ok(seq) => {
                        m.prompt_cache_hits.fetch_add(1, Ordering::Relaxed);
                        m.cached_prompt_tokens.fetch_add(n as u64, Ordering::Relaxed);
                        Ok(seq)
                    }
                    // The cache is an optimisation: a copy that failed leaves the request to
                    // run its whole prompt.
                    Err(_) => fresh(),
                }
            };
            match catching(start) {
                Ok(seq) => {
                    let stop = StopMatch::new(job.stop.clone());
                    let echoed = job.echo.is_none();
                    active.push(Active { seq, job, tok: &target.tokenizer, text: TextStream::new(&target.tokenizer), stop, sent_tokens: 0, answer_tokens: 0, flushed: false, echoed, failed: false });
                }
                Err(e) => {
                    m.requests_failed.fetch_add(1, Ordering::Relaxed);
                    let _ = job.events.send(Event::Failed(e.to_string()));
                }
            }
        }
        m.batch_size.store(active.len(), Ordering::Relaxed);
        if active.is_empty() {
            continue;
        }
        step_no += 1;
        // A sequence's own error ends that sequence alone (inside `step`); an error or a panic
        // in what they share (the forward) leaves every cache in an unknown state: end all of
        // them, loudly, and go on serving.
        if let Err(e) = catching(|| step(model, &mut active, &mut batch_costs, &mut policy, cfg.always_draft, step_no, m)) {
            for mut a in active.drain(..) {
                m.requests_failed.fetch_add(1, Ordering::Relaxed);
                a.fail(&e);
            }
            continue;
        }
        // Retire finished, failed and abandoned sequences (dropping one frees its KV cache).
        let mut i = 0;
        while i < active.len() {
            let a = &active[i];
            if a.failed {
                m.requests_failed.fetch_add(1, Ordering::Relaxed);
                active.swap_remove(i);
            } else if a.job.events.is_closed() {
                // The client left (a chat's stop button): what was computed still serves the
                // next turn.
                m.requests_cancelled.fetch_add(1, Ordering::Relaxed);
                let a = active.swap_remove(i);
                if a.job.caches() && prefixes.budget() > 0 {
                    if let (_, _, _, Some(p)) = a.seq.finish_keeping_prefix() {
                        prefixes.insert(p);
                    }
                }
            } else if a.seq.is_done() {
                let mut a = active.swap_remove(i);
                deliver(&mut a, m);
                finish(a, m, &mut prefixes);
            } else {
                i += 1;
            }
        }
        m.prompt_cache_bytes.store(prefixes.bytes(), Ordering::Relaxed);
    }
}

/// One forward over every active sequence.
fn step(model: &crate::model::Llama, active: &mut [Active], batch_costs: &mut Option<LiveCosts>, policy: &mut DraftPolicy, always_draft: bool, step_no: u64, m: &Metrics) -> Result<()> {
    let t0 = Instant::now();
    let decoding = active.iter().filter(|a| a.seq.is_decoding()).count();
    let prefilling = active.len() - decoding;
    let draft = always_draft || policy.choose(decoding, step_no);
    let mut prefill_left = PREFILL_TOKENS_PER_STEP;
    let mut works: Vec<Option<Work>> = Vec::with_capacity(active.len());
    for a in active.iter_mut() {
        let w = if a.seq.is_decoding() {
            a.seq.next_work(model, 0, draft)
        } else if prefill_left > 0 {
            a.seq.next_work(model, prefill_left, draft).inspect(|w| prefill_left -= w.as_ref().map_or(0, |w| w.tokens().len()))
        } else {
            Ok(None)
        };
        works.push(w.unwrap_or_else(|e| {
            a.fail(e);
            None
        }));
    }
    // Cut the trees: alone, as generate cuts (by the sequence's own costs); together, by the
    // batch's cost curve.
    let trees: Vec<usize> = (0..active.len()).filter(|&i| matches!(works[i], Some(Work::Tree { .. })) && active[i].seq.is_auto()).collect();
    if decoding == 1 || batch_costs.is_none() {
        for &i in &trees {
            let w = works[i].take().expect("a tree");
            works[i] = active[i].seq.cut(w).map_err(|e| active[i].fail(e)).ok();
        }
    } else if !trees.is_empty() {
        let costs = batch_costs.as_ref().expect("checked").curve();
        let fixed_ms: f64 = trees.iter().map(|&i| {
            let s = active[i].seq.stats();
            s.time.draft * 1e3 / s.gen.target_forwards.max(1) as f64
        }).sum();
        let prefill_rows: usize = works.iter().flatten().filter(|w| matches!(w, Work::Prefill { .. })).map(|w| w.tokens().len()).sum();
        let plain_roots = works.iter().flatten().filter(|w| matches!(w, Work::Tree { .. })).count() - trees.len();
        let ests: Vec<(crate::draft::tree::Tree, Vec<f64>)> = trees.iter().map(|&i| match &works[i] {
            Some(Work::Tree { draft, .. }) => (draft.tree.clone(), active[i].seq.estimates(draft)),
            _ => unreachable!("filtered to trees"),
        }).collect();
        let refs: Vec<(&crate::draft::tree::Tree, Vec<f64>)> = ests.iter().map(|(t, e)| (t, e.clone())).collect();
        // Rows that run anyway (prompt chunks, plain roots) shift where the trees' rows start.
        let shifted = shift_costs(&costs, prefill_rows + plain_roots);
        let keep = choose_nodes_batch(&refs, &shifted, fixed_ms);
        for (k, &i) in trees.iter().enumerate() {
            let w = works[i].take().expect("a tree");
            works[i] = active[i].seq.restrict(w, &keep[k]).map_err(|e| active[i].fail(e)).ok();
        }
    }
    // One forward over everything.
    let idx: Vec<usize> = (0..active.len()).filter(|&i| works[i].is_some()).collect();
    if idx.is_empty() {
        return Ok(());
    }
    let prompt_done: Vec<bool> = idx.iter().map(|&i| works[i].as_ref().is_some_and(|w| w.tokens().len() >= active[i].seq.prompt_left())).collect();
    let rows: usize = idx.iter().map(|&i| works[i].as_ref().map_or(0, |w| w.tokens().len())).sum();
    let t_fwd = Instant::now();
    let hidden = {
        let mut entries: Vec<BatchEntry> = Vec::with_capacity(idx.len());
        let mut it = active.iter_mut().zip(works.iter()).filter_map(|(a, w)| w.as_ref().map(|w| (a, w)));
        for (a, w) in it.by_ref() {
            entries.push(BatchEntry { tokens: w.tokens(), positions: w.positions(), mask: w.mask(), cache: a.seq.cache_mut() });
        }
        model.forward_batch(&mut entries)?
    };
    // Logits of the rows that need them, in one lm_head call.
    let mut offsets = Vec::with_capacity(idx.len());
    let mut logit_idx: Vec<u32> = Vec::new();
    let mut off = 0;
    for (k, &i) in idx.iter().enumerate() {
        let w = works[i].as_ref().expect("some");
        let r = w.logit_rows(prompt_done[k]);
        offsets.push((off, logit_idx.len(), r.len()));
        logit_idx.extend(r.map(|j| (off + j) as u32));
        off += w.tokens().len();
    }
    let logits = if logit_idx.is_empty() {
        None
    } else {
        let sel = hidden.index_select(&Tensor::new(logit_idx.as_slice(), hidden.device())?, 0)?;
        Some(model.logits(&sel)?)
    };
    let ms = t_fwd.elapsed().as_secs_f64() * 1e3;
    if let Some(c) = batch_costs.as_mut() {
        c.observe(rows, ms);
    }
    m.forwards.fetch_add(1, Ordering::Relaxed);
    m.forward_rows.fetch_add(rows as u64, Ordering::Relaxed);
    let mut emitted_total = 0;
    let mut decode_emitted = 0;
    for (k, &i) in idx.iter().enumerate() {
        let w = works[i].take().expect("some");
        let (o, lo, ln) = offsets[k];
        let h = hidden.narrow(0, o, w.tokens().len())?;
        let l = match &logits {
            Some(l) if ln > 0 => Some(l.narrow(0, lo, ln)?),
            _ => None,
        };
        let a = &mut active[i];
        let was_decoding = a.seq.is_decoding();
        let n = match a.seq.finish_work(model, w, h, l, rows, ms, &mut |_, _| Ok(Flow::Continue)) {
            Ok(n) => n,
            Err(e) => {
                a.fail(e);
                continue;
            }
        };
        if was_decoding {
            m.sequence_steps.fetch_add(1, Ordering::Relaxed);
            m.decode_tokens.fetch_add(n as u64, Ordering::Relaxed);
            decode_emitted += n;
        }
        emitted_total += n;
        deliver(a, m);
    }
    let secs = t0.elapsed().as_secs_f64();
    if prefilling == 0 {
        policy.record(decoding, draft, decode_emitted, secs);
    }
    m.busy_micros.fetch_add((secs * 1e6) as u64, Ordering::Relaxed);
    if emitted_total > 0 {
        m.last_tok_s_milli.store((emitted_total as f64 / secs * 1e3) as u64, Ordering::Relaxed);
    }
    Ok(())
}

/// Whether drafting pays at each number of decoding sequences, learned from this run's own
/// steps: the tokens per second of steps that drafted and of steps that did not, each a moving
/// average of tokens over a moving average of seconds. (An average of each step's own tok/s
/// would favour drafting: its steps vary more in length, and the mean of 1/t grows with t's
/// spread.) The choice that is behind is retried one step in 16, so a change of load is
/// noticed; each retry that leaves it behind doubles that period (to one in 1024), and a
/// change of winner resets it. A retry costs its gap, so a loser confirmed again and again is
/// retried less and less: with a fixed one in 16, the drafter server ran 2-5% behind plain at
/// 4 and 8 concurrent requests, where drafting stops paying on a 2-core CPU.
/// The batch cut prices a tree's rows but not the drafting and drafter bookkeeping each
/// sequence does on its own; measuring whole steps does. Alone, a sequence always drafts, as
/// `generate` does.
pub struct DraftPolicy {
    /// (tokens, seconds) per step, moving averages.
    on: Vec<Option<(f64, f64)>>,
    off: Vec<Option<(f64, f64)>>,
    period: Vec<u64>,
}

const RETRY_FIRST: u64 = 16;
const RETRY_LAST: u64 = 1024;

impl DraftPolicy {
    pub fn new(max_batch: usize) -> Self {
        DraftPolicy { on: vec![None; max_batch + 1], off: vec![None; max_batch + 1], period: vec![RETRY_FIRST; max_batch + 1] }
    }

    /// Whether drafting wins at this batch size (None until both have been measured).
    fn winner(&self, decoding: usize) -> Option<bool> {
        match (self.on[decoding], self.off[decoding]) {
            (Some(on), Some(off)) => Some(on.0 * off.1 >= off.0 * on.1),
            _ => None,
        }
    }

    pub fn choose(&self, decoding: usize, step_no: u64) -> bool {
        if decoding <= 1 || decoding >= self.on.len() {
            return true;
        }
        match (self.on[decoding], self.winner(decoding)) {
            (None, _) => true,
            (_, None) => false,
            (_, Some(w)) => w != step_no.is_multiple_of(self.period[decoding]),
        }
    }

    /// One step at `decoding` sequences that emitted `tokens` in `secs`.
    pub fn record(&mut self, decoding: usize, drafted: bool, tokens: usize, secs: f64) {
        if decoding >= self.on.len() || !(secs.is_finite() && secs > 0.0) {
            return;
        }
        let before = self.winner(decoding);
        let slot = if drafted { &mut self.on[decoding] } else { &mut self.off[decoding] };
        let t = tokens as f64;
        *slot = Some(slot.map_or((t, secs), |(vt, vs)| (0.9 * vt + 0.1 * t, 0.9 * vs + 0.1 * secs)));
        match (before, self.winner(decoding)) {
            (Some(b), Some(a)) if a != b => self.period[decoding] = RETRY_FIRST,
            (Some(b), Some(_)) if b != drafted => self.period[decoding] = (self.period[decoding] * 2).min(RETRY_LAST),
            _ => {}
        }
    }
}

/// `f`, with a panic turned into an error naming it (the engine thread outlives a bug in one
/// step).
fn catching<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let what = p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_else(|| "a panic".into());
        Err(Error::InvalidArgument(format!("internal error: {what}")))
    })
}

/// The curve as seen by rows that start after `base` rows already in the forward.
fn shift_costs(c: &CostCurve, base: usize) -> CostCurve {
    if base == 0 {
        return c.clone();
    }
    let n = c.max_tokens();
    let pts: Vec<(usize, f64)> = (1..=n).map(|t| (t, c.at(t + base))).collect();
    CostCurve::from_points(&pts, n).unwrap_or_else(|_| c.clone())
}

/// Send a sequence's new tokens, one event per token (its text, holding back what might be
/// the start of a stop string and incomplete UTF-8), and end it when a stop string appears.
fn deliver(a: &mut Active, m: &Metrics) {
    // The prompt first, once it has been read (the first token follows its last row).
    if !a.echoed && !a.seq.output().is_empty() {
        a.echoed = true;
        let text = a.job.echo.clone().unwrap_or_default();
        let logprobs = TokenLogprob::prompt(a.tok, &a.job.prompt, a.seq.prompt_logprobs());
        let _ = a.job.events.send(Event::Text { text, tokens: Vec::new(), logprobs });
    }
    let out = a.seq.output().to_vec();
    let eos = a.seq.ended_on_eos() && a.seq.is_done();
    let last = a.seq.is_done() && !a.flushed;
    let new = a.sent_tokens..out.len();
    let had_new = !new.is_empty();
    a.sent_tokens = out.len();
    for j in new {
        let drafted = a.seq.stats().drafted.get(j).copied().unwrap_or(false);
        a.answer_tokens = j + 1;
        m.completion_tokens.fetch_add(1, Ordering::Relaxed);
        m.accepted_draft_tokens.fetch_add(drafted as u64, Ordering::Relaxed);
        // The end-of-sequence token is not part of the answer's text.
        let mut piece = if eos && j + 1 == out.len() {
            String::new()
        } else {
            match a.text.push(out[j]) {
                Ok(p) => p.unwrap_or_default(),
                Err(e) => {
                    a.fail(e);
                    return;
                }
            }
        };
        let end = last && j + 1 == out.len();
        if end {
            if let Ok(Some(s)) = a.text.finish() {
                piece.push_str(&s);
            }
        }
        // The end-of-sequence token keeps its entry (usage counts it) with the answer's text
        // for it: none.
        let logprobs = a.seq.logprobs().get(j).map(|lp| TokenLogprob::describe(a.tok, lp)).map(|mut e| {
            if eos && j + 1 == out.len() {
                (e.token, e.bytes) = (String::new(), Vec::new());
            }
            e
        });
        let logprobs: Vec<TokenLogprob> = logprobs.into_iter().collect();
        let (text, stopped) = a.stop.push(&piece, end);
        let _ = a.job.events.send(Event::Text { text, tokens: vec![(out[j], drafted)], logprobs });
        if stopped {
            a.seq.stop();
            break;
        }
    }
    if last {
        a.flushed = true;
        // Done without a new token (the context filled): send what was held back.
        if !had_new {
            let mut piece = a.text.finish().ok().flatten().unwrap_or_default();
            let (text, _) = a.stop.push(&std::mem::take(&mut piece), true);
            if !text.is_empty() {
                let _ = a.job.events.send(Event::Text { text, tokens: Vec::new(), logprobs: Vec::new() });
            }
        }
    }
}

fn finish(a: Active, m: &Metrics, prefixes: &mut PrefixCache) {
    let hit_stop = a.stop.hit;
    let eos = a.seq.ended_on_eos();
    let seed = a.job.seed;
    let events = a.job.events.clone();
    let kept = a.answer_tokens;
    let stats = if a.job.caches() && prefixes.budget() > 0 {
        let (_, stats, _, prefix) = a.seq.finish_keeping_prefix();
        if let Some(p) = prefix {
            prefixes.insert(p);
        }
        stats
    } else {
        a.seq.finish().1
    };
    // Tokens emitted in the same step after a stop string are not part of the answer.
    let accepted = stats.drafted[..kept.min(stats.drafted.len())].iter().filter(|&&d| d).count();
    let summary = Summary {
        finish_reason: if hit_stop || eos { "stop" } else { "length" },
        prompt_tokens: stats.gen.prompt_tokens,
        cached_tokens: stats.cached_prompt_tokens,
        completion_tokens: kept,
        target_forwards: stats.gen.target_forwards,
        tau: stats.tau(),
        accepted_draft_tokens: accepted,
        seed,
    };
    if summary.finish_reason == "length" {
        m.requests_length.fetch_add(1, Ordering::Relaxed);
    }
    let _ = events.send(Event::Done(summary));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafting_is_kept_where_it_measured_faster_and_the_loser_is_retried() {
        let mut p = DraftPolicy::new(8);
        assert!(p.choose(1, 1) && p.choose(4, 1), "alone always, and first tried with drafting");
        p.record(4, true, 4, 4.0 / 500.0);
        assert!(!p.choose(4, 1), "then without");
        p.record(4, false, 4, 4.0 / 700.0);
        assert!(!p.choose(4, 1) && p.choose(4, 16), "the faster choice; the other one step in 16");
        p.record(4, true, 4, 4.0 / 520.0);
        assert!(!p.choose(4, 16) && p.choose(4, 32), "the retry lost again: one step in 32");
        p.record(4, true, 4, 4.0 / 520.0);
        assert!(!p.choose(4, 32) && p.choose(4, 64), "and again: one in 64");
        for _ in 0..40 {
            p.record(4, true, 4, 4.0 / 900.0);
        }
        assert!(p.choose(4, 1) && !p.choose(4, 16), "the load changed: drafting is ahead again, the other retried one in 16");
        for _ in 0..20 {
            p.record(4, false, 4, 4.0 / 500.0);
        }
        assert!(p.choose(4, 1) && p.choose(4, 512) && !p.choose(4, 1024), "a loser confirmed 20 times: retried one step in 1024 only");
        assert!(p.choose(1, 1) && p.choose(2, 1), "other batch sizes learn on their own");
    }

    #[test]
    fn drafting_steps_of_uneven_length_are_judged_by_total_tokens_over_total_time() {
        // Drafting: 2 tokens in 0.5 ms, then 2 in 9.5 ms (400 tok/s over both); plain steps 2
        // in 1.9 ms (1053 tok/s). A moving average of each step's own tok/s (4000 and 211
        // alternating) sits near 2000 to 2200, so it would have kept drafting.
        let mut p = DraftPolicy::new(8);
        p.record(3, false, 2, 0.0019);
        for _ in 0..50 {
            p.record(3, true, 2, 0.0005);
            p.record(3, true, 2, 0.0095);
            p.record(3, false, 2, 0.0019);
        }
        assert_eq!(p.winner(3), Some(false));
    }

    #[test]
    fn shifted_costs_start_where_the_rows_already_in_the_forward_end() {
        let c = CostCurve::from_points(&[(1, 10.0), (4, 13.0), (8, 21.0)], 8).unwrap();
        let s = shift_costs(&c, 3);
        assert_eq!(s.at(1), c.at(4));
        assert_eq!(s.at(5), c.at(8));
        assert_eq!(shift_costs(&c, 0), c);
    }
}
