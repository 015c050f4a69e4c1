//! One benchmark request: POST a JSON body, read the SSE stream (or a plain JSON reply from a server
//! that ignores `stream`), and time it. Never fails the benchmark: any problem (refused connection,
//! non-2xx status, an `error` object in the stream, a body with no text) becomes this request's
//! `error`. What the timings mean is in [`RequestOutcome`].

use super::spec::{self, SpecCounters};
use super::sse::SseDecoder;
use futures::StreamExt;
use serde::Serialize;
use serde_json::Value;
use std::time::Instant;

/// Where requests go.
pub struct Endpoint {
    /// base URL + endpoint path, e.g. `http://127.0.0.1:8000/v1/completions`.
    pub url: String,
    pub api_key: Option<String>,
}

/// What one request measured. Times are in seconds from just before the request was sent.
#[derive(Debug, Clone, Serialize)]
pub struct RequestOutcome {
    /// Why the request failed; `None` when it succeeded (then every field below is filled).
    pub error: Option<String>,
    /// `usage.prompt_tokens`, else the workload's word-count estimate.
    pub prompt_tokens: usize,
    /// `usage.completion_tokens`, else the number of chunks that carried text.
    pub output_tokens: usize,
    /// False when `output_tokens` is a chunk count because the server sent no usage.
    pub output_tokens_from_usage: bool,
    /// Time to the first chunk with non-empty text.
    pub ttft_s: f64,
    /// Time to the end of the response.
    pub e2e_s: f64,
    /// Gaps between successive chunks with text: a chunk carrying several tokens (speculation,
    /// detokenizer hold-back) is one gap, so there can be fewer gaps than tokens.
    pub itl_s: Vec<f64>,
    /// Speculative-decoding counters the server reported in the response, if any.
    pub spec: SpecCounters,
}

impl RequestOutcome {
    /// (e2e - ttft) / (output_tokens - 1): time per output token after the first; `None` for a
    /// failed request or one with a single output token.
    pub fn tpot_s(&self) -> Option<f64> {
        (self.error.is_none() && self.output_tokens > 1).then(|| (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) as f64)
    }
}

/// Sends `body` and measures the response; see the module docs for how failures are reported.
pub async fn send(client: &reqwest::Client, endpoint: &Endpoint, body: String, approx_prompt_tokens: usize) -> RequestOutcome {
    let mut rec = Recorder { start: Instant::now(), text_at: Vec::new(), prompt_tokens: None, output_tokens: None, spec: SpecCounters::new() };
    let result = exchange(client, endpoint, body, &mut rec).await;
    rec.outcome(Instant::now(), approx_prompt_tokens, result.err())
}

async fn exchange(client: &reqwest::Client, endpoint: &Endpoint, body: String, rec: &mut Recorder) -> Result<(), String> {
    let mut req = client.post(&endpoint.url).header(reqwest::header::CONTENT_TYPE, "application/json").body(body);
    if let Some(key) = &endpoint.api_key {
        req = req.bearer_auth(key);
    }
    let resp = req.send().await.map_err(|e| error_chain(&e))?;
    let status = resp.status();
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        return Err(format!("HTTP {}: {}", status.as_u16(), error_text(&text)));
    }
    let is_sse = resp.headers().get(reqwest::header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|v| v.starts_with("text/event-stream"));
    if !is_sse {
        let text = resp.text().await.map_err(|e| error_chain(&e))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| format!("reply is neither an event stream nor JSON ({e}): {}", clip(&text)))?;
        return rec.chunk(&v, Instant::now());
    }
    let mut decoder = SseDecoder::default();
    let mut stream = resp.bytes_stream();
    while let Some(bytes) = stream.next().await {
        let bytes = bytes.map_err(|e| format!("stream broken after {} text chunks: {}", rec.text_at.len(), error_chain(&e)))?;
        let now = Instant::now();
        for data in decoder.feed(&bytes) {
            if rec.data(&data, now)? {
                return Ok(());
            }
        }
    }
    for data in decoder.finish() {
        rec.data(&data, Instant::now())?;
    }
    Ok(())
}

/// What has been seen of one response so far.
struct Recorder {
    start: Instant,
    /// Arrival time of each chunk that carried text.
    text_at: Vec<Instant>,
    prompt_tokens: Option<usize>,
    output_tokens: Option<usize>,
    spec: SpecCounters,
}

impl Recorder {
    /// One SSE event's data; `Ok(true)` at `[DONE]`.
    fn data(&mut self, data: &str, at: Instant) -> Result<bool, String> {
        if data.trim() == "[DONE]" {
            return Ok(true);
        }
        let v: Value = serde_json::from_str(data).map_err(|e| format!("stream event is not JSON ({e}): {}", clip(data)))?;
        self.chunk(&v, at)?;
        Ok(false)
    }

    fn chunk(&mut self, v: &Value, at: Instant) -> Result<(), String> {
        if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
            return Err(format!("error in stream: {}", error_value_text(err)));
        }
        if chunk_has_text(v) {
            self.text_at.push(at);
        }
        let usage = &v["usage"];
        if let Some(n) = usage["prompt_tokens"].as_u64() {
            self.prompt_tokens = Some(n as usize);
        }
        if let Some(n) = usage["completion_tokens"].as_u64() {
            self.output_tokens = Some(n as usize);
        }
        spec::read_chunk(v, &mut self.spec);
        Ok(())
    }

    fn outcome(self, end: Instant, approx_prompt_tokens: usize, error: Option<String>) -> RequestOutcome {
        let secs = |t: Instant| t.duration_since(self.start).as_secs_f64();
        let error = error.or_else(|| self.text_at.is_empty().then(|| "response finished without any text".to_string()));
        RequestOutcome {
            prompt_tokens: self.prompt_tokens.unwrap_or(approx_prompt_tokens),
            output_tokens: self.output_tokens.unwrap_or(self.text_at.len()),
            output_tokens_from_usage: self.output_tokens.is_some(),
            ttft_s: self.text_at.first().map_or(0.0, |&t| secs(t)),
            e2e_s: secs(end),
            itl_s: self.text_at.windows(2).map(|w| w[1].duration_since(w[0]).as_secs_f64()).collect(),
            spec: self.spec,
            error,
        }
    }
}

