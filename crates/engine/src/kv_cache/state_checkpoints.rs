//! Which snapshots of recurrent state a hybrid model's prefix cache holds. A hybrid's cached KV
//! blocks are of use only with the recurrent state at the end of them: a sequence's state is
//! saved at one block boundary of its prompt (the last before its final token), keyed by the
//! chain hash of the blocks up to there, and a later prompt with that prefix starts from the
//! deepest boundary it finds, its state restored there. The bookkeeping only: the copies are
//! the step's (`transfer::StateSave`, `transfer::StateRestore`), into and out of the store's
//! numbered checkpoints (`RecurrentStore::save_checkpoint`), which this hands out, least recently
//! used first when all are taken.

use super::block_hash::BlockHash;
use std::collections::HashMap;

#[derive(Debug)]
pub(crate) struct StateCheckpoints {
    capacity: u32,
    /// Saved checkpoints: their id and the tick they were last saved or used at.
    held: HashMap<BlockHash, (u32, u64)>,
    /// Ids never used, or given back.
    free: Vec<u32>,
    /// Ids handed to a save not yet done (taken from `free` or from `held`'s oldest).
    in_flight: usize,
    tick: u64,
}

impl StateCheckpoints {
    /// Room for `capacity` checkpoints (ids `0..capacity`).
    pub(crate) fn new(capacity: u32) -> Self {
        Self { capacity, held: HashMap::new(), free: (0..capacity).rev().collect(), in_flight: 0, tick: 0 }
    }

    /// The checkpoint saved for the prefix ending with block `hash`, marked used.
    pub(crate) fn lookup(&mut self, hash: BlockHash) -> Option<u32> {
        self.tick += 1;
        let tick = self.tick;
        self.held.get_mut(&hash).map(|e| {
            e.1 = tick;
            e.0
        })
    }

    pub(crate) fn contains(&self, hash: BlockHash) -> bool {
        self.held.contains_key(&hash)
    }

    /// An id to save the prefix ending with block `hash` into: a free one, else the least
    /// recently used checkpoint's (forgotten now). None when that prefix is held already or every
    /// id awaits its save.
    pub(crate) fn reserve(&mut self, hash: BlockHash) -> Option<u32> {
        if self.held.contains_key(&hash) {
            return None;
        }
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                let (&oldest, _) = self.held.iter().min_by_key(|(_, &(_, used))| used)?;
                self.held.remove(&oldest).map(|(id, _)| id)?
            }
        };
        self.in_flight += 1;
        Some(id)
    }

    /// The save into `id` (from [`Self::reserve`]) is done: it now holds the prefix `hash`.
    pub(crate) fn saved(&mut self, hash: BlockHash, id: u32) {
        self.in_flight = self.in_flight.saturating_sub(1);
        self.tick += 1;
        if let Some((old, _)) = self.held.insert(hash, (id, self.tick)) {
            // the same prefix saved twice at once: keep one, give the other id back
            if old != id {
                self.free.push(old);
            }
        }
    }

    /// The save into `id` will not be done: the id is free again.
    pub(crate) fn cancel(&mut self, id: u32) {
        self.in_flight = self.in_flight.saturating_sub(1);
        self.free.push(id);
    }

    /// Checkpoints held.
    pub(crate) fn len(&self) -> usize {
        self.held.len()
    }

    pub(crate) fn capacity(&self) -> u32 {
        self.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: u64) -> BlockHash {
        crate::kv_cache::hash_block(None, &[x as u32])
    }

    #[test]
    fn the_least_recently_used_checkpoint_is_reused_when_all_are_taken() {
        let mut c = StateCheckpoints::new(2);
        let a = c.reserve(h(1)).unwrap();
        c.saved(h(1), a);
        let b = c.reserve(h(2)).unwrap();
        c.saved(h(2), b);
        assert_ne!(a, b);
        assert_eq!(c.reserve(h(1)), None, "held already");
        // 1 used after 2: 2 is the one to go
        assert_eq!(c.lookup(h(1)), Some(a));
        let d = c.reserve(h(3)).unwrap();
        assert_eq!(d, b);
        assert!(!c.contains(h(2)) && c.contains(h(1)));
        c.saved(h(3), d);
        assert_eq!((c.len(), c.lookup(h(3))), (2, Some(b)));
    }

    #[test]
    fn ids_awaiting_their_save_are_not_handed_out_again() {
        let mut c = StateCheckpoints::new(1);
        let a = c.reserve(h(1)).unwrap();
        assert_eq!(c.reserve(h(2)), None, "the one id awaits its save");
        c.saved(h(1), a);
        assert_eq!(c.reserve(h(2)), Some(a));
    }
}
