//! One engine, many dialects: the internal request that chat completions, Anthropic Messages and
//! OpenAI Responses are each parsed into ([`Conversation`]: template-shaped messages with tool
//! calls and results, tools, a constraint, sampling, limits), prepared once into a prompt and
//! engine parameters ([`prepare`]), with the way to read its output ([`Prepared::output_parser`]).
//! Identical conversations give identical prompts, so identical tokens, whatever the dialect.
//! Not for any dialect's wire types (`types.rs`, `dialect/*.rs`), for reading the output
//! (`output/`: the output side every dialect shares) or for running requests (`generate.rs`).

use crate::bounds;
use crate::error::ApiError;
use crate::generate::ChoiceJob;
use crate::output::{harmony, OutputParser, ReasoningCounter};
use crate::reasoning;
use crate::tools::{self, ToolSet};
use crate::validate::{self, DefaultMaxTokens, SamplingPlan};
use crate::AppState;
use serde_json::{json, Map, Value};
use specula_engine::constraint::Grammar;
use specula_engine::types::TokenId;
use specula_model::Tokenizer;
use std::sync::Arc;

/// A request in no dialect: what the model is asked, and how.
#[derive(Debug, Clone)]
pub struct Conversation {
    /// The messages as the chat template takes them: `role`, `content` (text), and where given
    /// `tool_calls` (each `{"id", "type": "function", "function": {"name", "arguments": {..}}}`,
    /// arguments as an object), `tool_call_id`, `name` and `reasoning_content`.
    pub messages: Vec<Value>,
    pub tools: Option<ToolSet>,
    /// Sampling, limits and the structured-output constraint (tool grammars are added here).
    pub plan: SamplingPlan,
    /// Extra template variables (`chat_template_kwargs`, e.g. `{"enable_thinking": false}`).
    pub template_kwargs: Map<String, Value>,
    /// Most tokens a thinking model may reason for (the think block is then closed for it).
    pub thinking_budget: Option<ThinkingBudget>,
}

/// A request's bound on reasoning, and the field it came from (for errors).
#[derive(Debug, Clone, Copy)]
pub struct ThinkingBudget {
    pub tokens: usize,
    pub param: &'static str,
}

impl ThinkingBudget {
    /// `thinking_token_budget` (vLLM's field, on chat completions and Responses): a count >= 0.
    pub fn from_field(value: Option<i64>) -> Result<Option<Self>, ApiError> {
        const PARAM: &str = "thinking_token_budget";
        value
            .map(|v| match usize::try_from(v) {
                Ok(tokens) => Ok(Self { tokens, param: PARAM }),
                Err(_) => Err(ApiError::invalid_param(PARAM, format!("{PARAM} must be >= 0, got {v}"))),
            })
            .transpose()
    }
}

/// A conversation ready to run: the prompt and how to read the output.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub prompt: Vec<TokenId>,
    pub plan: SamplingPlan,
    /// The tool names when the output is searched for calls (tools given, choice not `none`).
    pub tool_names: Option<Vec<String>>,
    /// `Some(opened)` when the template thinks; `opened`: the prompt opened the think block.
    pub reasoning: Option<bool>,
    /// The template speaks harmony (gpt-oss): channels, not think tags or `<tool_call>` blocks.
    pub harmony: bool,
    /// The constraint compiled once (`prep.rs`); every choice clones it.
    pub grammar: Option<Grammar>,
}

/// An assistant message for the template: its text, reasoning and calls (`(id, name, arguments)`).
pub fn assistant_message(content: String, reasoning: Option<String>, calls: Vec<(String, String, Value)>) -> Value {
    let mut m = json!({"role": "assistant", "content": content});
    if let Some(r) = reasoning {
        // Qwen3's templates read `reasoning_content`, gpt-oss's `thinking`
        m["thinking"] = Value::String(r.clone());
        m["reasoning_content"] = Value::String(r);
    }
    if !calls.is_empty() {
        let calls = calls.into_iter().map(|(id, name, arguments)| json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}));
        m["tool_calls"] = Value::Array(calls.collect());
    }
    m
}

/// A tool result for the template, answering call `call_id`.
pub fn tool_message(call_id: &str, content: String) -> Value {
    json!({"role": "tool", "tool_call_id": call_id, "content": content})
}

/// A call's arguments as the template takes them: a JSON text (OpenAI's shape) is parsed into
/// its object, as `tools::template_messages` does for chat completions.
pub fn call_arguments(arguments: &Value, param: &str) -> Result<Value, ApiError> {
    match arguments {
        Value::String(s) => serde_json::from_str::<Value>(s)
            .ok()
            .filter(Value::is_object)
            .ok_or_else(|| ApiError::invalid_param(param, "arguments must be a JSON text holding an object, as the model returned it")),
        v @ Value::Object(_) => Ok(v.clone()),
        _ => Err(ApiError::invalid_param(param, "arguments must be a JSON object")),
    }
}

