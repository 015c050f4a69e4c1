//! One dedicated worker thread that runs one job at a time, so the engine can schedule and prepare
//! step N+1 while step N executes (async scheduling, docs/architecture.md). `submit` refuses a second job until
//! `sync` has collected the first, so never more than one step is prepared ahead. A job's error or
//! panic comes back from `sync` naming the step; dropping the runner waits for the job and joins.
//! Not a thread pool: parallel work inside a job uses rayon; jobs share state only by ownership.

use crate::error::panic_message;
use std::fmt;
use std::panic::{self, AssertUnwindSafe};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::thread::{self, JoinHandle};

/// What can go wrong with an [`AsyncRunner`]; every message names the runner (its thread name).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AsyncRunnerError {
    #[error("could not start async runner {name:?}: {reason}")]
    Spawn { name: String, reason: String },
    #[error(
        "async runner {name:?} refused step {refused}: step {in_flight} is still in flight or its result \
         has not been collected; call sync() before submitting the next step"
    )]
    Busy { name: String, in_flight: u64, refused: u64 },
    #[error("step {step} failed on async runner {name:?}: {message}")]
    Job { name: String, step: u64, message: String },
    #[error("step {step} panicked on async runner {name:?}: {message}")]
    Panicked { name: String, step: u64, message: String },
    #[error("async runner {name:?} has no job to sync; submit a step first")]
    NothingSubmitted { name: String },
    #[error("async runner {name:?} has stopped ({reason}); no job can run on it, create a new runner")]
    Stopped { name: String, reason: String },
}

/// Why a job failed, in its own words (the runner runs any job; the engine's host job cannot fail).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobError(pub String);

/// A job as the worker receives it.
struct Job<T> {
    step: u64,
    run: Box<dyn FnOnce() -> Result<T, JobError> + Send>,
}

/// What the engine thread sends to the worker.
enum Message<T> {
    Run(Job<T>),
    /// Makes the worker die outside any `catch_unwind`, to test how a dead worker is reported.
    #[cfg(test)]
    Crash,
}

/// How a job ended, before the runner attaches its name.
enum Failure {
    Error(String),
    Panic(String),
}

/// A job's result as the worker sends it back.
struct Done<T> {
    step: u64,
    outcome: Result<T, Failure>,
}

/// A single worker thread with at most one job in flight. See the module docs.
pub struct AsyncRunner<T: Send + 'static> {
    /// The worker thread's name, repeated in every error so a log line says which runner failed.
    name: String,
    /// Jobs to the worker. Dropping it (in `Drop`, or when the worker is found dead) is what ends the
    /// worker's loop, so the worker can never outlive the runner waiting for work.
    jobs: Option<Sender<Message<T>>>,
    /// Results from the worker. Unbounded, but it holds at most one result because `pending` admits a
    /// new job only after the previous result was received.
    results: Receiver<Done<T>>,
    /// The step submitted and not yet collected: `Some` from `submit` until `sync`/`try_sync` returns
    /// its result. This is the "at most one step ahead" rule.
    pending: Option<u64>,
    /// The worker; `None` once joined (after it was found dead). `Drop` joins it, never detaches it.
    worker: Option<JoinHandle<()>>,
    /// Why the worker stopped, once known; every later call returns `Stopped` with it.
    stopped: Option<String>,
}

