//! API-key auth for the `/v1` routes (and vLLM's tokenizer routes) when `--api-key` is set.
//! The key comes as `Authorization: Bearer <key>` (OpenAI's clients; the scheme in any case) or
//! as `x-api-key: <key>` (Anthropic's clients, which also send `anthropic-version`, accepted
//! whatever its value). `/health` and `/metrics` stay open (as in vLLM) so probes and scrapers
//! need no secret.
//!
//! Keys are compared as SHA-256 digests with a constant-time equality: the time taken reveals
//! neither how much of the key matched nor how long it is.

use crate::error::ApiError;
use crate::AppState;
use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::http::HeaderMap;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};

pub async fn require_api_key(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(key) = &state.config.api_key {
        if !sent_keys(req.headers()).any(|sent| keys_match(sent, key)) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

/// The keys a request offers: the Bearer token (scheme matched case-insensitively) and `x-api-key`.
fn sent_keys(headers: &HeaderMap) -> impl Iterator<Item = &str> {
    let bearer = headers.get(AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| {
        let (scheme, token) = v.trim().split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
    });
    let x_api_key = headers.get("x-api-key").and_then(|v| v.to_str().ok()).map(str::trim);
    bearer.into_iter().chain(x_api_key)
}

/// Whether `sent` is the key: their SHA-256 digests (same length whatever the inputs) compared
/// without stopping at the first difference.
fn keys_match(sent: &str, key: &str) -> bool {
    let (a, b) = (Sha256::digest(sent.as_bytes()), Sha256::digest(key.as_bytes()));
    let diff = a.iter().zip(b.iter()).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn compares_whole_keys() {
        assert!(keys_match("sk-abc", "sk-abc"));
        assert!(!keys_match("sk-abd", "sk-abc"));
        assert!(!keys_match("sk-ab", "sk-abc"));
        assert!(!keys_match("", "sk-abc"));
    }

    #[test]
    fn bearer_in_any_case_and_x_api_key_are_read() {
        let keys = |pairs: &[(&'static str, &'static str)]| {
            let mut h = HeaderMap::new();
            for (k, v) in pairs {
                h.insert(*k, HeaderValue::from_static(v));
            }
            sent_keys(&h).map(str::to_string).collect::<Vec<_>>()
        };
        assert_eq!(keys(&[("authorization", "Bearer sk-1")]), ["sk-1"]);
        assert_eq!(keys(&[("authorization", "bearer  sk-1 ")]), ["sk-1"]);
        assert_eq!(keys(&[("authorization", "BEARER sk-1")]), ["sk-1"]);
        assert_eq!(keys(&[("authorization", "Basic sk-1")]), Vec::<String>::new());
        assert_eq!(keys(&[("x-api-key", "sk-2"), ("anthropic-version", "2023-06-01")]), ["sk-2"]);
        assert_eq!(keys(&[("authorization", "Bearer a"), ("x-api-key", "b")]), ["a", "b"]);
    }
}
