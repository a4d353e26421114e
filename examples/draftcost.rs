//! Where a draft layer's drafting time goes: propose (per tree) and commit, median ms.
//! `cargo run --release --example draftcost -- MODEL DRAFTER_DIR [weights]` (heads or a draft layer;
//! weights default to native). Commit timings use a made-up accepted path of two nodes.
//! `DRAFT_FORMAT=bf16` (or f32, q8_0, ...) drafts in another format than the default (`native`:
//! 4-bit blocks for a draft layer, 8-bit for heads).
//! `DRAFTCOST_COLD=1` runs a 4-row target forward (and its logits) before each propose-and-commit
//! pair, as a decoding step does, so the drafter's weights meet the caches a step leaves.
//! `DRAFTCOST_TREES=chain:2,dynamic:8` picks the trees, `DRAFTCOST_REPS=2000` the rounds (21; more
//! for `perf record`).
use std::time::Instant;

use selfspec::draft::drafter::Drafter;
use selfspec::model::loader::Target;
use selfspec::draft::choice::TreeChoice;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        anyhow::bail!("usage: draftcost MODEL DRAFTER_DIR [weights]");
    }
    let w: selfspec::cpu::quant::WeightFormat = args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(selfspec::cpu::quant::WeightFormat::Native);
    let mut target = Target::load_with(args[1].as_ref(), &candle_core::Device::Cpu, w)?;
    let format = std::env::var("DRAFT_FORMAT").map(|f| f.parse()).unwrap_or(Ok(selfspec::draft::drafter::DRAFTING_FORMAT))?;
    let drafter = Drafter::from_dir_as(args[2].as_ref(), &target, format)?;
    // An EAGLE-3 layer reads tapped target layers: the target must return them.
    drafter.attach(&mut target)?;
    let prompt = target.encode_prompt("Explain how a refrigerator keeps food cold, step by step, in detail.", true)?;
    let mut cache = target.model.new_cache()?;
    let hidden = target.model.forward_causal(&prompt, &mut cache)?;
    let mut state = drafter.start(&target.model, &hidden, &prompt, 42)?;
    let med = |mut v: Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let reps: usize = std::env::var("DRAFTCOST_REPS").map(|r| r.parse()).unwrap_or(Ok(21))?;
    let specs = std::env::var("DRAFTCOST_TREES").unwrap_or_else(|_| "chain:1,chain:2,chain:3,chain:5,cpu,dynamic:8,dynamic:16,dynamic:28".into());
    for spec in specs.split(',') {
        let choice = TreeChoice::parse(spec)?;
        let (mut p, mut c) = (Vec::new(), Vec::new());
        let cold = std::env::var("DRAFTCOST_COLD").is_ok_and(|v| v == "1");
        let mut tcache = target.model.new_cache()?;
        if cold {
            target.model.forward_causal(&prompt, &mut tcache)?;
        }
        let base = tcache.len();
        for rep in 0..reps.max(1) {
            // Each commit grows the layer's cache by two slots: start over now and then, so that
            // long runs keep measuring a short context.
            if rep % 32 == 31 {
                state = drafter.start(&target.model, &hidden, &prompt, 42)?;
            }
            if cold {
                tcache.truncate(base);
                let toks = [42u32, 7, 9, 11];
                let pos: Vec<usize> = (base..base + 4).collect();
                let h = target.model.forward(&toks, &pos, &selfspec::cpu::TreeMask::causal(4), &mut tcache)?;
                std::hint::black_box(target.model.logits(&h)?);
            }
            let t = Instant::now();
            let prop = state.propose(&target.model, 42, &choice, 1, usize::MAX, 0.0)?;
            p.push(t.elapsed().as_secs_f64() * 1e3);
            let t = Instant::now();
            let h = hidden.narrow(0, 0, prop.tree.len())?;
            state.commit(&target.model, &h, &[0, 1], &[7, 9])?;
            c.push(t.elapsed().as_secs_f64() * 1e3);
        }
        println!("{spec:>10}: propose {:.2} ms, commit (2 pairs) {:.2} ms", med(p), med(c));
    }
    Ok(())
}
