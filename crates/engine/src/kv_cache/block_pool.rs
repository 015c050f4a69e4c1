//! The pool of KV blocks: who holds each block (reference counts), which blocks are free, and the
//! prefix cache that lets a full block's KV be reused by a later sequence with the same prefix.
//! Metadata only: the tensors live in the model's KV store, indexed by the `BlockId`s handed out
//! here. Not for per-sequence bookkeeping (block tables live in [`super::KvCacheManager`]), and
//! not public: every mutation goes through the manager so refcounts stay balanced.

use super::block_hash::BlockHash;
use super::transfer::BlockKey;
use crate::types::{BlockId, TokenId};
use std::collections::{BTreeMap, HashMap, VecDeque};

#[derive(Debug, Default)]
struct BlockMeta {
    /// Number of sequences whose block table lists this block; 0 means nobody will write or read
    /// it until it is handed out again.
    ref_count: u32,
    /// `Some` while the block is in the prefix cache: its KV is complete and immutable, so it may
    /// be shared. A cached block is never written again until it is evicted. The key is kept so
    /// that a hit is confirmed by comparing tokens, not trusted on a 64-bit hash alone.
    cached: Option<BlockKey>,
    /// `Some(tick)` while the block is evictable (ref_count 0 and cached): its key in
    /// `BlockPool::evictable`.
    evictable_since: Option<u64>,
}

#[derive(Debug)]
pub(crate) struct BlockPool {
    block_size: usize,
    blocks: Vec<BlockMeta>,
    /// Blocks with ref_count 0 holding nothing worth keeping. Handed out first (front first) so
    /// that cached content survives as long as possible.
    free: VecDeque<BlockId>,
    /// Cached blocks with ref_count 0, keyed by the tick at which they were released: a later
    /// request may still hit them, so they are reclaimed only when `free` is empty, oldest
    /// release first (LRU).
    evictable: BTreeMap<u64, BlockId>,
    /// The prefix cache: chain hash -> the one block registered under it. A second block with the
    /// same content (two sequences computing the same prefix at once) is simply not registered.
    by_hash: HashMap<BlockHash, BlockId>,
    /// Monotonic clock for `evictable`; never reused, so keys are unique.
    next_tick: u64,
    /// With lower prefix-cache tiers: the blocks evicted since the manager last took them, with
    /// what they held (still there until the step that reuses them writes).
    evicted: Option<Vec<(BlockId, BlockKey)>>,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks of `block_size` tokens, all free. Sizes are validated by the
    /// manager.
    pub(crate) fn new(num_blocks: u32, block_size: usize) -> Self {
        Self {
            block_size,
            blocks: (0..num_blocks).map(|_| BlockMeta::default()).collect(),
            free: (0..num_blocks).map(BlockId).collect(),
            evictable: BTreeMap::new(),
            by_hash: HashMap::new(),
            next_tick: 0,
            evicted: None,
        }
    }

    /// Keep a list of evicted blocks for [`Self::take_evicted`] from now on.
    pub(crate) fn keep_evicted(&mut self) {
        self.evicted.get_or_insert_with(Vec::new);
    }

    /// The blocks evicted from the prefix cache since the last call, in order.
    pub(crate) fn take_evicted(&mut self) -> Vec<(BlockId, BlockKey)> {
        self.evicted.as_mut().map(std::mem::take).unwrap_or_default()
    }

