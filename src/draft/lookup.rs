//! Drafting by copying from the context (prompt lookup), grafted onto the drafter's tree.
//!
//! Small instruction models repeat themselves: a phrase from the prompt, a variable name, a
//! sentence from two lines up. On SmolLM2-135M's own greedy answers, the tokens that followed
//! the latest earlier occurrence of the last 2-4 tokens are the next tokens 76% of the time when
//! such an occurrence exists (38% of positions; `examples/lookup.rs`). The drafter guesses from
//! features and is right elsewhere, so the two are combined: the copied continuation becomes one
//! more branch of the step's tree, merged into the drafter's nodes where they agree. It is a
//! function of the emitted text alone, so both acceptance rules stay exact.
use crate::draft::datastore::Datastore;
use crate::draft::tree::Tree;
use crate::{Error, Result};

/// Copy up to `max_tokens` tokens after the latest earlier occurrence of the context's last
/// `n` tokens, for the longest `n` in `min_match..=max_match` that occurs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lookup {
    pub max_tokens: usize,
    pub min_match: usize,
    pub max_match: usize,
}

impl Default for Lookup {
    fn default() -> Self {
        Lookup { max_tokens: 6, min_match: 2, max_match: 4 }
    }
}

impl Lookup {
    /// Split a tree spec like `dynamic:8+lookup` or `tree.json+lookup:4` into the tree part and
    /// the lookup (with `:N` tokens at most).
    pub fn split_spec(spec: &str) -> Result<(&str, Option<Lookup>)> {
        // A tree file whose name holds a '+' is just a tree file.
        if std::path::Path::new(spec).is_file() {
            return Ok((spec, None));
        }
        let Some((tree, extra)) = spec.rsplit_once('+') else { return Ok((spec, None)) };
        let n = match extra.strip_prefix("lookup") {
            Some("") => Lookup::default().max_tokens,
            Some(rest) => rest
                .strip_prefix(':')
                .and_then(|n| n.parse::<usize>().ok())
                .filter(|&n| n > 0)
                .ok_or_else(|| Error::InvalidTree(format!("'{spec}': expected +lookup or +lookup:N with N > 0")))?,
            None => return Err(Error::InvalidTree(format!("'{spec}': unknown addition '+{extra}' (only +lookup[:N])"))),
        };
        if tree.is_empty() {
            return Err(Error::InvalidTree(format!("'{spec}': a lookup extends a tree; name one before '+'")));
        }
        Ok((tree, Some(Lookup { max_tokens: n, ..Lookup::default() })))
    }

