//! Anthropic Messages (`POST /v1/messages`, `POST /v1/messages/count_tokens`), the API Claude
//! Code and other Anthropic-SDK agents speak: the request's `system`, `messages` (text,
//! `tool_use`, `tool_result` and `thinking` blocks), `tools` and `tool_choice` become the shared
//! conversation; the output comes back as `message` objects with content blocks, or as
//! Anthropic's event stream (`message_start`, `content_block_start` / `_delta` / `_stop`,
//! `message_delta`, `message_stop`, `ping`). Errors on these routes, auth included, are in
//! Anthropic's shape ([`anthropic_errors`]).

use super::{block_text, only_choice, sampling_fields, Answer, Dialect, Turn};
use crate::conversation::{self, Conversation, ThinkingBudget};
use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::generate;
use crate::output::{BlockEvent, BlockKind, Blocks, OutputParser};
use crate::sse::{self, ChunkWriter};
use crate::tools::ToolSet;
use crate::types::Usage;
use crate::validate::{self, DefaultMaxTokens};
use crate::AppState;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use specula_engine::api::{FinishReason, TokenLogprob};
use specula_engine::types::{Tenant, TokenId};
use specula_model::Tokenizer;
use std::sync::Arc;

/// `POST /v1/messages` (and the body of `count_tokens`, which ignores the generation fields).
#[derive(Debug, Default, Deserialize)]
pub struct MessagesRequest {
    pub model: Option<String>,
    /// A string or a list of text blocks.
    pub system: Option<Value>,
    pub messages: Option<Vec<InputMessage>>,
    /// Required by `/v1/messages`.
    pub max_tokens: Option<i64>,
    pub stop_sequences: Option<Vec<String>>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    /// Accepted and ignored (`user_id`).
    pub metadata: Option<Value>,
    /// `{name, description, input_schema}` each.
    pub tools: Option<Vec<Value>>,
    /// `{"type": "auto" | "any" | "tool" | "none", "name", "disable_parallel_tool_use"}`.
    pub tool_choice: Option<Value>,
    /// `{"type": "enabled", "budget_tokens"}` or `{"type": "disabled"}`: the template's
    /// `enable_thinking`, and the bound on a thinking model's reasoning.
    pub thinking: Option<Value>,
    pub stream: Option<bool>,
    /// Our extensions, as on chat completions.
    pub seed: Option<i64>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct InputMessage {
    pub role: String,
    /// A string or a list of content blocks.
    pub content: Value,
}

/// The request as the shared conversation; `counting`: for `count_tokens` (no `max_tokens`).
fn conversation_of(req: &MessagesRequest, state: &AppState, counting: bool) -> Result<Conversation, ApiError> {
    // Agents name their vendor's models (Claude Code alternates two of them), so any `model` is
    // served by the loaded one, as llama.cpp's server does; responses carry the served name.
    let max_tokens = match (req.max_tokens, counting) {
        (None, false) => return Err(ApiError::invalid_param("max_tokens", "max_tokens: Field required")),
        (_, true) => Some(1),
        (m, false) => m,
    };
    let fields = sampling_fields(max_tokens, "max_tokens", req.temperature, req.top_p, req.top_k, req.stop_sequences.clone(), req.seed);
    let plan = validate::sampling_plan(fields, &state.config, state.tokenizer.vocab_size())?;
    let mut messages = Vec::new();
    if let Some(system) = &req.system {
        let text = block_text(system, &["text"]).map_err(|e| ApiError::invalid_param("system", format!("system {e}")))?;
        messages.push(json!({"role": "system", "content": text}));
    }
    let sent = req.messages.as_deref().unwrap_or_default();
    if sent.is_empty() {
        return Err(ApiError::invalid_param("messages", "messages must hold at least one message"));
    }
    for (i, m) in sent.iter().enumerate() {
        messages.extend(template_messages(m, i)?);
    }
    let tools = tool_set(req)?;
    let mut template_kwargs = req.chat_template_kwargs.clone().unwrap_or_default();
    let mut thinking_budget = None;
    match req.thinking.as_ref().and_then(|t| t.get("type")).and_then(Value::as_str) {
        Some("disabled") => {
            template_kwargs.entry("enable_thinking").or_insert(Value::Bool(false));
        }
        Some(kind @ ("enabled" | "adaptive")) => {
            template_kwargs.entry("enable_thinking").or_insert(Value::Bool(true));
            thinking_budget = budget_tokens(req.thinking.as_ref(), kind, max_tokens.filter(|_| !counting))?;
        }
        _ => {}
    }
    Ok(Conversation { messages, tools, plan, template_kwargs, thinking_budget })
}

/// `thinking.budget_tokens`: required with `enabled` (at least 1, below `max_tokens`, as
/// Anthropic asks; its own floor of 1024 is not kept, small local models think less), optional
/// with `adaptive`.
fn budget_tokens(thinking: Option<&Value>, kind: &str, max_tokens: Option<i64>) -> Result<Option<ThinkingBudget>, ApiError> {
    const PARAM: &str = "thinking.budget_tokens";
    let value = thinking.and_then(|t| t.get("budget_tokens"));
    let tokens = match value {
        None | Some(Value::Null) if kind == "adaptive" => return Ok(None),
        None | Some(Value::Null) => return Err(ApiError::invalid_param(PARAM, "thinking.budget_tokens: Field required")),
        Some(v) => {
            v.as_i64().filter(|&b| b >= 1).ok_or_else(|| ApiError::invalid_param(PARAM, format!("thinking.budget_tokens must be an integer >= 1, got {v}")))?
        }
    };
    if let Some(m) = max_tokens.filter(|&m| tokens >= m) {
        return Err(ApiError::invalid_param(PARAM, format!("max_tokens ({m}) must be greater than thinking.budget_tokens ({tokens})")));
    }
    Ok(Some(ThinkingBudget { tokens: usize::try_from(tokens).unwrap_or(usize::MAX), param: PARAM }))
}

/// One Anthropic message as template messages: a user turn's `tool_result` blocks become `tool`
/// messages (before its text, as Anthropic orders them), an assistant turn's `tool_use` blocks
/// its calls and its `thinking` blocks its reasoning.
fn template_messages(m: &InputMessage, i: usize) -> Result<Vec<Value>, ApiError> {
    let at = |field: &str| format!("messages[{i}]{field}");
    if !matches!(m.role.as_str(), "user" | "assistant") {
        return Err(ApiError::invalid_param(&at(".role"), format!("unexpected role '{}'; messages alternate between user and assistant", m.role)));
    }
    let blocks = match &m.content {
        Value::String(s) => vec![json!({"type": "text", "text": s})],
        Value::Array(blocks) => blocks.clone(),
        _ => return Err(ApiError::invalid_param(&at(".content"), "content must be a string or a list of content blocks")),
    };
    let (mut texts, mut reasoning, mut calls, mut out) = (Vec::new(), None::<String>, Vec::new(), Vec::new());
    for (j, b) in blocks.iter().enumerate() {
        let param = at(&format!(".content[{j}]"));
        let field = |name: &str| b.get(name).ok_or_else(|| ApiError::invalid_param(&param, format!("a `{}` block needs `{name}`", b["type"])));
        match (b.get("type").and_then(Value::as_str).unwrap_or_default(), m.role.as_str()) {
            ("text", _) => texts.push(field("text")?.as_str().unwrap_or_default().to_string()),
            ("thinking", "assistant") => reasoning.get_or_insert_with(String::new).push_str(field("thinking")?.as_str().unwrap_or_default()),
            ("redacted_thinking", "assistant") => {}
            ("tool_use", "assistant") => {
                let id = field("id")?.as_str().unwrap_or_default().to_string();
                let name = field("name")?.as_str().unwrap_or_default().to_string();
                let input = conversation::call_arguments(b.get("input").unwrap_or(&json!({})), &format!("{param}.input"))?;
                calls.push((id, name, input));
            }
            ("tool_result", "user") => {
                let id = field("tool_use_id")?.as_str().unwrap_or_default();
                let content = block_text(b.get("content").unwrap_or(&Value::Null), &["text"])
                    .map_err(|e| ApiError::invalid_param(&format!("{param}.content"), format!("tool_result content {e}")))?;
                out.push(conversation::tool_message(id, content));
            }
            (kind, role) => {
                return Err(ApiError::invalid_param(
                    &format!("{param}.type"),
                    format!("`{kind}` blocks are not supported in {role} messages; this server reads text, tool_use, tool_result and thinking"),
                ))
            }
        }
    }
    let content = texts.join("\n");
    match m.role.as_str() {
        "assistant" => out.push(conversation::assistant_message(content, reasoning, calls)),
        _ if !texts.is_empty() || out.is_empty() => out.push(json!({"role": "user", "content": content})),
        _ => {}
    }
    Ok(out)
}

/// Anthropic's tools and `tool_choice`, checked as chat completions checks its own.
fn tool_set(req: &MessagesRequest) -> Result<Option<ToolSet>, ApiError> {
    let Some(list) = req.tools.as_ref().filter(|l| !l.is_empty()) else {
        return Ok(None);
    };
    let definitions: Vec<Value> = list
        .iter()
        .map(|t| {
            let mut function = json!({"name": t.get("name").cloned().unwrap_or(Value::Null)});
            if let Some(d) = t.get("description") {
                function["description"] = d.clone();
            }
            function["parameters"] = t.get("input_schema").cloned().unwrap_or_else(|| json!({"type": "object", "properties": {}}));
            json!({"type": "function", "function": function})
        })
        .collect();
    let choice = req.tool_choice.as_ref();
    let openai_choice = match choice.and_then(|c| c.get("type")).and_then(Value::as_str) {
        None => None,
        Some("auto") => Some(json!("auto")),
        Some("any") => Some(json!("required")),
        Some("none") => Some(json!("none")),
        Some("tool") => Some(json!({"type": "function", "function": {"name": choice.and_then(|c| c.get("name")).cloned().unwrap_or(Value::Null)}})),
        Some(other) => return Err(ApiError::invalid_param("tool_choice.type", format!("tool_choice type '{other}' is not one of auto, any, tool, none"))),
    };
    let parallel = !choice.and_then(|c| c.get("disable_parallel_tool_use")).and_then(Value::as_bool).unwrap_or(false);
    Ok(ToolSet::from_request(Some(&Value::Array(definitions)), openai_choice.as_ref())?.map(|t| ToolSet { parallel, ..t }))
}

/// `POST /v1/messages`.
pub struct Messages;

impl Dialect for Messages {
    type Request = MessagesRequest;
    type Writer = MessageWriter;

