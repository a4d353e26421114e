//! `selfspec chat`: an interactive conversation in the terminal (llama-cli's conversation
//! mode), each turn decoded from the last turn's cache, with self-speculation when --drafter.
use std::io::{BufRead, IsTerminal, Write};

use anyhow::{bail, Result};
use clap::Args;
use selfspec::decode::generate::{Flow, StopRule, TextStream};
use selfspec::decode::sampling::rng;
use selfspec::spec::plan::{Plan, DEFAULT_TREE};
use selfspec::spec::verify::Rule;
use selfspec::spec::{Conversation, SpecOptions};

use crate::cli::args::{DrafterArgs, ModelArgs, SamplingArgs};

/// The longest message read from the terminal (bytes): far more than any context holds.
const MAX_MESSAGE: usize = 1 << 20;

/// Type a message and press Enter; end a line with `\` to go on to the next. `/reset` starts
/// over (the system message stays), `/exit` or end of input (Ctrl-D) ends. Messages can also
/// be piped in, one per line.
#[derive(Args)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// A system message opening the conversation (without it the template's own default, if it
    /// has one; "" removes that default).
    #[arg(long)]
    system: Option<String>,
    /// New tokens per answer at most.
    #[arg(long, default_value_t = 512)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    drafter: DrafterArgs,
    /// The tree each step drafts (as `generate --tree`).
    #[arg(long, default_value = DEFAULT_TREE, requires = "drafter", help_heading = "Drafter")]
    tree: String,
}

/// What one read of the input gives.
#[derive(Debug, PartialEq)]
enum Input {
    Message(String),
    /// A message that cannot be taken (too long, not UTF-8), and why; the session goes on.
    Refused(String),
    End,
}

/// One message from `input`: a line, joined with the next while it ends in `\`. A message past
/// [`MAX_MESSAGE`] bytes is refused (the rest of its line skipped) without reading it whole.
fn read_message<R: BufRead>(input: &mut R) -> std::io::Result<Input> {
    let mut message: Vec<u8> = Vec::new();
    loop {
        let mut line = Vec::new();
        let room = MAX_MESSAGE - message.len();
        // A line end more than the room allows is still read: it is not part of the message.
        let n = <&mut R as std::io::Read>::take(&mut *input, room as u64 + 2).read_until(b'\n', &mut line)?;
        if n == 0 {
            return Ok(if message.is_empty() { Input::End } else { text(message) });
        }
        let ended = line.ends_with(b"\n");
        while line.last().is_some_and(|&b| b == b'\n' || b == b'\r') {
            line.pop();
        }
        if line.len() > room {
            if !ended {
                let mut rest = Vec::new();
                input.read_until(b'\n', &mut rest)?;
            }
            return Ok(Input::Refused(format!("a message of more than {} MiB", MAX_MESSAGE >> 20)));
        }
        match line.strip_suffix(b"\\") {
            Some(part) if ended => {
                message.extend_from_slice(part);
                message.push(b'\n');
            }
            _ => {
                message.extend_from_slice(&line);
                return Ok(text(message));
            }
        }
    }
}

fn text(bytes: Vec<u8>) -> Input {
    match String::from_utf8(bytes) {
        Ok(s) => Input::Message(s),
        Err(e) => Input::Refused(format!("a message that is not UTF-8 text (byte {})", e.utf8_error().valid_up_to())),
    }
}

/// `r`, with a reader that went away (`| head`) turned into `Ok(false)`: the session ends
/// quietly, as `generate` does.
fn written(r: std::io::Result<()>) -> Result<bool> {
    match r {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
        Err(e) => Err(anyhow::anyhow!("standard output: {e}")),
    }
}

