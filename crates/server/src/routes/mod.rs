//! The HTTP handlers that generate nothing, one file per resource (`models`, `tokenize`);
//! `/health` lives here (it has no body to speak of). The generating APIs are in `dialect/`.

pub mod models;
pub mod tokenize;

use crate::AppState;
use axum::extract::State;
use axum::http::StatusCode;

/// `GET /health`: 200 with an empty body while the engine runs (vLLM's behaviour), 503 once it
/// has stopped or died, so a probe sees at once a server that can no longer generate. Never
/// behind auth.
pub async fn health(State(state): State<AppState>) -> StatusCode {
    if state.engine.is_running() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}
