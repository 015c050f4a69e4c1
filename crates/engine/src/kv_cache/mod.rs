//! Paged KV-cache bookkeeping: which fixed-size blocks of KV slots each sequence owns, and a prefix
//! cache that lets sequences with a common prompt prefix share the blocks already computed.
//! Metadata only: it hands out block ids and slot indices; the tensors live in the model's KV
//! store. Not a scheduler: it answers "does this fit?" and does what it is told, atomically.
//!
//! Below the store the prefix cache has a host-memory tier and a disk tier (`tiers`): evicted
//! blocks are saved there and a prompt's missing blocks loaded from there, the copies done by the
//! step's compute job (`transfer`).
//!
//! One owner, `&mut self` methods, no locks. `KvCacheManager::free` is the single way blocks go
//! back; the engine frees a sequence on every way a request ends (invariant 4 of docs/architecture.md).

mod block_hash;
mod block_pool;
mod byte_lru;
pub mod disk_tier;
mod host_tier;
mod manager;
mod state_checkpoints;
mod tiers;
pub mod transfer;

pub use block_hash::{hash_block, BlockHash};
pub use disk_tier::DiskTierConfig;
pub use manager::{KvCacheManager, PrefixCacheStats};
pub(crate) use tiers::PrefixTiers;
pub use tiers::{PrefixTierConfig, TierSizes};

use crate::types::SeqId;

/// The result of a KV-cache operation that cannot be refused while the engine's bookkeeping is
/// right (truncating or committing a running sequence's tokens): a refusal is a broken invariant,
/// never dropped in silence: an error log, and a debug assertion (so every test, run in the `ci`
/// profile, fails on it). Release builds log and go on, the cache unchanged (refusals change
/// nothing).
pub(crate) fn expect_kv<T>(result: Result<T, KvCacheError>, what: &str, seq: SeqId) -> Option<T> {
    match result {
        Ok(v) => Some(v),
        Err(e) => {
            tracing::error!(seq = %seq, "KV cache invariant broken: {what}: {e}");
            debug_assert!(false, "KV cache invariant broken: {what} for {seq}: {e}");
            None
        }
    }
}

/// Why a KV-cache operation was refused. Every refusal leaves the cache unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvCacheError {
    #[error(
        "KV cache is out of blocks: {needed} more needed but only {available} free; \
         finish or preempt a sequence, or start with more KV-cache memory"
    )]
    OutOfBlocks { needed: usize, available: usize },
    #[error("{0} has no KV blocks (never allocated, or already freed)")]
    UnknownSeq(SeqId),
    #[error("{0} already has KV blocks; free it before allocating it again")]
    SeqExists(SeqId),
    #[error(
        "{seq}: positions {start}..{end} are beyond its {capacity} allocated KV slots; \
         call ensure_capacity first"
    )]
    PositionOutOfRange { seq: SeqId, start: usize, end: usize, capacity: usize },
    #[error("invalid KV-cache configuration: {0}")]
    InvalidConfig(String),
    #[error("every one of the {0} recurrent-state slots is held by a running sequence")]
    OutOfStateSlots(usize),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(debug_assertions, should_panic(expected = "KV cache invariant broken: committing computed tokens"))]
    fn a_kv_refusal_that_breaks_an_invariant_is_never_silent() {
        // debug builds (the `ci` profile every test runs in) stop here; release logs and goes on
        let r = expect_kv::<()>(Err(KvCacheError::UnknownSeq(SeqId(3))), "committing computed tokens", SeqId(3));
        assert_eq!(r, None);
    }

    #[test]
    fn releasing_a_sequence_that_never_had_blocks_is_quiet() {
        let mut kv = KvCacheManager::new(4, 16, false).unwrap();
        assert!(!kv.release(SeqId(1)), "an unknown sequence held nothing");
        kv.allocate_prompt(SeqId(2), &[1, 2, 3]).unwrap();
        kv.ensure_capacity(SeqId(2), 20).unwrap();
        assert!(kv.release(SeqId(2)));
        assert_eq!(kv.num_free_blocks(), 4);
    }
}
