//! `POST /v1/completions`: text (or token-id) prompts in, `text_completion` objects out.
//! Each prompt gets `n` choices, numbered prompt-major (prompt p, choice i -> index p * n + i).

use super::{clamp_logprob as clamp, vllm_prompt_logprobs, Answer, Dialect, Turn};
use crate::bounds;
use crate::error::ApiError;
use crate::generate::{self, ChoiceJob, ChoiceOutput};
use crate::sse::{self, ChunkWriter};
use crate::types::{CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, Prompt, PromptLogprobs, Usage};
use crate::validate::{self, DefaultMaxTokens, SamplingFields};
use crate::{unix_now, AppState};
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use specula_engine::api::{FinishReason, TokenLogprob};
use specula_engine::types::{Tenant, TokenId};
use specula_model::Tokenizer;
use std::sync::Arc;

/// One prompt, tokenized, with the text `echo` prepends.
struct PromptInput {
    tokens: Vec<TokenId>,
    text: String,
}

/// `POST /v1/completions`.
pub struct Completions;

impl Dialect for Completions {
    type Request = CompletionRequest;
    type Writer = CompletionChunks;

    async fn begin(state: &AppState, _tenant: Tenant, req: CompletionRequest) -> Result<Turn<CompletionChunks>, ApiError> {
        let config = &state.config;
        let vocab = state.tokenizer.vocab_size();
        validate::check_model(req.model.as_deref(), config)?;
        bounds::check_completion(&req, state)?;
        let plan = validate::sampling_plan(SamplingFields::from(&req), config, vocab)?;
        let grammar = state.prep.compile(&state.tokenizer, plan.base.constraint.clone(), None, plan.constraint_param, "", config).await?;
        let echo = req.echo.unwrap_or(false);
        // `max_tokens: 0` (echo only): the engine runs the prompt and one step whose token is dropped
        let prompt_only = plan.requested_max_tokens == Some(0);
        let echo_logprobs = if echo { plan.base.logprobs } else { None };
        let want_prompt_logprobs = plan.base.prompt_logprobs;
        // the engine computes the largest top-k either field asked for; each keeps its own
        let mut plan = plan;
        plan.base.prompt_logprobs = echo_logprobs.into_iter().chain(want_prompt_logprobs).max();
        let prompt = req.prompt.ok_or_else(|| ApiError::invalid_param("prompt", "prompt is required"))?;
        let tokenizer = state.tokenizer.clone();
        let prompts = state.prep.run(move || tokenize(prompt, &tokenizer)).await??;
        let mut jobs = Vec::with_capacity(prompts.len() * plan.n);
        for (p, prompt) in prompts.iter().enumerate() {
            validate::check_prompt(&prompt.tokens, "prompt", config, vocab)?;
            for i in 0..plan.n {
                let default = DefaultMaxTokens::Fixed(config.completions_default_max_tokens);
                let params = plan.params_for(prompt.tokens.len(), i, default, config)?;
                jobs.push(ChoiceJob { index: p * plan.n + i, prompt: prompt.tokens.clone(), params, grammar: grammar.clone() });
            }
        }
        let prompt_tokens: usize = prompts.iter().map(|p| p.tokens.len()).sum();
        let first_tokens: Vec<Option<TokenId>> = prompts.iter().flat_map(|p| std::iter::repeat_n(p.tokens.first().copied(), plan.n)).collect();
        let echoes: Vec<String> = prompts.into_iter().flat_map(|p| std::iter::repeat_n(if echo { p.text } else { String::new() }, plan.n)).collect();
        // with prompt logprobs, a choice's stream opens once they are here (echo or not)
        let prompt_pending = vec![echo_logprobs.is_some() || want_prompt_logprobs.is_some(); echoes.len()];
        let stream = req.stream.unwrap_or(false).then(|| req.stream_options.and_then(|o| o.include_usage).unwrap_or(false));
        let writer = CompletionChunks {
            id: String::new(),
            created: unix_now(),
            model: config.model_name.clone(),
            tokenizer: state.tokenizer.clone(),
            include_usage: stream.filter(|&u| u).map(|_| None),
            logprobs: plan.base.logprobs.is_some(),
            offsets: echoes.iter().map(|e| e.chars().count()).collect(),
            echoes,
            prompt_only,
            echo_logprobs,
            want_prompt_logprobs,
            first_tokens,
            prompt_pending,
            prompt_tokens,
            choices_per_prompt: plan.n,
        };
        Ok(Turn { jobs, writer, stream, prompt_tokens, choices_per_prompt: plan.n })
    }
}

