//! Every failure the server reports, as an OpenAI error object
//! (`{"error": {"message", "type", "param", "code"}}`) with its HTTP status.
//! Not for engine-side errors in a running stream: those become an SSE error event (see `sse.rs`),
//! built from the same body type.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use specula_engine::api::InvalidParam;
use specula_engine::handle::SubmitError;

/// An error on its way to the client. Build it with the constructors, which pick the status and
/// the OpenAI `type`/`code` together so they never disagree.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `server_error`, `internal_error`, ...
    pub kind: &'static str,
    /// The request field at fault, spelled as the API spells it.
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

/// The JSON body: `{"error": {...}}`.
#[derive(Debug, Serialize)]
pub struct ErrorBody<'a> {
    pub error: ErrorDetail<'a>,
}

#[derive(Debug, Serialize)]
pub struct ErrorDetail<'a> {
    pub message: &'a str,
    #[serde(rename = "type")]
    pub kind: &'a str,
    pub param: Option<&'a str>,
    pub code: Option<&'a str>,
}

impl ApiError {
    /// 400: the request is malformed or a value is out of range.
    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> Self {
        Self { status: StatusCode::BAD_REQUEST, message: message.into(), kind: "invalid_request_error", param: param.map(str::to_string), code: None }
    }

    /// 400 naming one field.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        Self::invalid(Some(param), message)
    }

    /// 404 for a `model` that this server does not serve.
    pub fn model_not_found(requested: &str, served: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{requested}` does not exist; this server serves `{served}`"),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    /// 404 for a path that has no route.
    pub fn route_not_found(path: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("no route for {path}; see /v1/models, /v1/completions, /v1/chat/completions"),
            kind: "invalid_request_error",
            param: None,
            code: Some("not_found"),
        }
    }

    pub fn method_not_allowed() -> Self {
        Self {
            status: StatusCode::METHOD_NOT_ALLOWED,
            message: "method not allowed on this path".into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("method_not_allowed"),
        }
    }

    /// 401: the Bearer key is missing or wrong.
    pub fn unauthorized() -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            message: "missing or invalid API key: send `Authorization: Bearer <key>` or `x-api-key: <key>` with the server's --api-key".into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    /// 413: the body exceeds the server's limit.
    pub fn payload_too_large(limit: usize) -> Self {
        Self {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!("request body is larger than the server's limit of {limit} bytes"),
            kind: "invalid_request_error",
            param: None,
            code: Some("payload_too_large"),
        }
    }

    /// 503 `overloaded`: the server cannot take this work now; retrying later may succeed.
    pub fn overloaded(message: impl Into<String>) -> Self {
        Self { status: StatusCode::SERVICE_UNAVAILABLE, message: message.into(), kind: "server_error", param: None, code: Some("overloaded") }
    }

    /// 500: the engine failed this request.
    pub fn internal(message: impl Into<String>) -> Self {
        Self { status: StatusCode::INTERNAL_SERVER_ERROR, message: message.into(), kind: "internal_error", param: None, code: None }
    }

    pub fn body(&self) -> ErrorBody<'_> {
        ErrorBody { error: ErrorDetail { message: &self.message, kind: self.kind, param: self.param.as_deref(), code: self.code } }
    }
}

impl From<InvalidParam> for ApiError {
    fn from(e: InvalidParam) -> Self {
        Self::invalid_param(e.param, e.message)
    }
}

impl From<SubmitError> for ApiError {
    /// Both a full queue and a stopping engine are "try again later" (503).
    fn from(e: SubmitError) -> Self {
        let code = match e {
            SubmitError::QueueFull { .. } => "overloaded",
            SubmitError::Closed => "shutting_down",
        };
        Self { status: StatusCode::SERVICE_UNAVAILABLE, message: e.to_string(), kind: "server_error", param: None, code: Some(code) }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, axum::Json(self.body())).into_response();
        let headers = resp.headers_mut();
        if self.status == StatusCode::UNAUTHORIZED {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_has_the_openai_shape() {
        let e = ApiError::invalid_param("temperature", "temperature must be >= 0, got -1");
        let v = serde_json::to_value(e.body()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"error": {"message": "temperature must be >= 0, got -1",
                "type": "invalid_request_error", "param": "temperature", "code": null}})
        );
    }

    #[test]
    fn queue_full_is_503() {
        let e: ApiError = SubmitError::QueueFull { waiting: 3, limit: 3 }.into();
        assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(e.code, Some("overloaded"));
    }
}
