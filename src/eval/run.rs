//! Evaluation: acceptance length, acceptance by tree position, per-head accuracy and wall-clock
//! speed-up against plain decoding measured in the same run; and `tune`, which picks the tree
//! that maximises expected speed-up on this device from measured head accuracies and forward costs.
use std::collections::BTreeMap;

use serde::Serialize;

use crate::data::PromptItem;
use crate::decode::generate::{generate_plain, Flow, StopRule};
use crate::draft::drafter::Drafter;
use crate::model::loader::Target;
use crate::decode::sampling::{rng, SamplingParams};
use crate::draft::budget::{Budget, AFFORDABLE_COST};
use crate::draft::choice::TreeChoice;
use crate::spec::plan::Plan;
use crate::spec::{generate_spec, SpecOptions, SpecStats, StepTimes};
use crate::model::tokenizer::Message;
use crate::spec::verify::Rule;
use crate::Result;

/// One (prompt, turn) measured both ways.
#[derive(Debug, Clone, Serialize)]
pub struct TurnResult {
    pub prompt_id: String,
    pub category: String,
    pub turn: usize,
    pub new_tokens: usize,
    pub plain_tok_s: f64,
    /// Per tree (same order as the report's trees).
    pub spec: Vec<SpecStats>,
    pub identical: Vec<Option<bool>>,
}

/// Aggregates for one tree over a set of turns.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Summary {
    pub turns: usize,
    pub new_tokens: usize,
    pub target_forwards: usize,
    /// Tokens emitted per target forward, the bonus token counted (plain decoding = 1.0).
    pub tau: f64,
    pub spec_tok_s_median: f64,
    pub plain_tok_s_median: f64,
    /// Median over turns: the headline figure, which one unusually easy or hard turn cannot move.
    pub speedup: f64,
    /// All turns' tokens over all their decoding time, each way, and the ratio: the throughput a
    /// user running every prompt would see, as Spec-Bench reports it (long, easy turns weigh more).
    pub spec_tok_s_total: f64,
    pub plain_tok_s_total: f64,
    pub speedup_total: f64,
    pub accept_hist: Vec<usize>,
    /// Per static-tree node: accepted / tried.
    pub node_accept_rate: Vec<f64>,
    pub head_top1: Vec<f64>,
    pub head_top5: Vec<f64>,
    pub mean_tree_nodes: f64,
    /// Tokens per target forward that came from the context lookup's branch (included in τ).
    pub copied_per_forward: f64,
    /// Greedy only: every output identical to plain decoding.
    pub all_identical: Option<bool>,
    /// Where a step's time went, ms per target forward: drafting, the tree forward,
    /// verification, commit (KV compaction and the drafter's own update).
    pub step_ms: StepTimes,
    /// `auto` steps that verified a larger tree to price it, the start-up cost curve having
    /// overpriced the run's forwards (see [`crate::draft::budget::EXPLORE_EVERY`]).
    pub explored_steps: usize,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct EvalReport {
    pub model: String,
    /// The CPU weight format (`--weights`); speeds are only comparable within one format.
    pub weights: String,
    /// Where the forward ran: the device, and on the CPU its kernels' instruction-set paths
    /// (speeds are only comparable on one).
    pub device: String,
    /// The drafter directory evaluated.
    pub drafter_dir: String,
    /// "heads" or "draft layer".
    pub drafter: String,
    pub trees: Vec<String>,
    /// Tokens in the datastore the `+lookup` branches also copied from (0: none given).
    pub datastore_tokens: usize,
    pub temperature: f32,
    pub max_tokens: usize,
    pub overall: Vec<Summary>,
    pub per_category: BTreeMap<String, Vec<Summary>>,
    pub turns: Vec<TurnResult>,
    /// One generation with the first tree, accepted draft tokens marked.
    pub sample: String,
    pub sample_marked: String,
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { 0.5 * (v[n / 2 - 1] + v[n / 2]) }
}

