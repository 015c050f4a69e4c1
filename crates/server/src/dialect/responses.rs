//! OpenAI Responses (`POST /v1/responses`, `GET /v1/responses/{id}`), the API of the OpenAI
//! Agents SDK and Codex-style clients: `input` (a string, or items: messages with
//! `input_text` / `output_text`, `function_call`, `function_call_output`, `reasoning`),
//! `instructions`, function `tools`, `tool_choice` and `text.format` become the shared
//! conversation; the output comes back as `response` objects with `message`, `function_call`
//! and `reasoning` items, or as the named event stream (`response.created`, ...,
//! `response.completed`). With `store` (the default) a finished response is kept in the bounded
//! [`ResponseStore`](super::store::ResponseStore), so `previous_response_id` continues it and
//! `GET /v1/responses/{id}` returns it.

use super::store::Stored;
use super::{block_text, only_choice, sampling_fields, Answer, Dialect, Turn};
use crate::conversation::{self, Conversation, ThinkingBudget};
use crate::error::ApiError;
use crate::generate;
use crate::output::{BlockEvent, BlockKind, Blocks, OutputParser, ReasoningCounter};
use crate::sse::{self, ChunkWriter};
use crate::tools::ToolSet;
use crate::types::Usage;
use crate::validate::{self, DefaultMaxTokens};
use crate::AppState;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use specula_engine::api::{FinishReason, TokenLogprob};
use specula_engine::types::{Tenant, TokenId};

/// `POST /v1/responses`.
#[derive(Debug, Default, Deserialize)]
pub struct ResponsesRequest {
    pub model: Option<String>,
    /// A string (one user message) or a list of items.
    pub input: Option<Value>,
    /// A system message before the input; not carried over by `previous_response_id`.
    pub instructions: Option<String>,
    pub max_output_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// Our extensions, as on chat completions.
    pub top_k: Option<i64>,
    pub seed: Option<i64>,
    pub stop: Option<Vec<String>>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// Most tokens a thinking model may reason for (vLLM's field, as on chat completions).
    pub thinking_token_budget: Option<i64>,
    /// Function tools: `{"type": "function", "name", "description", "parameters", "strict"}`.
    pub tools: Option<Vec<Value>>,
    /// `"auto"`, `"none"`, `"required"` or `{"type": "function", "name"}`.
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    /// `{"format": {"type": "text" | "json_object" | "json_schema", "name", "schema", "strict"}}`.
    pub text: Option<Value>,
    pub stream: Option<bool>,
    /// Keep the response for `previous_response_id` and `GET` (default true).
    pub store: Option<bool>,
    pub previous_response_id: Option<String>,
    /// Accepted and echoed.
    pub metadata: Option<Value>,
    /// `{"effort": "low" | "medium" | "high", "summary"}`, echoed; the effort becomes the
    /// template's `reasoning_effort` (gpt-oss's system message says it).
    pub reasoning: Option<Value>,
}

