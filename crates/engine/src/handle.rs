//! The front end's side of the engine: a cheap, cloneable handle that submits requests and
//! aborts them over a channel to the engine thread (or, with data parallelism, through a
//! [`Router`] to the rank's thread). Holds no engine state.
//!
//! The handle knows a router only through the [`Router`] trait, which `dp::ReplicaRouter`
//! implements: `dp` builds on handles (a router holds each rank's), not the other way round.

use crate::api::GenerateRequest;
use crate::types::RequestId;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;

/// What the engine thread receives. A submission is moved once through the channel, so its size
/// costs a copy, not memory held: not boxed.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub enum EngineCommand {
    Submit(GenerateRequest),
    Abort(RequestId),
    /// Stop taking work; finish in-flight requests (bounded by the engine's grace period).
    Shutdown,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the server is overloaded: {waiting} requests are already waiting (limit {limit}); retry later")]
    QueueFull { waiting: usize, limit: usize },
    #[error("the engine is shutting down or has stopped")]
    Closed,
}

/// Counters shared between the handle and the engine thread.
#[derive(Debug, Default)]
pub struct QueueCounters {
    /// Requests submitted but not yet scheduled for the first time.
    pub waiting: AtomicUsize,
    /// Of `waiting`, those the engine's host state holds (accepted, not yet scheduled): what a
    /// lost host takes with it, so rebuilding it gives exactly these slots back.
    pub waiting_in_host: AtomicUsize,
    /// Set once the engine thread has ended, however it ended (a panic included): the handle
    /// then refuses work and `/health` fails (see [`EngineHandle::is_running`]).
    pub engine_stopped: AtomicBool,
}

/// Marks the engine thread's end in its counters when dropped, which also happens while a panic
/// unwinds the thread: `spawn_engine` holds one for the thread's whole life.
pub struct StoppedOnDrop(pub Arc<QueueCounters>);

impl Drop for StoppedOnDrop {
    fn drop(&mut self) {
        if std::thread::panicking() {
            tracing::error!("the engine thread panicked; the server can no longer generate");
        }
        self.0.engine_stopped.store(true, Ordering::Release);
    }
}

/// Where a routed handle's commands go: something that spreads requests over several engines,
/// each behind its own handle (`dp::ReplicaRouter`).
pub trait Router: Send + Sync {
    /// Routes a request to one engine; refuses as that engine's handle does.
    fn submit(&self, req: GenerateRequest) -> Result<(), SubmitError>;
    /// Sends the abort to the engine that owns the request; harmless if it already ended.
    fn abort(&self, id: RequestId);
    /// Stops every engine taking work.
    fn shutdown(&self);
    /// Requests waiting on all engines.
    fn waiting(&self) -> usize;
    /// Requests all engines' waiting queues hold when full.
    fn capacity(&self) -> usize;
    /// Whether every engine behind the router is still running.
    fn is_running(&self) -> bool;
}

#[derive(Clone)]
pub struct EngineHandle {
    target: Target,
    next_id: Arc<AtomicU64>,
}

/// Where commands go.
#[derive(Clone)]
enum Target {
    /// One engine thread's channel.
    Engine { tx: Sender<EngineCommand>, counters: Arc<QueueCounters>, max_waiting: usize },
    /// Data-parallel ranks behind a router (each rank has its own `Engine` target).
    Ranks(Arc<dyn Router>),
}

impl EngineHandle {
    /// A handle and the receiving end the engine thread drains.
    pub fn channel(max_waiting: usize) -> (Self, Receiver<EngineCommand>, Arc<QueueCounters>) {
        let (tx, rx) = std::sync::mpsc::channel();
        let counters = Arc::new(QueueCounters::default());
        let h = Self { target: Target::Engine { tx, counters: counters.clone(), max_waiting }, next_id: Arc::new(AtomicU64::new(1)) };
        (h, rx, counters)
    }

    /// A handle that routes over data-parallel ranks (`dp::ReplicaRouter`).
    pub fn routed(router: Arc<dyn Router>) -> Self {
        Self { target: Target::Ranks(router), next_id: Arc::new(AtomicU64::new(1)) }
    }

