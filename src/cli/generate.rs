//! `selfspec generate`: decode one prompt plainly, or self-speculatively with `--drafter`.
use std::io::{Read, Write};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use selfspec::decode::generate::{check_budget, generate_plain, Flow, GenStats, StopMatch, StopRule, TextStream};
use selfspec::model::tokenizer::Message;
use selfspec::decode::sampling::rng;
use selfspec::spec::plan::{Plan, DEFAULT_TREE};
use selfspec::spec::verify::Rule;
use selfspec::spec::{generate_spec, SpecOptions, SpecStats};

use crate::cli::args::{DrafterArgs, ModelArgs, SamplingArgs};

/// The largest `--prompt-file` read (bytes): far more text than any context holds.
const MAX_PROMPT_FILE: u64 = 16 << 20;

#[derive(Args)]
#[command(group = clap::ArgGroup::new("input").required(true).args(["prompt", "prompt_file"]))]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt text (wrapped in the chat template with --chat).
    #[arg(long)]
    prompt: Option<String>,
    /// Read the prompt from a file (`-`: standard input), as llama-cli's `-f`.
    #[arg(long, value_name = "PATH")]
    prompt_file: Option<PathBuf>,
    /// Wrap the prompt in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// A system message before the prompt (with --chat; without it the template's own default,
    /// if it has one; "" removes that default).
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// New tokens at most (fewer when the end-of-sequence token comes first or the context fills).
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Decode past the end-of-sequence token, to --max-tokens (for benchmarks of a fixed length).
    #[arg(long)]
    ignore_eos: bool,
    /// End the answer where this text appears (repeat for several), as vLLM's `stop` and
    /// llama-cli's `-r`; the text itself is not printed. Special tokens (end of sequence, chat
    /// markers) print no text, so they never match.
    #[arg(long, value_name = "TEXT")]
    stop: Vec<String>,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    drafter: DrafterArgs,
    /// cpu (8 nodes), gpu (64), chain, chain:N, dynamic, dynamic:N, auto, auto:N (cut per step
    /// by this device's measured costs), or a tree JSON file; append +lookup[:N] to graft up to
    /// N tokens copied from the context (prompt lookup). See docs/trees.md.
    #[arg(long, default_value = DEFAULT_TREE, requires = "drafter", help_heading = "Drafter")]
    tree: String,
    /// Medusa's typical acceptance. LOSSY: the output no longer follows the target's distribution.
    #[arg(long, help_heading = "Drafter")]
    lossy_typical: bool,
    /// Also run plain decoding on the same prompt and print both speeds and the speed-up.
    #[arg(long, requires = "drafter")]
    compare: bool,
}

/// The prompt from `--prompt` or `--prompt-file` (`-`: standard input), size checked first.
fn read_prompt(a: &GenerateArgs) -> Result<String> {
    let Some(path) = &a.prompt_file else {
        return Ok(a.prompt.clone().unwrap_or_default());
    };
    let mut bytes = Vec::new();
    let what = if path.as_os_str() == "-" {
        std::io::stdin().lock().take(MAX_PROMPT_FILE + 1).read_to_end(&mut bytes).with_context(|| "--prompt-file -: reading standard input")?;
        "standard input".to_string()
    } else {
        let meta = std::fs::metadata(path).with_context(|| format!("--prompt-file {}", path.display()))?;
        if meta.is_dir() {
            bail!("--prompt-file {}: a directory, not a file", path.display());
        }
        // A pipe (`<(...)`) has no size to check: the read below stops past the bound.
        if meta.is_file() && meta.len() > MAX_PROMPT_FILE {
            bail!("--prompt-file {}: {} bytes, more than the {} MiB a prompt may be", path.display(), meta.len(), MAX_PROMPT_FILE >> 20);
        }
        std::fs::File::open(path).and_then(|f| f.take(MAX_PROMPT_FILE + 1).read_to_end(&mut bytes)).with_context(|| format!("--prompt-file {}", path.display()))?;
        path.display().to_string()
    };
    if bytes.len() as u64 > MAX_PROMPT_FILE {
        bail!("--prompt-file: {what} holds more than the {} MiB a prompt may be", MAX_PROMPT_FILE >> 20);
    }
    let mut text = String::from_utf8(bytes).map_err(|e| anyhow::anyhow!("--prompt-file: {what} is not UTF-8 text (byte {})", e.utf8_error().valid_up_to()))?;
    // As llama-cli's -f: the line end a file or `echo` leaves is not part of the prompt.
    if text.ends_with('\n') {
        text.pop();
        if text.ends_with('\r') {
            text.pop();
        }
    }
    Ok(text.strip_prefix('\u{feff}').map(str::to_string).unwrap_or(text))
}

