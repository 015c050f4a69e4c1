//! The APIs beside OpenAI chat completions, one file each: its wire types, its translation into
//! the shared [`Conversation`](crate::conversation::Conversation), its handler, and the writer
//! that turns the engine's output back into its response and stream events. Chat completions
//! (`routes/chat.rs`) goes through the same conversation, so a conversation sent through any of
//! them gives the same prompt and the same tokens. A new dialect is one more file here.
//!
//! - [`anthropic`]: `POST /v1/messages`, `POST /v1/messages/count_tokens` (Anthropic Messages).
//! - [`responses`]: `POST /v1/responses`, `GET /v1/responses/{id}` (OpenAI Responses), with the
//!   bounded store of past responses in [`store`].

pub mod anthropic;
pub mod responses;
pub mod store;

use crate::types::Stop;
use crate::validate::SamplingFields;

/// The sampling fields every dialect has, spelled as the engine's checks want them.
pub(crate) fn sampling_fields(
    max_tokens: Option<i64>,
    max_tokens_param: &'static str,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    stop: Option<Vec<String>>,
    seed: Option<i64>,
) -> SamplingFields {
    SamplingFields {
        max_tokens,
        max_tokens_param,
        temperature,
        top_p,
        top_k,
        seed,
        stop: stop.map(Stop::Many),
        logprobs_param: "logprobs",
        ..Default::default()
    }
}

/// A text made of content blocks (`[{"type": "text", "text": ...}, ...]`, or the spellings in
/// `kinds`) or given as a plain string: the texts joined by newlines, as chat completions joins
/// its content parts. `Err` names what is not text.
pub(crate) fn block_text(v: &serde_json::Value, kinds: &[&str]) -> Result<String, String> {
    match v {
        serde_json::Value::String(s) => Ok(s.clone()),
        serde_json::Value::Null => Ok(String::new()),
        serde_json::Value::Array(blocks) => {
            let mut texts = Vec::with_capacity(blocks.len());
            for (i, b) in blocks.iter().enumerate() {
                let kind = b.get("type").and_then(|t| t.as_str()).unwrap_or_default();
                match b.get("text").and_then(|t| t.as_str()) {
                    Some(t) if kinds.contains(&kind) => texts.push(t),
                    _ => return Err(format!("[{i}] is a `{kind}` block; only text is supported here ({})", kinds.join(", "))),
                }
            }
            Ok(texts.join("\n"))
        }
        _ => Err("must be a string or a list of text blocks".into()),
    }
}
