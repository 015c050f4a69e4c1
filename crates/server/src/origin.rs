//! Browser pages must not drive a local server: with no `--api-key`, a request whose `Origin`
//! header names anything but a loopback address (`http://localhost:3000`, `http://127.0.0.1`,
//! `http://[::1]:8080`) is refused with 403, unless `--allowed-origins` lists it (`*` allows
//! every origin). Requests without `Origin` (curl, SDKs, other servers) are not browsers' and
//! pass. With an API key the key is the guard and every origin passes (a page cannot read it).
//!
//! Not CORS: no preflight answers and no `Access-Control-*` headers are written here.

use crate::error::ApiError;
use crate::AppState;
use axum::extract::{Request, State};
use axum::http::header::ORIGIN;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

pub async fn require_local_origin(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if state.config.api_keys.is_empty() {
        if let Some(origin) = req.headers().get(ORIGIN) {
            let origin = origin.to_str().unwrap_or_default();
            if !origin_allowed(origin, &state.config.allowed_origins) {
                return forbidden(origin).into_response();
            }
        }
    }
    next.run(req).await
}

/// Whether a request from `origin` may use a server without an API key.
pub fn origin_allowed(origin: &str, allowed: &[String]) -> bool {
    is_loopback(origin) || allowed.iter().any(|a| a == "*" || a.trim_end_matches('/').eq_ignore_ascii_case(origin))
}

/// `scheme://host[:port]` with a loopback host. Anything else (`null`, a file page, a name that
/// merely starts with `localhost`) is not.
fn is_loopback(origin: &str) -> bool {
    let Some((scheme, rest)) = origin.split_once("://") else { return false };
    if !matches!(scheme.to_ascii_lowercase().as_str(), "http" | "https") || rest.contains('/') {
        return false;
    }
    let host = match rest.strip_prefix('[') {
        // IPv6: [::1] or [::1]:port
        Some(v6) => match v6.split_once(']') {
            Some((addr, port)) if port.is_empty() || port.strip_prefix(':').is_some_and(is_port) => addr,
            _ => return false,
        },
        None => match rest.rsplit_once(':') {
            Some((host, port)) if is_port(port) => host,
            Some(_) => return false,
            None => rest,
        },
    };
    host.eq_ignore_ascii_case("localhost") || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

fn is_port(s: &str) -> bool {
    !s.is_empty() && s.parse::<u16>().is_ok()
}

fn forbidden(origin: &str) -> ApiError {
    ApiError {
        status: StatusCode::FORBIDDEN,
        message: format!(
            "requests from the web page at origin '{origin}' are refused: this server has no --api-key, so only pages on this machine's loopback address may use it; start it with --allowed-origins {origin} (or an --api-key) to allow them"
        ),
        kind: "invalid_request_error",
        param: None,
        code: Some("origin_not_allowed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_origins_pass_and_others_do_not() {
        for ok in
            ["http://localhost", "http://localhost:3000", "https://127.0.0.1:8000", "http://127.1.2.3", "http://[::1]", "http://[::1]:8080", "HTTP://LOCALHOST"]
        {
            assert!(is_loopback(ok), "{ok}");
        }
        for bad in [
            "null",
            "http://evil.example",
            "http://localhost.evil.example",
            "http://127.0.0.1.evil.example",
            "http://[::2]",
            "file://",
            "http://localhost:99999",
            "http://localhost:3000/x",
            "http://0.0.0.0",
            "ftp://localhost",
        ] {
            assert!(!is_loopback(bad), "{bad}");
        }
    }

    #[test]
    fn allowed_origins_open_named_origins_or_all() {
        let allowed = vec!["https://app.example".to_string()];
        assert!(origin_allowed("https://app.example", &allowed));
        assert!(!origin_allowed("https://other.example", &allowed));
        assert!(origin_allowed("https://other.example", &["*".to_string()]));
        assert!(!origin_allowed("https://other.example", &[]));
    }
}
