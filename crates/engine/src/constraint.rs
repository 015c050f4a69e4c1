//! Structured outputs: a request's [`Constraint`] compiled by llguidance into a per-sequence
//! [`Grammar`] that says, before each sampled token, which tokens keep the output inside the
//! language (a mask applied to the logits), and advances on the tokens the sequence accepts.
//!
//! - [`ConstraintCompiler`]: the tokenizer as llguidance sees it (a token trie over every token's
//!   bytes, `Tokenizer::token_bytes`), built once per tokenizer and shared. A request's constraint
//!   is compiled once ([`compile`]), by the front end on its blocking pool, within
//!   [`GrammarBudget`]; the engine thread never compiles, it receives the [`Grammar`] with the
//!   request (`GenerateRequest::grammar`), one clone per choice.
//! - [`Grammar`]: one sequence's matcher. It travels with the sequence's sampling state like its
//!   random stream (`SampleItem`, `SeqResult`), so sync and async scheduling mask alike.
//!
//! Not here: where the mask is applied (the compute job, `runner::job`) and how speculation uses
//! it (docs/architecture.md, "Structured outputs").

use crate::types::{Draft, TokenId};
use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{InferenceCapabilities, SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use specula_model::Tokenizer;
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// A language the output must stay inside, as the front end asked for it. The engine compiles it
/// (llguidance) once per request; an invalid one is refused before the request runs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Constraint {
    /// Any JSON object (`response_format: {type: json_object}`).
    JsonObject,
    /// JSON valid for this JSON Schema (the schema's JSON text).
    JsonSchema(String),
    /// Text matching this regular expression (whole output).
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A Lark grammar as llguidance reads it (may embed `%json { ... }`).
    Lark(String),
}

/// A thinking model's reasoning budget (Anthropic's `thinking.budget_tokens`, vLLM's
/// `thinking_token_budget`): at most `tokens` tokens between the think block's opening and its
/// closing token; the one after the last is forced to be `close`. Enforced as a grammar (the
/// sequence's [`Grammar`] starts in this phase), so it is exact under speculation and async
/// scheduling like any constraint: the forced tokens are one-hot masks, drafted by jump-forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReasoningBudget {
    /// Most tokens inside the think block (its opening and closing tokens not counted).
    pub tokens: usize,
    /// The opening token the output must start with; `None` when the prompt already opened the
    /// block (DeepSeek-R1's generation prompt ends with `<think>`).
    pub open: Option<TokenId>,
    /// The closing token (`</think>`), forced once the budget is spent.
    pub close: TokenId,
}

/// Most forced tokens proposed as drafts per step when the engine has no speculative method
/// (jump-forward, `EngineConfig::jump_forward`); with one, the engine's k bounds them.
pub const JUMP_FORWARD_MAX_TOKENS: usize = 8;

/// One tokenizer's compiler in `ConstraintCompiler::for_tokenizer`'s cache.
type CacheEntry = (Weak<Tokenizer>, Arc<ConstraintCompiler>);

/// A constraint that cannot be compiled; the text names the problem (for an HTTP 400).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct ConstraintError(pub String);

/// What one constraint may cost to compile: llguidance's limits, tightened from its defaults so
/// that a valid but huge schema is refused (HTTP 400 naming the field) instead of holding a
/// core for seconds. The server adds a wall-time bound on top (`ServerConfig`).
///
/// Measured on the default model's 151k-token vocabulary (see the server's
/// `test_hostile_requests.py`): a 150-property schema of `anyOf` over 200-value enums, which
/// takes seconds under the defaults, is over this budget; ordinary tool and response schemas
/// use a few percent of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrammarBudget {
    /// Lexer fuel to build the initial regex AST (llguidance: ~50k per ms; default 1M).
    pub initial_lexer_fuel: u64,
    /// Symbols in the grammar's productions (default 500k, "a few megabytes of JSON").
    pub max_grammar_size: usize,
    /// Lexer states, ~1-2 kB of memory each: llguidance's default (250k), not tightened, since
    /// states are also built while generating, where running out fails a running request.
    pub max_lexer_states: usize,
}

impl Default for GrammarBudget {
    fn default() -> Self {
        Self { initial_lexer_fuel: 200_000, max_grammar_size: 50_000, max_lexer_states: 250_000 }
    }
}

impl GrammarBudget {
    fn apply(&self, limits: &mut ParserLimits) {
        limits.initial_lexer_fuel = self.initial_lexer_fuel;
        limits.max_grammar_size = self.max_grammar_size;
        limits.max_lexer_states = self.max_lexer_states;
        // a refusal names the limit; the grammar and parser state only make the 400 huge
        limits.verbose_errors = false;
    }
}

/// llguidance's view of one tokenizer: the token trie and a parser factory. Building it walks the
/// whole vocabulary (a fraction of a second for 150k tokens), so it is built once per tokenizer
/// ([`ConstraintCompiler::for_tokenizer`]).
pub struct ConstraintCompiler {
    factory: ParserFactory,
    /// The tokenizer's EOS ids: where the grammar may end, any of them may be sampled.
    eos: Vec<TokenId>,
    /// Tokens the trie knows (the tokenizer's vocabulary); logits rows may be longer (padding
    /// rows of the output matrix), and those ids are never allowed.
    vocab: usize,
}

