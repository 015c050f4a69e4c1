//! The OpenAI wire format: request bodies as clients send them and response bodies as clients
//! expect them. Plain data only; range checks live in `validate.rs`, the mapping from engine
//! events in the routes. Unknown request fields are ignored (clients send extras such as `user`).

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize};

// ---------------------------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------------------------

/// The sampling fields of the OpenAI routes (completions and chat completions), declared once
/// here: [`SamplingBlock`] holds them, and `with_sampling_block!` splices them into each request
/// struct (with `sampling()`, the block read back). Spliced rather than `#[serde(flatten)]`ed:
/// flattened fields are buffered before they are read, so a wrong type there would lose its
/// field's name in the 400 (`extract.rs`). The fields each route spells its own way
/// (`max_tokens`, `logprobs`) stay on the request; Anthropic Messages and Responses spell theirs
/// after their APIs.
macro_rules! declare_sampling_block {
    ($d:tt $($(#[$fm:meta])* $field:ident: $ty:ty,)*) => {
        /// See `declare_sampling_block!`.
        #[derive(Debug, Default, Clone, Deserialize)]
        pub struct SamplingBlock {
            $($(#[$fm])* pub $field: $ty,)*
        }

        macro_rules! with_sampling_block {
            ($d(#[$d m:meta])* pub struct $d name:ident { $d($d body:tt)* }) => {
                $d(#[$d m])*
                pub struct $d name {
                    $d($d body)*
                    $($(#[$fm])* pub $field: $ty,)*
                }

                impl $d name {
                    /// The sampling fields, as the block every dialect fills.
                    pub fn sampling(&self) -> SamplingBlock {
                        SamplingBlock { $($field: self.$field.clone(),)* }
                    }
                }
            };
        }
    };
}

declare_sampling_block! { $
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    min_p: Option<f32>,
    seed: Option<i64>,
    stop: Option<Stop>,
    stop_token_ids: Option<Vec<u32>>,
    /// Token id (as a string key) -> bias in [-100, 100] added to its logit before sampling.
    logit_bias: Option<std::collections::BTreeMap<String, f32>>,
    n: Option<i64>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    repetition_penalty: Option<f32>,
    ignore_eos: Option<bool>,
    /// Our extension: no speculative drafts for this request (the output is the same either way;
    /// only its speed differs).
    disable_speculation: Option<bool>,
    /// vLLM's extension: the top-k logprobs of every prompt token (completions: `prompt_logprobs`
    /// in each choice; chat: at the top level of the response, and not with `stream`, as in vLLM).
    prompt_logprobs: Option<i64>,
    /// Structured outputs, every way a client can ask for them.
    #[serde(flatten)]
    structured: StructuredFields,
}

with_sampling_block! {
/// `POST /v1/completions`.
#[derive(Debug, Default, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Option<Prompt>,
    pub max_tokens: Option<i64>,
    /// Number of alternatives per position (0 = the sampled token's logprob only).
    pub logprobs: Option<i64>,
    /// Prepend the prompt's text to each choice's text (with `logprobs`, the prompt's logprobs too).
    pub echo: Option<bool>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
}
}

with_sampling_block! {
/// `POST /v1/chat/completions`.
#[derive(Debug, Default, Deserialize)]
pub struct ChatCompletionRequest {
    pub model: Option<String>,
    pub messages: Option<Vec<RequestMessage>>,
    pub max_tokens: Option<i64>,
    /// The newer name for `max_tokens`; wins when both are given.
    pub max_completion_tokens: Option<i64>,
    pub logprobs: Option<bool>,
    /// Alternatives per position; needs `logprobs: true`.
    pub top_logprobs: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// OpenAI function tools, as sent: checked (with the paths of the fields at fault) by
    /// `tools::ToolSet::from_request`, so a malformed one is a 400 naming e.g. `tools[1].type`.
    pub tools: Option<serde_json::Value>,
    /// `"auto"` (the default with tools), `"none"`, `"required"` or
    /// `{"type": "function", "function": {"name": ...}}`; checked with `tools`.
    pub tool_choice: Option<serde_json::Value>,
    /// false: `tool_choice: "required"` forces exactly one call. Calls the model makes on its own
    /// (`auto`) are all returned whatever its value.
    pub parallel_tool_calls: Option<bool>,
    /// Extra variables for the chat template, e.g. `{"enable_thinking": false}` (vLLM's field).
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// Most tokens a thinking model may reason for before its think block is closed for it
    /// (vLLM's field).
    pub thinking_token_budget: Option<i64>,
    /// OpenAI's `reasoning_effort` ("low", "medium", "high"): the template's `reasoning_effort`
    /// (gpt-oss's system message says it).
    pub reasoning_effort: Option<String>,
}
}

/// Every way a client can ask for structured output, as sent; at most one may be given (checked in
/// `validate::structured_constraint`).
#[derive(Debug, Default, Clone, Deserialize)]
pub struct StructuredFields {
    /// `{type: text | json_object | json_schema, json_schema: {name, schema, strict}}`.
    pub response_format: Option<serde_json::Value>,
    /// vLLM's structured outputs: one of `{json, regex, choice, grammar, json_object}`.
    pub structured_outputs: Option<serde_json::Value>,
    /// vLLM's older spellings of `structured_outputs`.
    pub guided_json: Option<serde_json::Value>,
    pub guided_regex: Option<serde_json::Value>,
    pub guided_choice: Option<serde_json::Value>,
    pub guided_grammar: Option<serde_json::Value>,
}

#[derive(Debug, Default, Clone, Copy, Deserialize)]
pub struct StreamOptions {
    /// Send one last chunk with `usage` (and no choices) before `[DONE]`.
    pub include_usage: Option<bool>,
}

/// The four shapes of `prompt`; each prompt (string or token list) gets its own `n` choices.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

/// The most prompts (strings or token-id lists) one `prompt` may list, whatever
/// `--max-prompts-per-request` says (it may not be set above this): reading a body stops here, so
/// a body of hundreds of thousands of tiny prompts costs neither their memory nor their time.
pub const PROMPT_LIST_CAP: usize = 4096;

const PROMPT_EXPECTED: &str = "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists";

/// Read element by element (not through a `serde_json::Value`), stopping at [`PROMPT_LIST_CAP`].
impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(PromptVisitor)
    }
}

struct PromptVisitor;

impl<'de> serde::de::Visitor<'de> for PromptVisitor {
    type Value = Prompt;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(PROMPT_EXPECTED)
    }

    fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Prompt, E> {
        Ok(Prompt::Text(s.to_owned()))
    }

    fn visit_string<E: serde::de::Error>(self, s: String) -> Result<Prompt, E> {
        Ok(Prompt::Text(s))
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
        let too_many = || A::Error::custom(format!("prompt lists more than {PROMPT_LIST_CAP} prompts"));
        // the first element decides the kind of list; every other must be of the same kind
        let mut out: Option<Prompt> = None;
        while let Some(item) = seq.next_element::<PromptItem>()? {
            match (&mut out, item) {
                (None, PromptItem::Text(t)) => out = Some(Prompt::Texts(vec![t])),
                (None, PromptItem::Token(t)) => out = Some(Prompt::Tokens(vec![t])),
                (None, PromptItem::Tokens(l)) => out = Some(Prompt::TokenLists(vec![l])),
                (Some(Prompt::Texts(v)), PromptItem::Text(t)) if v.len() < PROMPT_LIST_CAP => v.push(t),
                (Some(Prompt::TokenLists(v)), PromptItem::Tokens(l)) if v.len() < PROMPT_LIST_CAP => v.push(l),
                (Some(Prompt::Texts(_)), PromptItem::Text(_)) | (Some(Prompt::TokenLists(_)), PromptItem::Tokens(_)) => return Err(too_many()),
                (Some(Prompt::Tokens(v)), PromptItem::Token(t)) => v.push(t),
                _ => return Err(A::Error::custom(PROMPT_EXPECTED)),
            }
        }
        Ok(out.unwrap_or(Prompt::Texts(Vec::new())))
    }
}

/// One element of a `prompt` list.
enum PromptItem {
    Text(String),
    Token(u32),
    Tokens(Vec<u32>),
}

impl<'de> Deserialize<'de> for PromptItem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ItemVisitor;
        impl<'de> serde::de::Visitor<'de> for ItemVisitor {
            type Value = PromptItem;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(PROMPT_EXPECTED)
            }

            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<PromptItem, E> {
                Ok(PromptItem::Text(s.to_owned()))
            }

            fn visit_string<E: serde::de::Error>(self, s: String) -> Result<PromptItem, E> {
                Ok(PromptItem::Text(s))
            }

            fn visit_u64<E: serde::de::Error>(self, t: u64) -> Result<PromptItem, E> {
                u32::try_from(t).map(PromptItem::Token).map_err(|_| E::custom(PROMPT_EXPECTED))
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<PromptItem, A::Error> {
                let mut tokens = Vec::new();
                while let Some(t) = seq.next_element::<u32>()? {
                    tokens.push(t);
                }
                Ok(PromptItem::Tokens(tokens))
            }
        }
        d.deserialize_any(ItemVisitor)
    }
}

/// `stop`: one string or several.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct RequestMessage {
    pub role: String,
    /// Absent or null for e.g. an assistant turn that only called tools; rendered as "".
    #[serde(default)]
    pub content: Option<MessageContent>,
    /// An assistant turn's tool calls (OpenAI: `arguments` is a JSON string).
    #[serde(default)]
    pub tool_calls: Option<Vec<RequestToolCall>>,
    /// A `tool` message: the call it answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    /// The author's name (a `tool` message: the function's), passed to the template as given.
    #[serde(default)]
    pub name: Option<String>,
    /// An assistant turn's reasoning as an earlier response returned it (vLLM's field), for
    /// templates that write it back (`reasoning_content`, gpt-oss's `thinking`).
    #[serde(default)]
    pub reasoning_content: Option<String>,
}

/// One call in an assistant message the client sends back (`message.tool_calls[i]` of an
/// earlier response).
#[derive(Debug, Clone, Deserialize)]
pub struct RequestToolCall {
    pub id: Option<String>,
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub function: RequestFunctionCall,
}

#[derive(Debug, Clone, Deserialize)]
pub struct RequestFunctionCall {
    pub name: String,
    /// The arguments as a JSON text (OpenAI's shape); a JSON object is accepted too.
    pub arguments: serde_json::Value,
}

/// A message's content: plain text, or a list of parts of which only `text` parts are supported.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

// ---------------------------------------------------------------------------------------------
// Responses
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    /// As OpenAI reports it: `cached_tokens`, the prompt tokens served from the prefix cache.
    #[serde(default)]
    pub prompt_tokens_details: PromptTokensDetails,
    /// As OpenAI reports it for reasoning models: `reasoning_tokens`, the completion tokens spent
    /// reasoning; present where the template thinks (or speaks harmony).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_tokens_details: Option<CompletionTokensDetails>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct CompletionTokensDetails {
    pub reasoning_tokens: usize,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

impl Usage {
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails::default(),
            completion_tokens_details: None,
        }
    }

    /// With `reasoning` of the completion tokens spent reasoning (None: not a reasoning output).
    pub fn reasoning(self, reasoning: Option<usize>) -> Self {
        Self { completion_tokens_details: reasoning.map(|r| CompletionTokensDetails { reasoning_tokens: r.min(self.completion_tokens) }), ..self }
    }

    /// With `cached` of the prompt tokens served from the prefix cache.
    pub fn cached(self, cached: usize) -> Self {
        Self { prompt_tokens_details: PromptTokensDetails { cached_tokens: cached.min(self.prompt_tokens) }, ..self }
    }
}

