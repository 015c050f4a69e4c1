//! The front end's side of the engine: a cheap, cloneable handle that submits requests and
//! aborts them over a channel to the engine thread. Holds no engine state.

use crate::api::GenerateRequest;
use crate::types::RequestId;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;

/// What the engine thread receives.
#[derive(Debug)]
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
}

#[derive(Clone)]
pub struct EngineHandle {
    tx: Sender<EngineCommand>,
    counters: Arc<QueueCounters>,
    next_id: Arc<AtomicU64>,
    max_waiting: usize,
}

impl EngineHandle {
    /// A handle and the receiving end the engine thread drains.
    pub fn channel(max_waiting: usize) -> (Self, Receiver<EngineCommand>, Arc<QueueCounters>) {
        let (tx, rx) = std::sync::mpsc::channel();
        let counters = Arc::new(QueueCounters::default());
        let h = Self { tx, counters: counters.clone(), next_id: Arc::new(AtomicU64::new(1)), max_waiting };
        (h, rx, counters)
    }

    pub fn next_request_id(&self) -> RequestId {
        RequestId(self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// Queues a request; refuses at once when the waiting queue is full.
    pub fn submit(&self, req: GenerateRequest) -> Result<(), SubmitError> {
        let waiting = self.counters.waiting.load(Ordering::Relaxed);
        if waiting >= self.max_waiting {
            return Err(SubmitError::QueueFull { waiting, limit: self.max_waiting });
        }
        self.counters.waiting.fetch_add(1, Ordering::Relaxed);
        self.tx.send(EngineCommand::Submit(req)).map_err(|_| {
            self.counters.waiting.fetch_sub(1, Ordering::Relaxed);
            SubmitError::Closed
        })
    }

    /// Cancels a request; harmless if it already finished.
    pub fn abort(&self, id: RequestId) {
        let _ = self.tx.send(EngineCommand::Abort(id));
    }

    pub fn shutdown(&self) {
        let _ = self.tx.send(EngineCommand::Shutdown);
    }

    pub fn waiting(&self) -> usize {
        self.counters.waiting.load(Ordering::Relaxed)
    }
}