    async fn begin(state: &AppState, _tenant: Tenant, req: MessagesRequest) -> Result<Turn<MessageWriter>, ApiError> {
        let conv = conversation_of(&req, state, false)?;
        let prepared = conversation::prepare(state, conv).await?;
        let jobs = prepared.jobs(DefaultMaxTokens::RemainingContext, &state.config)?;
        let writer = MessageWriter {
            id: String::new(),
            model: state.config.model_name.clone(),
            tokenizer: state.tokenizer.clone(),
            stops: prepared.plan.base.stop.to_vec(),
            prompt_tokens: prepared.prompt.len(),
            cached_tokens: 0,
            parser: prepared.output_parser(),
            blocks: Blocks::default(),
            tokens: Vec::new(),
            text: String::new(),
            stop_reason: "end_turn",
            stop_sequence: None,
        };
        let stream = req.stream.unwrap_or(false).then_some(false);
        Ok(Turn { jobs, writer, stream, prompt_tokens: prepared.prompt.len(), choices_per_prompt: 1 })
    }
}

/// `POST /v1/messages/count_tokens`: the prompt's length, `{"input_tokens": N}`.
pub async fn count_tokens(State(state): State<AppState>, ApiJson(req): ApiJson<MessagesRequest>) -> Result<Response, ApiError> {
    let prepared = conversation::prepare(&state, conversation_of(&req, &state, true)?).await?;
    Ok(axum::Json(json!({"input_tokens": prepared.prompt.len()})).into_response())
}

/// Builds the `message` object, or its event stream, for one request.
pub struct MessageWriter {
    id: String,
    model: String,
    tokenizer: Arc<Tokenizer>,
    stops: Vec<String>,
    prompt_tokens: usize,
    /// Of them, served from the prefix cache (known once the output finished).
    cached_tokens: usize,
    parser: OutputParser,
    blocks: Blocks,
    /// The tokens and text so far (which stop sequence ended the output).
    tokens: Vec<TokenId>,
    text: String,
    stop_reason: &'static str,
    stop_sequence: Option<String>,
}

/// A content block as Anthropic writes it, whole (`text` the whole text) or opening a stream.
fn content_block(kind: &BlockKind, text: &str) -> Value {
    match kind {
        BlockKind::Reasoning => json!({"type": "thinking", "thinking": text, "signature": ""}),
        BlockKind::Text => json!({"type": "text", "text": text}),
        BlockKind::Call { id, name } => {
            let input = if text.is_empty() { json!({}) } else { serde_json::from_str(text).unwrap_or_else(|_| json!({})) };
            json!({"type": "tool_use", "id": tool_use_id(id), "name": name, "input": input})
        }
    }
}

/// Anthropic's spelling of a call id: `toolu_` where we write `call_`.
fn tool_use_id(id: &str) -> String {
    format!("toolu_{}", id.strip_prefix("call_").unwrap_or(id))
}

fn event(name: &str, data: Value) -> Event {
    sse::json_event(&data).event(name)
}

impl MessageWriter {
    /// The stop reason once the output ended: a call wins, then the token limit, then a stop
    /// sequence.
    fn stop(&mut self, reason: FinishReason) {
        self.stop_sequence = match reason {
            FinishReason::Stop => conversation::matched_stop(&self.tokenizer, &self.tokens, &self.text, &self.stops),
            _ => None,
        };
        self.stop_reason = if self.blocks.calls().next().is_some() {
            "tool_use"
        } else if reason == FinishReason::Length {
            "max_tokens"
        } else if self.stop_sequence.is_some() {
            "stop_sequence"
        } else {
            "end_turn"
        };
    }

