//! Finding calls in the model's text: [`CallParser`] lets out content and calls as the text
//! arrives (a Qwen-style call as soon as its name is known, then its arguments in fragments),
//! and parses a whole output through the same machine, so both give the same calls.

use super::{CALL_CLOSE, CALL_OPEN, PYTHON_TAG};
use serde_json::{Map, Value};
use std::sync::atomic::{AtomicU64, Ordering};

/// A call found in the model's text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedCall {
    pub name: String,
    /// The arguments object as compact JSON text.
    pub arguments: String,
}

/// What the parser lets out, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Content(String),
    /// A whole call (a block that is not in the streamable form, once it closed and parsed).
    Call(ParsedCall),
    /// A call in the streamable form `{"name": "<name>", "arguments": {` starts: its arguments
    /// follow as [`Piece::CallArguments`] fragments.
    CallStart(String),
    /// The next fragment of the arguments of the call last started.
    CallArguments(String),
}

/// The parse of a whole output.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ParsedMessage {
    /// The text outside the calls, trimmed; `None` when nothing is left.
    pub content: Option<String>,
    pub calls: Vec<ParsedCall>,
}

/// `{"name": <string>, "arguments" | "parameters": <object>}` (arguments may also come as a
/// JSON text holding an object, or be absent: `{}`).
fn call_from_json(v: &Value) -> Option<ParsedCall> {
    let obj = v.as_object()?;
    let name = obj.get("name")?.as_str().filter(|n| !n.is_empty())?;
    let arguments = match obj.get("arguments").or_else(|| obj.get("parameters")) {
        None => Value::Object(Map::new()),
        Some(Value::String(s)) => serde_json::from_str::<Value>(s).ok().filter(Value::is_object)?,
        Some(v @ Value::Object(_)) => v.clone(),
        Some(_) => return None,
    };
    Some(ParsedCall { name: name.to_string(), arguments: arguments.to_string() })
}

/// The body between `<tool_call>` and `</tool_call>`.
fn parse_hermes_body(body: &str) -> Option<ParsedCall> {
    call_from_json(&serde_json::from_str::<Value>(body.trim()).ok()?)
}

/// Llama 3's form: the whole output is one call object, or several joined by `;`, each naming
/// one of the tools (bare JSON is ambiguous, so an unknown name means "not a call").
fn parse_json_calls(text: &str, names: &[String]) -> Option<Vec<ParsedCall>> {
    let text = text.trim();
    let text = text.strip_prefix(PYTHON_TAG).unwrap_or(text).trim();
    let whole = serde_json::from_str::<Value>(text).ok().map(|v| vec![v]);
    let values = match whole {
        Some(v) => v,
        None => text.split(';').map(|part| serde_json::from_str::<Value>(part.trim()).ok()).collect::<Option<Vec<_>>>()?,
    };
    values.iter().map(|v| call_from_json(v).filter(|c| names.contains(&c.name))).collect()
}

impl ParsedMessage {
    /// The message the pieces of one output add up to.
    pub fn from_pieces(pieces: impl IntoIterator<Item = Piece>) -> Self {
        let mut message = ParsedMessage::default();
        let mut content = String::new();
        for piece in pieces {
            match piece {
                Piece::Content(text) => content.push_str(&text),
                Piece::Call(call) => message.calls.push(call),
                Piece::CallStart(name) => message.calls.push(ParsedCall { name, arguments: String::new() }),
                Piece::CallArguments(text) => match message.calls.last_mut() {
                    Some(call) => call.arguments.push_str(&text),
                    None => content.push_str(&text), // not produced by the parser
                },
            }
        }
        message.content = (!content.is_empty()).then_some(content);
        message
    }
}

/// How the text after `<tool_call>` begins.
#[derive(Debug, PartialEq, Eq)]
enum Head {
    /// Not decided yet: more text may still make it the streamable form.
    Open,
    /// Not the streamable form: the block is parsed whole once it closes.
    Other,
    /// `{"name": "<name>", "arguments": ` (any whitespace between), the arguments object's `{`
    /// next; `len` bytes of the body.
    Streamable { name: String, len: usize },
}

