//! `POST /v1/chat/completions`: messages rendered with the model's chat template (generation
//! prompt added), `chat.completion` objects or `chat.completion.chunk` streams out.

use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::generate::{self, ChoiceJob, ChoiceOutput};
use crate::routes::clamp_logprob as clamp;
use crate::sse::{self, ChunkWriter};
use crate::types::{
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatDelta, ChatLogprobs, ChatTokenLogprob, ChatTopLogprob,
    ResponseMessage, Usage,
};
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

pub async fn create(State(state): State<AppState>, ApiJson(req): ApiJson<ChatCompletionRequest>) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let config = &state.config;
    let vocab = state.tokenizer.vocab_size();
    validate::check_model(req.model.as_deref(), config)?;
    let plan = validate::sampling_plan(SamplingFields::from_chat(&req)?, config, vocab)?;
    validate::check_constraint(&plan, &state.tokenizer)?;
    let messages = validate::chat_messages(req.messages.as_deref())?;
    let template = state
        .chat_template
        .as_ref()
        .ok_or_else(|| ApiError::invalid(None, "this model has no chat template; use /v1/completions with your own prompt format"))?;
    let text = template.render(&messages, true).map_err(|e| ApiError::invalid_param("messages", e.to_string()))?;
    // The template writes any BOS itself, so plain `encode` (special tokens recognised, none added).
    let prompt = state.tokenizer.encode(&text).map_err(|e| ApiError::invalid_param("messages", format!("cannot tokenize the conversation: {e}")))?;
    validate::check_prompt(&prompt, "messages", config, vocab)?;
    let jobs = (0..plan.n)
        .map(|i| {
            let params = plan.params_for(prompt.len(), i, DefaultMaxTokens::RemainingContext, config)?;
            Ok(ChoiceJob { index: i, prompt: prompt.clone(), params })
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    let runs = generate::submit(&state.engine, jobs, arrived)?;
    let writer = ChatChunks {
        id: format!("chatcmpl-{:x}{:08x}", unix_now(), runs[0].id.0),
        created: unix_now(),
        model: config.model_name.clone(),
        tokenizer: state.tokenizer.clone(),
        n: plan.n,
        logprobs: plan.base.logprobs.is_some(),
        include_usage: None,
    };
    if req.stream.unwrap_or(false) {
        let include_usage = req.stream_options.and_then(|o| o.include_usage).unwrap_or(false);
        let writer = ChatChunks { include_usage: include_usage.then_some(None), ..writer };
        return Ok(sse::stream_response(runs, writer, include_usage, prompt.len()));
    }
    let outputs = generate::collect(runs).await?;
    Ok(axum::Json(writer.response(outputs, prompt.len())).into_response())
}

fn chat_logprobs(tokenizer: &Tokenizer, entries: &[TokenLogprob]) -> ChatLogprobs {
    let described = |id: TokenId| {
        let text = tokenizer.token_text(id);
        let bytes = text.as_bytes().to_vec();
        (text, bytes)
    };
    let content = entries
        .iter()
        .map(|entry| {
            let (token, bytes) = described(entry.token);
            let top_logprobs = entry
                .top
                .iter()
                .map(|&(id, logprob)| {
                    let (token, bytes) = described(id);
                    ChatTopLogprob { token, logprob: clamp(logprob), bytes }
                })
                .collect();
            ChatTokenLogprob { token, logprob: clamp(entry.logprob), bytes, top_logprobs }
        })
        .collect();
    ChatLogprobs { content }
}

/// Builds `chat.completion` and `chat.completion.chunk` objects for one request.
struct ChatChunks {
    id: String,
    created: u64,
    model: String,
    tokenizer: Arc<Tokenizer>,
    n: usize,
    /// Whether the client asked for logprobs (then every choice carries them, even if empty).
    logprobs: bool,
    /// `Some(None)` (usage: null on every chunk) when the client asked for a usage chunk.
    include_usage: Option<Option<Usage>>,
}

impl ChatChunks {
    fn chunk(&self, choices: Vec<ChatChunkChoice>, usage: Option<Option<Usage>>) -> Event {
        sse::json_event(&ChatCompletionChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        })
    }

    fn choice_chunk(&self, index: usize, delta: ChatDelta, logprobs: Option<ChatLogprobs>, reason: Option<FinishReason>) -> Event {
        let choice = ChatChunkChoice { index, delta, logprobs, finish_reason: reason.map(FinishReason::as_str) };
        self.chunk(vec![choice], self.include_usage)
    }

    fn response(self, outputs: Vec<ChoiceOutput>, prompt_tokens: usize) -> ChatCompletionResponse {
        let completion_tokens = outputs.iter().map(|o| o.completion_tokens).sum();
        let choices = outputs
            .into_iter()
            .map(|o| ChatChoice {
                index: o.index,
                logprobs: self.logprobs.then(|| chat_logprobs(&self.tokenizer, &o.logprobs)),
                message: ResponseMessage { role: "assistant", content: o.text },
                finish_reason: Some(o.finish_reason.as_str()),
            })
            .collect();
        ChatCompletionResponse {
            id: self.id,
            object: "chat.completion",
            created: self.created,
            model: self.model,
            choices,
            usage: Some(Some(Usage::new(prompt_tokens, completion_tokens))),
        }
    }
}

impl ChunkWriter for ChatChunks {
    /// OpenAI opens each choice with `{"role": "assistant", "content": ""}`.
    fn opening(&mut self) -> Vec<Event> {
        (0..self.n)
            .map(|index| {
                let delta = ChatDelta { role: Some("assistant"), content: Some(String::new()) };
                self.choice_chunk(index, delta, None, None)
            })
            .collect()
    }

    fn delta(&mut self, index: usize, _tokens: &[TokenId], text: &str, logprobs: &[TokenLogprob]) -> Option<Event> {
        if text.is_empty() && logprobs.is_empty() {
            return None;
        }
        let logprobs = (!logprobs.is_empty()).then(|| chat_logprobs(&self.tokenizer, logprobs));
        let delta = ChatDelta { role: None, content: Some(text.to_string()) };
        Some(self.choice_chunk(index, delta, logprobs, None))
    }

    fn finished(&mut self, index: usize, reason: FinishReason) -> Event {
        self.choice_chunk(index, ChatDelta::default(), None, Some(reason))
    }

    fn usage(&mut self, usage: Usage) -> Event {
        self.chunk(Vec::new(), Some(Some(usage)))
    }
}
