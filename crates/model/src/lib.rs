//! specula-model: model configuration, weight loading (GGUF and Hugging Face safetensors
//! folders, memory-mapped), tokenizer, chat template and the Llama-family forward pass over a
//! flattened batch with a paged KV cache.

pub mod arch;
pub mod chat;
pub mod config;
pub mod delta_net;
pub mod gguf;
pub mod gguf_reader;
pub mod kv_store;
pub mod llama;
pub mod loaded;
pub mod loader;
pub mod moe;
pub mod safetensors_folder;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tokenizer;

pub use arch::{Arch, ArchDescriptor};
pub use chat::{ChatMessage, ChatTemplate, RenderedChat};
pub use config::{ModelConfig, MoeConfig};
pub use kv_store::KvStore;
pub use llama::{AttentionWeights, FeedForward, ForwardBatch, ForwardOutput, LlamaModel, Mixer, NextnLayer, SeqSpan};
pub use loaded::{ExpertWeights, LoadOptions};
pub use loader::{load_model, load_model_with, load_tokenizer, LoadedModel};
pub use moe::{DenseFfn, ExchangeError, ExpertExchange, MoeFfn};
pub use tokenizer::{DecodeStream, TokenBytes, Tokenizer};

/// Everything that can go wrong loading or running a model, each naming what and where.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot open {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error(transparent)]
    KvAlloc(#[from] kv_store::KvAllocError),
    #[error("{path} is not a valid GGUF file: {message}")]
    BadGguf { path: String, message: String },
    #[error("{0}")]
    MissingMetadata(String),
    #[error("tensor '{name}' has type {dtype}, which specula does not support (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4)")]
    UnsupportedTensorType { name: String, dtype: String },
    #[error("{0}")]
    Unsupported(String),
    #[error("tensor '{name}': {message}")]
    BadTensor { name: String, message: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    #[error("{0}")]
    BadInput(String),
    #[error("expert-parallel exchange failed: {0}")]
    Exchange(String),
}
