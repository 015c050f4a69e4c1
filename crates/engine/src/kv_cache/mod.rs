//! Paged KV-cache bookkeeping: which fixed-size blocks of KV slots each sequence owns, and a prefix
//! cache that lets sequences with a common prompt prefix share the blocks already computed.
//! Metadata only: it hands out block ids and slot indices; the tensors live in the model's KV
//! store. Not a scheduler: it answers "does this fit?" and does what it is told, atomically.
//!
//! One owner, `&mut self` methods, no locks. `KvCacheManager::free` is the single way blocks go
//! back; the engine frees a sequence on every way a request ends (invariant 4 of docs/architecture.md).

mod block_hash;
mod block_pool;
mod manager;

pub use block_hash::{hash_block, BlockHash};
pub use manager::{KvCacheManager, PrefixCacheStats};

use crate::types::SeqId;

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
}
