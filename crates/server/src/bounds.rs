//! Bounds on every count and size a client controls, checked before any work is done for a
//! request (before tokenizing, rendering, compiling, cloning per choice or queueing): prompts per
//! request, prompts x `n` against the room left in the engine's waiting queue, `logit_bias`
//! entries, `stop_token_ids`, `tools`, `messages`, constraint and tools sizes, and a prompt
//! whose byte length alone rules it out against `--max-model-len`. Each bound is a
//! [`ServerConfig`] field with its reason. A refused request costs a pass over its counts.
//!
//! Not here: value ranges (`validate.rs`) and the work itself (`prep.rs`).

use crate::error::ApiError;
use crate::types::{ChatCompletionRequest, CompletionRequest, MessageContent, Prompt};
use crate::{AppState, ServerConfig};
use specula_engine::api::Constraint;
use specula_engine::handle::SubmitError;
use std::collections::BTreeMap;

/// A `/v1/completions` request's counts: prompts, prompts x n, sampling lists, prompt bytes.
pub fn check_completion(req: &CompletionRequest, state: &AppState) -> Result<(), ApiError> {
    let config = &state.config;
    sampling_lists(req.logit_bias.as_ref(), req.stop_token_ids.as_deref(), config)?;
    let prompts = match &req.prompt {
        Some(Prompt::Texts(ts)) => ts.len(),
        Some(Prompt::TokenLists(ls)) => ls.len(),
        Some(_) => 1,
        None => 0,
    };
    if prompts > config.max_prompts_per_request {
        return Err(ApiError::invalid_param(
            "prompt",
            format!("{prompts} prompts given; this server takes at most {} per request (--max-prompts-per-request)", config.max_prompts_per_request),
        ));
    }
    engine_room(state, prompts, req.n, "prompt")?;
    let too_long = |text: &str| prompt_bytes(state, text.len(), "prompt");
    match &req.prompt {
        Some(Prompt::Text(t)) => too_long(t),
        Some(Prompt::Texts(ts)) => ts.iter().try_for_each(|t| too_long(t)),
        _ => Ok(()),
    }
}

/// A chat request's counts: messages, tools (count and bytes), sampling lists, n, and the
/// conversation's text bytes.
pub fn check_chat(req: &ChatCompletionRequest, state: &AppState) -> Result<(), ApiError> {
    let config = &state.config;
    sampling_lists(req.logit_bias.as_ref(), req.stop_token_ids.as_deref(), config)?;
    let messages = req.messages.as_deref().unwrap_or_default();
    if messages.len() > config.max_messages {
        return Err(ApiError::invalid_param("messages", format!("{} messages given; this server takes at most {}", messages.len(), config.max_messages)));
    }
    if let Some(tools) = &req.tools {
        let count = tools.as_array().map_or(0, Vec::len);
        if count > config.max_tools {
            return Err(ApiError::invalid_param("tools", format!("{count} tools given; this server takes at most {}", config.max_tools)));
        }
        let bytes = json_bytes(tools);
        if bytes > config.max_schema_bytes {
            return Err(ApiError::invalid_param(
                "tools",
                format!("the tools take {bytes} bytes of JSON; this server takes at most {}", config.max_schema_bytes),
            ));
        }
    }
    engine_room(state, 1, req.n, "n")?;
    // the template adds markup around the contents, so their bytes are a lower bound
    let text_bytes: usize = messages
        .iter()
        .filter_map(|m| m.content.as_ref())
        .map(|c| match c {
            MessageContent::Text(t) => t.len(),
            MessageContent::Parts(parts) => parts.iter().filter_map(|p| p.text.as_ref()).map(String::len).sum(),
        })
        .sum();
    prompt_bytes(state, text_bytes, "messages")
}

/// Any dialect's conversation (`conversation::prepare`): messages, tools, `n` against the
/// engine's room, and the messages' text bytes against `--max-model-len`. Chat completions are
/// also checked on their wire request (`check_chat`) before they are translated.
pub fn check_conversation(state: &AppState, messages: &[serde_json::Value], tools: usize, n: usize) -> Result<(), ApiError> {
    let config = &state.config;
    if messages.len() > config.max_messages {
        return Err(ApiError::invalid_param("messages", format!("{} messages given; this server takes at most {}", messages.len(), config.max_messages)));
    }
    if tools > config.max_tools {
        return Err(ApiError::invalid_param("tools", format!("{tools} tools given; this server takes at most {}", config.max_tools)));
    }
    engine_room(state, 1, Some(n as i64), "n")?;
    let text_bytes: usize = messages.iter().filter_map(|m| m.get("content").and_then(serde_json::Value::as_str)).map(str::len).sum();
    prompt_bytes(state, text_bytes, "messages")
}

