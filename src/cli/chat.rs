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

/// One message from `input`: a line, joined with the next while it ends in `\`. None at the end
/// of input.
fn read_message<R: BufRead>(input: &mut R) -> Result<Option<String>> {
    let mut message = String::new();
    loop {
        let mut line = String::new();
        let n = <&mut R as std::io::Read>::take(&mut *input, (MAX_MESSAGE + 1 - message.len().min(MAX_MESSAGE)) as u64).read_line(&mut line)?;
        if n == 0 {
            return Ok((!message.is_empty()).then_some(message));
        }
        if message.len() + line.len() > MAX_MESSAGE {
            bail!("a message longer than {} MiB", MAX_MESSAGE >> 20);
        }
        let line = line.trim_end_matches(['\n', '\r']);
        match line.strip_suffix('\\') {
            Some(part) => {
                message.push_str(part);
                message.push('\n');
            }
            None => {
                message.push_str(line);
                return Ok(Some(message));
            }
        }
    }
}

pub fn run(a: ChatArgs) -> Result<()> {
    let params = a.sampling.params()?;
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let plan = Plan::parse(&a.tree)?;
    let t0 = std::time::Instant::now();
    let mut target = a.model.load()?;
    let drafter = a.drafter.load(&mut target)?;
    let datastore = a.drafter.datastore(&target)?;
    eprintln!("loaded {} ({} weights){} in {:.2} s", target.path.display(), target.model.weight_format(), if drafter.is_some() { " and its drafter" } else { "" }, t0.elapsed().as_secs_f64());
    if let Some(n) = target.plain_prompts_note() {
        eprintln!("{n} (the turns are joined as plain text)");
    }
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
        let Some(message) = read_message(&mut input)? else { break };
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
                writeln!(stdout, "{rest}")?;
                stdout.flush()?;
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
                writeln!(stdout)?;
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
        let mut input = std::io::Cursor::new("hello\r\nfirst \\\nsecond\nlast without newline");
        assert_eq!(read_message(&mut input).unwrap().as_deref(), Some("hello"));
        assert_eq!(read_message(&mut input).unwrap().as_deref(), Some("first \nsecond"));
        assert_eq!(read_message(&mut input).unwrap().as_deref(), Some("last without newline"));
        assert_eq!(read_message(&mut input).unwrap(), None);
        let long = "x".repeat(MAX_MESSAGE + 10);
        assert!(read_message(&mut std::io::Cursor::new(long)).is_err(), "a message past the bound is refused");
    }
}
