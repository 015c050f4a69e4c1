//! The per-sequence side of the KV cache: block tables, slot mapping, prefix-cache hits on a new
//! prompt, registering completed blocks, growing, rolling back and freeing. Not for deciding who
//! runs (the scheduler asks `blocks_needed`/`can_allocate` and decides) nor for the tensors.

use super::block_hash::{hash_block, BlockHash};
use super::block_pool::BlockPool;
use super::state_checkpoints::StateCheckpoints;
use super::tiers::{PrefixTiers, Tier};
use super::transfer::{BlockKey, BlockLoad, BlockSave, KvTransfers, LoadedBlock, SaveTo, StateRestore, StateSave, TransfersDone};
use super::{expect_kv, KvCacheError};
use crate::types::{BlockId, SeqId, TokenId};
use std::collections::HashMap;

/// Raw prefix-cache counters since start-up; the hit rate is computed when read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Prompt tokens looked up in the prefix cache (every prompt, whole length).
    pub queried_tokens: u64,
    /// Of those, tokens whose KV was found cached and reused (from any tier).
    pub hit_tokens: u64,
    /// Of the hits, tokens loaded from the host-memory tier and from the disk tier.
    pub host_hit_tokens: u64,
    pub disk_hit_tokens: u64,
}

impl PrefixCacheStats {
    /// `hit_tokens / queried_tokens`, or `None` before any query.
    pub fn hit_rate(&self) -> Option<f64> {
        (self.queried_tokens > 0).then(|| self.hit_tokens as f64 / self.queried_tokens as f64)
    }
}

/// One sequence's blocks.
#[derive(Debug, Default)]
struct SeqBlocks {
    /// Block `i` holds the KV of positions `i*block_size .. (i+1)*block_size`.
    table: Vec<BlockId>,
    /// Chain hashes of the leading full blocks whose KV is committed (hit or computed); entry `i`
    /// names `table[i]`'s content, so `hashes.len() <= table.len()`. The next committed block
    /// chains onto the last entry.
    hashes: Vec<BlockHash>,
    /// Its slot of recurrent state (hybrid models), held from admission to `free`.
    state: Option<u32>,
    /// Where its recurrent state is to be checkpointed (hybrid models with prefix caching): the
    /// last block boundary of its prompt before the final token, until a step ending there has
    /// been planned.
    checkpoint_at: Option<usize>,
}

/// Owns the block pool and every sequence's block table.
#[derive(Debug)]
pub struct KvCacheManager {
    pool: BlockPool,
    block_size: usize,
    enable_prefix_caching: bool,
    seqs: HashMap<SeqId, SeqBlocks>,
    stats: PrefixCacheStats,
    /// The prefix cache's host and disk tiers, when configured.
    tiers: Option<PrefixTiers>,
    /// Block copies decided since the last [`Self::take_transfers`] (the next step does them).
    pending: KvTransfers,
    /// Recurrent-state slots not held by a sequence (a hybrid model's; `None` for the others),
    /// and how many there are in all.
    free_states: Option<(Vec<u32>, usize)>,
    /// A hybrid's recurrent-state checkpoints, which its cached blocks are used with.
    checkpoints: Option<StateCheckpoints>,
}

impl KvCacheManager {
    /// A cache of `num_blocks` blocks of `block_size` token slots each (slots
    /// `0 .. num_blocks * block_size` in the KV store). Refuses zero sizes and more blocks than
    /// a `BlockId` can name.
    pub fn new(num_blocks: usize, block_size: usize, enable_prefix_caching: bool) -> Result<Self, KvCacheError> {
        if num_blocks == 0 || block_size == 0 {
            return Err(KvCacheError::InvalidConfig(format!(
                "need at least one block of at least one token, got {num_blocks} blocks of \
                 {block_size} tokens"
            )));
        }
        let n = u32::try_from(num_blocks).map_err(|_| KvCacheError::InvalidConfig(format!("{num_blocks} blocks exceed the u32 block-id range")))?;
        if num_blocks.checked_mul(block_size).is_none() {
            return Err(KvCacheError::InvalidConfig(format!("{num_blocks} blocks of {block_size} tokens overflow the slot index")));
        }
        Ok(Self {
            pool: BlockPool::new(n, block_size),
            block_size,
            enable_prefix_caching,
            seqs: HashMap::new(),
            stats: PrefixCacheStats::default(),
            tiers: None,
            pending: KvTransfers::default(),
            free_states: None,
            checkpoints: None,
        })
    }

    /// Gives every sequence one of `n` slots of recurrent state (a hybrid model's) from its
    /// admission until it is freed; a prompt is not admitted while all are held. A cached prefix
    /// is of use only with the state at its end: with `checkpoints` > 0 each prompt's state is
    /// saved at its last block boundary into one of that many checkpoints, and a prompt's cache
    /// hit is cut to the deepest boundary with one (`state_checkpoints`); with 0 prefix caching is
    /// off. The lower tiers are off either way (their blocks have no state).
    pub fn set_state_slots(&mut self, n: usize, checkpoints: usize) {
        self.free_states = Some(((0..n as u32).rev().collect(), n));
        self.tiers = None;
        if checkpoints == 0 || !self.enable_prefix_caching {
            self.enable_prefix_caching = false;
        } else {
            self.checkpoints = Some(StateCheckpoints::new(u32::try_from(checkpoints).unwrap_or(u32::MAX)));
        }
    }

    /// Recurrent-state checkpoints held, and room for how many (a hybrid with prefix caching).
    pub fn state_checkpoints(&self) -> Option<(usize, usize)> {
        self.checkpoints.as_ref().map(|c| (c.len(), c.capacity() as usize))
    }

    /// How many of the `n` tokens from `start` a step of `seq` may compute: a hybrid's prefill
    /// chunk stops at the block boundary where its state is to be checkpointed. `n` otherwise.
    pub fn chunk_len(&self, seq: SeqId, start: usize, n: usize) -> usize {
        match self.seqs.get(&seq).and_then(|b| b.checkpoint_at) {
            Some(at) if start < at && at < start + n => at - start,
            _ => n,
        }
    }

    /// `seq` (whose known tokens are `tokens`) is scheduled to compute `n` tokens from `start`:
    /// a step ending where its state is to be checkpointed saves it there (see
    /// [`Self::chunk_len`]). Call once the step is decided.
    pub fn note_scheduled(&mut self, seq: SeqId, tokens: &[TokenId], start: usize, n: usize) {
        let bs = self.block_size;
        let Some(b) = self.seqs.get_mut(&seq) else { return };
        let Some(at) = b.checkpoint_at.filter(|&at| start + n == at && at <= tokens.len()) else { return };
        b.checkpoint_at = None;
        let (Some(ck), Some(slot)) = (self.checkpoints.as_mut(), b.state) else { return };
        // the chain hash of the prefix's last block: what a later prompt's hits are keyed by
        let mut key = b.hashes.last().copied();
        for chunk in tokens[..at].chunks_exact(bs).skip(b.hashes.len()) {
            key = Some(hash_block(key, chunk));
        }
        if let Some(key) = key {
            if let Some(checkpoint) = ck.reserve(key) {
                self.pending.state_saves.push(StateSave { slot, checkpoint, position: at, key });
            }
        }
    }

