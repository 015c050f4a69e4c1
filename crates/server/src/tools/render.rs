//! The conversation shaped for the chat template: a chat request's messages as template
//! objects, the prompt rendered with the tools (by the template, or described in a system message
//! for a template that does not render tools), and JSON printed as Qwen's template prints it.

use super::{ToolSet, CALL_CLOSE, CALL_OPEN};
use crate::error::ApiError;
use crate::types::RequestMessage;
use serde_json::{json, Map, Value};
use specula_model::{ChatTemplate, RenderedChat, Tokenizer};

/// The messages as JSON objects for the chat template: `role`, `content` (text, from
/// `validate::chat_messages`), and where given `tool_calls` (each call's `arguments` parsed from
/// its JSON text into an object, as vLLM does, so templates that write `arguments | tojson` print
/// JSON rather than a quoted string), `tool_call_id` and `name`.
pub fn template_messages(sent: &[RequestMessage], texts: Vec<specula_model::ChatMessage>) -> Result<Vec<Value>, ApiError> {
    sent.iter()
        .zip(texts)
        .enumerate()
        .map(|(i, (m, text))| {
            let mut obj = Map::new();
            obj.insert("role".into(), Value::String(text.role));
            obj.insert("content".into(), Value::String(text.content));
            if let Some(calls) = &m.tool_calls {
                if m.role != "assistant" {
                    return Err(ApiError::invalid_param(
                        &format!("messages[{i}].tool_calls"),
                        format!("only assistant messages carry tool_calls, not {}", m.role),
                    ));
                }
                let calls = calls
                    .iter()
                    .enumerate()
                    .map(|(j, c)| {
                        let param = format!("messages[{i}].tool_calls[{j}].function.arguments");
                        let arguments = match &c.function.arguments {
                            Value::String(s) => serde_json::from_str::<Value>(s)
                                .map_err(|e| ApiError::invalid_param(&param, format!("arguments must be a JSON text, as the model returned it: {e}")))?,
                            v @ Value::Object(_) => v.clone(),
                            _ => return Err(ApiError::invalid_param(&param, "arguments must be a JSON text (a string)")),
                        };
                        let mut call = json!({"type": c.kind.clone().unwrap_or_else(|| "function".into()),
                                              "function": {"name": c.function.name, "arguments": arguments}});
                        if let Some(id) = &c.id {
                            call["id"] = Value::String(id.clone());
                        }
                        Ok(call)
                    })
                    .collect::<Result<Vec<_>, ApiError>>()?;
                obj.insert("tool_calls".into(), Value::Array(calls));
            }
            if let Some(id) = &m.tool_call_id {
                obj.insert("tool_call_id".into(), Value::String(id.clone()));
            }
            if let Some(name) = &m.name {
                obj.insert("name".into(), Value::String(name.clone()));
            }
            if let (Some(r), "assistant") = (&m.reasoning_content, m.role.as_str()) {
                obj.insert("reasoning_content".into(), Value::String(r.clone()));
                obj.insert("thinking".into(), Value::String(r.clone()));
            }
            Ok(Value::Object(obj))
        })
        .collect()
}

/// The prompt for `messages` (from [`template_messages`]), rendered and tokenized: through the
/// template with `tools` when it renders tools itself, else rewritten by [`hermes_fallback`]
/// first, with extra template variables (`chat_template_kwargs`). Control tokens come only from
/// the template's markup (`ChatTemplate::render_tokens`): a message that spells `<|im_end|>`
/// gets the text, not the token.
pub fn render(
    template: &ChatTemplate,
    tokenizer: &Tokenizer,
    messages: Vec<Value>,
    tools: Option<&ToolSet>,
    add_generation_prompt: bool,
    kwargs: &Map<String, Value>,
) -> Result<RenderedChat, ApiError> {
    let rendered = if template_renders_tools(template.source()) {
        let definitions = tools.map(|t| Value::Array(t.definitions.clone()));
        template.render_tokens(tokenizer, &messages, definitions.as_ref(), add_generation_prompt, kwargs)
    } else {
        template.render_tokens(tokenizer, &hermes_fallback(messages, tools), None, add_generation_prompt, kwargs)
    };
    rendered.map_err(|e| ApiError::invalid_param("messages", e.to_string()))
}

/// Whether a chat template renders tools itself (Qwen2.5, Llama 3.1+, Hermes): it mentions them.
pub fn template_renders_tools(source: &str) -> bool {
    source.contains("tools")
}

