//! Text <-> token ids. Built from GGUF metadata (`tokenizer.ggml.*`, byte-level BPE models) or
//! loaded from a `tokenizer.json`, using the `tokenizers` crate either way. Also the incremental
//! detokenizer used for streaming, which never emits a broken UTF-8 character.

use crate::ModelError;
use serde_json::{json, Value};
use tokenizers::Tokenizer as HfTokenizer;

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
}

/// The pieces of GGUF tokenizer metadata we use.
pub struct GgufTokenizerSpec<'a> {
    pub model: &'a str,
    pub pre: Option<&'a str>,
    pub tokens: Vec<String>,
    pub token_types: Vec<i32>,
    pub merges: Vec<String>,
    pub bos: Option<TokenId>,
    pub eos: Option<TokenId>,
    pub add_bos: bool,
}

impl Tokenizer {
    /// Builds a byte-level BPE tokenizer from GGUF metadata.
    pub fn from_gguf(spec: GgufTokenizerSpec) -> Result<Self, ModelError> {
        if spec.model != "gpt2" {
            return Err(ModelError::Unsupported(format!(
                "GGUF tokenizer model '{}' is not supported (only byte-level BPE 'gpt2'); put a tokenizer.json beside the model and pass the folder",
                spec.model
            )));
        }
        let vocab: serde_json::Map<String, Value> = spec.tokens.iter().enumerate().map(|(i, t)| (t.clone(), json!(i))).collect();
        // Token type 3 = control, 4 = user-defined: matched whole in the input, never split.
        let added: Vec<Value> = spec
            .tokens
            .iter()
            .enumerate()
            .filter(|(i, _)| matches!(spec.token_types.get(*i), Some(3) | Some(4)))
            .map(|(i, t)| {
                json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                       "normalized": false, "special": spec.token_types[i] == 3})
            })
            .collect();
        let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
        let pre_tokenizer = match spec.pre.unwrap_or("default") {
            // SmolLM: every digit its own pre-token, then GPT-2's byte-level split.
            "smollm" => json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true}, byte_level]}),
            "llama-bpe" | "llama3" => json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
                 "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]}),
            "gpt2" | "default" => byte_level,
            other => {
                return Err(ModelError::Unsupported(format!(
                    "GGUF pre-tokenizer '{other}' is not supported; put a tokenizer.json beside the model and pass the folder"
                )))
            }
        };
        let doc = json!({
            "version": "1.0",
            "truncation": null, "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": pre_tokenizer,
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": vocab, "merges": spec.merges},
        });
        let inner: HfTokenizer = doc.to_string().parse().map_err(|e| ModelError::Tokenizer(format!("building the tokenizer from GGUF metadata: {e}")))?;
        Ok(Self { vocab_size: spec.tokens.len(), inner, bos: spec.bos, eos: spec.eos.into_iter().collect(), add_bos: spec.add_bos })
    }

    /// Loads a Hugging Face `tokenizer.json`; `eos`/`bos` come from the model's config.
    pub fn from_file(path: &std::path::Path, bos: Option<TokenId>, eos: Vec<TokenId>) -> Result<Self, ModelError> {
        let inner = HfTokenizer::from_file(path).map_err(|e| ModelError::Tokenizer(format!("loading {}: {e}", path.display())))?;
        let vocab_size = inner.get_vocab_size(true);
        Ok(Self { inner, bos, eos, add_bos: false, vocab_size })
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
