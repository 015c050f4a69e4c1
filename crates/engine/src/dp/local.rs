//! In-process ranks: one `LocalComm` per thread, all sharing one rendezvous. Each collective is
//! a generation barrier on a `Mutex` + `Condvar`: every rank deposits its contribution, the last
//! to arrive publishes all of them and wakes the others, and each rank computes its own result
//! from the published contributions. Waiting ranks sleep on the condvar (no spinning). A rank
//! whose `LocalComm` is dropped (it returned or panicked) poisons the group: every collective in
//! progress or to come fails with `DpError::PeerGone` instead of waiting forever.

use super::communicator::{check_all_to_all_shape, check_gather_shape, check_root, CollectiveKind, Communicator, DpError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// What one rank brings to a collective.
#[derive(Clone, Debug)]
enum Payload {
    I64(Vec<i64>),
    F32(Vec<f32>),
    Bytes(Vec<u8>),
    Empty,
}

impl Payload {
    fn len(&self) -> usize {
        match self {
            Payload::I64(v) => v.len(),
            Payload::F32(v) => v.len(),
            Payload::Bytes(v) => v.len(),
            Payload::Empty => 0,
        }
    }
}

/// The contributions of one completed collective, in rank order, or why it failed.
type Published = Arc<Result<Vec<Payload>, DpError>>;

struct Rendezvous {
    /// Counts completed collectives; a waiter knows its round is over when this moves on.
    generation: u64,
    /// This round's contributions by rank (`None`: not arrived yet).
    pending: Vec<Option<(CollectiveKind, usize, Payload)>>,
    arrived: usize,
    /// The last completed round. Stays valid until every rank has read it, because the next
    /// round cannot complete before every rank has arrived at it.
    published: Option<Published>,
    /// The first rank that left the group; set once, never cleared.
    gone: Option<usize>,
}

struct Shared {
    size: usize,
    state: Mutex<Rendezvous>,
    wake: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Rendezvous> {
        // No code panics while holding this lock; a poisoned mutex still holds consistent state.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Builds the communicators of an in-process group.
pub struct LocalGroup;

impl LocalGroup {
    /// `n` communicators, rank i at index i; move each to its rank's thread.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(n: usize) -> Vec<LocalComm> {
        let shared = Arc::new(Shared {
            size: n,
            state: Mutex::new(Rendezvous { generation: 0, pending: vec![None; n], arrived: 0, published: None, gone: None }),
            wake: Condvar::new(),
        });
        (0..n).map(|rank| LocalComm { rank, shared: shared.clone() }).collect()
    }
}

/// One rank's end of an in-process group.
pub struct LocalComm {
    rank: usize,
    shared: Arc<Shared>,
}

impl LocalComm {
    /// Deposits this rank's contribution and blocks (sleeping) until every rank has deposited
    /// one; returns all contributions in rank order.
    fn exchange(&self, kind: CollectiveKind, arg: usize, payload: Payload) -> Result<Vec<Payload>, DpError> {
        let sh = &*self.shared;
        let mut st = sh.lock();
        if let Some(rank) = st.gone {
            return Err(DpError::PeerGone { rank });
        }
        let my_generation = st.generation;
        debug_assert!(st.pending[self.rank].is_none(), "rank {} entered a collective twice", self.rank);
        st.pending[self.rank] = Some((kind, arg, payload));
        st.arrived += 1;
        if st.arrived == sh.size {
            let round: Vec<_> = st.pending.iter_mut().map(|p| p.take().expect("every rank arrived")).collect();
            st.published = Some(Arc::new(complete(round)));
            st.arrived = 0;
            st.generation += 1;
            sh.wake.notify_all();
        } else {
            while st.generation == my_generation && st.gone.is_none() {
                st = sh.wake.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            if st.generation == my_generation {
                let rank = st.gone.expect("loop ended without a new generation");
                return Err(DpError::PeerGone { rank });
            }
        }
        let published = st.published.clone().expect("a completed round is published");
        drop(st);
        (*published).clone()
    }
}

/// Checks that every rank called the same collective with compatible shapes.
fn complete(round: Vec<(CollectiveKind, usize, Payload)>) -> Result<Vec<Payload>, DpError> {
    let (kind0, arg0, len0) = (round[0].0, round[0].1, round[0].2.len());
    for (r, (kind, arg, p)) in round.iter().enumerate().skip(1) {
        if *kind != kind0 {
            return Err(DpError::Mismatch(format!("rank 0 called {} while rank {r} called {}", kind0.as_str(), kind.as_str())));
        }
        let same_len = matches!(kind, CollectiveKind::Broadcast | CollectiveKind::Barrier) || p.len() == len0;
        if !same_len {
            return Err(DpError::Mismatch(format!("{}: rank 0 passed {len0} values, rank {r} passed {}", kind.as_str(), p.len())));
        }
        if *arg != arg0 {
            return Err(DpError::Mismatch(format!("{}: rank 0 named root {arg0}, rank {r} named root {arg}", kind.as_str())));
        }
    }
    Ok(round.into_iter().map(|(_, _, p)| p).collect())
}

fn i64s(p: &Payload) -> &[i64] {
    match p {
        Payload::I64(v) => v,
        _ => unreachable!("the kind check admits only i64 payloads here"),
    }
}

fn f32s(p: &Payload) -> &[f32] {
    match p {
        Payload::F32(v) => v,
        _ => unreachable!("the kind check admits only f32 payloads here"),
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn all_reduce_sum_i64(&self, buf: &mut [i64]) -> Result<(), DpError> {
        let all = self.exchange(CollectiveKind::AllReduceSum, 0, Payload::I64(buf.to_vec()))?;
        buf.fill(0);
        // rank order, so the result is the same on every rank (it is exact for integers anyway)
        for p in &all {
            for (b, x) in buf.iter_mut().zip(i64s(p)) {
                *b = b.wrapping_add(*x);
            }
        }
        Ok(())
    }

    fn all_reduce_max_i64(&self, buf: &mut [i64]) -> Result<(), DpError> {
        let all = self.exchange(CollectiveKind::AllReduceMax, 0, Payload::I64(buf.to_vec()))?;
        buf.fill(i64::MIN);
        for p in &all {
            for (b, x) in buf.iter_mut().zip(i64s(p)) {
                *b = (*b).max(*x);
            }
        }
        Ok(())
    }

    fn all_gather_f32(&self, local: &[f32], out: &mut [f32]) -> Result<(), DpError> {
        check_gather_shape(self.size(), local.len(), out.len())?;
        let all = self.exchange(CollectiveKind::AllGather, 0, Payload::F32(local.to_vec()))?;
        for (chunk, p) in out.chunks_mut(local.len().max(1)).zip(&all) {
            chunk.copy_from_slice(f32s(p));
        }
        Ok(())
    }

    fn all_to_all_f32(&self, send: &[f32], recv: &mut [f32]) -> Result<(), DpError> {
        check_all_to_all_shape(self.size(), send.len(), recv.len())?;
        let all = self.exchange(CollectiveKind::AllToAll, 0, Payload::F32(send.to_vec()))?;
        let chunk = send.len() / self.size();
        for (i, p) in all.iter().enumerate() {
            recv[i * chunk..(i + 1) * chunk].copy_from_slice(&f32s(p)[self.rank * chunk..(self.rank + 1) * chunk]);
        }
        Ok(())
    }

    fn broadcast_bytes(&self, root: usize, buf: &mut Vec<u8>) -> Result<(), DpError> {
        check_root(self.size(), root)?;
        let mine = if self.rank == root { Payload::Bytes(std::mem::take(buf)) } else { Payload::Empty };
        let all = self.exchange(CollectiveKind::Broadcast, root, mine)?;
        match &all[root] {
            Payload::Bytes(b) => *buf = b.clone(),
            _ => unreachable!("the root contributes bytes"),
        }
        Ok(())
    }

    fn barrier(&self) -> Result<(), DpError> {
        self.exchange(CollectiveKind::Barrier, 0, Payload::Empty).map(|_| ())
    }
}

impl LocalComm {
    /// Leaves the group without being dropped (a rank that cannot finish the collectives it
    /// started): whoever waits now, or calls later, gets `PeerGone`.
    pub fn leave(&self) {
        let mut st = self.shared.lock();
        if st.gone.is_none() {
            st.gone = Some(self.rank);
        }
        self.shared.wake.notify_all();
    }
}

impl Drop for LocalComm {
    /// Leaving poisons the group: whoever waits now, or calls later, gets `PeerGone`.
    fn drop(&mut self) {
        self.leave();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// Runs `f(comm)` on one thread per rank; returns the results in rank order. Panics (fails
    /// the test) if the group has not finished within 10 s: a hang is a bug here.
    fn on_ranks<T: Send + 'static>(n: usize, f: impl Fn(LocalComm) -> T + Send + Sync + 'static) -> Vec<T> {
        let f = Arc::new(f);
        let (tx, rx) = std::sync::mpsc::channel();
        for comm in LocalGroup::new(n) {
            let (f, tx) = (f.clone(), tx.clone());
            std::thread::spawn(move || {
                let r = comm.rank();
                let _ = tx.send((r, f(comm)));
            });
        }
        drop(tx);
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut out: Vec<Option<T>> = (0..n).map(|_| None).collect();
        for _ in 0..n {
            let left = deadline.saturating_duration_since(Instant::now());
            let (r, v) = rx.recv_timeout(left).expect("a rank hung in a collective");
            out[r] = Some(v);
        }
        out.into_iter().map(|v| v.unwrap()).collect()
    }

    #[test]
    fn all_reduce_sum_and_max_of_rank_dependent_vectors() {
        let out = on_ranks(4, |c| {
            let r = c.rank() as i64;
            let mut s = vec![r, 10 * r, -r, 1];
            c.all_reduce_sum_i64(&mut s).unwrap();
            let mut m = vec![r, -r, 7];
            c.all_reduce_max_i64(&mut m).unwrap();
            (s, m)
        });
        for (s, m) in out {
            assert_eq!(s, vec![6, 60, -6, 4]);
            assert_eq!(m, vec![3, 0, 7]);
        }
    }

    #[test]
    fn many_rounds_back_to_back_stay_in_step() {
        let started = Instant::now();
        let out = on_ranks(3, |c| {
            let mut total = 0;
            for i in 0..2000i64 {
                let mut v = [i + c.rank() as i64];
                c.all_reduce_sum_i64(&mut v).unwrap();
                assert_eq!(v[0], 3 * i + 3, "round {i}");
                total += v[0];
            }
            total
        });
        assert!(out.iter().all(|&t| t == out[0]));
        eprintln!("3 in-process ranks: {:.1} us per all-reduce round", started.elapsed().as_secs_f64() * 1e6 / 2000.0);
    }

    #[test]
    fn all_gather_all_to_all_broadcast_barrier() {
        let out = on_ranks(3, |c| {
            let r = c.rank() as f32;
            let mut gathered = vec![0f32; 6];
            c.all_gather_f32(&[r, r + 0.5], &mut gathered).unwrap();
            // chunk j of rank r's send is [10 r + j]: rank r receives [10 i + r] from each rank i
            let send: Vec<f32> = (0..3).map(|j| 10.0 * r + j as f32).collect();
            let mut recv = vec![0f32; 3];
            c.all_to_all_f32(&send, &mut recv).unwrap();
            let mut bytes = if c.rank() == 1 { b"from one".to_vec() } else { vec![9; 3] };
            c.broadcast_bytes(1, &mut bytes).unwrap();
            c.barrier().unwrap();
            (gathered, recv, bytes)
        });
        for (r, (g, a2a, b)) in out.into_iter().enumerate() {
            assert_eq!(g, vec![0.0, 0.5, 1.0, 1.5, 2.0, 2.5]);
            let r = r as f32;
            assert_eq!(a2a, vec![r, 10.0 + r, 20.0 + r]);
            assert_eq!(b, b"from one".to_vec());
        }
    }

    #[test]
    fn a_single_rank_group_returns_its_own_values() {
        let mut g = LocalGroup::new(1);
        let c = g.pop().unwrap();
        let mut v = [5, -2];
        c.all_reduce_sum_i64(&mut v).unwrap();
        assert_eq!(v, [5, -2]);
        c.barrier().unwrap();
    }

    #[test]
    fn different_collectives_fail_on_every_rank() {
        let out = on_ranks(2, |c| {
            if c.rank() == 0 {
                c.all_reduce_sum_i64(&mut [1]).map_err(|e| e.to_string())
            } else {
                c.all_reduce_max_i64(&mut [1]).map_err(|e| e.to_string())
            }
        });
        for r in out {
            let e = r.unwrap_err();
            assert!(e.contains("rank 0 called all_reduce_sum while rank 1 called all_reduce_max"), "{e}");
        }
    }

    #[test]
    fn different_lengths_fail_on_every_rank() {
        let out = on_ranks(2, |c| {
            let mut v = vec![0; 3 + c.rank()];
            c.all_reduce_sum_i64(&mut v)
        });
        for r in out {
            assert!(matches!(r, Err(DpError::Mismatch(_))), "{r:?}");
        }
    }

    #[test]
    fn a_rank_that_leaves_wakes_its_waiting_peers_with_an_error() {
        let out = on_ranks(3, |c| {
            if c.rank() == 2 {
                std::thread::sleep(Duration::from_millis(100));
                drop(c); // leaves without joining
                return Ok(());
            }
            let r = c.all_reduce_sum_i64(&mut [1]);
            // and every later call fails at once
            assert_eq!(c.barrier(), Err(DpError::PeerGone { rank: 2 }));
            r
        });
        assert_eq!(out[0], Err(DpError::PeerGone { rank: 2 }));
        assert_eq!(out[1], Err(DpError::PeerGone { rank: 2 }));
    }

    #[test]
    fn a_rank_that_panics_wakes_its_peers() {
        let out = on_ranks(2, |c| {
            if c.rank() == 1 {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                    let _c = c;
                    panic!("rank 1 fails");
                }));
                return r.is_err();
            }
            c.barrier() == Err(DpError::PeerGone { rank: 1 })
        });
        assert_eq!(out, vec![true, true]);
    }

    #[test]
    fn shape_slips_fail_on_the_calling_rank_before_the_collective() {
        let mut g = LocalGroup::new(2);
        let c = g.remove(0);
        assert!(matches!(c.all_gather_f32(&[1.0], &mut [0.0; 3]), Err(DpError::Mismatch(_))));
        assert!(matches!(c.all_to_all_f32(&[1.0; 3], &mut [0.0; 3]), Err(DpError::Mismatch(_))));
        assert!(matches!(c.broadcast_bytes(2, &mut vec![]), Err(DpError::Mismatch(_))));
    }
}
