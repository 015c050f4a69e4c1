//! Tool calling on `/v1/chat/completions`: the `tools` and `tool_choice` of a request checked
//! into a [`ToolSet`], the conversation (assistant `tool_calls`, `tool` results) shaped for the
//! chat template, the Lark grammar that forces a call for `tool_choice: "required"` or a named
//! function, and the parser that finds calls in the model's text ([`CallParser`], fed whole or
//! piece by piece while streaming, so both paths give the same calls and the same content).
//! Not for running requests or the response shapes (`routes/chat.rs`, `types.rs`).
//!
//! Call formats understood: Hermes/Qwen (`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
//! possibly several) and Llama 3's bare JSON (`{"name": ..., "parameters": {...}}`, the whole
//! output, optionally after `<|python_tag|>`, several separated by `;`). A template that does not
//! render tools itself (it never mentions `tools`, e.g. SmolLM2's) gets them described in a system
//! message in the Hermes/Qwen format instead ([`hermes_fallback`]).

use crate::error::ApiError;
use crate::types::RequestMessage;
use serde_json::{json, Map, Value};
use specula_engine::api::Constraint;
use specula_model::{ChatTemplate, RenderedChat, Tokenizer};
use std::sync::atomic::{AtomicU64, Ordering};

const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";

/// What the model may do with the tools (`tool_choice`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// Never call: the tools are still rendered into the prompt and the output is not parsed
    /// (vLLM's default for `"none"`).
    None,
    /// Call or answer, as the model decides; calls are parsed from its text.
    Auto,
    /// At least one call, any tool: forced by a grammar.
    Required,
    /// Exactly one call of this function: forced by a grammar.
    Function(String),
}

/// One function tool, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct FunctionTool {
    pub name: String,
    /// The JSON schema of the arguments (`{"type": "object"}` when the tool gave none).
    pub parameters: Value,
}

/// A request's tools with its `tool_choice`; only built when `tools` is a non-empty list.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSet {
    /// The tool objects as sent (each `{"type": "function", "function": {...}}`), for the template.
    pub definitions: Vec<Value>,
    /// The same tools in the same order, checked.
    pub functions: Vec<FunctionTool>,
    pub choice: ToolChoice,
    /// `parallel_tool_calls` (default true): with false, `"required"` forces exactly one call.
    pub parallel: bool,
}

/// OpenAI's rule for function names, which also keeps them safe inside grammar literals.
fn valid_function_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The checks a parameters schema gets here; the engine's grammar compiler checks the rest when
/// a grammar embeds it.
fn check_parameters(schema: &Value, param: &str) -> Result<(), ApiError> {
    let bad = |msg: &str| {
        Err(ApiError::invalid_param(
            param,
            format!("{msg}; `parameters` must be a JSON Schema object such as {{\"type\": \"object\", \"properties\": {{...}}}}"),
        ))
    };
    let Some(obj) = schema.as_object() else {
        return bad("the parameters schema is not a JSON object");
    };
    match obj.get("type") {
        None | Some(Value::String(_)) => {}
        Some(Value::Array(kinds)) if kinds.iter().all(Value::is_string) => {}
        Some(_) => return bad("`type` must be a string or a list of strings"),
    }
    if obj.get("properties").is_some_and(|p| !p.is_object()) {
        return bad("`properties` must be an object");
    }
    if obj.get("required").is_some_and(|r| !r.as_array().is_some_and(|r| r.iter().all(Value::is_string))) {
        return bad("`required` must be a list of property names");
    }
    Ok(())
}