/// The input items as template messages. Consecutive `function_call` items join the assistant
/// turn before them (or make one), as chat completions' `tool_calls` do; a `reasoning` item is
/// the next assistant turn's reasoning.
fn input_messages(input: &Value) -> Result<Vec<Value>, ApiError> {
    let items = match input {
        Value::String(s) => return Ok(vec![json!({"role": "user", "content": s})]),
        Value::Array(items) => items,
        _ => return Err(ApiError::invalid_param("input", "input must be a string or a list of items")),
    };
    let mut out: Vec<Value> = Vec::new();
    let mut reasoning: Option<String> = None;
    for (i, item) in items.iter().enumerate() {
        let at = |f: &str| format!("input[{i}]{f}");
        let str_field = |name: &str| {
            item.get(name)
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::invalid_param(&at(&format!(".{name}")), format!("this item needs a string `{name}`")))
        };
        let kind = item.get("type").and_then(Value::as_str).unwrap_or("message");
        match kind {
            "message" => {
                let role = str_field("role")?;
                if !matches!(role, "user" | "system" | "developer" | "assistant") {
                    return Err(ApiError::invalid_param(&at(".role"), format!("unknown role '{role}'; expected user, system, developer or assistant")));
                }
                let text = block_text(item.get("content").unwrap_or(&Value::Null), &["input_text", "output_text", "text"])
                    .map_err(|e| ApiError::invalid_param(&at(".content"), format!("content {e}")))?;
                out.push(match role {
                    "assistant" => conversation::assistant_message(text, reasoning.take(), Vec::new()),
                    _ => json!({"role": role, "content": text}),
                });
            }
            "function_call" => {
                let arguments = conversation::call_arguments(item.get("arguments").unwrap_or(&Value::Null), &at(".arguments"))?;
                let call = json!({"id": str_field("call_id")?, "type": "function", "function": {"name": str_field("name")?, "arguments": arguments}});
                match out.last_mut() {
                    Some(last) if last["role"] == "assistant" => match last.get_mut("tool_calls").and_then(Value::as_array_mut) {
                        Some(calls) => calls.push(call),
                        None => last["tool_calls"] = json!([call]),
                    },
                    _ => {
                        let mut m = conversation::assistant_message(String::new(), reasoning.take(), Vec::new());
                        m["tool_calls"] = json!([call]);
                        out.push(m);
                    }
                }
            }
            "function_call_output" => {
                let output = block_text(item.get("output").unwrap_or(&Value::Null), &["input_text", "output_text", "text"])
                    .map_err(|e| ApiError::invalid_param(&at(".output"), format!("output {e}")))?;
                out.push(conversation::tool_message(str_field("call_id")?, output));
            }
            "reasoning" => {
                let parts = item.get("content").and_then(Value::as_array).into_iter().flatten();
                let text: String = parts.filter_map(|p| p.get("text").and_then(Value::as_str)).collect();
                reasoning = Some(text);
            }
            other => {
                return Err(ApiError::invalid_param(
                    &at(".type"),
                    format!("input items of type `{other}` are not supported (message, function_call, function_call_output, reasoning)"),
                ))
            }
        }
    }
    Ok(out)
}

/// Responses' function tools and `tool_choice`, checked as chat completions checks its own.
fn tool_set(req: &ResponsesRequest) -> Result<Option<ToolSet>, ApiError> {
    let Some(list) = req.tools.as_ref().filter(|l| !l.is_empty()) else {
        return Ok(None);
    };
    let mut definitions = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        match t.get("type").and_then(Value::as_str) {
            Some("function") => {}
            other => {
                return Err(ApiError::invalid_param(
                    &format!("tools[{i}].type"),
                    format!("tools of type `{}` are not supported; only `function` tools are", other.unwrap_or("?")),
                ))
            }
        }
        let mut function = Map::new();
        for key in ["name", "description", "parameters"] {
            if let Some(v) = t.get(key).filter(|v| !v.is_null()) {
                function.insert(key.into(), v.clone());
            }
        }
        definitions.push(json!({"type": "function", "function": function}));
    }
    let choice = match &req.tool_choice {
        Some(Value::Object(c)) if c.get("type").and_then(Value::as_str) == Some("function") => {
            Some(json!({"type": "function", "function": {"name": c.get("name").cloned().unwrap_or(Value::Null)}}))
        }
        other => other.clone(),
    };
    let parallel = req.parallel_tool_calls.unwrap_or(true);
    Ok(ToolSet::from_request(Some(&Value::Array(definitions)), choice.as_ref())?.map(|t| ToolSet { parallel, ..t }))
}

/// `text.format` as chat completions' `response_format`.
fn response_format(text: Option<&Value>) -> Option<Value> {
    let format = text?.get("format")?;
    match format.get("type").and_then(Value::as_str)? {
        "json_schema" => Some(json!({"type": "json_schema", "json_schema": {
            "name": format.get("name"), "schema": format.get("schema"), "strict": format.get("strict")}})),
        _ => Some(format.clone()),
    }
}

/// `POST /v1/responses`.
pub struct Responses;

impl Dialect for Responses {
    type Request = ResponsesRequest;
    type Writer = ResponseWriter;

