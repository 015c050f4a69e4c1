//! The test-only fault switch (`EngineConfig::fault_injection`, which `specula serve` reads from
//! `SPECULA_INJECT_FAULT`): which phase of which step fails, and how. A leaf: the phases call
//! `FaultInjection::trip` and turn its [`Injected`] error into their own
//! (`StepFailure::Injected`); this module knows none of them.

/// How an injected fault fails (see `EngineConfig::fault_injection`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    Error,
    Panic,
}

/// The phase of a step an injected fault hits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FaultPhase {
    /// Preparing the step's inputs (host).
    #[default]
    Prepare,
    /// Right after the forward pass (compute; with async scheduling the host work already runs
    /// beside it).
    Forward,
    /// Sampling, after the first sequence was sampled (compute).
    Sample,
    /// Sampling the step's first sampled sequence panics or fails (compute): that sequence
    /// alone fails, its batch neighbours go on.
    SampleSequence,
    /// The engine loop itself, outside every step's guard, before running the step: the engine
    /// thread dies (a panic whatever the kind), to test that such a death is visible.
    EngineLoop,
    /// Applying the step's output to its sequences (host).
    Apply,
    /// The speculative proposer, after it drafted for the step's sequences (compute): the
    /// step's drafts are dropped and the proposer forgets those sequences; every sequence goes
    /// on with the tokens it has without the fault.
    Propose,
    /// The grammar of each constrained sequence of the step, when its masks are computed
    /// (compute): a matcher error at run time, which fails those sequences only.
    Grammar,
}

/// A test-only switch: fails `phase` of engine step `step` (steps are numbered from 1 as they
/// are prepared).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FaultInjection {
    pub step: u64,
    pub kind: FaultKind,
    pub phase: FaultPhase,
}

impl FaultInjection {
    /// Parses `step:phase:kind` (`4:sample-sequence:panic`; phases prepare, forward, sample,
    /// sample-sequence, propose, apply, grammar, engine-loop; kinds error, panic), the spelling of the
    /// `SPECULA_INJECT_FAULT` test switch of `specula serve`.
    pub fn parse(spec: &str) -> Result<Self, String> {
        let bad = || format!("fault injection '{spec}' is not step:phase:kind (e.g. 4:engine-loop:panic)");
        let mut parts = spec.split(':');
        let (Some(step), Some(phase), Some(kind), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
            return Err(bad());
        };
        let step = step.parse().map_err(|_| bad())?;
        let phase = match phase {
            "prepare" => FaultPhase::Prepare,
            "forward" => FaultPhase::Forward,
            "sample" => FaultPhase::Sample,
            "sample-sequence" => FaultPhase::SampleSequence,
            "propose" => FaultPhase::Propose,
            "apply" => FaultPhase::Apply,
            "grammar" => FaultPhase::Grammar,
            "engine-loop" => FaultPhase::EngineLoop,
            _ => return Err(bad()),
        };
        let kind = match kind {
            "error" => FaultKind::Error,
            "panic" => FaultKind::Panic,
            _ => return Err(bad()),
        };
        Ok(Self { step, kind, phase })
    }

    /// Fails here if `fault` targets `phase` of `step`: an error to return (which a step turns
    /// into `StepFailure::Injected`), or a panic.
    pub(crate) fn trip(fault: Option<FaultInjection>, step: u64, phase: FaultPhase) -> Result<(), Injected> {
        match fault.filter(|f| f.step == step && f.phase == phase).map(|f| f.kind) {
            Some(FaultKind::Error) => Err(Injected),
            Some(FaultKind::Panic) => panic!("injected panic (test switch)"),
            None => Ok(()),
        }
    }
}

/// The error an injected fault of kind [`FaultKind::Error`] returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("injected fault (test switch)")]
pub struct Injected;