/// Whether `body` (the text after `<tool_call>` so far) opens a call in the form whose arguments
/// can be streamed as they come: the name first, then an arguments object. The decision reads
/// only the text up to the arguments' `{`, so it is the same however the output is split.
fn streamable_head(body: &str) -> Head {
    let mut rest = body;
    // each literal: Open if the text ends inside it, Other if it differs
    let lit = |r: &mut &str, l: &str| -> Option<Head> {
        *r = r.trim_start();
        if r.starts_with(l) {
            *r = &r[l.len()..];
            None
        } else if l.starts_with(*r) {
            Some(Head::Open)
        } else {
            Some(Head::Other)
        }
    };
    for l in ["{", "\"name\"", ":", "\""] {
        if let Some(h) = lit(&mut rest, l) {
            return h;
        }
    }
    let Some(end) = rest.find(['"', '\\']) else { return Head::Open };
    if rest.as_bytes()[end] == b'\\' || end == 0 {
        return Head::Other; // an escaped or empty name: parsed whole
    }
    let name = rest[..end].to_string();
    rest = &rest[end + 1..];
    for l in [",", "\"arguments\"", ":", "{"] {
        if let Some(h) = lit(&mut rest, l) {
            return h;
        }
    }
    Head::Streamable { name, len: body.len() - rest.len() - 1 }
}

/// A streamed call's arguments, with the whitespace outside strings dropped (compact JSON, as
/// a whole call's arguments are written) and the closing braces at the end held back: the last
/// one closes the call's object, not the arguments.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Arguments {
    in_string: bool,
    escaped: bool,
    /// Compacted text not let out yet (a run of `}` outside strings).
    held: String,
}

impl Arguments {
    /// Takes raw body text; returns what can be let out.
    fn push(&mut self, text: &str) -> String {
        let mut out = std::mem::take(&mut self.held);
        for c in text.chars() {
            if self.escaped {
                self.escaped = false;
            } else if self.in_string {
                self.escaped = c == '\\';
                self.in_string = c != '"';
            } else if c == '"' {
                self.in_string = true;
            } else if c.is_whitespace() {
                continue;
            }
            out.push(c);
        }
        if !self.in_string {
            let body = out.trim_end_matches('}').len();
            self.held = out.split_off(body);
        }
        out
    }

    /// The end of the call: what is left without the call object's closing brace.
    fn close(&mut self) -> String {
        let mut rest = std::mem::take(&mut self.held);
        rest.pop();
        rest
    }
}

/// Where the parser is in the output.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Mode {
    /// Nothing but whitespace (or a prefix of `<|python_tag|>`) seen yet.
    Start,
    /// Ordinary text; `pending` holds at most a possible start of `<tool_call>`.
    Text,
    /// Inside `<tool_call>`: `pending` is the body so far.
    InCall,
    /// Inside a `<tool_call>` in the streamable form, its name sent: `pending` holds at most a
    /// possible start of `</tool_call>`, the arguments go out as they come.
    StreamingCall(Arguments),
    /// The output opened with `{` or `<|python_tag|>`: held whole until the end (Llama's form).
    WholeJson,
}

/// Finds calls in the model's text as it arrives, and lets out the content around them and the
/// calls: a call in the form Qwen writes (name, then an arguments object) as soon as its name is
/// known, then its arguments piece by piece; any other block whole once it closed. The
/// whitespace around the content is dropped (leading at once, trailing held until more content
/// follows), so the streamed content adds up to the non-streaming one. A whole output goes
/// through the same machine ([`CallParser::parse`]).
#[derive(Debug, Clone)]
pub struct CallParser {
    names: Vec<String>,
    mode: Mode,
    /// Text seen but not yet let out (see [`Mode`]).
    pending: String,
    /// Trailing whitespace of the content let out so far, sent once more content follows.
    held_space: String,
    /// Whether any content was let out (leading whitespace is dropped until then).
    content_started: bool,
}

impl CallParser {
    /// `names`: the request's tool names (Llama's bare-JSON form must name one).
    pub fn new(names: Vec<String>) -> Self {
        Self { names, mode: Mode::Start, pending: String::new(), held_space: String::new(), content_started: false }
    }

