//! specula-engine: scheduling, KV-cache management, sampling and the engine loop.
//!
//! Data flows one way: request -> scheduler -> runner -> sampler -> output (see docs/architecture.md).

pub mod api;
mod batch;
pub mod config;
pub mod constraint;
pub mod dp;
pub mod engine;
mod engine_loop;
pub mod error;
pub mod fault;
pub mod handle;
pub mod host;
pub mod kv_cache;
pub mod record;
pub mod runner;
pub mod sampling;
pub mod scheduler;
pub mod sequence;
pub mod speculative;
pub mod step;
pub mod types;

pub use api::{Constraint, FinishReason, GenerateRequest, ReasoningBudget, RequestEvent, SamplingParams, TokenLogprob};
pub use config::EngineConfig;
pub use engine::{spawn_engine, Engine};
pub use error::{EngineError, StepError, StepFailure};
pub use handle::{EngineCommand, EngineHandle, SubmitError};
pub use step::{StepStats, StepTimings};
