//! API-key auth for the `/v1` routes (and vLLM's tokenizer routes) when `--api-key` is set.
//! Several keys may be given; each is a tenant ([`Tenant`] `i + 1` for the i-th key, 0 without
//! keys), which the handlers pass on with the request: what the engine learns from one tenant's
//! requests (speculation's cross-request index) and the responses one stores are never served to
//! another. The key comes as `Authorization: Bearer <key>` (OpenAI's clients; the scheme in any case) or
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
use specula_engine::types::Tenant;

/// Refuses a request without one of the keys (when keys are set) and tags it with its tenant
/// (an `Extension<Tenant>` for the handlers).
pub async fn require_api_key(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    let keys = &state.config.api_keys;
    let tenant = if keys.is_empty() {
        Tenant::default()
    } else {
        match matching_key(req.headers(), keys) {
            Some(i) => Tenant(i as u32 + 1),
            None => return ApiError::unauthorized().into_response(),
        }
    };
    req.extensions_mut().insert(tenant);
    next.run(req).await
}

/// Which of `keys` the request offers (the first, where it offers several), every key compared
/// in full whatever matched, so the time taken does not tell which.
fn matching_key(headers: &HeaderMap, keys: &[String]) -> Option<usize> {
    let mut found = None;
    for sent in sent_keys(headers) {
        for (i, key) in keys.iter().enumerate() {
            if keys_match(sent, key) && found.is_none() {
                found = Some(i);
            }
        }
    }
    found
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

    #[test]
    fn each_key_is_its_own_tenant() {
        let keys = ["sk-a".to_string(), "sk-b".to_string()];
        let offered = |v: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(AUTHORIZATION, HeaderValue::from_static(v));
            matching_key(&h, &keys)
        };
        assert_eq!(offered("Bearer sk-a"), Some(0));
        assert_eq!(offered("Bearer sk-b"), Some(1));
        assert_eq!(offered("Bearer sk-c"), None);
    }
}