pub fn summarise(turns: &[&TurnResult], tree: usize) -> Summary {
    let mut s = Summary { turns: turns.len(), ..Default::default() };
    let mut head: Vec<(usize, usize, usize)> = Vec::new();
    let mut nodes: Vec<(usize, usize)> = Vec::new();
    let mut nodes_total = 0;
    let mut copied = 0;
    let mut identical = None;
    for t in turns {
        let st = &t.spec[tree];
        s.new_tokens += st.gen.new_tokens.saturating_sub(1);
        s.target_forwards += st.gen.target_forwards;
        s.step_ms.draft += st.time.draft;
        s.step_ms.forward += st.time.forward;
        s.step_ms.verify += st.time.verify;
        s.step_ms.commit += st.time.commit;
        nodes_total += st.tree_nodes_total;
        copied += st.lookup_accepted;
        s.explored_steps += st.explored;
        if s.accept_hist.len() < st.accept_hist.len() {
            s.accept_hist.resize(st.accept_hist.len(), 0);
        }
        for (i, c) in st.accept_hist.iter().enumerate() {
            s.accept_hist[i] += c;
        }
        if head.len() < st.head_acc.len() {
            head.resize(st.head_acc.len(), (0, 0, 0));
        }
        for (i, a) in st.head_acc.iter().enumerate() {
            head[i].0 += a.0;
            head[i].1 += a.1;
            head[i].2 += a.2;
        }
        if nodes.len() < st.node_tries_hits.len() {
            nodes.resize(st.node_tries_hits.len(), (0, 0));
        }
        for (i, a) in st.node_tries_hits.iter().enumerate() {
            nodes[i].0 += a.0;
            nodes[i].1 += a.1;
        }
        if let Some(same) = t.identical[tree] {
            identical = Some(identical.unwrap_or(true) && same);
        }
    }
    s.tau = s.new_tokens as f64 / s.target_forwards.max(1) as f64;
    let per_step = 1e3 / s.target_forwards.max(1) as f64;
    for t in [&mut s.step_ms.draft, &mut s.step_ms.forward, &mut s.step_ms.verify, &mut s.step_ms.commit] {
        *t *= per_step;
    }
    s.spec_tok_s_median = median(turns.iter().map(|t| t.spec[tree].gen.decode_tok_s()).collect());
    s.plain_tok_s_median = median(turns.iter().map(|t| t.plain_tok_s).collect());
    s.speedup = s.spec_tok_s_median / s.plain_tok_s_median.max(1e-9);
    let spec_secs: f64 = turns.iter().map(|t| t.spec[tree].gen.decode_secs).sum();
    // Decoded tokens: each turn's first comes from its prefill, before the decode clock starts.
    let plain_secs: f64 = turns.iter().map(|t| t.new_tokens.saturating_sub(1) as f64 / t.plain_tok_s.max(1e-9)).sum();
    let spec_tokens: usize = turns.iter().map(|t| t.spec[tree].gen.new_tokens.saturating_sub(1)).sum();
    let plain_tokens: usize = turns.iter().map(|t| t.new_tokens.saturating_sub(1)).sum();
    s.spec_tok_s_total = spec_tokens as f64 / spec_secs.max(1e-9);
    s.plain_tok_s_total = plain_tokens as f64 / plain_secs.max(1e-9);
    s.speedup_total = s.spec_tok_s_total / s.plain_tok_s_total.max(1e-9);
    s.node_accept_rate = nodes.iter().map(|(t, h)| *h as f64 / (*t).max(1) as f64).collect();
    s.head_top1 = head.iter().map(|a| a.1 as f64 / a.0.max(1) as f64).collect();
    s.head_top5 = head.iter().map(|a| a.2 as f64 / a.0.max(1) as f64).collect();
    s.mean_tree_nodes = nodes_total as f64 / s.target_forwards.max(1) as f64;
    s.copied_per_forward = copied as f64 / s.target_forwards.max(1) as f64;
    s.all_identical = identical;
    s
}

pub struct EvalOptions<'a> {
    pub trees: Vec<(String, Plan)>,
    pub params: SamplingParams,
    pub max_tokens: usize,
    pub seed: u64,
    /// A second source for `+lookup` branches (see [`crate::draft::datastore`]).
    pub datastore: Option<&'a crate::draft::datastore::Datastore>,
    pub progress: &'a mut dyn FnMut(usize, usize),
}