    pub fn next_request_id(&self) -> RequestId {
        RequestId(self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// Queues a request; refuses at once when the waiting queue is full.
    pub fn submit(&self, req: GenerateRequest) -> Result<(), SubmitError> {
        let (tx, counters, max_waiting) = match &self.target {
            Target::Engine { tx, counters, max_waiting } => (tx, counters, *max_waiting),
            Target::Ranks(router) => return router.submit(req),
        };
        if counters.engine_stopped.load(Ordering::Acquire) {
            return Err(SubmitError::Closed);
        }
        // reserve a waiting slot atomically, so concurrent submits cannot overshoot the limit
        counters
            .waiting
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |w| (w < max_waiting).then_some(w + 1))
            .map_err(|waiting| SubmitError::QueueFull { waiting, limit: max_waiting })?;
        tx.send(EngineCommand::Submit(req)).map_err(|_| {
            counters.waiting.fetch_sub(1, Ordering::Relaxed);
            SubmitError::Closed
        })
    }

    /// Queues all of `reqs` or none: the waiting slots for all of them are reserved at once, so a
    /// request with many choices never half-fills the queue before being refused (the refused
    /// requests are dropped unsent; nothing reaches the engine). Behind a router, whose ranks
    /// reserve one by one, the free room is checked first and, should a rank still refuse, the
    /// ones already submitted are aborted.
    pub fn submit_all(&self, reqs: Vec<GenerateRequest>) -> Result<(), SubmitError> {
        let n = reqs.len();
        let (tx, counters, max_waiting) = match &self.target {
            Target::Engine { tx, counters, max_waiting } => (tx, counters, *max_waiting),
            Target::Ranks(router) => {
                let (waiting, limit) = (router.waiting(), router.capacity());
                if waiting.saturating_add(n) > limit {
                    return Err(SubmitError::QueueFull { waiting, limit });
                }
                let ids: Vec<RequestId> = reqs.iter().map(|r| r.id).collect();
                for (sent, req) in reqs.into_iter().enumerate() {
                    if let Err(e) = router.submit(req) {
                        ids[..sent].iter().for_each(|&id| router.abort(id));
                        return Err(e);
                    }
                }
                return Ok(());
            }
        };
        counters
            .waiting
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |w| (w.saturating_add(n) <= max_waiting).then_some(w + n))
            .map_err(|waiting| SubmitError::QueueFull { waiting, limit: max_waiting })?;
        for (sent, req) in reqs.into_iter().enumerate() {
            if tx.send(EngineCommand::Submit(req)).is_err() {
                // the engine is gone: give back the slots of those not sent
                counters.waiting.fetch_sub(n - sent, Ordering::Relaxed);
                return Err(SubmitError::Closed);
            }
        }
        Ok(())
    }

    /// Cancels a request; harmless if it already finished.
    pub fn abort(&self, id: RequestId) {
        match &self.target {
            Target::Engine { tx, .. } => {
                let _ = tx.send(EngineCommand::Abort(id));
            }
            Target::Ranks(router) => router.abort(id),
        }
    }

    pub fn shutdown(&self) {
        match &self.target {
            Target::Engine { tx, .. } => {
                let _ = tx.send(EngineCommand::Shutdown);
            }
            Target::Ranks(router) => router.shutdown(),
        }
    }

    /// Whether the engine thread (every rank's, with data parallelism) is still running: false
    /// once it ended, by a shutdown or by dying. `/health` answers from this.
    pub fn is_running(&self) -> bool {
        match &self.target {
            Target::Engine { counters, .. } => !counters.engine_stopped.load(Ordering::Acquire),
            Target::Ranks(router) => router.is_running(),
        }
    }

    pub fn waiting(&self) -> usize {
        match &self.target {
            Target::Engine { counters, .. } => counters.waiting.load(Ordering::Relaxed),
            Target::Ranks(router) => router.waiting(),
        }
    }

    /// Requests the waiting queue holds when full (`--max-waiting`, summed over ranks).
    pub fn capacity(&self) -> usize {
        match &self.target {
            Target::Engine { max_waiting, .. } => *max_waiting,
            Target::Ranks(router) => router.capacity(),
        }
    }

    /// Requests the waiting queue can take right now: a front end refuses a request with more
    /// choices than this before doing any work for it.
    pub fn room(&self) -> usize {
        self.capacity().saturating_sub(self.waiting())
    }
}
