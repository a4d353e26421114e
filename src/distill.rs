//! Self-distillation: the target answers prompts through its chat template, and each answer is
//! appended to a JSONL file as soon as it is complete, so a killed run resumes where it stopped.
use std::io::Write;
use std::path::Path;

use crate::data::{DistillRecord, PromptItem};
use crate::generate::{generate_plain, StopRule};
use crate::loader::Target;
use crate::sampling::{rng, SamplingParams};
use crate::tokenizer::Message;
use crate::{Error, Result};

/// Ids already answered in `out` (resume support). A torn last line is ignored.
pub fn done_ids(out: &Path) -> Result<std::collections::HashSet<String>> {
    let mut s = std::collections::HashSet::new();
    if !out.exists() {
        return Ok(s);
    }
    let text = std::fs::read_to_string(out).map_err(|e| Error::io(out, e))?;
    for line in text.lines() {
        if let Ok(r) = serde_json::from_str::<DistillRecord>(line) {
            s.insert(r.id);
        }
    }
    Ok(s)
}

/// Answer one (possibly multi-turn) prompt; later turns follow the model's own earlier answers.
pub fn answer(target: &Target, item: &PromptItem, params: &SamplingParams, max_tokens: usize, seed: u64) -> Result<DistillRecord> {
    let mut messages = Vec::new();
    let mut total = 0;
    let mut r = rng(seed);
    for turn in &item.turns {
        messages.push(Message { role: "user".into(), content: turn.clone() });
        let text = target.chat_prompt(&messages)?;
        let ids = target.tokenizer.encode(&text, false)?;
        let stop = StopRule { max_new_tokens: max_tokens, eos_ids: &target.tokenizer.eos_ids };
        let (mut out, _) = generate_plain(&target.model, &ids, params, &stop, &mut r, &mut |_| Ok(()))?;
        total += out.len();
        if out.last().is_some_and(|t| target.tokenizer.is_eos(*t)) {
            out.pop();
        }
        messages.push(Message { role: "assistant".into(), content: target.tokenizer.decode(&out)? });
    }
    Ok(DistillRecord { id: item.id.clone(), messages, new_tokens: total })
}

fn ends_with_newline(path: &Path) -> Result<bool> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let len = f.metadata().map_err(|e| Error::io(path, e))?.len();
    if len == 0 {
        return Ok(true);
    }
    let mut b = [0u8; 1];
    f.seek(SeekFrom::End(-1)).and_then(|_| f.read_exact(&mut b)).map_err(|e| Error::io(path, e))?;
    Ok(b[0] == b'\n')
}

/// Append one record as a single line and flush, so a kill loses at most the answer in flight.
pub fn append_record(out: &Path, rec: &DistillRecord) -> Result<()> {
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    }
    // A run killed mid-write leaves a torn last line: cut it off (that answer is redone).
    if out.exists() && !ends_with_newline(out)? {
        let text = std::fs::read(out).map_err(|e| Error::io(out, e))?;
        if !text.is_empty() {
            let keep = text.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
            let f = std::fs::OpenOptions::new().write(true).open(out).map_err(|e| Error::io(out, e))?;
            f.set_len(keep as u64).map_err(|e| Error::io(out, e))?;
        }
    }
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(out).map_err(|e| Error::io(out, e))?;
    let mut line = serde_json::to_string(rec).expect("record serialises");
    line.push('\n');
    f.write_all(line.as_bytes()).map_err(|e| Error::io(out, e))?;
    f.sync_data().map_err(|e| Error::io(out, e))
}