    /// The calls and content of a whole output.
    pub fn parse(text: &str, names: Vec<String>) -> ParsedMessage {
        let mut parser = Self::new(names);
        let mut pieces = parser.push(text);
        pieces.extend(parser.finish());
        ParsedMessage::from_pieces(pieces)
    }

    /// Takes the next piece of output; returns what can be let out now.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.mode {
                Mode::Start => {
                    let head = self.pending.trim_start();
                    if head.is_empty() || (PYTHON_TAG.starts_with(head) && head.len() < PYTHON_TAG.len()) {
                        return out;
                    }
                    self.mode = if head.starts_with('{') || head.starts_with(PYTHON_TAG) { Mode::WholeJson } else { Mode::Text };
                }
                Mode::Text => match self.pending.find(CALL_OPEN) {
                    Some(at) => {
                        let before: String = self.pending.drain(..at + CALL_OPEN.len()).collect();
                        self.content(&before[..at], &mut out);
                        self.mode = Mode::InCall;
                    }
                    None => {
                        let keep = partial_tag_len(&self.pending, CALL_OPEN);
                        let sendable: String = self.pending.drain(..self.pending.len() - keep).collect();
                        self.content(&sendable, &mut out);
                        return out;
                    }
                },
                Mode::InCall if matches!(self.call_head(), Head::Streamable { .. }) => {
                    let Head::Streamable { name, len } = self.call_head() else { unreachable!("matched above") };
                    self.pending.drain(..len);
                    out.push(Piece::CallStart(name));
                    self.mode = Mode::StreamingCall(Arguments::default());
                }
                Mode::StreamingCall(ref mut args) => {
                    let (raw, closed) = match self.pending.find(CALL_CLOSE) {
                        Some(at) => {
                            let raw: String = self.pending.drain(..at + CALL_CLOSE.len()).collect();
                            (raw[..at].to_string(), true)
                        }
                        None => {
                            let keep = partial_tag_len(&self.pending, CALL_CLOSE);
                            (self.pending.drain(..self.pending.len() - keep).collect(), false)
                        }
                    };
                    let mut text = args.push(&raw);
                    if closed {
                        text.push_str(&args.close());
                        self.mode = Mode::Text;
                    }
                    if !text.is_empty() {
                        out.push(Piece::CallArguments(text));
                    }
                    if !closed {
                        return out;
                    }
                }
                Mode::InCall => match self.pending.find(CALL_CLOSE) {
                    Some(at) => {
                        let block: String = self.pending.drain(..at + CALL_CLOSE.len()).collect();
                        let body = &block[..at];
                        match parse_hermes_body(body) {
                            Some(call) => out.push(Piece::Call(call)),
                            None => self.content(&format!("{CALL_OPEN}{block}"), &mut out),
                        }
                        self.mode = Mode::Text;
                    }
                    None => return out,
                },
                Mode::WholeJson => return out,
            }
        }
    }

    /// How the call in `pending` begins (the text before a `</tool_call>` only).
    fn call_head(&self) -> Head {
        streamable_head(self.pending.find(CALL_CLOSE).map_or(&self.pending[..], |at| &self.pending[..at]))
    }

    /// The end of the output: lets out whatever was held. A `<tool_call>` left open is a call if
    /// its body parses; bare JSON is a call if it is one.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        let pending = std::mem::take(&mut self.pending);
        match std::mem::replace(&mut self.mode, Mode::Text) {
            Mode::Start | Mode::Text => self.content(&pending, &mut out),
            Mode::StreamingCall(mut args) => {
                let text = args.push(&pending) + &args.close();
                if !text.is_empty() {
                    out.push(Piece::CallArguments(text));
                }
            }
            Mode::InCall => match parse_hermes_body(&pending) {
                Some(call) => out.push(Piece::Call(call)),
                None => self.content(&format!("{CALL_OPEN}{pending}"), &mut out),
            },
            Mode::WholeJson => match parse_json_calls(&pending, &self.names) {
                Some(calls) => out.extend(calls.into_iter().map(Piece::Call)),
                None => self.content(&pending, &mut out),
            },
        }
        self.mode = Mode::Text;
        self.held_space.clear();
        out
    }

    /// Lets out `text` as content, trimming the whitespace at the content's two ends.
    fn content(&mut self, text: &str, out: &mut Vec<Piece>) {
        let mut text = std::mem::take(&mut self.held_space) + text;
        if !self.content_started {
            text = text.trim_start().to_string();
        }
        let body_len = text.trim_end().len();
        self.held_space = text.split_off(body_len);
        if !text.is_empty() {
            self.content_started = true;
            out.push(Piece::Content(text));
        }
    }
}

