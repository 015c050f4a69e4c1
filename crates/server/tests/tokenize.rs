//! vLLM's tokenizer endpoints (`/tokenize`, `/detokenize`, `/tokenizer_info`) as
//! lm-evaluation-harness's remote tokenizer calls them, on the test tokenizer (byte-level BPE with
//! the merges he / ll / hell and control tokens <|im_start|> 259, <|im_end|> 260).

mod common;

use axum::http::StatusCode;
use common::*;
use serde_json::json;
use specula_server::ServerConfig;

#[tokio::test]
async fn tokenize_a_prompt_as_the_engine_does() {
    let s = server();
    let (status, v) = s.post("/tokenize", json!({"prompt": "hello", "add_special_tokens": false})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    // "hell" (258) then "o" (byte 'o' = 111)
    assert_eq!(v["tokens"], json!([258, 111]));
    assert_eq!(v["count"], 2);
    assert_eq!(v["max_model_len"], 64);
    assert_eq!(v["token_strs"], json!(null));
    let (_, v) = s.post("/tokenize", json!({"prompt": "he<|im_end|>", "return_token_strs": true})).await;
    assert_eq!(v["tokens"], json!([256, 260]));
    assert_eq!(v["token_strs"], json!(["he", "<|im_end|>"]));
}

#[tokio::test]
async fn tokenize_messages_renders_the_chat_template() {
    let s = server();
    let (status, v) = s.post("/tokenize", json!({"messages": [{"role": "user", "content": "he"}]})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let want = s.tokenizer.encode("<|im_start|>user\nhe<|im_end|>\n<|im_start|>assistant\n").unwrap();
    assert_eq!(v["tokens"], json!(want));
    let (_, v) = s.post("/tokenize", json!({"messages": [{"role": "user", "content": "he"}], "add_generation_prompt": false})).await;
    let want = s.tokenizer.encode("<|im_start|>user\nhe<|im_end|>\n").unwrap();
    assert_eq!(v["tokens"], json!(want));
}

#[tokio::test]
async fn detokenize_round_trips_and_refuses_ids_outside_the_vocabulary() {
    let s = server();
    let (status, v) = s.post("/detokenize", json!({"tokens": [258, 111]})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["prompt"], "hello");
    for bad in [json!([1, 264]), json!([-1])] {
        let (status, v) = s.post("/detokenize", json!({"tokens": bad})).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
        assert!(error_of(&v)["param"].as_str().unwrap().starts_with("tokens["), "{v}");
    }
}

#[tokio::test]
async fn tokenize_refuses_both_or_neither_input_and_a_wrong_model() {
    let s = server();
    for body in [json!({}), json!({"prompt": "a", "messages": [{"role": "user", "content": "b"}]})] {
        let (status, v) = s.post("/tokenize", body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    }
    let (status, _) = s.post("/tokenize", json!({"prompt": "a", "model": "other"})).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let s = server_with(Setup { chat_template: false, ..Setup::default() });
    let (status, v) = s.post("/tokenize", json!({"messages": [{"role": "user", "content": "b"}]})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(error_of(&v)["param"], "messages");
}

#[tokio::test]
async fn tokenizer_info_names_the_special_tokens_and_the_template() {
    let s = server();
    let (status, v) = json_of(s.get("/tokenizer_info").await).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["eos_token"], "<|im_end|>");
    assert_eq!(v["eos_token_id"], 260);
    assert_eq!(v["bos_token"], json!(null));
    assert_eq!(v["model_max_length"], 64);
    assert_eq!(v["chat_template"], specula_model::chat::CHATML);
}

#[tokio::test]
async fn tokenizer_endpoints_need_the_api_key_when_one_is_set() {
    let s = server_with(Setup { config: ServerConfig { api_keys: vec!["k".into()], ..Setup::default().config }, ..Setup::default() });
    let (status, _) = s.post("/tokenize", json!({"prompt": "a"})).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
}
