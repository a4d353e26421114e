//! Self-speculative decoding: heads draft a tree from the last accepted hidden state, one target
//! forward checks the whole tree, [`crate::spec::verify`] decides what is emitted, and the KV cache is
//! compacted to the accepted path.
use std::time::Instant;

use crate::decode::generate::Flow;
use crate::decode::sampling::Rng64;
use crate::draft::drafter::Drafter;
use crate::model::Llama;
use crate::spec::session::{Sequence, SpecOptions, SpecStats};
use crate::Result;

/// Generate with self-speculation. `on_token` sees each emitted token as soon as it is
/// accepted, and may end the run after it ([`Flow::Stop`]: the step's later tokens are dropped).
/// A [`Sequence`] stepped alone: each step's forward holds this sequence's tree only, cut by
/// its own cost curve.
pub fn generate_spec(
    model: &Llama,
    drafter: &Drafter,
    prompt: &[u32],
    opts: &SpecOptions,
    rng: &mut Rng64,
    on_token: &mut dyn FnMut(u32) -> Result<Flow>,
) -> Result<(Vec<u32>, SpecStats)> {
    let mut seq = Sequence::new(model, Some(drafter), prompt, opts.clone(), rng.clone())?;
    run_alone(model, &mut seq, &mut |t, _| on_token(t))?;
    let (out, stats, r) = seq.finish();
    *rng = r;
    Ok((out, stats))
}

/// Step `seq` to its end alone: each step's forward holds its work only (the whole prompt in
/// one chunk), each tree cut by the sequence's own cost curve. `on_token` sees each emitted
/// token and whether it was drafted. Returns the target forwards run.
pub fn run_alone(model: &Llama, seq: &mut Sequence, on_token: &mut dyn FnMut(u32, bool) -> Result<Flow>) -> Result<usize> {
    let mut forwards = 0;
    while let Some(work) = seq.next_work(model, usize::MAX, true)? {
        let work = seq.cut(work)?;
        let t_fwd = Instant::now();
        let last_chunk = work.tokens().len() >= seq.prompt_left();
        let hidden = model.forward(work.tokens(), work.positions(), work.mask(), seq.cache_mut())?;
        let rows = work.logit_rows(last_chunk);
        let logits = if rows.is_empty() { None } else { Some(model.logits(&hidden.narrow(0, rows.start, rows.len())?)?) };
        let ms = t_fwd.elapsed().as_secs_f64() * 1e3;
        let n = work.tokens().len();
        seq.finish_work(model, work, hidden, logits, n, ms, on_token)?;
        forwards += 1;
    }
    Ok(forwards)
}