    /// `seq`'s slot of recurrent state (`None` for a model without one).
    pub fn state_slot(&self, seq: SeqId) -> Result<Option<u32>, KvCacheError> {
        Ok(self.seq(seq)?.state)
    }

    /// Adds the prefix cache's lower tiers: blocks evicted from the store are saved there (and,
    /// with a disk tier, every registered block is written to disk), and a prompt's blocks missing
    /// from the store are looked up there. Without prefix caching this does nothing.
    /// A hybrid model's manager (`set_state_slots` called first) takes none: its blocks are of
    /// use only with the state checkpoints, which stay in memory.
    pub(crate) fn set_tiers(&mut self, tiers: Option<PrefixTiers>) {
        if self.enable_prefix_caching && tiers.is_some() && self.free_states.is_none() {
            self.pool.keep_evicted();
            self.tiers = tiers;
        }
    }

    /// What the lower tiers hold, when there are tiers.
    pub fn tier_sizes(&self) -> Option<super::TierSizes> {
        self.tiers.as_ref().map(|t| t.sizes())
    }

    /// The block copies the next step must do before its forward pass (see `transfer`): the saves
    /// of blocks evicted or registered since the last call, and the loads of prompt blocks found
    /// in a tier.
    pub(crate) fn take_transfers(&mut self) -> KvTransfers {
        self.note_evictions();
        std::mem::take(&mut self.pending)
    }

    /// Takes back what a step's transfers did: saved bytes go to their tier; a loaded block that
    /// its sequence still holds where it was loaded joins the prefix cache (until then it is the
    /// sequence's own, as if computed: a step that never ran its load never shares it).
    pub(crate) fn finish_transfers(&mut self, done: TransfersDone) {
        if let Some(tiers) = self.tiers.as_mut() {
            for saved in done.saved {
                tiers.accept(saved);
            }
        }
        if let Some(ck) = self.checkpoints.as_mut() {
            for s in done.states_saved {
                ck.saved(s.key, s.checkpoint);
            }
        }
        for l in done.loaded {
            let held = self.seqs.get(&l.seq).is_some_and(|b| b.table.get(l.index) == Some(&l.block) && b.hashes.get(l.index) == Some(&l.key.hash));
            if held {
                self.pool.register(l.block, l.key.hash, l.key.parent, &l.key.tokens);
            }
        }
    }

    /// Turns the pool's evictions into saves where a tier lacks the block.
    fn note_evictions(&mut self) {
        let Some(tiers) = self.tiers.as_ref() else { return };
        for (block, key) in self.pool.take_evicted() {
            if tiers.wants_evicted(key.hash) {
                self.pending.saves.push(BlockSave { block, key, to: SaveTo::Evicted });
            }
        }
    }

    /// A block for `seq`'s prompt block `index`, filled from a tier: false when the pool has none
    /// free.
    fn load_block(&mut self, seq: SeqId, index: usize, key: BlockKey, bytes: std::sync::Arc<[u8]>) -> Option<BlockId> {
        let block = self.pool.allocate()?;
        self.note_evictions();
        self.pending.loads.push(BlockLoad { at: LoadedBlock { block, seq, index, key }, bytes });
        Some(block)
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_total_blocks(&self) -> usize {
        self.pool.num_total_blocks()
    }

    /// Blocks available to new allocations: free plus cached-but-unheld (evictable).
    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free_blocks()
    }

    /// Fraction of blocks held by some sequence, in [0, 1].
    pub fn usage(&self) -> f32 {
        let total = self.num_total_blocks();
        (total - self.num_free_blocks()) as f32 / total as f32
    }

    pub fn prefix_cache_stats(&self) -> PrefixCacheStats {
        self.stats
    }

    /// Blocks registered in the prefix cache (held or evictable).
    pub fn num_cached_blocks(&self) -> usize {
        self.pool.num_cached_blocks()
    }

    /// Sequences currently holding blocks (0 once every request has ended).
    pub fn num_seqs(&self) -> usize {
        self.seqs.len()
    }

    /// Registers `seq` and attaches the cached blocks that hold a prefix of `prompt`. Returns the
    /// number of leading prompt tokens whose KV is already computed: a multiple of the block size
    /// and at most `prompt.len() - 1`, so the last prompt token is always computed and yields
    /// logits. Allocates no new blocks (call [`Self::ensure_capacity`] next).
    pub fn allocate_prompt(&mut self, seq: SeqId, prompt: &[TokenId]) -> Result<usize, KvCacheError> {
        if self.seqs.contains_key(&seq) {
            return Err(KvCacheError::SeqExists(seq));
        }
        let mut blocks = SeqBlocks::default();
        if let Some((free, total)) = self.free_states.as_mut() {
            blocks.state = Some(free.pop().ok_or(KvCacheError::OutOfStateSlots(*total))?);
        }
        if self.enable_prefix_caching {
            let max_hit_blocks = prompt.len().saturating_sub(1) / self.block_size;
            for chunk in prompt.chunks_exact(self.block_size).take(max_hit_blocks) {
                let parent = blocks.hashes.last().copied();
                let hash = hash_block(parent, chunk);
                let Some(block) = self.pool.lookup(hash, parent, chunk) else {
                    break;
                };
                self.pool.acquire(block);
                blocks.table.push(block);
                blocks.hashes.push(hash);
            }
            self.load_from_tiers(seq, prompt, max_hit_blocks, &mut blocks);
            self.cut_to_checkpoint(&mut blocks, prompt.len());
            let cached = blocks.table.len() * self.block_size;
            self.stats.queried_tokens += prompt.len() as u64;
            self.stats.hit_tokens += cached as u64;
        }
        let cached = blocks.table.len() * self.block_size;
        self.seqs.insert(seq, blocks);
        Ok(cached)
    }

