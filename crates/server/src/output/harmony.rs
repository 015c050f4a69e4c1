//! gpt-oss's harmony output format, read into the shared output pieces: its messages are
//! `[<|start|>assistant[ to=RECIPIENT]]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>FMT]<|message|>BODY`
//! ended by `<|end|>` (or by `<|return|>` / `<|call|>`, the stop tokens that end generation and
//! bring no text). The `analysis` channel is reasoning, `final` the answer, and a `commentary`
//! message addressed to `functions.NAME` a tool call whose body is its JSON arguments (other
//! commentary, the model's preamble to its calls, is answer text). Text before any header (a
//! model that does not speak harmony) is answer text. Streamed: bodies are let out as they
//! arrive, holding back only what could be the start of `<|end|>`; headers are read whole.

use super::Out;
use crate::tools::{partial_tag_len, ParsedCall, Piece};

const START: &str = "<|start|>";
pub(crate) const CHANNEL: &str = "<|channel|>";
pub(crate) const MESSAGE: &str = "<|message|>";
pub(crate) const END: &str = "<|end|>";

/// Whether a chat template writes harmony (gpt-oss's): it has both channel and message tags.
pub fn template_speaks_harmony(source: &str) -> bool {
    source.contains(CHANNEL) && source.contains(MESSAGE)
}

/// What the message being read is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    Reasoning,
    Answer,
    /// A call to this tool: its body is buffered whole and parsed at the end.
    Call(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// Between messages: a header (or plain text) comes next.
    Header,
    /// Inside a message's body.
    Body(Kind),
}

#[derive(Debug, Clone)]
pub struct HarmonyParser {
    state: State,
    pending: String,
    /// Whether calls are parsed (the request has tools); otherwise a call's body is answer text.
    parses_calls: bool,
}

impl HarmonyParser {
    pub fn new(parses_calls: bool) -> Self {
        Self { state: State::Header, pending: String::new(), parses_calls }
    }

    pub fn push(&mut self, text: &str) -> Vec<Out> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        loop {
            match &self.state {
                State::Header => {
                    let Some(at) = self.pending.find(MESSAGE) else {
                        // no header yet: text that cannot begin one is plain answer text
                        if !self.pending.is_empty() && !could_be_header(&self.pending) {
                            let text = std::mem::take(&mut self.pending);
                            out.push(Out::Piece(Piece::Content(text)));
                        }
                        return out;
                    };
                    let header: String = self.pending.drain(..at + MESSAGE.len()).collect();
                    self.state = State::Body(self.kind_of(&header[..at]));
                }
                State::Body(kind) => {
                    let kind = kind.clone();
                    match self.pending.find(END) {
                        Some(at) => {
                            let body: String = self.pending.drain(..at + END.len()).collect();
                            self.emit(&kind, &body[..at], true, &mut out);
                            self.state = State::Header;
                        }
                        None => {
                            if matches!(kind, Kind::Call(_)) {
                                return out; // parsed whole
                            }
                            let keep = partial_tag_len(&self.pending, END);
                            let body: String = self.pending.drain(..self.pending.len() - keep).collect();
                            self.emit(&kind, &body, false, &mut out);
                            return out;
                        }
                    }
                }
            }
        }
    }

    /// The end of the output (a stop token, or the length limit): whatever was held back.
    pub fn finish(&mut self) -> Vec<Out> {
        let pending = std::mem::take(&mut self.pending);
        let mut out = Vec::new();
        match std::mem::replace(&mut self.state, State::Header) {
            State::Body(kind) => self.emit(&kind, &pending, true, &mut out),
            // a header cut short says nothing; plain text is answer text
            State::Header if !pending.is_empty() && !pending.contains(CHANNEL) && !pending.starts_with(START) => out.push(Out::Piece(Piece::Content(pending))),
            State::Header => {}
        }
        out
    }

    fn kind_of(&self, header: &str) -> Kind {
        let channel = header.split(CHANNEL).nth(1).unwrap_or_default();
        let channel_name = channel.split([' ', '<']).next().unwrap_or_default();
        let recipient = header.split_whitespace().find_map(|w| w.strip_prefix("to=")).map(|r| r.split('<').next().unwrap_or(r).to_string());
        match (channel_name, recipient) {
            ("analysis", _) => Kind::Reasoning,
            (_, Some(r)) if self.parses_calls && r.starts_with("functions.") => Kind::Call(r["functions.".len()..].to_string()),
            _ => Kind::Answer,
        }
    }

    /// Lets out a body (or part of one); `whole`: the body ended (a call is parsed then).
    fn emit(&self, kind: &Kind, body: &str, whole: bool, out: &mut Vec<Out>) {
        match kind {
            Kind::Reasoning if !body.is_empty() => out.push(Out::Reasoning(body.to_string())),
            Kind::Answer if !body.is_empty() => out.push(Out::Piece(Piece::Content(body.to_string()))),
            Kind::Call(name) if whole => match serde_json::from_str::<serde_json::Value>(body.trim()) {
                Ok(args @ serde_json::Value::Object(_)) => out.push(Out::Piece(Piece::Call(ParsedCall { name: name.clone(), arguments: args.to_string() }))),
                // not a JSON object: what the model wrote stays visible as text
                _ if !body.is_empty() => out.push(Out::Piece(Piece::Content(body.to_string()))),
                _ => {}
            },
            _ => {}
        }
    }
}