/// Every prompt shape becomes a list of token lists; text prompts get BOS when the model wants it.
fn tokenize(prompt: Prompt, tokenizer: &Tokenizer) -> Result<Vec<PromptInput>, ApiError> {
    let from_text = |text: String| -> Result<PromptInput, ApiError> {
        if text.is_empty() {
            return Err(ApiError::invalid_param("prompt", "the prompt is empty; send at least one token of text"));
        }
        let tokens = tokenizer.encode_prompt(&text).map_err(|e| ApiError::invalid_param("prompt", format!("cannot tokenize the prompt: {e}")))?;
        Ok(PromptInput { tokens, text })
    };
    // Token prompts echo as their decoded text; ids outside the vocabulary are refused later.
    let from_tokens = |tokens: Vec<TokenId>| {
        let text = tokenizer.decode(&tokens, false).unwrap_or_default();
        PromptInput { tokens, text }
    };
    let prompts: Vec<PromptInput> = match prompt {
        Prompt::Text(t) => vec![from_text(t)?],
        Prompt::Texts(ts) => ts.into_iter().map(from_text).collect::<Result<_, _>>()?,
        Prompt::Tokens(ids) => vec![from_tokens(ids)],
        Prompt::TokenLists(lists) => lists.into_iter().map(from_tokens).collect(),
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid_param("prompt", "the prompt list is empty; send at least one prompt"));
    }
    Ok(prompts)
}

/// Logprobs in the legacy layout; `offset` is the character offset where these tokens start and
/// is advanced past them. `k` cuts each entry's alternatives (None: all).
fn completion_logprobs(tokenizer: &Tokenizer, entries: &[TokenLogprob], offset: &mut usize, k: Option<usize>) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    for entry in entries {
        let entry = &TokenLogprob { token: entry.token, logprob: entry.logprob, top: entry.top[..k.unwrap_or(usize::MAX).min(entry.top.len())].to_vec() };
        let text = tokenizer.token_text(entry.token);
        // Keyed by text, so two ids with the same text (byte pieces shown as U+FFFD) keep the
        // more likely one; vLLM and OpenAI always list the sampled token among the alternatives.
        let mut top: Vec<(String, f32)> = Vec::with_capacity(entry.top.len() + 1);
        let alternatives = entry.top.iter().map(|&(id, lp)| (tokenizer.token_text(id), lp));
        for (t, lp) in alternatives.chain(std::iter::once((text.clone(), entry.logprob))) {
            if !top.iter().any(|(k, _)| *k == t) {
                top.push((t, clamp(lp)));
            }
        }
        // Most likely first (stable: ties keep the engine's order).
        top.sort_by(|a, b| b.1.total_cmp(&a.1));
        out.text_offset.push(*offset);
        *offset += text.chars().count();
        out.tokens.push(text);
        out.token_logprobs.push(Some(clamp(entry.logprob)));
        out.top_logprobs.push(Some(top));
    }
    out
}