    /// A hybrid's hits (`blocks`, of a prompt of `len` tokens) cut to the deepest block boundary
    /// whose recurrent state was checkpointed, that state restored into the sequence's slot by the
    /// next step, and the prompt's own checkpoint planned (its last boundary before the final
    /// token, unless the hit reaches it). Other models: nothing.
    fn cut_to_checkpoint(&mut self, blocks: &mut SeqBlocks, len: usize) {
        let (Some(ck), Some(slot)) = (self.checkpoints.as_mut(), blocks.state) else { return };
        let keep = blocks.hashes.iter().rposition(|&h| ck.contains(h)).map_or(0, |i| i + 1);
        for block in blocks.table.drain(keep..).rev() {
            self.pool.release(block);
        }
        blocks.hashes.truncate(keep);
        let bs = self.block_size;
        if let Some(checkpoint) = blocks.hashes.last().and_then(|&h| ck.lookup(h)) {
            self.pending.state_restores.push(StateRestore { checkpoint, slot, position: keep * bs });
        }
        let at = len.saturating_sub(1) / bs * bs;
        blocks.checkpoint_at = (at > keep * bs).then_some(at);
    }

    /// Extends `blocks` (the prefix-cache hits of `prompt` in the store) with the next blocks found
    /// in the lower tiers, up to `max_blocks`. Only when the free blocks hold the whole rest of the
    /// prompt: a prompt that cannot be admitted now does not read tiers every step it waits.
    fn load_from_tiers(&mut self, seq: SeqId, prompt: &[TokenId], max_blocks: usize, blocks: &mut SeqBlocks) {
        if self.tiers.is_none() || blocks.table.len() >= max_blocks {
            return;
        }
        let rest = prompt.len().div_ceil(self.block_size) - blocks.table.len();
        if self.pool.num_free_blocks() < rest {
            return;
        }
        let bs = self.block_size;
        for index in blocks.table.len()..max_blocks {
            let chunk = &prompt[index * bs..(index + 1) * bs];
            let parent = blocks.hashes.last().copied();
            let hash = hash_block(parent, chunk);
            let Some((bytes, tier)) = self.tiers.as_mut().and_then(|t| t.get(hash, parent, chunk)) else { break };
            let key = BlockKey { hash, parent, tokens: chunk.into() };
            let Some(block) = self.load_block(seq, index, key, bytes) else { break };
            blocks.table.push(block);
            blocks.hashes.push(hash);
            match tier {
                Tier::Host => self.stats.host_hit_tokens += bs as u64,
                Tier::Disk => self.stats.disk_hit_tokens += bs as u64,
            }
        }
    }

    /// New blocks `seq` needs to hold `total_tokens` tokens (0 if it already can).
    pub fn blocks_needed(&self, seq: SeqId, total_tokens: usize) -> Result<usize, KvCacheError> {
        let have = self.seq(seq)?.table.len();
        Ok(total_tokens.div_ceil(self.block_size).saturating_sub(have))
    }

    /// Whether `num_new_blocks` blocks can be allocated now.
    pub fn can_allocate(&self, num_new_blocks: usize) -> bool {
        num_new_blocks <= self.num_free_blocks()
    }

    /// Grows `seq`'s block table to hold `total_tokens` tokens. All or nothing: on
    /// `OutOfBlocks` no block was taken. Never shrinks (see [`Self::truncate`]).
    pub fn ensure_capacity(&mut self, seq: SeqId, total_tokens: usize) -> Result<(), KvCacheError> {
        let needed = self.blocks_needed(seq, total_tokens)?;
        let available = self.num_free_blocks();
        if needed > available {
            return Err(KvCacheError::OutOfBlocks { needed, available });
        }
        let new_blocks: Vec<BlockId> = (0..needed).filter_map(|_| self.pool.allocate()).collect();
        debug_assert_eq!(new_blocks.len(), needed, "pool had {available} free blocks");
        let blocks = self.seqs.get_mut(&seq).ok_or(KvCacheError::UnknownSeq(seq))?;
        blocks.table.extend(new_blocks);
        Ok(())
    }

    /// `seq`'s blocks in position order (what the attention kernel's block table row holds).
    pub fn block_table(&self, seq: SeqId) -> Result<&[BlockId], KvCacheError> {
        Ok(&self.seq(seq)?.table)
    }

    /// Tokens `seq` has slots for: `block_table.len() * block_size`.
    pub fn capacity(&self, seq: SeqId) -> Result<usize, KvCacheError> {
        Ok(self.seq(seq)?.table.len() * self.block_size)
    }

    /// The KV-store slot of position `pos` of `seq`: `block_id * block_size + pos % block_size`.
    pub fn slot(&self, seq: SeqId, pos: usize) -> Result<usize, KvCacheError> {
        let table = &self.seq(seq)?.table;
        match table.get(pos / self.block_size) {
            Some(b) => Ok(b.0 as usize * self.block_size + pos % self.block_size),
            None => Err(KvCacheError::PositionOutOfRange { seq, start: pos, end: pos + 1, capacity: table.len() * self.block_size }),
        }
    }

    /// Slots of positions `start_pos .. start_pos + n` of `seq`, in order.
    pub fn slot_mapping(&self, seq: SeqId, start_pos: usize, n: usize) -> Result<Vec<usize>, KvCacheError> {
        let mut out = Vec::new();
        self.extend_slot_mapping(seq, start_pos, n, &mut out)?;
        Ok(out)
    }

    /// Appends the slots of positions `start_pos .. start_pos + n` to `out` (a flat batch's slot
    /// mapping built sequence by sequence). On error `out` is unchanged.
    pub fn extend_slot_mapping(&self, seq: SeqId, start_pos: usize, n: usize, out: &mut Vec<usize>) -> Result<(), KvCacheError> {
        let table = &self.seq(seq)?.table;
        let capacity = table.len() * self.block_size;
        let end = start_pos.saturating_add(n);
        if end > capacity {
            return Err(KvCacheError::PositionOutOfRange { seq, start: start_pos, end, capacity });
        }
        let bs = self.block_size;
        out.extend((start_pos..end).map(|pos| table[pos / bs].0 as usize * bs + pos % bs));
        Ok(())
    }

    /// Records that the KV of `tokens` (all of `seq`'s tokens from position 0 whose KV is now
    /// computed, accepted tokens only) is complete, and registers each newly completed full block
    /// in the prefix cache. `tokens` must extend what was committed before; blocks committed
    /// earlier are not re-hashed. A no-op without prefix caching.
    pub fn commit_tokens(&mut self, seq: SeqId, tokens: &[TokenId]) -> Result<(), KvCacheError> {
        let bs = self.block_size;
        let blocks = self.seqs.get_mut(&seq).ok_or(KvCacheError::UnknownSeq(seq))?;
        let capacity = blocks.table.len() * bs;
        if tokens.len() > capacity {
            return Err(KvCacheError::PositionOutOfRange { seq, start: 0, end: tokens.len(), capacity });
        }
        if !self.enable_prefix_caching {
            return Ok(());
        }
        let full_blocks = tokens.len() / bs;
        for i in blocks.hashes.len()..full_blocks {
            let chunk = &tokens[i * bs..(i + 1) * bs];
            let parent = blocks.hashes.last().copied();
            let hash = hash_block(parent, chunk);
            let block = blocks.table[i];
            if self.pool.register(block, hash, parent, chunk) && self.tiers.as_ref().is_some_and(|t| t.wants_registered(hash)) {
                self.pending.saves.push(BlockSave { block, key: BlockKey { hash, parent, tokens: chunk.into() }, to: SaveTo::Disk });
            }
            blocks.hashes.push(hash);
        }
        Ok(())
    }

