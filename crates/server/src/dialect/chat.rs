//! `POST /v1/chat/completions`: messages rendered with the model's chat template (generation
//! prompt added), `chat.completion` objects or `chat.completion.chunk` streams out. With `tools`,
//! the output is searched for calls (`tools/`) and they come back as `message.tool_calls`, or
//! streamed as `delta.tool_calls` (a call's name once known, then its arguments as they come).
//! A thinking template's reasoning comes back as `reasoning_content` (vLLM's field). The request
//! becomes the shared [`Conversation`] (`conversation.rs`), as the other dialects' requests do.

use super::{clamp_logprob as clamp, vllm_prompt_logprobs, Answer, Dialect, Turn};
use crate::bounds;
use crate::conversation::{self, Conversation, ThinkingBudget};
use crate::error::ApiError;
use crate::generate::{self, ChoiceOutput};
use crate::output::{Out, OutputParser, ReasoningCounter};
use crate::sse::{self, ChunkWriter};
use crate::tools::{self, ParsedCall, Piece, ToolSet};
use crate::types::{
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatDelta, ChatLogprobs, ChatTokenLogprob, ChatTopLogprob,
    FunctionCall, FunctionCallDelta, ResponseMessage, ToolCall, ToolCallDelta, Usage,
};
use crate::validate::{self, DefaultMaxTokens, SamplingFields};
use crate::{unix_now, AppState};
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use specula_engine::api::{FinishReason, TokenLogprob};
use specula_engine::types::{Tenant, TokenId};
use specula_model::Tokenizer;
use std::sync::Arc;

/// `POST /v1/chat/completions`.
pub struct Chat;

impl Dialect for Chat {
    type Request = ChatCompletionRequest;
    type Writer = ChatChunks;