/// The echoed prompt's logprobs in the legacy layout: the first prompt token with `null`s, then
/// one entry per prompt logprob. Offsets start at 0 (the echo starts the text).
fn echo_logprobs(tokenizer: &Tokenizer, first: TokenId, entries: &[TokenLogprob], k: usize) -> (CompletionLogprobs, usize) {
    let text = tokenizer.token_text(first);
    let mut offset = text.chars().count();
    let mut out = CompletionLogprobs { tokens: vec![text], token_logprobs: vec![None], top_logprobs: vec![None], text_offset: vec![0] };
    out.extend(completion_logprobs(tokenizer, entries, &mut offset, Some(k)));
    (out, offset)
}

/// Builds `text_completion` objects for one request: streamed chunks and the whole response.
pub struct CompletionChunks {
    id: String,
    created: u64,
    model: String,
    tokenizer: Arc<Tokenizer>,
    /// `Some(None)` (usage: null on every chunk) when the client asked for a usage chunk.
    include_usage: Option<Option<Usage>>,
    /// Whether the client asked for logprobs (then every choice carries them, even if empty).
    logprobs: bool,
    /// Per choice: the echoed prompt text ("" without echo).
    echoes: Vec<String>,
    /// Per choice: characters of text sent so far, for `text_offset`.
    offsets: Vec<usize>,
    /// `max_tokens: 0`: the generated token is dropped (the prompt only).
    prompt_only: bool,
    /// With echo and `logprobs: k`: the prompt's logprobs lead each choice's logprobs.
    echo_logprobs: Option<usize>,
    /// vLLM's `prompt_logprobs: k`.
    want_prompt_logprobs: Option<usize>,
    /// Per choice: its prompt's first token (echo logprobs start with it).
    first_tokens: Vec<Option<TokenId>>,
    /// Streaming, per choice: its opening chunk (echo and prompt logprobs) waits on the engine's
    /// prompt logprobs.
    prompt_pending: Vec<bool>,
    /// Every prompt's tokens, for usage.
    prompt_tokens: usize,
    /// Choice `i` ran prompt `i / choices_per_prompt`.
    choices_per_prompt: usize,
}

impl CompletionChunks {
    fn object(&self, choices: Vec<CompletionChoice>, usage: Option<Option<Usage>>) -> CompletionResponse {
        CompletionResponse {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
            prompt_logprobs: None,
        }
    }

    fn chunk(&self, index: usize, text: String, logprobs: Option<CompletionLogprobs>, reason: Option<FinishReason>) -> Event {
        let choice = CompletionChoice { index, text, logprobs, finish_reason: reason.map(FinishReason::as_str), prompt_logprobs: None };
        sse::json_event(&self.object(vec![choice], self.include_usage))
    }

    /// Choice `index`'s prompt parts as asked: the echoed prompt's logprobs (legacy shape; the
    /// generated text's offsets continue after them) and vLLM's `prompt_logprobs`.
    fn prompt_parts(&mut self, index: usize, entries: &[TokenLogprob], ranks: &[u32]) -> (Option<CompletionLogprobs>, Option<PromptLogprobs>) {
        let mut logprobs = None;
        if let (Some(k), Some(first)) = (self.echo_logprobs, self.first_tokens[index]) {
            let (lp, offset) = echo_logprobs(&self.tokenizer, first, entries, k);
            self.offsets[index] = offset;
            logprobs = Some(lp);
        }
        (logprobs, self.want_prompt_logprobs.map(|k| vllm_prompt_logprobs(&self.tokenizer, entries, ranks, k)))
    }

    /// Streaming: the chunk that opens choice `index` when it asked for prompt logprobs (the
    /// echoed text with its logprobs, and/or vLLM's `prompt_logprobs`), once; nothing after that.
    fn prompt_chunk(&mut self, index: usize, entries: &[TokenLogprob], ranks: &[u32]) -> Vec<Event> {
        if !std::mem::take(&mut self.prompt_pending[index]) {
            return Vec::new();
        }
        let (logprobs, prompt_logprobs) = self.prompt_parts(index, entries, ranks);
        let text = std::mem::take(&mut self.echoes[index]);
        let choice = CompletionChoice { index, text, logprobs, finish_reason: None, prompt_logprobs };
        vec![sse::json_event(&self.object(vec![choice], self.include_usage))]
    }