    /// Rolls `seq` back to its first `num_tokens` tokens (rejected draft tokens, preemption of a
    /// tail): blocks past them go back to the pool. Returns how many leading tokens' KV `seq`
    /// still holds: `min(num_tokens, capacity)`, except when `num_tokens` ends inside a block that
    /// is in the prefix cache or shared with another sequence. Such a block must not be written,
    /// so it is dropped from this sequence (unregistering nothing) and the result is rounded down
    /// to the block boundary; the caller recomputes the difference.
    pub fn truncate(&mut self, seq: SeqId, num_tokens: usize) -> Result<usize, KvCacheError> {
        let bs = self.block_size;
        let blocks = self.seqs.get_mut(&seq).ok_or(KvCacheError::UnknownSeq(seq))?;
        let mut keep_blocks = num_tokens.div_ceil(bs).min(blocks.table.len());
        let mut kept = num_tokens.min(blocks.table.len() * bs);
        if !kept.is_multiple_of(bs) {
            let partial = blocks.table[kept / bs];
            if self.pool.is_cached(partial) || self.pool.ref_count(partial) > 1 {
                keep_blocks = kept / bs;
                kept = keep_blocks * bs;
            }
        }
        // Release tail-first so that, if these blocks are cached, the LRU evicts the end of the
        // chain before its start (a child is useless without its parent).
        for block in blocks.table.drain(keep_blocks..).rev() {
            self.pool.release(block);
        }
        blocks.hashes.truncate(kept / bs);
        Ok(kept)
    }

    /// Returns every block of `seq` to the pool and forgets `seq`. Cached blocks stay reusable
    /// until evicted; the end of the sequence is evicted before its start.
    pub fn free(&mut self, seq: SeqId) -> Result<(), KvCacheError> {
        let blocks = self.seqs.remove(&seq).ok_or(KvCacheError::UnknownSeq(seq))?;
        for &block in blocks.table.iter().rev() {
            self.pool.release(block);
        }
        if let (Some((free, _)), Some(state)) = (self.free_states.as_mut(), blocks.state) {
            free.push(state);
            // its checkpoint copies not handed to a step yet are dropped with it
            self.pending.state_restores.retain(|r| r.slot != state);
            let mut ck = self.checkpoints.as_mut();
            self.pending.state_saves.retain(|s| {
                let dropped = s.slot == state;
                if let (true, Some(ck)) = (dropped, ck.as_deref_mut()) {
                    ck.cancel(s.checkpoint);
                }
                !dropped
            });
        }
        Ok(())
    }

    /// [`Self::free`] for a sequence that may never have been given blocks (a request that ends
    /// while waiting): whether it held any.
    pub fn release(&mut self, seq: SeqId) -> bool {
        match self.free(seq) {
            Ok(()) => true,
            Err(KvCacheError::UnknownSeq(_)) => false,
            Err(e) => {
                expect_kv::<()>(Err(e), "freeing a sequence", seq);
                false
            }
        }
    }