impl ConstraintCompiler {
    /// Builds the token trie from `tokenizer`: byte-level and SentencePiece pieces as their raw
    /// bytes, control tokens as special tokens a grammar can name (`<|im_end|>` or `<[id]>`),
    /// other added tokens (e.g. `<tool_call>`) as their text. Forced text is tokenized by the
    /// tokenizer itself ([`CanonicalTokEnv`]), so llguidance forces the canonical tokens there.
    pub fn new(tokenizer: &Arc<Tokenizer>) -> Result<Self, ConstraintError> {
        let eos = tokenizer.eos.clone();
        let Some(&first_eos) = eos.first() else {
            return Err(ConstraintError("structured outputs need the model's EOS token, and this tokenizer has none".into()));
        };
        let words: Vec<Vec<u8>> = tokenizer
            .token_bytes()
            .into_iter()
            .map(|t| {
                if t.special {
                    let mut w = Vec::with_capacity(t.bytes.len() + 1);
                    w.push(TokTrie::SPECIAL_TOKEN_MARKER);
                    w.extend_from_slice(&t.bytes);
                    w
                } else {
                    t.bytes
                }
            })
            .collect();
        let vocab = words.len();
        if eos.iter().any(|&e| e as usize >= vocab) {
            return Err(ConstraintError(format!("an EOS id of {eos:?} is outside the tokenizer's {vocab} tokens")));
        }
        let info = TokRxInfo::new(vocab as u32, first_eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
        let env: TokEnv = Arc::new(CanonicalTokEnv { trie, tokenizer: tokenizer.clone() });
        let mut factory = ParserFactory::new(&env, InferenceCapabilities::default(), &llguidance::earley::SlicedBiasComputer::general_slices())
            .map_err(|e| ConstraintError(format!("building the grammar engine for this tokenizer: {e}")))?;
        factory.quiet();
        GrammarBudget::default().apply(factory.limits_mut());
        Ok(Self { factory, eos, vocab })
    }

    /// The compiler of `tokenizer`, built on first use and shared by every caller holding the
    /// same `Arc` (engine ranks and the server in one process).
    pub fn for_tokenizer(tokenizer: &Arc<Tokenizer>) -> Result<Arc<Self>, ConstraintError> {
        static CACHE: OnceLock<Mutex<Vec<CacheEntry>>> = OnceLock::new();
        let cache = CACHE.get_or_init(|| Mutex::new(Vec::new()));
        // building under the lock: concurrent first users wait for one build instead of racing
        let mut entries = cache.lock().unwrap_or_else(|p| p.into_inner());
        entries.retain(|(w, _)| w.strong_count() > 0);
        if let Some((_, c)) = entries.iter().find(|(w, _)| std::ptr::eq(w.as_ptr(), Arc::as_ptr(tokenizer))) {
            return Ok(c.clone());
        }
        let c = Arc::new(Self::new(tokenizer)?);
        entries.push((Arc::downgrade(tokenizer), c.clone()));
        Ok(c)
    }

    /// Compiles `c` into a fresh matcher at the start of the output.
    pub fn compile(&self, c: &Constraint) -> Result<Grammar, ConstraintError> {
        let grammar = top_level_grammar(c)?;
        let parser = self.factory.create_parser(grammar).map_err(|e| ConstraintError(describe(c, &e.to_string())))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(ConstraintError(describe(c, &e)));
        }
        Ok(Grammar { matcher: Some(matcher), reasoning: None, log: Vec::new(), eos: self.eos.clone(), vocab: self.vocab })
    }

    /// A request's grammar: its reasoning budget's phase first, then its constraint (free text
    /// when it has none); `None` when it has neither.
    pub fn compile_request(&self, constraint: Option<&Constraint>, budget: Option<&ReasoningBudget>) -> Result<Option<Grammar>, ConstraintError> {
        let mut grammar = match constraint {
            Some(c) => self.compile(c)?,
            None if budget.is_some() => Grammar { matcher: None, reasoning: None, log: Vec::new(), eos: self.eos.clone(), vocab: self.vocab },
            None => return Ok(None),
        };
        if let Some(b) = budget {
            if let Some(t) = [Some(b.close), b.open].into_iter().flatten().find(|&t| t as usize >= self.vocab || self.eos.contains(&t)) {
                return Err(ConstraintError(format!("the reasoning budget's token {t} is not an ordinary token of this vocabulary")));
            }
            let phase = if b.open.is_some() { Phase::Opening } else { Phase::Thinking(0) };
            grammar.reasoning = Some((*b, phase));
        }
        Ok(Some(grammar))
    }
}

/// llguidance's tokenizer environment: the trie, and the model's own tokenizer for text the
/// grammar forces. Being canonical lets llguidance force tokens: where the grammar admits only
/// one continuation for some bytes ahead, the mask holds only the first token of their canonical
/// tokenization (one-hot, so verification accepts a forced draft token by construction), and
/// [`Grammar::forced_tokens`] lists them (jump-forward).
struct CanonicalTokEnv {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for CanonicalTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// The tokenizer's encoding when it spells exactly `s` in the trie's bytes (not so for a
    /// piece that is not whole UTF-8, a SentencePiece dummy prefix, or text naming a control
    /// token); otherwise the trie's greedy tokenization, which does.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        if let Ok(text) = std::str::from_utf8(s) {
            if let Ok(ids) = self.tokenizer.encode(text) {
                let mut at = 0;
                let spells = ids.iter().all(|&t| {
                    let b = self.trie.token(t);
                    let ok = !b.is_empty() && b[0] != TokTrie::SPECIAL_TOKEN_MARKER && s[at..].starts_with(b);
                    at += b.len();
                    ok
                });
                if spells && at == s.len() {
                    return ids;
                }
            }
        }
        self.trie.greedy_tokenize(s)
    }
}