    fn message(&self, content: Vec<Value>, stop_reason: Option<&str>, output_tokens: usize) -> Value {
        json!({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": self.stop_sequence,
            "usage": self.usage_json(output_tokens),
        })
    }

    /// Anthropic's usage: `input_tokens` counts the prompt tokens not read from the cache, which
    /// `cache_read_input_tokens` counts (their sum is the prompt); nothing is written to a cache
    /// on request (`cache_creation_input_tokens`: the prefix cache keeps blocks by itself).
    fn usage_json(&self, output_tokens: usize) -> Value {
        json!({
            "input_tokens": self.prompt_tokens.saturating_sub(self.cached_tokens), "output_tokens": output_tokens,
            "cache_read_input_tokens": self.cached_tokens, "cache_creation_input_tokens": 0,
        })
    }

    fn message_of(mut self, out: generate::ChoiceOutput) -> Value {
        let mut outs = self.parser.push(&out.text);
        outs.extend(self.parser.finish());
        self.blocks.feed(outs);
        self.blocks.close();
        (self.tokens, self.text) = (out.tokens, out.text);
        self.cached_tokens = out.cached_tokens;
        self.stop(out.finish_reason);
        let content = self.blocks.done.iter().map(|b| content_block(&b.kind, &b.text)).collect();
        self.message(content, Some(self.stop_reason), out.completion_tokens)
    }

