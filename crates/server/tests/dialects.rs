//! The three dialects (chat completions, Anthropic Messages, OpenAI Responses) through the router
//! with the fake engine, which echoes the prompt back: one conversation spelled three ways must
//! reach the engine as the same prompt with the same parameters; each dialect's response and
//! stream events must have its documented shape and order; a `<tool_call>` block the engine
//! echoes comes back as each dialect's call; errors on `/v1/messages` are in Anthropic's shape.

mod common;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::*;
use serde_json::{json, Value};
use specula_server::ServerConfig;
use std::time::Duration;

fn big_server() -> TestServer {
    server_with(Setup { config: ServerConfig { max_model_len: 4096, ..ServerConfig::new(MODEL) }, tick: Duration::ZERO, ..Setup::default() })
}

const CALL: &str = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
const SCHEMA: &str = r#"{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}"#;

fn schema() -> Value {
    serde_json::from_str(SCHEMA).unwrap()
}

/// The same conversation (system, user, an assistant call, its result, a user follow-up) in the
/// three dialects.
fn three_spellings(stream: bool) -> [(&'static str, Value); 3] {
    let chat = json!({
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
            {"role": "user", "content": "Thanks. And tomorrow?"}
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": schema()}}],
        "max_tokens": 7, "temperature": 0, "stream": stream
    });
    let messages = json!({
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": [{"type": "text", "text": "18 C, sunny"}]},
                                         {"type": "text", "text": "Thanks. And tomorrow?"}]}
        ],
        "tools": [{"name": "get_weather", "description": "Weather in a city", "input_schema": schema()}],
        "max_tokens": 7, "temperature": 0, "stream": stream
    });
    let responses = json!({
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "18 C, sunny"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks. And tomorrow?"}]}
        ],
        "tools": [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": schema(), "strict": true}],
        "max_output_tokens": 7, "temperature": 0, "stream": stream
    });
    [("/v1/chat/completions", chat), ("/v1/messages", messages), ("/v1/responses", responses)]
}

/// The text each dialect returned (non-streaming).
fn text_of_response(path: &str, v: &Value) -> String {
    match path {
        "/v1/chat/completions" => v["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_string(),
        "/v1/messages" => v["content"].as_array().unwrap().iter().filter(|b| b["type"] == "text").map(|b| b["text"].as_str().unwrap()).collect(),
        _ => v["output"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|i| i["type"] == "message")
            .flat_map(|i| i["content"].as_array().unwrap().iter().map(|c| c["text"].as_str().unwrap().to_string()))
            .collect(),
    }
}

#[tokio::test]
async fn one_conversation_reaches_the_engine_identically_through_every_dialect() {
    let s = big_server();
    let mut texts = Vec::new();
    for (path, body) in three_spellings(false) {
        let (status, v) = s.post(path, body).await;
        assert_eq!(status, StatusCode::OK, "{path}: {v}");
        texts.push(text_of_response(path, &v));
    }
    let submitted = s.submitted();
    assert_eq!(submitted.len(), 3);
    let prompt = s.tokenizer.decode(&submitted[0].1, false).unwrap();
    assert!(prompt.contains("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"), "{prompt}");
    assert!(prompt.contains("<tool_response>\n18 C, sunny\n</tool_response>"), "{prompt}");
    for (path, (_, tokens, params)) in ["messages", "responses"].iter().zip(&submitted[1..]) {
        assert_eq!(tokens, &submitted[0].1, "{path}: same prompt tokens");
        assert_eq!(params, &submitted[0].2, "{path}: same sampling parameters");
    }
    assert_eq!(texts[0].len(), texts[1].len());
    assert!(!texts[0].is_empty());
    assert_eq!(texts[1], texts[0]);
    assert_eq!(texts[2], texts[0]);
}

/// `(event name, data)` of each SSE event.
fn named_events(body: &str) -> Vec<(String, Value)> {
    body.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let name = e.lines().find_map(|l| l.strip_prefix("event: ")).unwrap_or_default().to_string();
            let data = e.lines().find_map(|l| l.strip_prefix("data: ")).unwrap_or("null");
            (name, serde_json::from_str(data).unwrap_or(Value::Null))
        })
        .collect()
}

async fn post_stream(s: &TestServer, path: &str, body: Value) -> Vec<(String, Value)> {
    let resp = s.post_raw(path, body.to_string()).await;
    assert_eq!(resp.status(), StatusCode::OK);
    named_events(&text_of(resp).await)
}

