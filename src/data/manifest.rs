//! The corpus manifest (`training/corpus.toml`): every data set the project trains or retrieves
//! from, with where its prompts and answers live and how the answers were decoded.
//!
//! Why a manifest: `--datastore training/data` used to index whatever files happened to be in the
//! folder, so a stray file changed every speed-up measured with it. Now the manifest names the
//! files, and a set is in the datastore only when it says `datastore = true`.
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::{Error, Result};

/// Largest manifest read: it lists files, it does not hold data.
pub const MAX_MANIFEST_BYTES: u64 = 1 << 20;

/// One data set: a prompts file and the target's answers to it.
#[derive(Debug, Clone, Deserialize)]
pub struct DataSet {
    /// Unique name, e.g. `distill2`.
    pub id: String,
    #[serde(default)]
    pub description: String,
    /// The program that wrote the prompts (`make-prompts distill2`), or `hand-written`.
    #[serde(default)]
    pub generator: String,
    /// Relative to the manifest's folder.
    pub prompts: Option<PathBuf>,
    /// Relative to the manifest's folder: distill JSONL (or plain text).
    pub answers: PathBuf,
    /// Which target answered.
    #[serde(default)]
    pub target: String,
    /// `selfspec distill` flags beyond `--model`, `--prompts` and `--out`.
    #[serde(default)]
    pub decode: Vec<String>,
    pub records: Option<u64>,
    pub tokens: Option<u64>,
    /// Of the answers file as committed (greedy distillation is deterministic).
    pub sha256: Option<String>,
    /// Whether `--datastore MANIFEST` indexes this set.
    #[serde(default)]
    pub datastore: bool,
}

/// Prompts used only to measure, never to train.
#[derive(Debug, Clone, Deserialize)]
pub struct EvalSet {
    pub id: String,
    pub prompts: PathBuf,
    #[serde(default)]
    pub description: String,
}

/// A parsed manifest with its paths resolved against its own folder.
#[derive(Debug, Clone, Deserialize)]
pub struct Manifest {
    #[serde(default, rename = "set")]
    pub sets: Vec<DataSet>,
    #[serde(default, rename = "eval")]
    pub evals: Vec<EvalSet>,
}

/// Whether `path` names a manifest rather than data (by its `.toml` extension).
pub fn is_manifest(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "toml")
}

impl Manifest {
    /// Read and check a manifest: bounded size, unique ids, at least one set.
    pub fn read(path: &Path) -> Result<Manifest> {
        let text = crate::files::read_text(path, MAX_MANIFEST_BYTES, "a corpus manifest")?;
        let mut m: Manifest = toml::from_str(&text).map_err(|e| Error::bad_file(path, format!("not a corpus manifest: {e}")))?;
        if m.sets.is_empty() {
            return Err(Error::bad_file(path, "the manifest lists no [[set]]"));
        }
        let dir = path.parent().unwrap_or(Path::new("."));
        let mut seen = std::collections::HashSet::new();
        for s in &mut m.sets {
            if !seen.insert(s.id.clone()) {
                return Err(Error::bad_file(path, format!("set id '{}' appears twice", s.id)));
            }
            s.answers = dir.join(&s.answers);
            s.prompts = s.prompts.as_ref().map(|p| dir.join(p));
        }
        for e in &mut m.evals {
            e.prompts = dir.join(&e.prompts);
        }
        Ok(m)
    }

    /// The answers files of the sets marked `datastore = true`, in manifest order.
    pub fn datastore_files(&self) -> Vec<PathBuf> {
        self.sets.iter().filter(|s| s.datastore).map(|s| s.answers.clone()).collect()
    }

    /// Every set's answers file, in manifest order.
    pub fn answer_files(&self) -> Vec<PathBuf> {
        self.sets.iter().map(|s| s.answers.clone()).collect()
    }
}

/// The files `--datastore` indexes: each manifest's `datastore = true` sets, and files named
/// directly. A directory is refused: its contents change as files land in it.
pub fn datastore_files(inputs: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for p in inputs {
        if is_manifest(p) {
            let m = Manifest::read(p)?;
            let files = m.datastore_files();
            if files.is_empty() {
                return Err(Error::bad_file(p, "no set in the manifest has `datastore = true`"));
            }
            out.extend(files);
        } else if p.is_dir() {
            return Err(Error::bad_file(p, "--datastore takes a corpus manifest (training/corpus.toml) or files, not a directory"));
        } else {
            out.push(p.clone());
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("selfspec-manifest-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn manifest_resolves_paths_and_filters_the_datastore() {
        let d = scratch("ok");
        let m = d.join("corpus.toml");
        std::fs::write(&m, "[[set]]\nid = \"a\"\nanswers = \"data/a.jsonl\"\ndatastore = true\n\n[[set]]\nid = \"b\"\nanswers = \"data/b.jsonl\"\n\n[[eval]]\nid = \"e\"\nprompts = \"prompts/e.jsonl\"\n").unwrap();
        let man = Manifest::read(&m).unwrap();
        assert_eq!(man.answer_files(), vec![d.join("data/a.jsonl"), d.join("data/b.jsonl")]);
        assert_eq!(man.datastore_files(), vec![d.join("data/a.jsonl")]);
        assert_eq!(man.evals[0].prompts, d.join("prompts/e.jsonl"));
        let f = d.join("x.jsonl");
        assert_eq!(datastore_files(&[m.clone(), f.clone()]).unwrap(), vec![d.join("data/a.jsonl"), f]);
        std::fs::remove_dir_all(&d).ok();
    }

    #[test]
    fn bad_manifests_and_directories_are_refused() {
        let d = scratch("bad");
        let m = d.join("corpus.toml");
        std::fs::write(&m, "[[set]]\nid = \"a\"\nanswers = \"a.jsonl\"\n[[set]]\nid = \"a\"\nanswers = \"b.jsonl\"\n").unwrap();
        assert!(Manifest::read(&m).unwrap_err().to_string().contains("appears twice"));
        std::fs::write(&m, "[[set]]\nid = \"a\"\n").unwrap();
        assert!(Manifest::read(&m).unwrap_err().to_string().contains("not a corpus manifest"));
        std::fs::write(&m, "[[set]]\nid = \"a\"\nanswers = \"a.jsonl\"\n").unwrap();
        assert!(datastore_files(std::slice::from_ref(&m)).unwrap_err().to_string().contains("datastore = true"));
        assert!(datastore_files(std::slice::from_ref(&d)).unwrap_err().to_string().contains("not a directory"));
        std::fs::remove_dir_all(&d).ok();
    }
}
