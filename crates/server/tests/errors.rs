//! Bad input, auth, overload and engine failure: each is an OpenAI error object with the right
//! status, and the engine never sees a request that failed validation.

mod common;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::*;
use serde_json::json;
use specula_server::ServerConfig;

async fn expect_error(s: &TestServer, path: &str, body: serde_json::Value, status: StatusCode, param: Option<&str>) -> String {
    let (got, v) = s.post(path, body.clone()).await;
    assert_eq!(got, status, "{body} -> {v}");
    let e = error_of(&v);
    assert_eq!(e["param"].as_str(), param, "{body} -> {v}");
    e["message"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn malformed_json_is_400_json_not_plain_text() {
    let s = server();
    for body in ["{", "", "[1, 2]", "{\"prompt\": \"hi\"} trailing", "null"] {
        let resp = s.post_raw("/v1/completions", body).await;
        assert_eq!(resp.headers()["content-type"], "application/json", "{body:?}");
        let (status, v) = json_of(resp).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body:?}");
        assert_eq!(error_of(&v)["type"], "invalid_request_error");
    }
    assert!(s.submitted().is_empty());
}

#[tokio::test]
async fn wrong_types_name_the_field() {
    let s = server();
    let m = expect_error(&s, "/v1/completions", json!({"prompt": "hi", "temperature": "hot"}), StatusCode::BAD_REQUEST, Some("temperature")).await;
    assert!(m.contains("temperature"), "{m}");
    expect_error(&s, "/v1/completions", json!({"prompt": 5}), StatusCode::BAD_REQUEST, Some("prompt")).await;
    expect_error(&s, "/v1/completions", json!({"prompt": "hi", "max_tokens": 1.5}), StatusCode::BAD_REQUEST, Some("max_tokens")).await;
    expect_error(&s, "/v1/chat/completions", json!({"messages": [{"role": "user", "content": 3}]}), StatusCode::BAD_REQUEST, Some("messages[0].content")).await;
    expect_error(&s, "/v1/chat/completions", json!({"messages": "hi"}), StatusCode::BAD_REQUEST, Some("messages")).await;
}

#[tokio::test]
async fn unknown_model_is_404_model_not_found() {
    let s = server();
    for path in ["/v1/completions", "/v1/chat/completions"] {
        let body = json!({"model": "gpt-4", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]});
        let (status, v) = s.post(path, body).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert_eq!(error_of(&v)["code"], "model_not_found");
        assert_eq!(v["error"]["param"], "model");
    }
}

#[tokio::test]
async fn empty_prompts_are_400() {
    let s = server();
    for prompt in [json!(""), json!([]), json!(["ok", ""]), json!([[]]), json!(null)] {
        expect_error(&s, "/v1/completions", json!({"prompt": prompt}), StatusCode::BAD_REQUEST, Some("prompt")).await;
    }
    expect_error(&s, "/v1/chat/completions", json!({"messages": []}), StatusCode::BAD_REQUEST, Some("messages")).await;
    assert!(s.submitted().is_empty());
}

#[tokio::test]
async fn prompt_over_max_model_len_is_400_with_both_numbers() {
    let s = server(); // max_model_len 64; "x" is one token
    let m = expect_error(&s, "/v1/completions", json!({"prompt": "x".repeat(70)}), StatusCode::BAD_REQUEST, Some("prompt")).await;
    assert_eq!(m, "prompt has 70 tokens but --max-model-len is 64; shorten the prompt");
    let m = expect_error(&s, "/v1/completions", json!({"prompt": vec![120; 64]}), StatusCode::BAD_REQUEST, Some("prompt")).await;
    assert!(m.contains("leaves no room"), "{m}");
}

#[tokio::test]
async fn token_ids_outside_the_vocabulary_are_400() {
    let s = server();
    let m = expect_error(&s, "/v1/completions", json!({"prompt": [1, 99999]}), StatusCode::BAD_REQUEST, Some("prompt")).await;
    assert!(m.contains("99999"), "{m}");
    expect_error(&s, "/v1/completions", json!({"prompt": "hi", "stop_token_ids": [99999]}), StatusCode::BAD_REQUEST, Some("stop_token_ids")).await;
}

