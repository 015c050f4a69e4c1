//! specula-engine: scheduling, KV-cache management, sampling and the engine loop.
pub mod api;
pub mod types;
