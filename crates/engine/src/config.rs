//! Engine configuration: one struct per concern, validated once at start-up.

use crate::fault::FaultInjection;

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
    /// A hybrid model's prefix cache: snapshots of recurrent state kept at the end of prompts'
    /// cached prefixes (`--state-checkpoints`, each the size of one sequence's state); 0: no
    /// prefix caching for hybrids. Other models ignore it.
    pub state_checkpoints: usize,
    /// The prefix cache's host-memory and disk tiers (`--prefix-cache-memory`,
    /// `--prefix-cache-dir`); off by default here (the binary sizes them).
    pub prefix_tiers: crate::kv_cache::PrefixTierConfig,
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

/// Default `EngineConfig::state_checkpoints`: a few agents' conversations at once.
pub const DEFAULT_STATE_CHECKPOINTS: usize = 8;

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
            state_checkpoints: DEFAULT_STATE_CHECKPOINTS,
            prefix_tiers: Default::default(),
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