/// For a template without tool support: the conversation rewritten the way Qwen2.5's template
/// would render it. The tools are described in the system message (appended to the client's
/// system message, or as a new first one), an assistant's calls become `<tool_call>` blocks in
/// its content, and each run of `tool` messages becomes one user message of `<tool_response>`
/// blocks. `tools` is `None` when there are none (the messages are still rewritten).
pub fn hermes_fallback(messages: Vec<Value>, tools: Option<&ToolSet>) -> Vec<Value> {
    let mut out: Vec<Value> = Vec::with_capacity(messages.len() + 1);
    if let Some(tools) = tools {
        let mut prompt = String::from(
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
             You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
        );
        for t in &tools.definitions {
            prompt.push('\n');
            prompt.push_str(&py_json(t));
        }
        prompt.push_str(
            "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n\
             <tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
        );
        out.push(json!({"role": "system", "content": prompt}));
    }
    for (i, mut m) in messages.into_iter().enumerate() {
        let role = m["role"].as_str().unwrap_or_default().to_string();
        let content = m["content"].as_str().unwrap_or_default().to_string();
        if i == 0 && role == "system" && tools.is_some() {
            out[0]["content"] = Value::String(format!("{content}\n\n{}", out[0]["content"].as_str().unwrap_or_default()));
            continue;
        }
        match role.as_str() {
            "assistant" if m.get("tool_calls").is_some() => {
                let mut text = content;
                for call in m["tool_calls"].as_array().into_iter().flatten() {
                    if !text.is_empty() {
                        text.push('\n');
                    }
                    let (name, arguments) = (&call["function"]["name"], &call["function"]["arguments"]);
                    text.push_str(&format!("{CALL_OPEN}\n{{\"name\": {}, \"arguments\": {}}}\n{CALL_CLOSE}", py_json(name), py_json(arguments)));
                }
                out.push(json!({"role": "assistant", "content": text}));
            }
            "tool" => {
                let block = format!("<tool_response>\n{content}\n</tool_response>");
                match out.last_mut() {
                    Some(prev) if prev.get("tool_responses").is_some() => {
                        let merged = format!("{}\n{block}", prev["content"].as_str().unwrap_or_default());
                        prev["content"] = Value::String(merged);
                    }
                    _ => out.push(json!({"role": "user", "content": block, "tool_responses": true})),
                }
            }
            _ => {
                if let Some(obj) = m.as_object_mut() {
                    obj.remove("tool_calls");
                }
                out.push(m);
            }
        }
    }
    for m in &mut out {
        if let Some(obj) = m.as_object_mut() {
            obj.remove("tool_responses");
        }
    }
    out
}

/// JSON as Python's `json.dumps` writes it (`", "` and `": "`, non-ASCII kept), keys sorted as
/// our minijinja prints them: how Qwen's template prints tools and arguments, so the fallback
/// prompt reads the same.
pub fn py_json(v: &Value) -> String {
    match v {
        Value::Array(items) => format!("[{}]", items.iter().map(py_json).collect::<Vec<_>>().join(", ")),
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            let fields: Vec<String> = keys.into_iter().map(|k| format!("{}: {}", Value::String(k.clone()), py_json(&map[k]))).collect();
            format!("{{{}}}", fields.join(", "))
        }
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> Value {
        json!({"role": role, "content": content})
    }

    #[test]
    fn the_fallback_describes_tools_in_the_system_message_as_qwen_does() {
        let set = ToolSet::from_request(Some(&json!([{"type": "function", "function": {"name": "now"}}])), None).unwrap().unwrap();
        let out = hermes_fallback(vec![msg("system", "Be terse."), msg("user", "time?")], Some(&set));
        assert_eq!(out.len(), 2);
        let system = out[0]["content"].as_str().unwrap();
        assert!(system.starts_with("Be terse.\n\n# Tools\n\n"), "{system}");
        assert!(system.contains("<tools>\n{\"function\": {\"name\": \"now\"}, \"type\": \"function\"}\n</tools>"), "{system}");
        assert!(system.ends_with("<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"), "{system}");
        let out = hermes_fallback(vec![msg("user", "time?")], Some(&set));
        assert_eq!(out[0]["role"], "system");
        assert_eq!(out[1], msg("user", "time?"));
    }

    #[test]
    fn the_fallback_writes_calls_and_results_as_text() {
        let calls = json!({"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                           {"type": "function", "function": {"name": "now", "arguments": {}}}]});
        let out = hermes_fallback(vec![msg("user", "q"), calls, msg("tool", "21"), msg("tool", "12:00"), msg("assistant", "ok")], None);
        assert_eq!(
            out,
            vec![
                msg("user", "q"),
                msg("assistant", "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>"),
                msg("user", "<tool_response>\n21\n</tool_response>\n<tool_response>\n12:00\n</tool_response>"),
                msg("assistant", "ok"),
            ]
        );
    }
}
