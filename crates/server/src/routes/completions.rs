//! `POST /v1/completions`: text (or token-id) prompts in, `text_completion` objects out.
//! Each prompt gets `n` choices, numbered prompt-major (prompt p, choice i -> index p * n + i).

use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::generate::{self, ChoiceJob, ChoiceOutput};
use crate::routes::clamp_logprob as clamp;
use crate::sse::{self, ChunkWriter};
use crate::types::{CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, Prompt, Usage};
use crate::validate::{self, DefaultMaxTokens, SamplingFields};
use crate::{unix_now, AppState};
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use specula_engine::api::{FinishReason, TokenLogprob};
use specula_engine::types::TokenId;
use specula_model::Tokenizer;
use std::sync::Arc;
use std::time::Instant;

/// One prompt, tokenized, with the text `echo` prepends.
struct PromptInput {
    tokens: Vec<TokenId>,
    text: String,
}

pub async fn create(State(state): State<AppState>, ApiJson(req): ApiJson<CompletionRequest>) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let config = &state.config;
    let vocab = state.tokenizer.vocab_size();
    validate::check_model(req.model.as_deref(), config)?;
    let plan = validate::sampling_plan(SamplingFields::from(&req), config, vocab)?;
    let echo = req.echo.unwrap_or(false);
    if echo && plan.base.logprobs.is_some() {
        return Err(ApiError::invalid_param("echo", "echo with logprobs needs the prompt's logprobs, which specula does not compute; drop one of them"));
    }
    let prompt = req.prompt.ok_or_else(|| ApiError::invalid_param("prompt", "prompt is required"))?;
    let prompts = tokenize(prompt, &state.tokenizer)?;
    let mut jobs = Vec::with_capacity(prompts.len() * plan.n);
    for (p, prompt) in prompts.iter().enumerate() {
        validate::check_prompt(&prompt.tokens, "prompt", config, vocab)?;
        for i in 0..plan.n {
            let default = DefaultMaxTokens::Fixed(config.completions_default_max_tokens);
            let params = plan.params_for(prompt.tokens.len(), i, default, config)?;
            jobs.push(ChoiceJob { index: p * plan.n + i, prompt: prompt.tokens.clone(), params });
        }
    }
    let prompt_tokens: usize = prompts.iter().map(|p| p.tokens.len()).sum();
    let runs = generate::submit(&state.engine, jobs, arrived)?;
    let id = format!("cmpl-{:x}{:08x}", unix_now(), runs[0].id.0);
    let echoes: Vec<String> = prompts.into_iter().flat_map(|p| std::iter::repeat_n(if echo { p.text } else { String::new() }, plan.n)).collect();
    let writer = CompletionChunks {
        id,
        created: unix_now(),
        model: config.model_name.clone(),
        tokenizer: state.tokenizer.clone(),
        include_usage: None,
        logprobs: plan.base.logprobs.is_some(),
        offsets: echoes.iter().map(|e| e.chars().count()).collect(),
        echoes,
    };
    if req.stream.unwrap_or(false) {
        let include_usage = req.stream_options.and_then(|o| o.include_usage).unwrap_or(false);
        let writer = CompletionChunks { include_usage: include_usage.then_some(None), ..writer };
        return Ok(sse::stream_response(runs, writer, include_usage, prompt_tokens));
    }
    let outputs = generate::collect(runs).await?;
    Ok(axum::Json(writer.response(outputs, prompt_tokens)).into_response())
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
/// is advanced past them.
fn completion_logprobs(tokenizer: &Tokenizer, entries: &[TokenLogprob], offset: &mut usize) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    for entry in entries {
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
        out.token_logprobs.push(clamp(entry.logprob));
        out.top_logprobs.push(top);
    }
    out
}

/// Builds `text_completion` objects for one request: streamed chunks and the whole response.
struct CompletionChunks {
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
}

impl CompletionChunks {
    fn object(&self, choices: Vec<CompletionChoice>, usage: Option<Option<Usage>>) -> CompletionResponse {
        CompletionResponse { id: self.id.clone(), object: "text_completion", created: self.created, model: self.model.clone(), choices, usage }
    }

    fn chunk(&self, index: usize, text: String, logprobs: Option<CompletionLogprobs>, reason: Option<FinishReason>) -> Event {
        let choice = CompletionChoice { index, text, logprobs, finish_reason: reason.map(FinishReason::as_str) };
        sse::json_event(&self.object(vec![choice], self.include_usage))
    }

    fn response(mut self, outputs: Vec<ChoiceOutput>, prompt_tokens: usize) -> CompletionResponse {
        let completion_tokens = outputs.iter().map(|o| o.completion_tokens).sum();
        let choices = outputs
            .into_iter()
            .map(|o| {
                let logprobs = self.logprobs.then(|| completion_logprobs(&self.tokenizer, &o.logprobs, &mut self.offsets[o.index]));
                CompletionChoice {
                    index: o.index,
                    text: std::mem::take(&mut self.echoes[o.index]) + &o.text,
                    logprobs,
                    finish_reason: Some(o.finish_reason.as_str()),
                }
            })
            .collect();
        self.object(choices, Some(Some(Usage::new(prompt_tokens, completion_tokens))))
    }
}

impl ChunkWriter for CompletionChunks {
    fn opening(&mut self) -> Vec<Event> {
        let echoes = std::mem::take(&mut self.echoes);
        echoes.into_iter().enumerate().filter(|(_, text)| !text.is_empty()).map(|(index, text)| self.chunk(index, text, None, None)).collect()
    }

    fn delta(&mut self, index: usize, _tokens: &[TokenId], text: &str, logprobs: &[TokenLogprob]) -> Option<Event> {
        if text.is_empty() && logprobs.is_empty() {
            return None;
        }
        let logprobs = (!logprobs.is_empty()).then(|| completion_logprobs(&self.tokenizer, logprobs, &mut self.offsets[index]));
        Some(self.chunk(index, text.to_string(), logprobs, None))
    }

    fn finished(&mut self, index: usize, reason: FinishReason) -> Event {
        self.chunk(index, String::new(), None, Some(reason))
    }

    fn usage(&mut self, usage: Usage) -> Event {
        sse::json_event(&self.object(Vec::new(), Some(Some(usage))))
    }
}
