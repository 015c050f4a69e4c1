//! specula-engine: scheduling, KV-cache management, sampling and the engine loop.
//!
//! Data flows one way: request -> scheduler -> runner -> sampler -> output (see DESIGN.md).

pub mod api;
pub mod config;
pub mod dp;
pub mod engine;
pub mod handle;
pub mod host;
pub mod kv_cache;
pub mod runner;
pub mod sampling;
pub mod scheduler;
pub mod sequence;
pub mod spec;
pub mod types;

pub use api::{FinishReason, GenerateRequest, RequestEvent, SamplingParams, TokenLogprob};
pub use config::EngineConfig;
pub use engine::{spawn_engine, Engine, EngineError, StepStats, StepTimings};
pub use handle::{EngineCommand, EngineHandle, SubmitError};
