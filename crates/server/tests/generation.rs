//! Successful requests against the fake engine (which echoes the prompt's tokens back, one per
//! step): response shapes, parameters reaching the engine, SSE framing, and aborts on disconnect.
//! In the test tokenizer "hello" is the two tokens "hell" + "o".

mod common;

use axum::http::StatusCode;
use common::*;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use std::time::Duration;

fn parse_chunks(body: &str) -> Vec<Value> {
    let data = sse_data(body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "stream ends with [DONE]: {data:?}");
    data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect()
}

#[tokio::test]
async fn completion_has_the_openai_shape() {
    let s = server();
    let (status, v) = s.post("/v1/completions", json!({"model": MODEL, "prompt": "hello", "max_tokens": 3, "user": "u1", "logit_bias": {}})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], MODEL);
    assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
    assert_eq!(v["choices"], json!([{"index": 0, "text": "hellohell", "logprobs": null, "finish_reason": "length"}]));
    assert_eq!(v["usage"], json!({"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}}));
}

#[tokio::test]
async fn completion_parameters_reach_the_engine() {
    let s = server();
    let body = json!({"prompt": "hello", "max_tokens": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
        "seed": 42, "stop": "\n", "stop_token_ids": [260], "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "repetition_penalty": 1.1, "ignore_eos": true});
    let (status, _) = s.post("/v1/completions", body).await;
    assert_eq!(status, StatusCode::OK);
    let (_, prompt, p) = s.submitted().pop().unwrap();
    assert_eq!(prompt, s.tokenizer.encode("hello").unwrap());
    assert_eq!((p.temperature, p.top_p, p.top_k, p.min_p), (0.7, 0.9, 5, 0.1));
    assert_eq!((p.seed, p.max_tokens, p.ignore_eos), (Some(42), 2, true));
    assert_eq!(p.stop[..], ["\n".to_string()]);
    assert_eq!(p.stop_token_ids[..], [260]);
    assert_eq!((p.presence_penalty, p.frequency_penalty, p.repetition_penalty), (0.5, -0.5, 1.1));
    assert_eq!(p.logprobs, None);
}

#[tokio::test]
async fn completion_max_tokens_defaults_to_16_within_the_context() {
    let s = server(); // max_model_len 64
    s.post("/v1/completions", json!({"prompt": "hello"})).await;
    s.post("/v1/completions", json!({"prompt": "x".repeat(60)})).await;
    let max: Vec<usize> = s.submitted().iter().map(|(_, _, p)| p.max_tokens).collect();
    assert_eq!(max, vec![16, 4]);
}

#[tokio::test]
async fn echo_prepends_the_prompt() {
    let s = server();
    let (_, v) = s.post("/v1/completions", json!({"prompt": "hello", "max_tokens": 1, "echo": true})).await;
    assert_eq!(v["choices"][0]["text"], "hellohell");
    let (_, v) = s.post("/v1/completions", json!({"prompt": [104, 105], "max_tokens": 1, "echo": true})).await;
    assert_eq!(v["choices"][0]["text"], "hih");
}

/// lm-evaluation-harness's loglikelihood request: token-id prompts, echo, logprobs 1, max_tokens
/// 0 or 1. The fake engine gives prompt token i the logprob -0.25 * i.
#[tokio::test]
async fn echo_with_logprobs_returns_the_prompt_logprobs_in_the_legacy_shape() {
    let s = server();
    let body = json!({"prompt": [[104, 105, 106], [106, 107]], "echo": true, "logprobs": 1, "max_tokens": 0, "temperature": 0});
    let (status, v) = s.post("/v1/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let c = &v["choices"];
    assert_eq!(c[0]["text"], "hij");
    assert_eq!(c[0]["finish_reason"], "length");
    assert_eq!(c[0]["logprobs"]["tokens"], json!(["h", "i", "j"]));
    assert_eq!(c[0]["logprobs"]["token_logprobs"], json!([null, -0.25, -0.5]));
    assert_eq!(c[0]["logprobs"]["text_offset"], json!([0, 1, 2]));
    assert_eq!(c[0]["logprobs"]["top_logprobs"], json!([null, {"j": -0.1, "i": -0.25}, {"k": -0.1, "j": -0.5}]));
    assert_eq!(c[1]["text"], "jk");
    assert_eq!(c[1]["logprobs"]["token_logprobs"], json!([null, -0.25]));
    assert!(c[0].get("prompt_logprobs").is_none(), "only when asked for");
    assert_eq!(v["usage"], json!({"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}}));
    // the engine was asked for the prompt's logprobs with the client's k
    assert!(s.submitted().iter().all(|(_, _, p)| p.prompt_logprobs == Some(1)));

    // max_tokens 1: the generated token follows the prompt's, offsets continue
    let (_, v) = s.post("/v1/completions", json!({"prompt": [104, 105], "echo": true, "logprobs": 0, "max_tokens": 1})).await;
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(v["choices"][0]["text"], "hih");
    assert_eq!(lp["tokens"], json!(["h", "i", "h"]));
    assert_eq!(lp["token_logprobs"], json!([null, -0.25, -0.5]));
    assert_eq!(lp["text_offset"], json!([0, 1, 2]));
    assert_eq!(lp["top_logprobs"][1], json!({"i": -0.25}));
}

#[tokio::test]
async fn vllm_prompt_logprobs_field() {
    let s = server();
    let (status, v) = s.post("/v1/completions", json!({"prompt": [104, 105, 106], "prompt_logprobs": 1, "max_tokens": 1})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let plp = &v["choices"][0]["prompt_logprobs"];
    assert_eq!(plp[0], Value::Null);
    assert_eq!(plp[1], json!({"105": {"logprob": -0.25, "rank": 1, "decoded_token": "i"}, "106": {"logprob": -0.1, "rank": 1, "decoded_token": "j"}}));
    assert_eq!(plp[2]["106"], json!({"logprob": -0.5, "rank": 2, "decoded_token": "j"}));
    assert_eq!(plp.as_array().unwrap().len(), 3);
    assert_eq!(v["choices"][0]["text"], "h", "no echo");
}

/// Chat's `prompt_logprobs`: one top-level list for the rendered conversation (every choice shares
/// it), shaped as on completions.
#[tokio::test]
async fn chat_prompt_logprobs_are_top_level() {
    let s = server();
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "n": 2, "prompt_logprobs": 1});
    let (status, v) = s.post("/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let (_, prompt, params) = s.submitted().remove(0);
    assert_eq!(params.prompt_logprobs, Some(1));
    let plp = v["prompt_logprobs"].as_array().expect("top-level prompt_logprobs");
    assert_eq!(plp.len(), prompt.len());
    assert_eq!(plp[0], Value::Null);
    for (i, entry) in plp.iter().enumerate().skip(1) {
        let (token, alt) = (prompt[i], (prompt[i] + 1) % 256);
        let mut want = serde_json::Map::new();
        want.insert(token.to_string(), json!({"logprob": -0.25 * i as f64, "rank": i, "decoded_token": s.tokenizer.token_text(token)}));
        if alt != token {
            want.insert(alt.to_string(), json!({"logprob": -0.1, "rank": 1, "decoded_token": s.tokenizer.token_text(alt)}));
        }
        assert_eq!(entry, &Value::Object(want), "position {i}");
    }
    assert!(v["choices"].as_array().unwrap().iter().all(|c| c.get("prompt_logprobs").is_none()));
    // only when asked for
    let (_, v) = s.post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})).await;
    assert!(v.get("prompt_logprobs").is_none(), "{v}");
}

/// A stream's pieces, concatenated per choice: text and the legacy logprob lists (None when no
/// chunk carried logprobs), vLLM's `prompt_logprobs` (at most one chunk may carry them), the
/// finish reason and the usage chunk's usage.
#[derive(Debug, Default, PartialEq)]
struct Streamed {
    text: String,
    logprobs: Option<Value>,
    prompt_logprobs: Option<Value>,
    finish_reason: Option<Value>,
}

fn concatenate(chunks: &[Value], choices: usize) -> (Vec<Streamed>, Option<Value>) {
    let mut out: Vec<Streamed> = (0..choices).map(|_| Streamed::default()).collect();
    let mut usage = None;
    for chunk in chunks {
        if chunk["choices"].as_array().unwrap().is_empty() {
            usage = Some(chunk["usage"].clone());
            continue;
        }
        let c = &chunk["choices"][0];
        let o = &mut out[c["index"].as_u64().unwrap() as usize];
        assert!(o.finish_reason.is_none(), "nothing after the finish reason: {chunk}");
        o.text.push_str(c["text"].as_str().unwrap());
        if !c["logprobs"].is_null() {
            let lp = o.logprobs.get_or_insert_with(|| json!({"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}));
            for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
                lp[key].as_array_mut().unwrap().extend(c["logprobs"][key].as_array().unwrap().iter().cloned());
            }
        }
        if let Some(plp) = c.get("prompt_logprobs") {
            assert!(o.prompt_logprobs.replace(plp.clone()).is_none(), "prompt_logprobs sent twice");
        }
        if !c["finish_reason"].is_null() {
            o.finish_reason = Some(c["finish_reason"].clone());
        }
    }
    (out, usage)
}

/// Streaming with echo + logprobs, `prompt_logprobs` and `max_tokens: 0`: each choice opens with
/// the echoed prompt and its logprobs, then the generated deltas; the pieces put together are the
/// whole response's text and logprob lists.
#[tokio::test]
async fn streamed_prompt_logprobs_concatenate_to_the_whole_response() {
    let s = server();
    let cases = [
        json!({"prompt": [[104, 105, 106], [106, 107]], "echo": true, "logprobs": 1, "max_tokens": 0}),
        json!({"prompt": [[104, 105, 106], [106, 107]], "echo": true, "logprobs": 2, "max_tokens": 3, "n": 2}),
        json!({"prompt": "hello", "echo": true, "logprobs": 0, "max_tokens": 2, "prompt_logprobs": 2}),
        json!({"prompt": "hello", "logprobs": 1, "max_tokens": 2, "prompt_logprobs": 0}),
        json!({"prompt": "hello", "max_tokens": 2, "prompt_logprobs": 1}),
        json!({"prompt": ["hello", "hi"], "echo": true, "max_tokens": 0}),
    ];
    for body in cases {
        let (status, whole) = s.post("/v1/completions", body.clone()).await;
        assert_eq!(status, StatusCode::OK, "{body} -> {whole}");
        let mut streamed_body = body.clone();
        streamed_body["stream"] = json!(true);
        streamed_body["stream_options"] = json!({"include_usage": true});
        let resp = s.post_raw("/v1/completions", streamed_body.to_string()).await;
        assert_eq!(resp.status(), StatusCode::OK, "{body}");
        let chunks = parse_chunks(&text_of(resp).await);
        let choices = whole["choices"].as_array().unwrap();
        let (streamed, usage) = concatenate(&chunks, choices.len());
        for (c, got) in choices.iter().zip(&streamed) {
            let want = Streamed {
                text: c["text"].as_str().unwrap().to_string(),
                logprobs: (!c["logprobs"].is_null()).then(|| c["logprobs"].clone()),
                prompt_logprobs: c.get("prompt_logprobs").cloned(),
                finish_reason: Some(c["finish_reason"].clone()),
            };
            assert_eq!(got, &want, "{body}");
        }
        assert_eq!(usage.as_ref(), Some(&whole["usage"]), "{body}");
        // the echo (with its logprobs, the first one null) opens each choice
        if body["echo"] == json!(true) {
            for (i, c) in choices.iter().enumerate() {
                let first = &chunks.iter().find(|k| k["choices"][0]["index"] == json!(i)).unwrap()["choices"][0];
                let text = first["text"].as_str().unwrap();
                assert!(!text.is_empty() && c["text"].as_str().unwrap().starts_with(text), "{first}");
                assert!(body.get("logprobs").is_none() || first["logprobs"]["token_logprobs"][0].is_null(), "{first}");
            }
        }
    }
}

#[tokio::test]
async fn prompt_lists_and_n_give_prompt_major_choices_with_seed_plus_i() {
    let s = server();
    let (status, v) = s.post("/v1/completions", json!({"prompt": ["ab", "cd"], "n": 2, "max_tokens": 1, "seed": 7})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let texts: Vec<(u64, &str)> = v["choices"].as_array().unwrap().iter().map(|c| (c["index"].as_u64().unwrap(), c["text"].as_str().unwrap())).collect();
    assert_eq!(texts, vec![(0, "a"), (1, "a"), (2, "c"), (3, "c")]);
    // Each prompt counted once, each choice's tokens counted.
    assert_eq!(v["usage"], json!({"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8, "prompt_tokens_details": {"cached_tokens": 0}}));
    let mut seeds: Vec<(Vec<u32>, Option<u64>)> = s.submitted().into_iter().map(|(_, p, sp)| (p, sp.seed)).collect();
    seeds.sort();
    assert_eq!(seeds, vec![(vec![97, 98], Some(7)), (vec![97, 98], Some(8)), (vec![99, 100], Some(7)), (vec![99, 100], Some(8))]);
    let (_, v) = s.post("/v1/completions", json!({"prompt": [[104], [105, 106]], "max_tokens": 2})).await;
    assert_eq!(v["choices"][0]["text"], "hh");
    assert_eq!(v["choices"][1]["text"], "ij");
}

#[tokio::test]
async fn completion_logprobs_use_the_legacy_layout() {
    let s = server();
    let (status, v) = s.post("/v1/completions", json!({"prompt": "hello", "max_tokens": 2, "logprobs": 1})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(s.submitted()[0].2.logprobs, Some(1));
    // Fake engine: sampled token at -0.5, alternative (token + 1) % 256 at -1.
    let hell = s.tokenizer.encode("hell").unwrap()[0];
    let alt_hell = s.tokenizer.token_text((hell + 1) % 256);
    assert_eq!(
        v["choices"][0]["logprobs"],
        json!({
            "tokens": ["hell", "o"],
            "token_logprobs": [-0.5, -0.5],
            "top_logprobs": [{"hell": -0.5, alt_hell: -1.0}, {"o": -0.5, "p": -1.0}],
            "text_offset": [0, 4],
        })
    );
}

#[tokio::test]
async fn chat_renders_the_template_and_answers_as_assistant() {
    let s = server();
    let body = json!({"model": MODEL, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}],
        "max_tokens": 2});
    let (status, v) = s.post("/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["object"], "chat.completion");
    let expected_prompt = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi\nthere<|im_end|>\n<|im_start|>assistant\n";
    let (_, prompt, _) = s.submitted().pop().unwrap();
    assert_eq!(prompt, s.tokenizer.encode(expected_prompt).unwrap());
    assert_eq!(prompt[0], 259, "<|im_start|> is one control token");
    assert_eq!(v["choices"], json!([{"index": 0, "message": {"role": "assistant", "content": "<|im_start|>s"}, "logprobs": null, "finish_reason": "length"}]));
    let n = prompt.len();
    assert_eq!(v["usage"], json!({"prompt_tokens": n, "completion_tokens": 2, "total_tokens": n + 2, "prompt_tokens_details": {"cached_tokens": 0}}));
}

#[tokio::test]
async fn chat_max_tokens_defaults_to_the_rest_of_the_context() {
    let s = server(); // max_model_len 64
    let (status, _) = s.post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "n": 1})).await;
    assert_eq!(status, StatusCode::OK);
    let (_, prompt, p) = s.submitted().pop().unwrap();
    assert_eq!(p.max_tokens, 64 - prompt.len());
}

#[tokio::test]
async fn chat_n_2_returns_2_choices() {
    let s = server();
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 1})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    assert_eq!((choices[0]["index"].as_u64(), choices[1]["index"].as_u64()), (Some(0), Some(1)));
    assert_eq!(s.submitted().len(), 2);
    assert_eq!(v["usage"]["completion_tokens"], 2);
}

#[tokio::test]
async fn chat_logprobs_use_the_content_layout() {
    let s = server();
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logprobs": true, "top_logprobs": 2});
    let (status, v) = s.post("/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let entry = &v["choices"][0]["logprobs"]["content"][0];
    assert_eq!(entry["token"], "<|im_start|>");
    assert_eq!(entry["logprob"], -0.5);
    assert_eq!(entry["bytes"], json!("<|im_start|>".bytes().collect::<Vec<u8>>()));
    let top = entry["top_logprobs"].as_array().unwrap();
    assert_eq!(top.len(), 2);
    assert_eq!(top[0]["logprob"], -1.0);
    assert!(top[0]["token"].is_string() && top[0]["bytes"].is_array());
}

#[tokio::test]
async fn streamed_completion_matches_the_whole_one() {
    let s = server();
    let resp = s.post_raw("/v1/completions", json!({"prompt": "hello", "max_tokens": 3, "stream": true}).to_string()).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(resp.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    let chunks = parse_chunks(&text_of(resp).await);
    let text: String = chunks.iter().map(|c| c["choices"][0]["text"].as_str().unwrap()).collect();
    assert_eq!(text, "hellohell");
    for c in &chunks {
        assert_eq!(c["object"], "text_completion");
        assert!(c.get("usage").is_none(), "no usage without include_usage: {c}");
    }
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert!(chunks[..chunks.len() - 1].iter().all(|c| c["choices"][0]["finish_reason"].is_null()));
}

#[tokio::test]
async fn include_usage_adds_a_final_usage_chunk() {
    let s = server();
    let body = json!({"prompt": "hello", "max_tokens": 3, "stream": true, "stream_options": {"include_usage": true}, "echo": true});
    let chunks = parse_chunks(&text_of(s.post_raw("/v1/completions", body.to_string()).await).await);
    let (last, rest) = chunks.split_last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"], json!({"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}}));
    for c in rest {
        assert!(c["usage"].is_null() && c.get("usage").is_some(), "usage: null before the last chunk: {c}");
    }
    assert_eq!(rest[0]["choices"][0]["text"], "hello", "the echo comes first");
}

#[tokio::test]
async fn streamed_chat_opens_with_the_role_and_ends_with_done() {
    let s = server();
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": true,
        "stream_options": {"include_usage": true}});
    let chunks = parse_chunks(&text_of(s.post_raw("/v1/chat/completions", body.to_string()).await).await);
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
    assert!(chunks.iter().all(|c| c["id"] == chunks[0]["id"]));
    assert_eq!(chunks[0]["choices"][0]["delta"], json!({"role": "assistant", "content": ""}));
    let content: String = chunks[1..].iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(content, "<|im_start|>u");
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["delta"], json!({}));
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 2);
}