#[tokio::test]
async fn max_tokens_must_be_positive_and_fit_the_context() {
    let s = server();
    for m in [0, -1] {
        expect_error(&s, "/v1/completions", json!({"prompt": "hi", "max_tokens": m}), StatusCode::BAD_REQUEST, Some("max_tokens")).await;
    }
    expect_error(
        &s,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}),
        StatusCode::BAD_REQUEST,
        Some("max_completion_tokens"),
    )
    .await;
    // "xxxxxxxxxx" is 10 tokens: 10 + 55 > 64.
    let m = expect_error(&s, "/v1/completions", json!({"prompt": "x".repeat(10), "max_tokens": 55}), StatusCode::BAD_REQUEST, Some("max_tokens")).await;
    assert!(m.contains("at most 54"), "{m}");
    let (status, _) = s.post("/v1/completions", json!({"prompt": "x".repeat(10), "max_tokens": 54})).await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn sampling_ranges_are_checked() {
    let s = server();
    let cases = [
        (json!({"temperature": -1}), "temperature"),
        (json!({"top_p": 0}), "top_p"),
        (json!({"top_p": 1.5}), "top_p"),
        (json!({"top_k": -5}), "top_k"),
        (json!({"min_p": 2}), "min_p"),
        (json!({"presence_penalty": 3}), "presence_penalty"),
        (json!({"logprobs": 21}), "logprobs"),
        (json!({"n": 17}), "n"),
        (json!({"n": 0}), "n"),
    ];
    for (extra, param) in cases {
        let mut body = json!({"prompt": "hi"});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        expect_error(&s, "/v1/completions", body, StatusCode::BAD_REQUEST, Some(param)).await;
    }
    let chat = |extra: serde_json::Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    };
    expect_error(&s, "/v1/chat/completions", chat(json!({"logprobs": true, "top_logprobs": 21})), StatusCode::BAD_REQUEST, Some("top_logprobs")).await;
    expect_error(&s, "/v1/chat/completions", chat(json!({"top_logprobs": 2})), StatusCode::BAD_REQUEST, Some("top_logprobs")).await;
    expect_error(&s, "/v1/chat/completions", chat(json!({"temperature": -0.1})), StatusCode::BAD_REQUEST, Some("temperature")).await;
    assert!(s.submitted().is_empty());
}

#[tokio::test]
async fn bad_prompt_logprob_requests_name_their_field() {
    let s = server();
    let c = "/v1/completions";
    expect_error(&s, c, json!({"prompt": "hi", "prompt_logprobs": -1}), StatusCode::BAD_REQUEST, Some("prompt_logprobs")).await;
    expect_error(&s, c, json!({"prompt": "hi", "prompt_logprobs": 21}), StatusCode::BAD_REQUEST, Some("prompt_logprobs")).await;
    expect_error(&s, c, json!({"prompt": "hi", "echo": true, "logprobs": 21}), StatusCode::BAD_REQUEST, Some("logprobs")).await;
    expect_error(&s, c, json!({"prompt": "hi", "echo": true, "logprobs": -1}), StatusCode::BAD_REQUEST, Some("logprobs")).await;
    // max_tokens 0 means "the prompt only", which needs echo
    expect_error(&s, c, json!({"prompt": "hi", "max_tokens": 0}), StatusCode::BAD_REQUEST, Some("max_tokens")).await;
    expect_error(&s, c, json!({"prompt": "hi", "max_tokens": -1, "echo": true}), StatusCode::BAD_REQUEST, Some("max_tokens")).await;
    // chat: the same checks; its stream has no place for them (as in vLLM)
    let chat = "/v1/chat/completions";
    let messages = json!([{"role": "user", "content": "hi"}]);
    expect_error(&s, chat, json!({"messages": messages, "prompt_logprobs": -1}), StatusCode::BAD_REQUEST, Some("prompt_logprobs")).await;
    expect_error(&s, chat, json!({"messages": messages, "prompt_logprobs": 21}), StatusCode::BAD_REQUEST, Some("prompt_logprobs")).await;
    expect_error(&s, chat, json!({"messages": messages, "prompt_logprobs": 1, "stream": true}), StatusCode::BAD_REQUEST, Some("prompt_logprobs")).await;
    assert!(s.submitted().is_empty());
}

#[tokio::test]
async fn non_text_content_parts_and_missing_template_are_400() {
    let s = server();
    let body = json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]});
    expect_error(&s, "/v1/chat/completions", body, StatusCode::BAD_REQUEST, Some("messages[0].content[0].type")).await;
    let s = server_with(Setup { chat_template: false, ..Setup::default() });
    let m = expect_error(&s, "/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}]}), StatusCode::BAD_REQUEST, None).await;
    assert!(m.contains("chat template"), "{m}");
}

#[tokio::test]
async fn body_over_the_limit_is_413() {
    let s = server_with(Setup { config: ServerConfig { max_body_bytes: 1024, ..ServerConfig::new(MODEL) }, ..Setup::default() });
    let (status, v) = s.post("/v1/completions", json!({"prompt": "x".repeat(2000)})).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(error_of(&v)["message"].as_str().unwrap().contains("1024"));
}

