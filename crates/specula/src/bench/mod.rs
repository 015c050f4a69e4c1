//! Benchmarks that talk to a running server over HTTP (`specula bench serve`).
//!
//! The client knows nothing of our engine: it speaks the OpenAI completions and chat-completions
//! streaming protocol, so the same numbers can be taken against specula, llama.cpp's llama-server
//! and vLLM and compared. Engine-only throughput (no HTTP) lives in `offline.rs`, not here.

pub mod serve;

mod report;
mod request;
mod spec;
mod sse;
pub(crate) mod stats;
pub(crate) mod workload;

#[cfg(test)]
mod tests;