    fn response(mut self, mut outputs: Vec<ChoiceOutput>) -> CompletionResponse {
        let prompt_tokens = self.prompt_tokens;
        let cached = generate::cached_tokens(self.choices_per_prompt, outputs.iter().map(|o| (o.index, o.cached_tokens)));
        if self.prompt_only {
            for o in &mut outputs {
                o.text.clear();
                o.logprobs.clear();
                o.completion_tokens = 0;
                o.finish_reason = FinishReason::Length;
            }
        }
        let completion_tokens = outputs.iter().map(|o| o.completion_tokens).sum();
        let choices = outputs
            .into_iter()
            .map(|o| {
                let (plp, ranks) = o.prompt_logprobs.unwrap_or_default();
                let (mut logprobs, prompt_logprobs) = self.prompt_parts(o.index, &plp, &ranks);
                if self.logprobs {
                    let gen = completion_logprobs(&self.tokenizer, &o.logprobs, &mut self.offsets[o.index], None);
                    logprobs.get_or_insert_with(CompletionLogprobs::default).extend(gen);
                }
                CompletionChoice {
                    index: o.index,
                    text: std::mem::take(&mut self.echoes[o.index]) + &o.text,
                    logprobs,
                    finish_reason: Some(o.finish_reason.as_str()),
                    prompt_logprobs,
                }
            })
            .collect();
        self.object(choices, Some(Some(Usage::new(prompt_tokens, completion_tokens).cached(cached))))
    }
}

impl Answer for CompletionChunks {
    const ID_PREFIX: &'static str = "cmpl-";

    fn name(&mut self, id: String) {
        self.id = id;
    }

    fn whole(self, outputs: Vec<ChoiceOutput>) -> Result<Response, ApiError> {
        Ok(axum::Json(self.response(outputs)).into_response())
    }
}

impl ChunkWriter for CompletionChunks {
    /// Echoed prompts that wait on no prompt logprobs.
    fn opening(&mut self) -> Vec<Event> {
        let mut events = Vec::new();
        for index in 0..self.echoes.len() {
            if !self.prompt_pending[index] && !self.echoes[index].is_empty() {
                let text = std::mem::take(&mut self.echoes[index]);
                events.push(self.chunk(index, text, None, None));
            }
        }
        events
    }

    fn prompt_logprobs(&mut self, index: usize, logprobs: &[TokenLogprob], ranks: &[u32]) -> Vec<Event> {
        self.prompt_chunk(index, logprobs, ranks)
    }

    /// `max_tokens: 0`: the engine's one token is dropped, as in the whole response.
    fn delta(&mut self, index: usize, _tokens: &[TokenId], text: &str, logprobs: &[TokenLogprob]) -> Vec<Event> {
        // the engine sends prompt logprobs before the first delta; the opening goes first regardless
        let mut events = self.prompt_chunk(index, &[], &[]);
        if self.prompt_only || (text.is_empty() && logprobs.is_empty()) {
            return events;
        }
        let logprobs = (!logprobs.is_empty()).then(|| completion_logprobs(&self.tokenizer, logprobs, &mut self.offsets[index], None));
        events.push(self.chunk(index, text.to_string(), logprobs, None));
        events
    }

    fn finished(&mut self, index: usize, reason: FinishReason) -> Vec<Event> {
        let mut events = self.prompt_chunk(index, &[], &[]);
        let reason = if self.prompt_only { FinishReason::Length } else { reason };
        events.push(self.chunk(index, String::new(), None, Some(reason)));
        events
    }

    fn usage(&mut self, usage: Usage) -> Event {
        let usage = if self.prompt_only { Usage::new(usage.prompt_tokens, 0).cached(usage.prompt_tokens_details.cached_tokens) } else { usage };
        sse::json_event(&self.object(Vec::new(), Some(Some(usage))))
    }
}