#[tokio::test]
async fn streams_add_up_to_the_whole_responses() {
    let s = big_server();
    for (path, body) in three_spellings(true) {
        let resp = s.post_raw(path, body.to_string()).await;
        let text = text_of(resp).await;
        let streamed: String = match path {
            "/v1/chat/completions" => sse_data(&text)
                .iter()
                .filter(|d| *d != "[DONE]")
                .filter_map(|d| serde_json::from_str::<Value>(d).ok()?["choices"][0]["delta"]["content"].as_str().map(str::to_string))
                .collect(),
            "/v1/messages" => named_events(&text)
                .iter()
                .filter(|(n, d)| n == "content_block_delta" && d["delta"]["type"] == "text_delta")
                .map(|(_, d)| d["delta"]["text"].as_str().unwrap().to_string())
                .collect(),
            _ => named_events(&text).iter().filter(|(n, _)| n == "response.output_text.delta").map(|(_, d)| d["delta"].as_str().unwrap().to_string()).collect(),
        };
        let mut whole = three_spellings(false).into_iter().find(|(p, _)| *p == path).unwrap().1;
        whole["stream"] = json!(false);
        let (_, v) = s.post(path, whole).await;
        assert_eq!(streamed, text_of_response(path, &v), "{path}");
    }
}

fn anthropic_tools() -> Value {
    json!([{"name": "get_weather", "description": "Weather in a city", "input_schema": schema()}])
}

