//! HTTP handlers, one file per OpenAI resource; `/health` lives here (it has no body to speak of).

pub mod chat;
pub mod completions;
pub mod models;
pub mod tokenize;

use axum::http::StatusCode;

/// `GET /health`: 200 with an empty body while the server is up (vLLM's behaviour). Never behind auth.
pub async fn health() -> StatusCode {
    StatusCode::OK
}

/// JSON has no -inf; like vLLM, impossible tokens are reported at -9999.
pub(crate) fn clamp_logprob(logprob: f32) -> f32 {
    logprob.max(-9999.0)
}
