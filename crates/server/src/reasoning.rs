//! The one reasoning parser: separates a thinking model's reasoning (`<think>...</think>`, as
//! Qwen3 and the DeepSeek-R1 distills write it) from its answer, fed whole or piece by piece
//! while streaming so both paths split the same way. Every dialect reports the reasoning in its
//! own shape (`reasoning_content`, `thinking` blocks, reasoning items); the answer goes on to the
//! tool-call parser. Not for templates that do not think: the server only runs it when the chat
//! template mentions both tags ([`template_thinks`]).

use crate::tools::partial_tag_len;
use specula_engine::ReasoningBudget;
use specula_model::Tokenizer;

pub const THINK_OPEN: &str = "<think>";
pub const THINK_CLOSE: &str = "</think>";

/// Whether a chat template writes think blocks (Qwen3's, DeepSeek-R1's): it has both tags.
pub fn template_thinks(source: &str) -> bool {
    source.contains(THINK_OPEN) && source.contains(THINK_CLOSE)
}

/// Where a thinking template's rendered prompt leaves the model: DeepSeek-R1's generation prompt
/// ends with `<think>\n`, so its output has no opening tag; Qwen3 with `enable_thinking: false`
/// ends with an empty, closed block, so the output is all answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningStart {
    /// Inside a think block the prompt opened (DeepSeek-R1).
    Opened,
    /// Before one: the model opens it itself (Qwen3 thinking).
    ModelOpens,
    /// After an empty block that closes the prompt (Qwen3 with `enable_thinking: false`): no
    /// reasoning will come.
    Closed,
}

/// Where `prompt`, rendered by a thinking template, leaves the model.
pub fn reasoning_start(prompt: &str) -> ReasoningStart {
    match (prompt.rfind(THINK_OPEN), prompt.rfind(THINK_CLOSE)) {
        (Some(open), Some(close)) if open > close => ReasoningStart::Opened,
        (Some(_), None) => ReasoningStart::Opened,
        (_, Some(close)) if prompt[close + THINK_CLOSE.len()..].trim().is_empty() => ReasoningStart::Closed,
        _ => ReasoningStart::ModelOpens,
    }
}

/// The reasoning budget for a request to a thinking template (`tokens` thinking tokens at most)
/// from where its prompt leaves the model; `None` when no reasoning will come. An error when
/// this vocabulary does not spell the tags as single tokens (the budget forces them).
pub fn budget(tokenizer: &Tokenizer, start: ReasoningStart, tokens: usize) -> Result<Option<ReasoningBudget>, String> {
    let (Some(open), Some(close)) = (tokenizer.token_to_id(THINK_OPEN), tokenizer.token_to_id(THINK_CLOSE)) else {
        return Err(format!("this model's vocabulary does not hold {THINK_OPEN} and {THINK_CLOSE} as single tokens, so its reasoning cannot be bounded"));
    };
    Ok(match start {
        ReasoningStart::Closed => None,
        ReasoningStart::Opened => Some(ReasoningBudget { tokens, open: None, close }),
        ReasoningStart::ModelOpens => Some(ReasoningBudget { tokens, open: Some(open), close }),
    })
}

/// What the parser lets out, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReasoningPiece {
    Reasoning(String),
    Content(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Only whitespace, or a prefix of `<think>`, seen so far.
    Start,
    /// Inside the think block; leading whitespace not yet dropped while `fresh`.
    Reasoning { fresh: bool },
    /// After `</think>`: the whitespace before the answer is dropped.
    AfterClose,
    /// The answer.
    Content,
}

/// Splits output into reasoning and content as it arrives. Holds back at most a possible start
/// of a tag, so no tag text ever leaks into either part. A think block that never closes is all
/// reasoning (the model ran out of tokens while thinking); output that does not open with
/// `<think>` (and a prompt that did not open one) is all content.
#[derive(Debug, Clone)]
pub struct ReasoningParser {
    state: State,
    pending: String,
}

impl ReasoningParser {
    /// `opened`: the prompt already opened the think block ([`reasoning_start`] is [`ReasoningStart::Opened`]).
    pub fn new(opened: bool) -> Self {
        Self { state: if opened { State::Reasoning { fresh: true } } else { State::Start }, pending: String::new() }
    }