/// A structured-output constraint's size (its text: a schema's JSON, a regex, a grammar, the
/// choices together) against `max_schema_bytes`; `param` names the field it came from.
pub fn check_constraint(constraint: Option<&Constraint>, param: &str, config: &ServerConfig) -> Result<(), ApiError> {
    let bytes = match constraint {
        None | Some(Constraint::JsonObject) => 0,
        Some(Constraint::JsonSchema(t) | Constraint::Regex(t) | Constraint::Lark(t)) => t.len(),
        Some(Constraint::Choice(options)) => options.iter().map(String::len).sum(),
    };
    if bytes > config.max_schema_bytes {
        return Err(ApiError::invalid_param(param, format!("the constraint takes {bytes} bytes; this server takes at most {}", config.max_schema_bytes)));
    }
    Ok(())
}

/// `logit_bias` entries and `stop_token_ids`, counted before they are parsed or cloned.
fn sampling_lists(logit_bias: Option<&BTreeMap<String, f32>>, stop_token_ids: Option<&[u32]>, config: &ServerConfig) -> Result<(), ApiError> {
    let bias = logit_bias.map_or(0, BTreeMap::len);
    if bias > config.max_logit_bias {
        return Err(ApiError::invalid_param(
            "logit_bias",
            format!("{bias} logit_bias entries given; this server takes at most {} (--max-logit-bias)", config.max_logit_bias),
        ));
    }
    let stops = stop_token_ids.map_or(0, <[u32]>::len);
    if stops > config.max_stop_token_ids {
        return Err(ApiError::invalid_param(
            "stop_token_ids",
            format!("{stops} stop_token_ids given; this server takes at most {}", config.max_stop_token_ids),
        ));
    }
    Ok(())
}

/// `prompts` x `n` engine requests against the engine's waiting queue: more than it can ever
/// hold is a 400 (retrying cannot help), more than it has room for now a 503 `overloaded`.
/// An out-of-range `n` is left to `validate::sampling_plan` (counted here as 1, or the maximum).
fn engine_room(state: &AppState, prompts: usize, n: Option<i64>, param: &str) -> Result<(), ApiError> {
    let n = usize::try_from(n.unwrap_or(1)).unwrap_or(1).clamp(1, state.config.max_n);
    let wanted = prompts.saturating_mul(n);
    let (capacity, waiting) = (state.engine.capacity(), state.engine.waiting());
    // (a queue of 0 refuses everything as overloaded, like the engine handle does)
    if wanted > capacity.max(1) {
        return Err(ApiError::invalid_param(
            param,
            format!("this request makes {wanted} engine requests (prompts x n) but the server queues at most {capacity} (--max-waiting); split it"),
        ));
    }
    if wanted > capacity.saturating_sub(waiting) {
        return Err(SubmitError::QueueFull { waiting, limit: capacity }.into());
    }
    Ok(())
}

/// A text of `bytes` bytes that cannot fit `--max-model-len` whatever its tokens (each token
/// spells at most the tokenizer's longest token) is refused before it is tokenized.
fn prompt_bytes(state: &AppState, bytes: usize, param: &str) -> Result<(), ApiError> {
    let (fewest, max) = (state.prep.min_tokens(bytes), state.config.max_model_len);
    if fewest >= max {
        return Err(ApiError::invalid_param(
            param,
            format!("the prompt's {bytes} bytes are at least {fewest} tokens but --max-model-len is {max} (room is needed to generate); shorten the prompt"),
        ));
    }
    Ok(())
}

/// The length of `v`'s compact JSON, counted without building it.
fn json_bytes(v: &serde_json::Value) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0 += b.len();
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut c = Count(0);
    // writing to a counter cannot fail, and a Value always serializes
    let _ = serde_json::to_writer(&mut c, v);
    c.0
}