impl ToolSet {
    /// Checks `tools` and `tool_choice` as sent. `None` when there are no tools (absent or an
    /// empty list), in which case `tool_choice` may only be absent or `"none"`.
    pub fn from_request(tools: Option<&Value>, tool_choice: Option<&Value>) -> Result<Option<ToolSet>, ApiError> {
        let list = match tools {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(list)) => list.clone(),
            Some(_) => return Err(ApiError::invalid_param("tools", "tools must be a list of {\"type\": \"function\", \"function\": {...}} objects")),
        };
        let mut functions: Vec<FunctionTool> = Vec::with_capacity(list.len());
        for (i, tool) in list.iter().enumerate() {
            let at = |field: &str| format!("tools[{i}]{field}");
            let Some(obj) = tool.as_object() else {
                return Err(ApiError::invalid_param(&at(""), "a tool must be an object {\"type\": \"function\", \"function\": {...}}"));
            };
            match obj.get("type").and_then(Value::as_str) {
                Some("function") => {}
                Some(other) => {
                    return Err(ApiError::invalid_param(&at(".type"), format!("tools of type `{other}` are not supported; only `function` tools are")))
                }
                None => return Err(ApiError::invalid_param(&at(".type"), "a tool needs `\"type\": \"function\"`")),
            }
            let Some(function) = obj.get("function").and_then(Value::as_object) else {
                return Err(ApiError::invalid_param(&at(".function"), "a function tool needs a `function` object with at least a `name`"));
            };
            let name = match function.get("name").and_then(Value::as_str) {
                Some(n) if valid_function_name(n) => n.to_string(),
                Some(n) => {
                    return Err(ApiError::invalid_param(&at(".function.name"), format!("function name '{n}' must be 1 to 64 letters, digits, '_' or '-'")))
                }
                None => return Err(ApiError::invalid_param(&at(".function.name"), "a function tool needs a string `name`")),
            };
            if functions.iter().any(|f| f.name == name) {
                return Err(ApiError::invalid_param(&at(".function.name"), format!("two tools are named '{name}'; names must be unique")));
            }
            if function.get("description").is_some_and(|d| !d.is_string() && !d.is_null()) {
                return Err(ApiError::invalid_param(&at(".function.description"), "the description must be a string"));
            }
            let parameters = match function.get("parameters") {
                None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
                Some(p) => {
                    check_parameters(p, &at(".function.parameters"))?;
                    p.clone()
                }
            };
            functions.push(FunctionTool { name, parameters });
        }
        let choice = match tool_choice {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => match s.as_str() {
                "none" => Some(ToolChoice::None),
                "auto" => Some(ToolChoice::Auto),
                "required" => Some(ToolChoice::Required),
                other => {
                    return Err(ApiError::invalid_param(
                        "tool_choice",
                        format!("tool_choice '{other}' is not one of none, auto, required or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"),
                    ))
                }
            },
            Some(Value::Object(obj)) => {
                if obj.get("type").and_then(Value::as_str) != Some("function") {
                    return Err(ApiError::invalid_param("tool_choice", "a tool_choice object must be {\"type\": \"function\", \"function\": {\"name\": ...}}"));
                }
                let Some(name) = obj.get("function").and_then(|f| f.get("name")).and_then(Value::as_str) else {
                    return Err(ApiError::invalid_param("tool_choice", "tool_choice.function needs the `name` of one of the tools"));
                };
                if !functions.iter().any(|f| f.name == name) {
                    let known: Vec<&str> = functions.iter().map(|f| f.name.as_str()).collect();
                    return Err(ApiError::invalid_param(
                        "tool_choice",
                        format!("tool_choice names '{name}', which is not one of the tools ({})", known.join(", ")),
                    ));
                }
                Some(ToolChoice::Function(name.to_string()))
            }
            Some(_) => return Err(ApiError::invalid_param("tool_choice", "tool_choice must be a string (none, auto, required) or a function object")),
        };
        if functions.is_empty() {
            return match choice {
                None | Some(ToolChoice::None) => Ok(None),
                Some(_) => Err(ApiError::invalid_param("tool_choice", "tool_choice other than \"none\" needs `tools`")),
            };
        }
        Ok(Some(ToolSet { definitions: list, functions, choice: choice.unwrap_or(ToolChoice::Auto), parallel: true }))
    }

    /// Whether the model's output is searched for calls (every choice but `"none"`).
    pub fn parses_calls(&self) -> bool {
        self.choice != ToolChoice::None
    }

    pub fn names(&self) -> Vec<String> {
        self.functions.iter().map(|f| f.name.clone()).collect()
    }

    /// The grammar that forces the call(s) for `"required"` (one or more calls of any tool, one
    /// without `parallel`) and a named function (exactly one call of it); `None` for `"auto"` and
    /// `"none"`.
    pub fn constraint(&self) -> Option<Constraint> {
        match &self.choice {
            ToolChoice::None | ToolChoice::Auto => None,
            ToolChoice::Required => Some(Constraint::Lark(call_grammar(&self.functions.iter().collect::<Vec<_>>(), self.parallel))),
            ToolChoice::Function(name) => {
                let function: Vec<&FunctionTool> = self.functions.iter().filter(|f| &f.name == name).collect();
                Some(Constraint::Lark(call_grammar(&function, false)))
            }
        }
    }
}

