//! Turns what a client sent into what the engine accepts, or a 400 that names the field:
//! the model name, the sampling fields (ranges via `SamplingParams::validate`), the prompt's
//! tokens against the vocabulary and `--max-model-len`, and the `max_tokens` default.
//! Knows nothing of HTTP beyond `ApiError`, and nothing of how requests are run.

use crate::error::ApiError;
use crate::types::{ChatCompletionRequest, CompletionRequest, MessageContent, RequestMessage, SamplingBlock, Stop, StructuredFields};
use crate::ServerConfig;
use serde_json::Value;
use specula_engine::api::{Constraint, SamplingParams};
use specula_engine::types::TokenId;
use specula_model::ChatMessage;
use std::sync::Arc;

/// What `max_tokens` becomes when the client leaves it out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DefaultMaxTokens {
    /// Everything the context has left (vLLM's chat behaviour).
    RemainingContext,
    /// A fixed count (OpenAI's completions default is 16), cut to what the context has left.
    Fixed(usize),
}

/// The sampling fields of a request, whatever its dialect: the shared block (`SamplingBlock`,
/// which the OpenAI routes flatten into their requests and the other dialects fill from their own
/// spellings) and the fields each dialect names its own way.
#[derive(Debug, Default)]
pub struct SamplingFields {
    pub sampling: SamplingBlock,
    pub max_tokens: Option<i64>,
    /// How the client spelled the max-tokens field, for error messages.
    pub max_tokens_param: &'static str,
    pub logprobs: Option<i64>,
    /// How the client spelled the logprobs count (`logprobs` or `top_logprobs`).
    pub logprobs_param: &'static str,
    /// `max_tokens: 0` is allowed (completions with `echo`: the prompt only, nothing generated).
    pub allow_zero_max_tokens: bool,
}

impl From<&CompletionRequest> for SamplingFields {
    fn from(r: &CompletionRequest) -> Self {
        Self {
            sampling: r.sampling(),
            max_tokens: r.max_tokens,
            max_tokens_param: "max_tokens",
            logprobs: r.logprobs,
            logprobs_param: "logprobs",
            allow_zero_max_tokens: r.echo == Some(true),
        }
    }
}

impl SamplingFields {
    /// Chat spells logprobs as `logprobs: bool` + `top_logprobs: int`; the count is only valid
    /// with `logprobs: true`.
    pub fn from_chat(r: &ChatCompletionRequest) -> Result<Self, ApiError> {
        let logprobs = match (r.logprobs.unwrap_or(false), r.top_logprobs) {
            (true, k) => Some(k.unwrap_or(0)),
            (false, Some(_)) => return Err(ApiError::invalid_param("top_logprobs", "top_logprobs needs `logprobs: true`")),
            (false, None) => None,
        };
        let (max_tokens, max_tokens_param) = match r.max_completion_tokens {
            Some(m) => (Some(m), "max_completion_tokens"),
            None => (r.max_tokens, "max_tokens"),
        };
        Ok(Self { sampling: r.sampling(), max_tokens, max_tokens_param, logprobs, logprobs_param: "top_logprobs", allow_zero_max_tokens: false })
    }
}

/// Validated sampling settings for one HTTP request, before the prompt is known.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingPlan {
    /// Choices per prompt.
    pub n: usize,
    /// Every field final except `max_tokens` (per prompt) and `seed` (per choice).
    pub base: SamplingParams,
    /// `max_tokens` as the client asked, if it did.
    pub requested_max_tokens: Option<usize>,
    max_tokens_param: &'static str,
    /// The field `base.constraint` came from, for errors found when it is compiled.
    pub constraint_param: &'static str,
}

/// 404 unless the request names the served model (or an alias); a missing `model` means the
/// served one.
pub fn check_model(requested: Option<&str>, config: &ServerConfig) -> Result<(), ApiError> {
    match requested {
        Some(m) if !config.serves(m) => Err(ApiError::model_not_found(m, &config.model_name)),
        _ => Ok(()),
    }
}

