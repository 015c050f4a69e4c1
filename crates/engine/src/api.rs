//! The engine's public surface: what a front end (HTTP server, CLI, benchmark) submits and what
//! comes back. Everything crosses threads by channel; nothing here touches the model.

pub use crate::constraint::{Constraint, ReasoningBudget};
use crate::constraint::{ConstraintCompiler, ConstraintError, Grammar};
use crate::types::{RequestId, TokenId};
use serde::{Deserialize, Serialize};
use specula_model::Tokenizer;
use std::sync::Arc;

/// Per-request sampling settings, validated by [`SamplingParams::validate`] before submission.
/// Serializable so MPI ranks can receive requests (`dp::bridge`). The parts a client can make
/// large (stop strings, stop ids, logit bias, constraint) are shared (`Arc`): the `n` choices of a
/// request, and every step that samples a sequence, clone a pointer, not the lists.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// 0 disables top-k.
    pub top_k: usize,
    /// 1.0 disables top-p.
    pub top_p: f32,
    /// 0.0 disables min-p.
    pub min_p: f32,
    /// 1.0 disables. Applied to tokens seen in prompt and output (HF/vLLM semantics).
    pub repetition_penalty: f32,
    /// 0.0 disables. Applied to tokens seen in the output (OpenAI semantics).
    pub presence_penalty: f32,
    /// 0.0 disables. Applied per occurrence in the output (OpenAI semantics).
    pub frequency_penalty: f32,
    /// Same seed + same request => same output, whatever else is in the batch.
    pub seed: Option<u64>,
    /// Maximum number of generated tokens.
    pub max_tokens: usize,
    /// Generation stops when the text contains one of these; the stop string is not returned.
    #[serde(with = "shared")]
    pub stop: Arc<[String]>,
    /// Generation stops when one of these tokens is sampled (in addition to EOS unless ignore_eos).
    #[serde(with = "shared")]
    pub stop_token_ids: Arc<[TokenId]>,
    /// Added to these tokens' raw logits before penalties and sampling (OpenAI's `logit_bias`,
    /// each in [-100, 100]); logprobs stay those of the raw distribution.
    #[serde(default, with = "shared")]
    pub logit_bias: Arc<[(TokenId, f32)]>,
    pub ignore_eos: bool,
    /// No speculative drafts for this request (an opt-out; the output is the same either way).
    #[serde(default)]
    pub disable_speculation: bool,
    /// None: no logprobs. Some(k): the sampled token's logprob plus the top k alternatives.
    pub logprobs: Option<usize>,
    /// None: no prompt logprobs. Some(k): for every prompt token after the first, its logprob given
    /// the tokens before it plus the top k alternatives (raw distribution, like `logprobs`),
    /// delivered in one [`RequestEvent::PromptLogprobs`] before the first `Delta`.
    #[serde(default)]
    pub prompt_logprobs: Option<usize>,
    /// None: free text. Some: every sampled token must keep the output inside this language
    /// (structured outputs, forced tool calls); logprobs stay those of the raw distribution.
    /// The engine runs it from the compiled [`GenerateRequest::grammar`], never compiling it.
    #[serde(default, with = "shared_option")]
    pub constraint: Option<Arc<Constraint>>,
    /// A thinking model's reasoning budget: the think block closes after at most this many
    /// tokens (forced). Compiled with the constraint into the request's grammar.
    #[serde(default)]
    pub reasoning_budget: Option<ReasoningBudget>,
    /// Who sent it (the server's API key): speculation's cross-request index drafts from the
    /// outputs of this tenant's requests only.
    #[serde(default)]
    pub tenant: crate::types::Tenant,
}

/// Serde for `Arc<[T]>` as a plain list (serde's own needs its `rc` feature).
mod shared {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use std::sync::Arc;

    pub fn serialize<S: Serializer, T: Serialize>(v: &Arc<[T]>, s: S) -> Result<S::Ok, S::Error> {
        v[..].serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Arc<[T]>, D::Error> {
        Vec::<T>::deserialize(d).map(Arc::from)
    }
}

/// Serde for `Option<Arc<T>>` as an optional plain value.
mod shared_option {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use std::sync::Arc;

    pub fn serialize<S: Serializer, T: Serialize>(v: &Option<Arc<T>>, s: S) -> Result<S::Ok, S::Error> {
        v.as_deref().serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<Arc<T>>, D::Error> {
        Option::<T>::deserialize(d).map(|v| v.map(Arc::new))
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            max_tokens: 16,
            stop: Arc::from([]),
            stop_token_ids: Arc::from([]),
            logit_bias: Arc::from([]),
            ignore_eos: false,
            disable_speculation: false,
            logprobs: None,
            prompt_logprobs: None,
            constraint: None,
            reasoning_budget: None,
            tenant: crate::types::Tenant::default(),
        }
    }
}

/// Why a sampling parameter was refused. `param` names the field as the OpenAI API spells it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct InvalidParam {
    pub param: &'static str,
    pub message: String,
}