    async fn begin(state: &AppState, tenant: Tenant, req: ResponsesRequest) -> Result<Turn<ResponseWriter>, ApiError> {
        let config = &state.config;
        // any `model` is served by the loaded one (Codex-style clients send their own model names)
        let mut fields = sampling_fields(req.max_output_tokens, "max_output_tokens", req.temperature, req.top_p, req.top_k, req.stop.clone(), req.seed);
        fields.sampling.structured.response_format = response_format(req.text.as_ref());
        let plan = validate::sampling_plan(fields, config, state.tokenizer.vocab_size()).map_err(|e| {
            if e.param.as_deref() == Some("response_format") {
                ApiError { param: Some("text.format".into()), ..e }
            } else {
                e
            }
        })?;
        let mut history = match &req.previous_response_id {
            Some(id) => {
                state
                    .responses
                    .get(id)
                    .filter(|s| s.tenant == tenant)
                    .ok_or_else(|| ApiError::invalid_param("previous_response_id", format!("Previous response with id '{id}' not found.")))?
                    .messages
            }
            None => Vec::new(),
        };
        history.extend(input_messages(req.input.as_ref().unwrap_or(&Value::Null))?);
        if history.is_empty() {
            return Err(ApiError::invalid_param("input", "input must hold at least one item"));
        }
        let mut messages: Vec<Value> = req.instructions.iter().map(|s| json!({"role": "system", "content": s})).collect();
        messages.extend(history.iter().cloned());
        let mut template_kwargs = req.chat_template_kwargs.clone().unwrap_or_default();
        if let Some(effort) = req.reasoning.as_ref().and_then(|r| r.get("effort")).filter(|e| e.is_string()) {
            template_kwargs.entry("reasoning_effort").or_insert(effort.clone());
        }
        let thinking_budget = ThinkingBudget::from_field(req.thinking_token_budget)?;
        let prepared = conversation::prepare(state, Conversation { messages, tools: tool_set(&req)?, plan, template_kwargs, thinking_budget }).await?;
        let jobs = prepared.jobs(DefaultMaxTokens::RemainingContext, config)?;
        let echo = json!({
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "metadata": req.metadata.clone().unwrap_or(json!({})),
            "parallel_tool_calls": req.parallel_tool_calls.unwrap_or(true), "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning.clone().unwrap_or(json!({"effort": null, "summary": null})), "store": req.store.unwrap_or(true),
            "temperature": prepared.plan.base.temperature, "top_p": prepared.plan.base.top_p,
            "text": req.text.clone().unwrap_or(json!({"format": {"type": "text"}})), "tool_choice": req.tool_choice.clone().unwrap_or(json!("auto")),
            "tools": req.tools.clone().unwrap_or_default(), "truncation": "disabled", "user": null,
        });
        let writer = ResponseWriter {
            id: String::new(),
            created_at: crate::unix_now(),
            model: config.model_name.clone(),
            echo,
            prompt_tokens: prepared.prompt.len(),
            cached_tokens: 0,
            reasoning: prepared.reasoning_counter(&state.tokenizer),
            parser: prepared.output_parser(),
            blocks: Blocks::default(),
            item_ids: Vec::new(),
            sequence: 0,
            finish: FinishReason::Stop,
            store: req.store.unwrap_or(true).then_some((state.responses.clone(), history)),
            tenant,
        };
        let stream = req.stream.unwrap_or(false).then_some(false);
        Ok(Turn { jobs, writer, stream, prompt_tokens: prepared.prompt.len(), choices_per_prompt: 1 })
    }
}

/// `GET /v1/responses/{id}`: a stored response, or 404.
pub async fn retrieve(State(state): State<AppState>, Extension(tenant): Extension<Tenant>, Path(id): Path<String>) -> Result<Response, ApiError> {
    // another tenant's response is not found, as one never stored
    match state.responses.get(&id).filter(|s| s.tenant == tenant) {
        Some(stored) => Ok(axum::Json(stored.response).into_response()),
        None => Err(ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("No response with id '{id}' found (responses are kept for an hour, within a size bound, and only with store: true)"),
            kind: "invalid_request_error",
            param: None,
            code: Some("not_found"),
        }),
    }
}

/// Builds the `response` object, or its event stream, for one request.
pub struct ResponseWriter {
    id: String,
    created_at: u64,
    model: String,
    /// The request fields a response repeats.
    echo: Value,
    prompt_tokens: usize,
    /// Of them, served from the prefix cache (known once the output finished).
    cached_tokens: usize,
    /// The output's reasoning tokens, counted as they come.
    reasoning: ReasoningCounter,
    parser: OutputParser,
    blocks: Blocks,
    /// The item id of each block.
    item_ids: Vec<String>,
    /// `sequence_number` of the next event.
    sequence: u64,
    finish: FinishReason,
    /// Where to keep the finished response, and the conversation (without instructions) it ends.
    store: Option<(std::sync::Arc<super::store::ResponseStore>, Vec<Value>)>,
    /// Who asked: only this tenant reads the stored response back.
    tenant: Tenant,
}