/// Compiles `c` for `tokenizer` within [`GrammarBudget`]: once per request, by the front end
/// (the server, on its blocking pool), so a bad or over-budget schema, regex or grammar is an
/// HTTP 400 naming the problem, and the request carries the result to the engine.
pub fn compile(tokenizer: &Arc<Tokenizer>, c: &Constraint) -> Result<Grammar, ConstraintError> {
    ConstraintCompiler::for_tokenizer(tokenizer)?.compile(c)
}

/// JSON output layout the schema grammars use unless a schema sets its own `x-guidance`: one
/// space after `,` and `:`, no other whitespace (small models otherwise tend to pad with
/// newlines until the token limit).
fn json_layout() -> Value {
    serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

fn top_level_grammar(c: &Constraint) -> Result<TopLevelGrammar, ConstraintError> {
    Ok(match c {
        Constraint::JsonObject => TopLevelGrammar::from_json_schema(serde_json::json!({"type": "object", "x-guidance": json_layout()})),
        Constraint::JsonSchema(text) => {
            let mut schema: Value = serde_json::from_str(text).map_err(|e| ConstraintError(format!("the JSON schema is not valid JSON: {e}")))?;
            match &mut schema {
                Value::Object(m) => {
                    m.entry("x-guidance").or_insert_with(json_layout);
                }
                Value::Bool(_) => {}
                _ => return Err(ConstraintError("the JSON schema must be an object (or true/false)".into())),
            }
            TopLevelGrammar::from_json_schema(schema)
        }
        Constraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
        Constraint::Choice(options) => {
            if options.is_empty() {
                return Err(ConstraintError("choice needs at least one option".into()));
            }
            if options.iter().any(String::is_empty) {
                return Err(ConstraintError("choice options must not be empty strings".into()));
            }
            // Lark string literals are JSON strings
            let alts: Vec<String> = options.iter().map(|o| serde_json::to_string(o).expect("a string serializes")).collect();
            TopLevelGrammar::from_lark(format!("start: {}", alts.join(" | ")))
        }
        Constraint::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
    })
}

fn describe(c: &Constraint, err: &str) -> String {
    let what = match c {
        Constraint::JsonObject => "json_object",
        Constraint::JsonSchema(_) => "JSON schema",
        Constraint::Regex(_) => "regex",
        Constraint::Choice(_) => "choice",
        Constraint::Lark(_) => "grammar",
    };
    format!("invalid {what}: {err}")
}

/// One sequence's position in its output's language: first its reasoning budget's phase (if it
/// has one), then its constraint's (llguidance's matcher; free text without one). Cloned with
/// the sequence's sampling state into each step that samples it (a clone shares llguidance's
/// lexer caches, not its parser state).
#[derive(Clone)]
pub struct Grammar {
    matcher: Option<Matcher>,
    /// The reasoning budget and where the output stands in it.
    reasoning: Option<(ReasoningBudget, Phase)>,
    /// Per token consumed since the last [`Grammar::accept`], the reasoning phase it was consumed
    /// in (`None`: the matcher took it): what [`Grammar::rollback`] undoes.
    log: Vec<Option<Phase>>,
    eos: Vec<TokenId>,
    vocab: usize,
}

/// Where an output stands in its reasoning budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Before the think block: only its opening token may come.
    Opening,
    /// Inside it, after this many tokens.
    Thinking(usize),
    /// After its closing token: the constraint (or free text) from here.
    Done,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar").field("reasoning", &self.reasoning).field("stopped", &self.is_finished()).finish()
    }
}

/// The tokens allowed at one position (a bit per token id of the trie's vocabulary).
#[derive(Clone, Debug)]
pub struct TokenMask {
    bits: SimpleVob,
}

impl TokenMask {
    pub fn allows(&self, t: TokenId) -> bool {
        (t as usize) < self.bits.len() && self.bits.is_allowed(t)
    }