#[tokio::test]
async fn streamed_n_2_carries_both_indexes() {
    let s = server();
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": true, "n": 2});
    let chunks = parse_chunks(&text_of(s.post_raw("/v1/chat/completions", body.to_string()).await).await);
    let finished: Vec<u64> =
        chunks.iter().filter(|c| c["choices"][0]["finish_reason"] == "length").map(|c| c["choices"][0]["index"].as_u64().unwrap()).collect();
    let mut sorted = finished.clone();
    sorted.sort();
    assert_eq!(sorted, vec![0, 1]);
}

#[tokio::test]
async fn disconnect_mid_stream_aborts_the_request() {
    let s = server_with(Setup { tick: Duration::from_millis(20), ..Setup::default() });
    let resp = s.post_raw("/v1/completions", json!({"prompt": "hello", "max_tokens": 40, "stream": true}).to_string()).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let frame = body.frame().await.unwrap().unwrap();
    let first = String::from_utf8(frame.into_data().unwrap().to_vec()).unwrap();
    assert!(first.starts_with("data: {"), "{first:?}");
    let id = s.submitted()[0].0;
    assert!(!s.log.lock().unwrap().aborted.contains(&id));
    drop(body); // the client goes away
    assert!(s.wait_for_abort(id).await, "the engine saw no Abort for {id}");
}

