//! Tool calling through the router with the fake engine, which echoes the prompt back: the test
//! template (ChatML) does not render tools, so the prompt holds the Hermes-style tool system
//! message, and a user message written as a `<tool_call>` block comes back as a call.

mod common;

use axum::http::StatusCode;
use common::*;
use serde_json::{json, Value};
use specula_engine::api::Constraint;
use std::time::Duration;

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])
}

fn tool_server() -> TestServer {
    server_with(Setup {
        config: specula_server::ServerConfig { max_model_len: 4096, ..specula_server::ServerConfig::new(MODEL) },
        tick: Duration::ZERO,
        ..Setup::default()
    })
}

const CALL: &str = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";

fn request(stream: bool) -> Value {
    json!({"messages": [{"role": "user", "content": CALL}], "tools": tools(), "max_tokens": 900, "stream": stream})
}

#[tokio::test]
async fn the_echoed_call_comes_back_as_tool_calls() {
    let s = tool_server();
    let (status, v) = s.post("/v1/chat/completions", request(false)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert!(!calls.is_empty());
    assert_eq!(calls[0]["type"], "function");
    assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(calls[0]["function"], json!({"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}));
    // the system message's format example (`{"name": <function-name>, ...}`) is no call: it stays content
    assert!(choice["message"]["content"].as_str().unwrap().contains("# Tools"));
    let (_, prompt, params) = s.submitted().pop().unwrap();
    assert!(s.tokenizer.decode(&prompt, false).unwrap().contains("<tools>\n{\"function\": {\"description\": \"Weather in a city\", \"name\": \"get_weather\""));
    assert_eq!(params.constraint, None, "auto needs no grammar");
}

/// The calls of a streamed response put together from their pieces (each piece's arguments
/// appended to its call's), the content, the finish reason, and how many pieces carried
/// arguments per call. The first piece of a call must carry its id, type, name and arguments "".
async fn streamed_calls(s: &TestServer, body: Value) -> (String, Vec<Value>, Value, Vec<usize>) {
    let resp = s.post_raw("/v1/chat/completions", body.to_string()).await;
    let data = sse_data(&text_of(resp).await);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let mut content = String::new();
    let mut calls: Vec<Value> = Vec::new();
    let mut fragments: Vec<usize> = Vec::new();
    let mut reason = Value::Null;
    for d in &data[..data.len() - 1] {
        let chunk: Value = serde_json::from_str(d).unwrap();
        let c = &chunk["choices"][0];
        content.push_str(c["delta"]["content"].as_str().unwrap_or_default());
        for piece in c["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let i = piece["index"].as_u64().unwrap() as usize;
            if i == calls.len() {
                assert!(piece["id"].as_str().unwrap().starts_with("call_") && piece["function"]["name"].is_string(), "first piece: {piece}");
                assert_eq!((&piece["type"], &piece["function"]["arguments"]), (&json!("function"), &json!("")), "first piece: {piece}");
                calls.push(json!({"type": piece["type"], "function": {"name": piece["function"]["name"], "arguments": ""}}));
                fragments.push(0);
            } else {
                assert!(piece.get("id").is_none() && piece["function"].get("name").is_none(), "a later piece: {piece}");
            }
            fragments[i] += usize::from(!piece["function"]["arguments"].as_str().unwrap().is_empty());
            let args = format!("{}{}", calls[i]["function"]["arguments"].as_str().unwrap(), piece["function"]["arguments"].as_str().unwrap());
            calls[i]["function"]["arguments"] = Value::String(args);
        }
        if !c["finish_reason"].is_null() {
            reason = c["finish_reason"].clone();
        }
    }
    (content, calls, reason, fragments)
}

/// The calls of a non-streamed message, without their ids (as `streamed_calls` builds them).
fn message_calls(message: &Value) -> Vec<Value> {
    message["tool_calls"].as_array().unwrap().iter().map(|c| json!({"type": c["type"], "function": c["function"]})).collect()
}

#[tokio::test]
async fn streamed_calls_reassemble_into_the_non_streamed_message() {
    let s = tool_server();
    let (_, whole) = s.post("/v1/chat/completions", request(false)).await;
    let (content, calls, reason, _) = streamed_calls(&s, request(true)).await;
    let message = &whole["choices"][0]["message"];
    assert_eq!(content, message["content"].as_str().unwrap());
    assert_eq!(calls, message_calls(message));
    assert_eq!(reason, "tool_calls");
}

/// A long call's arguments stream in several fragments as the tokens come, not in one piece at
/// the end, and add up to the non-streamed arguments (valid JSON, whitespace outside strings
/// dropped).
#[tokio::test]
async fn a_long_calls_arguments_stream_in_fragments() {
    let s = tool_server();
    let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"note\": \"rain or shine, tell me the weather for the whole week ahead, hour by hour\", \"days\": [1, 2, 3]}}\n</tool_call>";
    let body = |stream: bool| json!({"messages": [{"role": "user", "content": call}], "tools": tools(), "max_tokens": 900, "stream": stream});
    let (_, whole) = s.post("/v1/chat/completions", body(false)).await;
    let message = &whole["choices"][0]["message"];
    let want = message_calls(message);
    let args: Value = serde_json::from_str(want[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris", "note": "rain or shine, tell me the weather for the whole week ahead, hour by hour", "days": [1, 2, 3]}));
    let (_, calls, reason, fragments) = streamed_calls(&s, body(true)).await;
    assert_eq!(calls, want);
    assert_eq!(reason, "tool_calls");
    assert!(fragments[0] > 5, "the arguments came in {} fragments", fragments[0]);
}

#[tokio::test]
async fn tool_choice_none_leaves_the_text_alone() {
    let s = tool_server();
    let mut body = request(false);
    body["tool_choice"] = json!("none");
    let (status, v) = s.post("/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert!(v["choices"][0]["message"].get("tool_calls").is_none());
    assert!(v["choices"][0]["message"]["content"].as_str().unwrap().contains(CALL));
}

#[tokio::test]
async fn required_and_named_choices_send_a_grammar() {
    let s = tool_server();
    for choice in [json!("required"), json!({"type": "function", "function": {"name": "get_weather"}})] {
        let mut body = request(false);
        body["tool_choice"] = choice.clone();
        body["max_tokens"] = json!(1);
        let (status, v) = s.post("/v1/chat/completions", body).await;
        assert_eq!(status, StatusCode::OK, "{v}");
        let (_, _, params) = s.submitted().pop().unwrap();
        let Some(Constraint::Lark(grammar)) = params.constraint.as_deref().cloned() else { panic!("{choice}: no Lark grammar") };
        assert!(grammar.contains("args_0: %json {"), "{grammar}");
        assert!(grammar.contains("\\\"name\\\": \\\"get_weather\\\""), "{grammar}");
    }
}

#[tokio::test]
async fn a_conversation_with_calls_and_results_renders() {
    let s = tool_server();
    let messages = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}
    ]);
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": messages, "tools": tools(), "max_tokens": 1})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let (_, prompt, _) = s.submitted().pop().unwrap();
    let text = s.tokenizer.decode(&prompt, false).unwrap();
    let tail = "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n\
                <|im_start|>user\n<tool_response>\n21 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n";
    assert!(text.ends_with(tail), "{text}");
}

#[tokio::test]
async fn bad_tools_and_tool_choices_are_400s_naming_the_field() {
    let s = tool_server();
    let user = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        (json!({"tools": [{"type": "code_interpreter"}]}), "tools[0].type"),
        (json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}), "tools[0].function.parameters"),
        (json!({"tools": [{"type": "function", "function": {"description": "no name"}}]}), "tools[0].function.name"),
        (json!({"tools": tools(), "tool_choice": {"type": "function", "function": {"name": "nope"}}}), "tool_choice"),
        (json!({"tools": tools(), "tool_choice": "always"}), "tool_choice"),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (json!({"tools": tools(), "tool_choice": "required", "response_format": {"type": "json_object"}}), "tool_choice"),
        // a schema only the grammar compiler finds wrong, when a call is forced
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "strng"}}}}}], "tool_choice": "required"}),
            "tools",
        ),
    ];
    for (extra, param) in cases {
        let mut body = json!({"messages": user});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (status, v) = s.post("/v1/chat/completions", body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
        assert_eq!(error_of(&v)["param"], param, "{v}");
    }
    let bad_args =
        json!([{"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]);
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": bad_args})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(error_of(&v)["param"], "messages[0].tool_calls[0].function.arguments");
}

/// The forced-call grammar, compiled by the engine's llguidance compiler over the test tokenizer
/// (byte tokens): a call of the named tool with valid arguments is accepted to the end, anything
/// else is refused somewhere along the way.
#[test]
fn the_forced_call_grammar_accepts_exactly_valid_calls() {
    use specula_engine::constraint::ConstraintCompiler;
    let tokenizer = tokenizer();
    let compiler = ConstraintCompiler::new(&std::sync::Arc::new(self::tokenizer())).unwrap();
    let set = |choice: Value| specula_server::tools::ToolSet::from_request(Some(&tools()), Some(&choice)).unwrap().unwrap();
    let accepts = |choice: Value, text: &str| {
        let mut grammar = compiler.compile(&set(choice).constraint().unwrap()).unwrap();
        let ids = tokenizer.encode(text).unwrap();
        grammar.consume(&ids).is_ok() && grammar.mask().unwrap().allows(260)
    };
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    assert!(accepts(named.clone(), CALL));
    assert!(accepts(json!("required"), &format!("{CALL}\n{CALL}")));
    assert!(!accepts(named.clone(), &format!("{CALL}\n{CALL}")), "a named function is called once");
    assert!(!accepts(named.clone(), "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>"), "city is required");
    assert!(!accepts(named.clone(), "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": 3}}\n</tool_call>"));
    assert!(!accepts(named.clone(), "<tool_call>\n{\"name\": \"other\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"));
    assert!(!accepts(named, "Sure! <tool_call>"));
}

#[tokio::test]
async fn each_streamed_choice_numbers_its_own_calls() {
    let s = tool_server();
    let mut body = request(true);
    body["n"] = json!(2);
    let resp = s.post_raw("/v1/chat/completions", body.to_string()).await;
    let data = sse_data(&text_of(resp).await);
    let mut first_call_index = [None, None];
    let mut reasons = [Value::Null, Value::Null];
    for d in &data[..data.len() - 1] {
        let chunk: Value = serde_json::from_str(d).unwrap();
        let c = &chunk["choices"][0];
        let choice = c["index"].as_u64().unwrap() as usize;
        if let Some(piece) = c["delta"]["tool_calls"].as_array().and_then(|p| p.first()) {
            first_call_index[choice].get_or_insert(piece["index"].as_u64().unwrap());
        }
        if !c["finish_reason"].is_null() {
            reasons[choice] = c["finish_reason"].clone();
        }
    }
    assert_eq!(first_call_index, [Some(0), Some(0)]);
    assert_eq!(reasons, [json!("tool_calls"), json!("tool_calls")]);
}