/// A Lark grammar (llguidance's dialect) for `<tool_call>\n{"name": "<name>", "arguments": <args>}\n</tool_call>`
/// with `<args>` valid for that function's parameters schema (`%json`), the name one of
/// `functions`; with `repeat`, one or more such calls separated by a newline. `<tool_call>`
/// is matched as text: Qwen's `<tool_call>` token is a user-defined (not control) token, which
/// llguidance sees as its text.
pub fn call_grammar(functions: &[&FunctionTool], repeat: bool) -> String {
    let literal = |s: &str| serde_json::to_string(s).unwrap_or_default();
    let mut g = String::new();
    g.push_str(if repeat { "start: call (\"\\n\" call)*\n" } else { "start: call\n" });
    let alternatives: Vec<String> = (0..functions.len()).map(|i| format!("call_{i}")).collect();
    g.push_str(&format!("call: {}\n", alternatives.join(" | ")));
    for (i, f) in functions.iter().enumerate() {
        let head = format!("{CALL_OPEN}\n{{\"name\": \"{}\", \"arguments\": ", f.name);
        g.push_str(&format!("call_{i}: {} args_{i} {}\n", literal(&head), literal(&format!("}}\n{CALL_CLOSE}"))));
        g.push_str(&format!("args_{i}: %json {}\n", with_json_layout(&f.parameters)));
    }
    g
}

/// `schema` with Qwen's JSON layout (`", "` and `": "`, no other whitespace, as its template
/// prints arguments) unless it sets its own `x-guidance`: with free whitespace small models pad
/// with newlines until the token limit.
fn with_json_layout(schema: &Value) -> Value {
    let mut schema = schema.clone();
    if let Value::Object(m) = &mut schema {
        m.entry("x-guidance").or_insert_with(|| json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}));
    }
    schema
}

// ---------------------------------------------------------------------------------------------
// The conversation, shaped for the template
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// Finding calls in the output
// ---------------------------------------------------------------------------------------------

/// A call found in the model's text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedCall {
    pub name: String,
    /// The arguments object as compact JSON text.
    pub arguments: String,
}

/// What the parser lets out, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Content(String),
    /// A whole call (a block that is not in the streamable form, once it closed and parsed).
    Call(ParsedCall),
    /// A call in the streamable form `{"name": "<name>", "arguments": {` starts: its arguments
    /// follow as [`Piece::CallArguments`] fragments.
    CallStart(String),
    /// The next fragment of the arguments of the call last started.
    CallArguments(String),
}

/// The parse of a whole output.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ParsedMessage {
    /// The text outside the calls, trimmed; `None` when nothing is left.
    pub content: Option<String>,
    pub calls: Vec<ParsedCall>,
}

/// `{"name": <string>, "arguments" | "parameters": <object>}` (arguments may also come as a
/// JSON text holding an object, or be absent: `{}`).
fn call_from_json(v: &Value) -> Option<ParsedCall> {
    let obj = v.as_object()?;
    let name = obj.get("name")?.as_str().filter(|n| !n.is_empty())?;
    let arguments = match obj.get("arguments").or_else(|| obj.get("parameters")) {
        None => Value::Object(Map::new()),
        Some(Value::String(s)) => serde_json::from_str::<Value>(s).ok().filter(Value::is_object)?,
        Some(v @ Value::Object(_)) => v.clone(),
        Some(_) => return None,
    };
    Some(ParsedCall { name: name.to_string(), arguments: arguments.to_string() })
}

/// The body between `<tool_call>` and `</tool_call>`.
fn parse_hermes_body(body: &str) -> Option<ParsedCall> {
    call_from_json(&serde_json::from_str::<Value>(body.trim()).ok()?)
}

/// Llama 3's form: the whole output is one call object, or several joined by `;`, each naming
/// one of the tools (bare JSON is ambiguous, so an unknown name means "not a call").
fn parse_json_calls(text: &str, names: &[String]) -> Option<Vec<ParsedCall>> {
    let text = text.trim();
    let text = text.strip_prefix(PYTHON_TAG).unwrap_or(text).trim();
    let whole = serde_json::from_str::<Value>(text).ok().map(|v| vec![v]);
    let values = match whole {
        Some(v) => v,
        None => text.split(';').map(|part| serde_json::from_str::<Value>(part.trim()).ok()).collect::<Option<Vec<_>>>()?,
    };
    values.iter().map(|v| call_from_json(v).filter(|c| names.contains(&c.name))).collect()
}

