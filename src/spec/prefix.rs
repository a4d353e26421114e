//! Prompt caching: a finished generation leaves its tokens' KV cache (and, for a drafter, the
//! target's states it read) behind as a [`Prefix`]; a later prompt that starts with the same
//! tokens copies them instead of recomputing them. A chat's second turn repeats the first turn
//! and its answer, and most requests repeat a system prompt, so on a CPU, where a prompt is read
//! at a few hundred tokens a second, this is most of a second turn's time to first token
//! (llama.cpp's `cache_prompt`, vLLM's automatic prefix caching).
//!
//! Why it cannot change an answer: a token's K/V and final state depend only on the tokens up
//! to it, and the CPU kernels give a row the same bits whether it runs in a prompt chunk, a tree
//! or alone (batch invariance; candle's GPU kernels do not). So the copied values are the ones a
//! fresh prefill would write, and the drafter restarts from the same states and pairs (`tests/serve.rs` checks answers against
//! `generate` with and without the cache).
use candle_core::Tensor;

use crate::model::kv_cache::KvCache;
use crate::{Error, Result};

/// The committed tokens of a finished generation with what the target computed for them.
pub struct Prefix {
    tokens: Vec<u32>,
    cache: KvCache,
    /// The target's states for each token (`[tokens, width]`), what a drafter starts from;
    /// `None` when no drafter reads them.
    states: Option<Tensor>,
    /// A draft layer's committed pairs over the first tokens (pair p: the state at p and token
    /// p + 1), so a later start runs the layer over the new rows only
    /// ([`crate::draft::drafter::Drafter::start_after`]).
    draft: Option<KvCache>,
}

impl Prefix {
    /// `cache` must hold exactly `tokens`, `states` (when given) one row per token, and
    /// `draft` at most one pair per token.
    pub fn new(tokens: Vec<u32>, cache: KvCache, states: Option<Tensor>, draft: Option<KvCache>) -> Result<Self> {
        if cache.len() != tokens.len() {
            return Err(Error::InvalidArgument(format!("a prefix of {} tokens with a cache of {}", tokens.len(), cache.len())));
        }
        if let Some(s) = &states {
            if s.dim(0)? != tokens.len() {
                return Err(Error::InvalidArgument(format!("a prefix of {} tokens with {} state rows", tokens.len(), s.dim(0)?)));
            }
        }
        if let Some(d) = &draft {
            if d.len() > tokens.len() {
                return Err(Error::InvalidArgument(format!("a prefix of {} tokens with {} draft pairs", tokens.len(), d.len())));
            }
        }
        Ok(Prefix { tokens, cache, states, draft })
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }
    pub fn states(&self) -> Option<&Tensor> {
        self.states.as_ref()
    }
    /// The draft layer's pairs: pair p read token p + 1, so the last may read a token past
    /// [`Self::tokens`]; a resumed sequence takes only those below the tokens it shares.
    pub fn draft(&self) -> Option<&KvCache> {
        self.draft.as_ref()
    }

    /// Bytes held: the caches' allocations and the states.
    pub fn bytes(&self) -> usize {
        self.cache.bytes() + self.states.as_ref().map_or(0, |s| s.elem_count() * s.dtype().size_in_bytes()) + self.draft.as_ref().map_or(0, KvCache::bytes)
    }

    /// How many of `prompt`'s first tokens this prefix can stand for: the common start, less
    /// one where it would cover the whole prompt (the prompt's last token must run, as its
    /// logits choose the first answer token).
    pub fn usable(&self, prompt: &[u32]) -> usize {
        let common = self.tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count();
        common.min(prompt.len().saturating_sub(1))
    }
}

/// Finished generations kept for later prompts, within a byte budget, the least recently used
/// dropped first.
pub struct PrefixCache {
    budget: usize,
    /// (prefix, last use).
    entries: Vec<(Prefix, u64)>,
    clock: u64,
}

impl PrefixCache {
    /// Keep at most `budget` bytes (0 keeps nothing).
    pub fn new(budget: usize) -> Self {
        PrefixCache { budget, entries: Vec::new(), clock: 0 }
    }

    /// The kept prefix that covers most of `prompt`'s start, and how many tokens it covers
    /// (at least one); marked as used.
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<(&Prefix, usize)> {
        let (i, n) = self.entries.iter().enumerate().map(|(i, (p, _))| (i, p.usable(prompt))).max_by_key(|&(i, n)| (n, std::cmp::Reverse(i)))?;
        if n == 0 {
            return None;
        }
        self.clock += 1;
        self.entries[i].1 = self.clock;
        Some((&self.entries[i].0, n))
    }