    /// Sets every disallowed token's logit to -inf (ids past the mask, padding rows, included).
    /// Applied to raw logits, this equals masking after logit bias, penalties and temperature
    /// (each keeps -inf), before top-k/p.
    pub fn apply(&self, row: &mut [f32]) {
        let words = self.bits.as_slice();
        for (w, chunk) in row.chunks_mut(32).enumerate() {
            let bits = words.get(w).copied().unwrap_or(0);
            if bits == u32::MAX && chunk.len() == 32 {
                continue;
            }
            for (j, x) in chunk.iter_mut().enumerate() {
                if bits & (1 << j) == 0 {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
    }

    pub fn num_allowed(&self) -> usize {
        self.bits.num_set()
    }
}

/// A grammar's failure while it runs, named by what it was doing.
fn grammar_err(what: &str, e: impl std::fmt::Display) -> ConstraintError {
    ConstraintError(format!("structured output grammar: {what}: {e}"))
}

impl Grammar {
    pub fn is_eos(&self, t: TokenId) -> bool {
        self.eos.contains(&t)
    }

    fn phase(&self) -> Phase {
        self.reasoning.map_or(Phase::Done, |(_, p)| p)
    }

    /// The token the reasoning budget forces at `phase` (its opening, or its closing once spent).
    fn budget_forces(&self, phase: Phase) -> Option<TokenId> {
        let (b, _) = self.reasoning?;
        match phase {
            Phase::Opening => b.open,
            Phase::Thinking(n) if n >= b.tokens => Some(b.close),
            _ => None,
        }
    }

    /// Whether the reasoning phase `phase` allows `t`: a forced token alone; inside the block
    /// anything but an end when a constraint must follow.
    fn budget_allows(&self, phase: Phase, t: TokenId) -> bool {
        match self.budget_forces(phase) {
            Some(f) => t == f,
            None => self.matcher.is_none() || !self.is_eos(t),
        }
    }

    /// The phase after `t` at `phase` (not `Done`).
    fn budget_after(&self, phase: Phase, t: TokenId) -> Phase {
        match (phase, self.reasoning) {
            (Phase::Opening, _) => Phase::Thinking(0),
            (Phase::Thinking(_), Some((b, _))) if t == b.close => Phase::Done,
            (Phase::Thinking(n), _) => Phase::Thinking(n + 1),
            (p, _) => p,
        }
    }

    fn one_hot_mask(&self, t: TokenId) -> TokenMask {
        let mut bits = SimpleVob::alloc(self.vocab);
        bits.allow_token(t);
        TokenMask { bits }
    }

    /// The tokens allowed next: where the grammar may end, every EOS id; once it can only end,
    /// only EOS. Inside a reasoning budget, the forced token alone or (mostly) anything.
    pub fn mask(&mut self) -> Result<TokenMask, ConstraintError> {
        let phase = self.phase();
        if phase != Phase::Done {
            if let Some(t) = self.budget_forces(phase) {
                return Ok(self.one_hot_mask(t));
            }
            let mut bits = SimpleVob::alloc_ones(self.vocab);
            if self.matcher.is_some() {
                for &e in &self.eos {
                    bits.disallow_token(e);
                }
            }
            return Ok(TokenMask { bits });
        }
        let Some(matcher) = self.matcher.as_mut() else {
            return Ok(TokenMask { bits: SimpleVob::alloc_ones(self.vocab) });
        };
        let mut bits = matcher.compute_mask_or_eos().map_err(|e| grammar_err("computing the token mask", e))?;
        if self.eos.iter().any(|&e| bits.is_allowed(e)) {
            for &e in &self.eos {
                bits.allow_token(e);
            }
        }
        Ok(TokenMask { bits })
    }

    /// Advances over accepted tokens; an EOS ends the output and is not consumed.
    pub fn consume(&mut self, tokens: &[TokenId]) -> Result<(), ConstraintError> {
        let end = tokens.iter().position(|&t| self.is_eos(t)).unwrap_or(tokens.len());
        if let Some(&t) = tokens[..end].iter().find(|&&t| t as usize >= self.vocab) {
            return Err(grammar_err("consuming tokens", format!("token {t} is outside the tokenizer's vocabulary")));
        }
        let mut rest = &tokens[..end];
        while let (Some((&t, tail)), Some((b, phase))) = (rest.split_first(), self.reasoning) {
            if phase == Phase::Done {
                break;
            }
            if !self.budget_allows(phase, t) {
                return Err(grammar_err("consuming tokens", format!("token {t} breaks the reasoning budget")));
            }
            self.reasoning = Some((b, self.budget_after(phase, t)));
            self.log.push(Some(phase));
            rest = tail;
        }
        if rest.is_empty() {
            return Ok(());
        }
        if let Some(m) = self.matcher.as_mut() {
            m.consume_tokens(rest).map_err(|e| grammar_err("consuming tokens", e))?;
        }
        self.log.extend(std::iter::repeat_n(None, rest.len()));
        Ok(())
    }

    /// Steps back over the last `n` consumed tokens.
    pub fn rollback(&mut self, n: usize) -> Result<(), ConstraintError> {
        if n == 0 {
            return Ok(());
        }
        if n > self.log.len() {
            return Err(grammar_err("rolling back", format!("{n} tokens asked, {} consumed since the last accepted step", self.log.len())));
        }
        let undone = self.log.split_off(self.log.len() - n);
        let matcher_tokens = undone.iter().filter(|p| p.is_none()).count();
        if matcher_tokens > 0 {
            if let Some(m) = self.matcher.as_mut() {
                m.rollback(matcher_tokens).map_err(|e| grammar_err("rolling back", e))?;
            }
        }
        if let (Some(Some(phase)), Some((b, _))) = (undone.iter().find(|p| p.is_some()), self.reasoning) {
            self.reasoning = Some((b, *phase));
        }
        Ok(())
    }

    /// The next token forced from here, if any: the reasoning budget's, or the first of
    /// llguidance's forced tokens when it is valid here.
    fn next_forced(&mut self) -> Option<TokenId> {
        let phase = self.phase();
        if phase != Phase::Done {
            return self.budget_forces(phase);
        }
        let m = self.matcher.as_mut()?;
        if m.is_stopped() {
            return None;
        }
        let &t = m.compute_ff_tokens().first()?;
        let valid = !self.eos.contains(&t) && (t as usize) < self.vocab && m.validate_tokens(&[t]).is_ok_and(|n| n == 1);
        valid.then_some(t)
    }

    /// The tokens the grammar forces from here, at most `max`: each one the only token its
    /// position's mask allows (llguidance's forced bytes, canonically tokenized, or the reasoning
    /// budget's tokens), so drafted they are accepted by construction. Found one at a time (the
    /// first forced token of each state, exactly what that state's mask allows), so they are
    /// what verification will mask; the grammar is left where it was.
    pub fn forced_tokens(&mut self, max: usize) -> Vec<TokenId> {
        let mut forced = Vec::new();
        while forced.len() < max {
            let Some(t) = self.next_forced() else { break };
            if self.consume(&[t]).is_err() {
                break;
            }
            forced.push(t);
        }
        if !forced.is_empty() && self.rollback(forced.len()).is_err() {
            // cannot happen after consuming them; an error state makes the next mask fail the step
            return Vec::new();
        }
        forced
    }

    /// How many leading tokens of `draft` the grammar accepts from here (an EOS ends the count:
    /// drafts never propose the end), without advancing.
    pub fn valid_prefix(&mut self, draft: &[TokenId]) -> usize {
        let end = draft.iter().position(|&t| self.is_eos(t) || t as usize >= self.vocab).unwrap_or(draft.len());
        let mut phase = self.phase();
        let mut i = 0;
        while i < end && phase != Phase::Done {
            if !self.budget_allows(phase, draft[i]) {
                return i;
            }
            phase = self.budget_after(phase, draft[i]);
            i += 1;
        }
        match self.matcher.as_mut() {
            _ if i == end => i,
            None => end,
            Some(m) if m.is_stopped() => i,
            Some(m) => i + m.validate_tokens(&draft[i..end]).unwrap_or(0),
        }
    }

    /// How many leading tokens of `draft` the grammar accepts after `forced` (tokens it accepts
    /// from here, e.g. [`Grammar::forced_tokens`]), without advancing.
    pub fn valid_prefix_after(&mut self, forced: &[TokenId], draft: &[TokenId]) -> Result<usize, ConstraintError> {
        if forced.is_empty() {
            return Ok(self.valid_prefix(draft));
        }
        self.consume(forced)?;
        let n = self.valid_prefix(draft);
        self.rollback(forced.len())?;
        Ok(n)
    }

    /// Nothing is constrained any more: a reasoning budget without a constraint, past its
    /// closing token. The compute job then samples the sequence as free text (no masks).
    pub fn is_free_text(&self) -> bool {
        self.phase() == Phase::Done && self.matcher.is_none()
    }

    /// The output is complete: the grammar allows nothing but its end (never while reasoning, or
    /// for free text after it).
    pub fn is_finished(&self) -> bool {
        self.phase() == Phase::Done && self.matcher.as_ref().is_some_and(|m| m.is_stopped())
    }

    /// The masks of a verification step: row 0 from the current state, row `i + 1` after draft
    /// tokens `0..=i`, for as long as the draft stays inside the grammar (rows after the first
    /// draft token it forbids are never read: the masked target gives that token probability 0,
    /// so verification stops there). Leaves the grammar advanced over the `consumed` draft tokens
    /// (the returned count); `accept` then keeps the accepted ones.
    pub fn verification_masks(&mut self, draft: &[TokenId]) -> Result<(Vec<TokenMask>, usize), ConstraintError> {
        let mut masks = Vec::with_capacity(draft.len() + 1);
        masks.push(self.mask()?);
        let mut consumed = 0;
        for &t in draft {
            let last = masks.last().expect("one mask pushed before the loop");
            if self.is_eos(t) || !last.allows(t) || self.is_finished() {
                break;
            }
            self.consume(&[t])?;
            consumed += 1;
            masks.push(self.mask()?);
        }
        Ok((masks, consumed))
    }

    /// Cuts the EOS an accepted draft's completion of the grammar made the next row give: the
    /// output then ends at that draft token, as it does without speculation (no EOS token).
    /// `emitted`: the tokens the grammar just kept.
    pub fn trim_completed(&self, emitted: &mut Vec<TokenId>) {
        if self.is_finished() && emitted.len() > 1 && emitted.last().is_some_and(|&t| self.is_eos(t)) {
            emitted.pop();
        }
    }

    /// After verification over `consumed` draft tokens (advanced by `verification_masks`): keeps
    /// the accepted ones and consumes the step's last emitted token. Nothing before this can be
    /// rolled back after it.
    pub fn accept(&mut self, consumed: usize, emitted: &[TokenId]) -> Result<(), ConstraintError> {
        let accepted = emitted.len() - 1;
        if accepted > consumed {
            return Err(grammar_err("verification", format!("{accepted} draft tokens accepted but only {consumed} were inside the grammar")));
        }
        self.rollback(consumed - accepted)?;
        self.consume(&emitted[accepted..])?;
        self.log.clear();
        Ok(())
    }
}

/// The rows sampling and verification read for a constrained item: `block` (one row per
/// position) with each row's forbidden tokens at -inf, in `scratch`.
pub(crate) fn masked_rows<'a>(block: &[f32], masks: &[TokenMask], vocab: usize, scratch: &'a mut Vec<f32>) -> &'a [f32] {
    scratch.clear();
    scratch.extend_from_slice(block);
    for (r, m) in masks.iter().enumerate() {
        m.apply(&mut scratch[r * vocab..(r + 1) * vocab]);
    }
    scratch
}

/// Jump-forward: how many leading tokens of a verified `draft` were forced by the grammar (each
/// at a position whose mask allowed only it), counted apart from the proposer's.
pub(crate) fn forced_prefix(draft: &[TokenId], masks: &[TokenMask]) -> usize {
    draft.iter().zip(masks).take_while(|(&t, m)| m.allows(t) && m.num_allowed() == 1).count()
}

/// Jump-forward merging: the proposer's `draft`, proposed after the tokens the grammar forces
/// (`forced`), cut at the first token the grammar forbids (none when its matcher fails: the next
/// step's masks then fail the sequence), behind the forced tokens (with one-hot draft
/// distributions for them). `None` when the proposer adds nothing to the forced tokens.
pub(crate) fn draft_after_forced(seq: crate::types::SeqId, grammar: Option<&mut Grammar>, forced: &[TokenId], mut draft: Draft, vocab: usize) -> Option<Draft> {
    if let Some(g) = grammar {
        let n = g.valid_prefix_after(forced, &draft.tokens).unwrap_or_else(|e| {
            tracing::warn!(seq = %seq, "grammar failed on a draft: {e}");
            0
        });
        draft.truncate(n);
    }
    if draft.tokens.is_empty() {
        return None;
    }
    if !forced.is_empty() {
        draft.probs = draft.probs.map(|p| forced.iter().map(|&t| one_hot(t, vocab)).chain(p).collect());
        draft.tokens.splice(0..0, forced.iter().copied());
    }
    Some(draft)
}

/// A draft distribution certain of `t`.
fn one_hot(t: TokenId, vocab: usize) -> Vec<f32> {
    let mut row = vec![0.0; vocab];
    row[t as usize] = 1.0;
    row
}

#[cfg(test)]
mod tests {
    use super::*;
    use specula_model::tokenizer::GgufTokenizerSpec;

