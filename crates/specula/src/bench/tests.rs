//! `bench serve` end to end against a fake OpenAI-compatible server (axum on 127.0.0.1:0) that
//! streams a known number of chunks with known delays, so counts are exact and times have floors.

use super::serve::{benchmark, run, BenchServeArgs};
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Parser;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What the fake server does for every generation request.
#[derive(Clone)]
struct Fake {
    /// Text chunks per response, each sent after `delay`.
    chunks: usize,
    /// Tokens each chunk stands for in `usage` (2 = two tokens per chunk, as with speculation).
    tokens_per_chunk: usize,
    delay: Duration,
    /// Send a usage chunk (with spec_decode counters) before [DONE].
    usage: bool,
    /// Answer every generation request with 400 instead.
    reject: bool,
    seen: Arc<Seen>,
}

/// What the fake server observed.
#[derive(Default)]
struct Seen {
    bodies: Mutex<Vec<Value>>,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    /// Requests whose stream ran to the end; drives the /metrics counters.
    finished: AtomicUsize,
}

const PROMPT_TOKENS: usize = 11;

impl Fake {
    fn streaming(chunks: usize, tokens_per_chunk: usize, delay_ms: u64, usage: bool) -> Fake {
        Fake { chunks, tokens_per_chunk, delay: Duration::from_millis(delay_ms), usage, reject: false, seen: Arc::default() }
    }

    fn bodies(&self) -> Vec<Value> {
        self.seen.bodies.lock().expect("no test thread panicked holding the lock").clone()
    }
}

/// Counts a request in flight until its response stream is dropped.
struct InFlight(Arc<Seen>);

