//! KV blocks moving between the KV store and the prefix cache's lower tiers (host memory, disk).
//! The bookkeeping decides (`KvCacheManager`): an evicted cached block is saved, a block the
//! disk tier lacks is saved when it is registered, a prompt block found in a tier is loaded into
//! a fresh block. The compute job does the copies, before its forward pass: every block it saves
//! still holds what was registered (a cached block is never written, and the block's next writer
//! is this step or a later one), and every block it loads is written before anything reads it.
//! Data flows one way: decisions go down with the step, saved bytes come back with its output.

use super::block_hash::BlockHash;
use crate::types::{BlockId, SeqId, TokenId};
use std::sync::Arc;

/// What a full block holds, named: its chain hash, its parent's, and its tokens (compared on every
/// hit, so a hash collision cannot hand out the wrong KV).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockKey {
    pub hash: BlockHash,
    pub parent: Option<BlockHash>,
    pub tokens: Box<[TokenId]>,
}

impl BlockKey {
    /// Whether this is the block of `tokens` after the chain `parent`.
    pub fn matches(&self, parent: Option<BlockHash>, tokens: &[TokenId]) -> bool {
        self.parent == parent && *self.tokens == *tokens
    }
}

/// Where a saved block goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SaveTo {
    /// Evicted from the KV store: the host tier, and the disk tier when there is one.
    Evicted,
    /// Just registered in the prefix cache and not on disk yet: the disk tier only (so that the
    /// next process finds it without this one ever evicting it).
    Disk,
}

/// Copy block `block` out of the KV store (it holds `key`'s KV).
#[derive(Debug)]
pub struct BlockSave {
    pub block: BlockId,
    pub key: BlockKey,
    pub to: SaveTo,
}

/// Copy `bytes` (found in a tier under `at.key`) into the block `at` names.
#[derive(Debug)]
pub struct BlockLoad {
    pub at: LoadedBlock,
    pub bytes: Arc<[u8]>,
}

/// Before the forward pass: put checkpoint `checkpoint` (a sequence's recurrent state at
/// `position`, a hybrid's prefix-cache hit) into state slot `slot`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateRestore {
    pub checkpoint: u32,
    pub slot: u32,
    pub position: usize,
}

/// After the forward pass: copy state slot `slot`, then at `position` (the end of the prompt
/// prefix whose last block is `key`), into checkpoint `checkpoint`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateSave {
    pub slot: u32,
    pub checkpoint: u32,
    pub position: usize,
    pub key: BlockHash,
}

/// One step's block copies, saves first (a block evicted and refilled in the same step is read
/// before it is written), and a hybrid's recurrent-state checkpoints: restores before the
/// forward pass, saves after it (`state_checkpoints`).
#[derive(Debug, Default)]
pub struct KvTransfers {
    pub saves: Vec<BlockSave>,
    pub loads: Vec<BlockLoad>,
    pub state_restores: Vec<StateRestore>,
    pub state_saves: Vec<StateSave>,
}

impl KvTransfers {
    pub fn is_empty(&self) -> bool {
        self.saves.is_empty() && self.loads.is_empty() && self.state_restores.is_empty() && self.state_saves.is_empty()
    }

    pub fn append(&mut self, mut other: KvTransfers) {
        self.saves.append(&mut other.saves);
        self.loads.append(&mut other.loads);
        self.state_restores.append(&mut other.state_restores);
        self.state_saves.append(&mut other.state_saves);
    }
}

/// A save done: the block's bytes, back to the bookkeeping with the step's output.
#[derive(Debug)]
pub struct SavedBlock {
    pub key: BlockKey,
    pub to: SaveTo,
    pub bytes: Vec<u8>,
}

/// Where a load goes: block `block`, which `seq` holds as its `index`-th, is to hold `key`'s KV.
/// Once the load is done it may join the prefix cache (if `seq` still holds it there).
#[derive(Debug)]
pub struct LoadedBlock {
    pub block: BlockId,
    pub seq: SeqId,
    pub index: usize,
    pub key: BlockKey,
}

/// What a step's transfers did.
#[derive(Debug, Default)]
pub struct TransfersDone {
    pub saved: Vec<SavedBlock>,
    pub loaded: Vec<LoadedBlock>,
    /// The recurrent-state checkpoints saved after the forward pass.
    pub states_saved: Vec<StateSave>,
}
