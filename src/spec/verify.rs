//! Exact acceptance rules, separate from the decoding loop so each can be tested on its own.
//!
//! Greedy: walk from the root, following the child that carries the target's argmax; the first
//! node without such a child emits the target's own token. Output equals plain greedy decoding.
//!
//! Sampling (children are the drafter's deterministic guesses): the sibling rule. At a node with
//! target distribution R, child x1 is accepted with probability R(x1); if not, R(x1) is zeroed,
//! R renormalised and the next child tried the same way; if none is accepted, the token is
//! drawn from what is left of R. Each child x is then emitted with probability P(x) and any
//! other token y with P(y): the output is distributed exactly as plain sampling.
//!
//! The rule's coins are realised by one inverse-CDF draw y from R per emitted position, the
//! draw plain decoding makes: "x1 accepted" is the event y = x1 (probability R(x1)); given
//! y != x1, y is distributed as the renormalised R without x1, so "x2 accepted" is y = x2 with
//! the rule's conditional probability; and given y is no child, y is a draw from the residual.
//! Realised this way, a seed gives the very tokens plain sampling gives with that seed, whatever
//! tree was drafted, whichever other sequences shared the forward. That is what lets a server
//! size trees by load and still return each request's seeded output unchanged.
//!
//! P at each node is computed by the same [`SamplingParams::distribution`] plain decoding uses,
//! with that node's own path as history.
use rand::Rng;

use crate::decode::sampling::{sample_from, Rng64, SamplingParams};
use crate::draft::tree::Tree;
use crate::Result;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Rule {
    Greedy,
    /// Exact speculative sampling.
    Sample,
    /// Medusa's typical acceptance: faster, but the output no longer follows the target's
    /// distribution. Opt-in only.
    LossyTypical { epsilon: f64, delta: f64 },
    /// Deliberately wrong: after all children are rejected, draws afresh from P instead of
    /// taking the residual's draw.
    /// Exists only so the exactness test can show it catches a broken rule.
    #[doc(hidden)]
    BrokenResampleFromTarget,
}

impl Rule {
    pub fn for_params(p: &SamplingParams, lossy_typical: bool) -> Self {
        if lossy_typical {
            Rule::LossyTypical { epsilon: 0.09, delta: 0.3 }
        } else if p.is_greedy() {
            Rule::Greedy
        } else {
            Rule::Sample
        }
    }
}

/// What one step produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    /// Accepted node indices, root first: their K/V stays in the cache.
    pub accepted: Vec<usize>,
    /// Emitted tokens: the accepted children's tokens, then the correction or bonus token.
    pub emitted: Vec<u32>,
}

/// Verify one tree. `tokens[i]` is node i's token (`tokens[0]` the root, already emitted);
/// `history` is everything emitted so far including the root; `logits_at(i)` gives the target's
/// logits after node i (fetched lazily: only the nodes on the walk are read).
pub fn verify<'a>(
    tree: &Tree,
    tokens: &[u32],
    history: &[u32],
    params: &SamplingParams,
    rule: Rule,
    rng: &mut Rng64,
    logits_at: &mut dyn FnMut(usize) -> Result<&'a [f32]>,
) -> Result<Verdict> {
    if let Rule::LossyTypical { epsilon, delta } = rule {
        return verify_typical(tree, tokens, history, params, epsilon, delta, rng, logits_at);
    }
    let mut hist = history.to_vec();
    let mut u = 0usize;
    let mut accepted = vec![0];
    let mut emitted = Vec::new();
    loop {
        let logits = logits_at(u)?;
        // The target's own choice at this node, exactly as plain decoding makes it (the argmax,
        // or one inverse-CDF draw from P with this node's path as history).
        let y = params.choose(logits, &hist, rng);
        match tree.node(u).children.iter().find(|&&c| tokens[c] == y) {
            Some(&c) => {
                emitted.push(y);
                hist.push(y);
                accepted.push(c);
                u = c;
            }
            None if rule == Rule::BrokenResampleFromTarget && !params.is_greedy() => {
                // Wrong on purpose: a rejected node draws afresh from P (a drafted token may
                // come back), where the rule's remaining draw is from the residual.
                emitted.push(params.choose(logits, &hist, rng));
                break;
            }
            None => {
                emitted.push(y);
                break;
            }
        }
    }
    Ok(Verdict { accepted, emitted })
}

/// Medusa's typical acceptance: a child passes when P(x) > min(eps, delta * exp(-H(P))); the
/// deepest passing path wins; the final token is drawn from the last node's distribution.
#[allow(clippy::too_many_arguments)]
fn verify_typical<'a>(
    tree: &Tree,
    tokens: &[u32],
    history: &[u32],
    params: &SamplingParams,
    epsilon: f64,
    delta: f64,
    rng: &mut Rng64,
    logits_at: &mut dyn FnMut(usize) -> Result<&'a [f32]>,
) -> Result<Verdict> {
    // Temperature 0 would make every distribution one-hot; typical acceptance uses T >= a floor.
    let mut p = params.clone();
    if p.is_greedy() {
        p.temperature = 1.0;
    }
    let mut best: Vec<usize> = vec![0];
    let mut stack: Vec<Vec<usize>> = vec![vec![0]];
    let mut dists: std::collections::HashMap<usize, Vec<f64>> = std::collections::HashMap::new();
    while let Some(path) = stack.pop() {
        let u = *path.last().unwrap();
        let mut hist = history.to_vec();
        hist.extend(path[1..].iter().map(|&i| tokens[i]));
        let dist = p.distribution(logits_at(u)?, &hist);
        let entropy: f64 = -dist.iter().filter(|&&x| x > 0.0).map(|&x| x * x.ln()).sum::<f64>();
        let threshold = epsilon.min(delta * (-entropy).exp());
        for &c in tree.node(u).children.iter().rev() {
            if dist[tokens[c] as usize] > threshold {
                let mut np = path.clone();
                np.push(c);
                if np.len() > best.len() {
                    best = np.clone();
                }
                stack.push(np);
            }
        }
        dists.insert(u, dist);
    }
    let last = *best.last().unwrap();
    let mut emitted: Vec<u32> = best[1..].iter().map(|&i| tokens[i]).collect();
    let final_tok = if params.is_greedy() {
        let mut hist = history.to_vec();
        hist.extend(emitted.iter());
        params.choose(logits_at(last)?, &hist, rng)
    } else {
        sample_from(&dists[&last], rng)
    };
    emitted.push(final_tok);
    Ok(Verdict { accepted: best, emitted })
}

