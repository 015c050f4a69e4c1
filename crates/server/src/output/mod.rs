//! The output side every dialect shares: one parser that splits a choice's text into reasoning,
//! answer and tool calls ([`OutputParser`]: think blocks through `reasoning`, then tool calls
//! through `tools`; or gpt-oss's channels through [`harmony`]), the blocks those make
//! ([`Blocks`]: thinking, text, tool call, in order), which each dialect writes in its own shapes,
//! and the count of reasoning tokens ([`ReasoningCounter`]). Not for the request side (the
//! conversation a dialect is parsed into and its prompt: `conversation.rs`).

mod counter;
pub mod harmony;

use crate::reasoning::{ReasoningParser, ReasoningPiece};
use crate::tools::{self, CallParser, ParsedCall, Piece};
pub use counter::ReasoningCounter;
use harmony::HarmonyParser;

/// What the output parser lets out: reasoning, or what the call parser made of the answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Out {
    Reasoning(String),
    Piece(Piece),
}

/// The one output parser: reasoning first (when the template thinks), the answer through the
/// tool-call parser (when calls are parsed), else passed on as it is; or, for a harmony
/// template (gpt-oss), the harmony reader, which yields all three.
#[derive(Debug, Clone)]
pub struct OutputParser {
    reasoning: Option<ReasoningParser>,
    calls: Option<CallParser>,
    harmony: Option<HarmonyParser>,
    parses_calls: bool,
}

/// A whole output, read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParsedTurn {
    pub reasoning: Option<String>,
    /// Without a call parser the text as generated (possibly empty); with one, the text around
    /// the calls, trimmed, `None` when nothing is left.
    pub content: Option<String>,
    pub calls: Vec<ParsedCall>,
}

impl OutputParser {
    /// `reasoning`: `Some(opened)` when the template thinks; `tool_names`: when calls are parsed;
    /// `harmony`: the template speaks harmony.
    pub fn new(reasoning: Option<bool>, tool_names: Option<Vec<String>>, harmony: bool) -> Self {
        let parses_calls = tool_names.is_some();
        if harmony {
            return Self { reasoning: None, calls: None, harmony: Some(HarmonyParser::new(parses_calls)), parses_calls };
        }
        Self { reasoning: reasoning.map(ReasoningParser::new), calls: tool_names.map(CallParser::new), harmony: None, parses_calls }
    }

    /// Whether the text passes through untouched (no reasoning, no calls).
    pub fn is_plain(&self) -> bool {
        self.reasoning.is_none() && self.calls.is_none() && self.harmony.is_none()
    }

    pub fn push(&mut self, text: &str) -> Vec<Out> {
        if let Some(h) = self.harmony.as_mut() {
            return h.push(text);
        }
        match self.reasoning.as_mut() {
            Some(r) => {
                let pieces = r.push(text);
                self.answer(pieces)
            }
            None => self.content(text),
        }
    }

    pub fn finish(&mut self) -> Vec<Out> {
        if let Some(h) = self.harmony.as_mut() {
            return h.finish();
        }
        let mut out = match self.reasoning.as_mut() {
            Some(r) => {
                let pieces = r.finish();
                self.answer(pieces)
            }
            None => Vec::new(),
        };
        if let Some(calls) = self.calls.as_mut() {
            out.extend(calls.finish().into_iter().map(Out::Piece));
        }
        out
    }

    fn answer(&mut self, pieces: Vec<ReasoningPiece>) -> Vec<Out> {
        let mut out = Vec::new();
        for piece in pieces {
            match piece {
                ReasoningPiece::Reasoning(r) => out.push(Out::Reasoning(r)),
                ReasoningPiece::Content(c) => out.extend(self.content(&c)),
            }
        }
        out
    }

    fn content(&mut self, text: &str) -> Vec<Out> {
        match self.calls.as_mut() {
            Some(calls) => calls.push(text).into_iter().map(Out::Piece).collect(),
            None if text.is_empty() => Vec::new(),
            None => vec![Out::Piece(Piece::Content(text.to_string()))],
        }
    }