    /// Keep `p`. Kept prefixes that `p` extends are dropped (it stands for them too), and `p`
    /// itself is dropped where a kept one extends it; then the least recently used go until
    /// the rest fits the budget.
    pub fn insert(&mut self, p: Prefix) {
        self.clock += 1;
        if p.tokens.is_empty() || p.bytes() > self.budget {
            return;
        }
        if let Some(e) = self.entries.iter_mut().find(|(e, _)| e.tokens.starts_with(&p.tokens)) {
            e.1 = self.clock;
            return;
        }
        self.entries.retain(|(e, _)| !p.tokens.starts_with(&e.tokens));
        self.entries.push((p, self.clock));
        while self.bytes() > self.budget {
            let oldest = self.entries.iter().enumerate().min_by_key(|(_, (_, used))| *used).map(|(i, _)| i).expect("over budget, so not empty");
            self.entries.remove(oldest);
        }
    }

    /// The byte budget it keeps within.
    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Bytes held by the kept prefixes.
    pub fn bytes(&self) -> usize {
        self.entries.iter().map(|(p, _)| p.bytes()).sum()
    }
    /// Prefixes kept.
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    fn prefix(tokens: &[u32], states: bool) -> Prefix {
        let dev = Device::Cpu;
        let mut c = KvCache::new(1, 1, 2, 1024, DType::F32, &dev).unwrap();
        let n = tokens.len();
        let k = Tensor::zeros((n, 1, 2), DType::F32, &dev).unwrap();
        c.write(0, &k, &k).unwrap();
        c.append(n).unwrap();
        let s = states.then(|| Tensor::zeros((n, 3), DType::F32, &dev).unwrap());
        Prefix::new(tokens.to_vec(), c, s, None).unwrap()
    }

    #[test]
    fn a_prefix_stands_for_the_common_start_but_never_the_last_prompt_token() {
        let p = prefix(&[1, 2, 3, 4], true);
        assert_eq!(p.usable(&[1, 2, 3, 4, 5]), 4);
        assert_eq!(p.usable(&[1, 2, 3, 4]), 3, "the last prompt token must run");
        assert_eq!(p.usable(&[1, 2, 9]), 2);
        assert_eq!(p.usable(&[7]), 0);
        assert_eq!(p.bytes(), 256 * 2 * 2 * 4 + 4 * 3 * 4, "a 256-slot cache and 4 rows of states");
        let c = KvCache::new(1, 1, 2, 8, DType::F32, &Device::Cpu).unwrap();
        assert!(Prefix::new(vec![1], c, None, None).is_err(), "a cache that does not hold the tokens");
        let c = prefix(&[1, 2], false).cache.prefix_copy(2).unwrap();
        assert!(Prefix::new(vec![1, 2], c.prefix_copy(2).unwrap(), Some(Tensor::zeros((3, 3), DType::F32, &Device::Cpu).unwrap()), None).is_err());
        let three = prefix(&[1, 2, 3], false).cache;
        assert!(Prefix::new(vec![1, 2], c.prefix_copy(2).unwrap(), None, Some(three)).is_err(), "more draft pairs than tokens");
        let with_draft = Prefix::new(vec![1, 2], c.prefix_copy(2).unwrap(), None, Some(c.prefix_copy(1).unwrap())).unwrap();
        assert_eq!(with_draft.bytes(), 2 * c.bytes(), "both caches counted");
    }

    #[test]
    fn the_longest_match_is_found_and_the_least_recently_used_goes_first() {
        let one = prefix(&[1], false).bytes();
        let mut pc = PrefixCache::new(2 * one);
        assert_eq!((pc.budget(), pc.len(), pc.bytes()), (2 * one, 0, 0));
        pc.insert(prefix(&[1, 2, 3], false));
        pc.insert(prefix(&[1, 2, 3, 4, 5], false));
        assert_eq!(pc.len(), 1, "the longer one extends the first and stands for it");
        pc.insert(prefix(&[1, 2], false));
        assert_eq!(pc.len(), 1, "one a kept prefix extends is not kept");
        pc.insert(prefix(&[1, 9], false));
        assert_eq!(pc.lookup(&[1, 2, 3, 4, 6, 7]).map(|(p, n)| (p.tokens().len(), n)), Some((5, 4)));
        assert_eq!(pc.lookup(&[1, 9, 9]).map(|(_, n)| n), Some(2));
        assert!(pc.lookup(&[5, 5]).is_none());
        // [1, 2, 3, 4, 5] was used last before [1, 9]: a third prefix evicts [1, 2, 3, 4, 5].
        pc.insert(prefix(&[7, 7], false));
        assert_eq!(pc.len(), 2);
        assert!(pc.lookup(&[1, 2, 3, 4]).is_some_and(|(p, _)| p.tokens() == [1, 9]));
        assert!(pc.bytes() <= 2 * one);
        let mut off = PrefixCache::new(0);
        off.insert(prefix(&[1, 2], false));
        assert!(off.is_empty(), "a zero budget keeps nothing");
    }
}