/// Renders, tokenizes and checks a conversation: the tool grammar (for a forced call) becomes
/// the constraint, and every check names the field at fault. Counts are bounded first
/// (`bounds::check_conversation`); the grammar compiles once and the template renders and
/// tokenizes on the prep pool (`prep.rs`), never on the async workers.
pub async fn prepare(state: &AppState, conv: Conversation) -> Result<Prepared, ApiError> {
    let Conversation { messages, tools: tool_set, mut plan, template_kwargs, thinking_budget } = conv;
    let config = &state.config;
    bounds::check_conversation(state, &messages, tool_set.as_ref().map_or(0, |t| t.names().len()), plan.n)?;
    let template = state
        .chat_template
        .as_ref()
        .ok_or_else(|| ApiError::invalid(None, "this model has no chat template; use /v1/completions with your own prompt format"))?
        .clone();
    let (mut constraint_param, mut what) = (plan.constraint_param, "");
    if let Some(constraint) = tool_set.as_ref().and_then(ToolSet::constraint) {
        if plan.base.constraint.is_some() {
            return Err(ApiError::invalid_param(
                "tool_choice",
                format!("a tool_choice that forces a call (\"required\", \"any\" or a named tool) cannot be combined with `{}`", plan.constraint_param),
            ));
        }
        // a parameters schema the grammar engine cannot compile is the client's to fix
        (constraint_param, what) = ("tools", "the tools' parameters cannot force a call: ");
        plan.base.constraint = Some(Arc::new(constraint));
    }
    let (tokenizer, to_render) = (state.tokenizer.clone(), tool_set.clone());
    let harmony = harmony::template_speaks_harmony(template.source());
    let (prompt, start) = state
        .prep
        .run(move || {
            // control tokens only from the template's markup; no BOS added (templates write it)
            let rendered = tools::render(&template, &tokenizer, messages, to_render.as_ref(), true, &template_kwargs)?;
            let start = reasoning::template_thinks(template.source()).then(|| reasoning::reasoning_start(&rendered.text));
            Ok::<_, ApiError>((rendered.tokens, start))
        })
        .await??;
    validate::check_prompt(&prompt, "messages", config, state.tokenizer.vocab_size())?;
    plan.base.reasoning_budget = reasoning_budget(state, start, thinking_budget, plan.base.constraint.is_some())?;
    let grammar = state.prep.compile(&state.tokenizer, plan.base.constraint.clone(), plan.base.reasoning_budget, constraint_param, what, config).await?;
    let tool_names = tool_set.as_ref().filter(|t| t.parses_calls()).map(ToolSet::names);
    let reasoning = start.map(|s| s == reasoning::ReasoningStart::Opened);
    Ok(Prepared { prompt, plan, tool_names, reasoning, harmony, grammar })
}

/// The engine's reasoning budget: the request's, or, for a constraint (structured output, a
/// forced tool call), an unbounded one where the vocabulary allows it, so that the constraint
/// holds the answer after the reasoning instead of forbidding the reasoning (without single think
/// tokens the constraint holds from the first token, as before). None where the template does not
/// think or the prompt closed the block (a budget sent to a model that does not reason has
/// nothing to bound).
fn reasoning_budget(
    state: &AppState,
    start: Option<reasoning::ReasoningStart>,
    asked: Option<ThinkingBudget>,
    constrained: bool,
) -> Result<Option<specula_engine::ReasoningBudget>, ApiError> {
    let Some(start) = start else { return Ok(None) };
    match asked {
        Some(b) => reasoning::budget(&state.tokenizer, start, b.tokens).map_err(|e| ApiError::invalid_param(b.param, e)),
        None if constrained => Ok(reasoning::budget(&state.tokenizer, start, usize::MAX).ok().flatten()),
        None => Ok(None),
    }
}

impl Prepared {
    /// One engine request per choice.
    pub fn jobs(&self, default: DefaultMaxTokens, config: &crate::ServerConfig) -> Result<Vec<ChoiceJob>, ApiError> {
        (0..self.plan.n)
            .map(|i| {
                let params = self.plan.params_for(self.prompt.len(), i, default, config)?;
                Ok(ChoiceJob { index: i, prompt: self.prompt.clone(), params, grammar: self.grammar.clone() })
            })
            .collect()
    }

    /// A parser for one choice's output.
    pub fn output_parser(&self) -> OutputParser {
        OutputParser::new(self.reasoning, self.tool_names.clone(), self.harmony)
    }

    /// A counter of one choice's reasoning tokens.
    pub fn reasoning_counter(&self, tokenizer: &Arc<Tokenizer>) -> ReasoningCounter {
        ReasoningCounter::new(tokenizer, self.reasoning, self.harmony)
    }
}

/// Which of `stops` ended an output that finished with `Stop`: the engine cuts the text before
/// the stop string, so the generated tokens decode to the text sent followed by it. `None`
/// when the output ended on an end-of-turn token instead.
pub fn matched_stop(tokenizer: &Tokenizer, tokens: &[TokenId], sent: &str, stops: &[String]) -> Option<String> {
    if stops.is_empty() || tokens.last().is_some_and(|&t| tokenizer.is_eos(t)) {
        return None;
    }
    let decoded = tokenizer.decode(tokens, true).ok()?;
    let rest = decoded.get(sent.len()..)?;
    stops.iter().filter_map(|s| rest.find(s.as_str()).map(|at| (at, s))).min_by_key(|(at, s)| (*at, usize::MAX - s.len())).map(|(_, s)| s.clone())
}