/// Run every prompt (each turn following the model's own previous answer) with plain decoding
/// and with each tree, alternating, after one warm-up generation.
pub fn evaluate(target: &Target, drafter: &Drafter, prompts: &[PromptItem], opts: &mut EvalOptions) -> Result<EvalReport> {
    let eos = target.tokenizer.eos_ids.clone();
    let rule = Rule::for_params(&opts.params, false);
    let greedy = opts.params.is_greedy();
    // Warm-up: page in weights, spin up threads.
    if let Some(first) = prompts.first() {
        let ids = target.prompt_ids(&[Message::new("user", first.turns[0].clone())])?;
        let stop = StopRule { max_new_tokens: 8, eos_ids: &eos };
        generate_plain(&target.model, &ids, &opts.params, &stop, &mut rng(0), &mut |_| Ok(Flow::Continue))?;
    }
    // `auto` trees: time this device's forward once for all prompts.
    let plans: Vec<Plan> = opts
        .trees
        .iter()
        .map(|(name, p)| {
            let tree = p.tree.clone().with_costs(&target.model, p.lookup.map_or(0, |l| l.max_tokens))?;
            if let (TreeChoice::Auto(b), TreeChoice::Auto(Budget { fit_to_device: true, .. })) = (&tree, &p.tree) {
                eprintln!("{name}: grows up to {} nodes here at start (forward cost within {AFFORDABLE_COST}x one token's; refitted per step to the forward times the run observes)", b.max_nodes);
            }
            Ok(Plan { tree, lookup: p.lookup })
        })
        .collect::<Result<_>>()?;
    let mut turns = Vec::new();
    let total: usize = prompts.iter().map(|p| p.turns.len()).sum();
    let mut sample = (String::new(), String::new());
    for (pi, item) in prompts.iter().enumerate() {
        let mut messages: Vec<Message> = Vec::new();
        for (ti, turn) in item.turns.iter().enumerate() {
            messages.push(Message::new("user", turn.clone()));
            let ids = target.prompt_ids(&messages)?;
            let seed = opts.seed.wrapping_add((pi * 16 + ti) as u64);
            let stop = StopRule { max_new_tokens: opts.max_tokens, eos_ids: &eos };
            let (plain_out, plain) = generate_plain(&target.model, &ids, &opts.params, &stop, &mut rng(seed), &mut |_| Ok(Flow::Continue))?;
            let mut specs = Vec::new();
            let mut identical = Vec::new();
            for (j, plan) in plans.iter().enumerate() {
                let so = SpecOptions { tree: plan.tree.clone(), lookup: plan.lookup, datastore: opts.datastore, rule, params: opts.params.clone(), stop: StopRule { max_new_tokens: opts.max_tokens, eos_ids: &eos } };
                let (out, st) = generate_spec(&target.model, drafter, &ids, &so, &mut rng(seed), &mut |_| Ok(Flow::Continue))?;
                identical.push(if greedy { Some(out == plain_out) } else { None });
                if pi == 0 && ti == 0 && j == 0 {
                    sample = (target.tokenizer.decode(&out)?, mark_drafted(target, &out, &st.drafted)?);
                }
                specs.push(st);
            }
            // Answer history for the next turn: the target's own reply.
            let mut reply = plain_out.clone();
            if reply.last().is_some_and(|t| target.tokenizer.is_eos(*t)) {
                reply.pop();
            }
            messages.push(Message::new("assistant", target.tokenizer.decode(&reply)?));
            turns.push(TurnResult {
                prompt_id: item.id.clone(),
                category: item.category.clone(),
                turn: ti,
                new_tokens: plain.new_tokens,
                plain_tok_s: plain.decode_tok_s(),
                spec: specs,
                identical,
            });
            (opts.progress)(turns.len(), total);
        }
    }
    let all: Vec<&TurnResult> = turns.iter().collect();
    let overall = (0..opts.trees.len()).map(|j| summarise(&all, j)).collect();
    let mut per_category = BTreeMap::new();
    let cats: std::collections::BTreeSet<String> = turns.iter().map(|t| t.category.clone()).collect();
    for c in cats {
        let ts: Vec<&TurnResult> = turns.iter().filter(|t| t.category == c).collect();
        per_category.insert(c, (0..opts.trees.len()).map(|j| summarise(&ts, j)).collect());
    }
    Ok(EvalReport {
        model: target.path.display().to_string(),
        weights: target.model.weight_format().to_string(),
        device: if target.model.device().is_cpu() { format!("cpu ({} kernels)", crate::cpu::isa::cpu_kernels()) } else { format!("{:?}", target.model.device().location()) },
        drafter_dir: String::new(),
        drafter: drafter.kind().to_string(),
        trees: opts.trees.iter().map(|t| t.0.clone()).collect(),
        datastore_tokens: opts.datastore.map_or(0, |d| d.len()),
        temperature: opts.params.temperature,
        max_tokens: opts.max_tokens,
        overall,
        per_category,
        turns,
        sample: sample.0,
        sample_marked: sample.1,
    })
}