    fn seq(&self, seq: SeqId) -> Result<&SeqBlocks, KvCacheError> {
        self.seqs.get(&seq).ok_or(KvCacheError::UnknownSeq(seq))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(ids: &[u32]) -> Vec<BlockId> {
        ids.iter().map(|&i| BlockId(i)).collect()
    }

    /// Allocates `seq` with `prompt`, grows it to the whole prompt and commits it all, the way
    /// the engine does after the prompt's forward pass. Returns the cached-token count.
    fn prefill(kv: &mut KvCacheManager, seq: u64, prompt: &[TokenId]) -> usize {
        let cached = kv.allocate_prompt(SeqId(seq), prompt).unwrap();
        kv.ensure_capacity(SeqId(seq), prompt.len()).unwrap();
        kv.commit_tokens(SeqId(seq), prompt).unwrap();
        cached
    }

    #[test]
    fn eight_tokens_with_block_size_four_take_two_blocks() {
        let mut kv = KvCacheManager::new(4, 4, false).unwrap();
        assert_eq!(kv.allocate_prompt(SeqId(1), &[1, 2, 3, 4, 5, 6, 7, 8]), Ok(0));
        assert_eq!(kv.blocks_needed(SeqId(1), 8), Ok(2));
        kv.ensure_capacity(SeqId(1), 8).unwrap();
        assert_eq!(kv.block_table(SeqId(1)).unwrap(), b(&[0, 1]));
        assert_eq!(kv.slot_mapping(SeqId(1), 0, 8).unwrap(), vec![0, 1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(kv.num_free_blocks(), 2);
        assert_eq!(kv.usage(), 0.5);
    }

    #[test]
    fn slots_follow_the_block_table_not_the_position() {
        let mut kv = KvCacheManager::new(4, 4, false).unwrap();
        kv.allocate_prompt(SeqId(1), &[0; 4]).unwrap();
        kv.ensure_capacity(SeqId(1), 4).unwrap(); // block 0
        kv.allocate_prompt(SeqId(2), &[0; 4]).unwrap();
        kv.ensure_capacity(SeqId(2), 4).unwrap(); // block 1
        kv.ensure_capacity(SeqId(1), 6).unwrap(); // block 2
        assert_eq!(kv.block_table(SeqId(1)).unwrap(), b(&[0, 2]));
        assert_eq!(kv.slot(SeqId(1), 5), Ok(9));
        assert_eq!(kv.slot_mapping(SeqId(1), 2, 4).unwrap(), vec![2, 3, 8, 9]);
        let mut flat = vec![99];
        kv.extend_slot_mapping(SeqId(2), 3, 1, &mut flat).unwrap();
        assert_eq!(flat, vec![99, 7]);
    }

    #[test]
    fn positions_beyond_the_allocated_blocks_are_refused() {
        let mut kv = KvCacheManager::new(4, 4, false).unwrap();
        kv.allocate_prompt(SeqId(1), &[0; 3]).unwrap();
        kv.ensure_capacity(SeqId(1), 3).unwrap();
        let err = KvCacheError::PositionOutOfRange { seq: SeqId(1), start: 4, end: 5, capacity: 4 };
        assert_eq!(kv.slot(SeqId(1), 4), Err(err));
        let mut out = vec![1];
        assert!(kv.extend_slot_mapping(SeqId(1), 2, 3, &mut out).is_err());
        assert_eq!(out, vec![1]);
        assert!(kv.slot_mapping(SeqId(1), usize::MAX, 2).is_err());
    }

    #[test]
    fn ensure_capacity_is_all_or_nothing() {
        let mut kv = KvCacheManager::new(3, 4, false).unwrap();
        kv.allocate_prompt(SeqId(1), &[0; 4]).unwrap();
        kv.ensure_capacity(SeqId(1), 4).unwrap();
        assert_eq!(kv.ensure_capacity(SeqId(1), 13), Err(KvCacheError::OutOfBlocks { needed: 3, available: 2 }));
        assert_eq!(kv.block_table(SeqId(1)).unwrap(), b(&[0]));
        assert_eq!(kv.num_free_blocks(), 2);
        assert!(kv.can_allocate(2));
        assert!(!kv.can_allocate(3));
        kv.ensure_capacity(SeqId(1), 12).unwrap();
        assert_eq!(kv.block_table(SeqId(1)).unwrap(), b(&[0, 1, 2]));
        // Asking for less than it has is a no-op, not a shrink.
        kv.ensure_capacity(SeqId(1), 1).unwrap();
        assert_eq!(kv.capacity(SeqId(1)), Ok(12));
    }

    #[test]
    fn unknown_and_duplicate_sequences_are_errors() {
        let mut kv = KvCacheManager::new(2, 4, true).unwrap();
        let s = SeqId(9);
        assert_eq!(kv.ensure_capacity(s, 1), Err(KvCacheError::UnknownSeq(s)));
        assert_eq!(kv.block_table(s).err(), Some(KvCacheError::UnknownSeq(s)));
        assert_eq!(kv.commit_tokens(s, &[]), Err(KvCacheError::UnknownSeq(s)));
        assert_eq!(kv.truncate(s, 0), Err(KvCacheError::UnknownSeq(s)));
        assert_eq!(kv.free(s), Err(KvCacheError::UnknownSeq(s)));
        kv.allocate_prompt(s, &[1]).unwrap();
        assert_eq!(kv.allocate_prompt(s, &[1]), Err(KvCacheError::SeqExists(s)));
        kv.free(s).unwrap();
        assert_eq!(kv.free(s), Err(KvCacheError::UnknownSeq(s)));
    }

    #[test]
    fn zero_sizes_are_invalid_config() {
        assert!(matches!(KvCacheManager::new(0, 16, true), Err(KvCacheError::InvalidConfig(_))));
        assert!(matches!(KvCacheManager::new(16, 0, true), Err(KvCacheError::InvalidConfig(_))));
    }

    #[test]
    fn committing_beyond_capacity_is_refused() {
        let mut kv = KvCacheManager::new(2, 4, true).unwrap();
        kv.allocate_prompt(SeqId(1), &[1, 2, 3, 4, 5]).unwrap();
        kv.ensure_capacity(SeqId(1), 4).unwrap();
        assert_eq!(kv.commit_tokens(SeqId(1), &[1, 2, 3, 4, 5]), Err(KvCacheError::PositionOutOfRange { seq: SeqId(1), start: 0, end: 5, capacity: 4 }));
        assert_eq!(kv.pool.num_cached_blocks(), 0);
    }

    #[test]
    fn prefix_is_reused_after_the_first_sequence_is_freed() {
        let mut kv = KvCacheManager::new(8, 4, true).unwrap();
        let prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10];
        assert_eq!(prefill(&mut kv, 1, &prompt), 0);
        assert_eq!(kv.block_table(SeqId(1)).unwrap(), b(&[0, 1, 2]));
        kv.free(SeqId(1)).unwrap();
        assert_eq!(kv.num_free_blocks(), 8);

        assert_eq!(kv.allocate_prompt(SeqId(2), &prompt), Ok(8));
        assert_eq!(kv.block_table(SeqId(2)).unwrap(), b(&[0, 1]));
        kv.ensure_capacity(SeqId(2), 10).unwrap();
        // Block 2 held an uncached partial block, so it went back to the free list's tail.
        assert_eq!(kv.block_table(SeqId(2)).unwrap(), b(&[0, 1, 3]));
        assert_eq!(kv.prefix_cache_stats(), PrefixCacheStats { queried_tokens: 20, hit_tokens: 8, ..Default::default() });
        assert_eq!(kv.prefix_cache_stats().hit_rate(), Some(0.4));
    }

    #[test]
    fn a_fully_cached_prompt_still_leaves_its_last_token_to_compute() {
        let mut kv = KvCacheManager::new(8, 4, true).unwrap();
        let prompt = [1, 2, 3, 4, 5, 6, 7, 8];
        prefill(&mut kv, 1, &prompt);
        kv.free(SeqId(1)).unwrap();
        // Both blocks are cached, but token 8 must run to produce logits: only block 0 is a hit.
        assert_eq!(kv.allocate_prompt(SeqId(2), &prompt), Ok(4));
        assert_eq!(kv.blocks_needed(SeqId(2), 8), Ok(1));
        // A one-token prompt can never hit.
        assert_eq!(kv.allocate_prompt(SeqId(3), &[1]), Ok(0));
        assert_eq!(kv.allocate_prompt(SeqId(4), &[]), Ok(0));
    }

    /// A manager of 4 blocks of 2 tokens with a host tier.
    fn tiered() -> KvCacheManager {
        let mut kv = KvCacheManager::new(4, 2, true).unwrap();
        let tiers = PrefixTiers::open(&super::super::PrefixTierConfig { host_bytes: 1 << 20, disk: None }, 0, 8).unwrap();
        kv.set_tiers(tiers);
        kv
    }

    /// What a step does with saves: each block's "bytes" are its id, eight times.
    fn do_saves(kv: &mut KvCacheManager) -> Vec<BlockSave> {
        let t = kv.take_transfers();
        assert!(t.loads.is_empty());
        let saves = t.saves;
        let saved = saves.iter().map(|s| super::super::transfer::SavedBlock { key: s.key.clone(), to: s.to, bytes: vec![s.block.0 as u8; 8] }).collect();
        kv.finish_transfers(TransfersDone { saved, loaded: vec![], states_saved: vec![] });
        saves
    }

    /// The prompt [`evict_a`] runs.
    const A: [TokenId; 5] = [1, 2, 3, 4, 5];

    /// Runs `A` as sequence 1 and frees it, then has sequence 2 (still running) take the whole pool
    /// of [`tiered`], which evicts A's two cached blocks; returns their saves, done.
    fn evict_a(kv: &mut KvCacheManager) -> Vec<BlockSave> {
        prefill(kv, 1, &A);
        kv.free(SeqId(1)).unwrap();
        assert!(kv.take_transfers().is_empty(), "nothing evicted yet");
        prefill(kv, 2, &[9, 9, 8, 8, 7, 7, 6, 6]);
        do_saves(kv)
    }

    /// What the step did with `t`'s loads.
    fn loads_done(t: KvTransfers) -> TransfersDone {
        TransfersDone { saved: vec![], loaded: t.loads.into_iter().map(|l| l.at).collect(), states_saved: vec![] }
    }

    #[test]
    fn evicted_blocks_are_saved_and_come_back_as_loads_shared_once_the_step_did_them() {
        let mut kv = tiered();
        // the end of the chain is evicted first
        let saves = evict_a(&mut kv);
        assert_eq!(saves.iter().map(|s| (s.to, s.key.tokens.to_vec())).collect::<Vec<_>>(), vec![(SaveTo::Evicted, vec![3, 4]), (SaveTo::Evicted, vec![1, 2])]);
        kv.free(SeqId(2)).unwrap();
        // a again: both blocks from host memory, loaded into fresh blocks by the next step
        assert_eq!(kv.allocate_prompt(SeqId(3), &A), Ok(4));
        assert_eq!((kv.prefix_cache_stats().hit_tokens, kv.prefix_cache_stats().host_hit_tokens), (4, 4));
        let t = kv.take_transfers();
        let loads: Vec<(usize, Vec<u8>)> = t.loads.iter().map(|l| (l.at.index, l.bytes.to_vec())).collect();
        assert_eq!(loads, vec![(0, vec![saves[1].block.0 as u8; 8]), (1, vec![saves[0].block.0 as u8; 8])]);
        assert_eq!(t.saves.len(), 2, "the blocks they took were b's, evicted and saved in turn");
        // the step confirms its loads: they join the prefix cache
        kv.finish_transfers(loads_done(t));
        kv.ensure_capacity(SeqId(3), 5).unwrap();
        let before = kv.prefix_cache_stats();
        assert_eq!(kv.allocate_prompt(SeqId(4), &A), Ok(4));
        assert_eq!(kv.prefix_cache_stats().host_hit_tokens, before.host_hit_tokens, "shared from the store");
        assert_eq!(kv.block_table(SeqId(4)).unwrap()[..2], kv.block_table(SeqId(3)).unwrap()[..2]);
    }

    #[test]
    fn a_load_whose_sequence_has_gone_is_not_shared() {
        let mut kv = tiered();
        evict_a(&mut kv);
        kv.free(SeqId(2)).unwrap();
        assert_eq!(kv.allocate_prompt(SeqId(3), &A), Ok(4));
        let t = kv.take_transfers();
        // the sequence fails before its step's result comes back: its blocks go back unshared
        kv.free(SeqId(3)).unwrap();
        kv.finish_transfers(loads_done(t));
        assert_eq!(kv.num_free_blocks(), 4);
        // not in the store: the next request loads from host memory again
        let before = kv.prefix_cache_stats().host_hit_tokens;
        assert_eq!(kv.allocate_prompt(SeqId(4), &A), Ok(4));
        assert_eq!(kv.prefix_cache_stats().host_hit_tokens - before, 4, "nothing registered for a sequence that is gone");
    }

    #[test]
    fn a_prompt_that_cannot_be_admitted_does_not_read_the_tiers() {
        let mut kv = tiered();
        evict_a(&mut kv);
        // b still runs: a's 3 blocks do not fit in the 0 free ones, so no load is tried
        assert_eq!(kv.allocate_prompt(SeqId(3), &A), Ok(0));
        assert!(kv.take_transfers().is_empty());
        assert_eq!(kv.prefix_cache_stats().host_hit_tokens, 0);
    }

    #[test]
    fn a_different_first_block_hides_an_equal_second_block() {
        let mut kv = KvCacheManager::new(8, 2, true).unwrap();
        prefill(&mut kv, 1, &[1, 2, 3, 4, 5]);
        // Same second block [3, 4] but a different parent: no hit at all.
        assert_eq!(kv.allocate_prompt(SeqId(2), &[9, 9, 3, 4, 5]), Ok(0));
        // Shares only the first block.
        assert_eq!(kv.allocate_prompt(SeqId(3), &[1, 2, 7, 7, 5]), Ok(2));
    }

    #[test]
    fn shared_prefix_blocks_are_reference_counted() {
        let mut kv = KvCacheManager::new(8, 4, true).unwrap();
        let prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9];
        prefill(&mut kv, 1, &prompt);
        assert_eq!(prefill(&mut kv, 2, &prompt), 8);
        assert_eq!(kv.block_table(SeqId(1)).unwrap(), b(&[0, 1, 2]));
        assert_eq!(kv.block_table(SeqId(2)).unwrap(), b(&[0, 1, 3]));
        assert_eq!(kv.pool.ref_count(BlockId(0)), 2);
        assert_eq!(kv.pool.ref_count(BlockId(1)), 2);
        assert_eq!(kv.pool.ref_count(BlockId(3)), 1);
        assert_eq!(kv.num_free_blocks(), 4);

        kv.free(SeqId(1)).unwrap();
        assert_eq!(kv.pool.ref_count(BlockId(0)), 1);
        // Only block 2 came back; 0 and 1 are still held by sequence 2.
        assert_eq!(kv.num_free_blocks(), 5);
        kv.free(SeqId(2)).unwrap();
        assert_eq!(kv.num_free_blocks(), 8);
        assert_eq!(kv.pool.check_invariants(&[0; 8]), Ok(()));
    }

    #[test]
    fn evictable_blocks_are_evicted_oldest_release_first() {
        let mut kv = KvCacheManager::new(4, 2, true).unwrap();
        prefill(&mut kv, 1, &[1, 1, 9]); // blocks 0 (cached [1,1]) and 1 (partial)
        prefill(&mut kv, 2, &[2, 2, 9]); // blocks 2 (cached [2,2]) and 3 (partial)
        kv.free(SeqId(1)).unwrap(); // block 0 released first: oldest
        kv.free(SeqId(2)).unwrap();
        assert_eq!(kv.pool.num_cached_blocks(), 2);
        // Free list: 1, 3. Then evictable: 0 (older), 2.
        kv.allocate_prompt(SeqId(3), &[7]).unwrap();
        kv.ensure_capacity(SeqId(3), 6).unwrap();
        assert_eq!(kv.block_table(SeqId(3)).unwrap(), b(&[1, 3, 0]));
        // [1, 1] was evicted, [2, 2] survives.
        assert_eq!(kv.allocate_prompt(SeqId(4), &[1, 1, 9]), Ok(0));
        assert_eq!(kv.allocate_prompt(SeqId(5), &[2, 2, 9]), Ok(2));
    }

    #[test]
    fn a_freed_sequence_loses_its_last_block_before_its_first() {
        let mut kv = KvCacheManager::new(3, 2, true).unwrap();
        prefill(&mut kv, 1, &[1, 2, 3, 4, 5, 6]); // blocks 0, 1, 2, all cached
        kv.free(SeqId(1)).unwrap();
        kv.allocate_prompt(SeqId(2), &[8]).unwrap();
        kv.ensure_capacity(SeqId(2), 1).unwrap();
        // The tail block [5, 6] was evicted; the first two still hit.
        assert_eq!(kv.block_table(SeqId(2)).unwrap(), b(&[2]));
        assert_eq!(kv.allocate_prompt(SeqId(3), &[1, 2, 3, 4, 5, 6, 7]), Ok(4));
    }

    #[test]
    fn a_hit_on_an_evictable_block_protects_it_from_eviction() {
        let mut kv = KvCacheManager::new(2, 2, true).unwrap();
        prefill(&mut kv, 1, &[1, 2, 3]);
        kv.free(SeqId(1)).unwrap();
        assert_eq!(kv.allocate_prompt(SeqId(2), &[1, 2, 3]), Ok(2));
        assert_eq!(kv.num_free_blocks(), 1);
        assert_eq!(kv.ensure_capacity(SeqId(2), 4), Ok(()));
        assert_eq!(kv.block_table(SeqId(2)).unwrap(), b(&[0, 1]));
        assert_eq!(kv.ensure_capacity(SeqId(2), 5), Err(KvCacheError::OutOfBlocks { needed: 1, available: 0 }));
    }

    #[test]
    fn truncate_frees_the_blocks_past_the_kept_tokens() {
        let mut kv = KvCacheManager::new(8, 4, true).unwrap();
        kv.allocate_prompt(SeqId(1), &[1, 2, 3]).unwrap();
        kv.ensure_capacity(SeqId(1), 13).unwrap(); // 1 + 9 drafts, say
        assert_eq!(kv.block_table(SeqId(1)).unwrap(), b(&[0, 1, 2, 3]));
        assert_eq!(kv.truncate(SeqId(1), 5), Ok(5));
        assert_eq!(kv.block_table(SeqId(1)).unwrap(), b(&[0, 1]));
        assert_eq!(kv.num_free_blocks(), 6);
        assert_eq!(kv.truncate(SeqId(1), 8), Ok(8));
        assert_eq!(kv.block_table(SeqId(1)).unwrap(), b(&[0, 1]));
        assert_eq!(kv.truncate(SeqId(1), 100), Ok(8));
        assert_eq!(kv.truncate(SeqId(1), 0), Ok(0));
        assert_eq!(kv.block_table(SeqId(1)).unwrap(), b(&[]));
        assert_eq!(kv.num_free_blocks(), 8);
    }

    #[test]
    fn truncate_into_a_shared_block_drops_it_and_keeps_it_cached() {
        let mut kv = KvCacheManager::new(8, 4, true).unwrap();
        let prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9];
        prefill(&mut kv, 1, &prompt);
        prefill(&mut kv, 2, &prompt);
        // Position 6 lies in block 1, which sequence 1 shares: it cannot be overwritten.
        assert_eq!(kv.truncate(SeqId(2), 6), Ok(4));
        assert_eq!(kv.block_table(SeqId(2)).unwrap(), b(&[0]));
        assert_eq!(kv.pool.ref_count(BlockId(1)), 1);
        assert!(kv.pool.is_cached(BlockId(1)));
        // Re-committing the same tokens re-derives the same chain, with a fresh block for 4..8.
        kv.ensure_capacity(SeqId(2), 9).unwrap();
        kv.commit_tokens(SeqId(2), &prompt).unwrap();
        kv.free(SeqId(1)).unwrap();
        kv.free(SeqId(2)).unwrap();
        assert_eq!(kv.allocate_prompt(SeqId(3), &prompt), Ok(8));
    }