/// Whether any choice carries output text: completions `text`, chat `delta.content` (or the
/// reasoning fields servers add), or a non-streamed chat `message.content`.
fn chunk_has_text(v: &Value) -> bool {
    let Some(choices) = v["choices"].as_array() else { return false };
    choices.iter().any(|c| {
        [&c["text"], &c["delta"]["content"], &c["delta"]["reasoning_content"], &c["delta"]["reasoning"], &c["message"]["content"]]
            .iter()
            .any(|t| t.as_str().is_some_and(|s| !s.is_empty()))
    })
}

/// The message in an error body: OpenAI `{"error": {"message"}}`, `{"error": "..."}`,
/// FastAPI `{"detail"}`, `{"message"}`, else the text itself, clipped.
fn error_text(body: &str) -> String {
    match serde_json::from_str::<Value>(body) {
        Ok(v) if v.get("error").is_some() => error_value_text(&v["error"]),
        Ok(v) if v.get("detail").is_some() => error_value_text(&v["detail"]),
        Ok(v) if v["message"].is_string() => error_value_text(&v["message"]),
        _ if body.trim().is_empty() => "(empty body)".to_string(),
        _ => clip(body.trim()),
    }
}

fn error_value_text(e: &Value) -> String {
    match e {
        Value::String(s) => clip(s),
        _ => match e["message"].as_str() {
            Some(m) => clip(m),
            None => clip(&e.to_string()),
        },
    }
}

fn clip(s: &str) -> String {
    const MAX: usize = 300;
    match s.char_indices().nth(MAX) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

/// An error and its causes on one line: reqwest's own message hides the cause ("connection refused").
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        cause = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn text_is_found_in_completion_and_chat_chunks_but_not_in_role_or_usage_chunks() {
        assert!(chunk_has_text(&json!({"choices": [{"index": 0, "text": " the"}]})));
        assert!(chunk_has_text(&json!({"choices": [{"delta": {"content": "Hi"}}]})));
        assert!(chunk_has_text(&json!({"choices": [{"message": {"content": "Hi"}}]})));
        assert!(!chunk_has_text(&json!({"choices": [{"delta": {"role": "assistant", "content": ""}}]})));
        assert!(!chunk_has_text(&json!({"choices": [], "usage": {"completion_tokens": 3}})));
    }

    #[test]
    fn error_bodies_give_their_message() {
        assert_eq!(error_text(r#"{"error": {"message": "model not found", "type": "invalid_request_error"}}"#), "model not found");
        assert_eq!(error_text(r#"{"error": "bad"}"#), "bad");
        assert_eq!(error_text(r#"{"detail": "Not Found"}"#), "Not Found");
        assert_eq!(error_text("plain text\n"), "plain text");
        assert_eq!(error_text(""), "(empty body)");
    }

    #[test]
    fn outcome_times_text_chunks_and_prefers_usage_counts() {
        let start = Instant::now();
        let ms = |n| start + std::time::Duration::from_millis(n);
        let mut r = Recorder { start, text_at: Vec::new(), prompt_tokens: None, output_tokens: None, spec: SpecCounters::new() };
        r.data(r#"{"choices": [{"delta": {"role": "assistant", "content": ""}}]}"#, ms(5)).unwrap();
        r.data(r#"{"choices": [{"delta": {"content": "a"}}]}"#, ms(10)).unwrap();
        r.data(r#"{"choices": [{"delta": {"content": "bc"}}]}"#, ms(30)).unwrap();
        r.data(r#"{"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}}"#, ms(31)).unwrap();
        assert!(r.data("[DONE]", ms(31)).unwrap());
        let o = r.outcome(ms(50), 99, None);
        assert_eq!(o.error, None);
        assert_eq!((o.prompt_tokens, o.output_tokens, o.output_tokens_from_usage), (7, 5, true));
        assert!((o.ttft_s - 0.010).abs() < 1e-9 && (o.e2e_s - 0.050).abs() < 1e-9);
        assert_eq!(o.itl_s.len(), 1);
        assert!((o.itl_s[0] - 0.020).abs() < 1e-9);
        assert!((o.tpot_s().unwrap() - 0.040 / 4.0).abs() < 1e-9);
    }

    #[test]
    fn stream_error_and_empty_response_fail_the_request() {
        let start = Instant::now();
        let mut r = Recorder { start, text_at: Vec::new(), prompt_tokens: None, output_tokens: None, spec: SpecCounters::new() };
        let e = r.data(r#"{"error": {"message": "out of KV blocks"}}"#, start).unwrap_err();
        assert_eq!(e, "error in stream: out of KV blocks");
        let empty = Recorder { start, text_at: Vec::new(), prompt_tokens: None, output_tokens: None, spec: SpecCounters::new() };
        let o = empty.outcome(start, 3, None);
        assert_eq!(o.error.as_deref(), Some("response finished without any text"));
        assert_eq!(o.tpot_s(), None);
    }
}
