//! One sequence's state as the engine tracks it: its known tokens, how many of them have their
//! keys/values computed, the request's sampling settings and random stream, and the streaming
//! detokenizer. The single rule of the scheduler is "compute known - computed tokens". Beside it,
//! the token-level stop rules that decide when a sequence ends.

use crate::api::{FinishReason, RequestEvent, SamplingParams, TokenLogprob};
use crate::constraint::Grammar;
use crate::sampling::{SeqRng, StopStrings};
use crate::types::{RequestId, SeqId, TokenId};
use specula_model::{DecodeStream, Tokenizer};
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// The compute side's part of a new sequence (see `Sequence::handoff`).
pub struct Handoff {
    pub rng: SeqRng,
    /// Its constraint's compiled grammar (structured outputs; `None`: free text).
    pub grammar: Option<Grammar>,
}

pub struct Sequence {
    pub id: SeqId,
    pub request: RequestId,
    /// Prompt followed by every accepted generated token.
    pub tokens: Vec<TokenId>,
    pub prompt_len: usize,
    /// Tokens whose keys/values are in the KV cache (a prefix of `tokens`).
    pub num_computed: usize,
    /// Where the next step starts: `num_computed` plus the tokens a step that was scheduled but
    /// not applied yet computes (async scheduling: the step running while the next one is
    /// planned). The scheduler sets it when it schedules a step, `Host::apply` and `Host::settle`
    /// bring it back to what was kept. Equal to `num_computed` whenever nothing is in flight
    /// (always, synchronously).
    pub num_scheduled: usize,
    /// Draft tokens proposed for verification in the next step (their draft distributions stay
    /// in the compute side's record).
    pub draft: Vec<TokenId>,
    pub params: SamplingParams,
    pub stops: StopStrings,
    /// What only the compute side uses of the sequence (its random stream and constraint state),
    /// held until the first step that schedules it hands it over (`crate::record`); `None` after.
    pub handoff: Option<Handoff>,
    pub decode: DecodeStream,
    /// Text generated so far (sent, plus any held back while a stop string may be forming).
    pub text: String,
    /// Bytes of `text` already sent to the client.
    pub text_sent: usize,
    pub events: UnboundedSender<RequestEvent>,
    pub arrival: Instant,
    /// Has been admitted to the running set at least once (left the waiting count).
    pub admitted: bool,
    /// Prompt tokens whose KV the prefix cache held at the first admission (the usage's cached
    /// tokens; a recompute after preemption does not change it).
    pub cached_prompt_tokens: usize,
    pub num_preemptions: usize,
    /// Prompt logprobs computed so far (`SamplingParams::prompt_logprobs`): entry `i` for prompt
    /// token `i + 1`, top alternatives already cut to the request's k.
    pub prompt_lps: Vec<TokenLogprob>,
    /// The rank of each `prompt_lps` entry's token.
    pub prompt_ranks: Vec<u32>,
    /// The prompt logprobs went out (`RequestEvent::PromptLogprobs`): a recompute after
    /// preemption does not compute them again.
    pub prompt_lps_sent: bool,
    /// Async scheduling's one rule, as a counter: KV slots reserved for tokens this sequence's
    /// next step was scheduled with before they were known (a decode scheduled ahead of the step
    /// that samples its input: 1 + k). Goes up when the scheduler schedules ahead, down when the
    /// step before lands its tokens and the step is settled (`Host::settle`); never below zero.
    /// Zero whenever nothing is scheduled ahead (always, synchronously).
    num_placeholders: usize,
}

impl Sequence {
    pub fn new(id: SeqId, request: RequestId, prompt: Vec<TokenId>, params: SamplingParams, events: UnboundedSender<RequestEvent>) -> Self {
        let prompt_len = prompt.len();
        let handoff = Some(Handoff { rng: SeqRng::new(params.seed, 0), grammar: None });
        let decode = DecodeStream::with_context(&prompt);
        Self {
            id,
            request,
            tokens: prompt,
            prompt_len,
            num_computed: 0,
            num_scheduled: 0,
            draft: Vec::new(),
            stops: StopStrings::new(&params.stop),
            params,
            handoff,
            decode,
            text: String::new(),
            text_sent: 0,
            events,
            arrival: Instant::now(),
            admitted: false,
            cached_prompt_tokens: 0,
            num_preemptions: 0,
            prompt_lps: Vec::new(),
            prompt_ranks: Vec::new(),
            prompt_lps_sent: false,
            num_placeholders: 0,
        }
    }

    pub fn output_len(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    pub fn output(&self) -> &[TokenId] {
        &self.tokens[self.prompt_len..]
    }

    /// Whether this sequence's steps still compute prompt logprobs.
    pub fn wants_prompt_logprobs(&self) -> bool {
        self.params.prompt_logprobs.is_some() && !self.prompt_lps_sent
    }

    /// Whether a step in flight ends on this sequence's last known token: it samples, so the
    /// next step's input tokens are not known yet and it can only be scheduled ahead, with
    /// placeholders.
    pub fn samples_in_flight(&self) -> bool {
        self.num_scheduled > self.num_computed && self.num_scheduled >= self.tokens.len()
    }

    /// KV slots reserved ahead for tokens not known yet (see the field).
    pub fn num_placeholders(&self) -> usize {
        self.num_placeholders
    }

    /// Scheduled ahead with `n` tokens whose inputs the running step has yet to produce.
    pub fn add_placeholders(&mut self, n: usize) {
        self.num_placeholders += n;
    }

    /// The step before landed the tokens `n` placeholders stood for.
    pub fn land_placeholders(&mut self, n: usize) {
        assert!(n <= self.num_placeholders, "{}: landing {n} placeholders but only {} are reserved", self.id, self.num_placeholders);
        self.num_placeholders -= n;
    }

    /// Tokens this sequence still needs computed, drafts included.
    pub fn pending_tokens(&self) -> usize {
        self.tokens.len() + self.draft.len() - self.num_computed
    }

    /// Sends an event; a closed channel means the client went away (the engine aborts on its own
    /// schedule, so this is not an error here).
    pub fn send(&self, ev: RequestEvent) -> bool {
        self.events.send(ev).is_ok()
    }

    pub fn send_delta(&self, tokens: Vec<TokenId>, text: String, logprobs: Vec<TokenLogprob>) -> bool {
        self.send(RequestEvent::Delta { tokens, text, logprobs })
    }
}

/// Why a sequence stops at token `id`, judged from tokens alone (stop strings need the text and
/// are checked when the engine streams). The engine's update and the job's drafting both use it,
/// so a sequence the job keeps drafting for is exactly one the engine keeps running.
pub(crate) fn token_finish(
    params: &SamplingParams,
    tokenizer: &Tokenizer,
    id: TokenId,
    output_len: usize,
    total_len: usize,
    max_model_len: usize,
) -> Option<FinishReason> {
    if is_stop_token(params, tokenizer, id) {
        Some(FinishReason::Stop)
    } else if output_len >= params.max_tokens || total_len >= max_model_len {
        Some(FinishReason::Length)
    } else {
        None
    }
}

/// EOS (unless ignored) or one of the request's stop token ids: emitted without text.
pub(crate) fn is_stop_token(params: &SamplingParams, tokenizer: &Tokenizer, id: TokenId) -> bool {
    (!params.ignore_eos && tokenizer.is_eos(id)) || params.stop_token_ids.contains(&id)
}