/// Classic speculative sampling for one token drawn from a draft distribution `q`: accept `x`
/// with min(1, p(x)/q(x)), else draw from norm(max(0, p - q)).
pub fn accept_or_resample(p: &[f64], q: &[f64], x: u32, rng: &mut Rng64) -> u32 {
    let (px, qx) = (p[x as usize], q[x as usize]);
    if qx > 0.0 && rng.random::<f64>() < (px / qx).min(1.0) {
        return x;
    }
    sample_from(&residual(p, q), rng)
}

/// norm(max(0, p - q)); falls back to p when p <= q everywhere (then the draft was never rejected).
pub fn residual(p: &[f64], q: &[f64]) -> Vec<f64> {
    let r: Vec<f64> = p.iter().zip(q).map(|(a, b)| (a - b).max(0.0)).collect();
    let s: f64 = r.iter().sum();
    if s <= 0.0 {
        return p.to_vec();
    }
    r.into_iter().map(|v| v / s).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::sampling::rng;

    #[test]
    fn worked_example_is_exact() {
        let p = [0.5, 0.3, 0.2];
        let q = [0.8, 0.1, 0.1];
        // Closed form: P(out = y) = q(y) min(1, p/q) + (sum_x q(x) (1 - min(1, p(x)/q(x)))) r(y).
        let r = residual(&p, &q);
        let reject: f64 = (0..3).map(|x| q[x] * (1.0 - (p[x] / q[x]).min(1.0))).sum();
        for y in 0..3 {
            let exact = q[y] * (p[y] / q[y]).min(1.0) + reject * r[y];
            assert!((exact - p[y]).abs() < 1e-12, "closed form for {y}: {exact}");
        }
        // Monte Carlo.
        let mut g = rng(1);
        let n = 200_000;
        let mut counts = [0usize; 3];
        for _ in 0..n {
            let x = sample_from(&q, &mut g);
            counts[accept_or_resample(&p, &q, x, &mut g) as usize] += 1;
        }
        for y in 0..3 {
            let f = counts[y] as f64 / n as f64;
            assert!((f - p[y]).abs() < 0.005, "token {y}: {f} vs {}", p[y]);
        }
    }

    #[test]
    fn greedy_walks_the_argmax_path() {
        // root -> [1 (tok 5), 2 (tok 6)], 1 -> [3 (tok 7)]
        let tree = Tree::from_paths(&[vec![0], vec![1], vec![0, 0]]).unwrap();
        let tokens = [9, 5, 6, 7];
        let onehot = |t: usize| {
            let mut v = vec![0f32; 10];
            v[t] = 1.0;
            v
        };
        let table = [onehot(5), onehot(7), onehot(0), onehot(3)];
        let v = verify(&tree, &tokens, &[9], &SamplingParams::greedy(), Rule::Greedy, &mut rng(0), &mut |i| Ok(table[i].as_slice())).unwrap();
        assert_eq!(v.accepted, vec![0, 1, 3]);
        assert_eq!(v.emitted, vec![5, 7, 3]);
        let table2 = [onehot(4), onehot(7), onehot(0), onehot(3)];
        let v = verify(&tree, &tokens, &[9], &SamplingParams::greedy(), Rule::Greedy, &mut rng(0), &mut |i| Ok(table2[i].as_slice())).unwrap();
        assert_eq!(v.accepted, vec![0]);
        assert_eq!(v.emitted, vec![4]);
    }

    #[test]
    fn sampling_handles_duplicates_and_zero_children() {
        // Two children with the same token and one with zero probability.
        let tree = Tree::from_paths(&[vec![0], vec![1], vec![2]]).unwrap();
        let tokens = [0, 1, 1, 3];
        let params = SamplingParams { temperature: 1.0, ..Default::default() };
        let logits = vec![0.0f32, 1.0, 0.5, f32::NEG_INFINITY];
        let p = params.distribution(&logits, &[]);
        let mut g = rng(3);
        let n = 60_000;
        let mut counts = [0usize; 4];
        for _ in 0..n {
            let v = verify(&tree, &tokens, &[0], &params, Rule::Sample, &mut g, &mut |_| Ok(logits.as_slice())).unwrap();
            counts[v.emitted[0] as usize] += 1;
            assert!(v.accepted.len() <= 2);
        }
        assert_eq!(counts[3], 0);
        for y in 0..3 {
            assert!((counts[y] as f64 / n as f64 - p[y]).abs() < 0.01);
        }
    }
}