pub fn run(a: ChatArgs) -> Result<()> {
    let params = a.sampling.params()?;
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let plan = Plan::parse(&a.tree)?;
    let (target, drafter, datastore) = a.drafter.load_with(&a.model, "the turns")?;
    let opts = SpecOptions {
        tree: plan.tree,
        lookup: plan.lookup,
        datastore: datastore.as_ref(),
        rule: Rule::for_params(&params, false),
        params: params.clone(),
        stop: StopRule { max_new_tokens: a.max_tokens, eos_ids: &target.tokenizer.eos_ids },
    };
    let mut convo = Conversation::new(drafter.as_ref(), a.system.clone());
    let mut r = rng(a.sampling.seed);
    let interactive = std::io::stdin().is_terminal();
    if interactive {
        eprintln!("type a message and press Enter (a line ending in \\ goes on); /reset starts over, /exit or Ctrl-D ends");
    }
    let mut input = std::io::stdin().lock();
    loop {
        if interactive {
            eprint!("> ");
        }
        let message = match read_message(&mut input)? {
            Input::Message(m) => m,
            Input::Refused(why) => {
                eprintln!("error: {why}: not sent");
                continue;
            }
            Input::End => break,
        };
        match message.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                convo.reset();
                eprintln!("(conversation reset)");
                continue;
            }
            _ => {}
        }
        let mut stream = TextStream::new(&target.tokenizer);
        let mut stdout = std::io::stdout().lock();
        let eos = &target.tokenizer.eos_ids;
        let mut print = |t: u32| -> selfspec::Result<Flow> {
            if !eos.contains(&t) {
                let piece = stream.push(t)?.unwrap_or_default();
                stdout.write_all(piece.as_bytes()).and_then(|_| stdout.flush()).map_err(|err| selfspec::Error::Io { path: "standard output".into(), err })?;
            }
            Ok(Flow::Continue)
        };
        match convo.reply(&target, &message, &opts, &mut r, &mut print) {
            Ok(reply) => {
                let rest = stream.finish()?.unwrap_or_default();
                if !written(writeln!(stdout, "{rest}").and_then(|_| stdout.flush()))? {
                    return Ok(());
                }
                let g = &reply.stats.gen;
                eprintln!(
                    "[{} tokens, {:.1} tok/s, tau {:.2} tokens/forward (bonus token counted; plain = 1.00); prompt {} tokens, {} from the last turn's cache]",
                    g.new_tokens,
                    g.decode_tok_s(),
                    reply.stats.tau(),
                    g.prompt_tokens,
                    reply.stats.cached_prompt_tokens
                );
            }
            Err(selfspec::Error::Io { err, .. }) if err.kind() == std::io::ErrorKind::BrokenPipe => return Ok(()),
            Err(e) => {
                if !written(writeln!(stdout).and_then(|_| stdout.flush()))? {
                    return Ok(());
                }
                eprintln!("error: {e} (the turn is not kept; /reset starts over)");
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_is_a_line_or_lines_joined_by_a_trailing_backslash() {
        let mut input = std::io::Cursor::new("hello\r\nfirst \\\nsecond\nlast without newline".as_bytes());
        assert_eq!(read_message(&mut input).unwrap(), Input::Message("hello".into()));
        assert_eq!(read_message(&mut input).unwrap(), Input::Message("first \nsecond".into()));
        assert_eq!(read_message(&mut input).unwrap(), Input::Message("last without newline".into()));
        assert_eq!(read_message(&mut input).unwrap(), Input::End);
        // Too long: refused, its line skipped, the next message read as usual; exactly the
        // bound is taken.
        let mut long = "x".repeat(MAX_MESSAGE + 10);
        long.push_str("\nnext\n");
        long.push_str(&"y".repeat(MAX_MESSAGE));
        long.push('\n');
        let mut input = std::io::Cursor::new(long.into_bytes());
        assert!(matches!(read_message(&mut input).unwrap(), Input::Refused(w) if w.contains("more than 1 MiB")));
        assert_eq!(read_message(&mut input).unwrap(), Input::Message("next".into()));
        assert!(matches!(read_message(&mut input).unwrap(), Input::Message(m) if m.len() == MAX_MESSAGE));
        let mut input = std::io::Cursor::new(b"caf\xe9\nok\n".to_vec());
        assert!(matches!(read_message(&mut input).unwrap(), Input::Refused(w) if w.contains("not UTF-8")));
        assert_eq!(read_message(&mut input).unwrap(), Input::Message("ok".into()));
    }
}
