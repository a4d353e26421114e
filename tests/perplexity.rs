//! `perplexity` scores as llama-perplexity does: chunks of `ctx` tokens from an empty cache, the
//! second half of each scored against the token that follows, PPL = exp(mean NLL).
mod common;

use common::*;
use selfspec::cpu::reduce::row_to_vec;
use selfspec::eval::perplexity::perplexity;

/// The same number from a plain f64 log-softmax written out here, chunk by chunk; shuffled text
/// scores worse than the text itself.
#[test]
fn perplexity_is_the_mean_nll_of_each_chunks_second_half() {
    let t = smollm2();
    let text = "The river runs down from the hills to the sea. Along its banks the farmers grow wheat and barley, and in the autumn the boats carry the grain to the town. ".repeat(4);
    let tokens = t.tokenizer.encode(&text, true).unwrap();
    let ctx = 32;
    let mut seen = Vec::new();
    let p = perplexity(&t, &tokens, ctx, Some(3), &mut |i, ppl| seen.push((i, ppl))).unwrap();
    assert_eq!((p.chunks, p.scored, p.running.len()), (3, 3 * (ctx - 1 - ctx / 2), 3));
    assert_eq!(seen.iter().map(|s| s.0).collect::<Vec<_>>(), vec![0, 1, 2]);
    assert_eq!(p.running[2], p.ppl);
    let (mut nll, mut n) = (0f64, 0);
    for c in 0..3 {
        let chunk = &tokens[c * ctx..(c + 1) * ctx];
        let mut cache = t.model.new_cache().unwrap();
        let logits = t.model.logits(&t.model.forward_causal(chunk, &mut cache).unwrap()).unwrap();
        for r in ctx / 2..ctx - 1 {
            let row = row_to_vec(&logits, r).unwrap();
            let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
            let z: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
            nll -= row[chunk[r + 1] as usize] as f64 - max - z.ln();
            n += 1;
        }
    }
    let want = (nll / n as f64).exp();
    assert!((p.ppl - want).abs() < 1e-4 * want, "{} vs {want}", p.ppl);
    assert!(p.ppl_error > 0.0 && p.ppl < 20.0, "{p:?}");
    // The same words in a scrambled order are far less likely.
    let mut words: Vec<&str> = text.split(' ').collect();
    let mut r = Rand(7);
    for i in (1..words.len()).rev() {
        words.swap(i, r.below(i + 1));
    }
    let shuffled = t.tokenizer.encode(&words.join(" "), true).unwrap();
    let q = perplexity(&t, &shuffled, ctx, Some(3), &mut |_, _| {}).unwrap();
    assert!(q.ppl > 3.0 * p.ppl, "shuffled {} vs {}", q.ppl, p.ppl);
    // Too short a text, too short a context, a context past the model's.
    assert!(perplexity(&t, &tokens[..40], ctx, None, &mut |_, _| {}).is_err());
    assert!(perplexity(&t, &tokens, 8, None, &mut |_, _| {}).is_err());
    assert!(perplexity(&t, &tokens, 1 << 20, None, &mut |_, _| {}).unwrap_err().to_string().contains("past this model's"));
}

/// Against itself a format diverges by nothing; native against f32 by a little, with PPLs equal
/// to each format's own `perplexity`.
#[test]
fn divergence_from_a_reference_format_is_measured_on_the_same_tokens() {
    use selfspec::cpu::quant::WeightFormat;
    use selfspec::eval::perplexity::perplexity_against;
    use selfspec::model::loader::Target;
    let load = |w| Target::load_with(&smollm2_path(), &candle_core::Device::Cpu, w).unwrap();
    let (native, f32) = (load(WeightFormat::Native), load(WeightFormat::F32));
    let text = "A hash map stores values under keys. It hashes each key to a bucket, and keeps the keys that land in one bucket in a short list. ".repeat(5);
    let tokens = native.tokenizer.encode(&text, true).unwrap();
    let (p, same) = perplexity_against(&native, &native, &tokens, 32, Some(3), &mut |_, _| {}).unwrap();
    assert_eq!((same.mean_kld, same.max_kld, same.same_top, same.reference.ppl), (0.0, 0.0, 1.0, p.ppl));
    let (p, d) = perplexity_against(&native, &f32, &tokens, 32, Some(3), &mut |_, _| {}).unwrap();
    assert_eq!(p.ppl, perplexity(&native, &tokens, 32, Some(3), &mut |_, _| {}).unwrap().ppl);
    assert_eq!(d.reference.ppl, perplexity(&f32, &tokens, 32, Some(3), &mut |_, _| {}).unwrap().ppl);
    assert!(d.mean_kld > 0.0 && d.mean_kld < 0.05 && d.max_kld >= d.mean_kld, "{d:?}");
    assert!(d.same_top > 0.8 && d.same_top <= 1.0, "{d:?}");
}