    #[test]
    fn truncate_into_an_unshared_cached_block_also_rounds_down() {
        let mut kv = KvCacheManager::new(4, 4, true).unwrap();
        prefill(&mut kv, 1, &[1, 2, 3, 4, 5]);
        assert_eq!(kv.truncate(SeqId(1), 2), Ok(0));
        assert_eq!(kv.num_free_blocks(), 4);
        // Its content stays a valid cache entry.
        assert_eq!(kv.allocate_prompt(SeqId(2), &[1, 2, 3, 4, 5]), Ok(4));
    }

    #[test]
    fn truncate_into_an_uncommitted_block_keeps_the_exact_count() {
        let mut kv = KvCacheManager::new(4, 4, true).unwrap();
        prefill(&mut kv, 1, &[1, 2, 3, 4, 5, 6]);
        kv.ensure_capacity(SeqId(1), 12).unwrap();
        assert_eq!(kv.truncate(SeqId(1), 7), Ok(7));
        assert_eq!(kv.block_table(SeqId(1)).unwrap(), b(&[0, 1]));
    }

    #[test]
    fn commit_registers_only_full_blocks_once() {
        let mut kv = KvCacheManager::new(4, 4, true).unwrap();
        kv.allocate_prompt(SeqId(1), &[1, 2, 3]).unwrap();
        kv.ensure_capacity(SeqId(1), 8).unwrap();
        kv.commit_tokens(SeqId(1), &[1, 2, 3]).unwrap();
        assert_eq!(kv.pool.num_cached_blocks(), 0);
        kv.commit_tokens(SeqId(1), &[1, 2, 3, 4, 5]).unwrap();
        assert_eq!(kv.pool.num_cached_blocks(), 1);
        kv.commit_tokens(SeqId(1), &[1, 2, 3, 4, 5, 6, 7, 8]).unwrap();
        kv.commit_tokens(SeqId(1), &[1, 2, 3, 4, 5, 6, 7, 8]).unwrap();
        assert_eq!(kv.pool.num_cached_blocks(), 2);
        assert_eq!(kv.pool.check_invariants(&[1, 1, 0, 0]), Ok(()));
    }