impl<T: Send + 'static> AsyncRunner<T> {
    /// Starts the worker thread, named `name`, idle until the first `submit`.
    pub fn new(name: &str) -> Result<Self, AsyncRunnerError> {
        let spawn_error = |reason: String| AsyncRunnerError::Spawn { name: name.to_string(), reason };
        if name.contains('\0') {
            return Err(spawn_error("a thread name cannot contain a NUL byte".to_string()));
        }
        let (jobs, job_rx) = mpsc::channel();
        let (result_tx, results) = mpsc::channel();
        let worker_name = name.to_string();
        let worker =
            thread::Builder::new().name(name.to_string()).spawn(move || work(&worker_name, job_rx, result_tx)).map_err(|e| spawn_error(e.to_string()))?;
        Ok(Self { name: name.to_string(), jobs: Some(jobs), results, pending: None, worker: Some(worker), stopped: None })
    }

    /// The worker thread's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// True from `submit` until `sync`/`try_sync` has returned that job's result (even if the job
    /// itself has already finished): while true, `submit` is refused.
    pub fn is_busy(&self) -> bool {
        self.pending.is_some()
    }

    /// The step submitted and not yet collected, if any.
    pub fn in_flight_step(&self) -> Option<u64> {
        self.pending
    }

    /// Hands `job` for `step` to the worker and returns at once. Refused with `Busy` while a previous
    /// job has not been collected (the job is dropped unrun), `Stopped` if the worker has died.
    pub fn submit(&mut self, step: u64, job: impl FnOnce() -> Result<T, JobError> + Send + 'static) -> Result<(), AsyncRunnerError> {
        self.check_running()?;
        if let Some(in_flight) = self.pending {
            return Err(AsyncRunnerError::Busy { name: self.name.clone(), in_flight, refused: step });
        }
        let sent = match &self.jobs {
            Some(jobs) => jobs.send(Message::Run(Job { step, run: Box::new(job) })).is_ok(),
            None => false,
        };
        if !sent {
            return Err(self.stop());
        }
        self.pending = Some(step);
        Ok(())
    }

    /// Blocks until the submitted job ends and returns its value, or its error (`Job`) or panic
    /// (`Panicked`) with its step. `NothingSubmitted` if no job is waiting to be collected.
    pub fn sync(&mut self) -> Result<T, AsyncRunnerError> {
        self.check_running()?;
        if self.pending.is_none() {
            return Err(AsyncRunnerError::NothingSubmitted { name: self.name.clone() });
        }
        match self.results.recv() {
            Ok(done) => self.collect(done),
            Err(_) => Err(self.stop()),
        }
    }

    /// Like `sync` but never blocks: `Ok(None)` while the job is still running.
    pub fn try_sync(&mut self) -> Result<Option<T>, AsyncRunnerError> {
        self.check_running()?;
        if self.pending.is_none() {
            return Err(AsyncRunnerError::NothingSubmitted { name: self.name.clone() });
        }
        match self.results.try_recv() {
            Ok(done) => self.collect(done).map(Some),
            Err(TryRecvError::Empty) => Ok(None),
            Err(TryRecvError::Disconnected) => Err(self.stop()),
        }
    }

    /// Makes the worker die outside `catch_unwind` and waits until it has (bounded by the caller's
    /// test watchdog), so tests can check how a dead worker is reported.
    #[cfg(test)]
    fn crash_worker_for_test(&mut self) {
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(Message::Crash);
        }
        while self.worker.as_ref().is_some_and(|w| !w.is_finished()) {
            thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    fn check_running(&self) -> Result<(), AsyncRunnerError> {
        match &self.stopped {
            Some(reason) => Err(AsyncRunnerError::Stopped { name: self.name.clone(), reason: reason.clone() }),
            None => Ok(()),
        }
    }

    fn collect(&mut self, done: Done<T>) -> Result<T, AsyncRunnerError> {
        let pending = self.pending.take();
        // The worker answers jobs in order and only one is ever pending, so the steps must agree.
        debug_assert_eq!(pending, Some(done.step), "async runner {:?} got the result of a step it did not submit", self.name);
        let (name, step) = (self.name.clone(), done.step);
        done.outcome.map_err(|failure| match failure {
            Failure::Error(message) => AsyncRunnerError::Job { name, step, message },
            Failure::Panic(message) => AsyncRunnerError::Panicked { name, step, message },
        })
    }

    /// Records that the worker is gone (a channel to it disconnected), joins it to learn why, and
    /// returns the `Stopped` error every later call will return.
    fn stop(&mut self) -> AsyncRunnerError {
        self.jobs = None;
        self.pending = None;
        let reason = match self.worker.take().map(JoinHandle::join) {
            Some(Err(payload)) => format!("its worker thread panicked: {}", panic_message(&payload)),
            Some(Ok(())) | None => "its worker thread exited".to_string(),
        };
        self.stopped = Some(reason.clone());
        AsyncRunnerError::Stopped { name: self.name.clone(), reason }
    }
}