    /// The reasoning (None when there was none) and the content of a whole output.
    pub fn split(text: &str, opened: bool) -> (Option<String>, String) {
        let mut parser = Self::new(opened);
        let mut pieces = parser.push(text);
        pieces.extend(parser.finish());
        let (mut reasoning, mut content) = (None::<String>, String::new());
        for piece in pieces {
            match piece {
                ReasoningPiece::Reasoning(r) => reasoning.get_or_insert_with(String::new).push_str(&r),
                ReasoningPiece::Content(c) => content.push_str(&c),
            }
        }
        (reasoning, content)
    }

    /// Takes the next piece of output; returns what can be let out now.
    pub fn push(&mut self, text: &str) -> Vec<ReasoningPiece> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.state {
                State::Start => {
                    let head = self.pending.trim_start();
                    if head.starts_with(THINK_OPEN) {
                        let at = self.pending.len() - head.len() + THINK_OPEN.len();
                        self.pending.drain(..at);
                        self.state = State::Reasoning { fresh: true };
                    } else if head.is_empty() || THINK_OPEN.starts_with(head) {
                        return out;
                    } else {
                        self.state = State::Content;
                    }
                }
                State::Reasoning { fresh } => {
                    if fresh {
                        let trimmed = self.pending.trim_start().len();
                        self.pending.drain(..self.pending.len() - trimmed);
                        if self.pending.is_empty() {
                            return out;
                        }
                        self.state = State::Reasoning { fresh: false };
                    }
                    match self.pending.find(THINK_CLOSE) {
                        Some(at) => {
                            let block: String = self.pending.drain(..at + THINK_CLOSE.len()).collect();
                            push_piece(&mut out, ReasoningPiece::Reasoning(block[..at].to_string()));
                            self.state = State::AfterClose;
                        }
                        None => {
                            let keep = partial_tag_len(&self.pending, THINK_CLOSE);
                            let sendable: String = self.pending.drain(..self.pending.len() - keep).collect();
                            push_piece(&mut out, ReasoningPiece::Reasoning(sendable));
                            return out;
                        }
                    }
                }
                State::AfterClose => {
                    let trimmed = self.pending.trim_start().len();
                    self.pending.drain(..self.pending.len() - trimmed);
                    if self.pending.is_empty() {
                        return out;
                    }
                    self.state = State::Content;
                }
                State::Content => {
                    push_piece(&mut out, ReasoningPiece::Content(std::mem::take(&mut self.pending)));
                    return out;
                }
            }
        }
    }

    /// The end of the output: lets out whatever was held back.
    pub fn finish(&mut self) -> Vec<ReasoningPiece> {
        let pending = std::mem::take(&mut self.pending);
        let mut out = Vec::new();
        match self.state {
            State::Start | State::Content => push_piece(&mut out, ReasoningPiece::Content(pending)),
            State::Reasoning { .. } => push_piece(&mut out, ReasoningPiece::Reasoning(pending)),
            State::AfterClose => {}
        }
        self.state = State::Content;
        out
    }
}

