//! The engine's errors: [`EngineError`] when an engine cannot be built or started, [`StepError`]
//! when one step fails (its requests are failed with its text; the engine goes on), and the one
//! way a caught panic becomes text ([`panic_message`]).

use std::any::Any;

/// Building or starting an engine failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("invalid engine configuration: {0}")]
    Config(String),
    #[error("cannot start the compute thread pool: {0}")]
    ThreadPool(String),
    #[error("cannot start the engine thread: {0}")]
    Spawn(std::io::Error),
    #[error(transparent)]
    KvAlloc(#[from] specula_model::kv_store::KvAllocError),
}

/// One step failed. Its `Display` text is what the step's requests receive in
/// `RequestEvent::Failed`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StepError {
    /// A phase of step `step` (prepare, forward pass, sampling, proposals) returned an error.
    #[error("step {step} failed: {message}")]
    Failed { step: u64, message: String },
    /// A phase of step `step` panicked; the panic was caught.
    #[error("internal error: step {step} panicked: {message}")]
    Panicked { step: u64, message: String },
    /// Applying a computed step's output to its sequences failed.
    #[error("{0}")]
    Apply(String),
    /// Applying a computed step (or, in a lockstep rank, running it) panicked; the panic was caught.
    #[error("internal error in engine step: {0}")]
    ApplyPanicked(String),
}

/// The text of a caught panic's payload (`panic!` gives a `&str` or a `String`).
#[allow(clippy::borrowed_box)] // takes the Box so that a `&Box` is never taken for the payload itself
pub(crate) fn panic_message(payload: &Box<dyn Any + Send>) -> String {
    let payload: &(dyn Any + Send) = &**payload;
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic payload is not a string".to_string()
    }
}