/// The envelope every response object shares (`text_completion`, `chat.completion`,
/// `chat.completion.chunk`), over its kind of choice.
#[derive(Debug, Clone, Serialize)]
pub struct ResponseObject<C> {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<C>,
    /// A whole response: always present. A stream: absent, or (with `include_usage`) null on
    /// every chunk but the last.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
    /// vLLM's `prompt_logprobs` of a chat response (top level: every choice shares the prompt);
    /// only when asked for. Completions carry theirs in each choice.
    #[serde(skip_serializing_if = "Option::is_none", serialize_with = "prompt_logprob_maps")]
    pub prompt_logprobs: Option<PromptLogprobs>,
}

/// `text_completion` object: the whole response, or one streamed chunk.
pub type CompletionResponse = ResponseObject<CompletionChoice>;

#[derive(Debug, Clone, Serialize)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
    /// vLLM's `prompt_logprobs`, only when asked for.
    #[serde(skip_serializing_if = "Option::is_none", serialize_with = "prompt_logprob_maps")]
    pub prompt_logprobs: Option<PromptLogprobs>,
}

/// The legacy completions logprobs layout: parallel arrays, one entry per token.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    /// `null` for the first prompt token when the prompt is echoed.
    pub token_logprobs: Vec<Option<f32>>,
    /// Token text -> logprob for the alternatives at each position (the sampled token included),
    /// most likely first: sent as JSON objects whose keys keep that order, as OpenAI and vLLM do.
    #[serde(serialize_with = "ordered_maps")]
    pub top_logprobs: Vec<Option<Vec<(String, f32)>>>,
    /// Character offset of each token in the choice's text.
    pub text_offset: Vec<usize>,
}