#[tokio::test]
async fn disconnect_while_waiting_for_a_whole_response_aborts_every_choice() {
    let s = server_with(Setup { tick: Duration::from_millis(20), ..Setup::default() });
    let router = s.router.clone();
    let task = tokio::spawn(async move {
        use tower::ServiceExt;
        let req = axum::http::Request::post("/v1/completions")
            .body(axum::body::Body::from(json!({"prompt": "hello", "max_tokens": 40, "n": 2}).to_string()))
            .unwrap();
        router.oneshot(req).await
    });
    for _ in 0..200 {
        if s.submitted().len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    task.abort();
    for (id, _, _) in s.submitted() {
        assert!(s.wait_for_abort(id).await, "the engine saw no Abort for {id}");
    }
}

#[tokio::test]
async fn finished_requests_are_not_aborted() {
    let s = server();
    let (status, _) = s.post("/v1/completions", json!({"prompt": "hello", "max_tokens": 2, "n": 3})).await;
    assert_eq!(status, StatusCode::OK);
    let chunks = text_of(s.post_raw("/v1/completions", json!({"prompt": "hi", "max_tokens": 2, "stream": true}).to_string()).await).await;
    assert!(chunks.ends_with("data: [DONE]\n\n"), "{chunks:?}");
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(s.log.lock().unwrap().aborted.is_empty());
}
