//! The prefix cache's host-memory tier: the KV of blocks evicted from the KV store, kept by chain
//! hash within a byte budget, least recently used out first. A hit hands out the bytes shared
//! (no copy); the entry stays, so a second request with the same prefix finds it too.

use super::block_hash::BlockHash;
use super::transfer::BlockKey;
use crate::types::TokenId;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

struct Entry {
    key: BlockKey,
    bytes: Arc<[u8]>,
    tick: u64,
}

pub(crate) struct HostTier {
    budget: usize,
    used: usize,
    entries: HashMap<BlockHash, Entry>,
    /// tick of last use -> hash; the first is the next out.
    lru: BTreeMap<u64, BlockHash>,
    next_tick: u64,
}

impl HostTier {
    pub(crate) fn new(budget: usize) -> Self {
        Self { budget, used: 0, entries: HashMap::new(), lru: BTreeMap::new(), next_tick: 0 }
    }

    pub(crate) fn budget(&self) -> usize {
        self.budget
    }

    pub(crate) fn used(&self) -> usize {
        self.used
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(crate) fn contains(&self, hash: BlockHash) -> bool {
        self.entries.contains_key(&hash)
    }

    /// The bytes of the block holding `tokens` after `parent`, if kept; marks it used.
    pub(crate) fn get(&mut self, hash: BlockHash, parent: Option<BlockHash>, tokens: &[TokenId]) -> Option<Arc<[u8]>> {
        let tick = self.next_tick;
        let e = self.entries.get_mut(&hash).filter(|e| e.key.matches(parent, tokens))?;
        self.lru.remove(&e.tick);
        e.tick = tick;
        self.lru.insert(tick, hash);
        self.next_tick += 1;
        Some(e.bytes.clone())
    }

    /// Keeps `bytes` under `key`, making room by dropping the least recently used; a block larger
    /// than the whole budget, or one already kept, is not added.
    pub(crate) fn insert(&mut self, key: BlockKey, bytes: Arc<[u8]>) {
        let size = entry_size(&key, &bytes);
        if size > self.budget || self.entries.contains_key(&key.hash) {
            return;
        }
        while self.used + size > self.budget {
            let Some((_, old)) = self.lru.pop_first() else { break };
            if let Some(e) = self.entries.remove(&old) {
                self.used -= entry_size(&e.key, &e.bytes);
            }
        }
        let tick = self.next_tick;
        self.next_tick += 1;
        self.used += size;
        self.lru.insert(tick, key.hash);
        self.entries.insert(key.hash, Entry { key, bytes, tick });
    }
}

/// What an entry counts against the budget: its KV and its tokens.
fn entry_size(key: &BlockKey, bytes: &[u8]) -> usize {
    bytes.len() + std::mem::size_of_val(&*key.tokens)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::block_hash::hash_block;

    fn key(tokens: &[TokenId]) -> BlockKey {
        BlockKey { hash: hash_block(None, tokens), parent: None, tokens: tokens.into() }
    }

    #[test]
    fn the_least_recently_used_goes_first_and_the_budget_holds() {
        // each entry: 100 bytes + 2 tokens of 4 bytes
        let mut t = HostTier::new(3 * 108);
        for i in 0..3u32 {
            t.insert(key(&[i, i]), vec![i as u8; 100].into());
        }
        assert_eq!((t.len(), t.used()), (3, 324));
        // touch block 0, then a fourth pushes out block 1 (the least recently used)
        assert!(t.get(key(&[0, 0]).hash, None, &[0, 0]).is_some());
        t.insert(key(&[3, 3]), vec![3; 100].into());
        assert!(t.contains(key(&[0, 0]).hash) && !t.contains(key(&[1, 1]).hash));
        assert!(t.used() <= t.budget());
        assert_eq!(t.get(key(&[3, 3]).hash, None, &[3, 3]).as_deref(), Some(&[3u8; 100][..]));
    }

    #[test]
    fn a_hit_compares_the_tokens_and_too_large_a_block_is_not_kept() {
        let mut t = HostTier::new(200);
        t.insert(key(&[1, 2]), vec![7; 50].into());
        assert!(t.get(key(&[1, 2]).hash, None, &[1, 3]).is_none(), "a forged hash is a miss");
        assert!(t.get(key(&[1, 2]).hash, Some(BlockHash(9)), &[1, 2]).is_none());
        t.insert(key(&[5, 5]), vec![0; 300].into());
        assert!(!t.contains(key(&[5, 5]).hash));
        assert_eq!(t.len(), 1);
        let mut none = HostTier::new(0);
        none.insert(key(&[1, 2]), vec![7; 1].into());
        assert_eq!(none.len(), 0);
    }
}