/// Each inner list as one JSON object, keys in list order.
#[allow(clippy::ptr_arg)]
fn ordered_maps<S: serde::Serializer>(maps: &Vec<Option<Vec<(String, f32)>>>, s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(maps.iter().map(|m| m.as_deref().map(Ordered)))
}

/// A list of pairs serialized as one JSON object, keys in list order.
pub struct Ordered<'a, V>(pub &'a [(String, V)]);

impl<V: Serialize> Serialize for Ordered<'_, V> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.0.iter().map(|(k, v)| (k, v)))
    }
}

/// One entry of vLLM's `prompt_logprobs`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PromptLogprobEntry {
    pub logprob: f32,
    pub rank: u32,
    pub decoded_token: String,
}

/// vLLM's `prompt_logprobs` of one choice: `null` for the first prompt token, then per token an
/// object token id -> entry (the prompt token first, then the top alternatives).
pub type PromptLogprobs = Vec<Option<Vec<(String, PromptLogprobEntry)>>>;

fn prompt_logprob_maps<S: serde::Serializer>(maps: &Option<PromptLogprobs>, s: S) -> Result<S::Ok, S::Error> {
    match maps {
        None => s.serialize_none(),
        Some(maps) => s.collect_seq(maps.iter().map(|m| m.as_deref().map(Ordered))),
    }
}