    async fn begin(state: &AppState, _tenant: Tenant, req: ChatCompletionRequest) -> Result<Turn<ChatChunks>, ApiError> {
        let config = &state.config;
        let vocab = state.tokenizer.vocab_size();
        validate::check_model(req.model.as_deref(), config)?;
        bounds::check_chat(&req, state)?;
        let plan = validate::sampling_plan(SamplingFields::from_chat(&req)?, config, vocab)?;
        let stream = req.stream.unwrap_or(false);
        if stream && plan.base.prompt_logprobs.is_some() {
            // vLLM refuses it too: a chat stream has no place for the prompt's logprobs
            return Err(ApiError::invalid_param("prompt_logprobs", "prompt_logprobs are answered on chat completions only without streaming; drop `stream`"));
        }
        let tools =
            ToolSet::from_request(req.tools.as_ref(), req.tool_choice.as_ref())?.map(|t| ToolSet { parallel: req.parallel_tool_calls.unwrap_or(true), ..t });
        let texts = validate::chat_messages(req.messages.as_deref())?;
        let messages = tools::template_messages(req.messages.as_deref().unwrap_or_default(), texts)?;
        let mut template_kwargs = req.chat_template_kwargs.clone().unwrap_or_default();
        if let Some(effort) = &req.reasoning_effort {
            template_kwargs.entry("reasoning_effort").or_insert(serde_json::Value::String(effort.clone()));
        }
        let thinking_budget = ThinkingBudget::from_field(req.thinking_token_budget)?;
        let prepared = conversation::prepare(state, Conversation { messages, tools, plan, template_kwargs, thinking_budget }).await?;
        let (plan, prompt_tokens) = (&prepared.plan, prepared.prompt.len());
        let jobs = prepared.jobs(DefaultMaxTokens::RemainingContext, config)?;
        let include_usage = req.stream_options.and_then(|o| o.include_usage).unwrap_or(false);
        let parser = prepared.output_parser();
        // streaming with tools or reasoning: one parser per choice
        let parsers = if !stream || parser.is_plain() { Vec::new() } else { vec![parser.clone(); plan.n] };
        let writer = ChatChunks {
            id: String::new(),
            created: unix_now(),
            model: config.model_name.clone(),
            tokenizer: state.tokenizer.clone(),
            n: plan.n,
            prompt_tokens,
            logprobs: plan.base.logprobs.is_some(),
            prompt_logprobs: plan.base.prompt_logprobs,
            include_usage: (stream && include_usage).then_some(None),
            parser,
            parsers,
            calls_sent: vec![0; plan.n],
            reasoning: vec![prepared.reasoning_counter(&state.tokenizer); plan.n],
        };
        Ok(Turn { jobs, writer, stream: stream.then_some(include_usage), prompt_tokens, choices_per_prompt: plan.n })
    }
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
pub struct ChatChunks {
    id: String,
    created: u64,
    model: String,
    tokenizer: Arc<Tokenizer>,
    n: usize,
    /// The rendered conversation's tokens, for usage.
    prompt_tokens: usize,
    /// Whether the client asked for logprobs (then every choice carries them, even if empty).
    logprobs: bool,
    /// vLLM's `prompt_logprobs: k` (not streamed).
    prompt_logprobs: Option<usize>,
    /// `Some(None)` (usage: null on every chunk) when the client asked for a usage chunk.
    include_usage: Option<Option<Usage>>,
    /// How a choice's output is read (reasoning, tool calls), fresh.
    parser: OutputParser,
    /// Streaming with tools or reasoning: one parser per choice (empty otherwise).
    parsers: Vec<OutputParser>,
    /// Streaming: calls sent so far, per choice (the next call's `index`).
    calls_sent: Vec<usize>,
    /// Each choice's reasoning tokens (`usage.completion_tokens_details`), counted as they come.
    reasoning: Vec<ReasoningCounter>,
}

fn tool_call(call: ParsedCall) -> ToolCall {
    ToolCall { id: tools::call_id(), kind: "function", function: FunctionCall { name: call.name, arguments: call.arguments } }
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
            prompt_logprobs: None,
        })
    }

    fn choice_chunk(&self, index: usize, delta: ChatDelta, logprobs: Option<ChatLogprobs>, reason: Option<&'static str>) -> Event {
        let choice = ChatChunkChoice { index, delta, logprobs, finish_reason: reason };
        self.chunk(vec![choice], self.include_usage)
    }

    /// The deltas for what a choice's call parser let out: content as it is, each call as one
    /// chunk with its id, type and name (arguments ""), then its arguments: in the fragments the
    /// parser lets out as they are generated, or in one piece for a call parsed whole.
    fn piece_deltas(&mut self, index: usize, pieces: Vec<Out>) -> Vec<ChatDelta> {
        let mut deltas = Vec::new();
        for piece in pieces {
            let piece = match piece {
                Out::Reasoning(text) => {
                    deltas.push(ChatDelta { reasoning_content: Some(text), ..Default::default() });
                    continue;
                }
                Out::Piece(piece) => piece,
            };
            match piece {
                Piece::Content(text) => deltas.push(ChatDelta { content: Some(text), ..Default::default() }),
                Piece::Call(call) => {
                    let call_index = self.calls_sent[index];
                    self.calls_sent[index] += 1;
                    let head = ToolCallDelta {
                        index: call_index,
                        id: Some(tools::call_id()),
                        kind: Some("function"),
                        function: FunctionCallDelta { name: Some(call.name), arguments: String::new() },
                    };
                    let arguments =
                        ToolCallDelta { index: call_index, id: None, kind: None, function: FunctionCallDelta { name: None, arguments: call.arguments } };
                    deltas.push(ChatDelta { tool_calls: Some(vec![head]), ..Default::default() });
                    deltas.push(ChatDelta { tool_calls: Some(vec![arguments]), ..Default::default() });
                }
                Piece::CallStart(name) => {
                    let call_index = self.calls_sent[index];
                    self.calls_sent[index] += 1;
                    let function = FunctionCallDelta { name: Some(name), arguments: String::new() };
                    let head = ToolCallDelta { index: call_index, id: Some(tools::call_id()), kind: Some("function"), function };
                    deltas.push(ChatDelta { tool_calls: Some(vec![head]), ..Default::default() });
                }
                Piece::CallArguments(arguments) => {
                    let function = FunctionCallDelta { name: None, arguments };
                    let piece = ToolCallDelta { index: self.calls_sent[index].saturating_sub(1), id: None, kind: None, function };
                    deltas.push(ChatDelta { tool_calls: Some(vec![piece]), ..Default::default() });
                }
            }
        }
        deltas
    }

    /// The reasoning tokens of every choice, where the output can have them.
    fn reasoning_tokens(&self) -> Option<usize> {
        self.reasoning.first().is_some_and(ReasoningCounter::counts).then(|| self.reasoning.iter().map(ReasoningCounter::count).sum())
    }

    fn response(mut self, outputs: Vec<ChoiceOutput>) -> ChatCompletionResponse {
        let prompt_tokens = self.prompt_tokens;
        let completion_tokens = outputs.iter().map(|o| o.completion_tokens).sum();
        for (c, o) in self.reasoning.iter_mut().zip(&outputs) {
            c.feed(&o.tokens);
        }
        let reasoning = self.reasoning_tokens();
        let cached = generate::cached_tokens(self.n, outputs.iter().map(|o| (o.index, o.cached_tokens)));
        // every choice ran the same prompt; the first one's prompt logprobs stand for all
        let prompt_logprobs = self.prompt_logprobs.map(|k| {
            let (entries, ranks) = outputs.iter().find_map(|o| o.prompt_logprobs.as_ref()).map_or((&[][..], &[][..]), |(e, r)| (&e[..], &r[..]));
            vllm_prompt_logprobs(&self.tokenizer, entries, ranks, k)
        });
        let choices = outputs
            .into_iter()
            .map(|o| {
                let parsed = self.parser.clone().parse(&o.text);
                let finish_reason = if parsed.calls.is_empty() { o.finish_reason.as_str() } else { "tool_calls" };
                let tool_calls = parsed.calls.into_iter().map(tool_call).collect();
                let message = ResponseMessage { role: "assistant", content: parsed.content, reasoning_content: parsed.reasoning, tool_calls };
                ChatChoice {
                    index: o.index,
                    logprobs: self.logprobs.then(|| chat_logprobs(&self.tokenizer, &o.logprobs)),
                    message,
                    finish_reason: Some(finish_reason),
                }
            })
            .collect();
        ChatCompletionResponse {
            id: self.id,
            object: "chat.completion",
            created: self.created,
            model: self.model,
            choices,
            usage: Some(Some(Usage::new(prompt_tokens, completion_tokens).cached(cached).reasoning(reasoning))),
            prompt_logprobs,
        }
    }
}