    fn block_events(&self, events: Vec<BlockEvent>) -> Vec<Event> {
        events
            .into_iter()
            .map(|e| match e {
                BlockEvent::Start(index, kind) => {
                    event("content_block_start", json!({"type": "content_block_start", "index": index, "content_block": content_block(&kind, "")}))
                }
                BlockEvent::Delta(index, text) => {
                    let delta = match &self.blocks.done[index].kind {
                        BlockKind::Reasoning => json!({"type": "thinking_delta", "thinking": text}),
                        BlockKind::Text => json!({"type": "text_delta", "text": text}),
                        BlockKind::Call { .. } => json!({"type": "input_json_delta", "partial_json": text}),
                    };
                    event("content_block_delta", json!({"type": "content_block_delta", "index": index, "delta": delta}))
                }
                BlockEvent::Stop(index) => event("content_block_stop", json!({"type": "content_block_stop", "index": index})),
            })
            .collect()
    }
}

impl Answer for MessageWriter {
    const ID_PREFIX: &'static str = "msg_";

    fn name(&mut self, id: String) {
        self.id = id;
    }

    fn whole(self, outputs: Vec<generate::ChoiceOutput>) -> Result<Response, ApiError> {
        Ok(axum::Json(self.message_of(only_choice(outputs)?)).into_response())
    }
}

impl ChunkWriter for MessageWriter {
    fn opening(&mut self) -> Vec<Event> {
        let message = self.message(Vec::new(), None, 0);
        vec![event("message_start", json!({"type": "message_start", "message": message})), event("ping", json!({"type": "ping"}))]
    }