/// Whether `text` (no `<|message|>` yet) may still be a message header: it starts with (a prefix
/// of) `<|start|>` or `<|channel|>`.
fn could_be_header(text: &str) -> bool {
    [START, CHANNEL].iter().any(|tag| text.starts_with(tag) || tag.starts_with(text))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(chunks: &[&str], calls: bool) -> Vec<Out> {
        let mut p = HarmonyParser::new(calls);
        let mut out: Vec<Out> = chunks.iter().flat_map(|c| p.push(c)).collect();
        out.extend(p.finish());
        out
    }

    /// Joins runs of the same kind (streaming cuts them differently).
    fn joined(outs: Vec<Out>) -> Vec<Out> {
        let mut v: Vec<Out> = Vec::new();
        for o in outs {
            match (v.last_mut(), o) {
                (Some(Out::Reasoning(a)), Out::Reasoning(b)) => a.push_str(&b),
                (Some(Out::Piece(Piece::Content(a))), Out::Piece(Piece::Content(b))) => a.push_str(&b),
                (_, o) => v.push(o),
            }
        }
        v
    }

    const ANSWER: &str = "<|channel|>analysis<|message|>The user greets me.<|end|><|start|>assistant<|channel|>final<|message|>Hello! How can I help?";
    const CALL: &str = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}";

    #[test]
    fn analysis_is_reasoning_and_final_is_the_answer_however_the_stream_is_cut() {
        let want = vec![Out::Reasoning("The user greets me.".into()), Out::Piece(Piece::Content("Hello! How can I help?".into()))];
        assert_eq!(joined(read(&[ANSWER], false)), want);
        let chars: Vec<char> = ANSWER.chars().collect();
        for size in 1..9 {
            let chunks: Vec<String> = chars.chunks(size).map(|c| c.iter().collect()).collect();
            let refs: Vec<&str> = chunks.iter().map(String::as_str).collect();
            let got = read(&refs, false);
            assert!(got.iter().all(|o| !matches!(o, Out::Reasoning(t) | Out::Piece(Piece::Content(t)) if t.contains("<|"))), "a tag leaked: {got:?}");
            assert_eq!(joined(got), want, "chunks of {size}");
        }
    }

    #[test]
    fn a_commentary_message_to_a_function_is_a_call_in_either_header_order() {
        let call = Out::Piece(Piece::Call(ParsedCall { name: "get_weather".into(), arguments: "{\"city\":\"Paris\"}".into() }));
        assert_eq!(joined(read(&[CALL], true)), vec![Out::Reasoning("Need the weather.".into()), call.clone()]);
        // the recipient in the role part, as the chat template writes past calls
        let role_first = "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Paris\"}";
        assert_eq!(joined(read(&[role_first], true)), vec![call]);
        // without tools in the request the body is text
        assert_eq!(joined(read(&[role_first], false)), vec![Out::Piece(Piece::Content("{\"city\": \"Paris\"}".into()))]);
        // arguments that are not a JSON object stay visible
        let broken = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\": ";
        assert_eq!(joined(read(&[broken], true)), vec![Out::Piece(Piece::Content("{\"a\": ".into()))]);
    }

    #[test]
    fn text_without_headers_is_the_answer_and_a_cut_body_is_kept() {
        assert_eq!(joined(read(&["Just an answer."], true)), vec![Out::Piece(Piece::Content("Just an answer.".into()))]);
        // ran out of tokens while thinking: all reasoning, nothing held back
        assert_eq!(joined(read(&["<|channel|>analysis<|message|>Let me think <|en"], false)), vec![Out::Reasoning("Let me think <|en".into())]);
        // a header cut short says nothing
        assert!(read(&["<|channel|>analy"], false).is_empty());
        assert!(template_speaks_harmony("{{- '<|start|>assistant<|channel|>final<|message|>' }}"));
        assert!(!template_speaks_harmony("<|im_start|>assistant"));
    }
}