/// Why decoding ended, for the summary (llama-cli's "[end of text]").
fn stop_reason(out: &[u32], eos: &[u32], budget: usize, asked: usize, stop_text: bool) -> String {
    match out.last() {
        _ if stop_text => "stopped at a --stop text".into(),
        Some(t) if eos.contains(t) => "stopped at end of sequence".into(),
        _ if out.len() >= asked => format!("stopped at --max-tokens {asked}"),
        _ if out.len() >= budget => format!("stopped: the context is full ({budget} new tokens fit after the prompt)"),
        _ => format!("stopped after {} tokens", out.len()),
    }
}

pub fn run(a: GenerateArgs) -> Result<()> {
    let params = a.sampling.params()?;
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    if a.stop.iter().any(String::is_empty) {
        bail!("--stop: the text is empty (it would end every answer before it began)");
    }
    if a.lossy_typical && a.drafter.drafter.is_none() {
        bail!("--lossy-typical changes how drafted tokens are accepted; it needs --drafter DIR");
    }
    let prompt = read_prompt(&a)?;
    if prompt.is_empty() && !a.chat {
        let flag = if a.prompt_file.is_some() { "--prompt-file" } else { "--prompt" };
        bail!("{flag}: the prompt is empty: give it some text (or add --chat, which wraps even an empty prompt in the chat template)");
    }
    let plan = Plan::parse(&a.tree)?;
    let t0 = std::time::Instant::now();
    let mut target = a.model.load()?;
    eprintln!("loaded {} ({} weights) in {:.2} s", target.path.display(), target.model.weight_format(), t0.elapsed().as_secs_f64());
    let drafter = a.drafter.load(&mut target)?;
    let ids = match &a.system {
        Some(system) => target.tokenizer.encode(&target.chat_prompt(&[Message::new("system", system.as_str()), Message::new("user", prompt.as_str())])?, false)?,
        None => target.encode_prompt(&prompt, a.chat)?,
    };
    let context = target.model.config().max_position;
    let budget = check_budget(ids.len(), a.max_tokens, context)?;
    if budget < a.max_tokens {
        eprintln!("note: --max-tokens {} is more than fits: the context holds {context} tokens and the prompt {}, so at most {budget} new tokens", a.max_tokens, ids.len());
    }
    let eos: &[u32] = if a.ignore_eos { &[] } else { &target.tokenizer.eos_ids };
    let stop = StopRule { max_new_tokens: a.max_tokens, eos_ids: eos };
    let mut text = Answer::new(&target.tokenizer, &a.stop);
    let mut stdout = std::io::stdout().lock();
    // A reader that goes away (`| head`) ends decoding at once, quietly, as for other tools.
    let mut closed = false;
    let mut print = |t: u32| -> selfspec::Result<Flow> {
        let (s, flow) = text.push(t)?;
        if let Err(err) = stdout.write_all(s.as_bytes()).and_then(|_| stdout.flush()) {
            closed = err.kind() == std::io::ErrorKind::BrokenPipe;
            return Err(selfspec::Error::Io { path: "standard output".into(), err });
        }
        Ok(flow)
    };
    let mut r = rng(a.sampling.seed);
    if !params.is_greedy() {
        eprintln!("sampling with --seed {}", a.sampling.seed);
    }
    let Some(drafter) = drafter else {
        let result = generate_plain(&target.model, &ids, &params, &stop, &mut r, &mut print);
        let Some((out, stats)) = ended(result, closed, &mut text)? else { return Ok(()) };
        eprintln!("{}; {}", plain_summary(&stats), stop_reason(&out, eos, budget, a.max_tokens, text.stopped));
        return Ok(());
    };
    let rule = Rule::for_params(&params, a.lossy_typical);
    let ds = a.drafter.datastore(&target)?;
    let opts = SpecOptions { tree: plan.tree, lookup: plan.lookup, datastore: ds.as_ref(), rule, params: params.clone(), stop };
    let result = generate_spec(&target.model, &drafter, &ids, &opts, &mut r, &mut print);
    let Some((spec_out, stats)) = ended(result, closed, &mut text)? else { return Ok(()) };
    eprintln!("{}; {}", spec_summary(&stats, a.lossy_typical), stop_reason(&spec_out, eos, budget, a.max_tokens, text.stopped));
    if a.compare {
        let stop = StopRule { max_new_tokens: a.max_tokens, eos_ids: eos };
        // The same stop texts end the plain run, unprinted, so the two outputs compare.
        let mut quiet = Answer::new(&target.tokenizer, &a.stop);
        let (plain_out, plain) = generate_plain(&target.model, &ids, &params, &stop, &mut rng(a.sampling.seed), &mut |t| Ok(quiet.push(t)?.1))?;
        eprintln!("{}", plain_summary(&plain));
        let same = match (params.is_greedy() && !a.lossy_typical, spec_out == plain_out) {
            (false, _) => "",
            (true, true) => "; outputs identical",
            (true, false) => "; OUTPUTS DIFFER",
        };
        if stats.gen.new_tokens < 2 || plain.new_tokens < 2 {
            eprintln!("speed-up n/a: one token, the prefill's, and nothing decoded after it{same}");
        } else {
            eprintln!(
                "speed-up {:.2}x (self-speculative {:.1} tok/s vs plain {:.1} tok/s){same}",
                stats.gen.decode_tok_s() / plain.decode_tok_s(),
                stats.gen.decode_tok_s(),
                plain.decode_tok_s(),
            );
        }
    }
    Ok(())
}