    /// A byte-level vocabulary: the 256 bytes (GPT-2's byte characters), "ab", "yes", "no",
    /// `<|end|>` (control, EOS), then "ye" (a merge step of "yes").
    fn tokenizer() -> Tokenizer {
        let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        let mut tokens: Vec<String> = (0..=255u8)
            .map(|b| {
                let remapped = (0..b).filter(|&x| !printable(x)).count() as u32;
                if printable(b) {
                    char::from(b).to_string()
                } else {
                    char::from_u32(256 + remapped).unwrap().to_string()
                }
            })
            .collect();
        tokens.extend(["ab", "yes", "no", "<|end|>", "ye"].map(String::from));
        let mut token_types = vec![1; tokens.len()];
        token_types[EOS as usize] = 3;
        let merges = vec!["a b".into(), "y e".into(), "ye s".into(), "n o".into()];
        Tokenizer::from_gguf(GgufTokenizerSpec { model: "gpt2", tokens, token_types, merges, eos: Some(EOS), ..Default::default() }).unwrap()
    }

    fn compiler() -> ConstraintCompiler {
        ConstraintCompiler::new(&Arc::new(tokenizer())).unwrap()
    }

    const EOS: TokenId = 259;

    /// A choice: the first mask allows the options' first bytes and tokens, not EOS; after
    /// "yes" the grammar is finished and only EOS is allowed; a rollback goes back.
    #[test]
    fn choice_masks_advance_finish_and_roll_back() {
        let t = tokenizer();
        let id = |s: &str| t.token_to_id(s).unwrap();
        let mut g = compiler().compile(&Constraint::Choice(vec!["yes".into(), "no".into()])).unwrap();
        let m = g.mask().unwrap();
        assert!(m.allows(id("yes")) && m.allows(id("no")) && m.allows(id("y")) && m.allows(id("n")));
        assert!(!m.allows(id("ab")) && !m.allows(EOS) && !m.allows(id("x")));
        let mut row = vec![0.0f32; 300];
        m.apply(&mut row);
        assert_eq!(row[id("yes") as usize], 0.0);
        assert_eq!(row[id("ab") as usize], f32::NEG_INFINITY);
        assert_eq!(row[299], f32::NEG_INFINITY, "ids past the vocabulary are never allowed");
        assert_eq!(g.valid_prefix(&[id("yes"), id("no")]), 1);
        g.consume(&[id("yes")]).unwrap();
        assert!(g.is_finished());
        let m = g.mask().unwrap();
        assert_eq!((m.allows(EOS), m.num_allowed()), (true, 1));
        g.rollback(1).unwrap();
        assert!(!g.is_finished());
        let (masks, consumed) = g.verification_masks(&[id("n"), id("x"), id("o")]).unwrap();
        assert_eq!((masks.len(), consumed), (2, 1));
        assert!(masks[1].allows(id("o")) && !masks[1].allows(id("x")));
        // the draft "n" accepted, then "o" sampled: "no" is complete
        g.accept(consumed, &[id("n"), id("o")]).unwrap();
        assert!(g.is_finished());
    }