    #[test]
    fn without_prefix_caching_nothing_is_cached_or_counted() {
        let mut kv = KvCacheManager::new(4, 2, false).unwrap();
        prefill(&mut kv, 1, &[1, 2, 3]);
        kv.free(SeqId(1)).unwrap();
        assert_eq!(prefill(&mut kv, 2, &[1, 2, 3]), 0);
        assert_eq!(kv.pool.num_cached_blocks(), 0);
        assert_eq!(kv.prefix_cache_stats(), PrefixCacheStats::default());
        assert_eq!(kv.prefix_cache_stats().hit_rate(), None);
    }

    mod random_operations {
        use super::*;
        use proptest::prelude::*;

        const NUM_BLOCKS: usize = 12;
        const BLOCK_SIZE: usize = 3;

        #[derive(Clone, Debug)]
        enum Op {
            /// Allocate a sequence with this prompt (ignored if it exists).
            Allocate(u64, Vec<TokenId>),
            /// Compute this many more tokens (new ones appended past the prompt) and commit them.
            Extend(u64, usize, Vec<TokenId>),
            /// Roll back to this fraction (per mille) of the computed tokens.
            Truncate(u64, u32),
            Free(u64),
        }

        fn op() -> impl Strategy<Value = Op> {
            // A tiny alphabet so prompts share prefixes often.
            let tokens = |n| prop::collection::vec(0u32..3, 0..n);
            prop_oneof![
                (0u64..4, tokens(10)).prop_map(|(s, t)| Op::Allocate(s, t)),
                (0u64..4, 0usize..6, tokens(6)).prop_map(|(s, n, t)| Op::Extend(s, n, t)),
                (0u64..4, 0u32..=1000).prop_map(|(s, f)| Op::Truncate(s, f)),
                (0u64..4).prop_map(Op::Free),
            ]
        }