/// Checks every prompt-independent field.
pub fn sampling_plan(f: SamplingFields, config: &ServerConfig, vocab_size: usize) -> Result<SamplingPlan, ApiError> {
    let s = f.sampling;
    let requested_max_tokens = match f.max_tokens {
        Some(0) if f.allow_zero_max_tokens => Some(0),
        Some(m) if m <= 0 => {
            return Err(ApiError::invalid_param(f.max_tokens_param, format!("{} must be at least 1 (0 only with echo), got {m}", f.max_tokens_param)))
        }
        Some(m) => Some(usize::try_from(m).unwrap_or(usize::MAX)),
        None => None,
    };
    let n = match s.n.unwrap_or(1) {
        n if n < 1 => return Err(ApiError::invalid_param("n", format!("n must be at least 1, got {n}"))),
        n if n as u64 > config.max_n as u64 => return Err(ApiError::invalid_param("n", format!("n is {n} but this server allows at most {}", config.max_n))),
        n => n as usize,
    };
    let top_k = match s.top_k.unwrap_or(0) {
        -1 | 0 => 0,
        k if k < 0 => return Err(ApiError::invalid_param("top_k", format!("top_k must be -1, 0 (disabled) or positive, got {k}"))),
        k => usize::try_from(k).unwrap_or(usize::MAX),
    };
    let logprobs = match f.logprobs {
        Some(k) if k < 0 => return Err(ApiError::invalid_param(f.logprobs_param, format!("{} must be >= 0, got {k}", f.logprobs_param))),
        Some(k) => Some(usize::try_from(k).unwrap_or(usize::MAX)),
        None => None,
    };
    let prompt_logprobs = match s.prompt_logprobs {
        Some(k) if k < 0 => return Err(ApiError::invalid_param("prompt_logprobs", format!("prompt_logprobs must be >= 0, got {k}"))),
        Some(k) => Some(usize::try_from(k).unwrap_or(usize::MAX)),
        None => None,
    };
    let stop: Vec<String> = s.stop.map(Stop::into_vec).unwrap_or_default();
    if stop.len() > config.max_stop_strings {
        return Err(ApiError::invalid_param("stop", format!("{} stop strings given; at most {} are allowed", stop.len(), config.max_stop_strings)));
    }
    if let Some(long) = stop.iter().find(|s| s.chars().count() > config.max_stop_string_chars) {
        return Err(ApiError::invalid_param(
            "stop",
            format!("a stop string of {} characters is longer than the {} allowed", long.chars().count(), config.max_stop_string_chars),
        ));
    }
    let stop_token_ids = s.stop_token_ids.unwrap_or_default();
    // OpenAI's keys are token ids written as strings; anything else is refused, not ignored
    let logit_bias = s
        .logit_bias
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| match k.trim().parse::<u32>() {
            Ok(id) if (id as usize) < vocab_size => Ok((id, v)),
            _ => Err(ApiError::invalid_param("logit_bias", format!("logit_bias key '{k}' is not a token id of this model (0..{vocab_size})"))),
        })
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(bad) = stop_token_ids.iter().find(|&&t| t as usize >= vocab_size) {
        return Err(ApiError::invalid_param("stop_token_ids", format!("stop token id {bad} is outside the vocabulary (size {vocab_size})")));
    }
    let (constraint, constraint_param) = match structured_constraint(&s.structured)? {
        Some((c, p)) => (Some(Arc::new(c)), p),
        None => (None, ""),
    };
    let defaults = SamplingParams::default();
    let base = SamplingParams {
        temperature: s.temperature.unwrap_or(defaults.temperature),
        top_k,
        top_p: s.top_p.unwrap_or(defaults.top_p),
        min_p: s.min_p.unwrap_or(defaults.min_p),
        repetition_penalty: s.repetition_penalty.unwrap_or(defaults.repetition_penalty),
        presence_penalty: s.presence_penalty.unwrap_or(defaults.presence_penalty),
        frequency_penalty: s.frequency_penalty.unwrap_or(defaults.frequency_penalty),
        // Negative seeds are accepted (OpenAI allows them) and wrap to the same 64 bits.
        seed: s.seed.map(|s| s as u64),
        // 0 (echo only) runs one step and drops its token: the engine always generates one
        max_tokens: requested_max_tokens.unwrap_or(1).max(1),
        // An empty stop string would end every request at once; it means nothing, so drop it.
        stop: stop.into_iter().filter(|s| !s.is_empty()).collect(),
        stop_token_ids: stop_token_ids.into(),
        logit_bias: logit_bias.into(),
        ignore_eos: s.ignore_eos.unwrap_or(false),
        disable_speculation: s.disable_speculation.unwrap_or(false),
        logprobs,
        prompt_logprobs,
        constraint,
        // set once the prompt is rendered (`conversation::prepare`): it depends on the template
        reasoning_budget: None,
        // set when the request is submitted (`generate::submit`), from its API key
        tenant: defaults.tenant,
    };
    base.validate(config.max_logprobs).map_err(|e| {
        let param = match e.param {
            "logprobs" => f.logprobs_param,
            "max_tokens" => f.max_tokens_param,
            p => p,
        };
        ApiError::invalid_param(param, e.message.replace("max_tokens", f.max_tokens_param))
    })?;
    Ok(SamplingPlan { n, base, requested_max_tokens, max_tokens_param: f.max_tokens_param, constraint_param })
}