    fn delta(&mut self, _index: usize, tokens: &[TokenId], text: &str, _logprobs: &[TokenLogprob]) -> Vec<Event> {
        self.tokens.extend_from_slice(tokens);
        self.text.push_str(text);
        let outs = self.parser.push(text);
        let events = self.blocks.feed(outs);
        self.block_events(events)
    }

    fn finished(&mut self, _index: usize, reason: FinishReason) -> Vec<Event> {
        let outs = self.parser.finish();
        let mut events = self.blocks.feed(outs);
        events.extend(self.blocks.close());
        self.stop(reason);
        self.block_events(events)
    }

    fn usage(&mut self, usage: Usage) -> Event {
        event("message_delta", json!({"type": "message_delta", "delta": {}, "usage": {"output_tokens": usage.completion_tokens}}))
    }

    /// The last `message_delta` carries the whole usage (its counts are cumulative; the SDKs
    /// take its input and cache counts over `message_start`'s, sent before the prefix cache was
    /// looked up).
    fn closing(&mut self, usage: Usage, _include_usage: bool) -> Vec<Event> {
        let delta = json!({"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence});
        self.cached_tokens = usage.prompt_tokens_details.cached_tokens;
        vec![
            event("message_delta", json!({"type": "message_delta", "delta": delta, "usage": self.usage_json(usage.completion_tokens)})),
            event("message_stop", json!({"type": "message_stop"})),
        ]
    }

    fn failure(&mut self, error: &ApiError) -> Vec<Event> {
        vec![event("error", error_body(StatusCode::INTERNAL_SERVER_ERROR, &error.message))]
    }
}

// ---------------------------------------------------------------------------------------------
// Errors in Anthropic's shape
// ---------------------------------------------------------------------------------------------

/// Anthropic's error `type` for an HTTP status, as its SDKs map them to exceptions.
pub fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 | 405 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    }
}

/// `{"type": "error", "error": {"type", "message"}}`.
pub fn error_body(status: StatusCode, message: &str) -> Value {
    json!({"type": "error", "error": {"type": error_type(status), "message": message}})
}

/// Middleware for the Anthropic routes: every error response (from auth, the body extractor or
/// a handler, all written as OpenAI error objects) is rewritten into Anthropic's shape with the
/// same status and headers.
pub async fn anthropic_errors(req: Request, next: Next) -> Response {
    let resp = next.run(req).await;
    let status = resp.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    // our error bodies are small; anything else is cut to a readable length
    let bytes = axum::body::to_bytes(body, 64 * 1024).await.unwrap_or_default();
    let message = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| v.pointer("/error/message").and_then(Value::as_str).map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
    let body = serde_json::to_vec(&error_body(status, &message)).unwrap_or_default();
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    Response::from_parts(parts, Body::from(body))
}