impl Answer for ChatChunks {
    const ID_PREFIX: &'static str = "chatcmpl-";

    fn name(&mut self, id: String) {
        self.id = id;
    }

    fn whole(self, outputs: Vec<ChoiceOutput>) -> Result<Response, ApiError> {
        Ok(axum::Json(self.response(outputs)).into_response())
    }
}

impl ChunkWriter for ChatChunks {
    /// OpenAI opens each choice with `{"role": "assistant", "content": ""}`.
    fn opening(&mut self) -> Vec<Event> {
        (0..self.n)
            .map(|index| {
                let delta = ChatDelta { role: Some("assistant"), content: Some(String::new()), ..Default::default() };
                self.choice_chunk(index, delta, None, None)
            })
            .collect()
    }

    /// With tools, the text goes through the choice's call parser first; logprobs ride on the
    /// first chunk that goes out (an empty delta when the parser holds the text back).
    fn delta(&mut self, index: usize, tokens: &[TokenId], text: &str, logprobs: &[TokenLogprob]) -> Vec<Event> {
        if let Some(c) = self.reasoning.get_mut(index) {
            c.feed(tokens);
        }
        if text.is_empty() && logprobs.is_empty() {
            return Vec::new();
        }
        let mut logprobs = (!logprobs.is_empty()).then(|| chat_logprobs(&self.tokenizer, logprobs));
        let mut deltas = match self.parsers.get_mut(index) {
            Some(parser) => {
                let pieces = parser.push(text);
                self.piece_deltas(index, pieces)
            }
            None => vec![ChatDelta { content: Some(text.to_string()), ..Default::default() }],
        };
        if deltas.is_empty() && logprobs.is_some() {
            deltas.push(ChatDelta::default());
        }
        deltas.into_iter().map(|delta| self.choice_chunk(index, delta, logprobs.take(), None)).collect()
    }

    /// Lets out what the call parser still holds; `tool_calls` is the reason once a call was sent.
    fn finished(&mut self, index: usize, reason: FinishReason) -> Vec<Event> {
        let pieces = self.parsers.get_mut(index).map(OutputParser::finish).unwrap_or_default();
        let mut events: Vec<Event> = self.piece_deltas(index, pieces).into_iter().map(|delta| self.choice_chunk(index, delta, None, None)).collect();
        let reason = if self.calls_sent[index] > 0 { "tool_calls" } else { reason.as_str() };
        events.push(self.choice_chunk(index, ChatDelta::default(), None, Some(reason)));
        events
    }

    fn usage(&mut self, usage: Usage) -> Event {
        let usage = usage.reasoning(self.reasoning_tokens());
        self.chunk(Vec::new(), Some(Some(usage)))
    }
}
