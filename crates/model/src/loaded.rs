//! What loading a model gives: the weights, the tokenizer and the chat template, whichever source
//! they came from (`loader` for a GGUF file, `safetensors_folder` for a Hugging Face folder). Its
//! own module so that neither loader imports the other.

use crate::chat::ChatTemplate;
use crate::llama::LlamaModel;
use crate::tokenizer::Tokenizer;
use std::time::Duration;

pub struct LoadedModel {
    pub model: LlamaModel,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    pub load_time: Duration,
    /// Bytes of weights mapped.
    pub weight_bytes: usize,
    pub name: String,
}

/// How a mixture-of-experts model's expert weights are held (`--expert-weights`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExpertWeights {
    /// Repacked when the file fits in the memory available with a tenth to spare, else mapped.
    #[default]
    Auto,
    /// Repacked at load into this process's memory (the fastest kernels; the file's size in
    /// resident memory, private to the process).
    Repacked,
    /// Read in place from the memory-mapped file, each group of eight rows repacked as a kernel
    /// reads it: no copy (the page cache holds them once for every process that maps the file,
    /// and the kernel may evict them under pressure instead of failing), same results, slower.
    Mapped,
}

impl ExpertWeights {
    /// `Repacked` or `Mapped` for repacked copies totalling `bytes` (a file's size times the
    /// copies to make) with `available` bytes of memory (unknown: repack): `Auto` maps when they
    /// would take more than nine tenths of it, leaving the rest to the KV cache and the system.
    pub fn settle(self, bytes: u64, available: Option<usize>) -> Self {
        match self {
            Self::Auto if available.is_some_and(|a| bytes as f64 > 0.9 * a as f64) => Self::Mapped,
            Self::Auto => Self::Repacked,
            other => other,
        }
    }
}

/// What `load_model_with` may choose.
#[derive(Clone, Copy, Debug, Default)]
pub struct LoadOptions {
    pub expert_weights: ExpertWeights,
    /// Also load the file's multi-token-prediction layer (`nextn`), when it has one: only the
    /// mtp proposer runs it, so it is left on disk otherwise.
    pub nextn: bool,
}
