//! Test fixtures: a tiny byte-level BPE tokenizer, a scripted fake engine, and request helpers
//! that drive the router in process (no sockets).
#![allow(dead_code)]

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::response::Response;
use axum::Router;
use http_body_util::BodyExt;
use serde_json::Value;
use specula_engine::api::{FinishReason, RequestEvent, SamplingParams, TokenLogprob};
use specula_engine::handle::{EngineCommand, EngineHandle};
use specula_engine::types::{RequestId, TokenId};
use specula_model::tokenizer::GgufTokenizerSpec;
use specula_model::{ChatTemplate, Tokenizer};
use specula_server::{router, AppState, ServerConfig};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tower::ServiceExt;

pub const MODEL: &str = "tiny";

/// GPT-2's byte -> printable-char table.
fn bytes_to_unicode() -> Vec<char> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut extra = 0;
    (0..256u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap()
            } else {
                extra += 1;
                char::from_u32(255 + extra).unwrap()
            }
        })
        .collect()
}

/// 256 byte tokens, merges he / ll / hell, then the control tokens <|im_start|> (259),
/// <|im_end|> (260, EOS) and <|fail|> (261, which makes the fake engine fail the request), and
/// the user-defined tokens <think> (262) and </think> (263), as Qwen3's vocabulary has them.
pub fn tokenizer() -> Tokenizer {
    let mut tokens: Vec<String> = bytes_to_unicode().into_iter().map(String::from).collect();
    tokens.extend(["he", "ll", "hell"].map(String::from));
    let mut token_types = vec![1; tokens.len()];
    for control in ["<|im_start|>", "<|im_end|>", "<|fail|>"] {
        tokens.push(control.to_string());
        token_types.push(3);
    }
    for tag in ["<think>", "</think>"] {
        tokens.push(tag.to_string());
        token_types.push(4);
    }
    Tokenizer::from_gguf(GgufTokenizerSpec {
        model: "gpt2",
        pre: None,
        tokens,
        token_types,
        merges: vec!["h e".into(), "l l".into(), "he ll".into()],
        bos: None,
        eos: Some(260),
        ..Default::default()
    })
    .expect("the test tokenizer builds")
}

pub const FAIL_TOKEN: TokenId = 261;
pub const THINK_OPEN: TokenId = 262;
pub const THINK_CLOSE: TokenId = 263;

/// What the fake engine saw.
#[derive(Debug, Default)]
pub struct EngineLog {
    pub submitted: Vec<(RequestId, Vec<TokenId>, SamplingParams)>,
    /// Per submitted request: whether it came with a compiled grammar.
    pub grammars: Vec<bool>,
    pub aborted: Vec<RequestId>,
}

struct Active {
    id: RequestId,
    prompt: Vec<TokenId>,
    params: SamplingParams,
    emitted: usize,
    events: tokio::sync::mpsc::UnboundedSender<RequestEvent>,
}

/// A fake engine thread: echoes each prompt's tokens back cyclically, one token per `tick`, until
/// `max_tokens` (then `Finished { Length }`). A prompt containing `<|fail|>` fails after its first
/// token. Honours `Abort` (answering `Finished { Abort }`) and logs everything.
pub fn fake_engine(max_waiting: usize, tokenizer: Arc<Tokenizer>, tick: Duration) -> (EngineHandle, Arc<Mutex<EngineLog>>) {
    let (handle, rx, counters) = EngineHandle::channel(max_waiting);
    let log = Arc::new(Mutex::new(EngineLog::default()));
    let thread_log = log.clone();
    std::thread::spawn(move || {
        let mut active: Vec<Active> = Vec::new();
        loop {
            let command = if active.is_empty() {
                match rx.recv() {
                    Ok(c) => Some(c),
                    Err(_) => return,
                }
            } else {
                match rx.recv_timeout(tick) {
                    Ok(c) => Some(c),
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => None,
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
                }
            };
            match command {
                Some(EngineCommand::Submit(req)) => {
                    counters.waiting.fetch_sub(1, Ordering::Relaxed);
                    let mut log = thread_log.lock().unwrap();
                    log.submitted.push((req.id, req.prompt.clone(), req.params.clone()));
                    log.grammars.push(req.grammar.is_some());
                    drop(log);
                    active.push(Active { id: req.id, prompt: req.prompt, params: req.params, emitted: 0, events: req.events });
                    continue;
                }
                Some(EngineCommand::Abort(id)) => {
                    thread_log.lock().unwrap().aborted.push(id);
                    if let Some(pos) = active.iter().position(|a| a.id == id) {
                        let a = active.remove(pos);
                        let _ = a.events.send(RequestEvent::Finished {
                            reason: FinishReason::Abort,
                            prompt_tokens: a.prompt.len(),
                            completion_tokens: a.emitted,
                            cached_tokens: 0,
                        });
                    }
                    continue;
                }
                Some(EngineCommand::Shutdown) => return,
                None => {}
            }
            active.retain_mut(|a| step(a, &tokenizer));
        }
    });
    (handle, log)
}