impl ResponseWriter {
    fn response(&self, status: &str, output: Vec<Value>, completion_tokens: Option<usize>) -> Value {
        let mut r = json!({
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "error": null,
            "incomplete_details": if status == "incomplete" { json!({"reason": "max_output_tokens"}) } else { Value::Null },
            "model": self.model, "output": output,
            "usage": completion_tokens.map(|c| json!({
                "input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": c, "output_tokens_details": {"reasoning_tokens": self.reasoning.count().min(c)}, "total_tokens": self.prompt_tokens + c})),
        });
        if let (Value::Object(r), Value::Object(echo)) = (&mut r, &self.echo) {
            r.extend(echo.clone());
        }
        r
    }

    /// Block `index` as an output item; `done`: whole, else as it opens (empty).
    fn item(&self, index: usize, done: bool) -> Value {
        let (block, id) = (&self.blocks.done[index], &self.item_ids[index]);
        let status = if done { "completed" } else { "in_progress" };
        let text = if done { block.text.as_str() } else { "" };
        match &block.kind {
            BlockKind::Text => {
                let content = if done { json!([output_text(text)]) } else { json!([]) };
                json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
            }
            BlockKind::Reasoning => {
                let content = if done { json!([{"type": "reasoning_text", "text": text}]) } else { json!([]) };
                json!({"type": "reasoning", "id": id, "summary": [], "content": content, "status": status})
            }
            BlockKind::Call { id: call_id, name } => {
                json!({"type": "function_call", "id": id, "call_id": call_id, "name": name, "arguments": text, "status": status})
            }
        }
    }

    fn name_items(&mut self) {
        while self.item_ids.len() < self.blocks.done.len() {
            let prefix = match self.blocks.done[self.item_ids.len()].kind {
                BlockKind::Text => "msg",
                BlockKind::Reasoning => "rs",
                BlockKind::Call { .. } => "fc",
            };
            self.item_ids.push(format!("{prefix}_{}{:04x}", self.id.trim_start_matches("resp_"), self.item_ids.len()));
        }
    }

    /// The finished response; stored when asked.
    fn finish_response(&mut self, completion_tokens: usize) -> Value {
        self.name_items();
        let status = if self.finish == FinishReason::Length { "incomplete" } else { "completed" };
        let output = (0..self.blocks.done.len()).map(|i| self.item(i, true)).collect();
        let response = self.response(status, output, Some(completion_tokens));
        if let Some((store, mut messages)) = self.store.take() {
            let texts: Vec<&str> = self.blocks.done.iter().filter(|b| b.kind == BlockKind::Text).map(|b| b.text.as_str()).collect();
            let reasoning = self.blocks.done.iter().filter(|b| b.kind == BlockKind::Reasoning).map(|b| b.text.clone()).reduce(|a, b| a + &b);
            let calls = self
                .blocks
                .calls()
                .map(|(id, name, args)| (id.to_string(), name.to_string(), serde_json::from_str(args).unwrap_or_else(|_| json!({}))))
                .collect();
            messages.push(conversation::assistant_message(texts.join(""), reasoning, calls));
            store.insert(self.id.clone(), Stored { response: response.clone(), messages, tenant: self.tenant });
        }
        response
    }

    fn response_of(mut self, out: generate::ChoiceOutput) -> Value {
        let mut outs = self.parser.push(&out.text);
        outs.extend(self.parser.finish());
        self.blocks.feed(outs);
        self.blocks.close();
        self.finish = out.finish_reason;
        self.cached_tokens = out.cached_tokens;
        self.reasoning.feed(&out.tokens);
        self.finish_response(out.completion_tokens)
    }

    fn event(&mut self, name: &str, mut data: Value) -> Event {
        data["type"] = json!(name);
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        sse::json_event(&data).event(name)
    }

