//! Speculative decoding: proposers guess the next k tokens of each sequence cheaply, the target
//! model scores all 1 + k positions in one batched pass, and the rejection sampler keeps a prefix
//! of the guesses so that the output distribution is exactly the target's (greedy: token for
//! token). Not the scheduler's business: it only sees a sequence's extra draft tokens.

pub mod adaptive;
pub mod config;
pub mod draft_model;
pub mod metrics;
pub mod mtp;
pub mod mtp_format;
pub mod ngram;
pub mod proposer;
pub mod rejection;
pub mod vocab_map;

pub use config::{SpecConfig, SpecMethod};
pub use metrics::SpecMetrics;
pub use proposer::{Draft, DraftRequest, Proposer};
pub use rejection::{verify, Verdict};

/// Why speculation could not be set up or run.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("invalid speculative decoding configuration: {0}")]
    Config(String),
    #[error("draft model: {0}")]
    Model(#[from] specula_model::ModelError),
    #[error("draft KV cache: {0}")]
    Kv(#[from] crate::kv_cache::KvCacheError),
    #[error("sampling: {0}")]
    Sampling(#[from] crate::sampling::SamplingError),
    /// The mtp head file is unreadable, malformed or made for another target.
    #[error("mtp head {path}: {message}")]
    Head { path: String, message: String },
}

/// What `build_proposer` knows of the target: its shape always, its weights when the caller has
/// them loaded (the mtp head uses the target's token embedding and checks its fingerprint).
#[derive(Clone, Copy)]
pub enum ProposerTarget<'a> {
    Config(&'a specula_model::ModelConfig),
    Model(&'a specula_model::LlamaModel),
}

impl ProposerTarget<'_> {
    pub fn config(&self) -> &specula_model::ModelConfig {
        match self {
            Self::Config(c) => c,
            Self::Model(m) => &m.config,
        }
    }
}

impl<'a> From<&'a specula_model::ModelConfig> for ProposerTarget<'a> {
    fn from(c: &'a specula_model::ModelConfig) -> Self {
        Self::Config(c)
    }
}

impl<'a> From<&'a specula_model::LlamaModel> for ProposerTarget<'a> {
    fn from(m: &'a specula_model::LlamaModel) -> Self {
        Self::Model(m)
    }
}

/// Builds the proposer a configuration names. The draft model is loaded here, and checked
/// against the target's vocabulary. `target` is the target's config or, for `mtp`, the loaded
/// target model itself.
pub fn build_proposer<'a>(
    cfg: &SpecConfig,
    target: impl Into<ProposerTarget<'a>>,
    engine: &crate::config::EngineConfig,
) -> Result<Box<dyn Proposer>, SpecError> {
    cfg.validate().map_err(SpecError::Config)?;
    let target = target.into();
    match cfg.method {
        SpecMethod::Ngram => Ok(Box::new(ngram::NgramProposer::new(cfg.ngram_min, cfg.ngram_max))),
        SpecMethod::Draft => {
            let path = cfg.draft_model.as_ref().ok_or_else(|| SpecError::Config("--speculative-method draft needs --draft-model PATH".into()))?;
            let loaded = specula_model::load_model(path)?;
            Ok(Box::new(draft_model::DraftModelProposer::new(loaded.model, target.config().vocab_size, engine.num_kv_blocks, engine.block_size)?))
        }
        SpecMethod::Mtp => {
            let path = cfg.draft_model.as_ref().ok_or_else(|| {
                SpecError::Config("--speculative-method mtp needs --draft-model HEAD.safetensors (an mtp head trained for this target)".into())
            })?;
            let ProposerTarget::Model(model) = target else {
                return Err(SpecError::Config(
                    "the mtp proposer reads the target's weights: build it from the loaded target model, not only its config".into(),
                ));
            };
            // without adaptive speculation every step drafts exactly k
            let gate = if cfg.adaptive { cfg.mtp_min_confidence } else { 0.0 };
            Ok(Box::new(mtp::MtpProposer::load(path, model)?.with_min_confidence(gate)))
        }
    }
}

/// Speculative decoding state of an engine: the proposer, the counters and each sequence's
/// acceptance history (adaptive k). It travels with the step's compute job.
pub struct Speculation {
    pub cfg: SpecConfig,
    pub proposer: Box<dyn Proposer>,
    pub metrics: SpecMetrics,
    pub(crate) trackers: std::collections::BTreeMap<crate::types::SeqId, adaptive::AcceptanceTracker>,
    /// Acceptance over every sequence: where a new sequence's estimate starts.
    pub(crate) global: adaptive::AcceptanceTracker,
    /// Cost of one more draft token relative to a plain step (verification + proposing).
    pub(crate) cost_per_draft_token: f64,
}

impl Speculation {
    /// `target` is the verified model's config (for the proposer's relative cost).
    pub fn new(cfg: SpecConfig, proposer: Box<dyn Proposer>, target: &specula_model::ModelConfig) -> Self {
        let metrics = SpecMetrics::new(cfg.num_speculative_tokens);
        let cost_per_draft_token = cfg.verify_cost_per_token + proposer.cost_per_draft_token(target);
        Self { cfg, proposer, metrics, trackers: std::collections::BTreeMap::new(), global: adaptive::AcceptanceTracker::global(), cost_per_draft_token }
    }

    /// Records a verification of `proposed` drafts of which `accepted` were kept.
    pub(crate) fn record(&mut self, seq: crate::types::SeqId, proposed: usize, accepted: usize) {
        self.metrics.record(proposed, accepted);
        self.global.record(proposed, accepted);
        self.tracker(seq).record(proposed, accepted);
    }

    /// `seq`'s acceptance tracker, started from the engine-wide estimate on first use.
    fn tracker(&mut self, seq: crate::types::SeqId) -> &mut adaptive::AcceptanceTracker {
        let global = &self.global;
        self.trackers.entry(seq).or_insert_with(|| adaptive::AcceptanceTracker::from_global(global))
    }

    /// Draft length for `seq` this step, at most `k_limit` (the batch's budget; without adaptive
    /// speculation, exactly `k_limit`).
    pub(crate) fn next_k(&mut self, seq: crate::types::SeqId, k_limit: usize) -> usize {
        if !self.cfg.adaptive {
            return k_limit;
        }
        let cost = self.cost_per_draft_token;
        self.tracker(seq).next_k(k_limit, cost)
    }

    /// Forgets a sequence that ended.
    pub(crate) fn remove(&mut self, seq: crate::types::SeqId) {
        self.proposer.remove(seq);
        self.trackers.remove(&seq);
    }
}