/// Text with each run of accepted draft tokens wrapped in `[brackets]`.
///
/// The text is decoded as one stream and cut between tokens afterwards: decoding each run on its
/// own drops the leading space a SentencePiece token carries (`wanted[to]play`).
pub fn mark_drafted(target: &Target, out: &[u32], drafted: &[bool]) -> Result<String> {
    mark_pieces(&target.tokenizer, out, drafted)
}

fn mark_pieces(tok: &crate::model::tokenizer::Tokenizer, out: &[u32], drafted: &[bool]) -> Result<String> {
    let mut stream = crate::decode::generate::TextStream::new(tok);
    let mut s = String::new();
    let mut open = false;
    // A piece can complete only after several tokens (a character split across byte tokens);
    // it counts as drafted when all of its tokens were.
    let mut all_drafted = true;
    let mut put = |s: &mut String, piece: String, d: bool| {
        if d != open {
            s.push(if d { '[' } else { ']' });
            open = d;
        }
        s.push_str(&piece);
    };
    for (i, &t) in out.iter().enumerate() {
        all_drafted &= drafted.get(i).copied().unwrap_or(false);
        if let Some(piece) = stream.push(t)? {
            put(&mut s, piece, all_drafted);
            all_drafted = true;
        }
    }
    if let Some(piece) = stream.finish()? {
        put(&mut s, piece, all_drafted && !out.is_empty());
    }
    if open {
        s.push(']');
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Marking keeps every character of the decoded text, SentencePiece's leading spaces
    /// included: "▁to" decoded alone is "to", but in the stream it is " to".
    #[test]
    fn marked_sample_keeps_sentencepiece_spaces() {
        use candle_core::quantized::gguf_file::Value as V;
        let words = ["<unk>", "<s>", "</s>", "▁wanted", "▁to", "▁play", "▁the", "▁cat"];
        let md: std::collections::HashMap<String, V> = [
            ("tokenizer.ggml.model", V::String("llama".into())),
            ("tokenizer.ggml.tokens", V::Array(words.iter().map(|w| V::String(w.to_string())).collect())),
            ("tokenizer.ggml.scores", V::Array(words.iter().map(|_| V::F32(0.0)).collect())),
            ("tokenizer.ggml.token_type", V::Array([2, 3, 3, 1, 1, 1, 1, 1].iter().map(|&t| V::I32(t)).collect())),
            ("tokenizer.ggml.bos_token_id", V::U32(1)),
            ("tokenizer.ggml.eos_token_id", V::U32(2)),
            ("tokenizer.ggml.unknown_token_id", V::U32(0)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let tok = crate::model::tokenizer::Tokenizer::from_gguf(std::path::Path::new("sp.gguf"), &md).unwrap();
        let out = [7, 3, 4, 5];
        let marked = mark_pieces(&tok, &out, &[false, false, true, false]).unwrap();
        assert_eq!(marked.replace(['[', ']'], ""), tok.decode(&out).unwrap());
        assert_eq!(marked, "cat wanted[ to] play");
        assert_eq!(mark_pieces(&tok, &out, &[true; 4]).unwrap(), "[cat wanted to play]");
    }

    /// The median speed-up and the overall one (all tokens over all time) differ when turns do.
    #[test]
    fn summary_medians_and_totals() {
        let turn = |tokens: usize, spec_secs: f64, plain_tok_s: f64| {
            let mut st = SpecStats::default();
            st.gen.new_tokens = tokens;
            st.gen.target_forwards = tokens / 2;
            st.gen.decode_secs = spec_secs;
            TurnResult { prompt_id: "p".into(), category: "c".into(), turn: 0, new_tokens: tokens, plain_tok_s, spec: vec![st], identical: vec![Some(true)] }
        };
        let (a, b) = (turn(100, 0.5, 100.0), turn(10, 0.2, 50.0));
        let s = summarise(&[&a, &b], 0);
        // 99 tokens in 0.5 s and 9 in 0.2 s (each turn's first is the prefill's).
        assert!((s.spec_tok_s_median - (198.0 + 45.0) / 2.0).abs() < 1e-9 && (s.plain_tok_s_median - 75.0).abs() < 1e-9);
        assert!((s.speedup - 121.5 / 75.0).abs() < 1e-9);
        assert!((s.spec_tok_s_total - 108.0 / 0.7).abs() < 1e-9);
        assert!((s.plain_tok_s_total - 108.0 / (99.0 / 100.0 + 9.0 / 50.0)).abs() < 1e-9);
        assert!((s.speedup_total - (108.0 / 0.7) / (108.0 / 1.17)).abs() < 1e-9);
        assert_eq!(s.all_identical, Some(true));
    }

}