impl SamplingParams {
    pub fn greedy(max_tokens: usize) -> Self {
        Self { temperature: 0.0, max_tokens, ..Self::default() }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Whether the request runs with a grammar (`GenerateRequest::grammar`): a constraint or a
    /// reasoning budget.
    pub fn needs_grammar(&self) -> bool {
        self.constraint.is_some() || self.reasoning_budget.is_some()
    }

    /// Greedy with no penalty: the token is the argmax of the raw logits (the sampler's and the
    /// rejection sampler's fast path, which skips building the distribution).
    pub fn is_plain_greedy(&self) -> bool {
        self.is_greedy() && self.repetition_penalty == 1.0 && self.presence_penalty == 0.0 && self.frequency_penalty == 0.0 && self.logit_bias.is_empty()
    }

    /// Checks every field's range; `max_logprobs` is the server's `--max-logprobs`.
    pub fn validate(&self, max_logprobs: usize) -> Result<(), InvalidParam> {
        let bad = |param: &'static str, message: String| Err(InvalidParam { param, message });
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad("temperature", format!("temperature must be >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad("repetition_penalty", format!("repetition_penalty must be > 0, got {}", self.repetition_penalty));
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return bad("presence_penalty", format!("presence_penalty must be in [-2, 2], got {}", self.presence_penalty));
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return bad("frequency_penalty", format!("frequency_penalty must be in [-2, 2], got {}", self.frequency_penalty));
        }
        if let Some((id, b)) = self.logit_bias.iter().find(|(_, b)| !(-100.0..=100.0).contains(b)) {
            return bad("logit_bias", format!("logit_bias for token {id} is {b}; values must be in [-100, 100]"));
        }
        if self.max_tokens == 0 {
            return bad("max_tokens", "max_tokens must be at least 1".to_string());
        }
        if let Some(k) = self.logprobs {
            if k > max_logprobs {
                return bad("logprobs", format!("requested {k} logprobs but the server allows at most {max_logprobs} (--max-logprobs)"));
            }
        }
        if let Some(k) = self.prompt_logprobs {
            if k > max_logprobs {
                return bad("prompt_logprobs", format!("requested {k} prompt logprobs but the server allows at most {max_logprobs} (--max-logprobs)"));
            }
        }
        Ok(())
    }
}

/// Log-probability of one emitted token and the top alternatives at that position.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    pub token: TokenId,
    pub logprob: f32,
    /// Sorted by descending logprob; empty when the request asked for 0 alternatives.
    pub top: Vec<(TokenId, f32)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FinishReason {
    /// EOS, a stop token or a stop string.
    Stop,
    /// max_tokens or the model's context length reached.
    Length,
    /// The client went away or asked to cancel.
    Abort,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// What the engine streams back for one request, in order: zero or more `Delta`s then exactly one
/// `Finished` or `Failed`. Serializable so MPI ranks can send them back (`dp::bridge`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum RequestEvent {
    Delta {
        /// The token(s) this event carries: the engine sends one event per emitted token, also
        /// when a speculative step emits several (so clients see one delta per token).
        tokens: Vec<TokenId>,
        /// Text those tokens completed; may be empty while a UTF-8 character is incomplete or a
        /// possible stop string is being held back.
        text: String,
        /// One entry per token when logprobs were asked for, else empty.
        logprobs: Vec<TokenLogprob>,
    },
    /// The prompt's logprobs (`SamplingParams::prompt_logprobs`): entry `i` is prompt token `i + 1`
    /// given the tokens before it (the first prompt token has none). Sent once, before the first
    /// `Delta`.
    PromptLogprobs {
        logprobs: Vec<TokenLogprob>,
        /// Per entry: the prompt token's rank (1 + tokens with a strictly larger logit).
        ranks: Vec<u32>,
    },
    Finished {
        reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
        /// Prompt tokens served from the prefix cache (their KV reused, not computed).
        #[serde(default)]
        cached_tokens: usize,
    },
    Failed {
        message: String,
    },
}

/// All tokens carried by the `Delta` events of a request's stream, in order.
pub fn streamed_tokens(events: &[RequestEvent]) -> Vec<TokenId> {
    events
        .iter()
        .flat_map(|e| match e {
            RequestEvent::Delta { tokens, .. } => tokens.clone(),
            _ => Vec::new(),
        })
        .collect()
}

/// One request as the engine receives it: already tokenized, validated and, with a
/// constraint, compiled.
#[derive(Debug)]
pub struct GenerateRequest {
    pub id: RequestId,
    pub prompt: Vec<TokenId>,
    pub params: SamplingParams,
    pub events: tokio::sync::mpsc::UnboundedSender<RequestEvent>,
    /// `params.constraint` and `params.reasoning_budget` compiled ([`compile_params`]), by the front end, off the engine
    /// thread; the choices of one request each get a clone of one compilation. The engine fails
    /// a request whose constraint comes without it (it never compiles on its own thread).
    pub grammar: Option<Grammar>,
}

/// The grammar a request's parameters need (its constraint and reasoning budget,
/// [`ConstraintCompiler::compile_request`]), for [`GenerateRequest::grammar`]; `None` when they
/// need none.
pub fn compile_params(tokenizer: &Arc<Tokenizer>, params: &SamplingParams) -> Result<Option<Grammar>, ConstraintError> {
    if !params.needs_grammar() {
        return Ok(None);
    }
    ConstraintCompiler::for_tokenizer(tokenizer)?.compile_request(params.constraint.as_deref(), params.reasoning_budget.as_ref())
}
