//! Drafting from a datastore of the target's own earlier text (retrieval, as REST does).
//!
//! A 135M instruction model answers in stock phrases ("I'm here to help", "Here's a simple
//! example", "In summary, ..."), and the same phrases fill the answers it gave to thousands of
//! other prompts. The datastore holds those answers (the self-distillation corpus) under a suffix
//! array: the longest suffix of the current text that occurs there selects every earlier
//! occurrence, and the tokens that most often followed them form a copied branch of the step's
//! tree, like the context lookup's ([`crate::draft::lookup`]). It is a function of the emitted text
//! alone, so both acceptance rules stay exact; a wrong guess costs only its tree nodes.
use std::ops::Range;
use std::path::PathBuf;

use crate::model::loader::Target;
use crate::{Error, Result};

/// Ends every stored sequence, so no match runs from one document into the next.
const SEP: u32 = u32::MAX;
/// Suffixes are sorted on this many leading tokens: longer than any match plus continuation.
const SORT_DEPTH: usize = 64;

/// Token sequences under a suffix array (sorted on their first `SORT_DEPTH` tokens).
pub struct Datastore {
    tokens: Vec<u32>,
    sa: Vec<u32>,
    /// Shortest and longest suffix of the context tried, longest first.
    pub min_match: usize,
    pub max_match: usize,
    /// A continuation token is kept only while it followed at least this share of the
    /// occurrences still matching (and at least two of them).
    pub min_share: f64,
}

impl Datastore {
    /// Index `seqs`; an empty collection is refused (there would be nothing to copy).
    pub fn from_sequences(seqs: impl IntoIterator<Item = Vec<u32>>) -> Result<Self> {
        let mut tokens = Vec::new();
        for s in seqs {
            if s.contains(&SEP) {
                return Err(Error::InvalidArgument(format!("token id {SEP} is reserved by the datastore")));
            }
            if !s.is_empty() {
                tokens.extend(s);
                tokens.push(SEP);
            }
        }
        if tokens.is_empty() {
            return Err(Error::InvalidArgument("the datastore got no text".into()));
        }
        if tokens.len() >= u32::MAX as usize {
            return Err(Error::InvalidArgument(format!("datastore of {} tokens is too large (at most 4G)", tokens.len())));
        }
        let key = |i: u32| {
            let i = i as usize;
            &tokens[i..(i + SORT_DEPTH).min(tokens.len())]
        };
        let mut sa: Vec<u32> = (0..tokens.len() as u32).filter(|&i| tokens[i as usize] != SEP).collect();
        use rayon::slice::ParallelSliceMut;
        sa.par_sort_unstable_by(|&a, &b| key(a).cmp(key(b)).then(a.cmp(&b)));
        Ok(Self::with_index(tokens, sa))
    }

    fn with_index(tokens: Vec<u32>, sa: Vec<u32>) -> Self {
        // Measured on the bundled eval prompts with the self-distilled answers as the store
        // (native weights, layer drafter): min_match 1 or 3, max_match 12 and min_share 0.1 or
        // 0.4 moved τ by at most 0.04.
        Datastore { tokens, sa, min_match: 2, max_match: 8, min_share: 0.25 }
    }

    /// Index what `--datastore` names: corpus manifests (their `datastore = true` sets, in
    /// manifest order) and files. Directories are refused ([`crate::data::manifest::datastore_files`]).
    pub fn from_inputs(target: &Target, inputs: &[PathBuf]) -> Result<Self> {
        let files = crate::data::manifest::datastore_files(inputs)?;
        Self::from_corpus(target, &files)
    }

