//! A multi-turn chat with one target (and its drafter): each turn renders the whole
//! conversation through the chat template, as a chat client sends it, and starts from the
//! previous turn's cache ([`Prefix`]), so a turn runs only its new tokens (llama-cli's
//! conversation mode). The answers are what decoding the whole conversation afresh gives: the
//! cache holds the values a fresh prefill would compute ([`crate::spec::prefix`]).
use crate::decode::generate::Flow;
use crate::decode::sampling::Rng64;
use crate::draft::drafter::Drafter;
use crate::model::loader::Target;
use crate::model::tokenizer::Message;
use crate::spec::driver::run_alone;
use crate::spec::prefix::Prefix;
use crate::spec::session::{Sequence, SpecOptions, SpecStats};
use crate::Result;

/// The turns so far and the cache of the last one.
pub struct Conversation<'d> {
    drafter: Option<&'d Drafter>,
    system: Option<String>,
    messages: Vec<Message>,
    prefix: Option<Prefix>,
}

/// One turn's answer.
pub struct Reply {
    /// The tokens emitted (an end-of-sequence token included).
    pub tokens: Vec<u32>,
    /// The answer's text as the conversation keeps it (without the end-of-sequence token).
    pub text: String,
    pub stats: SpecStats,
}

impl<'d> Conversation<'d> {
    /// A conversation that drafts with `drafter` (plain decoding without), opened by a system
    /// message when `system` is given (else the template's own default, if it has one).
    pub fn new(drafter: Option<&'d Drafter>, system: Option<String>) -> Self {
        Conversation { drafter, system, messages: Vec::new(), prefix: None }
    }

    /// The messages so far, the system message first when there is one.
    pub fn messages(&self) -> Vec<Message> {
        let system = self.system.iter().map(|s| Message::new("system", s.as_str()));
        system.chain(self.messages.iter().cloned()).collect()
    }

    /// Forget the turns (and the cache); the system message stays.
    pub fn reset(&mut self) {
        self.messages.clear();
        self.prefix = None;
    }

    /// Answer `user`: the conversation so far and this message through the chat template,
    /// decoded from the last turn's cache. `on_token` sees each token as it is emitted and may
    /// end the answer ([`Flow::Stop`]: the text so far is kept as the answer). On an error the
    /// conversation is left as it was.
    pub fn reply(&mut self, target: &Target, user: &str, opts: &SpecOptions, rng: &mut Rng64, on_token: &mut dyn FnMut(u32) -> Result<Flow>) -> Result<Reply> {
        let mut messages = self.messages();
        messages.push(Message::new("user", user));
        let ids = target.prompt_ids(&messages)?;
        let mut seq = Sequence::new(&target.model, self.drafter, &ids, opts.clone(), rng.clone())?.keeping_prefix();
        if let Some(p) = &self.prefix {
            let n = p.usable(&ids);
            seq = seq.resume_from(p, n)?;
        }
        run_alone(&target.model, &mut seq, &mut |t, _| on_token(t))?;
        let (tokens, stats, next_rng, prefix) = seq.finish_keeping_prefix();
        let eos = tokens.last().is_some_and(|t| opts.stop.eos_ids.contains(t));
        let text = target.tokenizer.decode(&tokens[..tokens.len() - eos as usize])?;
        *rng = next_rng;
        self.messages.push(Message::new("user", user));
        self.messages.push(Message::new("assistant", text.as_str()));
        self.prefix = prefix;
        Ok(Reply { tokens, text, stats })
    }
}
