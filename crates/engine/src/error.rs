//! The engine's errors: [`EngineError`] when an engine cannot be built or started, [`StepError`]
//! when one step fails (its requests are failed with its text; the engine goes on), with
//! [`StepFailure`] saying which part of the engine failed, and the one way a caught panic becomes
//! text ([`panic_message`]).

use crate::constraint::ConstraintError;
use crate::fault::Injected;
use crate::kv_cache::KvCacheError;
use crate::sampling::SamplingError;
use crate::speculative::SpecError;
use std::any::Any;
use std::sync::Arc;

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

/// Why a phase of a step failed: the part of the engine that failed, wrapping that part's own
/// error. Its `Display` is the leaf error's text (what a failed request's client reads), its
/// [`kind`](Self::kind) the label `/metrics` counts failures by.
#[derive(Clone, Debug, thiserror::Error)]
pub enum StepFailure {
    /// The forward pass (weights, shapes, a kernel).
    #[error("{0}")]
    Model(Arc<specula_model::ModelError>),
    /// Sampling, verification or logprobs.
    #[error("{0}")]
    Sampling(#[from] SamplingError),
    /// Packing the step's logprobs for the host (a range check of the packed format).
    #[error("logprobs transfer: {0}")]
    Logprobs(#[from] crate::sampling::PackError),
    /// A structured-output grammar's matcher.
    #[error("{0}")]
    Grammar(#[from] ConstraintError),
    /// The speculative proposer.
    #[error("{0}")]
    Proposer(Arc<SpecError>),
    /// A KV-cache operation the step needed was refused.
    #[error("{0}")]
    Kv(#[from] KvCacheError),
    /// The engine's own bookkeeping found a broken invariant while building or applying the step
    /// (a bug: the text says which).
    #[error("{0}")]
    Invariant(String),
    /// A step's view of a sequence disagrees with the compute side's record of it (a bug).
    #[error("{0}")]
    Record(#[from] crate::record::RecordError),
    /// A collective of the data-parallel group (the expert exchange) failed.
    #[error("{0}")]
    Collective(String),
    /// The test switch (`EngineConfig::fault_injection`).
    #[error("injected fault (test switch)")]
    Injected,
}

impl StepFailure {
    /// The part of the engine that failed, as `/metrics` labels it
    /// (`specula:step_failures_total{kind}`).
    pub fn kind(&self) -> &'static str {
        match self {
            StepFailure::Model(_) => "model",
            StepFailure::Sampling(_) => "sampling",
            StepFailure::Logprobs(_) => "logprobs",
            StepFailure::Grammar(_) => "grammar",
            StepFailure::Proposer(_) => "proposer",
            StepFailure::Kv(_) => "kv",
            StepFailure::Invariant(_) | StepFailure::Record(_) => "invariant",
            StepFailure::Collective(_) => "collective",
            StepFailure::Injected => "injected",
        }
    }
}

/// Equal when of the same kind with the same text (the leaf errors need not be comparable).
impl PartialEq for StepFailure {
    fn eq(&self, other: &Self) -> bool {
        self.kind() == other.kind() && self.to_string() == other.to_string()
    }
}

impl Eq for StepFailure {}

impl From<specula_model::ModelError> for StepFailure {
    fn from(e: specula_model::ModelError) -> Self {
        StepFailure::Model(Arc::new(e))
    }
}

impl From<Injected> for StepFailure {
    fn from(_: Injected) -> Self {
        StepFailure::Injected
    }
}

impl From<SpecError> for StepFailure {
    fn from(e: SpecError) -> Self {
        StepFailure::Proposer(Arc::new(e))
    }
}

/// One step failed. Its `Display` text is what the step's requests receive in
/// `RequestEvent::Failed`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StepError {
    /// A phase of step `step` (prepare, forward pass, sampling, proposals) failed.
    #[error("step {step} failed: {failure}")]
    Failed { step: u64, failure: StepFailure },
    /// A phase of step `step` panicked; the panic was caught.
    #[error("internal error: step {step} panicked: {message}")]
    Panicked { step: u64, message: String },
    /// Applying a computed step's output to its sequences failed.
    #[error("{0}")]
    Apply(StepFailure),
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

impl StepError {
    /// The part of the engine that failed (`panic` for a caught panic), as `/metrics` labels it.
    pub fn kind(&self) -> &'static str {
        match self {
            StepError::Failed { failure, .. } | StepError::Apply(failure) => failure.kind(),
            StepError::Panicked { .. } | StepError::ApplyPanicked(_) => "panic",
        }
    }
}