#[tokio::test]
async fn api_key_guards_v1_but_not_health() {
    let s = server_with(Setup { config: ServerConfig { api_keys: vec!["sk-test".into()], ..ServerConfig::new(MODEL) }, ..Setup::default() });
    let request = |auth: Option<&str>| {
        let mut b = Request::post("/v1/completions").header("content-type", "application/json");
        if let Some(a) = auth {
            b = b.header("authorization", a);
        }
        b.body(Body::from(json!({"prompt": "hi", "max_tokens": 1}).to_string())).unwrap()
    };
    for auth in [None, Some("Bearer wrong"), Some("sk-test"), Some("Basic sk-test")] {
        let resp = s.send(request(auth)).await;
        assert_eq!(resp.headers()["www-authenticate"], "Bearer");
        let (status, v) = json_of(resp).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{auth:?}");
        assert_eq!(error_of(&v)["code"], "invalid_api_key");
    }
    let (status, _) = json_of(s.send(request(Some("Bearer sk-test"))).await).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(s.get("/v1/models").await.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(s.get("/health").await.status(), StatusCode::OK);
}

#[tokio::test]
async fn full_queue_is_503() {
    let s = server_with(Setup { max_waiting: 0, ..Setup::default() });
    let resp = s.post_raw("/v1/completions", json!({"prompt": "hi"}).to_string()).await;
    assert_eq!(resp.headers()["retry-after"], "1");
    let (status, v) = json_of(resp).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(error_of(&v)["code"], "overloaded");
    let (status, _) = s.post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "stream": true})).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
}

#[tokio::test]
async fn engine_failure_is_500_internal_error() {
    let s = server();
    let (status, v) = s.post("/v1/completions", json!({"prompt": "a<|fail|>", "max_tokens": 5})).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(error_of(&v)["type"], "internal_error");
    assert_eq!(v["error"]["message"], "scripted failure");
}

#[tokio::test]
async fn engine_failure_mid_stream_is_an_error_event() {
    let s = server();
    let resp = s.post_raw("/v1/completions", json!({"prompt": "a<|fail|>", "max_tokens": 5, "stream": true}).to_string()).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let data = sse_data(&text_of(resp).await);
    assert_eq!(data.len(), 3, "{data:?}");
    let first: serde_json::Value = serde_json::from_str(&data[0]).unwrap();
    assert_eq!(first["choices"][0]["text"], "a");
    let err: serde_json::Value = serde_json::from_str(&data[1]).unwrap();
    assert_eq!(error_of(&err)["type"], "internal_error");
    assert_eq!(data[2], "[DONE]");
}

#[tokio::test]
async fn unknown_routes_and_methods_answer_in_json() {
    let s = server();
    let (status, v) = json_of(s.get("/v1/nope").await).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    error_of(&v);
    let (status, v) = json_of(s.get("/v1/completions").await).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    error_of(&v);
    let (status, v) = json_of(s.get("/v1/models/other").await).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(error_of(&v)["code"], "model_not_found");
}

#[tokio::test]
async fn unknown_roles_and_user_messages_without_content_are_refused() {
    let s = server();
    let m =
        expect_error(&s, "/v1/chat/completions", json!({"messages": [{"role": "wizard", "content": "hi"}]}), StatusCode::BAD_REQUEST, Some("messages[0].role"))
            .await;
    assert!(m.contains("wizard"), "{m}");
    for role in ["user", "system", "developer", "tool"] {
        let body = json!({"messages": [{"role": "user", "content": "hi"}, {"role": role}]});
        expect_error(&s, "/v1/chat/completions", body, StatusCode::BAD_REQUEST, Some("messages[1].content")).await;
    }
    assert!(s.submitted().is_empty());
    // an assistant turn without content (it called tools) is still rendered
    let (status, v) = s
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}, {"role": "user", "content": "he"}], "max_tokens": 2}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
}

#[tokio::test]
async fn stop_strings_are_bounded_in_number_and_length() {
    let s = server_with(Setup { config: ServerConfig { max_stop_strings: 2, max_stop_string_chars: 5, ..Setup::default().config }, ..Setup::default() });
    let m = expect_error(&s, "/v1/completions", json!({"prompt": "hi", "stop": ["a", "b", "c"]}), StatusCode::BAD_REQUEST, Some("stop")).await;
    assert!(m.contains("at most 2"), "{m}");
    let m = expect_error(
        &s,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}], "stop": "abcdef"}),
        StatusCode::BAD_REQUEST,
        Some("stop"),
    )
    .await;
    assert!(m.contains("5"), "{m}");
    assert!(s.submitted().is_empty());
    let (status, v) = s.post("/v1/completions", json!({"prompt": "hi", "stop": ["a", "bcdé!"], "max_tokens": 2})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
}

#[tokio::test]
async fn logit_bias_keys_must_be_token_ids_and_values_in_range() {
    let s = server();
    for bias in [json!({"x": 1}), json!({"264": 1}), json!({"-1": 1})] {
        let m = expect_error(&s, "/v1/completions", json!({"prompt": "hi", "logit_bias": bias}), StatusCode::BAD_REQUEST, Some("logit_bias")).await;
        assert!(m.contains("token id"), "{m}");
    }
    expect_error(
        &s,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 101}}),
        StatusCode::BAD_REQUEST,
        Some("logit_bias"),
    )
    .await;
    assert!(s.submitted().is_empty());
    let (status, v) = s.post("/v1/completions", json!({"prompt": "hi", "logit_bias": {"42": 100, "7": -100}, "max_tokens": 2})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let (_, _, params) = s.submitted().pop().unwrap();
    let mut bias = params.logit_bias.to_vec();
    bias.sort_by_key(|b| b.0);
    assert_eq!(bias, vec![(7, -100.0), (42, 100.0)]);
}
