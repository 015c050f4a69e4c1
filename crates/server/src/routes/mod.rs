//! HTTP handlers, one file per OpenAI resource; `/health` lives here (it has no body to speak of).

pub mod chat;
pub mod completions;
pub mod models;
pub mod tokenize;

use crate::types::{PromptLogprobEntry, PromptLogprobs};
use crate::AppState;
use axum::extract::State;
use axum::http::StatusCode;
use specula_engine::api::TokenLogprob;
use specula_engine::types::TokenId;
use specula_model::Tokenizer;

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

/// JSON has no -inf; like vLLM, impossible tokens are reported at -9999.
pub(crate) fn clamp_logprob(logprob: f32) -> f32 {
    logprob.max(-9999.0)
}

/// vLLM's `prompt_logprobs` (see `PromptLogprobs`): a completions choice's, or a chat response's
/// (top level); top alternatives cut to `k`.
pub(crate) fn vllm_prompt_logprobs(tokenizer: &Tokenizer, entries: &[TokenLogprob], ranks: &[u32], k: usize) -> PromptLogprobs {
    let mut out: PromptLogprobs = vec![None];
    for (e, &rank) in entries.iter().zip(ranks) {
        let entry = |id: TokenId, logprob: f32, rank: u32| {
            (id.to_string(), PromptLogprobEntry { logprob: clamp_logprob(logprob), rank, decoded_token: tokenizer.token_text(id) })
        };
        let mut m = vec![entry(e.token, e.logprob, rank)];
        for (j, &(id, lp)) in e.top.iter().take(k).enumerate() {
            if id != e.token {
                m.push(entry(id, lp, j as u32 + 1));
            }
        }
        out.push(Some(m));
    }
    out
}
