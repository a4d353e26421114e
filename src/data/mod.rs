//! Training and evaluation text: prompt files, distill JSONL records and plain-text corpora.
use std::path::{Path, PathBuf};

pub mod manifest;

use serde::{Deserialize, Serialize};

use crate::model::tokenizer::Message;
use crate::{Error, Result};

/// One prompt: a single turn, or several turns where later ones follow the model's own answers.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptItem {
    pub id: String,
    pub category: String,
    pub turns: Vec<String>,
}

/// Read a prompt file: one prompt per line, or JSONL with `"prompt"` or `"turns"` (MT-Bench /
/// Spec-Bench style, with optional `"question_id"` and `"category"`). Records with
/// `"finished": false` (prompts the model did not finish, from `distill --self-prompts`) are
/// skipped.
pub fn read_prompts(path: &Path) -> Result<Vec<PromptItem>> {
    let bytes = crate::files::read_data(path)?;
    let text = String::from_utf8(bytes).map_err(|_| Error::bad_file(path, "not UTF-8 text"))?;
    let mut out = Vec::new();
    let mut unfinished = 0;
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if line.starts_with('{') {
            let v: serde_json::Value = serde_json::from_str(line).map_err(|e| Error::bad_file(path, format!("line {}: invalid JSON: {e}", i + 1)))?;
            // A prompt `distill --self-prompts` wrote but the model did not finish.
            if v.get("finished").and_then(|f| f.as_bool()) == Some(false) {
                unfinished += 1;
                continue;
            }
            let turns: Vec<String> = if let Some(p) = v.get("prompt").and_then(|p| p.as_str()) {
                vec![p.to_string()]
            } else if let Some(t) = v.get("turns").and_then(|t| t.as_array()) {
                t.iter().filter_map(|x| x.as_str().map(str::to_string)).collect()
            } else {
                return Err(Error::bad_file(path, format!("line {}: JSON needs \"prompt\" or \"turns\"", i + 1)));
            };
            if turns.is_empty() {
                return Err(Error::bad_file(path, format!("line {}: no turns", i + 1)));
            }
            let id = v.get("question_id").map(|q| q.to_string().trim_matches('"').to_string()).unwrap_or_else(|| format!("{}", i + 1));
            let category = v.get("category").and_then(|c| c.as_str()).unwrap_or("general").to_string();
            out.push(PromptItem { id, category, turns });
        } else {
            out.push(PromptItem { id: format!("{}", i + 1), category: "general".into(), turns: vec![line.to_string()] });
        }
    }
    if out.is_empty() {
        let why = if unfinished > 0 { format!("no prompts in the file ({unfinished} unfinished ones skipped)") } else { "no prompts in the file".into() };
        return Err(Error::bad_file(path, why));
    }
    Ok(out)
}

/// One self-distilled conversation: what the target answered, turn by turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DistillRecord {
    pub id: String,
    pub messages: Vec<Message>,
    pub new_tokens: usize,
}

/// A training document and the byte ranges of it whose tokens the drafter should learn to guess.
#[derive(Debug, Clone, PartialEq)]
pub struct Document {
    pub text: String,
    /// `None`: every token (plain text). For a rendered conversation, the assistant's answers
    /// only: the chat template and system prompt recur in every record, are trivially
    /// predictable, and would otherwise dominate the loss and inflate the held-out accuracy.
    pub scored: Option<Vec<std::ops::Range<usize>>>,
}

impl Document {
    pub fn plain(text: impl Into<String>) -> Self {
        Document { text: text.into(), scored: None }
    }

    /// A rendered conversation, scoring the assistant turns: each answer is looked up in the
    /// rendered text after everything before it (the rendering of the earlier messages, which
    /// chat templates keep as a prefix). When a template rewrites an answer so it cannot be
    /// found, the whole text is scored, as for plain text.
    pub fn conversation(messages: &[Message], render: &dyn Fn(&[Message]) -> Result<String>) -> Result<Self> {
        let text = render(messages)?;
        let mut spans = Vec::new();
        let mut pos = 0;
        for (i, m) in messages.iter().enumerate().filter(|(_, m)| m.role == "assistant") {
            let answer = m.content.trim();
            if answer.is_empty() {
                continue;
            }
            let before = render(&messages[..i])?;
            if text.starts_with(&before) {
                pos = pos.max(before.len());
            }
            match text[pos..].find(answer) {
                Some(at) => {
                    spans.push(pos + at..pos + at + answer.len());
                    pos += at + answer.len();
                }
                None => return Ok(Document { text, scored: None }),
            }
        }
        Ok(Document { text, scored: Some(spans) })
    }

    /// Whether the token starting at byte `offset` is scored.
    pub fn scores(&self, offset: usize) -> bool {
        self.scored.as_ref().is_none_or(|s| s.iter().any(|r| r.contains(&offset)))
    }
}

