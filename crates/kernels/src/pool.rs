//! A small spinning fork-join pool for the kernels' parallel loops. A forward pass runs about
//! ten parallel loops per layer; rayon parks its workers between them and pays a futex wake-up
//! each time, which on a 2-core machine cost a third of a decode step. Here helper threads spin
//! for a short while after each loop (and park only when the engine goes quiet), so back-to-back
//! loops start in well under a microsecond. Tasks are handed out by an atomic counter; each task's
//! result does not depend on which thread runs it, so outputs stay bitwise reproducible.
//!
//! `parallel_for` uses one pool per calling thread, sized to the rayon pool it runs in
//! (`rayon::current_num_threads()`), so the engine's `--threads` keeps its meaning.

use std::cell::RefCell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// An output buffer that `parallel_for`'s tasks write at disjoint places: each task may write
/// only indices no other task touches (its own rows, chunk or heads), and the buffer outlives the
/// loop. Shared by reference between the tasks.
#[derive(Clone, Copy)]
pub(crate) struct DisjointOut {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: tasks write disjoint indices only (the contract of every use) and the buffer outlives
// the parallel loop that holds this.
unsafe impl Send for DisjointOut {}
unsafe impl Sync for DisjointOut {}

impl DisjointOut {
    pub(crate) fn new(out: &mut [f32]) -> Self {
        Self { ptr: out.as_mut_ptr(), len: out.len() }
    }

    /// The buffer's start and length.
    pub(crate) fn raw(&self) -> (*mut f32, usize) {
        (self.ptr, self.len)
    }

    /// `len` elements at `start` (checked to lie inside the buffer).
    ///
    /// # Safety
    /// No other task reads or writes these elements while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice(&self, start: usize, len: usize) -> &mut [f32] {
        assert!(start.checked_add(len).is_some_and(|e| e <= self.len), "disjoint output: {start}+{len} outside {}", self.len);
        std::slice::from_raw_parts_mut(self.ptr.add(start), len)
    }
}

/// How long an idle helper spins before parking.
const SPIN: Duration = Duration::from_micros(300);

type Task<'a> = &'a (dyn Fn(usize) + Sync);

/// `state` packs the epoch (high 32 bits), whether it is closed (bit 31) and how many helpers
/// joined it (low bits). A helper runs tasks of an epoch only after joining it, and it can join
/// only while the caller has not closed it; the caller closes it when it runs out of tasks and
/// then waits for the helpers that joined, never for one that was not scheduled in time (on a
/// busy machine a helper can be off the CPU for a whole time slice: the caller used to wait for
/// every helper on every loop, a step of 300 loops then took tens of milliseconds).
const CLOSED: u64 = 1 << 31;
const JOINED: u64 = CLOSED - 1;
const EPOCH_SHIFT: u32 = 32;

struct Shared {
    state: AtomicU64,
    /// Points at the caller's `Task` for the current epoch; valid until the epoch is closed and
    /// `finished` reaches the number of helpers that joined.
    job: AtomicPtr<()>,
    next: AtomicUsize,
    n: AtomicUsize,
    /// Helpers that joined the current epoch and are done with it.
    finished: AtomicUsize,
    panicked: AtomicBool,
    stop: AtomicBool,
    lock: Mutex<usize>,
    wake: Condvar,
}

pub struct SpinPool {
    shared: Arc<Shared>,
    helpers: Vec<JoinHandle<()>>,
    threads: usize,
}