/// The answer's text as tokens arrive: complete characters, less what could still grow into a
/// `--stop` text, cut where one appears.
struct Answer<'a> {
    stream: TextStream<'a>,
    stop: StopMatch,
    /// A stop text ended decoding (one found only in the text held back at the end did not).
    stopped: bool,
}

impl<'a> Answer<'a> {
    fn new(tok: &'a selfspec::model::tokenizer::Tokenizer, stops: &[String]) -> Self {
        Answer { stream: TextStream::new(tok), stop: StopMatch::new(stops.to_vec()), stopped: false }
    }
    /// Text to print now, and whether decoding goes on.
    fn push(&mut self, t: u32) -> selfspec::Result<(String, Flow)> {
        let piece = self.stream.push(t)?.unwrap_or_default();
        let (text, hit) = self.stop.push(&piece, false);
        self.stopped |= hit;
        Ok((text, if hit { Flow::Stop } else { Flow::Continue }))
    }
    /// What is left to print once decoding has ended.
    fn finish(&mut self) -> selfspec::Result<String> {
        let rest = self.stream.finish()?.unwrap_or_default();
        Ok(self.stop.push(&rest, true).0)
    }
}

/// A decoding run's result once its text is out: None when the reader has gone (`closed`: the
/// run was cut short by a broken pipe, or the last write found one), which ends quietly.
fn ended<T>(result: selfspec::Result<T>, closed: bool, text: &mut Answer) -> Result<Option<T>> {
    if closed {
        return Ok(None);
    }
    let done = result?;
    Ok(finish_stream(text)?.then_some(done))
}

/// The text held back and a last newline; false when the reader has gone (a broken pipe, which
/// ends the run quietly, as a reader that leaves mid-stream does).
fn finish_stream(text: &mut Answer) -> Result<bool> {
    let mut stdout = std::io::stdout().lock();
    let rest = text.finish()?;
    match stdout.write_all(rest.as_bytes()).and_then(|_| writeln!(stdout)).and_then(|_| stdout.flush()) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
        Err(e) => Err(anyhow::anyhow!("standard output: {e}")),
    }
}

fn plain_summary(s: &GenStats) -> String {
    format!("plain: prompt {} tokens, {} new tokens | prefill {:.1} tok/s | decode {:.1} tok/s", s.prompt_tokens, s.new_tokens, s.prefill_tok_s(), s.decode_tok_s())
}

fn spec_summary(s: &SpecStats, lossy: bool) -> String {
    let steps = s.gen.target_forwards.max(1) as f64;
    format!(
        "self-speculative{}: prompt {} tokens, {} new tokens, {} target forwards | tau {:.2} tokens/forward (bonus token counted; plain = 1.00) | prefill {:.1} tok/s | decode {:.1} tok/s | per step: draft {:.2} ms, tree forward {:.2} ms, verify {:.2} ms, commit {:.2} ms{}",
        if lossy { " (LOSSY typical acceptance: output does not follow the target's distribution)" } else { "" },
        s.gen.prompt_tokens,
        s.gen.new_tokens,
        s.gen.target_forwards,
        s.tau(),
        s.gen.prefill_tok_s(),
        s.gen.decode_tok_s(),
        s.time.draft * 1e3 / steps,
        s.time.forward * 1e3 / steps,
        s.time.verify * 1e3 / steps,
        s.time.commit * 1e3 / steps,
        if s.lookup_nodes > 0 { format!(" | lookup: {} of {} copied tokens accepted", s.lookup_accepted, s.lookup_nodes) } else { String::new() },
    )
}
