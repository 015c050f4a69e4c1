//! Text <-> token ids. Built from GGUF metadata (`tokenizer.ggml.*`: byte-level BPE or SentencePiece) or
//! loaded from a `tokenizer.json`, using the `tokenizers` crate either way. Also the incremental
//! detokenizer used for streaming, which never emits a broken UTF-8 character.

use crate::ModelError;
use serde_json::{json, Value};
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::{AddedToken, DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper, Tokenizer as HfTokenizer};

pub type TokenId = u32;

/// A loaded tokenizer plus the special-token ids the engine needs.
pub struct Tokenizer {
    inner: HfTokenizer,
    pub bos: Option<TokenId>,
    /// End-of-sequence ids: generation stops at any of them.
    pub eos: Vec<TokenId>,
    /// Whether prompts get BOS prepended (GGUF `tokenizer.ggml.add_bos_token`).
    pub add_bos: bool,
    vocab_size: usize,
    /// How vocabulary strings spell bytes, and which tokens are control tokens
    /// (`Tokenizer::token_bytes`).
    pieces: PieceSpelling,
    /// GGUF token type per id (empty for a tokenizer.json: its added tokens say which are special).
    token_types: Vec<i32>,
    /// The spellings of the control (special) added tokens, longest first: what a client's text
    /// must not turn into control tokens (`Tokenizer::neutralize_controls`).
    control_strings: Vec<String>,
    /// A copy of `inner` that reads control-token spellings as plain text, built on first use
    /// (only a conversation that spells one needs it).
    text_only: std::sync::OnceLock<HfTokenizer>,
}

/// How a vocabulary string spells the bytes of its token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PieceSpelling {
    /// GPT-2 byte-level: each byte is one printable character (`Ġ` is a space).
    ByteLevel,
    /// SentencePiece: `▁` is a space, `<0xNN>` is the byte NN, the rest is UTF-8.
    SentencePiece,
}

/// One token's bytes as grammar-constrained decoding sees them (`Tokenizer::token_bytes`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenBytes {
    /// What the token adds to the output text (for a special token: its name, e.g. `<|im_end|>`).
    pub bytes: Vec<u8>,
    /// A control token (GGUF type CONTROL, or a tokenizer.json added token marked special): it
    /// is not text, a grammar can only name it.
    pub special: bool,
}

/// The pieces of GGUF tokenizer metadata we use.
#[derive(Default)]
pub struct GgufTokenizerSpec<'a> {
    /// `tokenizer.ggml.model`: "gpt2" (byte-level BPE) or "llama" (SentencePiece).
    pub model: &'a str,
    pub pre: Option<&'a str>,
    pub tokens: Vec<String>,
    pub token_types: Vec<i32>,
    pub merges: Vec<String>,
    /// `tokenizer.ggml.scores` (SentencePiece only: merge priority of each piece).
    pub scores: Vec<f32>,
    pub bos: Option<TokenId>,
    pub eos: Option<TokenId>,
    pub unk: Option<TokenId>,
    pub add_bos: bool,
    /// `tokenizer.ggml.add_space_prefix` (SentencePiece only; llama.cpp's default is true).
    pub add_space_prefix: bool,
}

/// GGUF token types (llama.cpp's `llama_token_type`).
const TOKEN_NORMAL: i32 = 1;
const TOKEN_CONTROL: i32 = 3;
const TOKEN_USER_DEFINED: i32 = 4;

/// Qwen2's split (llama.cpp `qwen2`, Hugging Face Qwen2 tokenizer.json): Llama 3's pattern with
/// single digits.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen3.5's split (llama.cpp `qwen35`): Qwen2's, with combining marks (`\p{M}`) joining the
/// letters they follow.
const QWEN35_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3's split (llama.cpp `llama-bpe`, Meta-Llama-3 tokenizer.json): digits in groups of up to 3.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// o200k's split (llama.cpp `gpt-4o`: Phi-4-mini, gpt-oss): cased words keep their contraction,
/// digits in groups of up to 3, punctuation runs take trailing newlines and slashes.
const GPT4O_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