impl SpinPool {
    /// A pool whose loops run on `threads` threads: the caller plus `threads - 1` helpers.
    pub fn new(threads: usize) -> Self {
        let shared = Arc::new(Shared {
            state: AtomicU64::new(CLOSED),
            job: AtomicPtr::new(std::ptr::null_mut()),
            next: AtomicUsize::new(0),
            n: AtomicUsize::new(0),
            finished: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            lock: Mutex::new(0),
            wake: Condvar::new(),
        });
        let helpers = (1..threads.max(1))
            .filter_map(|i| {
                let s = shared.clone();
                std::thread::Builder::new().name(format!("specula-spin-{i}")).spawn(move || helper(&s)).ok()
            })
            .collect::<Vec<_>>();
        let threads = helpers.len() + 1;
        Self { shared, helpers, threads }
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f(0..n)` across the pool and returns when every call has finished. A panic in any
    /// call is re-raised here after all threads have left the loop.
    pub fn run(&self, n: usize, f: Task) {
        if n == 0 {
            return;
        }
        if self.helpers.is_empty() || n == 1 {
            (0..n).for_each(f);
            return;
        }
        let s = &*self.shared;
        let task: Task = f;
        s.next.store(0, Ordering::Relaxed);
        s.n.store(n, Ordering::Relaxed);
        s.panicked.store(false, Ordering::Relaxed);
        s.finished.store(0, Ordering::Relaxed);
        s.job.store(&task as *const Task as *mut (), Ordering::Relaxed);
        // open the next epoch with no helper joined (the previous one is closed and drained)
        let epoch = ((s.state.load(Ordering::Relaxed) >> EPOCH_SHIFT) + 1) & 0xFFFF_FFFF;
        s.state.store(epoch << EPOCH_SHIFT, Ordering::Release);
        {
            let sleeping = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            if *sleeping > 0 {
                s.wake.notify_all();
            }
        }
        let mine = catch_unwind(AssertUnwindSafe(|| work(s, task)));
        // no helper may join from now on; those that did hold a pointer to `task`: wait for them
        let joined = (s.state.fetch_or(CLOSED, Ordering::AcqRel) & JOINED) as usize;
        while s.finished.load(Ordering::Acquire) < joined {
            std::hint::spin_loop();
        }
        if let Err(p) = mine {
            resume_unwind(p);
        }
        if s.panicked.load(Ordering::Relaxed) {
            panic!("a kernel task panicked on a helper thread");
        }
    }
}

fn work(s: &Shared, f: Task) {
    struct InLoop(bool);
    impl Drop for InLoop {
        fn drop(&mut self) {
            IN_LOOP.with(|c| c.set(self.0));
        }
    }
    let _restore = InLoop(IN_LOOP.with(|c| c.replace(true)));
    let n = s.n.load(Ordering::Relaxed);
    loop {
        let i = s.next.fetch_add(1, Ordering::Relaxed);
        if i >= n {
            break;
        }
        f(i);
    }
}

/// Joins the open epoch `state` names; false when it was closed (or replaced) first.
fn try_join(s: &Shared, mut state: u64) -> bool {
    loop {
        if state & CLOSED != 0 {
            return false;
        }
        match s.state.compare_exchange_weak(state, state + 1, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return true,
            Err(now) if now >> EPOCH_SHIFT == state >> EPOCH_SHIFT => state = now,
            Err(_) => return false,
        }
    }
}

fn helper(s: &Shared) {
    let mut seen = 0u64;
    loop {
        let start = Instant::now();
        let mut polls = 0u32;
        let state = loop {
            if s.stop.load(Ordering::Acquire) {
                return;
            }
            let state = s.state.load(Ordering::Acquire);
            if state >> EPOCH_SHIFT != seen {
                if state & CLOSED == 0 {
                    break state;
                }
                seen = state >> EPOCH_SHIFT; // a loop that ended before this thread looked
            }
            polls += 1;
            if polls.is_multiple_of(1024) && start.elapsed() > SPIN {
                let mut sleeping = s.lock.lock().unwrap_or_else(|e| e.into_inner());
                *sleeping += 1;
                while s.state.load(Ordering::Acquire) >> EPOCH_SHIFT == seen && !s.stop.load(Ordering::Acquire) {
                    sleeping = s.wake.wait(sleeping).unwrap_or_else(|e| e.into_inner());
                }
                *sleeping -= 1;
            } else {
                std::hint::spin_loop();
            }
        };
        seen = state >> EPOCH_SHIFT;
        if !try_join(s, state) {
            continue; // the caller finished this loop without us
        }
        // SAFETY: this thread joined the epoch before the caller closed it, so `run` keeps its
        // `Task` alive until `finished` counts this thread, which it does after its last use.
        let task: Task = unsafe { *(s.job.load(Ordering::Acquire) as *const Task) };
        if catch_unwind(AssertUnwindSafe(|| work(s, task))).is_err() {
            s.panicked.store(true, Ordering::Relaxed);
        }
        s.finished.fetch_add(1, Ordering::Release);
    }
}

impl Drop for SpinPool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        {
            let _g = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for h in self.helpers.drain(..) {
            let _ = h.join();
        }
    }
}

thread_local! {
    static POOL: RefCell<Option<SpinPool>> = const { RefCell::new(None) };
    /// Whether this thread is running a task of a loop (a nested loop then runs sequentially).
    static IN_LOOP: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The pool every caller uses when it is free and of its size. One rayon pool runs its jobs on
/// whichever worker picks them up (the engine's forward pass on one, the mtp head's next on the
/// other): with a pool per thread, the last worker's helper still spun (300 us) beside the next
/// worker's loops, three busy threads on two cores, and a k = 1 speculative step's forward pass
/// took 1.4x a plain one instead of the 1.1x its extra row costs.
static SHARED: Mutex<Option<SpinPool>> = Mutex::new(None);

/// Runs `f(0..n)` on the shared spinning pool (or, while another caller holds it or it has
/// another size, this thread's own), sized like the rayon pool it runs in. Nested calls (a task
/// that itself calls `parallel_for`) run sequentially.
pub fn parallel_for(n: usize, f: Task) {
    let threads = rayon::current_num_threads();
    if n <= 1 || threads <= 1 || IN_LOOP.with(|c| c.get()) {
        (0..n).for_each(f);
        return;
    }
    let shared = match SHARED.try_lock() {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    };
    if let Some(mut slot) = shared {
        if slot.is_none() {
            *slot = Some(SpinPool::new(threads));
        }
        if let Some(p) = slot.as_ref().filter(|p| p.threads() == threads) {
            p.run(n, f);
            return;
        }
    }
    POOL.with(|cell| match cell.try_borrow_mut() {
        Ok(mut slot) => {
            if slot.as_ref().is_none_or(|p| p.threads() != threads) {
                *slot = Some(SpinPool::new(threads));
            }
            if let Some(p) = slot.as_ref() {
                p.run(n, f);
            }
        }
        Err(_) => (0..n).for_each(f),
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_task_runs_exactly_once_over_many_loops() {
        let pool = SpinPool::new(3);
        for round in 0..2000 {
            let n = round % 37;
            let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
            pool.run(n, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "round {round}");
        }
    }

    #[test]
    fn helpers_park_and_wake_again() {
        let pool = SpinPool::new(2);
        let sum = AtomicU32::new(0);
        pool.run(8, &|i| {
            sum.fetch_add(i as u32, Ordering::Relaxed);
        });
        std::thread::sleep(Duration::from_millis(20)); // helpers are parked now
        pool.run(8, &|i| {
            sum.fetch_add(i as u32, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 56);
    }

    #[test]
    fn a_panicking_task_is_reraised_and_the_pool_still_works() {
        let pool = SpinPool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| pool.run(16, &|i| assert!(i != 11, "task 11 fails"))));
        assert!(r.is_err());
        let count = AtomicU32::new(0);
        pool.run(16, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 16);
    }

    #[test]
    fn parallel_for_follows_the_rayon_pool_size() {
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let n = AtomicU32::new(0);
            pool.install(|| {
                parallel_for(100, &|_| {
                    n.fetch_add(1, Ordering::Relaxed);
                })
            });
            assert_eq!(n.load(Ordering::Relaxed), 100);
        }
    }

    #[test]
    fn every_task_runs_exactly_once_with_more_helpers_than_cores() {
        // helpers are often off the CPU here: most loops close before some of them look
        let pool = SpinPool::new(8);
        for round in 0..3000 {
            let n = 1 + round % 23;
            let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
            pool.run(n, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "round {round}");
            if round % 1000 == 999 {
                std::thread::sleep(Duration::from_millis(5)); // helpers park and wake again
            }
        }
    }

    #[test]
    fn nested_and_concurrent_loops_each_run_every_task_once() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let run = || {
            let hits: Vec<AtomicU32> = (0..64).map(|_| AtomicU32::new(0)).collect();
            for _ in 0..200 {
                parallel_for(8, &|i| {
                    // a nested loop inside a task: sequential on this thread
                    parallel_for(8, &|j| {
                        hits[i * 8 + j].fetch_add(1, Ordering::Relaxed);
                    });
                });
            }
            hits.iter().all(|h| h.load(Ordering::Relaxed) == 200)
        };
        // two callers at once: one gets the shared pool, the other its own
        let (a, b) = std::thread::scope(|sc| {
            let a = sc.spawn(|| pool.install(run));
            let b = sc.spawn(|| pool.install(run));
            (a.join().unwrap(), b.join().unwrap())
        });
        assert!(a && b);
    }
}
