//! Tool calling, shared by every dialect: the `tools` and `tool_choice` of a request checked
//! into a [`ToolSet`] and the Lark grammar that forces a call for `tool_choice: "required"` or a
//! named function (here), the conversation shaped for the chat template ([`render`]), and the
//! parser that finds calls in the model's text ([`parse`], fed whole or piece by piece while
//! streaming, so both paths give the same calls and the same content).
//! Not for running requests or any dialect's response shapes (`dialect/`, `types.rs`).
//!
//! Call formats understood: Hermes/Qwen (`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
//! possibly several) and Llama 3's bare JSON (`{"name": ..., "parameters": {...}}`, the whole
//! output, optionally after `<|python_tag|>`, several separated by `;`). A template that does not
//! render tools itself (it never mentions `tools`, e.g. SmolLM2's) gets them described in a system
//! message in the Hermes/Qwen format instead ([`hermes_fallback`]).

pub mod parse;
pub mod render;

pub(crate) use parse::partial_tag_len;
pub use parse::{call_id, CallParser, ParsedCall, ParsedMessage, Piece};
pub use render::{hermes_fallback, py_json, render, template_messages, template_renders_tools};

use crate::error::ApiError;
use serde_json::{json, Value};
use specula_engine::api::Constraint;

pub(crate) const CALL_OPEN: &str = "<tool_call>";
pub(crate) const CALL_CLOSE: &str = "</tool_call>";
pub(crate) const PYTHON_TAG: &str = "<|python_tag|>";

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

#[cfg(test)]
mod tests {
    use super::*;

    fn weather_tools() -> Value {
        json!([
            {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "now"}}
        ])
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
}
