//! Speculative decoding: proposers guess the next k tokens of each sequence cheaply, the target
//! model scores all 1 + k positions in one batched pass, and the rejection sampler keeps a prefix
//! of the guesses so that the output distribution is exactly the target's (greedy: token for
//! token). Not the scheduler's business: it only sees a sequence's extra draft tokens.

pub mod adaptive;
pub mod config;
pub mod draft_model;
pub mod metrics;
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
}

/// Builds the proposer a configuration names. The draft model is loaded here, and checked
/// against the target's vocabulary.
pub fn build_proposer(cfg: &SpecConfig, target: &specula_model::ModelConfig, engine: &crate::config::EngineConfig) -> Result<Box<dyn Proposer>, SpecError> {
    cfg.validate().map_err(SpecError::Config)?;
    match cfg.method {
        SpecMethod::Ngram => Ok(Box::new(ngram::NgramProposer::new(cfg.ngram_min, cfg.ngram_max))),
        SpecMethod::Draft => {
            let path = cfg.draft_model.as_ref().ok_or_else(|| SpecError::Config("--speculative-method draft needs --draft-model PATH".into()))?;
            let loaded = specula_model::load_model(path)?;
            Ok(Box::new(draft_model::DraftModelProposer::new(loaded.model, target.vocab_size, engine.num_kv_blocks, engine.block_size)?))
        }
        SpecMethod::Mtp => Err(SpecError::Config("the mtp method needs a head file (not available yet in this build)".into())),
    }
}