impl Tokenizer {
    /// Builds the tokenizer GGUF metadata describes: byte-level BPE (`gpt2`) or SentencePiece
    /// (`llama`).
    pub fn from_gguf(spec: GgufTokenizerSpec) -> Result<Self, ModelError> {
        let parts = match spec.model {
            "gpt2" => byte_level_bpe(&spec)?,
            "llama" => sentencepiece_bpe(&spec)?,
            other => {
                return Err(ModelError::Unsupported(format!(
                    "GGUF tokenizer model '{other}' is not supported (only byte-level BPE 'gpt2' and SentencePiece 'llama'); put a tokenizer.json beside the model and pass the folder"
                )))
            }
        };
        let err = |what: &str, e: &dyn std::fmt::Display| ModelError::Tokenizer(format!("building the tokenizer from GGUF metadata ({what}): {e}"));
        // The model is built directly (a 262k-piece vocabulary as JSON text costs seconds and
        // hundreds of MB); the small parts are tokenizer.json-shaped values.
        let vocab: Vocab = spec.tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
        let mut bpe = BPE::builder()
            .vocab_and_merges(vocab, parts.merges)
            .byte_fallback(parts.byte_fallback)
            .fuse_unk(parts.byte_fallback)
            .ignore_merges(parts.ignore_merges);
        if let Some(unk) = parts.unk {
            bpe = bpe.unk_token(unk);
        }
        let mut inner = HfTokenizer::new(bpe.build().map_err(|e| err("model", &e))?);
        if !parts.normalizer.is_null() {
            inner.with_normalizer(Some(serde_json::from_value::<NormalizerWrapper>(parts.normalizer).map_err(|e| err("normalizer", &e))?));
        }
        if !parts.pre_tokenizer.is_null() {
            inner.with_pre_tokenizer(Some(serde_json::from_value::<PreTokenizerWrapper>(parts.pre_tokenizer).map_err(|e| err("pre-tokenizer", &e))?));
        }
        inner.with_decoder(Some(serde_json::from_value::<DecoderWrapper>(parts.decoder).map_err(|e| err("decoder", &e))?));
        // Token type 3 = control, 4 = user-defined: matched whole in the raw input, never split
        // (they are in the vocabulary, so they keep their ids).
        let added: Vec<AddedToken> = spec
            .tokens
            .iter()
            .enumerate()
            .filter(|(i, _)| matches!(spec.token_types.get(*i), Some(&TOKEN_CONTROL) | Some(&TOKEN_USER_DEFINED)))
            .map(|(i, t)| AddedToken::from(t.clone(), spec.token_types[i] == TOKEN_CONTROL).normalized(false))
            .collect();
        inner.add_tokens(&added);
        let pieces = if spec.model == "llama" { PieceSpelling::SentencePiece } else { PieceSpelling::ByteLevel };
        Ok(Self {
            vocab_size: spec.tokens.len(),
            control_strings: control_strings(&inner),
            inner,
            bos: spec.bos,
            eos: spec.eos.into_iter().collect(),
            add_bos: spec.add_bos,
            pieces,
            token_types: spec.token_types,
            text_only: std::sync::OnceLock::new(),
        })
    }

    /// Adds the end-of-turn tokens of the common chat formats that exist in the vocabulary to
    /// the EOS set, so generation stops where the template ends an assistant turn:
    /// `<|im_end|>` (ChatML: Qwen, SmolLM), `<end_of_turn>` (Gemma), `<|eot_id|>` and
    /// `<|eom_id|>` (Llama 3), `<|end|>` (Phi-3 / Phi-4: the file's EOS is `<|endoftext|>`, the
    /// template ends each turn with `<|end|>`), `<|return|>` and `<|call|>` (gpt-oss's harmony). In harmony
    /// `<|end|>` ends a message, not the turn (the analysis message is followed by the final
    /// one), so with `<|return|>` and `<|call|>` present it is no EOS, as llama.cpp decides.
    pub fn add_end_of_turn_tokens(&mut self) {
        for t in END_OF_TURN_TOKENS {
            if let Some(id) = self.token_to_id(t) {
                if !self.eos.contains(&id) {
                    self.eos.push(id);
                }
            }
        }
        if let (Some(_), Some(_), Some(end)) = (self.token_to_id("<|return|>"), self.token_to_id("<|call|>"), self.token_to_id("<|end|>")) {
            self.eos.retain(|&id| id != end);
        }
    }

