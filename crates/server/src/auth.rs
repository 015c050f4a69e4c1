//! Bearer-token auth for the `/v1` routes when `--api-key` is set. `/health` and `/metrics`
//! stay open (as in vLLM) so probes and scrapers need no secret.

use crate::error::ApiError;
use crate::AppState;
use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

pub async fn require_api_key(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(key) = &state.config.api_key {
        let sent = req.headers().get(AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer ")).map(str::trim);
        if !sent.is_some_and(|s| constant_time_eq(s.as_bytes(), key.as_bytes())) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

/// Compares without stopping at the first differing byte, so timing does not reveal the key.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::constant_time_eq;

    #[test]
    fn compares_whole_keys() {
        assert!(constant_time_eq(b"sk-abc", b"sk-abc"));
        assert!(!constant_time_eq(b"sk-abd", b"sk-abc"));
        assert!(!constant_time_eq(b"sk-ab", b"sk-abc"));
    }
}
