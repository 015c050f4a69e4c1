//! A communicator wrapper that counts the collectives made through it, by kind. Tests use it to
//! prove the lockstep contract (exactly one metadata all-reduce per step, whatever the batch
//! holds); it adds one relaxed atomic increment per call and nothing else.

use super::communicator::{CollectiveKind, Communicator, DpError};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Calls per collective kind (including calls that failed).
#[derive(Debug, Default)]
pub struct CollectiveCounts {
    by_kind: [AtomicU64; CollectiveKind::ALL.len()],
}

impl CollectiveCounts {
    pub fn get(&self, kind: CollectiveKind) -> u64 {
        self.by_kind[kind.index()].load(Ordering::Relaxed)
    }

    pub fn total(&self) -> u64 {
        self.by_kind.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    fn bump(&self, kind: CollectiveKind) {
        self.by_kind[kind.index()].fetch_add(1, Ordering::Relaxed);
    }
}

/// `inner` with every collective counted in a shared [`CollectiveCounts`].
pub struct CountingComm<C> {
    inner: C,
    counts: Arc<CollectiveCounts>,
}

impl<C: Communicator> CountingComm<C> {
    pub fn new(inner: C) -> Self {
        Self { inner, counts: Arc::new(CollectiveCounts::default()) }
    }

    /// The wrapped communicator.
    pub fn inner(&self) -> &C {
        &self.inner
    }

    /// The counters, readable while the communicator is in use on another thread.
    pub fn counts(&self) -> Arc<CollectiveCounts> {
        self.counts.clone()
    }
}

impl<C: Communicator> Communicator for CountingComm<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn all_reduce_sum_i64(&self, buf: &mut [i64]) -> Result<(), DpError> {
        self.counts.bump(CollectiveKind::AllReduceSum);
        self.inner.all_reduce_sum_i64(buf)
    }
    fn all_reduce_max_i64(&self, buf: &mut [i64]) -> Result<(), DpError> {
        self.counts.bump(CollectiveKind::AllReduceMax);
        self.inner.all_reduce_max_i64(buf)
    }
    fn all_gather_f32(&self, local: &[f32], out: &mut [f32]) -> Result<(), DpError> {
        self.counts.bump(CollectiveKind::AllGather);
        self.inner.all_gather_f32(local, out)
    }
    fn all_to_all_f32(&self, send: &[f32], recv: &mut [f32]) -> Result<(), DpError> {
        self.counts.bump(CollectiveKind::AllToAll);
        self.inner.all_to_all_f32(send, recv)
    }
    fn broadcast_bytes(&self, root: usize, buf: &mut Vec<u8>) -> Result<(), DpError> {
        self.counts.bump(CollectiveKind::Broadcast);
        self.inner.broadcast_bytes(root, buf)
    }
    fn barrier(&self) -> Result<(), DpError> {
        self.counts.bump(CollectiveKind::Barrier);
        self.inner.barrier()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dp::local::LocalGroup;

    #[test]
    fn counts_each_kind_separately() {
        let c = CountingComm::new(LocalGroup::new(1).pop().unwrap());
        let counts = c.counts();
        c.all_reduce_sum_i64(&mut [1]).unwrap();
        c.all_reduce_sum_i64(&mut [1]).unwrap();
        c.barrier().unwrap();
        c.broadcast_bytes(0, &mut vec![1]).unwrap();
        assert_eq!(counts.get(CollectiveKind::AllReduceSum), 2);
        assert_eq!(counts.get(CollectiveKind::Barrier), 1);
        assert_eq!(counts.get(CollectiveKind::Broadcast), 1);
        assert_eq!(counts.get(CollectiveKind::AllReduceMax), 0);
        assert_eq!(counts.total(), 4);
    }
}