    /// [`Datastore::from_inputs`], kept in the cache under `dir` between runs: indexing the
    /// bundled corpus takes about 2 s (2.3M tokens, 2-core Xeon), reading the index back well
    /// under 0.1 s. The key is the files' bytes, in order, with the tokenizer and the chat
    /// template that turn them into tokens. What a cache entry holds is checked before use
    /// (lengths, every index inside the text); its order is trusted, which can cost drafts but
    /// never exactness, as verification decides every token.
    pub fn from_inputs_cached(target: &Target, inputs: &[PathBuf], dir: Option<&std::path::Path>) -> Result<Self> {
        let Some(dir) = dir else { return Self::from_inputs(target, inputs) };
        let files = crate::data::manifest::datastore_files(inputs)?;
        let mut parts: Vec<Vec<u8>> = vec![target.tokenizer.to_json().into_bytes(), target.chat_template.as_ref().map(|t| t.source().as_bytes().to_vec()).unwrap_or_default(), format!("{SORT_DEPTH}").into_bytes()];
        // Everything else that decides the indexed ids: BOS/EOS conventions, how each file is
        // read (its extension picks text or conversations), and this program's version.
        let t = &target.tokenizer;
        parts.push(format!("{:?} {:?} {} {:?} {:?} {}", t.bos_id, t.eos_ids, t.add_bos, t.bos_token, t.eos_token, env!("CARGO_PKG_VERSION")).into_bytes());
        for f in &files {
            parts.push(f.extension().map(|e| e.to_string_lossy().into_owned()).unwrap_or_default().into_bytes());
            parts.push(crate::files::read_data(f)?);
        }
        let key = crate::files::cache_key(&parts.iter().map(|p| p.as_slice()).collect::<Vec<_>>());
        drop(parts);
        let max = crate::files::available_memory().map_or(u64::MAX, |m| m / 4);
        if let Some(ds) = crate::files::cache_read(dir, "datastore", &key, max).and_then(|b| Self::from_bytes(&b)) {
            return Ok(ds);
        }
        let ds = Self::from_corpus(target, &files)?;
        crate::files::cache_write(dir, "datastore", &key, &ds.to_bytes());
        Ok(ds)
    }

    const MAGIC: &'static [u8; 8] = b"SSDSTOR1";