    /// Reads a whole output; the same as feeding it piece by piece.
    pub fn parse(mut self, text: &str) -> ParsedTurn {
        let parses_calls = self.parses_calls;
        let mut outs = self.push(text);
        outs.extend(self.finish());
        let mut reasoning = None::<String>;
        let mut pieces = Vec::new();
        for out in outs {
            match out {
                Out::Reasoning(r) => reasoning.get_or_insert_with(String::new).push_str(&r),
                Out::Piece(p) => pieces.push(p),
            }
        }
        let message = tools::ParsedMessage::from_pieces(pieces);
        let content = if parses_calls { message.content } else { Some(message.content.unwrap_or_default()) };
        ParsedTurn { reasoning, content, calls: message.calls }
    }
}

/// What an output block holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlockKind {
    Reasoning,
    Text,
    /// A tool call: `id` is `call_...` (each dialect may respell it).
    Call {
        id: String,
        name: String,
    },
}

/// One block of the output, whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    pub kind: BlockKind,
    /// The reasoning, the text, or the call's arguments (compact JSON).
    pub text: String,
}

/// The output as a dialect streams it: a block starts, grows, stops; `usize` is its index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlockEvent {
    Start(usize, BlockKind),
    Delta(usize, String),
    Stop(usize),
}

/// Turns parser output into blocks: a new block starts whenever the kind changes, and each call
/// is its own block. Keeps every block whole too ([`Blocks::done`]), for the final response.
#[derive(Debug, Default)]
pub struct Blocks {
    open: bool,
    /// Every block so far (the last one open while `open`).
    pub done: Vec<Block>,
}

impl Blocks {
    pub fn feed(&mut self, outs: Vec<Out>) -> Vec<BlockEvent> {
        let mut events = Vec::new();
        for out in outs {
            match out {
                Out::Reasoning(t) => self.grow(BlockKind::Reasoning, t, &mut events),
                Out::Piece(Piece::Content(t)) => self.grow(BlockKind::Text, t, &mut events),
                Out::Piece(Piece::Call(call)) => {
                    self.start(BlockKind::Call { id: tools::call_id(), name: call.name }, &mut events);
                    self.grow_open(call.arguments, &mut events);
                    events.extend(self.close());
                }
                Out::Piece(Piece::CallStart(name)) => self.start(BlockKind::Call { id: tools::call_id(), name }, &mut events),
                Out::Piece(Piece::CallArguments(t)) => self.grow_open(t, &mut events),
            }
        }
        events
    }

    /// Stops the open block, if any.
    pub fn close(&mut self) -> Vec<BlockEvent> {
        if std::mem::take(&mut self.open) {
            vec![BlockEvent::Stop(self.done.len() - 1)]
        } else {
            Vec::new()
        }
    }

    /// The calls among the blocks: `(id, name, arguments)`.
    pub fn calls(&self) -> impl Iterator<Item = (&str, &str, &str)> {
        self.done.iter().filter_map(|b| match &b.kind {
            BlockKind::Call { id, name } => Some((id.as_str(), name.as_str(), b.text.as_str())),
            _ => None,
        })
    }

    fn start(&mut self, kind: BlockKind, events: &mut Vec<BlockEvent>) {
        events.extend(self.close());
        self.done.push(Block { kind: kind.clone(), text: String::new() });
        self.open = true;
        events.push(BlockEvent::Start(self.done.len() - 1, kind));
    }

    /// Appends to the open block of this kind, or starts one.
    fn grow(&mut self, kind: BlockKind, text: String, events: &mut Vec<BlockEvent>) {
        if text.is_empty() {
            return;
        }
        if !(self.open && self.done.last().is_some_and(|b| b.kind == kind)) {
            self.start(kind, events);
        }
        self.grow_open(text, events);
    }

    fn grow_open(&mut self, text: String, events: &mut Vec<BlockEvent>) {
        if let (true, Some(block)) = (self.open, self.done.last_mut()) {
            if !text.is_empty() {
                block.text.push_str(&text);
                events.push(BlockEvent::Delta(self.done.len() - 1, text));
            }
        }
    }
}