    /// The `"lookup": N` entry of a tree file (`tune` writes it when the lookup measured faster).
    pub fn from_tree_file(path: &std::path::Path) -> Result<Option<Lookup>> {
        let text = crate::files::read_config(path)?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::bad_file(path, format!("not JSON: {e}")))?;
        match v.get("lookup") {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(n) => match n.as_u64() {
                Some(n) if n > 0 => Ok(Some(Lookup { max_tokens: n as usize, ..Lookup::default() })),
                _ => Err(Error::bad_file(path, format!("\"lookup\" must be a positive token count, not {n}"))),
            },
        }
    }

    /// The tokens that followed the latest earlier occurrence of the context's longest matching
    /// suffix; empty when none occurs.
    pub fn continuation(&self, context: &[u32]) -> Vec<u32> {
        self.matched_continuation(context).1
    }

    /// [`Lookup::continuation`] with the length of the suffix it matched (0: none).
    pub fn matched_continuation(&self, context: &[u32]) -> (usize, Vec<u32>) {
        let len = context.len();
        for n in (self.min_match.max(1)..=self.max_match).rev() {
            if len <= n {
                continue;
            }
            let suffix = &context[len - n..];
            // Latest first: recent text is the likeliest to repeat.
            if let Some(s) = (0..len - n).rev().find(|&s| &context[s..s + n] == suffix) {
                return (n, context[s + n..].iter().take(self.max_tokens).copied().collect());
            }
        }
        (0, Vec::new())
    }

    /// What the step copies: the context's continuation, or the datastore's where that matched
    /// a longer suffix of the text (more evidence; on a tie the context, which is about this
    /// very answer). The flag says the copy came from the datastore.
    pub fn copy(&self, context: &[u32], datastore: Option<&Datastore>) -> (Vec<u32>, bool) {
        let (n, own) = self.matched_continuation(context);
        match datastore {
            Some(ds) => {
                let (m, stored) = ds.continuation(context, self.max_tokens, n);
                if m > n && !stored.is_empty() { (stored, true) } else { (own, false) }
            }
            None => (own, false),
        }
    }

    /// Graft `copied` under the root of `tree`: follow the drafter's nodes while they hold the
    /// same tokens, then add the rest as a chain, up to `max_nodes` nodes in all. Returns the
    /// copied branch: the node holding each copied token, the drafter's where it merged (new
    /// nodes are the ones past the tree's old length).
    pub fn graft(tree: &mut Tree, tokens: &mut Vec<u32>, copied: &[u32], max_nodes: usize) -> Vec<usize> {
        let mut at = 0;
        let mut branch = Vec::new();
        for &tok in copied {
            if let Some(&c) = tree.node(at).children.iter().find(|&&c| tokens[c] == tok) {
                at = c;
            } else if tree.len() < max_nodes {
                at = tree.add_child(at);
                tokens.push(tok);
            } else {
                break;
            }
            branch.push(at);
        }
        branch
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn continues_the_latest_longest_match() {
        let l = Lookup { max_tokens: 3, min_match: 2, max_match: 3 };
        // "1 2 3 9 ... 1 2 3 7 8 ... 2 3": the 2-token suffix [2, 3] last occurred before 7.
        assert_eq!(l.continuation(&[1, 2, 3, 9, 5, 1, 2, 3, 7, 8, 4, 2, 3]), vec![7, 8, 4]);
        // The 3-token match wins over a later 2-token one.
        assert_eq!(l.continuation(&[5, 2, 3, 6, 1, 2, 3, 4, 4, 9, 2, 3, 1, 2, 3]), vec![4, 4, 9]);
        assert!(l.continuation(&[1, 2, 3, 4]).is_empty());
        assert!(l.continuation(&[]).is_empty());
        // Runs up to the end of the context at most.
        assert_eq!(l.continuation(&[7, 7, 7]), vec![7]);
    }

    #[test]
    fn grafts_onto_matching_nodes_then_chains() {
        let l = Lookup { max_tokens: 4, min_match: 1, max_match: 1 };
        // Root token 5; the drafter proposed children 8 and 6, and 6 -> 2.
        let mut tree = Tree::from_paths(&[vec![0], vec![1], vec![1, 0]]).unwrap();
        let order: Vec<Vec<usize>> = tree.nodes().iter().map(|n| n.path.clone()).collect();
        let mut tokens: Vec<u32> = order.iter().map(|p| match p.as_slice() { [] => 5, [0] => 8, [1] => 6, _ => 2 }).collect();
        // Context "5 6 2 4 1 5": after the last 5 came 6 2 4 1.
        let before = tree.len();
        let branch = Lookup::graft(&mut tree, &mut tokens, &l.copy(&[5, 6, 2, 4, 1, 5], None).0, 100);
        assert_eq!(tree.len() - before, 2, "6 and 2 are the drafter's nodes; 4 and 1 are new");
        assert_eq!(tree.len(), 6);
        assert_eq!(branch.iter().map(|&i| tokens[i]).collect::<Vec<_>>(), vec![6, 2, 4, 1]);
        assert_eq!(&branch[2..], &[4, 5]);
        let last = tree.len() - 1;
        let path: Vec<u32> = tree.path_to(last).iter().map(|&i| tokens[i]).collect();
        assert_eq!(path, vec![5, 6, 2, 4, 1]);
        assert!(tree.nodes().iter().enumerate().all(|(i, n)| n.parent.is_none_or(|p| p < i)), "parents come first");
        // The node budget is respected.
        let mut small = Tree::from_paths(&[]).unwrap();
        let mut toks = vec![5];
        assert_eq!(Lookup::graft(&mut small, &mut toks, &l.copy(&[5, 6, 2, 4, 1, 5], None).0, 3), vec![1, 2]);
        assert_eq!(small.len(), 3);
    }

    #[test]
    fn copies_from_the_datastore_only_on_a_longer_match() {
        let l = Lookup { max_tokens: 3, min_match: 2, max_match: 4 };
        let mut ds = Datastore::from_sequences(vec![vec![4, 7, 8, 1, 2, 3], vec![9, 7, 8, 1, 2, 3], vec![5, 8, 1, 2, 6]]).unwrap();
        ds.min_share = 0.0;
        // The context holds "8 1 ... 8 1": a 2-token match, continued by 9. The store matches
        // "7 8 1" (3 tokens) twice, continued by 2 3.
        let ctx = [8, 1, 9, 5, 7, 8, 1];
        assert_eq!(l.matched_continuation(&ctx), (2, vec![9, 5, 7]));
        assert_eq!(l.copy(&ctx, None), (vec![9, 5, 7], false));
        assert_eq!(l.copy(&ctx, Some(&ds)), (vec![2, 3], true));
        // Where the context's own match is as long, it wins.
        let ctx = [7, 8, 1, 4, 7, 8, 1];
        assert_eq!(l.copy(&ctx, Some(&ds)), (vec![4, 7, 8], false));
    }

    #[test]
    fn parses_specs() {
        assert_eq!(Lookup::split_spec("cpu").unwrap(), ("cpu", None));
        let (t, l) = Lookup::split_spec("dynamic:8+lookup").unwrap();
        assert_eq!((t, l.unwrap().max_tokens), ("dynamic:8", Lookup::default().max_tokens));
        assert_eq!(Lookup::split_spec("runs/t.json+lookup:3").unwrap().1.unwrap().max_tokens, 3);
        assert!(Lookup::split_spec("cpu+lookup:0").is_err());
        assert!(Lookup::split_spec("cpu+ngram").is_err());
        assert!(Lookup::split_spec("+lookup").is_err());
        let d = std::env::temp_dir().join(format!("selfspec-lookup-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let f = d.join("t.json");
        std::fs::write(&f, r#"{"paths": [[0]], "lookup": 5}"#).unwrap();
        assert_eq!(Lookup::from_tree_file(&f).unwrap().unwrap().max_tokens, 5);
        std::fs::write(&f, r#"{"paths": [[0]], "lookup": null}"#).unwrap();
        assert!(Lookup::from_tree_file(&f).unwrap().is_none());
        std::fs::write(&f, r#"{"paths": [[0]], "lookup": -2}"#).unwrap();
        assert!(Lookup::from_tree_file(&f).unwrap_err().to_string().contains("t.json"));
        let plus = d.join("a+b.json");
        std::fs::write(&plus, "[[0]]").unwrap();
        let name = plus.to_str().unwrap();
        assert_eq!(Lookup::split_spec(name).unwrap(), (name, None));
    }
}