impl ParsedMessage {
    /// The message the pieces of one output add up to.
    pub fn from_pieces(pieces: impl IntoIterator<Item = Piece>) -> Self {
        let mut message = ParsedMessage::default();
        let mut content = String::new();
        for piece in pieces {
            match piece {
                Piece::Content(text) => content.push_str(&text),
                Piece::Call(call) => message.calls.push(call),
                Piece::CallStart(name) => message.calls.push(ParsedCall { name, arguments: String::new() }),
                Piece::CallArguments(text) => match message.calls.last_mut() {
                    Some(call) => call.arguments.push_str(&text),
                    None => content.push_str(&text), // not produced by the parser
                },
            }
        }
        message.content = (!content.is_empty()).then_some(content);
        message
    }
}

/// How the text after `<tool_call>` begins.
#[derive(Debug, PartialEq, Eq)]
enum Head {
    /// Not decided yet: more text may still make it the streamable form.
    Open,
    /// Not the streamable form: the block is parsed whole once it closes.
    Other,
    /// `{"name": "<name>", "arguments": ` (any whitespace between), the arguments object's `{`
    /// next; `len` bytes of the body.
    Streamable { name: String, len: usize },
}

/// Whether `body` (the text after `<tool_call>` so far) opens a call in the form whose arguments
/// can be streamed as they come: the name first, then an arguments object. The decision reads
/// only the text up to the arguments' `{`, so it is the same however the output is split.
fn streamable_head(body: &str) -> Head {
    let mut rest = body;
    // each literal: Open if the text ends inside it, Other if it differs
    let lit = |r: &mut &str, l: &str| -> Option<Head> {
        *r = r.trim_start();
        if r.starts_with(l) {
            *r = &r[l.len()..];
            None
        } else if l.starts_with(*r) {
            Some(Head::Open)
        } else {
            Some(Head::Other)
        }
    };
    for l in ["{", "\"name\"", ":", "\""] {
        if let Some(h) = lit(&mut rest, l) {
            return h;
        }
    }
    let Some(end) = rest.find(['"', '\\']) else { return Head::Open };
    if rest.as_bytes()[end] == b'\\' || end == 0 {
        return Head::Other; // an escaped or empty name: parsed whole
    }
    let name = rest[..end].to_string();
    rest = &rest[end + 1..];
    for l in [",", "\"arguments\"", ":", "{"] {
        if let Some(h) = lit(&mut rest, l) {
            return h;
        }
    }
    Head::Streamable { name, len: body.len() - rest.len() - 1 }
}

/// A streamed call's arguments, with the whitespace outside strings dropped (compact JSON, as
/// a whole call's arguments are written) and the closing braces at the end held back: the last
/// one closes the call's object, not the arguments.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Arguments {
    in_string: bool,
    escaped: bool,
    /// Compacted text not let out yet (a run of `}` outside strings).
    held: String,
}

impl Arguments {
    /// Takes raw body text; returns what can be let out.
    fn push(&mut self, text: &str) -> String {
        let mut out = std::mem::take(&mut self.held);
        for c in text.chars() {
            if self.escaped {
                self.escaped = false;
            } else if self.in_string {
                self.escaped = c == '\\';
                self.in_string = c != '"';
            } else if c == '"' {
                self.in_string = true;
            } else if c.is_whitespace() {
                continue;
            }
            out.push(c);
        }
        if !self.in_string {
            let body = out.trim_end_matches('}').len();
            self.held = out.split_off(body);
        }
        out
    }

    /// The end of the call: what is left without the call object's closing brace.
    fn close(&mut self) -> String {
        let mut rest = std::mem::take(&mut self.held);
        rest.pop();
        rest
    }
}

/// Where the parser is in the output.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Mode {
    /// Nothing but whitespace (or a prefix of `<|python_tag|>`) seen yet.
    Start,
    /// Ordinary text; `pending` holds at most a possible start of `<tool_call>`.
    Text,
    /// Inside `<tool_call>`: `pending` is the body so far.
    InCall,
    /// Inside a `<tool_call>` in the streamable form, its name sent: `pending` holds at most a
    /// possible start of `</tool_call>`, the arguments go out as they come.
    StreamingCall(Arguments),
    /// The output opened with `{` or `<|python_tag|>`: held whole until the end (Llama's form).
    WholeJson,
}

