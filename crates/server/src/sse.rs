//! Server-sent events for `stream: true`: drives the merged choice events through an endpoint's
//! [`ChunkWriter`] and frames the result as `data: {...}` lines ending with `data: [DONE]`.
//! An engine failure mid-stream becomes one `data: {"error": {...}}` event, then `[DONE]`.
//! The response body owns the choices, so dropping it (client gone) aborts them.

use crate::error::ApiError;
use crate::generate::{ChoiceEvents, ChoiceRun};
use crate::types::Usage;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::{Stream, StreamExt};
use serde::Serialize;
use specula_engine::api::{FinishReason, RequestEvent, TokenLogprob};
use specula_engine::types::TokenId;
use std::collections::VecDeque;
use std::convert::Infallible;

/// How one endpoint turns choice events into its chunk objects.
pub trait ChunkWriter: Send + 'static {
    /// Chunks sent before any engine event (chat: the `role` delta; completions: echoed prompts
    /// that wait on no prompt logprobs).
    fn opening(&mut self) -> Vec<Event>;
    /// The chunks for choice `index`'s prompt logprobs (entry i: prompt token i + 1), which the
    /// engine sends once, before the choice's first delta, when they were asked for. None by
    /// default (chat refuses streamed prompt logprobs).
    fn prompt_logprobs(&mut self, _index: usize, _logprobs: &[TokenLogprob], _ranks: &[u32]) -> Vec<Event> {
        Vec::new()
    }
    /// The chunks for new tokens of choice `index`: usually one, none when there is nothing to
    /// show yet, several when held-back text comes out at once (a parsed tool call).
    fn delta(&mut self, index: usize, tokens: &[TokenId], text: &str, logprobs: &[TokenLogprob]) -> Vec<Event>;
    /// The chunks that end choice `index`: anything still held back, then the one that carries
    /// its finish reason.
    fn finished(&mut self, index: usize, reason: FinishReason) -> Vec<Event>;
    /// The last chunk when `include_usage` was asked for: no choices, only usage.
    fn usage(&mut self, usage: Usage) -> Event;
    /// The events after every choice finished; `usage` counts the whole request. OpenAI's
    /// chunk streams: the usage chunk (when asked for), then `[DONE]`. Other dialects end their
    /// own way (Anthropic's `message_delta` + `message_stop`).
    fn closing(&mut self, usage: Usage, include_usage: bool) -> Vec<Event> {
        let mut events: Vec<Event> = include_usage.then(|| self.usage(usage)).into_iter().collect();
        events.push(done_event());
        events
    }
    /// The events for an engine failure mid-stream: by default one error object, then `[DONE]`.
    fn failure(&mut self, error: &ApiError) -> Vec<Event> {
        vec![error_event(error), done_event()]
    }
}

/// A `data:` event holding `value` as JSON.
pub fn json_event<T: Serialize>(value: &T) -> Event {
    // Our response types serialize infallibly (string keys, no non-string map keys).
    Event::default().data(serde_json::to_string(value).unwrap_or_else(|e| format!("{{\"serialization_error\":\"{e}\"}}")))
}

pub fn done_event() -> Event {
    Event::default().data("[DONE]")
}

pub fn error_event(e: &ApiError) -> Event {
    json_event(&e.body())
}

struct Pump<W> {
    choices: ChoiceEvents,
    writer: W,
    /// Events ready to go out, in order.
    queue: VecDeque<Event>,
    include_usage: bool,
    prompt_tokens: usize,
    completion_tokens: usize,
    /// Each finished choice's (index, prompt tokens from the prefix cache), and how many choices
    /// ran each prompt (`generate::cached_tokens`).
    cached: Vec<(usize, usize)>,
    choices_per_prompt: usize,
    ended: bool,
}

/// The SSE response for `runs`; `prompt_tokens` is the request's usage prompt count, each prompt
/// ran by `choices_per_prompt` of the runs (choice `i` ran prompt `i / choices_per_prompt`).
pub fn stream_response<W: ChunkWriter>(runs: Vec<ChoiceRun>, mut writer: W, include_usage: bool, prompt_tokens: usize, choices_per_prompt: usize) -> Response {
    let pump = Pump {
        choices: futures::stream::select_all(runs),
        queue: writer.opening().into(),
        writer,
        include_usage,
        prompt_tokens,
        completion_tokens: 0,
        cached: Vec::new(),
        choices_per_prompt,
        ended: false,
    };
    Sse::new(events(pump).map(Ok::<_, Infallible>)).into_response()
}

fn events<W: ChunkWriter>(pump: Pump<W>) -> impl Stream<Item = Event> + Send {
    futures::stream::unfold(pump, |mut p| async move {
        loop {
            if let Some(event) = p.queue.pop_front() {
                return Some((event, p));
            }
            if p.ended {
                return None;
            }
            match p.choices.next().await {
                Some((index, RequestEvent::Delta { tokens, text, logprobs })) => {
                    p.queue.extend(p.writer.delta(index, &tokens, &text, &logprobs));
                }
                Some((index, RequestEvent::Finished { reason, completion_tokens, cached_tokens, .. })) => {
                    p.completion_tokens += completion_tokens;
                    p.cached.push((index, cached_tokens));
                    p.queue.extend(p.writer.finished(index, reason));
                }
                Some((index, RequestEvent::PromptLogprobs { logprobs, ranks })) => {
                    p.queue.extend(p.writer.prompt_logprobs(index, &logprobs, &ranks));
                }
                Some((_, RequestEvent::Failed { message })) => {
                    p.queue.extend(p.writer.failure(&ApiError::internal(message)));
                    // Dropping the other choices aborts them.
                    p.choices = futures::stream::select_all(Vec::new());
                    p.ended = true;
                }
                None => {
                    let usage =
                        Usage::new(p.prompt_tokens, p.completion_tokens).cached(crate::generate::cached_tokens(p.choices_per_prompt, p.cached.iter().copied()));
                    p.queue.extend(p.writer.closing(usage, p.include_usage));
                    p.ended = true;
                }
            }
        }
    })
}