/// The length of the longest end of `text` that is a proper start of `tag`.
pub(crate) fn partial_tag_len(text: &str, tag: &str) -> usize {
    (1..tag.len().min(text.len() + 1)).rev().find(|&n| text.is_char_boundary(text.len() - n) && tag.starts_with(&text[text.len() - n..])).unwrap_or(0)
}

/// A new call id (`call_` + 24 hex digits), unique in this process.
pub fn call_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("call_{:016x}{:08x}", crate::unix_now(), n as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        vec!["get_weather".into(), "now".into()]
    }

    fn call(name: &str, arguments: &str) -> ParsedCall {
        ParsedCall { name: name.into(), arguments: arguments.into() }
    }

    #[test]
    fn hermes_calls_become_tool_calls_and_the_rest_content() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
        let m = CallParser::parse(text, names());
        assert_eq!(m.content.as_deref(), Some("Let me check."));
        assert_eq!(m.calls, vec![call("get_weather", r#"{"city":"Paris"}"#), call("now", "{}")]);
    }

    #[test]
    fn a_call_alone_has_null_content() {
        let m = CallParser::parse("<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>\n", names());
        assert_eq!(m, ParsedMessage { content: None, calls: vec![call("now", "{}")] });
    }

    #[test]
    fn an_unclosed_last_call_still_parses_if_its_json_does() {
        let m = CallParser::parse("<tool_call>\n{\"name\": \"now\", \"arguments\": {}}", names());
        assert_eq!(m.calls, vec![call("now", "{}")]);
        let m = CallParser::parse("<tool_call>\n{\"name\": \"now\", \"argum", names());
        assert_eq!(m, ParsedMessage { content: Some("<tool_call>\n{\"name\": \"now\", \"argum".into()), calls: vec![] });
    }

    #[test]
    fn text_that_only_looks_like_a_call_stays_content() {
        for text in [
            "<tool_call>\nnot json\n</tool_call>",
            "<tool_call>{\"arguments\": {}}</tool_call>",
            "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>",
            "I would use <tool_call but no.",
        ] {
            let m = CallParser::parse(text, names());
            assert_eq!(m, ParsedMessage { content: Some(text.into()), calls: vec![] }, "{text}");
        }
    }

    #[test]
    fn llama_json_calls_must_name_a_tool() {
        let m = CallParser::parse(" {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}", names());
        assert_eq!(m, ParsedMessage { content: None, calls: vec![call("get_weather", r#"{"city":"Oslo"}"#)] });
        let m = CallParser::parse(
            "<|python_tag|>{\"name\": \"now\", \"parameters\": {}}; {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}",
            names(),
        );
        assert_eq!(m.calls, vec![call("now", "{}"), call("get_weather", r#"{"city":"Rome"}"#)]);
        let text = "{\"name\": \"Bob\", \"parameters\": {}}";
        assert_eq!(CallParser::parse(text, names()), ParsedMessage { content: Some(text.into()), calls: vec![] });
        let text = "{\"answer\": 42}";
        assert_eq!(CallParser::parse(text, names()).content.as_deref(), Some(text));
    }

    #[test]
    fn arguments_given_as_a_json_string_are_unwrapped() {
        let m = CallParser::parse("<tool_call>{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Paris\\\"}\"}</tool_call>", names());
        assert_eq!(m.calls, vec![call("get_weather", r#"{"city":"Paris"}"#)]);
    }

    #[test]
    fn streaming_in_any_pieces_gives_the_whole_parse() {
        let texts = [
            "  Sure.\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Köln\"}}\n</tool_call>\nand <tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>  ",
            "plain answer with < and <tool and </tool_call> in it\n",
            "<tool_call>\nbroken\n</tool_call> tail",
            "{\"name\": \"now\", \"parameters\": {}}",
            "<|python_tag|>{\"name\": \"now\", \"parameters\": {}}",
            "<|pyth",
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"a}\\\"}\", \"n\": {\"x\": [1, {}]}}}\n</tool_call>",
            "<tool_call>{\"name\": \"now\", \"arguments\": {} }   ",
            "<tool_call>{\"name\": \"now\"</tool_call> x",
        ];
        for text in texts {
            let whole = CallParser::parse(text, names());
            let chars: Vec<char> = text.chars().collect();
            for step in [1, 2, 3, 7] {
                let mut parser = CallParser::new(names());
                let mut pieces = Vec::new();
                for chunk in chars.chunks(step) {
                    pieces.extend(parser.push(&chunk.iter().collect::<String>()));
                }
                pieces.extend(parser.finish());
                assert_eq!(ParsedMessage::from_pieces(pieces), whole, "{text:?} in pieces of {step}");
            }
        }
    }

    #[test]
    fn content_before_a_call_is_let_out_before_the_call_closes() {
        let mut p = CallParser::new(names());
        assert_eq!(p.push("Checking the weather <tool"), vec![Piece::Content("Checking the weather".into())]);
        assert_eq!(p.push("_call>\n{\"name\": \"now\", "), vec![]);
        assert_eq!(p.push("\"arguments\": {}}\n</tool_call>"), vec![Piece::CallStart("now".into()), Piece::CallArguments("{}".into())]);
        assert_eq!(p.finish(), vec![]);
    }

    /// A call in Qwen's form goes out as it is written: its name as soon as it is known, then its
    /// arguments in fragments (whitespace outside strings dropped, the call object's closing
    /// brace held back and dropped), adding up to the whole parse's arguments.
    #[test]
    fn a_call_streams_its_name_then_its_arguments_in_fragments() {
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Köln } \\\" x\", \"days\": [1, 2], \"opts\": {\"unit\": \"C\"}}}\n</tool_call>";
        let whole = CallParser::parse(text, names());
        assert_eq!(whole.calls, vec![call("get_weather", r#"{"city":"Köln } \" x","days":[1,2],"opts":{"unit":"C"}}"#)]);
        let serde: Value = serde_json::from_str(&whole.calls[0].arguments).unwrap();
        assert_eq!(serde["city"], "Köln } \" x");
        let mut p = CallParser::new(names());
        assert_eq!(p.push("<tool_call>\n{\"name\": \"get_wea"), vec![]);
        assert_eq!(p.push("ther\", \"arguments\": "), vec![]);
        assert_eq!(p.push("{\"city\": \"Kö"), vec![Piece::CallStart("get_weather".into()), Piece::CallArguments("{\"city\":\"Kö".into())]);
        assert_eq!(p.push("ln\", \"opts\": {\"unit\": \"C\"}"), vec![Piece::CallArguments("ln\",\"opts\":{\"unit\":\"C\"".into())]);
        assert_eq!(p.push("}}\n</tool"), vec![]);
        assert_eq!(p.push("_call>"), vec![Piece::CallArguments("}}".into())]);
        assert_eq!(p.finish(), vec![]);
        // the name is not first, or the arguments are no object: the block is parsed whole
        for text in [
            "<tool_call>{\"arguments\": {\"city\": \"Rome\"}, \"name\": \"get_weather\"}</tool_call>",
            "<tool_call>{\"name\": \"now\", \"arguments\": \"{}\"}</tool_call>",
        ] {
            let mut p = CallParser::new(names());
            let mut pieces = p.push(text);
            pieces.extend(p.finish());
            assert!(matches!(&pieces[..], [Piece::Call(_)]), "{text}: {pieces:?}");
        }
    }

    #[test]
    fn partial_tags_are_held_back() {
        assert_eq!(partial_tag_len("abc <tool_c", CALL_OPEN), 7);
        assert_eq!(partial_tag_len("abc <", CALL_OPEN), 1);
        assert_eq!(partial_tag_len("abc", CALL_OPEN), 0);
        assert_eq!(partial_tag_len("é<", CALL_OPEN), 1);
    }
}
