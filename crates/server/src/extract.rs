//! `ApiJson<T>`: the JSON body extractor for every route. Unlike `axum::Json` it answers malformed
//! JSON, wrong types and oversized bodies with OpenAI error objects (naming the offending field),
//! so axum's plain-text rejections never reach a client. It does not insist on a Content-Type:
//! some clients omit it, and the body is JSON or an error either way.

use crate::error::ApiError;
use crate::AppState;
use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use serde::de::DeserializeOwned;

pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
            if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::payload_too_large(state.config.max_body_bytes)
            } else {
                ApiError::invalid(None, format!("cannot read the request body: {}", rejection.body_text()))
            }
        })?;
        parse_json(&bytes).map(ApiJson)
    }
}

/// Parses a whole body; a type error names its field path (`messages[0].content`) as `param`.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    // serde's derived structs also accept a JSON array (fields by position), so `["m", "hi"]`
    // would pass as a request; every body of this API is an object.
    match bytes.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'{') => {}
        Some(_) => return Err(ApiError::invalid(None, "the request body must be a JSON object")),
        None => return Err(ApiError::invalid(None, "the request body is empty; send a JSON object")),
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value: T = serde_path_to_error::deserialize(&mut de).map_err(|err| {
        let path = err.path().to_string();
        let inner = err.into_inner();
        match inner.classify() {
            serde_json::error::Category::Data if path != "." => ApiError::invalid(Some(&path), format!("invalid value for `{path}`: {inner}")),
            serde_json::error::Category::Data => ApiError::invalid(None, format!("invalid request: {inner}")),
            _ => ApiError::invalid(None, format!("request body is not valid JSON: {inner}")),
        }
    })?;
    de.end().map_err(|e| ApiError::invalid(None, format!("request body is not valid JSON: {e}")))?;
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug)]
    struct Req {
        #[allow(dead_code)]
        temperature: Option<f32>,
    }

    #[test]
    fn wrong_type_names_the_field() {
        let e = parse_json::<Req>(br#"{"temperature": "hot"}"#).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("temperature"));
        assert!(e.message.contains("invalid value for `temperature`"), "{}", e.message);
    }

    #[test]
    fn only_objects_are_bodies() {
        for body in [&b"[1, 2]"[..], b"[null, 0.5]", b"\"x\"", b"3", b"  "] {
            let e = parse_json::<Req>(body).unwrap_err();
            assert_eq!((e.status, e.param.as_deref()), (StatusCode::BAD_REQUEST, None), "{body:?}");
        }
        assert!(parse_json::<Req>(b" {\"temperature\": 0.5}").is_ok());
    }

    #[test]
    fn syntax_error_and_trailing_garbage_are_400() {
        for body in [&b"{"[..], b"", b"{} x", b"[1,"] {
            let e = parse_json::<Req>(body).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body:?}");
        }
    }
}