/// Emits one token; false when the request is over.
fn step(a: &mut Active, tokenizer: &Tokenizer) -> bool {
    if a.emitted == 1 && a.prompt.contains(&FAIL_TOKEN) {
        let _ = a.events.send(RequestEvent::Failed { message: "scripted failure".into() });
        return false;
    }
    if let (0, Some(k)) = (a.emitted, a.params.prompt_logprobs) {
        // prompt token i (i >= 1) gets logprob -0.25 * i, rank i, and k alternatives
        let logprobs: Vec<TokenLogprob> = a.prompt[1..]
            .iter()
            .enumerate()
            .map(|(i, &token)| TokenLogprob {
                token,
                logprob: -0.25 * (i + 1) as f32,
                top: (0..k as u32).map(|j| ((token + 1 + j) % 256, -0.1 - j as f32)).collect(),
            })
            .collect();
        let ranks = (1..a.prompt.len() as u32).collect();
        let _ = a.events.send(RequestEvent::PromptLogprobs { logprobs, ranks });
    }
    let token = a.prompt[a.emitted % a.prompt.len()];
    let logprobs = match a.params.logprobs {
        Some(k) => vec![TokenLogprob { token, logprob: -0.5, top: (0..k as u32).map(|j| ((token + 1 + j) % 256, -1.0 - j as f32)).collect() }],
        None => Vec::new(),
    };
    let _ = a.events.send(RequestEvent::Delta { tokens: vec![token], text: tokenizer.token_text(token), logprobs });
    a.emitted += 1;
    if a.emitted >= a.params.max_tokens {
        let _ = a.events.send(RequestEvent::Finished {
            reason: FinishReason::Length,
            prompt_tokens: a.prompt.len(),
            completion_tokens: a.emitted,
            cached_tokens: 0,
        });
        return false;
    }
    true
}

pub struct TestServer {
    pub router: Router,
    /// The handle the server submits through (its queue counters).
    pub engine: EngineHandle,
    pub log: Arc<Mutex<EngineLog>>,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Arc<ChatTemplate>,
}

pub struct Setup {
    pub config: ServerConfig,
    pub max_waiting: usize,
    pub tick: Duration,
    pub chat_template: bool,
}

impl Default for Setup {
    fn default() -> Self {
        Self { config: ServerConfig { max_model_len: 64, ..ServerConfig::new(MODEL) }, max_waiting: 64, tick: Duration::from_millis(1), chat_template: true }
    }
}

pub fn server() -> TestServer {
    server_with(Setup::default())
}

pub fn server_with(setup: Setup) -> TestServer {
    let tokenizer = Arc::new(tokenizer());
    let template = Arc::new(ChatTemplate::new(specula_model::chat::CHATML, "", "<|im_end|>").unwrap());
    let (engine, log) = fake_engine(setup.max_waiting, tokenizer.clone(), setup.tick);
    let state = AppState::new(engine.clone(), tokenizer.clone(), setup.chat_template.then(|| template.clone()), setup.config);
    TestServer { router: router(state), engine, log, tokenizer, template }
}

impl TestServer {
    pub async fn send(&self, req: Request<Body>) -> Response {
        self.router.clone().oneshot(req).await.unwrap()
    }

    pub async fn post_raw(&self, path: &str, body: impl Into<Body>) -> Response {
        let req = Request::post(path).header("content-type", "application/json").body(body.into()).unwrap();
        self.send(req).await
    }

    /// POSTs `body`, returns the status and the JSON answer.
    pub async fn post(&self, path: &str, body: Value) -> (StatusCode, Value) {
        let resp = self.post_raw(path, body.to_string()).await;
        json_of(resp).await
    }

    pub async fn get(&self, path: &str) -> Response {
        self.send(Request::get(path).body(Body::empty()).unwrap()).await
    }

    /// Waits (up to 2 s) until the fake engine has logged an abort of `id`.
    pub async fn wait_for_abort(&self, id: RequestId) -> bool {
        for _ in 0..200 {
            if self.log.lock().unwrap().aborted.contains(&id) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }

    pub fn submitted(&self) -> Vec<(RequestId, Vec<TokenId>, SamplingParams)> {
        self.log.lock().unwrap().submitted.clone()
    }
}

pub async fn text_of(resp: Response) -> String {
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}

pub async fn json_of(resp: Response) -> (StatusCode, Value) {
    let status = resp.status();
    let text = text_of(resp).await;
    let value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
    (status, value)
}

/// The `data:` payloads of an SSE body, in order.
pub fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|event| {
            let data: Vec<&str> = event.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
            assert_eq!(data.len(), 1, "one data line per event: {event:?}");
            data[0].to_string()
        })
        .collect()
}

/// Asserts `v` is an OpenAI error object and returns its `error` member.
pub fn error_of(v: &Value) -> &Value {
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "error.message: {v}");
    assert!(e["type"].is_string(), "error.type: {v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "error.param/code present: {v}");
    e
}