    /// Jump-forward: an object whose one key is required has `{"ab": ` forced. The forced tokens
    /// spell exactly that text; each is the only token its position's mask allows (so a draft of
    /// them is accepted by construction); listing them leaves the grammar where it was.
    #[test]
    fn forced_tokens_spell_the_forced_text_each_alone_in_its_mask() {
        let t = tokenizer();
        let schema = r#"{"type": "object", "properties": {"ab": {"type": "integer"}}, "required": ["ab"], "additionalProperties": false}"#;
        let mut g = compiler().compile(&Constraint::JsonSchema(schema.into())).unwrap();
        let forced = g.forced_tokens(16);
        assert_eq!(t.decode(&forced, false).unwrap(), "{\"ab\": ", "{forced:?}");
        assert!(forced.contains(&t.token_to_id("ab").unwrap()), "the canonical tokenization: {forced:?}");
        assert_eq!(g.forced_tokens(2), forced[..2], "at most max");
        for &f in &forced {
            let m = g.mask().unwrap();
            assert_eq!((m.num_allowed(), m.allows(f)), (1, true), "token {f}");
            g.consume(&[f]).unwrap();
        }
        // an integer is free: nothing forced, digits allowed
        assert!(g.forced_tokens(16).is_empty());
        let m = g.mask().unwrap();
        assert!(m.allows(t.token_to_id("7").unwrap()) && m.num_allowed() > 1);
        g.consume(&[t.token_to_id("7").unwrap()]).unwrap();
        // after the proposer's draft "7" would come "}" (a digit or the end of the object)
        assert_eq!(g.valid_prefix_after(&[], &[t.token_to_id("}").unwrap()]).unwrap(), 1);
        g.rollback(1 + forced.len()).unwrap();
        assert_eq!(g.valid_prefix_after(&forced, &[t.token_to_id("7").unwrap(), t.token_to_id("}").unwrap()]).unwrap(), 2);
        assert_eq!(g.forced_tokens(16), forced, "the grammar is back at the start");
    }