fn push_piece(out: &mut Vec<ReasoningPiece>, piece: ReasoningPiece) {
    let empty = match &piece {
        ReasoningPiece::Reasoning(t) | ReasoningPiece::Content(t) => t.is_empty(),
    };
    if !empty {
        out.push(piece);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The part of Qwen3's published chat template (Qwen/Qwen3-0.6B, tokenizer_config.json) that
    /// decides how a turn with reasoning is written and what the generation prompt is.
    pub const QWEN3_TEMPLATE_TAIL: &str = r#"{%- for message in messages %}
    {%- if message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"#;

    fn pieces(chunks: &[&str], opened: bool) -> Vec<ReasoningPiece> {
        let mut p = ReasoningParser::new(opened);
        let mut out: Vec<ReasoningPiece> = chunks.iter().flat_map(|c| p.push(c)).collect();
        out.extend(p.finish());
        out
    }

    fn joined(pieces: &[ReasoningPiece]) -> (String, String) {
        let (mut r, mut c) = (String::new(), String::new());
        for p in pieces {
            match p {
                ReasoningPiece::Reasoning(t) => r.push_str(t),
                ReasoningPiece::Content(t) => c.push_str(t),
            }
        }
        (r, c)
    }

    #[test]
    fn qwen3_template_is_recognised_and_its_prompts_open_or_close_the_block() {
        let t = specula_model::ChatTemplate::new(QWEN3_TEMPLATE_TAIL, "", "").unwrap();
        assert!(template_thinks(t.source()));
        assert!(!template_thinks(specula_model::chat::CHATML));
        let msgs = [specula_model::ChatMessage { role: "user".into(), content: "hi".into() }];
        let thinking = t.render(&msgs, true).unwrap();
        assert_eq!(thinking, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
        let off = serde_json::json!({"enable_thinking": false});
        let quiet = t.render_with_kwargs(&msgs, None, true, off.as_object().unwrap()).unwrap();
        assert!(quiet.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"), "{quiet:?}");
        assert_eq!(reasoning_start(&thinking), ReasoningStart::ModelOpens, "Qwen3 writes <think> itself");
        assert_eq!(reasoning_start(&quiet), ReasoningStart::Closed, "an empty closed block: all answer");
        assert_eq!(reasoning_start("<|Assistant|><think>\n"), ReasoningStart::Opened, "DeepSeek-R1's generation prompt");
        // an earlier turn's block, closed and answered, leaves the model before a new one
        let history = "<|im_start|>assistant\n<think>\nx\n</think>\n\nok<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n";
        assert_eq!(reasoning_start(history), ReasoningStart::ModelOpens);
    }

    #[test]
    fn qwen3_output_splits_into_reasoning_and_answer() {
        let out = "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?";
        let (r, c) = ReasoningParser::split(out, false);
        assert_eq!(r.as_deref(), Some("The user greets me.\n"));
        assert_eq!(c, "Hello! How can I help?");
    }

    #[test]
    fn the_split_is_the_same_however_the_stream_is_cut() {
        let out = "<think>\nStep 1: x < y.\nStep 2: </thin not a tag.\n</think>\n\nAnswer: <b>2</b>";
        let whole = joined(&pieces(&[out], false));
        assert_eq!(whole, ("Step 1: x < y.\nStep 2: </thin not a tag.\n".to_string(), "Answer: <b>2</b>".to_string()));
        for size in 1..12 {
            let chars: Vec<char> = out.chars().collect();
            let chunks: Vec<String> = chars.chunks(size).map(|c| c.iter().collect()).collect();
            let refs: Vec<&str> = chunks.iter().map(String::as_str).collect();
            let got = pieces(&refs, false);
            assert_eq!(joined(&got), whole, "chunks of {size}");
            assert!(got.iter().all(|p| !matches!(p, ReasoningPiece::Content(t) | ReasoningPiece::Reasoning(t) if t.contains("think>"))));
        }
    }

    #[test]
    fn output_without_a_think_block_is_all_answer() {
        assert_eq!(ReasoningParser::split("  plain <think> later", false), (None, "  plain <think> later".to_string()));
        assert_eq!(ReasoningParser::split("", false), (None, String::new()));
        // a lone prefix of the tag at the end is content after all
        assert_eq!(ReasoningParser::split("<thi", false), (None, "<thi".to_string()));
    }

    #[test]
    fn deepseek_output_starts_inside_the_block() {
        let (r, c) = ReasoningParser::split("\nLet me think.\n</think>\n\nIt is 4.", true);
        assert_eq!((r.as_deref(), c.as_str()), (Some("Let me think.\n"), "It is 4."));
    }

    #[test]
    fn an_unclosed_block_is_all_reasoning() {
        assert_eq!(ReasoningParser::split("<think>\nstill going", false), (Some("still going".to_string()), String::new()));
    }

    #[test]
    fn tool_calls_after_reasoning_reach_the_call_parser_intact() {
        let out = "<think>\nI need the weather.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let (r, c) = ReasoningParser::split(out, false);
        assert_eq!(r.as_deref(), Some("I need the weather.\n"));
        let parsed = crate::tools::CallParser::parse(&c, vec!["get_weather".into()]);
        assert_eq!(parsed.calls.len(), 1);
        assert_eq!((parsed.calls[0].name.as_str(), parsed.calls[0].arguments.as_str()), ("get_weather", "{\"city\":\"Paris\"}"));
        assert_eq!(parsed.content, None);
    }
}