impl<T: Send + 'static> Drop for AsyncRunner<T> {
    /// Closes the job channel, so the worker leaves its loop as soon as the job in flight (if any)
    /// ends, then joins it. An uncollected result is dropped with the runner.
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(worker) = self.worker.take() {
            if let Err(payload) = worker.join() {
                tracing::error!(runner = %self.name, "async runner worker panicked: {}", panic_message(&payload));
            }
        }
    }
}

impl<T: Send + 'static> fmt::Debug for AsyncRunner<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncRunner").field("name", &self.name).field("pending", &self.pending).field("stopped", &self.stopped).finish()
    }
}

/// The worker loop: runs jobs in order until the job channel closes or the runner is gone.
fn work<T>(name: &str, jobs: Receiver<Message<T>>, results: Sender<Done<T>>) {
    batch_scheduling();
    while let Ok(message) = jobs.recv() {
        // a test-only variant makes the match refutable in test builds only
        #[allow(clippy::infallible_destructuring_match)]
        let job = match message {
            Message::Run(job) => job,
            #[cfg(test)]
            Message::Crash => panic!("worker crash requested by a test"),
        };
        let _span = tracing::debug_span!("async_job", runner = name, step = job.step).entered();
        let outcome = run_job(job.run);
        if let Err(Failure::Panic(message)) = &outcome {
            tracing::error!(runner = name, step = job.step, "job panicked: {message}");
        }
        if results.send(Done { step: job.step, outcome }).is_err() {
            return; // the runner is gone; nobody will read another result
        }
    }
}

/// Puts the calling thread in Linux's SCHED_BATCH class: a thread woken by `submit` then never
/// preempts the thread that woke it. Without it, waking the worker right before a forward pass
/// often ran the worker on the engine thread's core first and delayed the forward pass by tens of
/// microseconds (the gap async scheduling exists to remove). Best effort: elsewhere, or if the
/// call is refused, the worker keeps the normal class.
fn batch_scheduling() {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: plain syscall on the calling thread (pid 0) with a valid, initialized parameter.
        let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
        if rc != 0 {
            tracing::debug!("async runner: SCHED_BATCH refused: {}", std::io::Error::last_os_error());
        }
    }
}

