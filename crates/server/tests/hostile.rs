//! Valid but hostile requests (issue 38): each is refused fast, before the work it asks for,
//! and leaves the engine's queue as it found it; CPU-heavy preparation never holds the async
//! workers; a request's grammar is compiled once, within a budget, and reaches every choice.

mod common;

use axum::http::StatusCode;
use common::*;
use serde_json::{json, Value};
use specula_engine::handle::{EngineCommand, EngineHandle};
use specula_server::{router, AppState, ServerConfig};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A body asking for more engine requests (prompts x n) than the waiting queue can ever hold,
/// with a large logit_bias: a 400 naming the cause within milliseconds, nothing submitted, the
/// queue's counter untouched (today's code tokenized every prompt, queued 64 choices, then
/// aborted them).
#[tokio::test]
async fn more_choices_than_the_queue_holds_is_refused_at_once_and_queues_nothing() {
    let s = server();
    let bias: serde_json::Map<String, Value> = (0..1000).map(|t| (t.to_string(), json!(1.0))).collect();
    let prompts: Vec<String> = (0..200).map(|i| format!("hello {i}")).collect();
    let started = Instant::now();
    let (status, v) = s.post("/v1/completions", json!({"prompt": prompts, "n": 16, "logit_bias": bias, "max_tokens": 4})).await;
    let took = started.elapsed();
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(error_of(&v)["param"], "prompt", "{v}");
    assert!(took < Duration::from_millis(100), "refused after {took:?}");
    assert!(s.submitted().is_empty(), "nothing reaches the engine");
    assert_eq!(s.engine.waiting(), 0);
}

/// Counts past their bounds are 400s naming the field, before anything is parsed per entry.
#[tokio::test]
async fn counts_past_their_bounds_are_refused_naming_the_field() {
    let s = server();
    let config = ServerConfig::new(MODEL);
    let bias: serde_json::Map<String, Value> = (0..config.max_logit_bias + 1).map(|t| (t.to_string(), json!(1.0))).collect();
    let cases = [
        ("/v1/completions", json!({"prompt": "hi", "logit_bias": bias}), "logit_bias"),
        ("/v1/completions", json!({"prompt": "hi", "stop_token_ids": vec![1; config.max_stop_token_ids + 1]}), "stop_token_ids"),
        ("/v1/completions", json!({"prompt": vec!["hi"; config.max_prompts_per_request + 1]}), "prompt"),
        ("/v1/chat/completions", json!({"messages": vec![json!({"role": "user", "content": "hi"}); config.max_messages + 1]}), "messages"),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}],
                   "tools": (0..config.max_tools + 1).map(|i| json!({"type": "function", "function": {"name": format!("f{i}")}})).collect::<Vec<_>>()}),
            "tools",
        ),
    ];
    for (path, body, param) in cases {
        let (status, v) = s.post(path, body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{param}: {v}");
        let e = error_of(&v);
        assert_eq!(e["param"], param, "{v}");
        assert!(e["message"].as_str().unwrap().contains("at most"), "{v}");
    }
    assert!(s.submitted().is_empty());
}

/// A prompt whose bytes alone need more tokens than --max-model-len allows (each token spells
/// at most 12 bytes here) is refused without being tokenized: fast, whatever its length.
#[tokio::test]
async fn a_prompt_too_long_in_bytes_alone_is_refused_before_tokenizing() {
    let s = server_with(Setup { config: ServerConfig { max_model_len: 64, max_body_bytes: 8 << 20, ..ServerConfig::new(MODEL) }, ..Setup::default() });
    let prompt = "hell".repeat(1 << 20);
    let started = Instant::now();
    let (status, v) = s.post("/v1/completions", json!({"prompt": prompt})).await;
    let took = started.elapsed();
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    let e = error_of(&v);
    assert_eq!(e["param"], "prompt");
    assert!(e["message"].as_str().unwrap().contains("bytes"), "{v}");
    assert!(took < Duration::from_millis(300), "refused after {took:?}");
    let messages = json!([{"role": "user", "content": "hell".repeat(1 << 20)}]);
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": messages})).await;
    assert_eq!((status, &error_of(&v)["param"]), (StatusCode::BAD_REQUEST, &json!("messages")), "{v}");
}

/// An engine whose waiting queue holds 64 and is never drained: what is queued stays counted.
fn stalled_server() -> (axum::Router, EngineHandle, std::sync::mpsc::Receiver<EngineCommand>) {
    let tokenizer = Arc::new(tokenizer());
    let (engine, rx, _) = EngineHandle::channel(64);
    let config = ServerConfig { max_model_len: 64, ..ServerConfig::new(MODEL) };
    let state = AppState::new(engine.clone(), tokenizer, None, config);
    (router(state), engine, rx)
}

async fn post(router: &axum::Router, body: Value) -> (StatusCode, Value) {
    use tower::ServiceExt;
    let req = axum::http::Request::post("/v1/completions").header("content-type", "application/json").body(axum::body::Body::from(body.to_string())).unwrap();
    json_of(router.clone().oneshot(req).await.unwrap()).await
}