impl CompletionLogprobs {
    pub fn extend(&mut self, other: CompletionLogprobs) {
        self.tokens.extend(other.tokens);
        self.token_logprobs.extend(other.token_logprobs);
        self.top_logprobs.extend(other.top_logprobs);
        self.text_offset.extend(other.text_offset);
    }
}

/// `chat.completion` (whole response).
pub type ChatCompletionResponse = ResponseObject<ChatChoice>;

#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    pub index: usize,
    pub message: ResponseMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ResponseMessage {
    pub role: &'static str,
    /// Null when the model only called tools.
    pub content: Option<String>,
    /// A thinking model's reasoning (vLLM's field), when there was some.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

/// A call the model made, as OpenAI returns it in `message.tool_calls`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCall {
    /// `call_...`, unique per server process.
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments as JSON text (always a valid JSON value).
    pub arguments: String,
}

/// One piece of a streamed call in `delta.tool_calls`: the first carries `id`, `type` and the
/// name, the later ones pieces of `arguments` only.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCallDelta {
    /// Which call of the message this piece belongs to (0, 1, ...).
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionCallDelta,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionCallDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

/// `chat.completion.chunk` (one streamed chunk).
pub type ChatCompletionChunk = ResponseObject<ChatChunkChoice>;

#[derive(Debug, Clone, Serialize)]
pub struct ChatChunkChoice {
    pub index: usize,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<ChatTopLogprob>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatTopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub max_model_len: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_accepts_the_four_shapes() {
        let p = |s: &str| serde_json::from_str::<Prompt>(s);
        assert_eq!(p(r#""hi""#).unwrap(), Prompt::Text("hi".into()));
        assert_eq!(p(r#"["a","b"]"#).unwrap(), Prompt::Texts(vec!["a".into(), "b".into()]));
        assert_eq!(p("[1,2]").unwrap(), Prompt::Tokens(vec![1, 2]));
        assert_eq!(p("[[1],[2,3]]").unwrap(), Prompt::TokenLists(vec![vec![1], vec![2, 3]]));
        assert_eq!(p("[]").unwrap(), Prompt::Texts(vec![]));
        for bad in ["3", r#"["a",1]"#, "[-1]", "[1.5]", "[[1],\"a\"]", "{}", "[4294967296]", "[[1,\"a\"]]", "[1,[2]]", "null"] {
            assert!(p(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_prompt_list_stops_being_read_at_the_cap() {
        let texts = |n: usize| format!("[{}]", vec!["\"x\""; n].join(","));
        let lists = |n: usize| format!("[{}]", vec!["[1]"; n].join(","));
        let p = |s: &str| serde_json::from_str::<Prompt>(s);
        assert!(matches!(p(&texts(PROMPT_LIST_CAP)), Ok(Prompt::Texts(v)) if v.len() == PROMPT_LIST_CAP));
        assert!(matches!(p(&lists(PROMPT_LIST_CAP)), Ok(Prompt::TokenLists(v)) if v.len() == PROMPT_LIST_CAP));
        for over in [texts(PROMPT_LIST_CAP + 1), lists(PROMPT_LIST_CAP + 1)] {
            let e = p(&over).unwrap_err().to_string();
            assert!(e.contains(&format!("more than {PROMPT_LIST_CAP} prompts")), "{e}");
        }
        // a single token-id prompt is one prompt, however long
        assert!(matches!(p(&format!("[{}]", vec!["7"; 3 * PROMPT_LIST_CAP].join(","))), Ok(Prompt::Tokens(v)) if v.len() == 3 * PROMPT_LIST_CAP));
    }

    #[test]
    fn completion_top_logprobs_keep_their_order() {
        let lp = CompletionLogprobs {
            tokens: vec!["x".into(), "b".into()],
            token_logprobs: vec![None, Some(-0.1)],
            top_logprobs: vec![None, Some(vec![("b".into(), -0.1), ("a".into(), -2.0), ("c".into(), -3.0)])],
            text_offset: vec![0, 1],
        };
        let s = serde_json::to_string(&lp).unwrap();
        assert!(s.contains(r#""top_logprobs":[null,{"b":-0.1,"a":-2.0,"c":-3.0}]"#), "{s}");
        assert!(s.contains(r#""token_logprobs":[null,-0.1]"#), "{s}");
    }

    #[test]
    fn streamed_usage_is_null_until_the_last_chunk() {
        let chunk = |usage| CompletionResponse {
            id: "cmpl-1".into(),
            object: "text_completion",
            created: 0,
            model: "m".into(),
            choices: vec![],
            usage,
            prompt_logprobs: None,
        };
        let v = serde_json::to_value(chunk(None)).unwrap();
        assert!(v.get("usage").is_none());
        assert!(v.get("prompt_logprobs").is_none(), "only a chat response asked for them has them");
        let v = serde_json::to_value(chunk(Some(None))).unwrap();
        assert!(v["usage"].is_null() && v.get("usage").is_some());
        let v = serde_json::to_value(chunk(Some(Some(Usage::new(2, 3))))).unwrap();
        assert_eq!(v["usage"]["total_tokens"], 5);
    }
}