/// Finds calls in the model's text as it arrives, and lets out the content around them and the
/// calls: a call in the form Qwen writes (name, then an arguments object) as soon as its name is
/// known, then its arguments piece by piece; any other block whole once it closed. The
/// whitespace around the content is dropped (leading at once, trailing held until more content
/// follows), so the streamed content adds up to the non-streaming one. A whole output goes
/// through the same machine ([`CallParser::parse`]).
#[derive(Debug, Clone)]
pub struct CallParser {
    names: Vec<String>,
    mode: Mode,
    /// Text seen but not yet let out (see [`Mode`]).
    pending: String,
    /// Trailing whitespace of the content let out so far, sent once more content follows.
    held_space: String,
    /// Whether any content was let out (leading whitespace is dropped until then).
    content_started: bool,
}

impl CallParser {
    /// `names`: the request's tool names (Llama's bare-JSON form must name one).
    pub fn new(names: Vec<String>) -> Self {
        Self { names, mode: Mode::Start, pending: String::new(), held_space: String::new(), content_started: false }
    }

    /// The calls and content of a whole output.
    pub fn parse(text: &str, names: Vec<String>) -> ParsedMessage {
        let mut parser = Self::new(names);
        let mut pieces = parser.push(text);
        pieces.extend(parser.finish());
        ParsedMessage::from_pieces(pieces)
    }

    /// Takes the next piece of output; returns what can be let out now.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.mode {
                Mode::Start => {
                    let head = self.pending.trim_start();
                    if head.is_empty() || (PYTHON_TAG.starts_with(head) && head.len() < PYTHON_TAG.len()) {
                        return out;
                    }
                    self.mode = if head.starts_with('{') || head.starts_with(PYTHON_TAG) { Mode::WholeJson } else { Mode::Text };
                }
                Mode::Text => match self.pending.find(CALL_OPEN) {
                    Some(at) => {
                        let before: String = self.pending.drain(..at + CALL_OPEN.len()).collect();
                        self.content(&before[..at], &mut out);
                        self.mode = Mode::InCall;
                    }
                    None => {
                        let keep = partial_tag_len(&self.pending, CALL_OPEN);
                        let sendable: String = self.pending.drain(..self.pending.len() - keep).collect();
                        self.content(&sendable, &mut out);
                        return out;
                    }
                },
                Mode::InCall if matches!(self.call_head(), Head::Streamable { .. }) => {
                    let Head::Streamable { name, len } = self.call_head() else { unreachable!("matched above") };
                    self.pending.drain(..len);
                    out.push(Piece::CallStart(name));
                    self.mode = Mode::StreamingCall(Arguments::default());
                }
                Mode::StreamingCall(ref mut args) => {
                    let (raw, closed) = match self.pending.find(CALL_CLOSE) {
                        Some(at) => {
                            let raw: String = self.pending.drain(..at + CALL_CLOSE.len()).collect();
                            (raw[..at].to_string(), true)
                        }
                        None => {
                            let keep = partial_tag_len(&self.pending, CALL_CLOSE);
                            (self.pending.drain(..self.pending.len() - keep).collect(), false)
                        }
                    };
                    let mut text = args.push(&raw);
                    if closed {
                        text.push_str(&args.close());
                        self.mode = Mode::Text;
                    }
                    if !text.is_empty() {
                        out.push(Piece::CallArguments(text));
                    }
                    if !closed {
                        return out;
                    }
                }
                Mode::InCall => match self.pending.find(CALL_CLOSE) {
                    Some(at) => {
                        let block: String = self.pending.drain(..at + CALL_CLOSE.len()).collect();
                        let body = &block[..at];
                        match parse_hermes_body(body) {
                            Some(call) => out.push(Piece::Call(call)),
                            None => self.content(&format!("{CALL_OPEN}{block}"), &mut out),
                        }
                        self.mode = Mode::Text;
                    }
                    None => return out,
                },
                Mode::WholeJson => return out,
            }
        }
    }

    /// How the call in `pending` begins (the text before a `</tool_call>` only).
    fn call_head(&self) -> Head {
        streamable_head(self.pending.find(CALL_CLOSE).map_or(&self.pending[..], |at| &self.pending[..at]))
    }

    /// The end of the output: lets out whatever was held. A `<tool_call>` left open is a call if
    /// its body parses; bare JSON is a call if it is one.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        let pending = std::mem::take(&mut self.pending);
        match std::mem::replace(&mut self.mode, Mode::Text) {
            Mode::Start | Mode::Text => self.content(&pending, &mut out),
            Mode::StreamingCall(mut args) => {
                let text = args.push(&pending) + &args.close();
                if !text.is_empty() {
                    out.push(Piece::CallArguments(text));
                }
            }
            Mode::InCall => match parse_hermes_body(&pending) {
                Some(call) => out.push(Piece::Call(call)),
                None => self.content(&format!("{CALL_OPEN}{pending}"), &mut out),
            },
            Mode::WholeJson => match parse_json_calls(&pending, &self.names) {
                Some(calls) => out.extend(calls.into_iter().map(Piece::Call)),
                None => self.content(&pending, &mut out),
            },
        }
        self.mode = Mode::Text;
        self.held_space.clear();
        out
    }

    /// Lets out `text` as content, trimming the whitespace at the content's two ends.
    fn content(&mut self, text: &str, out: &mut Vec<Piece>) {
        let mut text = std::mem::take(&mut self.held_space) + text;
        if !self.content_started {
            text = text.trim_start().to_string();
        }
        let body_len = text.trim_end().len();
        self.held_space = text.split_off(body_len);
        if !text.is_empty() {
            self.content_started = true;
            out.push(Piece::Content(text));
        }
    }
}