/// The constraint the structured-output fields ask for (at most one of them may be given), and
/// the field it came from. Shapes: `response_format` `{type: text | json_object | json_schema,
/// json_schema: {name, schema, strict}}`; vLLM's `structured_outputs` with one of `json` (a
/// schema, or its JSON text), `regex`, `choice` (strings), `grammar` (Lark, llguidance's
/// dialect) or `json_object: true`; and the older `guided_json`, `guided_regex`,
/// `guided_choice`, `guided_grammar`.
pub fn structured_constraint(s: &StructuredFields) -> Result<Option<(Constraint, &'static str)>, ApiError> {
    let given: Vec<&'static str> = [
        ("response_format", &s.response_format),
        ("structured_outputs", &s.structured_outputs),
        ("guided_json", &s.guided_json),
        ("guided_regex", &s.guided_regex),
        ("guided_choice", &s.guided_choice),
        ("guided_grammar", &s.guided_grammar),
    ]
    .into_iter()
    .filter(|(_, v)| v.as_ref().is_some_and(|v| !v.is_null()))
    .map(|(n, _)| n)
    .collect();
    // `response_format: {type: text}` asks for nothing and may accompany the others
    let text_format = s.response_format.as_ref().is_some_and(|v| v.get("type").and_then(Value::as_str) == Some("text"));
    let asking: Vec<&str> = given.iter().copied().filter(|&n| !(n == "response_format" && text_format)).collect();
    if asking.len() > 1 {
        return Err(ApiError::invalid_param(asking[1], format!("only one structured-output field may be given, got {}", asking.join(" and "))));
    }
    let Some(&field) = asking.first() else { return Ok(None) };
    let c = match field {
        "response_format" => return response_format(s.response_format.as_ref().expect("given")),
        "structured_outputs" => return structured_outputs(s.structured_outputs.as_ref().expect("given")),
        "guided_json" => json_schema(s.guided_json.as_ref().expect("given"), "guided_json")?,
        "guided_regex" => Constraint::Regex(string(s.guided_regex.as_ref().expect("given"), "guided_regex")?),
        "guided_choice" => choice(s.guided_choice.as_ref().expect("given"), "guided_choice")?,
        _ => Constraint::Lark(string(s.guided_grammar.as_ref().expect("given"), "guided_grammar")?),
    };
    Ok(Some((c, field)))
}

fn response_format(v: &Value) -> Result<Option<(Constraint, &'static str)>, ApiError> {
    const P: &str = "response_format";
    let kind = v.get("type").and_then(Value::as_str).ok_or_else(|| ApiError::invalid_param(P, "response_format must be an object with a string `type`"))?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some((Constraint::JsonObject, P))),
        "json_schema" => {
            let js = v
                .get("json_schema")
                .filter(|j| j.is_object())
                .ok_or_else(|| ApiError::invalid_param(P, "response_format of type json_schema needs `json_schema: {name, schema, strict}`"))?;
            // OpenAI's schema is optional: without one, any JSON value
            let schema = js.get("schema").cloned().unwrap_or_else(|| Value::Object(Default::default()));
            Ok(Some((json_schema(&schema, P)?, P)))
        }
        other => Err(ApiError::invalid_param(P, format!("response_format type '{other}' is not supported (text, json_object, json_schema)"))),
    }
}