#[tokio::test]
async fn messages_return_tool_use_blocks_and_their_stop_reason() {
    let s = big_server();
    let body = json!({"model": MODEL, "max_tokens": 900, "messages": [{"role": "user", "content": CALL}], "tools": anthropic_tools()});
    let (status, v) = s.post("/v1/messages", body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!((v["type"].as_str(), v["role"].as_str()), (Some("message"), Some("assistant")));
    assert!(v["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(v["stop_reason"], "tool_use");
    let uses: Vec<&Value> = v["content"].as_array().unwrap().iter().filter(|b| b["type"] == "tool_use").collect();
    assert_eq!(uses.len(), 1, "{v}");
    assert_eq!((&uses[0]["name"], &uses[0]["input"]), (&json!("get_weather"), &json!({"city": "Paris"})));
    assert!(uses[0]["id"].as_str().unwrap().starts_with("toolu_"));
    let (_, prompt, _) = s.submitted().pop().unwrap();
    assert_eq!(v["usage"]["input_tokens"], prompt.len());

    // streamed: Anthropic's event order, and the tool input reassembles from input_json_delta
    let events = post_stream(&s, "/v1/messages", json!({"stream": true}).merge(&body)).await;
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(&names[..2], ["message_start", "ping"]);
    assert_eq!(&names[names.len() - 2..], ["message_delta", "message_stop"]);
    assert_eq!(events[0].1["message"]["usage"]["input_tokens"], prompt.len());
    let (_, delta) = &events[events.len() - 2];
    assert_eq!(delta["delta"]["stop_reason"], "tool_use");
    assert_eq!(delta["usage"]["output_tokens"], v["usage"]["output_tokens"]);
    let mut open: Option<(u64, String)> = None;
    let mut inputs = Vec::new();
    for (name, d) in &events[2..events.len() - 2] {
        match name.as_str() {
            "content_block_start" => {
                assert!(open.is_none(), "blocks do not overlap");
                if d["content_block"]["type"] == "tool_use" {
                    assert_eq!(d["content_block"]["input"], json!({}));
                }
                open = Some((d["index"].as_u64().unwrap(), String::new()));
            }
            "content_block_delta" => {
                let (index, json) = open.as_mut().expect("a delta inside a block");
                assert_eq!(d["index"].as_u64(), Some(*index));
                if d["delta"]["type"] == "input_json_delta" {
                    json.push_str(d["delta"]["partial_json"].as_str().unwrap());
                }
            }
            "content_block_stop" => {
                let (index, json) = open.take().expect("a stop closes a block");
                assert_eq!(d["index"].as_u64(), Some(index));
                if !json.is_empty() {
                    inputs.push(serde_json::from_str::<Value>(&json).unwrap());
                }
            }
            other => panic!("unexpected event {other}"),
        }
    }
    assert_eq!(inputs, [json!({"city": "Paris"})]);
}

/// `json!({...}.merge(&other))`-style helper: `other`'s fields, overridden by `self`'s.
trait Merge {
    fn merge(self, other: &Value) -> Value;
}

impl Merge for Value {
    fn merge(self, other: &Value) -> Value {
        let mut out = other.clone();
        if let (Value::Object(o), Value::Object(s)) = (&mut out, self) {
            o.extend(s);
        }
        out
    }
}

#[tokio::test]
async fn messages_report_max_tokens_and_stop_sequences() {
    let s = big_server();
    let (_, v) = s.post("/v1/messages", json!({"max_tokens": 3, "messages": [{"role": "user", "content": "hello"}]})).await;
    assert_eq!((v["stop_reason"].as_str(), v["usage"]["output_tokens"].as_u64()), (Some("max_tokens"), Some(3)));
    assert_eq!(v["stop_sequence"], Value::Null);
}

#[tokio::test]
async fn count_tokens_is_the_prompt_the_engine_gets() {
    let s = big_server();
    let body = json!({"system": "Be brief.", "messages": [{"role": "user", "content": "hello there"}], "tools": anthropic_tools()});
    let (status, counted) = s.post("/v1/messages/count_tokens", body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{counted}");
    let (status, _) = s.post("/v1/messages", json!({"max_tokens": 1}).merge(&body)).await;
    assert_eq!(status, StatusCode::OK);
    let (_, prompt, _) = s.submitted().pop().unwrap();
    assert_eq!(counted, json!({"input_tokens": prompt.len()}));
}

#[tokio::test]
async fn messages_errors_have_anthropics_shape_and_status() {
    let s = server_with(Setup { config: ServerConfig { api_keys: vec!["sk-test".into()], ..Setup::default().config }, ..Setup::default() });
    let post = |key: Option<(&'static str, &'static str)>, body: Value| {
        let mut req = Request::post("/v1/messages").header("content-type", "application/json").header("anthropic-version", "2023-06-01");
        if let Some((k, v)) = key {
            req = req.header(k, v);
        }
        req.body(Body::from(body.to_string())).unwrap()
    };
    let ok = json!({"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
    let cases = [
        (None, ok.clone(), StatusCode::UNAUTHORIZED, "authentication_error"),
        (Some(("x-api-key", "sk-wrong")), ok.clone(), StatusCode::UNAUTHORIZED, "authentication_error"),
        (Some(("x-api-key", "sk-test")), json!({"messages": [{"role": "user", "content": "hi"}]}), StatusCode::BAD_REQUEST, "invalid_request_error"),
        (Some(("authorization", "bearer sk-test")), json!({"max_tokens": "many"}).merge(&ok), StatusCode::BAD_REQUEST, "invalid_request_error"),
    ];
    for (key, body, status, kind) in cases {
        let (got, v) = json_of(s.send(post(key, body.clone())).await).await;
        assert_eq!((got, v["type"].as_str(), v["error"]["type"].as_str()), (status, Some("error"), Some(kind)), "{body}: {v}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()));
    }
    let (got, v) = json_of(s.send(post(Some(("x-api-key", "sk-test")), ok.clone())).await).await;
    assert_eq!(got, StatusCode::OK, "{v}");
    // an agent's own model name is served by the loaded model (Claude Code sends claude-* names)
    let (got, v) = json_of(s.send(post(Some(("x-api-key", "sk-test")), json!({"model": "claude-sonnet-4-5"}).merge(&ok))).await).await;
    assert_eq!((got, v["model"].as_str()), (StatusCode::OK, Some(MODEL)), "{v}");
    let (got, v) = json_of(s.send(post(Some(("x-api-key", "sk-test")), json!({"model": "other"}).merge(&ok))).await).await;
    assert_eq!(got, StatusCode::OK, "{v}");
    assert_eq!(error_type_of_openai(&s).await, "invalid_request_error", "OpenAI routes keep OpenAI's shape");
}

async fn error_type_of_openai(s: &TestServer) -> String {
    let req = Request::post("/v1/chat/completions").header("x-api-key", "sk-wrong").body(Body::from("{}")).unwrap();
    let (status, v) = json_of(s.send(req).await).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    error_of(&v)["type"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn responses_return_function_calls_and_stream_the_documented_events() {
    let s = big_server();
    let tools = json!([{"type": "function", "name": "get_weather", "parameters": schema(), "strict": true}]);
    let body = json!({"input": CALL, "tools": tools, "max_output_tokens": 900});
    let (status, v) = s.post("/v1/responses", body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    // the fake engine always runs to max_output_tokens
    assert_eq!((v["object"].as_str(), v["status"].as_str()), (Some("response"), Some("incomplete")));
    let calls: Vec<&Value> = v["output"].as_array().unwrap().iter().filter(|i| i["type"] == "function_call").collect();
    assert_eq!(calls.len(), 1, "{v}");
    assert_eq!((&calls[0]["name"], &calls[0]["arguments"]), (&json!("get_weather"), &json!("{\"city\":\"Paris\"}")));
    assert!(calls[0]["call_id"].as_str().unwrap().starts_with("call_"));
    let usage = &v["usage"];
    assert_eq!(usage["total_tokens"].as_u64(), Some(usage["input_tokens"].as_u64().unwrap() + usage["output_tokens"].as_u64().unwrap()));

    let events = post_stream(&s, "/v1/responses", json!({"stream": true}).merge(&body)).await;
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(&names[..2], ["response.created", "response.in_progress"]);
    assert_eq!(names.last(), Some(&"response.incomplete"));
    for (i, (name, d)) in events.iter().enumerate() {
        assert_eq!((d["type"].as_str(), d["sequence_number"].as_u64()), (Some(name.as_str()), Some(i as u64)));
    }
    let (mut arguments, mut done) = (String::new(), None);
    for (name, d) in &events {
        match name.as_str() {
            "response.function_call_arguments.delta" => arguments.push_str(d["delta"].as_str().unwrap()),
            "response.function_call_arguments.done" => done = d["arguments"].as_str().map(str::to_string),
            _ => {}
        }
    }
    assert_eq!((arguments.as_str(), done.as_deref()), ("{\"city\":\"Paris\"}", Some("{\"city\":\"Paris\"}")));
    // every item opens before and closes after its deltas, with the message's content part in between
    let order = |n: &str| names.iter().position(|x| *x == n).unwrap_or_else(|| panic!("no {n}: {names:?}"));
    assert!(order("response.output_item.added") < order("response.content_part.added"));
    assert!(order("response.output_text.delta") < order("response.output_text.done"));
    assert!(order("response.content_part.done") < order("response.output_item.done"));
    let completed = &events.last().unwrap().1["response"];
    assert_eq!(completed["output"].as_array().unwrap().len(), v["output"].as_array().unwrap().len());
}

#[tokio::test]
async fn stored_responses_continue_and_can_be_fetched() {
    let s = big_server();
    let (status, first) = s.post("/v1/responses", json!({"input": "first question", "instructions": "Be brief.", "max_output_tokens": 5})).await;
    assert_eq!(status, StatusCode::OK, "{first}");
    let id = first["id"].as_str().unwrap();
    let (status, fetched) = json_of(s.get(&format!("/v1/responses/{id}")).await).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(fetched, first);
    let (status, v) = s.post("/v1/responses", json!({"input": "second question", "previous_response_id": id, "max_output_tokens": 2})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let prompt = s.tokenizer.decode(&s.submitted().pop().unwrap().1, false).unwrap();
    let answer = text_of_response("/v1/responses", &first);
    assert!(
        prompt
            .starts_with(&format!("<|im_start|>user\nfirst question<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n<|im_start|>user\nsecond question")),
        "the stored turn, without the old instructions, then the new input: {prompt:?}"
    );
    let (status, v) = json_of(s.get("/v1/responses/resp_missing").await).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    error_of(&v);
    let (status, v) = s.post("/v1/responses", json!({"input": "x", "previous_response_id": "resp_missing"})).await;
    assert_eq!((status, error_of(&v)["param"].as_str()), (StatusCode::BAD_REQUEST, Some("previous_response_id")));
    let (_, unstored) = s.post("/v1/responses", json!({"input": "x", "store": false, "max_output_tokens": 1})).await;
    let (status, _) = json_of(s.get(&format!("/v1/responses/{}", unstored["id"].as_str().unwrap())).await).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "store: false keeps nothing");
}

#[tokio::test]
async fn responses_text_format_becomes_the_constraint_and_limits_say_incomplete() {
    let s = big_server();
    let format = json!({"format": {"type": "json_schema", "name": "city", "schema": schema(), "strict": true}});
    let (status, v) = s.post("/v1/responses", json!({"input": "x", "text": format, "max_output_tokens": 2})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let (_, _, params) = s.submitted().pop().unwrap();
    assert!(
        matches!(params.constraint, Some(ref c) if matches!(**c, specula_engine::api::Constraint::JsonSchema(ref s) if s.contains("\"city\""))),
        "{:?}",
        params.constraint
    );
    assert_eq!((v["status"].as_str(), v["incomplete_details"]["reason"].as_str()), (Some("incomplete"), Some("max_output_tokens")));
    let (status, v) = s.post("/v1/responses", json!({"input": "x", "tools": [{"type": "web_search"}]})).await;
    assert_eq!((status, error_of(&v)["param"].as_str()), (StatusCode::BAD_REQUEST, Some("tools[0].type")));
}

/// A server whose template writes only the messages' text (and mentions the think tags, as a
/// thinking template does), so the fake engine echoes a user message back as the model's output.
fn thinking_server() -> TestServer {
    let tokenizer = std::sync::Arc::new(tokenizer());
    let source = "{# a thinking template: <think> ... </think> #}{% for m in messages %}{{ m.content }}{% endfor %}";
    let template = std::sync::Arc::new(specula_model::ChatTemplate::new(source, "", "<|im_end|>").unwrap());
    let (engine, log) = fake_engine(64, tokenizer.clone(), Duration::ZERO);
    let config = ServerConfig { max_model_len: 4096, ..ServerConfig::new(MODEL) };
    let state = specula_server::AppState::new(engine.clone(), tokenizer.clone(), Some(template.clone()), config);
    TestServer { router: specula_server::router(state), engine, log, tokenizer, template }
}

const THOUGHT: &str = "<think>\nThe user wants a greeting.\n</think>\n\nHello there!";

#[tokio::test]
async fn reasoning_is_split_from_the_answer_in_every_dialect() {
    let s = thinking_server();
    let n = s.tokenizer.encode(THOUGHT).unwrap().len();
    let user = json!([{"role": "user", "content": THOUGHT}]);
    let (_, chat) = s.post("/v1/chat/completions", json!({"messages": user, "max_tokens": n})).await;
    let message = &chat["choices"][0]["message"];
    assert_eq!((message["reasoning_content"].as_str(), message["content"].as_str()), (Some("The user wants a greeting.\n"), Some("Hello there!")), "{chat}");
    // the tokens from <think> through </think>
    let reasoning_tokens = s.tokenizer.encode(&THOUGHT[..THOUGHT.find("</think>").unwrap() + "</think>".len()]).unwrap().len();
    assert_eq!(chat["usage"]["completion_tokens_details"], json!({"reasoning_tokens": reasoning_tokens}), "{chat}");

    let (_, msg) = s.post("/v1/messages", json!({"messages": user, "max_tokens": n})).await;
    let blocks: Vec<(&str, &str)> =
        msg["content"].as_array().unwrap().iter().map(|b| (b["type"].as_str().unwrap(), b["thinking"].as_str().or(b["text"].as_str()).unwrap())).collect();
    assert_eq!(blocks, [("thinking", "The user wants a greeting.\n"), ("text", "Hello there!")], "{msg}");

    let (_, resp) = s.post("/v1/responses", json!({"input": THOUGHT, "max_output_tokens": n})).await;
    let items: Vec<&str> = resp["output"].as_array().unwrap().iter().map(|i| i["type"].as_str().unwrap()).collect();
    assert_eq!(items, ["reasoning", "message"], "{resp}");
    assert_eq!(resp["output"][0]["content"][0]["text"], "The user wants a greeting.\n");
    assert_eq!(resp["output"][1]["content"][0]["text"], "Hello there!");
    assert_eq!(resp["usage"]["output_tokens_details"]["reasoning_tokens"], reasoning_tokens, "{resp}");

    // streamed chat: reasoning_content deltas, then content deltas, adding up to the same
    let body = json!({"messages": user, "max_tokens": n, "stream": true, "stream_options": {"include_usage": true}});
    let body = s.post_raw("/v1/chat/completions", body.to_string()).await;
    let (mut reasoning, mut content, mut usage) = (String::new(), String::new(), Value::Null);
    for d in sse_data(&text_of(body).await).iter().filter(|d| *d != "[DONE]") {
        let chunk = serde_json::from_str::<Value>(d).unwrap();
        let delta = &chunk["choices"][0]["delta"];
        reasoning.push_str(delta["reasoning_content"].as_str().unwrap_or_default());
        content.push_str(delta["content"].as_str().unwrap_or_default());
        usage = chunk["usage"].clone();
    }
    assert_eq!((reasoning.as_str(), content.as_str()), ("The user wants a greeting.\n", "Hello there!"));
    assert_eq!(usage["completion_tokens_details"], json!({"reasoning_tokens": reasoning_tokens}), "streamed usage");

    // the stream of a response counts them too
    let events = post_stream(&s, "/v1/responses", json!({"input": THOUGHT, "max_output_tokens": n, "stream": true})).await;
    let done = &events.iter().find(|(e, _)| e == "response.completed" || e == "response.incomplete").unwrap().1;
    assert_eq!(done["response"]["usage"]["output_tokens_details"]["reasoning_tokens"], reasoning_tokens, "{done}");

    // streamed messages: a thinking block with thinking_delta, then a text block
    let events = post_stream(&s, "/v1/messages", json!({"messages": user, "max_tokens": n, "stream": true})).await;
    let starts: Vec<&str> = events.iter().filter(|(e, _)| e == "content_block_start").map(|(_, d)| d["content_block"]["type"].as_str().unwrap()).collect();
    assert_eq!(starts, ["thinking", "text"]);
    let thinking: String = events.iter().filter_map(|(_, d)| d["delta"]["thinking"].as_str()).collect();
    assert_eq!(thinking, "The user wants a greeting.\n");
}

#[tokio::test]
async fn chat_template_kwargs_reach_the_template() {
    let tokenizer = std::sync::Arc::new(tokenizer());
    let template = std::sync::Arc::new(specula_model::ChatTemplate::new("{% if flag %}on{% else %}off{% endif %}", "", "").unwrap());
    let (engine, log) = fake_engine(64, tokenizer.clone(), Duration::ZERO);
    let state = specula_server::AppState::new(
        engine.clone(),
        tokenizer.clone(),
        Some(template.clone()),
        ServerConfig { max_model_len: 64, ..ServerConfig::new(MODEL) },
    );
    let s = TestServer { router: specula_server::router(state), engine, log, tokenizer, template };
    let user = json!([{"role": "user", "content": "x"}]);
    for (kwargs, want) in [(json!({"flag": true}), "on"), (json!({}), "off")] {
        let (status, v) = s.post("/v1/chat/completions", json!({"messages": user, "max_tokens": 1, "chat_template_kwargs": kwargs})).await;
        assert_eq!(status, StatusCode::OK, "{v}");
        assert_eq!(s.tokenizer.decode(&s.submitted().pop().unwrap().1, false).unwrap(), want);
    }
}

/// A thinking budget reaches the engine as a reasoning budget from every dialect's field (the
/// opening forced where the template lets the model open the block), with the grammar that
/// enforces it; a constraint on a thinking template gets an unbounded one (so it holds the
/// answer, after the reasoning); a model that does not think ignores the budget; bad budgets
/// are 400s in each dialect's shape.
#[tokio::test]
async fn thinking_budgets_reach_the_engine_from_every_dialect() {
    let s = thinking_server();
    let user = json!([{"role": "user", "content": "hi"}]);
    let want = |tokens: usize| Some(specula_engine::ReasoningBudget { tokens, open: Some(THINK_OPEN), close: THINK_CLOSE });
    for (path, body, tokens) in [
        ("/v1/messages", json!({"messages": user, "max_tokens": 8, "thinking": {"type": "enabled", "budget_tokens": 5}}), 5),
        ("/v1/chat/completions", json!({"messages": user, "max_tokens": 8, "thinking_token_budget": 3}), 3),
        ("/v1/responses", json!({"input": "hi", "max_output_tokens": 8, "thinking_token_budget": 0}), 0),
    ] {
        let (status, v) = s.post(path, body).await;
        assert_eq!(status, StatusCode::OK, "{path}: {v}");
        assert_eq!(s.submitted().pop().unwrap().2.reasoning_budget, want(tokens), "{path}");
        assert_eq!(s.log.lock().unwrap().grammars.last(), Some(&true), "{path}: the budget's grammar goes with it");
    }
    // no budget asked: none, no grammar
    let (status, _) = s.post("/v1/chat/completions", json!({"messages": user, "max_tokens": 8})).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(s.submitted().pop().unwrap().2.reasoning_budget, None);
    assert_eq!(s.log.lock().unwrap().grammars.last(), Some(&false));
    // a constraint on a thinking template: an unbounded budget before it
    let format = json!({"type": "json_object"});
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": user, "max_tokens": 8, "response_format": format})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(s.submitted().pop().unwrap().2.reasoning_budget, want(usize::MAX));
    // a prompt that opened the block: nothing to force at the start
    let opened = json!([{"role": "user", "content": "<think>"}]);
    let (status, _) = s.post("/v1/chat/completions", json!({"messages": opened, "max_tokens": 8, "thinking_token_budget": 2})).await;
    assert_eq!(status, StatusCode::OK);
    let budget = s.submitted().pop().unwrap().2.reasoning_budget;
    assert_eq!(budget, Some(specula_engine::ReasoningBudget { tokens: 2, open: None, close: THINK_CLOSE }));

    // bad budgets, in each dialect's error shape
    for (path, body, param) in [
        ("/v1/messages", json!({"messages": user, "max_tokens": 8, "thinking": {"type": "enabled", "budget_tokens": 8}}), "thinking.budget_tokens"),
        ("/v1/messages", json!({"messages": user, "max_tokens": 8, "thinking": {"type": "enabled"}}), "thinking.budget_tokens"),
        ("/v1/messages", json!({"messages": user, "max_tokens": 8, "thinking": {"type": "enabled", "budget_tokens": -1}}), "thinking.budget_tokens"),
        ("/v1/chat/completions", json!({"messages": user, "max_tokens": 8, "thinking_token_budget": -2}), "thinking_token_budget"),
    ] {
        let (status, v) = s.post(path, body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path}: {v}");
        if path == "/v1/messages" {
            assert_eq!((v["type"].as_str(), v["error"]["type"].as_str()), (Some("error"), Some("invalid_request_error")), "{v}");
            assert!(v["error"]["message"].as_str().unwrap().contains("budget_tokens"), "{v}");
        } else {
            assert_eq!(error_of(&v)["param"].as_str(), Some(param), "{v}");
        }
    }

    // a template that does not think: the budget has nothing to bound
    let plain = big_server();
    let (status, _) = plain.post("/v1/messages", json!({"messages": user, "max_tokens": 8, "thinking": {"type": "enabled", "budget_tokens": 5}})).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(plain.submitted().pop().unwrap().2.reasoning_budget, None);
}

/// A server whose template speaks harmony (its source mentions the channel tags, as gpt-oss's
/// does) and writes only the messages' text, so the fake engine echoes a user message back as
/// the model's output.
fn harmony_server() -> TestServer {
    let tokenizer = std::sync::Arc::new(tokenizer());
    let source = "{# harmony: <|channel|> ... <|message|>, and the tools (not written here) #}{% for m in messages %}{{ m.content }}{% endfor %}";
    let template = std::sync::Arc::new(specula_model::ChatTemplate::new(source, "", "").unwrap());
    let (engine, log) = fake_engine(64, tokenizer.clone(), Duration::ZERO);
    let config = ServerConfig { max_model_len: 4096, ..ServerConfig::new(MODEL) };
    let state = specula_server::AppState::new(engine.clone(), tokenizer.clone(), Some(template.clone()), config);
    TestServer { router: specula_server::router(state), engine, log, tokenizer, template }
}

const HARMONY_CALL: &str = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}";
const HARMONY_ANSWER: &str = "<|channel|>analysis<|message|>A greeting.<|end|><|start|>assistant<|channel|>final<|message|>Hello there!";

/// gpt-oss's harmony output through every dialect: the analysis channel is the reasoning, the
/// final channel the answer, a commentary message to `functions.NAME` a tool call.
#[tokio::test]
async fn harmony_channels_become_reasoning_answer_and_calls_in_every_dialect() {
    let s = harmony_server();
    let n = |t: &str| s.tokenizer.encode(t).unwrap().len();
    let user = |t: &str| json!([{"role": "user", "content": t}]);
    let (_, chat) = s.post("/v1/chat/completions", json!({"messages": user(HARMONY_ANSWER), "max_tokens": n(HARMONY_ANSWER)})).await;
    let m = &chat["choices"][0]["message"];
    assert_eq!((m["reasoning_content"].as_str(), m["content"].as_str()), (Some("A greeting."), Some("Hello there!")), "{chat}");

    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": schema()}}]);
    let (_, chat) = s.post("/v1/chat/completions", json!({"messages": user(HARMONY_CALL), "max_tokens": n(HARMONY_CALL), "tools": tools})).await;
    let choice = &chat["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{chat}");
    assert_eq!(choice["message"]["reasoning_content"], "Need the weather.");
    let call = &choice["message"]["tool_calls"][0]["function"];
    assert_eq!((call["name"].as_str(), call["arguments"].as_str()), (Some("get_weather"), Some("{\"city\":\"Paris\"}")));

    let (_, msg) = s.post("/v1/messages", json!({"messages": user(HARMONY_CALL), "max_tokens": n(HARMONY_CALL), "tools": anthropic_tools()})).await;
    let kinds: Vec<&str> = msg["content"].as_array().unwrap().iter().map(|b| b["type"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["thinking", "tool_use"], "{msg}");
    assert_eq!((msg["stop_reason"].as_str(), &msg["content"][1]["input"]), (Some("tool_use"), &json!({"city": "Paris"})));

    let rtools = json!([{"type": "function", "name": "get_weather", "parameters": schema()}]);
    let (_, resp) = s.post("/v1/responses", json!({"input": HARMONY_CALL, "max_output_tokens": n(HARMONY_CALL), "tools": rtools})).await;
    let items: Vec<&str> = resp["output"].as_array().unwrap().iter().map(|i| i["type"].as_str().unwrap()).collect();
    assert_eq!(items, ["reasoning", "function_call"], "{resp}");
    assert_eq!(resp["output"][1]["arguments"], "{\"city\":\"Paris\"}");

    // streamed chat: the reasoning and the answer add up, no tag leaks
    let body = s.post_raw("/v1/chat/completions", json!({"messages": user(HARMONY_ANSWER), "max_tokens": n(HARMONY_ANSWER), "stream": true}).to_string()).await;
    let (mut reasoning, mut content) = (String::new(), String::new());
    for d in sse_data(&text_of(body).await).iter().filter(|d| *d != "[DONE]") {
        let delta = &serde_json::from_str::<Value>(d).unwrap()["choices"][0]["delta"];
        reasoning.push_str(delta["reasoning_content"].as_str().unwrap_or_default());
        content.push_str(delta["content"].as_str().unwrap_or_default());
    }
    assert_eq!((reasoning.as_str(), content.as_str()), ("A greeting.", "Hello there!"));
}

/// Several `--api-key`s: each key is a tenant. Every dialect hands the engine the key's tenant
/// (the cross-request speculation index is kept per tenant), and a stored response is neither
/// fetched nor continued with another key.
#[tokio::test]
async fn each_api_key_is_a_tenant_in_every_dialect_and_in_the_response_store() {
    use specula_engine::types::Tenant;
    let s = server_with(Setup { config: ServerConfig { api_keys: vec!["sk-a".into(), "sk-b".into()], ..Setup::default().config }, ..Setup::default() });
    let call = |path: &'static str, key: &'static str, body: Value| {
        Request::post(path)
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer {key}"))
            .body(Body::from(body.to_string()))
            .unwrap()
    };
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
    let requests = [
        ("/v1/completions", json!({"prompt": "hi", "max_tokens": 1})),
        ("/v1/chat/completions", chat.clone()),
        ("/v1/messages", chat.clone()),
        ("/v1/responses", json!({"input": "hi", "max_output_tokens": 1})),
    ];
    for (key, tenant) in [("sk-a", Tenant(1)), ("sk-b", Tenant(2))] {
        for (path, body) in &requests {
            let (status, v) = json_of(s.send(call(path, key, body.clone())).await).await;
            assert_eq!(status, StatusCode::OK, "{path}: {v}");
            assert_eq!(s.submitted().pop().unwrap().2.tenant, tenant, "{path} with {key}");
        }
    }
    // a response stored with one key: fetched and continued with it, with the other not found
    let (_, stored) = json_of(s.send(call("/v1/responses", "sk-a", json!({"input": "hi", "max_output_tokens": 1}))).await).await;
    let id = stored["id"].as_str().unwrap();
    let get = |key: &'static str| Request::get(format!("/v1/responses/{id}")).header("authorization", format!("Bearer {key}")).body(Body::empty()).unwrap();
    assert_eq!(s.send(get("sk-a")).await.status(), StatusCode::OK);
    let (status, v) = json_of(s.send(get("sk-b")).await).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{v}");
    let follow_up = json!({"input": "more", "previous_response_id": id, "max_output_tokens": 1});
    assert_eq!(s.send(call("/v1/responses", "sk-a", follow_up.clone())).await.status(), StatusCode::OK);
    let (status, v) = json_of(s.send(call("/v1/responses", "sk-b", follow_up)).await).await;
    assert_eq!((status, error_of(&v)["param"].as_str()), (StatusCode::BAD_REQUEST, Some("previous_response_id")), "{v}");
}