/// Training documents from text files, directories of text files, distill JSONL, and corpus
/// manifests (every set's answers; [`manifest`])
/// (conversations rendered through `render`, so they look like inference-time text).
pub fn read_corpus(paths: &[PathBuf], render: &dyn Fn(&[Message]) -> Result<String>) -> Result<Vec<Document>> {
    let mut files = Vec::new();
    for p in paths {
        collect_files(p, &mut files)?;
    }
    let mut docs = Vec::new();
    for f in &files {
        let bytes = crate::files::read_data(f)?;
        let text = String::from_utf8(bytes).map_err(|_| Error::bad_file(f, "not UTF-8 text (convert it, or leave it out)"))?;
        if f.extension().is_some_and(|e| e == "jsonl") {
            for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
                let v: serde_json::Value = serde_json::from_str(line).map_err(|e| Error::bad_file(f, format!("line {}: invalid JSON: {e}", i + 1)))?;
                if let Some(t) = v.get("text").and_then(|t| t.as_str()) {
                    docs.push(Document::plain(t));
                } else if v.get("messages").is_some() {
                    let r: DistillRecord = serde_json::from_value(v).map_err(|e| Error::bad_file(f, format!("line {}: {e}", i + 1)))?;
                    docs.push(Document::conversation(&r.messages, render)?);
                } else {
                    return Err(Error::bad_file(f, format!("line {}: expected \"text\" or \"messages\"", i + 1)));
                }
            }
        } else if !text.trim().is_empty() {
            docs.push(Document::plain(text));
        }
    }
    if docs.iter().all(|d| d.text.trim().is_empty()) {
        let names: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
        return Err(Error::bad_file(names.join(", "), "empty corpus: no text in it"));
    }
    Ok(docs)
}

fn collect_files(p: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    if manifest::is_manifest(p) {
        out.extend(manifest::Manifest::read(p)?.answer_files());
        return Ok(());
    }
    let meta = std::fs::metadata(p).map_err(|e| Error::io(p, e))?;
    if meta.is_dir() {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(p).map_err(|e| Error::io(p, e))?.filter_map(|e| e.ok().map(|e| e.path())).collect();
        entries.sort();
        for e in entries {
            collect_files(&e, out)?;
        }
    } else {
        out.push(p.to_path_buf());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_formats() {
        let d = std::env::temp_dir().join(format!("selfspec-data-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join("p.jsonl");
        std::fs::write(&p, "plain line\n{\"prompt\": \"json one\"}\n{\"question_id\": 7, \"category\": \"math\", \"turns\": [\"a\", \"b\"]}\n").unwrap();
        let items = read_prompts(&p).unwrap();
        assert_eq!(items.len(), 3);
        assert_eq!(items[2].turns, vec!["a", "b"]);
        assert_eq!(items[2].category, "math");
        assert_eq!(items[2].id, "7");
        // Prompts the model did not finish (distill --self-prompts) are skipped.
        std::fs::write(&p, "{\"question_id\": \"self-0\", \"prompt\": \"cut\", \"finished\": false}\n{\"question_id\": \"self-1\", \"prompt\": \"whole\", \"finished\": true}\n").unwrap();
        let items = read_prompts(&p).unwrap();
        assert_eq!((items.len(), items[0].id.as_str(), items[0].turns[0].as_str()), (1, "self-1", "whole"));
        std::fs::write(&p, "{\"question_id\": \"self-0\", \"prompt\": \"cut\", \"finished\": false}\n").unwrap();
        assert!(read_prompts(&p).unwrap_err().to_string().contains("1 unfinished"));
        std::fs::write(&p, "\n\n").unwrap();
        assert!(read_prompts(&p).is_err());
        let bad = d.join("bad.txt");
        std::fs::write(&bad, [0xffu8, 0xfe, 0x00]).unwrap();
        let e = read_corpus(std::slice::from_ref(&bad), &|_| Ok(String::new())).unwrap_err().to_string();
        assert!(e.contains("bad.txt") && e.contains("UTF-8"), "{e}");
        let empty = d.join("empty.txt");
        std::fs::write(&empty, "  \n").unwrap();
        assert!(read_corpus(&[empty], &|_| Ok(String::new())).unwrap_err().to_string().contains("empty corpus"));
    }

    #[test]
    fn conversations_score_only_the_answers() {
        let msg = |role: &str, content: &str| Message::new(role, content);
        let render = |m: &[Message]| -> Result<String> { Ok(m.iter().map(|x| format!("<{}>{}</>", x.role, x.content)).collect()) };
        let conv = [msg("system", "be nice"), msg("user", "say hi"), msg("assistant", " hi "), msg("user", "hi again"), msg("assistant", "hi")];
        let d = Document::conversation(&conv, &render).unwrap();
        // "hi" in "say hi" and "hi again" is not scored: each answer is found after the previous one.
        let spans = d.scored.clone().unwrap();
        assert_eq!(spans.len(), 2);
        assert_eq!(&d.text[spans[0].clone()], "hi");
        assert_eq!(&d.text[spans[1].clone()], "hi");
        assert!(spans[0].start > d.text.find("say hi").unwrap() + 4);
        assert!(spans[1].start > d.text.find("hi again").unwrap() + 2);
        assert!(d.scores(spans[1].start) && !d.scores(0) && !d.scores(d.text.find("hi again").unwrap()));
        // A template that rewrites the answer: everything is scored.
        let upper = |m: &[Message]| -> Result<String> { Ok(m.iter().map(|x| x.content.to_uppercase()).collect()) };
        let d = Document::conversation(&conv, &upper).unwrap();
        assert!(d.scored.is_none() && d.scores(0));
        assert!(Document::plain("x").scores(0));
    }
}
