//! The prefix cache's host-memory tier: the KV of blocks evicted from the KV store, kept by chain
//! hash within a byte budget, least recently used out first. A hit hands out the bytes shared
//! (no copy); the entry stays, so a second request with the same prefix finds it too.

use super::block_hash::BlockHash;
use super::byte_lru::ByteLru;
use super::transfer::BlockKey;
use crate::types::TokenId;
use std::sync::Arc;

pub(crate) struct HostTier {
    lru: ByteLru<(BlockKey, Arc<[u8]>)>,
}

impl HostTier {
    pub(crate) fn new(budget: usize) -> Self {
        Self { lru: ByteLru::new(budget as u64) }
    }

    pub(crate) fn budget(&self) -> usize {
        self.lru.budget() as usize
    }

    pub(crate) fn used(&self) -> usize {
        self.lru.used() as usize
    }

    pub(crate) fn len(&self) -> usize {
        self.lru.len()
    }

    pub(crate) fn contains(&self, hash: BlockHash) -> bool {
        self.lru.contains(hash)
    }

    /// The bytes of the block holding `tokens` after `parent`, if kept; marks it used.
    pub(crate) fn get(&mut self, hash: BlockHash, parent: Option<BlockHash>, tokens: &[TokenId]) -> Option<Arc<[u8]>> {
        let bytes = self.lru.peek(hash).filter(|(key, _)| key.matches(parent, tokens))?.1.clone();
        self.lru.touch(hash);
        Some(bytes)
    }

    /// Keeps `bytes` under `key`, making room by dropping the least recently used; a block larger
    /// than the whole budget, or one already kept, is not added.
    pub(crate) fn insert(&mut self, key: BlockKey, bytes: Arc<[u8]>) {
        if !self.lru.contains(key.hash) {
            let size = entry_size(&key, &bytes) as u64;
            self.lru.insert(key.hash, (key, bytes), size);
        }
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
