//! Engine configuration: one struct per concern, validated once at start-up.

/// Scheduling and memory limits of one engine.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Most sequences in one step's batch.
    pub max_num_seqs: usize,
    /// Most tokens (prefill chunks + decodes + draft tokens) in one step.
    pub max_num_batched_tokens: usize,
    /// Longest prompt + completion a request may have.
    pub max_model_len: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks in the pool.
    pub num_kv_blocks: usize,
    /// What the KV cache stores (`--kv-cache-dtype`); the draft model's cache and the cost
    /// model's measurement use it too.
    pub kv_cache_dtype: specula_kernels::kv::KvDtype,
    pub enable_prefix_caching: bool,
    /// Compute threads for the forward pass.
    pub threads: usize,
    /// Requests allowed to wait before submit answers "queue full".
    pub max_waiting: usize,
    /// How long shutdown lets in-flight requests run before aborting them.
    pub shutdown_grace: std::time::Duration,
    /// Schedule and prepare step N+1 while step N computes (`--async-scheduling`).
    pub async_scheduling: bool,
    /// Jump-forward for structured outputs (`--structured-jump-forward`): where a request's
    /// grammar forces the next tokens, they are drafted (before the speculative proposer's own
    /// drafts, or alone when no speculative method is configured) and accepted by construction.
    /// Changes no output, only how many steps it takes.
    pub jump_forward: bool,
    /// Publish the unlabeled engine gauges (running, waiting, KV usage, prefix cache) after each
    /// step. Off for data-parallel ranks, whose labeled per-rank gauges and their aggregate are
    /// published by the rank loop (two writers would make a scrape see one rank's numbers).
    pub publish_gauges: bool,
    /// Test-only switch: make one phase (prepare, forward, sample, apply) of one step fail or panic.
    #[doc(hidden)]
    pub fault_injection: Option<FaultInjection>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_num_seqs: 16,
            max_num_batched_tokens: 512,
            max_model_len: 2048,
            block_size: 16,
            num_kv_blocks: 2048,
            kv_cache_dtype: specula_kernels::kv::KvDtype::default(),
            enable_prefix_caching: true,
            threads: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            max_waiting: 256,
            shutdown_grace: std::time::Duration::from_secs(10),
            async_scheduling: false,
            jump_forward: true,
            publish_gauges: true,
            fault_injection: None,
        }
    }
}

impl EngineConfig {
    /// Refuses configurations that could hang or fail later, with the flag to change.
    pub fn validate(&self, model_context: usize) -> Result<(), String> {
        if self.max_num_seqs == 0 {
            return Err("--max-num-seqs must be at least 1".into());
        }
        if self.threads == 0 {
            return Err("--threads must be at least 1".into());
        }
        if self.block_size == 0 || !self.block_size.is_multiple_of(8) && self.block_size != 1 {
            return Err(format!("block size {} must be a positive multiple of 8", self.block_size));
        }
        if self.max_model_len == 0 {
            return Err("--max-model-len must be at least 1".into());
        }
        if self.max_model_len > model_context {
            return Err(format!("--max-model-len {} exceeds the model's context length {model_context}", self.max_model_len));
        }
        let capacity = self.num_kv_blocks * self.block_size;
        if capacity < self.max_model_len {
            return Err(format!(
                "the KV cache holds {capacity} tokens but --max-model-len is {}; give it more memory (--kv-cache-tokens) or lower --max-model-len",
                self.max_model_len
            ));
        }
        if self.max_num_batched_tokens == 0 {
            return Err("--max-num-batched-tokens must be at least 1".into());
        }
        Ok(())
    }
}

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

    /// Fails here if `fault` targets `phase` of `step`: an error to return, or a panic.
    pub(crate) fn trip(fault: Option<FaultInjection>, step: u64, phase: FaultPhase) -> Result<(), crate::error::StepFailure> {
        match fault.filter(|f| f.step == step && f.phase == phase).map(|f| f.kind) {
            Some(FaultKind::Error) => Err(crate::error::StepFailure::Injected),
            Some(FaultKind::Panic) => panic!("injected panic (test switch)"),
            None => Ok(()),
        }
    }
}