        /// What the test knows about one live sequence.
        struct Model {
            tokens: Vec<TokenId>,
            /// Leading tokens whose KV is written (and committed).
            computed: usize,
        }

        /// A stand-in for the KV tensors: each slot remembers the whole prefix whose last token
        /// was written there, so a prefix hit can be checked to hand out the right KV.
        type Store = Vec<Option<Vec<TokenId>>>;

        fn check(kv: &KvCacheManager, models: &HashMap<u64, Model>) -> Result<(), TestCaseError> {
            let mut holders = vec![0u32; NUM_BLOCKS];
            for s in models.keys() {
                for b in kv.block_table(SeqId(*s)).unwrap() {
                    holders[b.0 as usize] += 1;
                }
            }
            prop_assert_eq!(kv.pool.check_invariants(&holders), Ok(()));
            let held = holders.iter().filter(|&&h| h > 0).count();
            prop_assert_eq!(kv.num_free_blocks() + held, NUM_BLOCKS);
            Ok(())
        }

        fn write(kv: &KvCacheManager, store: &mut Store, s: u64, m: &Model, range: std::ops::Range<usize>) -> Result<(), TestCaseError> {
            for pos in range {
                let block = kv.block_table(SeqId(s)).unwrap()[pos / BLOCK_SIZE];
                prop_assert_eq!(kv.pool.ref_count(block), 1, "writing into a shared block");
                prop_assert!(!kv.pool.is_cached(block), "writing into a cached block");
                store[kv.slot(SeqId(s), pos).unwrap()] = Some(m.tokens[..=pos].to_vec());
            }
            Ok(())
        }

        fn apply(kv: &mut KvCacheManager, store: &mut Store, models: &mut HashMap<u64, Model>, op: Op) -> Result<(), TestCaseError> {
            match op {
                Op::Allocate(s, prompt) => {
                    if models.contains_key(&s) {
                        prop_assert_eq!(kv.allocate_prompt(SeqId(s), &prompt), Err(KvCacheError::SeqExists(SeqId(s))));
                        return Ok(());
                    }
                    let cached = kv.allocate_prompt(SeqId(s), &prompt).unwrap();
                    prop_assert_eq!(cached % BLOCK_SIZE, 0);
                    prop_assert!(cached == 0 || cached < prompt.len());
                    for pos in 0..cached {
                        let slot = kv.slot(SeqId(s), pos).unwrap();
                        prop_assert_eq!(store[slot].as_deref(), Some(&prompt[..=pos]), "stale prefix hit");
                    }
                    models.insert(s, Model { tokens: prompt, computed: cached });
                }
                Op::Extend(s, n, new_tokens) => {
                    let Some(m) = models.get_mut(&s) else {
                        return Ok(());
                    };
                    let target = m.computed + n;
                    for t in new_tokens.iter().take(target.saturating_sub(m.tokens.len())) {
                        m.tokens.push(*t);
                    }
                    let target = target.min(m.tokens.len());
                    let free_before = kv.num_free_blocks();
                    let table_before = kv.block_table(SeqId(s)).unwrap().to_vec();
                    match kv.ensure_capacity(SeqId(s), target) {
                        Ok(()) => {
                            write(kv, store, s, m, m.computed..target)?;
                            m.computed = target;
                            kv.commit_tokens(SeqId(s), &m.tokens[..target]).unwrap();
                        }
                        Err(KvCacheError::OutOfBlocks { needed, available }) => {
                            prop_assert!(needed > available);
                            prop_assert_eq!(kv.num_free_blocks(), free_before);
                            prop_assert_eq!(kv.block_table(SeqId(s)).unwrap(), &table_before[..]);
                        }
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
                Op::Truncate(s, per_mille) => {
                    let Some(m) = models.get_mut(&s) else {
                        return Ok(());
                    };
                    let n = m.computed * per_mille as usize / 1000;
                    let kept = kv.truncate(SeqId(s), n).unwrap();
                    prop_assert!(kept <= n && kept >= n / BLOCK_SIZE * BLOCK_SIZE);
                    prop_assert_eq!(kv.capacity(SeqId(s)).unwrap(), kept.div_ceil(BLOCK_SIZE) * BLOCK_SIZE);
                    m.tokens.truncate(n);
                    m.computed = kept;
                }
                Op::Free(s) => {
                    let result = kv.free(SeqId(s));
                    prop_assert_eq!(result.is_ok(), models.remove(&s).is_some());
                }
            }
            Ok(())
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(512))]
            #[test]
            fn blocks_never_leak_and_refcounts_stay_exact(ops in prop::collection::vec(op(), 1..60)) {
                let mut kv = KvCacheManager::new(NUM_BLOCKS, BLOCK_SIZE, true).unwrap();
                let mut store: Store = vec![None; NUM_BLOCKS * BLOCK_SIZE];
                let mut models = HashMap::new();
                for op in ops {
                    apply(&mut kv, &mut store, &mut models, op)?;
                    check(&kv, &models)?;
                }
                let live: Vec<u64> = models.keys().copied().collect();
                for s in live {
                    kv.free(SeqId(s)).unwrap();
                    models.remove(&s);
                    check(&kv, &models)?;
                }
                prop_assert_eq!(kv.num_free_blocks(), NUM_BLOCKS);
                prop_assert_eq!(kv.num_seqs(), 0);
            }
        }
    }
}