fn structured_outputs(v: &Value) -> Result<Option<(Constraint, &'static str)>, ApiError> {
    const P: &str = "structured_outputs";
    let obj = v.as_object().ok_or_else(|| ApiError::invalid_param(P, "structured_outputs must be an object with one of json, regex, choice, grammar"))?;
    let kinds: Vec<&str> = ["json", "regex", "choice", "grammar", "json_object"]
        .into_iter()
        .filter(|k| obj.get(*k).is_some_and(|x| !x.is_null() && x != &Value::Bool(false)))
        .collect();
    if kinds.len() != 1 {
        return Err(ApiError::invalid_param(
            P,
            format!("structured_outputs needs exactly one of json, regex, choice, grammar, json_object; got {}", kinds.len()),
        ));
    }
    let c = match kinds[0] {
        "json" => json_schema(&obj["json"], "structured_outputs.json")?,
        "regex" => Constraint::Regex(string(&obj["regex"], "structured_outputs.regex")?),
        "choice" => choice(&obj["choice"], "structured_outputs.choice")?,
        "grammar" => Constraint::Lark(string(&obj["grammar"], "structured_outputs.grammar")?),
        _ => Constraint::JsonObject,
    };
    Ok(Some((c, P)))
}

/// A JSON schema given as an object (or boolean), or as its JSON text.
fn json_schema(v: &Value, param: &'static str) -> Result<Constraint, ApiError> {
    let schema = match v {
        Value::String(s) => serde_json::from_str(s).map_err(|e| ApiError::invalid_param(param, format!("{param} is not a JSON schema: {e}")))?,
        other => other.clone(),
    };
    if !(schema.is_object() || schema.is_boolean()) {
        return Err(ApiError::invalid_param(param, format!("{param} must be a JSON schema object")));
    }
    Ok(Constraint::JsonSchema(schema.to_string()))
}

fn string(v: &Value, param: &'static str) -> Result<String, ApiError> {
    match v.as_str() {
        Some(s) if !s.is_empty() => Ok(s.to_string()),
        _ => Err(ApiError::invalid_param(param, format!("{param} must be a non-empty string"))),
    }
}

fn choice(v: &Value, param: &'static str) -> Result<Constraint, ApiError> {
    let opts: Option<Vec<String>> = v.as_array().and_then(|a| a.iter().map(|x| x.as_str().map(str::to_string)).collect());
    match opts {
        Some(o) if !o.is_empty() && o.iter().all(|s| !s.is_empty()) => Ok(Constraint::Choice(o)),
        _ => Err(ApiError::invalid_param(param, format!("{param} must be a non-empty list of non-empty strings"))),
    }
}

/// A prompt the engine can run: not empty, every id in the vocabulary, room left to generate.
pub fn check_prompt(tokens: &[TokenId], param: &str, config: &ServerConfig, vocab_size: usize) -> Result<(), ApiError> {
    if tokens.is_empty() {
        return Err(ApiError::invalid_param(param, "the prompt is empty; send at least one token of text"));
    }
    if let Some(bad) = tokens.iter().find(|&&t| t as usize >= vocab_size) {
        return Err(ApiError::invalid_param(param, format!("prompt token id {bad} is outside the vocabulary (size {vocab_size})")));
    }
    let (len, max) = (tokens.len(), config.max_model_len);
    if len > max {
        return Err(ApiError::invalid_param(param, format!("prompt has {len} tokens but --max-model-len is {max}; shorten the prompt")));
    }
    if len == max {
        return Err(ApiError::invalid_param(
            param,
            format!("prompt has {len} tokens and --max-model-len is {max}, which leaves no room to generate; shorten the prompt"),
        ));
    }
    Ok(())
}

impl SamplingPlan {
    /// The engine parameters for choice `choice` of a prompt of `prompt_len` tokens (already
    /// checked by [`check_prompt`], so at least one token of room is left).
    pub fn params_for(&self, prompt_len: usize, choice: usize, default: DefaultMaxTokens, config: &ServerConfig) -> Result<SamplingParams, ApiError> {
        let room = config.max_model_len.saturating_sub(prompt_len);
        let max_tokens = match (self.requested_max_tokens, default) {
            (Some(m), _) if prompt_len.saturating_add(m) > config.max_model_len => {
                return Err(ApiError::invalid_param(
                    self.max_tokens_param,
                    format!(
                        "prompt ({prompt_len} tokens) + {} ({m}) exceeds --max-model-len {}; lower {} to at most {room}",
                        self.max_tokens_param, config.max_model_len, self.max_tokens_param
                    ),
                ))
            }
            (Some(m), _) => m,
            (None, DefaultMaxTokens::RemainingContext) => room,
            (None, DefaultMaxTokens::Fixed(k)) => k.min(room),
        };
        let seed = self.base.seed.map(|s| s.wrapping_add(choice as u64));
        Ok(SamplingParams { max_tokens: max_tokens.max(1), seed, ..self.base.clone() })
    }
}