    /// Loads a Hugging Face `tokenizer.json`; `eos`/`bos` come from the model's config.
    pub fn from_file(path: &std::path::Path, bos: Option<TokenId>, eos: Vec<TokenId>) -> Result<Self, ModelError> {
        let inner = HfTokenizer::from_file(path).map_err(|e| ModelError::Tokenizer(format!("loading {}: {e}", path.display())))?;
        let vocab_size = inner.get_vocab_size(true);
        let byte_level = matches!(inner.get_decoder(), Some(DecoderWrapper::ByteLevel(_))) || inner.token_to_id("\u{120}").is_some();
        let pieces = if byte_level { PieceSpelling::ByteLevel } else { PieceSpelling::SentencePiece };
        let control_strings = control_strings(&inner);
        Ok(Self { inner, bos, eos, add_bos: false, vocab_size, pieces, token_types: Vec::new(), control_strings, text_only: std::sync::OnceLock::new() })
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Plain encoding: special tokens written in the text are recognised, no BOS is added.
    pub fn encode(&self, text: &str) -> Result<Vec<TokenId>, ModelError> {
        let enc = self.inner.encode_fast(text, false).map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Encoding of a prompt: BOS first when the model wants it.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<TokenId>, ModelError> {
        let mut ids = Vec::new();
        if self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend(self.encode(text)?);
        Ok(ids)
    }

    /// `text` with every control-token spelling in it (`<|im_end|>`, ...) replaced by filler of
    /// the same byte length, or None when it spells none. A chat template renders the client's
    /// strings neutralized this way to show where its own markup is (`encode_template_render`).
    pub fn neutralize_controls(&self, text: &str) -> Option<String> {
        let mut out: Option<String> = None;
        // again until none is left: filler next to the text around it must not spell a new one
        while let Some(control) = self.control_strings.iter().find(|c| out.as_deref().unwrap_or(text).contains(c.as_str())) {
            out = Some(out.as_deref().unwrap_or(text).replace(control.as_str(), &CONTROL_FILLER.repeat(control.len())));
        }
        out
    }

    /// Encodes `text`, a chat template's render, so that control tokens come only from the
    /// template's markup: `neutral` is the same render of the client's strings passed through
    /// [`Self::neutralize_controls`]. The control tokens found in `neutral` are the template's
    /// (the client's text there spells none); `text` is split at exactly those positions and the
    /// pieces between are encoded with control-token spellings read as plain text. Since added
    /// tokens split the input before anything else, a render whose client strings spell no control
    /// token encodes exactly as [`Self::encode`] would encode it.
    ///
    /// Fails when the two renders do not line up (a template that changes the client's text in a
    /// way that moves its markup), rather than guess.
    pub fn encode_template_render(&self, text: &str, neutral: &str) -> Result<Vec<TokenId>, ModelError> {
        let misaligned = || {
            ModelError::BadInput(
                "the conversation spells control tokens (such as <|im_end|>) and the chat template rewrites that text, so its own markup cannot be told apart from it; remove them from the messages".into(),
            )
        };
        if text.len() != neutral.len() {
            return Err(misaligned());
        }
        let marked = self.inner.encode(neutral, false).map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        let added = self.inner.get_added_tokens_decoder();
        let text_only = self.text_only.get_or_init(|| {
            let mut t = self.inner.clone();
            t.set_encode_special_tokens(true);
            t
        });
        let encode_text = |piece: &str| -> Result<Vec<TokenId>, ModelError> {
            if piece.is_empty() {
                return Ok(Vec::new());
            }
            Ok(text_only.encode_fast(piece, false).map_err(|e| ModelError::Tokenizer(e.to_string()))?.get_ids().to_vec())
        };
        let mut ids = Vec::new();
        let mut done = 0;
        for (&id, &(start, end)) in marked.get_ids().iter().zip(marked.get_offsets()) {
            if !added.get(&id).is_some_and(|a| a.special) {
                continue;
            }
            // the markup must read the same in both renders, at the same place
            if start < done || text.get(start..end) != neutral.get(start..end) {
                return Err(misaligned());
            }
            ids.extend(encode_text(text.get(done..start).ok_or_else(misaligned)?)?);
            ids.push(id);
            done = end;
        }
        ids.extend(encode_text(text.get(done..).ok_or_else(misaligned)?)?);
        Ok(ids)
    }

    pub fn decode(&self, ids: &[TokenId], skip_special: bool) -> Result<String, ModelError> {
        self.inner.decode(ids, skip_special).map_err(|e| ModelError::Tokenizer(e.to_string()))
    }

    /// The token's string as stored in the vocabulary (byte-level form), for logprob displays.
    pub fn id_to_token(&self, id: TokenId) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn token_to_id(&self, token: &str) -> Option<TokenId> {
        self.inner.token_to_id(token)
    }

    /// The exact text of one token (decoded on its own; may be a partial UTF-8 sequence shown
    /// with replacement characters).
    pub fn token_text(&self, id: TokenId) -> String {
        self.inner.decode(&[id], false).unwrap_or_default()
    }

    pub fn is_eos(&self, id: TokenId) -> bool {
        self.eos.contains(&id)
    }

    /// Every token's bytes, by id, for grammar-constrained decoding: a byte-level BPE piece is
    /// mapped back to its raw bytes, a SentencePiece `▁` to a space and `<0xNN>` to byte NN; a
    /// control token (GGUF type CONTROL, or special in a tokenizer.json) is `special` with its
    /// name as bytes; other added tokens (GGUF USER_DEFINED, e.g. Qwen's `<tool_call>`) are
    /// their text. Unknown and unused pieces are special too (no text can produce them).
    pub fn token_bytes(&self) -> Vec<TokenBytes> {
        let added = self.inner.get_added_tokens_decoder();
        let byte_of = byte_level_decoder();
        (0..self.vocab_size as u32)
            .map(|id| {
                let piece = self.inner.id_to_token(id).unwrap_or_default();
                let ty = self.token_types.get(id as usize).copied();
                let added_tok = added.get(&id);
                let special = match ty {
                    Some(t) => t == TOKEN_CONTROL || t == TOKEN_UNKNOWN || t == TOKEN_UNUSED,
                    None => added_tok.is_some_and(|a| a.special),
                };
                let bytes = if special || ty == Some(TOKEN_USER_DEFINED) || (ty.is_none() && added_tok.is_some()) {
                    piece.into_bytes()
                } else {
                    match self.pieces {
                        PieceSpelling::ByteLevel => piece.chars().flat_map(|c| byte_of(c).map_or_else(|| c.to_string().into_bytes(), |b| vec![b])).collect(),
                        PieceSpelling::SentencePiece => sentencepiece_bytes(&piece),
                    }
                };
                TokenBytes { bytes, special }
            })
            .collect()
    }
}

/// What [`Tokenizer::neutralize_controls`] writes for each byte of a control-token spelling: a
/// printable ASCII letter, which no template escapes and no control token is made of.
const CONTROL_FILLER: &str = "x";

/// The spellings of `inner`'s special added tokens, longest first (so that one containing
/// another is neutralized whole).
fn control_strings(inner: &HfTokenizer) -> Vec<String> {
    let mut out: Vec<String> = inner.get_added_tokens_decoder().into_values().filter(|t| t.special && !t.content.is_empty()).map(|t| t.content).collect();
    out.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
    out.dedup();
    out
}

/// GGUF token types beside NORMAL, CONTROL and USER_DEFINED that `token_bytes` treats as special.
const TOKEN_UNKNOWN: i32 = 2;
const TOKEN_UNUSED: i32 = 5;

/// GPT-2's byte-to-character table, inverted: the byte a byte-level BPE character stands for.
fn byte_level_decoder() -> impl Fn(char) -> Option<u8> {
    let mut table = std::collections::HashMap::with_capacity(256);
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        let c = if printable {
            char::from(b)
        } else {
            n += 1;
            char::from_u32(255 + n).expect("GPT-2's table maps bytes to U+0100..U+0143")
        };
        table.insert(c, b);
    }
    move |c| table.get(&c).copied()
}

/// A SentencePiece piece's bytes: `<0xNN>` is byte NN, `▁` a space.
fn sentencepiece_bytes(piece: &str) -> Vec<u8> {
    if piece.len() == 6 && piece.starts_with("<0x") && piece.ends_with('>') {
        if let Ok(b) = u8::from_str_radix(&piece[3..5], 16) {
            return vec![b];
        }
    }
    piece.replace('\u{2581}', " ").into_bytes()
}

/// Turn-ending tokens of the chat formats we know (see `add_end_of_turn_tokens`).
pub const END_OF_TURN_TOKENS: [&str; 7] = ["<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|return|>", "<|call|>"];

/// What differs between the two kinds of GGUF tokenizer.
struct Parts {
    normalizer: Value,
    pre_tokenizer: Value,
    decoder: Value,
    merges: Vec<(String, String)>,
    byte_fallback: bool,
    /// Take a pre-token that is itself a vocabulary entry whole, without merging (Llama 3).
    ignore_merges: bool,
    unk: Option<String>,
}

/// Byte-level BPE (GPT-2 style): vocabulary and merges straight from the GGUF, the
/// pre-tokenizer chosen by `tokenizer.ggml.pre` as llama.cpp does.
fn byte_level_bpe(spec: &GgufTokenizerSpec) -> Result<Parts, ModelError> {
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let split_then_bytes = |regex: &str| {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]})
    };
    let mut normalizer = Value::Null;
    let mut ignore_merges = false;
    let pre_tokenizer = match spec.pre.unwrap_or("default") {
        // SmolLM: every digit its own pre-token, then GPT-2's byte-level split.
        "smollm" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level]}),
        "llama-bpe" | "llama3" | "llama-v3" => {
            // Meta-Llama-3's tokenizer.json has "ignore_merges": true (llama.cpp does the same).
            ignore_merges = true;
            split_then_bytes(LLAMA3_SPLIT)
        }
        "qwen2" => {
            // Qwen2's tokenizer.json normalizes to NFC before splitting (llama.cpp does not).
            normalizer = json!({"type": "NFC"});
            split_then_bytes(QWEN2_SPLIT)
        }
        "qwen35" => {
            normalizer = json!({"type": "NFC"});
            split_then_bytes(QWEN35_SPLIT)
        }
        "gpt-4o" => split_then_bytes(GPT4O_SPLIT),
        "gpt2" | "default" => byte_level,
        other => {
            return Err(ModelError::Unsupported(format!(
                "GGUF pre-tokenizer '{other}' (tokenizer.ggml.pre) is not supported (known: default, gpt2, smollm, llama-bpe, qwen2, qwen35, gpt-4o); put a tokenizer.json beside the model and pass the folder"
            )))
        }
    };
    let decoder = json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true});
    let merges = spec
        .merges
        .iter()
        .map(|m| {
            m.split_once(' ').map(|(a, b)| (a.to_string(), b.to_string())).ok_or_else(|| ModelError::Tokenizer(format!("GGUF merge '{m}' is not two tokens")))
        })
        .collect::<Result<_, _>>()?;
    Ok(Parts { normalizer, pre_tokenizer, decoder, merges, byte_fallback: false, ignore_merges, unk: None })
}