/// Runs one job, turning a panic into `Failure::Panic` with the payload's text.
fn run_job<T>(run: Box<dyn FnOnce() -> Result<T, JobError> + Send>) -> Result<T, Failure> {
    match panic::catch_unwind(AssertUnwindSafe(run)) {
        Ok(result) => result.map_err(|e| Failure::Error(e.0)),
        Err(payload) => {
            let message = panic_message(&payload);
            // A payload whose destructor panics must not take the worker down with it; if dropping
            // it panics again, that second payload is leaked rather than risk a third panic.
            if let Err(again) = panic::catch_unwind(AssertUnwindSafe(move || drop(payload))) {
                std::mem::forget(again);
            }
            Err(Failure::Panic(message))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::cell::RefCell;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::mpsc::RecvTimeoutError;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    /// Upper bound for anything that could hang; tests normally take milliseconds.
    const LIMIT: Duration = Duration::from_secs(20);

    /// Runs `f` on its own thread and fails the test if it takes longer than `limit` (a deadlock)
    /// instead of hanging the test run. A panic inside `f` fails the test with its own message.
    fn bounded<R: Send + 'static>(limit: Duration, f: impl FnOnce() -> R + Send + 'static) -> R {
        let (tx, rx) = mpsc::channel();
        let handle = thread::Builder::new()
            .name("bounded-test".to_string())
            .spawn(move || {
                let _ = tx.send(f());
            })
            .expect("spawn test thread");
        match rx.recv_timeout(limit) {
            Ok(r) => {
                handle.join().expect("test thread ended after sending its result");
                r
            }
            Err(RecvTimeoutError::Timeout) => panic!("test did not finish within {limit:?}: deadlock?"),
            Err(RecvTimeoutError::Disconnected) => match handle.join() {
                Err(payload) => panic::resume_unwind(payload),
                Ok(()) => unreachable!("test thread ended without a result or a panic"),
            },
        }
    }

    fn runner<T: Send + 'static>(name: &str) -> AsyncRunner<T> {
        AsyncRunner::new(name).expect("start async runner")
    }

    #[test]
    fn sequential_jobs_return_their_results_in_order() {
        bounded(LIMIT, || {
            let mut r = runner::<u64>("seq");
            for step in 0..10u64 {
                assert!(!r.is_busy());
                r.submit(step, move || Ok(step * 2)).unwrap();
                assert!(r.is_busy());
                assert_eq!(r.in_flight_step(), Some(step));
                assert_eq!(r.sync(), Ok(step * 2));
                assert_eq!(r.in_flight_step(), None);
            }
        });
    }

    #[test]
    fn job_error_comes_back_with_its_step_and_message() {
        bounded(LIMIT, || {
            let mut r = runner::<u32>("errs");
            r.submit(7, || Err(JobError("block table has 3 entries but the span needs 4".to_string()))).unwrap();
            let err = r.sync().unwrap_err();
            assert_eq!(err, AsyncRunnerError::Job { name: "errs".into(), step: 7, message: "block table has 3 entries but the span needs 4".into() });
            assert_eq!(err.to_string(), "step 7 failed on async runner \"errs\": block table has 3 entries but the span needs 4");
            assert!(!r.is_busy());
            r.submit(8, || Ok(1)).unwrap();
            assert_eq!(r.sync(), Ok(1));
        });
    }

    #[test]
    fn panic_comes_back_with_step_and_text_and_the_worker_keeps_going() {
        bounded(LIMIT, || {
            let mut r = runner::<thread::ThreadId>("panics");
            r.submit(1, || Ok(thread::current().id())).unwrap();
            let worker = r.sync().unwrap();

            r.submit(2, || panic!("slot mapping out of range")).unwrap();
            let err = r.sync().unwrap_err();
            assert_eq!(err, AsyncRunnerError::Panicked { name: "panics".into(), step: 2, message: "slot mapping out of range".into() });
            assert!(err.to_string().contains("step 2 panicked"), "{err}");

            let row = 41;
            r.submit(3, move || panic!("row {row} has no logits")).unwrap();
            match r.sync() {
                Err(AsyncRunnerError::Panicked { step: 3, message, .. }) => assert_eq!(message, "row 41 has no logits"),
                other => panic!("expected a panic error for step 3, got {other:?}"),
            }

            r.submit(4, || std::panic::panic_any(17u8)).unwrap();
            match r.sync() {
                Err(AsyncRunnerError::Panicked { step: 4, message, .. }) => assert_eq!(message, "panic payload is not a string"),
                other => panic!("expected a panic error for step 4, got {other:?}"),
            }

            // Same worker thread, still serving jobs.
            r.submit(5, || Ok(thread::current().id())).unwrap();
            assert_eq!(r.sync(), Ok(worker));
        });
    }

    #[test]
    fn payload_whose_destructor_panics_does_not_kill_the_worker() {
        struct Bomb;
        impl Drop for Bomb {
            fn drop(&mut self) {
                panic!("bomb payload dropped");
            }
        }
        bounded(LIMIT, || {
            let mut r = runner::<u8>("bomb");
            r.submit(1, || std::panic::panic_any(Bomb)).unwrap();
            assert!(matches!(r.sync(), Err(AsyncRunnerError::Panicked { step: 1, .. })));
            r.submit(2, || Ok(2)).unwrap();
            assert_eq!(r.sync(), Ok(2));
        });
    }

    #[test]
    fn second_submit_is_refused_and_the_first_result_still_arrives() {
        bounded(LIMIT, || {
            let mut r = runner::<&'static str>("busy");
            let (gate_tx, gate_rx) = mpsc::channel::<()>();
            r.submit(1, move || {
                gate_rx.recv_timeout(LIMIT).map_err(|e| JobError(format!("gate never opened: {e}")))?;
                Ok("first")
            })
            .unwrap();

            let second_ran = Arc::new(AtomicBool::new(false));
            let flag = second_ran.clone();
            let refused = r.submit(2, move || {
                flag.store(true, Ordering::SeqCst);
                Ok("second")
            });
            assert_eq!(refused, Err(AsyncRunnerError::Busy { name: "busy".into(), in_flight: 1, refused: 2 }));
            assert_eq!(r.in_flight_step(), Some(1));

            gate_tx.send(()).unwrap();
            assert_eq!(r.sync(), Ok("first"));
            assert!(!second_ran.load(Ordering::SeqCst), "a refused job must never run");

            // Also refused when the job has finished but its result was not collected yet.
            let finished = Arc::new(AtomicBool::new(false));
            let flag = finished.clone();
            r.submit(3, move || {
                flag.store(true, Ordering::SeqCst);
                Ok("third")
            })
            .unwrap();
            while !finished.load(Ordering::SeqCst) {
                thread::sleep(Duration::from_millis(1));
            }
            assert!(matches!(r.submit(4, || Ok("fourth")), Err(AsyncRunnerError::Busy { in_flight: 3, refused: 4, .. })));
            assert_eq!(r.sync(), Ok("third"));
        });
    }

    #[test]
    fn sync_without_a_submitted_job_is_nothing_submitted() {
        bounded(LIMIT, || {
            let mut r = runner::<u8>("idle");
            let nothing = AsyncRunnerError::NothingSubmitted { name: "idle".into() };
            assert_eq!(r.sync(), Err(nothing.clone()));
            assert_eq!(r.try_sync(), Err(nothing.clone()));
            r.submit(1, || Ok(1)).unwrap();
            assert_eq!(r.sync(), Ok(1));
            assert_eq!(r.sync(), Err(nothing), "a result is collected once");
        });
    }

    #[test]
    fn try_sync_does_not_block_and_eventually_returns_the_result() {
        bounded(LIMIT, || {
            let mut r = runner::<u8>("poll");
            let (gate_tx, gate_rx) = mpsc::channel::<()>();
            r.submit(9, move || {
                gate_rx.recv_timeout(LIMIT).map_err(|e| JobError(e.to_string()))?;
                Ok(9)
            })
            .unwrap();
            assert_eq!(r.try_sync(), Ok(None), "the job is held at its gate");
            assert!(r.is_busy());
            gate_tx.send(()).unwrap();
            let deadline = Instant::now() + LIMIT;
            let value = loop {
                if let Some(v) = r.try_sync().unwrap() {
                    break v;
                }
                assert!(Instant::now() < deadline, "try_sync never returned the result");
                thread::sleep(Duration::from_micros(200));
            };
            assert_eq!(value, 9);
            assert!(!r.is_busy());
        });
    }

    /// Sets its flag when dropped; stored in a worker's thread-local, it is dropped when that thread exits.
    struct SetOnThreadExit(Arc<AtomicBool>);
    impl Drop for SetOnThreadExit {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    thread_local! {
        static ON_EXIT: RefCell<Option<SetOnThreadExit>> = const { RefCell::new(None) };
    }

    #[test]
    fn drop_while_busy_waits_for_the_job_and_joins_the_worker() {
        bounded(LIMIT, || {
            let job_done = Arc::new(AtomicBool::new(false));
            let worker_exited = Arc::new(AtomicBool::new(false));
            let mut r = runner::<()>("drop-busy");
            let (done, exited) = (job_done.clone(), worker_exited.clone());
            let (started_tx, started_rx) = mpsc::channel();
            r.submit(1, move || {
                ON_EXIT.with(|slot| *slot.borrow_mut() = Some(SetOnThreadExit(exited)));
                started_tx.send(()).map_err(|e| JobError(e.to_string()))?;
                thread::sleep(Duration::from_millis(150));
                done.store(true, Ordering::SeqCst);
                Ok(())
            })
            .unwrap();
            started_rx.recv_timeout(LIMIT).expect("job started");
            assert!(!job_done.load(Ordering::SeqCst));
            drop(r);
            assert!(job_done.load(Ordering::SeqCst), "drop returned before the job in flight finished");
            assert!(worker_exited.load(Ordering::SeqCst), "drop returned before the worker thread exited");
        });
    }

    #[test]
    fn drop_when_idle_or_with_an_uncollected_result_joins_the_worker() {
        bounded(LIMIT, || {
            let exited = Arc::new(AtomicBool::new(false));
            let mut r = runner::<Vec<u32>>("drop-idle");
            let flag = exited.clone();
            r.submit(1, move || {
                ON_EXIT.with(|slot| *slot.borrow_mut() = Some(SetOnThreadExit(flag)));
                Ok(vec![1, 2, 3])
            })
            .unwrap();
            assert_eq!(r.sync(), Ok(vec![1, 2, 3]));
            r.submit(2, || Ok(vec![4])).unwrap(); // never collected
            drop(r);
            assert!(exited.load(Ordering::SeqCst));

            drop(runner::<u8>("never-used"));
        });
    }

    #[test]
    fn jobs_run_on_the_worker_thread_while_the_caller_goes_on() {
        bounded(LIMIT, || {
            let mut r = runner::<(thread::ThreadId, Option<String>)>("overlap");
            let (started_tx, started_rx) = mpsc::channel();
            let (reply_tx, reply_rx) = mpsc::channel();
            r.submit(1, move || {
                started_tx.send(()).map_err(|e| JobError(e.to_string()))?;
                // Finishes only once the caller, still running after submit, answers.
                reply_rx.recv_timeout(LIMIT).map_err(|e| JobError(format!("caller never answered: {e}")))?;
                Ok((thread::current().id(), thread::current().name().map(String::from)))
            })
            .unwrap();
            started_rx.recv_timeout(LIMIT).expect("the job should start while the caller is running");
            assert_eq!(r.try_sync(), Ok(None));
            reply_tx.send(()).unwrap();
            let (id, name) = r.sync().expect("job result");
            assert_ne!(id, thread::current().id());
            assert_eq!(name.as_deref(), Some("overlap"));
        });
    }

    #[test]
    fn dead_worker_is_reported_as_stopped_with_the_reason() {
        bounded(LIMIT, || {
            let mut r = runner::<u8>("dies");
            r.crash_worker_for_test();
            let err = r.submit(1, || Ok(1)).unwrap_err();
            match &err {
                AsyncRunnerError::Stopped { name, reason } => {
                    assert_eq!(name, "dies");
                    assert!(reason.contains("worker crash requested by a test"), "{reason}");
                }
                other => panic!("expected Stopped, got {other:?}"),
            }
            assert_eq!(r.sync(), Err(err.clone()));
            assert_eq!(r.try_sync(), Err(err));
            assert!(!r.is_busy());
        });
    }

    #[test]
    fn worker_dying_behind_a_job_still_delivers_that_result_then_reports_stopped() {
        bounded(LIMIT, || {
            let mut r = runner::<u8>("dies-busy");
            let (gate_tx, gate_rx) = mpsc::channel::<()>();
            r.submit(1, move || {
                gate_rx.recv_timeout(LIMIT).map_err(|e| JobError(e.to_string()))?;
                Ok(1)
            })
            .unwrap();
            // Queue the crash behind the job: the job's result is sent, then the worker dies.
            r.jobs.as_ref().unwrap().send(Message::Crash).unwrap();
            gate_tx.send(()).unwrap();
            assert_eq!(r.sync(), Ok(1));
            // The next job is either refused at once or accepted by a channel nobody reads any more;
            // then `sync` must report the dead worker rather than wait forever.
            match r.submit(2, || Ok(2)) {
                Ok(()) => assert!(matches!(r.sync(), Err(AsyncRunnerError::Stopped { .. }))),
                Err(e) => assert!(matches!(e, AsyncRunnerError::Stopped { .. }), "{e}"),
            }
            assert!(matches!(r.submit(3, || Ok(3)), Err(AsyncRunnerError::Stopped { .. })));
        });
    }

    #[test]
    fn names_with_nul_bytes_are_refused() {
        let err = AsyncRunner::<u8>::new("bad\0name").unwrap_err();
        assert!(matches!(err, AsyncRunnerError::Spawn { .. }), "{err}");
        assert!(err.to_string().contains("NUL"), "{err}");
    }

    #[derive(Debug, Clone, Copy)]
    enum Kind {
        Value,
        Error,
        Panic,
    }

    #[derive(Debug, Clone)]
    enum Op {
        Submit { kind: Kind, sleep_us: u64 },
        Sync,
        TrySync,
        Check,
        DropAndRestart,
    }

    fn op() -> impl Strategy<Value = Op> {
        let kind = prop_oneof![4 => Just(Kind::Value), 1 => Just(Kind::Error), 1 => Just(Kind::Panic)];
        prop_oneof![
            4 => (kind, 0u64..300).prop_map(|(kind, sleep_us)| Op::Submit { kind, sleep_us }),
            3 => Just(Op::Sync),
            3 => Just(Op::TrySync),
            1 => Just(Op::Check),
            1 => Just(Op::DropAndRestart),
        ]
    }

    /// Checks a job's outcome against what the model expects for that step and kind.
    fn check_outcome(got: Result<u64, AsyncRunnerError>, step: u64, kind: Kind) {
        match (kind, got) {
            (Kind::Value, Ok(v)) => assert_eq!(v, step * 3),
            (Kind::Error, Err(AsyncRunnerError::Job { step: s, message, .. })) => {
                assert_eq!((s, message), (step, format!("error at step {step}")))
            }
            (Kind::Panic, Err(AsyncRunnerError::Panicked { step: s, message, .. })) => {
                assert_eq!((s, message), (step, format!("panic at step {step}")))
            }
            (kind, got) => panic!("step {step} was a {kind:?} job but came back as {got:?}"),
        }
    }

    /// Replays `ops` against a runner and a model of it (the step in flight and its kind).
    fn replay(ops: Vec<Op>) {
        let mut r = runner::<u64>("prop");
        let mut pending: Option<(u64, Kind)> = None;
        for (step, op) in (0u64..).zip(ops) {
            match op {
                Op::Submit { kind, sleep_us } => {
                    let got = r.submit(step, move || {
                        thread::sleep(Duration::from_micros(sleep_us));
                        match kind {
                            Kind::Value => Ok(step * 3),
                            Kind::Error => Err(JobError(format!("error at step {step}"))),
                            Kind::Panic => panic!("panic at step {step}"),
                        }
                    });
                    match pending {
                        Some((in_flight, _)) => {
                            assert_eq!(got, Err(AsyncRunnerError::Busy { name: "prop".into(), in_flight, refused: step }))
                        }
                        None => {
                            assert_eq!(got, Ok(()));
                            pending = Some((step, kind));
                        }
                    }
                }
                Op::Sync => match pending.take() {
                    Some((s, kind)) => check_outcome(r.sync(), s, kind),
                    None => assert!(matches!(r.sync(), Err(AsyncRunnerError::NothingSubmitted { .. }))),
                },
                Op::TrySync => match pending {
                    Some((s, kind)) => match r.try_sync() {
                        Ok(None) => {}
                        Ok(Some(v)) => {
                            pending = None;
                            check_outcome(Ok(v), s, kind);
                        }
                        Err(e) => {
                            pending = None;
                            check_outcome(Err(e), s, kind);
                        }
                    },
                    None => assert!(matches!(r.try_sync(), Err(AsyncRunnerError::NothingSubmitted { .. }))),
                },
                Op::Check => {
                    assert_eq!(r.is_busy(), pending.is_some());
                    assert_eq!(r.in_flight_step(), pending.map(|(s, _)| s));
                }
                Op::DropAndRestart => {
                    drop(r);
                    r = runner::<u64>("prop");
                    pending = None;
                }
            }
        }
        // The runner is dropped here, possibly with a job in flight.
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

        #[test]
        fn random_submit_sync_try_sync_drop_sequences_never_deadlock(ops in prop::collection::vec(op(), 1..24)) {
            bounded(LIMIT, move || replay(ops));
        }
    }
}