/// A request that fits the queue but not the room left in it: a 503 `overloaded` at once, and
/// the queue exactly as it was (today's code queued the first 24 choices, then sent aborts).
#[tokio::test]
async fn a_request_larger_than_the_room_left_is_a_503_that_leaves_the_queue_as_it_was() {
    let (router, engine, rx) = stalled_server();
    // 40 choices queued (streamed, so the handler returns while they wait; the response is
    // kept, so its choices stay queued)
    let queued = {
        use tower::ServiceExt;
        let body = json!({"prompt": vec!["hi"; 10], "n": 4, "stream": true, "max_tokens": 2});
        let req =
            axum::http::Request::post("/v1/completions").header("content-type", "application/json").body(axum::body::Body::from(body.to_string())).unwrap();
        router.clone().oneshot(req).await.unwrap()
    };
    let status = queued.status();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(engine.waiting(), 40);
    assert_eq!(rx.try_iter().count(), 40);
    let started = Instant::now();
    let (status, v) = post(&router, json!({"prompt": vec!["hi"; 5], "n": 6, "max_tokens": 2})).await;
    assert!(started.elapsed() < Duration::from_millis(100), "refused after {:?}", started.elapsed());
    assert_eq!((status, &error_of(&v)["code"]), (StatusCode::SERVICE_UNAVAILABLE, &json!("overloaded")), "{v}");
    assert_eq!(engine.waiting(), 40, "the queue's counter is as it was");
    assert_eq!(rx.try_iter().count(), 0, "not one submission nor abort reached the engine");
    drop(queued);
}

/// Tokenizing a large no-space prompt runs on the prep pool: on a runtime with one async worker,
/// /health answers while it is under way (today's code tokenized on that worker, so /health
/// waited for the whole tokenization).
#[tokio::test(flavor = "current_thread")]
async fn health_answers_while_a_large_prompt_is_tokenized() {
    let s = Arc::new(server_with(Setup {
        config: ServerConfig { max_model_len: 1 << 30, max_body_bytes: 8 << 20, ..ServerConfig::new(MODEL) },
        ..Setup::default()
    }));
    let body = json!({"prompt": "hellx".repeat(400_000)}).to_string();
    let started = Instant::now();
    let heavy = {
        let s = s.clone();
        tokio::spawn(async move {
            let resp = s.post_raw("/tokenize", body).await;
            (resp.status(), started.elapsed())
        })
    };
    tokio::task::yield_now().await;
    let health = s.get("/health").await;
    let health_at = started.elapsed();
    assert_eq!(health.status(), StatusCode::OK);
    let (status, tokenized_at) = heavy.await.unwrap();
    assert_eq!(status, StatusCode::OK);
    assert!(tokenized_at > Duration::from_millis(100), "the tokenization must take a while for this test to mean anything: {tokenized_at:?}");
    assert!(health_at * 4 < tokenized_at, "/health answered after {health_at:?}, the tokenization ended after {tokenized_at:?}");
}

/// 150 properties, each any of a 200-value enum or an integer (issue 38's heavy schema).
fn heavy_schema() -> Value {
    let properties: serde_json::Map<String, Value> = (0..150)
        .map(|p| {
            let values: Vec<String> = (0..200).map(|v| format!("v{v}")).collect();
            (format!("p{p}"), json!({"anyOf": [{"type": "string", "enum": values}, {"type": "integer"}]}))
        })
        .collect();
    json!({"type": "object", "properties": properties})
}

/// The heavy schema is over the grammar budget: a 400 naming `response_format`, fast, nothing
/// submitted (today's code compiled it on the HTTP worker, then again per choice on the engine
/// thread).
#[tokio::test]
async fn a_schema_over_the_grammar_budget_is_a_400_naming_its_field() {
    let s = server();
    let format = json!({"type": "json_schema", "json_schema": {"name": "heavy", "schema": heavy_schema()}});
    let started = Instant::now();
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "n": 8, "response_format": format})).await;
    let took = started.elapsed();
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(error_of(&v)["param"], "response_format", "{v}");
    assert!(took < Duration::from_secs(2), "refused after {took:?}");
    assert!(s.submitted().is_empty());
}

/// A valid schema is compiled once and every choice's engine request carries the grammar (the
/// engine never compiles), with the settings shared rather than copied per choice.
#[tokio::test]
async fn every_choice_carries_the_one_compiled_grammar_and_shares_the_settings() {
    let s = server();
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    let format = json!({"type": "json_schema", "json_schema": {"name": "s", "schema": schema}});
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 2, "response_format": format, "logit_bias": {"5": 1}});
    let (status, v) = s.post("/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let log = s.log.lock().unwrap();
    assert_eq!(log.grammars, vec![true; 3]);
    let params: Vec<_> = log.submitted.iter().map(|(_, _, p)| p).collect();
    assert!(params.iter().all(|p| Arc::ptr_eq(p.constraint.as_ref().unwrap(), params[0].constraint.as_ref().unwrap())));
    assert!(params.iter().all(|p| Arc::ptr_eq(&p.logit_bias, &params[0].logit_bias)));
}