impl InFlight {
    fn enter(seen: &Arc<Seen>) -> InFlight {
        let now = seen.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        seen.max_in_flight.fetch_max(now, Ordering::SeqCst);
        InFlight(seen.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

fn event(v: Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

async fn generate(State(f): State<Fake>, Json(body): Json<Value>) -> Response {
    f.seen.bodies.lock().expect("no test thread panicked holding the lock").push(body.clone());
    if f.reject {
        return (StatusCode::BAD_REQUEST, Json(json!({"error": {"message": "model 'nope' not found", "type": "invalid_request_error"}}))).into_response();
    }
    let chat = body.get("messages").is_some();
    let guard = InFlight::enter(&f.seen);
    // Chat streams open with a role chunk that carries no text: it must not count as the first token.
    let opening = chat.then(|| event(json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})));
    let stream = futures::stream::unfold((0usize, Some(guard)), move |(i, guard)| {
        let f = f.clone();
        async move {
            if i < f.chunks {
                tokio::time::sleep(f.delay).await;
                let choice = if chat { json!({"index": 0, "delta": {"content": "ab "}}) } else { json!({"index": 0, "text": "ab "}) };
                Some((Ok::<_, Infallible>(event(json!({"choices": [choice]}))), (i + 1, guard)))
            } else if i == f.chunks {
                let mut tail = Vec::new();
                if f.usage {
                    let n = f.chunks * f.tokens_per_chunk;
                    let spec = json!({"num_drafts": 3, "num_draft_tokens": 9, "num_accepted_tokens": 5});
                    tail.extend_from_slice(&event(json!({"choices": [], "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": n, "total_tokens": PROMPT_TOKENS + n, "spec_decode": spec}})));
                }
                tail.extend_from_slice(b"data: [DONE]\n\n");
                f.seen.finished.fetch_add(1, Ordering::SeqCst);
                // Out of flight before the client can see [DONE] and send its next request.
                drop(guard);
                Some((Ok(Bytes::from(tail)), (i + 1, None)))
            } else {
                None
            }
        }
    });
    let body = Body::from_stream(futures::StreamExt::chain(futures::stream::iter(opening.map(Ok)), stream));
    ([("content-type", "text/event-stream")], body).into_response()
}

async fn models() -> Json<Value> {
    Json(json!({"object": "list", "data": [{"id": "fake-model", "object": "model"}]}))
}

/// vLLM-style counters: every finished request drafted 9 tokens.
async fn metrics(State(f): State<Fake>) -> String {
    let n = f.seen.finished.load(Ordering::SeqCst);
    format!("# TYPE fake:spec_decode_num_draft_tokens_total counter\nfake:spec_decode_num_draft_tokens_total{{engine=\"0\"}} {}\n", 9 * n)
}

/// Serves `f` on a free local port; returns its base URL.
async fn start(f: Fake) -> String {
    let app = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/completions", post(generate))
        .route("/v1/chat/completions", post(generate))
        .route("/metrics", get(metrics))
        .with_state(f);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a free local port");
    let addr = listener.local_addr().expect("a bound listener has an address");
    // Without TCP_NODELAY, Nagle's algorithm holds small SSE chunks back (adding ~40 ms to TTFT
    // and merging chunks), as it would in any streaming server that forgets it.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: BenchServeArgs,
}

fn args(list: &[&str]) -> BenchServeArgs {
    Cli::try_parse_from(std::iter::once("bench").chain(list.iter().copied())).expect("test flags parse").args
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_requests_are_counted_and_timed_at_concurrency_2() {
    let fake = Fake::streaming(4, 2, 20, true);
    let url = start(fake.clone()).await;
    let a = args(&[
        "--base-url",
        &url,
        "--max-concurrency",
        "2",
        "--num-prompts",
        "6",
        "--random-input-len",
        "8",
        "--random-output-len",
        "8",
        "--save-detailed",
        "--no-progress",
        "--label",
        "fake",
    ]);
    let report = benchmark(&a).await.unwrap();

    assert_eq!(report.results.len(), 1);
    let r = &report.results[0];
    assert_eq!((r.max_concurrency, r.completed, r.failed), (Some(2), 6, 0));
    assert_eq!(r.total_output_tokens, 6 * 4 * 2, "output tokens come from usage, not the chunk count");
    assert_eq!(r.total_input_tokens, 6 * PROMPT_TOKENS);
    assert_eq!(r.output_tokens_counted_as_chunks, 0);
    assert_eq!(fake.seen.max_in_flight.load(Ordering::SeqCst), 2);
    for o in r.requests.as_ref().unwrap() {
        assert!(o.ttft_s >= 0.020, "TTFT {} s is below the injected 20 ms delay", o.ttft_s);
        assert!(o.e2e_s >= 0.080, "E2E {} s is below 4 chunks x 20 ms", o.e2e_s);
        assert_eq!(o.itl_s.len(), 3, "one gap per pair of chunks, though each chunk is 2 tokens");
        assert!((o.tpot_s().unwrap() - (o.e2e_s - o.ttft_s) / 7.0).abs() < 1e-12);
    }
    assert!(r.ttft_ms.unwrap().p50 >= 20.0);
    assert_eq!(r.itl_ms.unwrap().count, 18);
    assert_eq!(r.tpot_ms.unwrap().count, 6);
    assert!(r.duration_s >= 3.0 * 0.080, "6 requests, 2 at a time, 80 ms each");

    let spec = r.spec_decode.as_ref().expect("the usage chunks carried spec_decode");
    assert_eq!(spec.counters["num_draft_tokens"], 54.0);
    assert_eq!(spec.acceptance_rate, Some(30.0 / 54.0));
    assert_eq!(spec.mean_acceptance_length, Some(1.0 + 30.0 / 18.0));
    let from_metrics = r.spec_decode_metrics.as_ref().expect("/metrics has spec_decode counters");
    assert_eq!(from_metrics.counters["num_draft_tokens"], 54.0);

    let bodies = fake.bodies();
    assert_eq!(bodies.len(), 6);
    let b = &bodies[0];
    assert_eq!(b["model"], "fake-model", "the model defaults to the first of /v1/models");
    assert_eq!((b["max_tokens"].as_u64(), b["min_tokens"].as_u64(), b["ignore_eos"].as_bool()), (Some(8), Some(8), Some(true)));
    assert_eq!((b["stream"].as_bool(), b["stream_options"]["include_usage"].as_bool()), (Some(true), Some(true)));
    assert_eq!(b["prompt"].as_str().unwrap().split(' ').count(), 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_sweep_without_usage_counts_chunks_per_level() {
    let fake = Fake::streaming(4, 1, 5, false);
    let url = start(fake.clone()).await;
    let a = args(&[
        "--base-url",
        &url,
        "--endpoint",
        "/v1/chat/completions",
        "--model",
        "m2",
        "--max-concurrency",
        "1,3",
        "--num-prompts",
        "6",
        "--random-input-len",
        "5",
        "--random-output-len",
        "4",
        "--extra-body",
        r#"{"top_k": 1, "temperature": 0.5}"#,
        "--no-progress",
    ]);
    let report = benchmark(&a).await.unwrap();

    let levels: Vec<_> = report.results.iter().map(|r| (r.max_concurrency, r.completed, r.failed, r.total_output_tokens)).collect();
    assert_eq!(levels, vec![(Some(1), 6, 0, 24), (Some(3), 6, 0, 24)]);
    for r in &report.results {
        assert_eq!(r.output_tokens_counted_as_chunks, 6);
        assert_eq!(r.total_input_tokens, 6 * 5, "no usage: input tokens are the prompt word counts");
        assert!(r.spec_decode.is_none());
        assert!(r.ttft_ms.unwrap().p50 >= 5.0, "the empty role chunk is not the first token");
    }
    assert_eq!(fake.seen.max_in_flight.load(Ordering::SeqCst), 3);
    let bodies = fake.bodies();
    assert_eq!(bodies.len(), 12, "the same 6 prompts at each level");
    assert_eq!(bodies[0]["messages"][0]["role"], "user");
    assert_eq!(bodies[0]["model"], "m2");
    assert_eq!((bodies[0]["top_k"].as_u64(), bodies[0]["temperature"].as_f64()), (Some(1), Some(0.5)), "--extra-body keys win");
    assert_eq!(report.config["max_concurrency"], json!([1, 3]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_requests_are_counted_as_failures_with_the_server_message() {
    let fake = Fake { reject: true, ..Fake::streaming(1, 1, 0, true) };
    let url = start(fake.clone()).await;
    let out = tempfile::NamedTempFile::new().unwrap();
    let path = out.path().to_str().unwrap();
    let a = args(&[
        "--base-url",
        &url,
        "--model",
        "nope",
        "--max-concurrency",
        "2",
        "--num-prompts",
        "6",
        "--random-input-len",
        "4",
        "--random-output-len",
        "4",
        "--no-progress",
        "--label",
        "bad",
        "--output-json",
        path,
    ]);
    run(a).await.expect("failed requests are results, not errors");

    let j: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(j["label"], "bad");
    assert_eq!(j["config"]["model"], "nope");
    let r = &j["results"][0];
    assert_eq!((r["completed"].as_u64(), r["failed"].as_u64()), (Some(0), Some(6)));
    assert_eq!(r["errors"], json!([{"message": "HTTP 400: model 'nope' not found", "count": 6}]));
    assert!(r["ttft_ms"].is_null() && r["e2e_ms"].is_null());
    assert_eq!(r["request_throughput"].as_f64(), Some(0.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_server_fails_each_request_not_the_benchmark() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let a = args(&[
        "--base-url",
        &format!("http://127.0.0.1:{port}"),
        "--model",
        "m",
        "--num-prompts",
        "3",
        "--random-input-len",
        "4",
        "--random-output-len",
        "4",
        "--no-progress",
    ]);
    let r = &benchmark(&a).await.unwrap().results[0];
    assert_eq!((r.completed, r.failed, r.max_concurrency), (0, 3, None));
    assert_eq!(r.errors.iter().map(|e| e.count).sum::<usize>(), 3);
    assert!(r.spec_decode_metrics.is_none());
}

#[tokio::test]
async fn bad_flags_are_reported_before_any_request() {
    let cases: &[(&[&str], &str)] = &[
        (&["--base-url", "https://api.example.com"], "https is not supported"),
        (&["--endpoint", "/v1/embeddings"], "only /v1/completions and /v1/chat/completions"),
        (&["--extra-body", "[1]"], "--extra-body must be a JSON object"),
        (&["--extra-body", "{oops"], "--extra-body is not valid JSON"),
        (&["--max-concurrency", "4,0"], "each level must be at least 1"),
        (&["--request-rate", "0"], "--request-rate 0 must be positive"),
        (&["--dataset", "file"], "--dataset file needs --dataset-path"),
    ];
    for (flags, expected) in cases {
        let mut all = vec!["--model", "m", "--no-progress"];
        all.extend_from_slice(flags);
        let e = benchmark(&args(&all)).await.unwrap_err().to_string();
        assert!(e.contains(expected), "{flags:?}: {e}");
    }
}