    /// Jump-forward merging: the proposer's draft goes behind the forced tokens, cut where the
    /// grammar forbids; the forced prefix of a verified draft is counted from the masks; a draft
    /// that completes the grammar keeps no EOS after it.
    #[test]
    fn drafts_merge_behind_forced_tokens_and_the_forced_prefix_is_counted() {
        let t = tokenizer();
        let id = |s: &str| t.token_to_id(s).unwrap();
        let vocab = t.vocab_size();
        let schema = r#"{"type": "object", "properties": {"ab": {"type": "integer"}}, "required": ["ab"], "additionalProperties": false}"#;
        let mut g = compiler().compile(&Constraint::JsonSchema(schema.into())).unwrap();
        let forced = g.forced_tokens(16);
        let draft = |tokens: Vec<TokenId>| Draft { tokens, probs: None };
        // "7}" fits after the forced text, "x" does not: the draft is cut there
        let merged = draft_after_forced(crate::types::SeqId(1), Some(&mut g), &forced, draft(vec![id("7"), id("}"), id("x")]), vocab).unwrap();
        assert_eq!(merged.tokens, [&forced[..], &[id("7"), id("}")]].concat());
        assert_eq!(g.forced_tokens(16), forced, "merging leaves the grammar where it was");
        // nothing the grammar allows: the forced tokens stay alone (None)
        assert!(draft_after_forced(crate::types::SeqId(1), Some(&mut g), &forced, draft(vec![id("x")]), vocab).is_none());
        // one-hot rows for the forced tokens in front of the proposer's distributions
        let probs = Draft { tokens: vec![id("7")], probs: Some(vec![vec![0.5; vocab]]) };
        let merged = draft_after_forced(crate::types::SeqId(1), Some(&mut g), &forced, probs, vocab).unwrap();
        let rows = merged.probs.unwrap();
        assert_eq!(rows.len(), forced.len() + 1);
        assert!(rows[..forced.len()].iter().zip(&forced).all(|(r, &f)| r[f as usize] == 1.0 && r.iter().sum::<f32>() == 1.0));
        // without a grammar a draft passes as it is
        assert_eq!(draft_after_forced(crate::types::SeqId(1), None, &[], draft(vec![5, 6]), vocab).unwrap().tokens, vec![5, 6]);
        // the forced prefix of a verified draft: the leading tokens each alone in their mask
        let (masks, _) = g.verification_masks(&[forced.clone(), vec![id("7")]].concat()).unwrap();
        assert_eq!(forced_prefix(&[forced.clone(), vec![id("7")]].concat(), &masks), forced.len());
        // a choice completed by an accepted draft: the EOS the next row gave is cut
        let mut c = compiler().compile(&Constraint::Choice(vec!["yes".into(), "no".into()])).unwrap();
        let mut emitted = vec![id("yes"), EOS];
        c.accept(0, &emitted[..1]).unwrap();
        c.trim_completed(&mut emitted);
        assert_eq!(emitted, vec![id("yes")]);
    }