/// The conversation as the chat template wants it; content parts must all be text.
pub fn chat_messages(messages: Option<&[RequestMessage]>) -> Result<Vec<ChatMessage>, ApiError> {
    let messages = messages.unwrap_or_default();
    if messages.is_empty() {
        return Err(ApiError::invalid_param("messages", "messages must hold at least one message"));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            // OpenAI's roles; only an assistant turn may come without content (one that called tools)
            if !matches!(m.role.as_str(), "system" | "developer" | "user" | "assistant" | "tool") {
                return Err(ApiError::invalid_param(
                    &format!("messages[{i}].role"),
                    format!("unknown role '{}'; expected one of system, developer, user, assistant, tool", m.role),
                ));
            }
            let content = match &m.content {
                None if m.role != "assistant" => {
                    return Err(ApiError::invalid_param(&format!("messages[{i}].content"), format!("a {} message needs content", m.role)))
                }
                None => String::new(),
                Some(MessageContent::Text(t)) => t.clone(),
                Some(MessageContent::Parts(parts)) => {
                    let mut texts = Vec::with_capacity(parts.len());
                    for (j, part) in parts.iter().enumerate() {
                        match (part.kind.as_str(), &part.text) {
                            ("text", Some(t)) => texts.push(t.as_str()),
                            ("text", None) => {
                                return Err(ApiError::invalid_param(&format!("messages[{i}].content[{j}].text"), "a text content part needs a `text` field"))
                            }
                            (other, _) => {
                                return Err(ApiError::invalid_param(
                                    &format!("messages[{i}].content[{j}].type"),
                                    format!("content parts of type `{other}` are not supported; this model reads text only"),
                                ))
                            }
                        }
                    }
                    texts.join("\n")
                }
            };
            Ok(ChatMessage { role: m.role.clone(), content })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> ServerConfig {
        ServerConfig { max_model_len: 100, ..ServerConfig::new("m") }
    }

    fn plan(f: SamplingFields) -> Result<SamplingPlan, ApiError> {
        sampling_plan(f, &config(), 300)
    }

    #[test]
    fn the_served_name_and_its_aliases_are_accepted_and_nothing_else() {
        let c = ServerConfig { model_aliases: vec!["short-name".into()], ..config() };
        for ok in [None, Some("m"), Some("short-name")] {
            assert!(check_model(ok, &c).is_ok(), "{ok:?}");
        }
        for bad in ["other", "short", "M", ""] {
            let e = check_model(Some(bad), &c).unwrap_err();
            assert_eq!(e.status, axum::http::StatusCode::NOT_FOUND, "{bad}");
        }
        assert!(check_model(Some("short-name"), &config()).is_err(), "no alias unless configured");
    }

    #[test]
    fn defaults_are_engine_defaults() {
        let p = plan(SamplingFields { max_tokens_param: "max_tokens", logprobs_param: "logprobs", ..Default::default() }).unwrap();
        assert_eq!(p.n, 1);
        assert_eq!(p.requested_max_tokens, None);
        assert_eq!(p.base.temperature, 1.0);
        assert_eq!(p.base.logprobs, None);
    }

    #[test]
    fn out_of_range_fields_name_their_param() {
        let cases: Vec<(SamplingFields, &str)> = vec![
            (SamplingFields { max_tokens: Some(0), ..Default::default() }, "max_tokens"),
            (SamplingFields { max_tokens: Some(-3), ..Default::default() }, "max_tokens"),
            (SamplingFields { sampling: SamplingBlock { temperature: Some(-0.5), ..Default::default() }, ..Default::default() }, "temperature"),
            (SamplingFields { sampling: SamplingBlock { top_p: Some(0.0), ..Default::default() }, ..Default::default() }, "top_p"),
            (SamplingFields { sampling: SamplingBlock { top_p: Some(1.5), ..Default::default() }, ..Default::default() }, "top_p"),
            (SamplingFields { sampling: SamplingBlock { top_k: Some(-2), ..Default::default() }, ..Default::default() }, "top_k"),
            (SamplingFields { sampling: SamplingBlock { n: Some(0), ..Default::default() }, ..Default::default() }, "n"),
            (SamplingFields { sampling: SamplingBlock { n: Some(17), ..Default::default() }, ..Default::default() }, "n"),
            (SamplingFields { logprobs: Some(21), ..Default::default() }, "logprobs"),
            (SamplingFields { logprobs: Some(-1), ..Default::default() }, "logprobs"),
            (SamplingFields { sampling: SamplingBlock { stop_token_ids: Some(vec![300]), ..Default::default() }, ..Default::default() }, "stop_token_ids"),
        ];
        for (mut f, param) in cases {
            f.max_tokens_param = "max_tokens";
            f.logprobs_param = "logprobs";
            let e = plan(f).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{}", e.message);
        }
    }

    #[test]
    fn max_tokens_default_and_limit() {
        let f = || SamplingFields { max_tokens_param: "max_tokens", logprobs_param: "logprobs", ..Default::default() };
        let cfg = config();
        let p = plan(f()).unwrap();
        assert_eq!(p.params_for(90, 0, DefaultMaxTokens::RemainingContext, &cfg).unwrap().max_tokens, 10);
        assert_eq!(p.params_for(10, 0, DefaultMaxTokens::Fixed(16), &cfg).unwrap().max_tokens, 16);
        assert_eq!(p.params_for(90, 0, DefaultMaxTokens::Fixed(16), &cfg).unwrap().max_tokens, 10);
        let p = plan(SamplingFields { max_tokens: Some(11), ..f() }).unwrap();
        let e = p.params_for(90, 0, DefaultMaxTokens::Fixed(16), &cfg).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert!(e.message.contains("at most 10"), "{}", e.message);
        assert_eq!(p.params_for(89, 0, DefaultMaxTokens::Fixed(16), &cfg).unwrap().max_tokens, 11);
    }

    #[test]
    fn choice_i_gets_seed_plus_i() {
        let p = plan(SamplingFields { sampling: SamplingBlock { seed: Some(7), ..Default::default() }, max_tokens_param: "max_tokens", ..Default::default() })
            .unwrap();
        let cfg = config();
        let seeds: Vec<_> = (0..3).map(|i| p.params_for(5, i, DefaultMaxTokens::Fixed(16), &cfg).unwrap().seed).collect();
        assert_eq!(seeds, vec![Some(7), Some(8), Some(9)]);
    }

    #[test]
    fn prompt_checks() {
        let cfg = config();
        assert!(check_prompt(&[], "prompt", &cfg, 300).is_err());
        assert!(check_prompt(&[300], "prompt", &cfg, 300).is_err());
        let e = check_prompt(&[1; 101], "prompt", &cfg, 300).unwrap_err();
        assert_eq!(e.message, "prompt has 101 tokens but --max-model-len is 100; shorten the prompt");
        assert!(check_prompt(&[1; 100], "prompt", &cfg, 300).is_err());
        assert!(check_prompt(&[1; 99], "prompt", &cfg, 300).is_ok());
    }

    #[test]
    fn chat_top_logprobs_needs_logprobs() {
        let r = ChatCompletionRequest { top_logprobs: Some(2), ..Default::default() };
        assert_eq!(SamplingFields::from_chat(&r).unwrap_err().param.as_deref(), Some("top_logprobs"));
        let r = ChatCompletionRequest { logprobs: Some(true), top_logprobs: Some(2), ..Default::default() };
        assert_eq!(SamplingFields::from_chat(&r).unwrap().logprobs, Some(2));
    }

    #[test]
    fn chat_prompt_logprobs_are_checked_as_on_completions() {
        let fields = |k| SamplingFields::from_chat(&ChatCompletionRequest { prompt_logprobs: Some(k), ..Default::default() }).unwrap();
        assert_eq!(plan(fields(3)).unwrap().base.prompt_logprobs, Some(3));
        for k in [-1, 21] {
            assert_eq!(plan(fields(k)).unwrap_err().param.as_deref(), Some("prompt_logprobs"));
        }
    }

    /// The shared sampling block is spliced into both OpenAI requests: read back whole by
    /// `sampling()`, and a wrong type in it still names its field (a flattened block would not).
    #[test]
    fn the_sampling_block_reads_back_and_its_type_errors_name_the_field() {
        use crate::extract::parse_json;
        let body = br#"{"temperature": 0.5, "stop": "x", "n": 2, "prompt_logprobs": 1, "guided_regex": "a+", "logprobs": true}"#;
        let chat: ChatCompletionRequest = parse_json(body).unwrap();
        let done: CompletionRequest = parse_json(br#"{"temperature": 0.5, "stop": "x", "n": 2, "prompt_logprobs": 1, "guided_regex": "a+"}"#).unwrap();
        for b in [chat.sampling(), done.sampling()] {
            assert_eq!((b.temperature, b.n, b.prompt_logprobs), (Some(0.5), Some(2), Some(1)));
            assert_eq!(b.stop.map(Stop::into_vec), Some(vec!["x".to_string()]));
            assert_eq!(b.structured.guided_regex, Some(serde_json::json!("a+")));
        }
        for field in ["temperature", "top_k", "stop_token_ids", "ignore_eos"] {
            let body = format!(r#"{{"{field}": {{"wrong": 1}}}}"#);
            assert_eq!(parse_json::<ChatCompletionRequest>(body.as_bytes()).unwrap_err().param.as_deref(), Some(field));
            assert_eq!(parse_json::<CompletionRequest>(body.as_bytes()).unwrap_err().param.as_deref(), Some(field));
        }
    }

    fn structured(s: StructuredFields) -> Result<Option<(Constraint, &'static str)>, ApiError> {
        structured_constraint(&s)
    }

    /// Every request shape maps to its constraint and names its field; bad shapes are 400s
    /// naming the field.
    #[test]
    fn structured_output_fields_map_to_constraints() {
        use serde_json::json;
        let rf = |v| StructuredFields { response_format: Some(v), ..Default::default() };
        assert_eq!(structured(rf(json!({"type": "text"}))).unwrap(), None);
        assert_eq!(structured(rf(json!({"type": "json_object"}))).unwrap(), Some((Constraint::JsonObject, "response_format")));
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(
            structured(rf(json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}))).unwrap(),
            Some((Constraint::JsonSchema(schema.to_string()), "response_format"))
        );
        assert_eq!(structured(rf(json!({"type": "xml"}))).unwrap_err().param.as_deref(), Some("response_format"));
        assert_eq!(structured(rf(json!({"type": "json_schema"}))).unwrap_err().param.as_deref(), Some("response_format"));
        let so = |v| StructuredFields { structured_outputs: Some(v), ..Default::default() };
        assert_eq!(structured(so(json!({"regex": "a+"}))).unwrap(), Some((Constraint::Regex("a+".into()), "structured_outputs")));
        assert_eq!(structured(so(json!({"choice": ["x", "y"]}))).unwrap(), Some((Constraint::Choice(vec!["x".into(), "y".into()]), "structured_outputs")));
        assert_eq!(
            structured(so(json!({"json": "{\"type\": \"string\"}"}))).unwrap(),
            Some((Constraint::JsonSchema("{\"type\":\"string\"}".into()), "structured_outputs"))
        );
        assert_eq!(structured(so(json!({"grammar": "start: \"a\""}))).unwrap(), Some((Constraint::Lark("start: \"a\"".into()), "structured_outputs")));
        assert_eq!(structured(so(json!({"json_object": true}))).unwrap(), Some((Constraint::JsonObject, "structured_outputs")));
        assert!(structured(so(json!({"regex": "a", "choice": ["b"]}))).is_err());
        assert_eq!(structured(so(json!({"choice": []}))).unwrap_err().param.as_deref(), Some("structured_outputs.choice"));
        let old = StructuredFields { guided_choice: Some(json!(["a"])), ..Default::default() };
        assert_eq!(structured(old).unwrap(), Some((Constraint::Choice(vec!["a".into()]), "guided_choice")));
        let two = StructuredFields { guided_regex: Some(json!("a")), response_format: Some(json!({"type": "json_object"})), ..Default::default() };
        assert!(structured(two).unwrap_err().message.contains("only one"));
        // `text` beside another field asks for nothing more
        let text_and = StructuredFields { guided_regex: Some(json!("a")), response_format: Some(json!({"type": "text"})), ..Default::default() };
        assert_eq!(structured(text_and).unwrap(), Some((Constraint::Regex("a".into()), "guided_regex")));
    }
}
