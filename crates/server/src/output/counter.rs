//! Counts an output's reasoning tokens by token id, as the writers see them (OpenAI's
//! `usage.completion_tokens_details.reasoning_tokens`): think blocks (`reasoning`'s tags) or
//! harmony's analysis messages (`harmony`'s tags).

use super::harmony;
use crate::reasoning::{THINK_CLOSE, THINK_OPEN};
use specula_engine::types::TokenId;
use specula_model::Tokenizer;
use std::sync::Arc;

/// Counts, by token id, the output tokens a thinking model spent reasoning (OpenAI's
/// `reasoning_tokens`): a think block's from its opening tag (from the output's start when the
/// prompt opened it) through `</think>`; with harmony, each `analysis` message from its
/// `<|channel|>` through its `<|end|>` (the `<|start|>assistant` before a later message is not
/// counted: it names no channel yet). Tags a vocabulary does not hold as single tokens: nothing
/// is counted.
#[derive(Clone)]
pub struct ReasoningCounter {
    mode: CountMode,
    count: usize,
}

#[derive(Clone)]
enum CountMode {
    None,
    /// `inside` the think block; `done` once it closed (one block per output).
    Think {
        open: TokenId,
        close: TokenId,
        inside: bool,
        done: bool,
    },
    Harmony {
        channel: TokenId,
        message: TokenId,
        end: TokenId,
        tokenizer: Arc<Tokenizer>,
        /// A header being read (from its `<|channel|>` on).
        header: Option<Vec<TokenId>>,
        /// Inside a message's body, and whether it is an analysis message.
        body: Option<bool>,
    },
}

impl ReasoningCounter {
    /// `opened`: `Some` when the template thinks, `true` when the prompt opened the think block
    /// (as `OutputParser::new` takes it); with `harmony`, harmony's channels.
    pub fn new(tokenizer: &Arc<Tokenizer>, opened: Option<bool>, harmony: bool) -> Self {
        let id = |t: &str| tokenizer.token_to_id(t);
        let mode = if harmony {
            match (id(harmony::CHANNEL), id(harmony::MESSAGE), id(harmony::END)) {
                (Some(channel), Some(message), Some(end)) => {
                    CountMode::Harmony { channel, message, end, tokenizer: tokenizer.clone(), header: None, body: None }
                }
                _ => CountMode::None,
            }
        } else {
            match (opened, id(THINK_OPEN), id(THINK_CLOSE)) {
                (Some(opened), Some(open), Some(close)) => CountMode::Think { open, close, inside: opened, done: false },
                _ => CountMode::None,
            }
        };
        Self { mode, count: 0 }
    }

    /// Takes the next output tokens.
    pub fn feed(&mut self, tokens: &[TokenId]) {
        for &t in tokens {
            match &mut self.mode {
                CountMode::None => return,
                CountMode::Think { open, close, inside, done } => {
                    if *done {
                        return;
                    }
                    if !*inside && t == *open {
                        *inside = true;
                    }
                    if *inside {
                        self.count += 1;
                        if t == *close {
                            (*inside, *done) = (false, true);
                        }
                    }
                }
                CountMode::Harmony { channel, message, end, tokenizer, header, body } => {
                    if let Some(h) = header.as_mut() {
                        if t == *message {
                            let name = tokenizer.decode(&h[1..], false).unwrap_or_default();
                            let analysis = name.trim_start().starts_with("analysis");
                            if analysis {
                                self.count += h.len() + 1;
                            }
                            (*header, *body) = (None, Some(analysis));
                        } else {
                            h.push(t);
                        }
                    } else if t == *channel {
                        (*header, *body) = (Some(vec![t]), None);
                    } else if let Some(analysis) = *body {
                        self.count += usize::from(analysis);
                        if t == *end {
                            *body = None;
                        }
                    }
                }
            }
        }
    }

    /// Whether this output can have reasoning tokens (a thinking or harmony template whose tags
    /// are single tokens).
    pub fn counts(&self) -> bool {
        !matches!(self.mode, CountMode::None)
    }

    /// Reasoning tokens counted so far.
    pub fn count(&self) -> usize {
        self.count
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reasoning::{THINK_CLOSE, THINK_OPEN};
    use specula_model::tokenizer::GgufTokenizerSpec;

    /// Byte tokens (ids 0..256), then `extra` as control tokens (ids 256...).
    fn tokenizer(extra: &[&str]) -> Arc<Tokenizer> {
        let mut tokens: Vec<String> = (0..=255u8).map(|b| specula_model::testing::byte_token(b).to_string()).collect();
        let mut token_types = vec![1; tokens.len()];
        for t in extra {
            tokens.push(t.to_string());
            token_types.push(3);
        }
        Arc::new(Tokenizer::from_gguf(GgufTokenizerSpec { model: "gpt2", pre: None, tokens, token_types, ..Default::default() }).unwrap())
    }

    fn count(tok: &Arc<Tokenizer>, opened: Option<bool>, harmony: bool, text: &str, piece: usize) -> usize {
        let ids = tok.encode(text).unwrap();
        let mut c = ReasoningCounter::new(tok, opened, harmony);
        ids.chunks(piece).for_each(|p| c.feed(p));
        c.count()
    }

    #[test]
    fn a_think_block_counts_from_its_opening_through_its_closing_tag() {
        let tok = tokenizer(&[THINK_OPEN, THINK_CLOSE]);
        let n = |s: &str| tok.encode(s).unwrap().len();
        let thought = "<think>\nsum them\n</think>";
        for piece in [1, 3, 64] {
            assert_eq!(count(&tok, Some(false), false, &format!("{thought}\n\nx + y"), piece), n(thought), "fed {piece} at a time");
            // the prompt opened the block: from the output's first token
            assert_eq!(count(&tok, Some(true), false, "sum them\n</think>\n\nx + y", piece), n("sum them\n</think>"));
            // a block that never closes is all reasoning; a second one is not read
            assert_eq!(count(&tok, Some(true), false, "still thinking", piece), n("still thinking"));
            assert_eq!(count(&tok, Some(false), false, &format!("{thought} a {thought}"), piece), n(thought));
            // no block opened, or a template that does not think
            assert_eq!(count(&tok, Some(false), false, "x + y", piece), 0);
            assert_eq!(count(&tok, None, false, thought, piece), 0);
        }
        // tags that are not single tokens: nothing is counted
        assert!(!ReasoningCounter::new(&tokenizer(&[]), Some(true), false).counts());
    }

    #[test]
    fn harmony_counts_the_analysis_messages() {
        let tok = tokenizer(&["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>"]);
        let n = |s: &str| tok.encode(s).unwrap().len();
        let analysis = "<|channel|>analysis<|message|>Add them.<|end|>";
        let out = format!("{analysis}<|start|>assistant<|channel|>final<|message|>x + y<|return|>");
        for piece in [1, 2, 64] {
            assert_eq!(count(&tok, None, true, &out, piece), n(analysis), "fed {piece} at a time");
            let two = format!("{analysis}<|start|>assistant<|channel|>commentary<|message|>calling<|end|>{out}");
            assert_eq!(count(&tok, None, true, &two, piece), 2 * n(analysis));
            assert_eq!(count(&tok, None, true, "<|channel|>final<|message|>x<|return|>", piece), 0);
        }
    }
}