    /// A reasoning budget of 2 tokens, opened by "ab" and closed by "no": the opening is forced,
    /// then anything (an end too, with no constraint after), then the closing alone; free text
    /// after it, never finished. Rollback and verification cross the phases.
    #[test]
    fn a_reasoning_budget_forces_its_opening_and_its_closing() {
        let t = tokenizer();
        let id = |s: &str| t.token_to_id(s).unwrap();
        let (open, close) = (id("ab"), id("no"));
        let budget = ReasoningBudget { tokens: 2, open: Some(open), close };
        let mut g = compiler().compile_request(None, Some(&budget)).unwrap().unwrap();
        let m = g.mask().unwrap();
        assert_eq!((m.num_allowed(), m.allows(open)), (1, true));
        assert_eq!(g.forced_tokens(8), vec![open], "only the opening is forced from the start");
        g.consume(&[open, id("x")]).unwrap();
        let m = g.mask().unwrap();
        assert!(m.allows(id("y")) && m.allows(close) && m.allows(EOS), "inside the budget anything may come");
        assert!(g.forced_tokens(8).is_empty());
        g.consume(&[id("y")]).unwrap();
        let m = g.mask().unwrap();
        assert_eq!((m.num_allowed(), m.allows(close)), (1, true), "the budget is spent: the closing alone");
        assert_eq!(g.forced_tokens(8), vec![close]);
        g.consume(&[close]).unwrap();
        let m = g.mask().unwrap();
        assert!(m.allows(id("x")) && m.allows(EOS) && !g.is_finished(), "free text after the block");
        assert!(g.is_free_text(), "nothing left to constrain: the job samples it unmasked");
        assert!(g.forced_tokens(8).is_empty());
        // back over the closing and one thought: one more thought may come, then the closing
        g.rollback(2).unwrap();
        assert_eq!(g.valid_prefix(&[id("z"), id("x"), id("q")]), 1, "after one more thought only the closing");
        assert_eq!(g.valid_prefix(&[id("z"), close, id("q"), id("r")]), 4, "free after the closing");
        // a verification step from the start: the draft's second thought over budget is cut
        let mut g = compiler().compile_request(None, Some(&budget)).unwrap().unwrap();
        let (masks, consumed) = g.verification_masks(&[open, id("x"), id("y"), id("z")]).unwrap();
        assert_eq!((masks.len(), consumed), (4, 3));
        assert!(masks[3].allows(close) && !masks[3].allows(id("z")));
        // "ab x" accepted, "y" sampled; then the closing is forced
        g.accept(consumed, &[open, id("x"), id("y")]).unwrap();
        assert_eq!(g.forced_tokens(8), vec![close]);
        assert!(g.rollback(1).is_err(), "nothing before an accepted step can be rolled back");
        // a prompt that opened the block: thinking from the first token
        let opened = ReasoningBudget { tokens: 0, open: None, close };
        let mut g = compiler().compile_request(None, Some(&opened)).unwrap().unwrap();
        assert_eq!(g.forced_tokens(8), vec![close], "a budget of 0 closes at once");
        assert!(compiler().compile_request(None, Some(&ReasoningBudget { tokens: 1, open: None, close: EOS })).is_err(), "an end cannot close");
        assert!(compiler().compile_request(None, None).unwrap().is_none());
    }

    /// A reasoning budget before a constraint: no end while reasoning, the constraint's mask and
    /// forced tokens after the closing, finished when the constraint is; rollback and
    /// verification across the two.
    #[test]
    fn a_reasoning_budget_hands_over_to_the_constraint() {
        let t = tokenizer();
        let id = |s: &str| t.token_to_id(s).unwrap();
        let close = id("no");
        let budget = ReasoningBudget { tokens: 1, open: None, close };
        let schema = r#"{"type": "object", "properties": {"ab": {"type": "integer"}}, "required": ["ab"], "additionalProperties": false}"#;
        let mut g = compiler().compile_request(Some(&Constraint::JsonSchema(schema.into())), Some(&budget)).unwrap().unwrap();
        assert!(!g.mask().unwrap().allows(EOS), "the answer must still come");
        assert!(!g.is_free_text());
        g.consume(&[id("x")]).unwrap();
        let forced = g.forced_tokens(16);
        assert_eq!(forced[0], close);
        assert_eq!(t.decode(&forced[1..], false).unwrap(), "{\"ab\": ", "the schema's forced text follows the closing");
        let draft: Vec<TokenId> = [&forced[..], &[id("7"), id("}")]].concat();
        let (masks, consumed) = g.verification_masks(&draft).unwrap();
        assert_eq!(consumed, draft.len());
        assert!(g.is_finished());
        assert_eq!(forced_prefix(&draft, &masks), forced.len());
        // the closing and the first forced token accepted, the second sampled: the rest is ahead
        g.accept(consumed, &[close, forced[1], forced[2]]).unwrap();
        assert!(!g.is_finished());
        assert_eq!(g.valid_prefix(&forced[3..]), forced.len() - 3);
    }

    #[test]
    fn invalid_constraints_are_refused_with_the_reason() {
        let c = compiler();
        let e = c.compile(&Constraint::Regex("a(b".into())).unwrap_err().0;
        assert!(e.starts_with("invalid regex"), "{e}");
        let e = c.compile(&Constraint::JsonSchema("{\"type\": \"object\",".into())).unwrap_err().0;
        assert!(e.contains("not valid JSON"), "{e}");
        let e = c.compile(&Constraint::JsonSchema("{\"type\": \"array\", \"uniqueItems\": true}".into())).unwrap_err().0;
        assert!(e.contains("uniqueItems"), "{e}");
        let e = c.compile(&Constraint::Lark("start: foo".into())).unwrap_err().0;
        assert!(e.starts_with("invalid grammar"), "{e}");
        assert!(c.compile(&Constraint::Choice(vec![])).is_err());
    }

    /// Requests reach MPI ranks as JSON (`dp::bridge`): every constraint survives the trip.
    #[test]
    fn constraints_cross_to_mpi_ranks_unchanged() {
        for c in [
            Constraint::JsonObject,
            Constraint::JsonSchema("{\"type\": \"string\"}".into()),
            Constraint::Regex("a+".into()),
            Constraint::Choice(vec!["x".into(), "y".into()]),
            Constraint::Lark("start: \"a\"".into()),
        ] {
            let reasoning_budget = Some(ReasoningBudget { tokens: 7, open: None, close: 3 });
            let p = crate::api::SamplingParams { constraint: Some(Arc::new(c)), reasoning_budget, ..Default::default() };
            let back: crate::api::SamplingParams = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
            assert_eq!(back, p);
        }
    }
}
