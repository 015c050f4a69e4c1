//! One handler for every API. Each dialect is a file here: its wire types, its translation into
//! engine work (for the chat-shaped ones through the shared
//! [`Conversation`](crate::conversation::Conversation), so a conversation sent through any of
//! them gives the same prompt and the same tokens), and its [`Answer`]: the writer that turns the
//! engine's output into its response, whole or as its event stream. [`handle`] is the one route
//! they all go through: check and prepare ([`Dialect::begin`]), submit every choice, then stream
//! or collect. A new dialect is one more file here and one line in the router.
//!
//! - [`chat`]: `POST /v1/chat/completions` (OpenAI chat completions).
//! - [`completions`]: `POST /v1/completions` (OpenAI completions: text or token prompts).
//! - [`anthropic`]: `POST /v1/messages`, `POST /v1/messages/count_tokens` (Anthropic Messages).
//! - [`responses`]: `POST /v1/responses`, `GET /v1/responses/{id}` (OpenAI Responses), with the
//!   bounded store of past responses in [`store`].

pub mod anthropic;
pub mod chat;
pub mod completions;
pub mod responses;
pub mod store;

use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::generate::{self, ChoiceJob, ChoiceOutput};
use crate::sse::{self, ChunkWriter};
use crate::types::{PromptLogprobEntry, PromptLogprobs, SamplingBlock, Stop};
use crate::validate::SamplingFields;
use crate::{unix_now, AppState};
use axum::extract::State;
use axum::response::Response;
use axum::Extension;
use serde::de::DeserializeOwned;
use specula_engine::api::TokenLogprob;
use specula_engine::types::{Tenant, TokenId};
use specula_model::Tokenizer;
use std::future::Future;
use std::time::Instant;

/// One API: how its request becomes engine work, and who writes its answer.
pub trait Dialect: Send + 'static {
    /// The request body as the client sends it.
    type Request: DeserializeOwned + Send + 'static;
    /// Writes the answer, streamed or whole.
    type Writer: Answer;
    /// Checks and prepares a request: the choices to run and the writer of their answer. Every
    /// refusal is an [`ApiError`] naming the field at fault; nothing reaches the engine before
    /// this returns.
    fn begin(state: &AppState, tenant: Tenant, req: Self::Request) -> impl Future<Output = Result<Turn<Self::Writer>, ApiError>> + Send;
}

/// What [`Dialect::begin`] hands the shared route.
pub struct Turn<W> {
    /// One engine request per choice (choice `i` ran prompt `i / choices_per_prompt`).
    pub jobs: Vec<ChoiceJob>,
    pub writer: W,
    /// `Some(include_usage)` when the client asked for a stream.
    pub stream: Option<bool>,
    /// The request's prompt tokens, for usage.
    pub prompt_tokens: usize,
    pub choices_per_prompt: usize,
}

/// A dialect's writer: the stream's events ([`ChunkWriter`]) and the whole answer.
pub trait Answer: ChunkWriter {
    /// How the dialect's response ids begin (`chatcmpl-`, `msg_`, ...).
    const ID_PREFIX: &'static str;
    /// Names the answer once its choices are submitted, before any event is written.
    fn name(&mut self, id: String);
    /// The whole answer once every choice finished (outputs sorted by choice index).
    fn whole(self, outputs: Vec<ChoiceOutput>) -> Result<Response, ApiError>;
}

/// The route every dialect's generation endpoint goes through: begin, submit every choice (or
/// none: a refusal leaves the engine's queue as it was), then stream the events through the
/// writer or collect them into the whole answer. The response id is the dialect's prefix, the
/// time and the first choice's engine id.
pub async fn handle<D: Dialect>(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    ApiJson(req): ApiJson<D::Request>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let Turn { jobs, mut writer, stream, prompt_tokens, choices_per_prompt } = D::begin(&state, tenant, req).await?;
    let runs = generate::submit(&state.engine, jobs, tenant, arrived, state.audit.as_ref())?;
    let first = runs.first().ok_or_else(|| ApiError::internal("no choice was submitted"))?.id;
    writer.name(format!("{}{:x}{:08x}", D::Writer::ID_PREFIX, unix_now(), first.0));
    match stream {
        Some(include_usage) => Ok(sse::stream_response(runs, writer, include_usage, prompt_tokens, choices_per_prompt)),
        None => writer.whole(generate::collect(runs).await?),
    }
}

/// The one choice of a single-choice dialect's whole answer (Anthropic Messages, Responses).
pub(crate) fn only_choice(mut outputs: Vec<ChoiceOutput>) -> Result<ChoiceOutput, ApiError> {
    outputs.pop().ok_or_else(|| ApiError::internal("no choice was submitted"))
}

/// The sampling fields of the dialects that spell only a few (Anthropic Messages, Responses), as
/// the shared checks want them.
pub(crate) fn sampling_fields(
    max_tokens: Option<i64>,
    max_tokens_param: &'static str,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    stop: Option<Vec<String>>,
    seed: Option<i64>,
) -> SamplingFields {
    let sampling = SamplingBlock { temperature, top_p, top_k, seed, stop: stop.map(Stop::Many), ..Default::default() };
    SamplingFields { sampling, max_tokens, max_tokens_param, logprobs_param: "logprobs", ..Default::default() }
}

/// JSON has no -inf; like vLLM, impossible tokens are reported at -9999.
pub(crate) fn clamp_logprob(logprob: f32) -> f32 {
    logprob.max(-9999.0)
}

/// vLLM's `prompt_logprobs` (see `PromptLogprobs`): a completions choice's, or a chat response's
/// (top level); top alternatives cut to `k`.
pub(crate) fn vllm_prompt_logprobs(tokenizer: &Tokenizer, entries: &[TokenLogprob], ranks: &[u32], k: usize) -> PromptLogprobs {
    let mut out: PromptLogprobs = vec![None];
    for (e, &rank) in entries.iter().zip(ranks) {
        let entry = |id: TokenId, logprob: f32, rank: u32| {
            (id.to_string(), PromptLogprobEntry { logprob: clamp_logprob(logprob), rank, decoded_token: tokenizer.token_text(id) })
        };
        let mut m = vec![entry(e.token, e.logprob, rank)];
        for (j, &(id, lp)) in e.top.iter().take(k).enumerate() {
            if id != e.token {
                m.push(entry(id, lp, j as u32 + 1));
            }
        }
        out.push(Some(m));
    }
    out
}

/// A text made of content blocks (`[{"type": "text", "text": ...}, ...]`, or the spellings in
/// `kinds`) or given as a plain string: the texts joined by newlines, as chat completions joins
/// its content parts. `Err` names what is not text.
pub(crate) fn block_text(v: &serde_json::Value, kinds: &[&str]) -> Result<String, String> {
    match v {
        serde_json::Value::String(s) => Ok(s.clone()),
        serde_json::Value::Null => Ok(String::new()),
        serde_json::Value::Array(blocks) => {
            let mut texts = Vec::with_capacity(blocks.len());
            for (i, b) in blocks.iter().enumerate() {
                let kind = b.get("type").and_then(|t| t.as_str()).unwrap_or_default();
                match b.get("text").and_then(|t| t.as_str()) {
                    Some(t) if kinds.contains(&kind) => texts.push(t),
                    _ => return Err(format!("[{i}] is a `{kind}` block; only text is supported here ({})", kinds.join(", "))),
                }
            }
            Ok(texts.join("\n"))
        }
        _ => Err("must be a string or a list of text blocks".into()),
    }
}