    pub(crate) fn num_total_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks that [`BlockPool::allocate`] can hand out: free plus evictable.
    pub(crate) fn num_free_blocks(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks registered in the prefix cache, held or not.
    pub(crate) fn num_cached_blocks(&self) -> usize {
        self.by_hash.len()
    }

    pub(crate) fn ref_count(&self, block: BlockId) -> u32 {
        self.meta(block).ref_count
    }

    pub(crate) fn is_cached(&self, block: BlockId) -> bool {
        self.meta(block).cached.is_some()
    }

    /// A block for new KV, with ref_count 1: a free one, else the least recently released
    /// evictable one (which leaves the prefix cache). `None` when every block is held.
    pub(crate) fn allocate(&mut self) -> Option<BlockId> {
        let block = match self.free.pop_front() {
            Some(b) => b,
            None => {
                let (_, b) = self.evictable.pop_first()?;
                let meta = self.meta_mut(b);
                meta.evictable_since = None;
                let content = meta.cached.take();
                debug_assert!(content.is_some(), "evictable block {b:?} was not cached");
                if let Some(c) = content {
                    self.by_hash.remove(&c.hash);
                    if let Some(ev) = self.evicted.as_mut() {
                        ev.push((b, c));
                    }
                }
                b
            }
        };
        let meta = self.meta_mut(block);
        debug_assert_eq!(meta.ref_count, 0, "allocated block {block:?} was still held");
        meta.ref_count = 1;
        Some(block)
    }

    /// The cached block holding exactly `tokens` after the chain `parent`, if any; confirmed by
    /// comparing the stored tokens and parent, not just the hash.
    pub(crate) fn lookup(&self, hash: BlockHash, parent: Option<BlockHash>, tokens: &[TokenId]) -> Option<BlockId> {
        let block = *self.by_hash.get(&hash)?;
        self.meta(block).cached.as_ref()?.matches(parent, tokens).then_some(block)
    }

    /// One more holder for a block (a prefix-cache hit). An evictable block stops being evictable.
    pub(crate) fn acquire(&mut self, block: BlockId) {
        let meta = self.meta_mut(block);
        meta.ref_count += 1;
        if let Some(tick) = meta.evictable_since.take() {
            self.evictable.remove(&tick);
        }
    }

    /// One holder fewer. At zero the block goes to the evictable LRU if cached, else to the free
    /// list.
    pub(crate) fn release(&mut self, block: BlockId) {
        let tick = self.next_tick;
        let meta = self.meta_mut(block);
        if meta.ref_count == 0 {
            // A double release is an engine bug: the test build (debug assertions) stops on it;
            // a release build logs it and keeps the block where it is (freeing it twice would
            // hand one block to two sequences).
            debug_assert!(false, "released block {block:?} with ref_count 0");
            tracing::error!(?block, "KV block released with no holder (an engine bug); ignored");
            return;
        }
        meta.ref_count -= 1;
        if meta.ref_count > 0 {
            return;
        }
        if meta.cached.is_some() {
            meta.evictable_since = Some(tick);
            self.evictable.insert(tick, block);
            self.next_tick += 1;
        } else {
            self.free.push_back(block);
        }
    }

    /// Registers a held block whose KV is now complete under `hash`. Returns false (and leaves
    /// the block uncached) when another block already holds this content.
    pub(crate) fn register(&mut self, block: BlockId, hash: BlockHash, parent: Option<BlockHash>, tokens: &[TokenId]) -> bool {
        debug_assert_eq!(tokens.len(), self.block_size, "only full blocks are cached");
        debug_assert!(self.meta(block).ref_count > 0, "registering unheld block {block:?}");
        if self.by_hash.contains_key(&hash) || self.meta(block).cached.is_some() {
            return false;
        }
        self.by_hash.insert(hash, block);
        self.meta_mut(block).cached = Some(BlockKey { hash, parent, tokens: tokens.into() });
        true
    }

    fn meta(&self, block: BlockId) -> &BlockMeta {
        &self.blocks[block.0 as usize]
    }

    fn meta_mut(&mut self, block: BlockId) -> &mut BlockMeta {
        &mut self.blocks[block.0 as usize]
    }

    /// Checks every bookkeeping invariant against `holders` (how many block tables list each
    /// block). Test support: returns a description of the first violation.
    #[cfg(test)]
    pub(crate) fn check_invariants(&self, holders: &[u32]) -> Result<(), String> {
        let mut seen = vec![0u8; self.blocks.len()];
        for &b in &self.free {
            seen[b.0 as usize] += 1;
        }
        for (&tick, &b) in &self.evictable {
            seen[b.0 as usize] += 1;
            if self.meta(b).evictable_since != Some(tick) {
                return Err(format!("{b:?} in evictable under tick {tick} but meta disagrees"));
            }
        }
        for (i, meta) in self.blocks.iter().enumerate() {
            let b = BlockId(i as u32);
            if meta.ref_count != holders[i] {
                return Err(format!("{b:?} ref_count {} but {} holders", meta.ref_count, holders[i]));
            }
            let expected_lists = u8::from(meta.ref_count == 0);
            if seen[i] != expected_lists {
                return Err(format!("{b:?} (ref_count {}) is on {} lists", meta.ref_count, seen[i]));
            }
            if meta.ref_count == 0 && meta.cached.is_some() != meta.evictable_since.is_some() {
                return Err(format!("{b:?} is unheld but cached/evictable disagree"));
            }
            if meta.ref_count > 0 && meta.evictable_since.is_some() {
                return Err(format!("{b:?} is held but marked evictable"));
            }
            if let Some(c) = &meta.cached {
                if self.by_hash.get(&c.hash) != Some(&b) {
                    return Err(format!("{b:?} is cached but not indexed by its hash"));
                }
            }
        }
        if self.by_hash.len() != self.blocks.iter().filter(|m| m.cached.is_some()).count() {
            return Err("prefix-cache index and cached blocks disagree".to_string());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::block_hash::hash_block;

    #[test]
    fn fresh_pool_hands_out_blocks_in_id_order() {
        let mut pool = BlockPool::new(3, 4);
        assert_eq!(pool.allocate(), Some(BlockId(0)));
        assert_eq!(pool.allocate(), Some(BlockId(1)));
        assert_eq!(pool.allocate(), Some(BlockId(2)));
        assert_eq!(pool.allocate(), None);
        assert_eq!(pool.num_free_blocks(), 0);
    }

    #[test]
    fn released_uncached_block_goes_back_to_the_free_list() {
        let mut pool = BlockPool::new(2, 4);
        let a = pool.allocate().unwrap();
        pool.release(a);
        assert_eq!(pool.num_free_blocks(), 2);
        assert_eq!(pool.ref_count(a), 0);
        assert_eq!(pool.check_invariants(&[0, 0]), Ok(()));
    }

    #[test]
    fn free_blocks_are_used_before_evicting_cached_ones() {
        let mut pool = BlockPool::new(2, 2);
        let a = pool.allocate().unwrap();
        let h = hash_block(None, &[7, 8]);
        assert!(pool.register(a, h, None, &[7, 8]));
        pool.release(a);
        // Block 1 is free, so block 0 keeps its cached content.
        assert_eq!(pool.allocate(), Some(BlockId(1)));
        assert_eq!(pool.lookup(h, None, &[7, 8]), Some(a));
        // Now only the evictable block is left: taking it drops it from the cache.
        assert_eq!(pool.allocate(), Some(a));
        assert_eq!(pool.lookup(h, None, &[7, 8]), None);
        assert_eq!(pool.num_cached_blocks(), 0);
        assert_eq!(pool.check_invariants(&[1, 1]), Ok(()));
    }

    #[test]
    fn lookup_compares_tokens_not_only_the_hash() {
        let mut pool = BlockPool::new(1, 2);
        let a = pool.allocate().unwrap();
        let h = hash_block(None, &[1, 2]);
        pool.register(a, h, None, &[1, 2]);
        assert_eq!(pool.lookup(h, None, &[1, 2]), Some(a));
        // Same hash presented with other tokens (a forged collision) is a miss.
        assert_eq!(pool.lookup(h, None, &[1, 3]), None);
        assert_eq!(pool.lookup(h, Some(BlockHash(5)), &[1, 2]), None);
    }

    #[test]
    fn second_block_with_the_same_content_is_not_registered() {
        let mut pool = BlockPool::new(2, 2);
        let a = pool.allocate().unwrap();
        let b = pool.allocate().unwrap();
        let h = hash_block(None, &[1, 2]);
        assert!(pool.register(a, h, None, &[1, 2]));
        assert!(!pool.register(b, h, None, &[1, 2]));
        assert!(!pool.is_cached(b));
        pool.release(b);
        pool.release(a);
        assert_eq!(pool.free.len(), 1);
        assert_eq!(pool.evictable.len(), 1);
        assert_eq!(pool.check_invariants(&[0, 0]), Ok(()));
    }

    #[test]
    fn acquiring_an_evictable_block_takes_it_off_the_lru() {
        let mut pool = BlockPool::new(1, 2);
        let a = pool.allocate().unwrap();
        pool.register(a, hash_block(None, &[1, 2]), None, &[1, 2]);
        pool.release(a);
        assert_eq!(pool.num_free_blocks(), 1);
        pool.acquire(a);
        assert_eq!(pool.num_free_blocks(), 0);
        assert_eq!(pool.ref_count(a), 1);
        assert_eq!(pool.allocate(), None);
        assert_eq!(pool.check_invariants(&[1]), Ok(()));
    }
}