    /// The index as bytes: magic, token count, entry count, tokens, entries (little-endian).
    fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(24 + 4 * (self.tokens.len() + self.sa.len()));
        b.extend_from_slice(Self::MAGIC);
        b.extend_from_slice(&(self.tokens.len() as u64).to_le_bytes());
        b.extend_from_slice(&(self.sa.len() as u64).to_le_bytes());
        for &t in self.tokens.iter().chain(&self.sa) {
            b.extend_from_slice(&t.to_le_bytes());
        }
        b
    }

    /// [`Datastore::to_bytes`] read back, or `None` for anything that is not a whole, consistent
    /// index (wrong lengths, an entry outside the text or on a separator).
    fn from_bytes(b: &[u8]) -> Option<Self> {
        let u64_at = |at: usize| Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?) as usize);
        if b.get(..8)? != Self::MAGIC {
            return None;
        }
        let (nt, ns) = (u64_at(8)?, u64_at(16)?);
        if ns > nt || nt == 0 || (b.len() - 24) / 4 != nt.checked_add(ns)? || !(b.len() - 24).is_multiple_of(4) {
            return None;
        }
        let words: Vec<u32> = b[24..].chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        let (tokens, sa) = words.split_at(nt);
        if sa.iter().any(|&i| i as usize >= nt || tokens[i as usize] == SEP) {
            return None;
        }
        Some(Self::with_index(tokens.to_vec(), sa.to_vec()))
    }

    /// The rendered and tokenized documents of `paths` (text files, directories, distill JSONL,
    /// as `train --data` reads them).
    pub fn from_corpus(target: &Target, paths: &[PathBuf]) -> Result<Self> {
        let docs = crate::data::read_corpus(paths, &|m| target.render_conversation(m))?;
        let seqs = docs.iter().map(|d| target.tokenizer.encode(&d.text, true)).collect::<Result<Vec<_>>>()?;
        Self::from_sequences(seqs).map_err(|e| Error::bad_file(paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "), e.to_string()))
    }

    /// Stored tokens (separators excluded).
    pub fn len(&self) -> usize {
        self.sa.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sa.is_empty()
    }

    /// Token `depth` places into the suffix at `sa[i]` (a separator past the end).
    fn at(&self, i: usize, depth: usize) -> u32 {
        self.tokens.get(self.sa[i] as usize + depth).copied().unwrap_or(SEP)
    }

    /// The entries of `within` (all sharing their first `depth` tokens) whose token at `depth`
    /// is `tok`: contiguous, as the array is sorted.
    fn narrow(&self, within: Range<usize>, depth: usize, tok: u32) -> Range<usize> {
        let s = &self.sa[within.clone()];
        let lo = s.partition_point(|&p| self.tokens.get(p as usize + depth).copied().unwrap_or(SEP) < tok);
        let hi = s.partition_point(|&p| self.tokens.get(p as usize + depth).copied().unwrap_or(SEP) <= tok);
        within.start + lo..within.start + hi
    }

    /// Suffix-array entries that start with `pattern` (two binary searches on whole prefixes:
    /// this runs for every suffix length at every step).
    fn find(&self, pattern: &[u32]) -> Range<usize> {
        let key = |p: u32| {
            let p = p as usize;
            &self.tokens[p..(p + pattern.len()).min(self.tokens.len())]
        };
        let lo = self.sa.partition_point(|&p| key(p) < pattern);
        lo..lo + self.sa[lo..].partition_point(|&p| key(p) == pattern)
    }

    /// The continuation of the longest suffix of `context` (of `min_match..=max_match` tokens)
    /// that has one in the store, and that suffix's length (0 and empty when none has): at each
    /// step the token that most often followed the occurrences still matching, while it holds
    /// `min_share` of them and at least two. A long suffix seen too rarely to agree on a next
    /// token gives way to a shorter one seen more often.
    /// Only suffixes longer than `longer_than` tokens are tried (a caller with a match of its
    /// own that long needs no shorter one: this runs at every step).
    pub fn continuation(&self, context: &[u32], max_tokens: usize, longer_than: usize) -> (usize, Vec<u32>) {
        let lo = self.min_match.max(longer_than + 1).max(1);
        let Some((top, found)) = self.longest_occurring(context, lo, self.max_match.min(SORT_DEPTH / 2)) else { return (0, Vec::new()) };
        let mut found = Some(found);
        for n in (lo..=top).rev() {
            let mut r = found.take().unwrap_or_else(|| self.find(&context[context.len() - n..]));
            let mut out = Vec::new();
            while out.len() < max_tokens && n + out.len() < SORT_DEPTH {
                let depth = n + out.len();
                let (best, best_count) = self.most_followed(r.clone(), depth);
                if best == SEP || best_count < 2 || (best_count as f64) < self.min_share * r.len() as f64 {
                    break;
                }
                out.push(best);
                r = self.narrow(r, depth, best);
            }
            if !out.is_empty() {
                return (n, out);
            }
        }
        (0, Vec::new())
    }

    /// The longest `n` in `lo..=hi` whose last `n` tokens of `context` occur in the store, with
    /// their entries (None: not even `lo`). Occurrence only shrinks as `n` grows (an occurrence
    /// of a suffix holds one of every shorter suffix; context tokens are never the separator), so
    /// a binary search finds it: `lo`, then at most 3 lookups for the default 2..=8, where trying
    /// each length from the longest took up to 7 (each lookup is two binary searches over the
    /// whole array, mostly cache misses).
    fn longest_occurring(&self, context: &[u32], lo: usize, hi: usize) -> Option<(usize, Range<usize>)> {
        let hi = hi.min(context.len());
        let find = |n: usize| self.find(&context[context.len() - n..]);
        if lo > hi {
            return None;
        }
        let mut yes = (lo, find(lo));
        if yes.1.is_empty() {
            return None;
        }
        let mut no = hi + 1;
        while no - yes.0 > 1 {
            let mid = (yes.0 + no) / 2;
            match find(mid) {
                r if r.is_empty() => no = mid,
                r => yes = (mid, r),
            }
        }
        Some(yes)
    }

    /// The token at `depth` that most entries of `r` hold (the first in sorted order on a
    /// tie; separators never), with its count; `(SEP, 0)` when none. A token that passes the
    /// caller's `min_share` test holds a run of at least `s = floor(min_share * len)` entries,
    /// so it holds one of the entries `s` apart: only their runs are measured, where walking
    /// every run cost hundreds of binary searches after a common two-token suffix. The answer
    /// is the full walk's whenever the caller's test can pass (the tests compare the two).
    fn most_followed(&self, r: Range<usize>, depth: usize) -> (u32, usize) {
        let step = (self.min_share * r.len() as f64).floor() as usize;
        let (mut best, mut best_count, mut i) = (SEP, 0, r.start);
        while i < r.end {
            let tok = self.at(i, depth);
            // A sampled entry may sit inside its run: measure the whole run.
            let g = self.narrow(if step >= 2 { r.clone() } else { i..r.end }, depth, tok);
            if tok != SEP && g.len() > best_count {
                (best, best_count) = (tok, g.len());
            }
            // Past this run: every run, or the next one holding an entry `step` apart.
            i = if step >= 2 { r.start + (g.end - r.start).div_ceil(step) * step } else { g.end };
        }
        (best, best_count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_index_survives_the_cache_and_a_damaged_one_is_refused() {
        let ds = Datastore::from_sequences(vec![vec![5, 6, 7, 5, 6, 8], vec![5, 6, 7]]).unwrap();
        let bytes = ds.to_bytes();
        let back = Datastore::from_bytes(&bytes).unwrap();
        assert_eq!((back.tokens.clone(), back.sa.clone()), (ds.tokens.clone(), ds.sa.clone()));
        assert_eq!(back.continuation(&[1, 5, 6], 2, 0), ds.continuation(&[1, 5, 6], 2, 0));
        assert!(Datastore::from_bytes(&bytes[..bytes.len() - 4]).is_none(), "truncated");
        let mut bad = bytes.clone();
        let at = bad.len() - 4;
        bad[at..].copy_from_slice(&1000u32.to_le_bytes());
        assert!(Datastore::from_bytes(&bad).is_none(), "an entry outside the text");
        let mut sep = bytes.clone();
        sep[at..].copy_from_slice(&6u32.to_le_bytes()); // tokens[6] is the first separator
        assert!(Datastore::from_bytes(&sep).is_none(), "an entry on a separator");
        let mut huge = bytes;
        huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(Datastore::from_bytes(&huge).is_none(), "a count the bytes cannot back");
    }

    #[test]
    fn continues_the_most_frequent_follower_of_the_longest_match() {
        let mut ds = Datastore::from_sequences(vec![vec![1, 2, 3, 4, 5], vec![9, 2, 3, 4, 6], vec![7, 2, 3, 4, 5, 8], vec![1, 2, 3, 7]]).unwrap();
        ds.min_match = 1;
        ds.min_share = 0.0;
        // "2 3": followed by 4 three times, 7 once; then 4 -> 5 twice, 6 once; then 5 -> 8 once only.
        assert_eq!(ds.continuation(&[0, 2, 3], 5, 0), (2, vec![4, 5]));
        // The longer match "1 2 3" has two occurrences that disagree ("4" and "7"): one
        // follower is not enough support, so the shorter "2 3" speaks.
        assert_eq!(ds.continuation(&[1, 2, 3], 5, 0), (2, vec![4, 5]));
        assert_eq!(ds.continuation(&[9, 2, 3], 2, 0), (2, vec![4, 5]));
        assert_eq!(ds.continuation(&[3, 4], 1, 0), (2, vec![5]));
        // Nothing matches, or an empty context.
        assert_eq!(ds.continuation(&[42, 43], 4, 0), (0, vec![]));
        assert_eq!(ds.continuation(&[], 4, 0), (0, vec![]));
        // The end of a document is never copied: "4 5" ends one and is followed by 8 once.
        assert_eq!(ds.continuation(&[4, 5], 4, 0), (0, vec![]));
        // The share threshold stops a contested step: after "3", 4 holds 3 of 4 followers.
        ds.min_share = 0.7;
        assert_eq!(ds.continuation(&[0, 3], 1, 0), (1, vec![4]));
        ds.min_share = 0.9;
        assert_eq!(ds.continuation(&[0, 3], 1, 0), (0, vec![]));
        // Suffixes no longer than a caller's own match are not tried.
        ds.min_share = 0.0;
        assert_eq!(ds.continuation(&[0, 2, 3], 5, 0), (2, vec![4, 5]));
        assert_eq!(ds.continuation(&[0, 2, 3], 5, 2), (0, vec![]));
    }

    /// The continuation as first written: every suffix length from the longest, every run.
    fn continuation_by_full_walk(ds: &Datastore, context: &[u32], max_tokens: usize, longer_than: usize) -> (usize, Vec<u32>) {
        for n in (ds.min_match.max(longer_than + 1).max(1)..=ds.max_match.min(SORT_DEPTH / 2)).rev() {
            if context.len() < n {
                continue;
            }
            let mut r = ds.find(&context[context.len() - n..]);
            if r.is_empty() {
                continue;
            }
            let mut out = Vec::new();
            while out.len() < max_tokens && n + out.len() < SORT_DEPTH {
                let depth = n + out.len();
                let (mut best, mut best_count, mut i) = (SEP, 0, r.start);
                while i < r.end {
                    let tok = ds.at(i, depth);
                    let g = ds.narrow(i..r.end, depth, tok);
                    if tok != SEP && g.len() > best_count {
                        (best, best_count) = (tok, g.len());
                    }
                    i = g.end;
                }
                if best == SEP || best_count < 2 || (best_count as f64) < ds.min_share * r.len() as f64 {
                    break;
                }
                out.push(best);
                r = ds.narrow(r, depth, best);
            }
            if !out.is_empty() {
                return (n, out);
            }
        }
        (0, Vec::new())
    }

    #[test]
    fn sampled_runs_and_searched_lengths_give_the_full_walks_answer() {
        // Small alphabets make long shared suffixes and contested followers.
        let mut seed = 7u64;
        let mut next = |m: u32| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 33) % m as u64) as u32
        };
        for alphabet in [2u32, 3, 5, 9] {
            let seqs: Vec<Vec<u32>> = (0..30).map(|_| (0..60 + next(80)).map(|_| next(alphabet)).collect()).collect();
            let mut ds = Datastore::from_sequences(seqs).unwrap();
            for (share, min_match, max_match) in [(0.25, 2, 8), (0.1, 1, 12), (0.4, 2, 5), (0.0, 1, 8), (0.7, 3, 8)] {
                (ds.min_share, ds.min_match, ds.max_match) = (share, min_match, max_match);
                for _ in 0..300 {
                    let ctx: Vec<u32> = (0..next(14)).map(|_| next(alphabet)).collect();
                    let (max_tokens, longer) = (1 + next(6) as usize, next(4) as usize);
                    assert_eq!(ds.continuation(&ctx, max_tokens, longer), continuation_by_full_walk(&ds, &ctx, max_tokens, longer), "{ctx:?} share {share}");
                }
            }
        }
    }

    #[test]
    fn suffix_array_is_sorted_and_complete() {
        let seqs: Vec<Vec<u32>> = (0..40u32).map(|s| (0..(s % 7 + 3)).map(|i| (s * 31 + i * 17) % 5).collect()).collect();
        let total: usize = seqs.iter().map(Vec::len).sum();
        let ds = Datastore::from_sequences(seqs).unwrap();
        assert_eq!(ds.len(), total);
        for w in ds.sa.windows(2) {
            let k = |i: u32| &ds.tokens[i as usize..(i as usize + SORT_DEPTH).min(ds.tokens.len())];
            assert!(k(w[0]) <= k(w[1]));
        }
        // Every occurrence of a pattern is found, and only those.
        for pat in [&[1u32, 3][..], &[4], &[0, 2, 4], &[3, 3, 3, 3, 3]] {
            let brute = ds.tokens.windows(pat.len()).filter(|w| w == &pat).count();
            let r = ds.find(pat);
            assert_eq!(r.len(), brute, "{pat:?}");
            assert!(r.clone().all(|i| ds.tokens[ds.sa[i] as usize..].starts_with(pat)));
        }
        assert!(!ds.find(&[1, 3]).is_empty());
    }

    #[test]
    fn refuses_empty_and_reserved_input() {
        assert!(Datastore::from_sequences(Vec::<Vec<u32>>::new()).is_err());
        assert!(Datastore::from_sequences(vec![vec![]]).is_err());
        assert!(Datastore::from_sequences(vec![vec![1, u32::MAX]]).is_err());
    }
}