/// The length of the longest end of `text` that is a proper start of `tag`.
pub(crate) fn partial_tag_len(text: &str, tag: &str) -> usize {
    (1..tag.len().min(text.len() + 1)).rev().find(|&n| text.is_char_boundary(text.len() - n) && tag.starts_with(&text[text.len() - n..])).unwrap_or(0)
}

/// A new call id (`call_` + 24 hex digits), unique in this process.
pub fn call_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("call_{:016x}{:08x}", crate::unix_now(), n as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        vec!["get_weather".into(), "now".into()]
    }

    fn call(name: &str, arguments: &str) -> ParsedCall {
        ParsedCall { name: name.into(), arguments: arguments.into() }
    }

    fn weather_tools() -> Value {
        json!([
            {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "now"}}
        ])
    }

    #[test]
    fn hermes_calls_become_tool_calls_and_the_rest_content() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
        let m = CallParser::parse(text, names());
        assert_eq!(m.content.as_deref(), Some("Let me check."));
        assert_eq!(m.calls, vec![call("get_weather", r#"{"city":"Paris"}"#), call("now", "{}")]);
    }

    #[test]
    fn a_call_alone_has_null_content() {
        let m = CallParser::parse("<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>\n", names());
        assert_eq!(m, ParsedMessage { content: None, calls: vec![call("now", "{}")] });
    }

    #[test]
    fn an_unclosed_last_call_still_parses_if_its_json_does() {
        let m = CallParser::parse("<tool_call>\n{\"name\": \"now\", \"arguments\": {}}", names());
        assert_eq!(m.calls, vec![call("now", "{}")]);
        let m = CallParser::parse("<tool_call>\n{\"name\": \"now\", \"argum", names());
        assert_eq!(m, ParsedMessage { content: Some("<tool_call>\n{\"name\": \"now\", \"argum".into()), calls: vec![] });
    }

    #[test]
    fn text_that_only_looks_like_a_call_stays_content() {
        for text in [
            "<tool_call>\nnot json\n</tool_call>",
            "<tool_call>{\"arguments\": {}}</tool_call>",
            "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>",
            "I would use <tool_call but no.",
        ] {
            let m = CallParser::parse(text, names());
            assert_eq!(m, ParsedMessage { content: Some(text.into()), calls: vec![] }, "{text}");
        }
    }

    #[test]
    fn llama_json_calls_must_name_a_tool() {
        let m = CallParser::parse(" {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}", names());
        assert_eq!(m, ParsedMessage { content: None, calls: vec![call("get_weather", r#"{"city":"Oslo"}"#)] });
        let m = CallParser::parse(
            "<|python_tag|>{\"name\": \"now\", \"parameters\": {}}; {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}",
            names(),
        );
        assert_eq!(m.calls, vec![call("now", "{}"), call("get_weather", r#"{"city":"Rome"}"#)]);
        let text = "{\"name\": \"Bob\", \"parameters\": {}}";
        assert_eq!(CallParser::parse(text, names()), ParsedMessage { content: Some(text.into()), calls: vec![] });
        let text = "{\"answer\": 42}";
        assert_eq!(CallParser::parse(text, names()).content.as_deref(), Some(text));
    }

    #[test]
    fn arguments_given_as_a_json_string_are_unwrapped() {
        let m = CallParser::parse("<tool_call>{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Paris\\\"}\"}</tool_call>", names());
        assert_eq!(m.calls, vec![call("get_weather", r#"{"city":"Paris"}"#)]);
    }

    #[test]
    fn streaming_in_any_pieces_gives_the_whole_parse() {
        let texts = [
            "  Sure.\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Köln\"}}\n</tool_call>\nand <tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>  ",
            "plain answer with < and <tool and </tool_call> in it\n",
            "<tool_call>\nbroken\n</tool_call> tail",
            "{\"name\": \"now\", \"parameters\": {}}",
            "<|python_tag|>{\"name\": \"now\", \"parameters\": {}}",
            "<|pyth",
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"a}\\\"}\", \"n\": {\"x\": [1, {}]}}}\n</tool_call>",
            "<tool_call>{\"name\": \"now\", \"arguments\": {} }   ",
            "<tool_call>{\"name\": \"now\"</tool_call> x",
        ];
        for text in texts {
            let whole = CallParser::parse(text, names());
            let chars: Vec<char> = text.chars().collect();
            for step in [1, 2, 3, 7] {
                let mut parser = CallParser::new(names());
                let mut pieces = Vec::new();
                for chunk in chars.chunks(step) {
                    pieces.extend(parser.push(&chunk.iter().collect::<String>()));
                }
                pieces.extend(parser.finish());
                assert_eq!(ParsedMessage::from_pieces(pieces), whole, "{text:?} in pieces of {step}");
            }
        }
    }

    #[test]
    fn content_before_a_call_is_let_out_before_the_call_closes() {
        let mut p = CallParser::new(names());
        assert_eq!(p.push("Checking the weather <tool"), vec![Piece::Content("Checking the weather".into())]);
        assert_eq!(p.push("_call>\n{\"name\": \"now\", "), vec![]);
        assert_eq!(p.push("\"arguments\": {}}\n</tool_call>"), vec![Piece::CallStart("now".into()), Piece::CallArguments("{}".into())]);
        assert_eq!(p.finish(), vec![]);
    }

    /// A call in Qwen's form goes out as it is written: its name as soon as it is known, then its
    /// arguments in fragments (whitespace outside strings dropped, the call object's closing
    /// brace held back and dropped), adding up to the whole parse's arguments.
    #[test]
    fn a_call_streams_its_name_then_its_arguments_in_fragments() {
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Köln } \\\" x\", \"days\": [1, 2], \"opts\": {\"unit\": \"C\"}}}\n</tool_call>";
        let whole = CallParser::parse(text, names());
        assert_eq!(whole.calls, vec![call("get_weather", r#"{"city":"Köln } \" x","days":[1,2],"opts":{"unit":"C"}}"#)]);
        let serde: Value = serde_json::from_str(&whole.calls[0].arguments).unwrap();
        assert_eq!(serde["city"], "Köln } \" x");
        let mut p = CallParser::new(names());
        assert_eq!(p.push("<tool_call>\n{\"name\": \"get_wea"), vec![]);
        assert_eq!(p.push("ther\", \"arguments\": "), vec![]);
        assert_eq!(p.push("{\"city\": \"Kö"), vec![Piece::CallStart("get_weather".into()), Piece::CallArguments("{\"city\":\"Kö".into())]);
        assert_eq!(p.push("ln\", \"opts\": {\"unit\": \"C\"}"), vec![Piece::CallArguments("ln\",\"opts\":{\"unit\":\"C\"".into())]);
        assert_eq!(p.push("}}\n</tool"), vec![]);
        assert_eq!(p.push("_call>"), vec![Piece::CallArguments("}}".into())]);
        assert_eq!(p.finish(), vec![]);
        // the name is not first, or the arguments are no object: the block is parsed whole
        for text in [
            "<tool_call>{\"arguments\": {\"city\": \"Rome\"}, \"name\": \"get_weather\"}</tool_call>",
            "<tool_call>{\"name\": \"now\", \"arguments\": \"{}\"}</tool_call>",
        ] {
            let mut p = CallParser::new(names());
            let mut pieces = p.push(text);
            pieces.extend(p.finish());
            assert!(matches!(&pieces[..], [Piece::Call(_)]), "{text}: {pieces:?}");
        }
    }

    #[test]
    fn partial_tags_are_held_back() {
        assert_eq!(partial_tag_len("abc <tool_c", CALL_OPEN), 7);
        assert_eq!(partial_tag_len("abc <", CALL_OPEN), 1);
        assert_eq!(partial_tag_len("abc", CALL_OPEN), 0);
        assert_eq!(partial_tag_len("é<", CALL_OPEN), 1);
    }

    #[test]
    fn tools_and_tool_choice_are_checked() {
        let tools = weather_tools();
        let set = ToolSet::from_request(Some(&tools), None).unwrap().unwrap();
        assert_eq!(set.choice, ToolChoice::Auto);
        assert_eq!(set.names(), vec!["get_weather", "now"]);
        assert_eq!(set.functions[1].parameters, json!({"type": "object", "properties": {}}));
        let named = json!({"type": "function", "function": {"name": "now"}});
        assert_eq!(ToolSet::from_request(Some(&tools), Some(&named)).unwrap().unwrap().choice, ToolChoice::Function("now".into()));
        assert_eq!(ToolSet::from_request(None, Some(&json!("none"))).unwrap(), None);
        assert_eq!(ToolSet::from_request(Some(&json!([])), None).unwrap(), None);

        let param = |tools: Value, choice: Option<Value>| ToolSet::from_request(Some(&tools), choice.as_ref()).unwrap_err().param.unwrap();
        assert_eq!(param(tools.clone(), Some(json!({"type": "function", "function": {"name": "nope"}}))), "tool_choice");
        assert_eq!(param(tools.clone(), Some(json!("sometimes"))), "tool_choice");
        assert_eq!(param(json!([{"type": "retrieval"}]), None), "tools[0].type");
        assert_eq!(param(json!([{"type": "function", "function": {"name": "a b"}}]), None), "tools[0].function.name");
        assert_eq!(param(json!([{"type": "function", "function": {"name": "f", "parameters": "x"}}]), None), "tools[0].function.parameters");
        assert_eq!(param(json!([{"type": "function", "function": {"name": "f", "parameters": {"properties": []}}}]), None), "tools[0].function.parameters");
        assert_eq!(
            param(json!([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]), None),
            "tools[1].function.name"
        );
        assert_eq!(param(json!({"type": "function"}), None), "tools");
        assert_eq!(ToolSet::from_request(None, Some(&json!("required"))).unwrap_err().param.as_deref(), Some("tool_choice"));
    }

    #[test]
    fn the_named_function_grammar_forces_its_call() {
        let set = ToolSet::from_request(Some(&weather_tools()), Some(&json!({"type": "function", "function": {"name": "get_weather"}}))).unwrap().unwrap();
        let Some(Constraint::Lark(g)) = set.constraint() else { panic!("no grammar") };
        let schema = with_json_layout(&set.functions[0].parameters);
        assert_eq!(
            g,
            format!(
                "start: call\n\
                 call: call_0\n\
                 call_0: \"<tool_call>\\n{{\\\"name\\\": \\\"get_weather\\\", \\\"arguments\\\": \" args_0 \"}}\\n</tool_call>\"\n\
                 args_0: %json {schema}\n"
            )
        );
        let layout = json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
        assert_eq!(schema, json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "x-guidance": layout}));
    }

    #[test]
    fn the_required_grammar_is_an_alternation_over_the_tools_repeated() {
        let set = ToolSet::from_request(Some(&weather_tools()), Some(&json!("required"))).unwrap().unwrap();
        let Some(Constraint::Lark(g)) = set.constraint() else { panic!("no grammar") };
        let lines: Vec<&str> = g.lines().collect();
        assert_eq!(lines[0], "start: call (\"\\n\" call)*");
        assert_eq!(lines[1], "call: call_0 | call_1");
        assert_eq!(lines[5], format!("args_1: %json {}", with_json_layout(&json!({"type": "object", "properties": {}}))));
        assert!(lines[4].contains("\\\"name\\\": \\\"now\\\""), "{}", lines[4]);
        let single = ToolSet { parallel: false, ..set };
        let Some(Constraint::Lark(g)) = single.constraint() else { panic!("no grammar") };
        assert!(g.starts_with("start: call\ncall: call_0 | call_1\n"), "{g}");
        let auto = ToolSet::from_request(Some(&weather_tools()), None).unwrap().unwrap();
        assert_eq!(auto.constraint(), None);
    }

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
