//! The bookkeeping both lower prefix-cache tiers share: entries by block hash, each with a size
//! in bytes, kept within a byte budget, least recently used out first. What an entry holds (the
//! host tier's bytes, nothing for the disk tier, whose bytes are in files) is the tier's.

use super::block_hash::BlockHash;
use std::collections::{BTreeMap, HashMap};

struct Entry<V> {
    value: V,
    size: u64,
    tick: u64,
}

pub(crate) struct ByteLru<V> {
    budget: u64,
    used: u64,
    entries: HashMap<BlockHash, Entry<V>>,
    /// tick of last use -> hash; the first is the next out.
    order: BTreeMap<u64, BlockHash>,
    next_tick: u64,
}

impl<V> ByteLru<V> {
    pub(crate) fn new(budget: u64) -> Self {
        Self { budget, used: 0, entries: HashMap::new(), order: BTreeMap::new(), next_tick: 0 }
    }

    pub(crate) fn budget(&self) -> u64 {
        self.budget
    }

    pub(crate) fn used(&self) -> u64 {
        self.used
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(crate) fn contains(&self, hash: BlockHash) -> bool {
        self.entries.contains_key(&hash)
    }

    /// The entry under `hash`, not marked used.
    pub(crate) fn peek(&self, hash: BlockHash) -> Option<&V> {
        self.entries.get(&hash).map(|e| &e.value)
    }

    fn tick(&mut self) -> u64 {
        self.next_tick += 1;
        self.next_tick - 1
    }

    /// Marks the entry under `hash` as just used.
    pub(crate) fn touch(&mut self, hash: BlockHash) {
        let tick = self.tick();
        if let Some(e) = self.entries.get_mut(&hash) {
            self.order.remove(&e.tick);
            e.tick = tick;
            self.order.insert(tick, hash);
        }
    }

    /// Keeps `value` under `hash` as the most recently used (replacing what was there), then drops
    /// the least recently used until the budget holds. Returns what was dropped; an entry larger
    /// than the whole budget is not kept and comes straight back, the others untouched.
    pub(crate) fn insert(&mut self, hash: BlockHash, value: V, size: u64) -> Vec<(BlockHash, V)> {
        if size > self.budget {
            return vec![(hash, value)];
        }
        self.remove(hash);
        let tick = self.tick();
        self.entries.insert(hash, Entry { value, size, tick });
        self.order.insert(tick, hash);
        self.used += size;
        let mut dropped = Vec::new();
        while self.used > self.budget {
            let Some((_, old)) = self.order.first_key_value().map(|(&t, &h)| (t, h)) else { break };
            if let Some(v) = self.remove(old) {
                dropped.push((old, v));
            }
        }
        dropped
    }

    /// Forgets the entry under `hash`, returning it.
    pub(crate) fn remove(&mut self, hash: BlockHash) -> Option<V> {
        let e = self.entries.remove(&hash)?;
        self.order.remove(&e.tick);
        self.used -= e.size;
        Some(e.value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_recently_used_go_first_and_too_large_an_entry_is_not_kept() {
        let mut l = ByteLru::new(30);
        for i in 0..3 {
            assert!(l.insert(BlockHash(i), i, 10).is_empty());
        }
        l.touch(BlockHash(0));
        assert_eq!(l.insert(BlockHash(3), 3, 10), vec![(BlockHash(1), 1)]);
        assert_eq!((l.len(), l.used()), (3, 30));
        assert_eq!(l.insert(BlockHash(9), 9, 31), vec![(BlockHash(9), 9)], "larger than the budget");
        assert_eq!(l.len(), 3, "the others untouched");
        // replacing an entry counts its new size once
        assert!(l.insert(BlockHash(0), 0, 5).is_empty());
        assert_eq!(l.used(), 25);
        assert_eq!(l.remove(BlockHash(2)), Some(2));
        assert_eq!((l.peek(BlockHash(0)), l.peek(BlockHash(2)), l.used()), (Some(&0), None, 15));
    }
}