/// SentencePiece BPE (`tokenizer.ggml.model` = llama), the way Hugging Face converts a
/// SentencePiece model: a BPE with byte fallback whose merges are every split of a normal piece
/// into two vocabulary pieces, ranked by the merged piece's score (highest first; ties by
/// piece id, then by the ids of the two halves). Spaces become '▁' (plus a leading '▁' when
/// `add_space_prefix`), and there is no pre-tokenizer: the whole text between special tokens is
/// one word, as in SentencePiece and llama.cpp.
fn sentencepiece_bpe(spec: &GgufTokenizerSpec) -> Result<Parts, ModelError> {
    if spec.scores.len() != spec.tokens.len() {
        return Err(ModelError::MissingMetadata(format!(
            "a SentencePiece GGUF tokenizer needs tokenizer.ggml.scores for each of its {} tokens (found {})",
            spec.tokens.len(),
            spec.scores.len()
        )));
    }
    let ids: std::collections::HashMap<&str, u32> = spec.tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i as u32)).collect();
    let mut ranked: Vec<(f32, u32, u32, u32)> = Vec::new();
    for (id, piece) in spec.tokens.iter().enumerate() {
        if spec.token_types.get(id).copied().unwrap_or(TOKEN_NORMAL) != TOKEN_NORMAL {
            continue;
        }
        for (at, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(at);
            if let (Some(&li), Some(&ri)) = (ids.get(l), ids.get(r)) {
                ranked.push((spec.scores[id], id as u32, li, ri));
            }
        }
    }
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)).then(a.3.cmp(&b.3)));
    let merges = ranked.iter().map(|&(_, _, l, r)| (spec.tokens[l as usize].clone(), spec.tokens[r as usize].clone())).collect();
    let replace = json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"});
    let normalizer =
        if spec.add_space_prefix { json!({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u{2581}"}, replace]}) } else { replace };
    let mut decoders =
        vec![json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}), json!({"type": "ByteFallback"}), json!({"type": "Fuse"})];
    if spec.add_space_prefix {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    let unk = spec.unk.and_then(|i| spec.tokens.get(i as usize)).cloned();
    Ok(Parts {
        normalizer,
        pre_tokenizer: Value::Null,
        decoder: json!({"type": "Sequence", "decoders": decoders}),
        merges,
        byte_fallback: true,
        ignore_merges: false,
        unk,
    })
}

/// Streaming detokenizer (the prefix/read-offset scheme of TGI and vLLM): decodes a window of
/// recent tokens and releases only text that ends on a complete character.
#[derive(Clone, Debug, Default)]
pub struct DecodeStream {
    tokens: Vec<TokenId>,
    prefix_offset: usize,
    read_offset: usize,
}

impl DecodeStream {
    pub fn new() -> Self {
        Self::default()
    }

    /// Seeds the window with prompt tokens so the first generated token decodes in context
    /// (matters for tokenizers that add or strip leading spaces).
    pub fn with_context(context: &[TokenId]) -> Self {
        let keep = context.len().saturating_sub(4);
        let tokens = context[keep..].to_vec();
        let n = tokens.len();
        Self { tokens, prefix_offset: n, read_offset: n }
    }

    /// Adds one token; returns the newly completed text (possibly empty).
    pub fn step(&mut self, tok: &Tokenizer, id: TokenId) -> Result<String, ModelError> {
        self.tokens.push(id);
        let prefix = tok.decode(&self.tokens[self.prefix_offset..self.read_offset], false)?;
        let full = tok.decode(&self.tokens[self.prefix_offset..], false)?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') && full.is_char_boundary(prefix.len()) {
            let new = full[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.tokens.len();
            // keep the window small
            if self.prefix_offset > 64 {
                self.tokens.drain(..self.prefix_offset);
                self.read_offset -= self.prefix_offset;
                self.prefix_offset = 0;
            }
            Ok(new)
        } else {
            Ok(String::new())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GPT-2's byte -> printable character table.
    fn byte_chars() -> Vec<String> {
        let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
        let mut cs = bs.clone();
        let mut n = 0;
        for b in 0..256u32 {
            if !bs.contains(&b) {
                bs.push(b);
                cs.push(256 + n);
                n += 1;
            }
        }
        let mut table = vec![String::new(); 256];
        for (b, c) in bs.into_iter().zip(cs) {
            table[b as usize] = char::from_u32(c).unwrap().to_string();
        }
        table
    }

    fn byte_level(pre: &str) -> Result<Tokenizer, ModelError> {
        let mut tokens = byte_chars();
        tokens.extend(["12", "123", "1234", "xyz", "<|im_end|>"].map(String::from));
        let mut token_types = vec![1; tokens.len()];
        *token_types.last_mut().unwrap() = 3;
        Tokenizer::from_gguf(GgufTokenizerSpec {
            model: "gpt2",
            pre: Some(pre),
            tokens,
            token_types,
            merges: vec!["1 2".into(), "12 3".into(), "123 4".into()],
            ..Default::default()
        })
    }

    impl Tokenizer {
        /// `text` encoded with control-token spellings as plain text.
        fn text_only_for_test(&self, text: &str) -> Vec<TokenId> {
            let mut t = self.inner.clone();
            t.set_encode_special_tokens(true);
            t.encode_fast(text, false).unwrap().get_ids().to_vec()
        }
    }

    fn pieces(t: &Tokenizer, text: &str) -> Vec<String> {
        t.encode(text).unwrap().into_iter().map(|i| t.id_to_token(i).unwrap()).collect()
    }

    #[test]
    fn digit_splitting_follows_the_pre_tokenizer() {
        // Qwen2 and SmolLM: one digit per pre-token; Llama 3: up to three; GPT-2: whole runs.
        assert_eq!(pieces(&byte_level("qwen2").unwrap(), "12345"), ["1", "2", "3", "4", "5"]);
        assert_eq!(pieces(&byte_level("qwen35").unwrap(), "12345"), ["1", "2", "3", "4", "5"]);
        assert_eq!(pieces(&byte_level("smollm").unwrap(), "12345"), ["1", "2", "3", "4", "5"]);
        assert_eq!(pieces(&byte_level("llama-bpe").unwrap(), "12345"), ["123", "4", "5"]);
        // o200k (Phi-4-mini, gpt-oss): groups of three like Llama 3, merges applied
        assert_eq!(pieces(&byte_level("gpt-4o").unwrap(), "12345"), ["123", "4", "5"]);
        assert_eq!(pieces(&byte_level("gpt-4o").unwrap(), "xyz"), ["x", "y", "z"]);
        assert_eq!(pieces(&byte_level("default").unwrap(), "12345"), ["1234", "5"]);
        // "xyz" is a vocabulary entry no merge reaches: Llama 3 takes it whole (ignore_merges).
        assert_eq!(pieces(&byte_level("llama-bpe").unwrap(), "xyz"), ["xyz"]);
        assert_eq!(pieces(&byte_level("qwen2").unwrap(), "xyz"), ["x", "y", "z"]);
        let q = byte_level("qwen2").unwrap();
        assert_eq!(q.decode(&q.encode("a 12<|im_end|>\n").unwrap(), false).unwrap(), "a 12<|im_end|>\n");
    }

    #[test]
    fn unknown_pre_tokenizer_and_model_are_named_in_the_error() {
        let e = byte_level("tekken").err().unwrap().to_string();
        assert!(e.contains("'tekken'") && e.contains("pre-tokenizer"), "{e}");
        let e = Tokenizer::from_gguf(GgufTokenizerSpec { model: "rwkv", ..Default::default() }).err().unwrap().to_string();
        assert!(e.contains("'rwkv'"), "{e}");
    }

    /// A SentencePiece vocabulary: <unk> <s> </s>, <start_of_turn> (control), "\n" (user
    /// defined), the byte tokens, then pieces whose scores decide the merge order.
    fn sentencepiece(add_space_prefix: bool) -> Tokenizer {
        let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>", "<start_of_turn>", "\n"].map(String::from).to_vec();
        let mut token_types = vec![2, 3, 3, 3, 4];
        let mut scores = vec![0.0; 5];
        for b in 0..256 {
            tokens.push(format!("<0x{b:02X}>"));
            token_types.push(6);
            scores.push(0.0);
        }
        // "bc" outranks "ab", which outranks "▁a"; "abc" is reached through either half.
        for (piece, score) in
            [("a", -100.0), ("b", -101.0), ("c", -102.0), ("\u{2581}", -103.0), ("ab", -1.0), ("bc", -0.5), ("\u{2581}a", -2.0), ("abc", -3.0)]
        {
            tokens.push(piece.into());
            token_types.push(1);
            scores.push(score);
        }
        Tokenizer::from_gguf(GgufTokenizerSpec {
            model: "llama",
            tokens,
            token_types,
            scores,
            bos: Some(1),
            eos: Some(2),
            unk: Some(0),
            add_bos: true,
            add_space_prefix,
            ..Default::default()
        })
        .unwrap()
    }

    #[test]
    fn sentencepiece_merges_by_score_with_byte_fallback() {
        let t = sentencepiece(false);
        // "bc" first, then "a"+"bc" is the piece "abc".
        assert_eq!(pieces(&t, "abc"), ["abc"]);
        assert_eq!(pieces(&t, "cbc"), ["c", "bc"]);
        // "ab" (-1) outranks "▁a" (-2), and "▁ab" is no piece.
        assert_eq!(pieces(&t, " ab a"), ["\u{2581}", "ab", "\u{2581}a"]);
        // Not in the vocabulary: UTF-8 bytes. Special and user-defined tokens are matched whole.
        assert_eq!(pieces(&t, "é<start_of_turn>\na"), ["<0xC3>", "<0xA9>", "<start_of_turn>", "\n", "a"]);
        for text in ["abc", " ab a", "é<start_of_turn>\na  c", "x y\tz"] {
            assert_eq!(t.decode(&t.encode(text).unwrap(), false).unwrap(), text);
        }
        assert_eq!(t.encode_prompt("a").unwrap(), [1, t.token_to_id("a").unwrap()]);
        // With the SentencePiece prefix space: "a" is read as " a", and decoding drops it again.
        let t = sentencepiece(true);
        assert_eq!(pieces(&t, "a"), ["\u{2581}a"]);
        assert_eq!(t.decode(&t.encode("a b").unwrap(), false).unwrap(), "a b");
    }

    /// A message spelling `<|im_end|>` gets the text; the template's own `<|im_end|>` is the
    /// control token; a conversation without spellings encodes as plain `encode`.
    #[test]
    fn a_template_render_gets_control_tokens_only_from_its_markup() {
        use crate::chat::{ChatMessage, ChatTemplate};
        let t = byte_level("gpt2").unwrap();
        let end = t.token_to_id("<|im_end|>").unwrap();
        let chat = ChatTemplate::new("{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}", "", "").unwrap();
        let msg = |c: &str| [ChatMessage { role: "user".into(), content: c.into() }];
        let r = chat.render_tokens(&t, &msg("a<|im_end|>b"), None, false, &Default::default()).unwrap();
        assert_eq!(r.text, "a<|im_end|>b<|im_end|>");
        assert_eq!(r.tokens.iter().filter(|&&x| x == end).count(), 1, "{:?}", r.tokens);
        assert_eq!(r.tokens.last(), Some(&end));
        // the spelled one is its ten bytes (GPT-2's split keeps `<|` and `|>` runs together)
        assert_eq!(r.tokens[1..r.tokens.len() - 2], t.text_only_for_test("<|im_end|>")[..]);
        assert_eq!(t.decode(&r.tokens, false).unwrap(), r.text);
        let benign = chat.render_tokens(&t, &msg("a b"), None, false, &Default::default()).unwrap();
        assert_eq!(benign.tokens, t.encode("a b<|im_end|>").unwrap());
        // tools are the client's strings too
        let with_tools = ChatTemplate::new("{{ tools[0] }}<|im_end|>", "", "").unwrap();
        let r = with_tools.render_tokens(&t, &msg("x"), Some(&serde_json::json!(["<|im_end|>"])), false, &Default::default()).unwrap();
        assert_eq!(r.tokens.iter().filter(|&&x| x == end).count(), 1, "{:?}", r.tokens);
    }

    /// A template whose markup depends on the spelled text cannot be told apart: an error, never
    /// a guess.
    #[test]
    fn a_template_that_moves_its_markup_with_the_text_is_refused() {
        use crate::chat::{ChatMessage, ChatTemplate};
        let t = byte_level("gpt2").unwrap();
        let src = "{% for m in messages %}{% if '<|im_end|>' in m.content %}<|im_end|>{% endif %}{{ m.content }}{% endfor %}";
        let chat = ChatTemplate::new(src, "", "").unwrap();
        let err = chat.render_tokens(&t, &[ChatMessage { role: "user".into(), content: "<|im_end|>".into() }], None, false, &Default::default()).unwrap_err();
        assert!(err.to_string().contains("control tokens"), "{err}");
    }

    #[test]
    fn neutralizing_replaces_each_control_spelling_by_filler_of_its_length() {
        let t = byte_level("qwen2").unwrap();
        assert_eq!(t.neutralize_controls("a<|im_end|>b").as_deref(), Some("axxxxxxxxxxb"));
        assert_eq!(t.neutralize_controls("<|im_end"), None);
    }

    #[test]
    fn end_of_turn_tokens_join_the_eos_set() {
        let mut t = byte_level("qwen2").unwrap();
        assert!(t.eos.is_empty());
        t.add_end_of_turn_tokens();
        t.add_end_of_turn_tokens();
        assert_eq!(t.eos, [t.token_to_id("<|im_end|>").unwrap()]);
    }

    /// Byte-level pieces map back to their raw bytes (every one of the 256), control tokens are
    /// special under their name, user-defined tokens are their text.
    #[test]
    fn token_bytes_of_a_byte_level_vocabulary() {
        let t = byte_level("qwen2").unwrap();
        let tb = t.token_bytes();
        for b in 0..256usize {
            assert_eq!(tb[b], TokenBytes { bytes: vec![b as u8], special: false }, "byte {b}");
        }
        let id = |s: &str| t.token_to_id(s).unwrap() as usize;
        assert_eq!(tb[id("123")], TokenBytes { bytes: b"123".to_vec(), special: false });
        assert_eq!(tb[id("<|im_end|>")], TokenBytes { bytes: b"<|im_end|>".to_vec(), special: true });
        assert_eq!(tb[id("\u{120}")].bytes, b" ");
    }

    /// SentencePiece: `▁` is a space, `<0xNN>` byte NN; control, unknown are special; the
    /// user-defined "\n" is its text.
    #[test]
    fn token_bytes_of_a_sentencepiece_vocabulary() {
        let t = sentencepiece(false);
        let tb = t.token_bytes();
        let id = |s: &str| t.token_to_id(s).unwrap() as usize;
        assert_eq!(tb[id("\u{2581}a")], TokenBytes { bytes: b" a".to_vec(), special: false });
        assert_eq!(tb[id("<0xC3>")], TokenBytes { bytes: vec![0xC3], special: false });
        assert_eq!(tb[id("<start_of_turn>")], TokenBytes { bytes: b"<start_of_turn>".to_vec(), special: true });
        assert!(tb[0].special && tb[1].special && tb[2].special);
        assert_eq!(tb[4], TokenBytes { bytes: b"\n".to_vec(), special: false });
    }
}
