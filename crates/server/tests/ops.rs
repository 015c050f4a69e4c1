//! The operational endpoints (/v1/models, /health, /metrics) and `serve` on a real socket.

mod common;

use axum::http::StatusCode;
use common::*;
use serde_json::json;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test]
async fn models_lists_the_served_model() {
    let s = server();
    let (status, v) = json_of(s.get("/v1/models").await).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["object"], "list");
    let card = &v["data"][0];
    assert_eq!((card["id"].as_str(), card["object"].as_str()), (Some(MODEL), Some("model")));
    assert_eq!(card["owned_by"], "specula");
    assert_eq!(card["max_model_len"], 64);
    let (status, one) = json_of(s.get(&format!("/v1/models/{MODEL}")).await).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(&one, card);
}

#[tokio::test]
async fn health_is_200() {
    assert_eq!(server().get("/health").await.status(), StatusCode::OK);
}

#[tokio::test]
async fn metrics_render_request_counters_and_histograms() {
    let s = server();
    let (status, _) = s.post("/v1/completions", json!({"prompt": "hello", "max_tokens": 3})).await;
    assert_eq!(status, StatusCode::OK);
    // A second server in the same process shares the recorder.
    let other = server();
    let resp = other.get("/metrics").await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(resp.headers()["content-type"].to_str().unwrap().starts_with("text/plain"));
    let text = text_of(resp).await;
    for name in [
        "\nspecula:prompt_tokens_total ",
        "\nspecula:generation_tokens_total ",
        "specula:request_success_total{finished_reason=\"length\"}",
        "specula:time_to_first_token_seconds_bucket",
        "specula:time_per_output_token_seconds_bucket",
        "specula:e2e_request_latency_seconds_count",
        "# HELP specula:e2e_request_latency_seconds",
    ] {
        assert!(text.contains(name), "{name} missing from:\n{text}");
    }
}

#[tokio::test]
async fn serve_answers_on_a_socket_and_shuts_down() {
    let tokenizer = Arc::new(tokenizer());
    let (engine, _log) = fake_engine(8, tokenizer.clone(), std::time::Duration::from_millis(1));
    let state = specula_server::AppState::new(engine, tokenizer, None, specula_server::ServerConfig::new(MODEL));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(specula_server::serve(listener, state, async {
        let _ = stop_rx.await;
    }));
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let body = json!({"prompt": "hi", "max_tokens": 2}).to_string();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("\"text\":\"hi\""), "{answer}");
    stop_tx.send(()).unwrap();
    server.await.unwrap().unwrap();
}

#[tokio::test]
async fn serve_refuses_a_bad_config() {
    let tokenizer = Arc::new(tokenizer());
    let (engine, _log) = fake_engine(8, tokenizer.clone(), std::time::Duration::from_millis(1));
    let config = specula_server::ServerConfig { max_model_len: 0, ..specula_server::ServerConfig::new(MODEL) };
    let state = specula_server::AppState::new(engine, tokenizer, None, config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let err = specula_server::serve(listener, state, async {}).await.unwrap_err();
    assert!(err.to_string().contains("--max-model-len"), "{err}");
}