    fn block_events(&mut self, events: Vec<BlockEvent>) -> Vec<Event> {
        self.name_items();
        let mut out = Vec::new();
        for e in events {
            match e {
                BlockEvent::Start(index, kind) => {
                    let (item_id, item) = (self.item_ids[index].clone(), self.item(index, false));
                    out.push(self.event("response.output_item.added", json!({"output_index": index, "item": item})));
                    if kind == BlockKind::Text {
                        let part = json!({"item_id": item_id, "output_index": index, "content_index": 0, "part": output_text("")});
                        out.push(self.event("response.content_part.added", part));
                    }
                }
                BlockEvent::Delta(index, text) => {
                    let item_id = self.item_ids[index].clone();
                    let name = match self.blocks.done[index].kind {
                        BlockKind::Text => "response.output_text.delta",
                        BlockKind::Reasoning => "response.reasoning_text.delta",
                        BlockKind::Call { .. } => "response.function_call_arguments.delta",
                    };
                    let mut data = json!({"item_id": item_id, "output_index": index, "delta": text});
                    if name != "response.function_call_arguments.delta" {
                        data["content_index"] = json!(0);
                    }
                    if name == "response.output_text.delta" {
                        data["logprobs"] = json!([]);
                    }
                    out.push(self.event(name, data));
                }
                BlockEvent::Stop(index) => {
                    let (item_id, text) = (self.item_ids[index].clone(), self.blocks.done[index].text.clone());
                    let head = json!({"item_id": item_id, "output_index": index});
                    match &self.blocks.done[index].kind {
                        BlockKind::Text => {
                            let done = json!({"item_id": item_id, "output_index": index, "content_index": 0, "text": text, "logprobs": []});
                            out.push(self.event("response.output_text.done", done));
                            let part = json!({"item_id": item_id, "output_index": index, "content_index": 0, "part": output_text(&text)});
                            out.push(self.event("response.content_part.done", part));
                        }
                        BlockKind::Reasoning => {
                            let done = json!({"item_id": item_id, "output_index": index, "content_index": 0, "text": text});
                            out.push(self.event("response.reasoning_text.done", done));
                        }
                        BlockKind::Call { name, .. } => {
                            let mut done = head;
                            done["arguments"] = json!(text);
                            done["name"] = json!(name);
                            out.push(self.event("response.function_call_arguments.done", done));
                        }
                    }
                    let item = self.item(index, true);
                    out.push(self.event("response.output_item.done", json!({"output_index": index, "item": item})));
                }
            }
        }
        out
    }
}

fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

impl Answer for ResponseWriter {
    const ID_PREFIX: &'static str = "resp_";

    fn name(&mut self, id: String) {
        self.id = id;
    }

    fn whole(self, outputs: Vec<generate::ChoiceOutput>) -> Result<Response, ApiError> {
        Ok(axum::Json(self.response_of(only_choice(outputs)?)).into_response())
    }
}

impl ChunkWriter for ResponseWriter {
    fn opening(&mut self) -> Vec<Event> {
        let response = self.response("in_progress", Vec::new(), None);
        vec![self.event("response.created", json!({"response": response.clone()})), self.event("response.in_progress", json!({"response": response}))]
    }

    fn delta(&mut self, _index: usize, tokens: &[TokenId], text: &str, _logprobs: &[TokenLogprob]) -> Vec<Event> {
        self.reasoning.feed(tokens);
        let outs = self.parser.push(text);
        let events = self.blocks.feed(outs);
        self.block_events(events)
    }

    fn finished(&mut self, _index: usize, reason: FinishReason) -> Vec<Event> {
        self.finish = reason;
        let outs = self.parser.finish();
        let mut events = self.blocks.feed(outs);
        events.extend(self.blocks.close());
        self.block_events(events)
    }

    fn usage(&mut self, _usage: Usage) -> Event {
        Event::default().comment("usage")
    }

    fn closing(&mut self, usage: Usage, _include_usage: bool) -> Vec<Event> {
        self.cached_tokens = usage.prompt_tokens_details.cached_tokens;
        let response = self.finish_response(usage.completion_tokens);
        let name = if response["status"] == "incomplete" { "response.incomplete" } else { "response.completed" };
        vec![self.event(name, json!({"response": response}))]
    }

    fn failure(&mut self, error: &ApiError) -> Vec<Event> {
        let mut response = self.response("failed", Vec::new(), None);
        response["error"] = json!({"code": "server_error", "message": error.message});
        vec![self.event("response.failed", json!({"response": response}))]
    }
}
