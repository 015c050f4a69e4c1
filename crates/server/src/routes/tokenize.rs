//! vLLM's tokenizer endpoints, with its request and response shapes: `POST /tokenize` (a text
//! prompt, or chat messages rendered with the model's template), `POST /detokenize` and
//! `GET /tokenizer_info`. lm-evaluation-harness's `tokenizer_backend=remote` reads these three,
//! so an evaluation tokenizes exactly as the server does.

use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::tools::{self, ToolSet};
use crate::types::RequestMessage;
use crate::validate;
use crate::AppState;
use axum::extract::State;
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use specula_engine::types::TokenId;

#[derive(Debug, Deserialize)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    /// Text to tokenize; exactly one of `prompt` and `messages`.
    pub prompt: Option<String>,
    /// A conversation, rendered with the chat template first.
    pub messages: Option<Vec<RequestMessage>>,
    /// Add the model's BOS token where it wants one (default: true for `prompt`, false for
    /// `messages`, whose template writes its own special tokens; vLLM's defaults).
    pub add_special_tokens: Option<bool>,
    /// With `messages`: end with the assistant's turn header (default true).
    pub add_generation_prompt: Option<bool>,
    /// With `messages`: tools rendered as `/v1/chat/completions` renders them.
    pub tools: Option<Value>,
    /// Also return each token's vocabulary string.
    #[serde(default)]
    pub return_token_strs: bool,
}

#[derive(Debug, Serialize)]
pub struct TokenizeResponse {
    pub count: usize,
    pub max_model_len: usize,
    pub tokens: Vec<TokenId>,
    pub token_strs: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    /// Signed, so that a negative id gets a 400 naming the field rather than a parse error.
    pub tokens: Vec<i64>,
}

#[derive(Debug, Serialize)]
pub struct DetokenizeResponse {
    pub prompt: String,
}

pub async fn tokenize(State(state): State<AppState>, ApiJson(req): ApiJson<TokenizeRequest>) -> Result<Json<TokenizeResponse>, ApiError> {
    validate::check_model(req.model.as_deref(), &state.config)?;
    let return_token_strs = req.return_token_strs;
    let prepared = state.clone();
    let tokens = state.prep.run(move || tokens_of(&prepared, &req)).await??;
    let tok = &state.tokenizer;
    let token_strs = return_token_strs.then(|| tokens.iter().map(|&t| tok.id_to_token(t).unwrap_or_default()).collect());
    Ok(Json(TokenizeResponse { count: tokens.len(), max_model_len: state.config.max_model_len, tokens, token_strs }))
}

/// The request's tokens (on the prep pool: rendering and tokenizing are CPU work).
fn tokens_of(state: &AppState, req: &TokenizeRequest) -> Result<Vec<TokenId>, ApiError> {
    let tok = &state.tokenizer;
    let tokens = match (&req.prompt, &req.messages) {
        (Some(text), None) => {
            let ids = if req.add_special_tokens.unwrap_or(true) { tok.encode_prompt(text) } else { tok.encode(text) };
            ids.map_err(|e| ApiError::invalid_param("prompt", format!("cannot tokenize the prompt: {e}")))?
        }
        (None, Some(messages)) => {
            let tool_set = ToolSet::from_request(req.tools.as_ref(), None)?;
            let texts = validate::chat_messages(Some(messages))?;
            let messages = tools::template_messages(messages, texts)?;
            let template = state
                .chat_template
                .as_ref()
                .ok_or_else(|| ApiError::invalid_param("messages", "this model has no chat template; tokenize a `prompt` instead"))?;
            let ids = tools::render(template, tok, messages, tool_set.as_ref(), req.add_generation_prompt.unwrap_or(true), &Default::default())?.tokens;
            let bos = tok.bos.filter(|_| tok.add_bos && req.add_special_tokens.unwrap_or(false));
            bos.into_iter().chain(ids).collect()
        }
        (Some(_), Some(_)) => return Err(ApiError::invalid(None, "give either `prompt` or `messages`, not both")),
        (None, None) => return Err(ApiError::invalid(None, "give `prompt` (text) or `messages` (a conversation) to tokenize")),
    };
    Ok(tokens)
}

pub async fn detokenize(State(state): State<AppState>, ApiJson(req): ApiJson<DetokenizeRequest>) -> Result<Json<DetokenizeResponse>, ApiError> {
    validate::check_model(req.model.as_deref(), &state.config)?;
    let vocab = state.tokenizer.vocab_size();
    let ids = req
        .tokens
        .iter()
        .enumerate()
        .map(|(i, &t)| match TokenId::try_from(t) {
            Ok(id) if (id as usize) < vocab => Ok(id),
            _ => Err(ApiError::invalid_param(&format!("tokens[{i}]"), format!("token id {t} is outside the vocabulary (0..{vocab})"))),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let prompt = state.tokenizer.decode(&ids, false).map_err(|e| ApiError::invalid_param("tokens", format!("cannot decode: {e}")))?;
    Ok(Json(DetokenizeResponse { prompt }))
}

/// The tokenizer's configuration in the shape of a Hugging Face `tokenizer_config.json`, as vLLM
/// serves it: special tokens by text (and id), the context length.
pub async fn info(State(state): State<AppState>) -> Json<Value> {
    let tok = &state.tokenizer;
    let text = |id: Option<TokenId>| id.and_then(|i| tok.id_to_token(i));
    let eos = tok.eos.first().copied();
    Json(json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": state.config.max_model_len,
        "vocab_size": tok.vocab_size(),
        "bos_token": text(tok.bos),
        "bos_token_id": tok.bos,
        "eos_token": text(eos),
        "eos_token_id": eos,
        "eos_token_ids": tok.eos,
        "pad_token": text(eos),
        "pad_token_id": eos,
        "add_bos_token": tok.add_bos,
        "chat_template": state.chat_template.as_ref().map(|t| t.source().to_string()),
    }))
}
