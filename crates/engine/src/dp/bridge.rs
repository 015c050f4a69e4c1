//! Serving over MPI processes (`mpirun -np N specula serve --data-parallel-backend mpi`): every
//! process runs one engine rank; rank 0 also runs the HTTP server and the `ReplicaRouter`. This
//! module carries what crosses processes, as MPI point-to-point messages (JSON bodies) on a
//! duplicate of the world communicator, so they never mix with the ranks' collectives:
//!
//! - down (rank 0 to rank r): submit, abort, shutdown, and a last `Done`;
//! - up (rank r to rank 0): batches of request events, metric snapshots, `Stopped`.
//!
//! On rank 0, [`FrontBridge`] gives the router one `EngineHandle` per remote rank: a plain engine
//! channel that the bridge thread drains, so the router cannot tell a remote rank from a local
//! one. On the other ranks, [`RankBridge`] feeds the local engine's handle and watches the events
//! of the requests it submitted. One thread per process does all of it, polling with a short
//! back-off (at most `MAX_IDLE_SLEEP` of extra latency per hop); sends are non-blocking and the
//! thread keeps receiving while one is pending, so two bridges sending large messages to each
//! other at once cannot deadlock.
//!
//! Ending: rank 0 sends `Shutdown` (on SIGTERM, or once its handles are gone); each rank's engine
//! finishes in-flight work within its grace period and the rank reports `Stopped`; once every
//! rank has, rank 0 sends `Done`. Only then do the bridges end and MPI finalize, so no message is
//! left in flight and no rank waits for one that will never come. A bridge that fails (a message
//! it cannot decode, a panic) aborts the MPI job, for the same reason.

use super::communicator::DpError;
use super::rank::{RankMetrics, RankSnapshot, RankStats};
use crate::api::{GenerateRequest, RequestEvent, SamplingParams};
use crate::handle::{EngineCommand, EngineHandle, QueueCounters};
use crate::types::{RequestId, TokenId};
use mpi::topology::SimpleCommunicator;
use mpi::traits::{Communicator as _, Destination, MatchedReceiveVec, Source};
use serde::{Deserialize, Serialize};
use specula_model::Tokenizer;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::error::TryRecvError as EventTryRecvError;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// Messages from rank 0 to the other ranks.
const TAG_DOWN: mpi::Tag = 1;
/// Messages from the other ranks to rank 0.
const TAG_UP: mpi::Tag = 2;
/// Longest sleep of an idle bridge between two polls.
const MAX_IDLE_SLEEP: Duration = Duration::from_millis(1);
/// How often a rank sends its metrics snapshot to rank 0 (when it changed).
const STATS_INTERVAL: Duration = Duration::from_millis(50);

/// Rank 0 to rank r.
#[derive(Debug, Serialize, Deserialize)]
enum Down {
    Submit {
        id: u64,
        prompt: Vec<TokenId>,
        params: SamplingParams,
    },
    Abort {
        id: u64,
    },
    /// Stop taking work; finish in-flight requests within the grace period.
    Shutdown,
    /// Every rank has stopped: the bridge may end.
    Done,
}

/// Rank r to rank 0.
#[derive(Debug, Serialize, Deserialize)]
enum Up {
    /// Events of this rank's requests, in the order each request produced them.
    Events(Vec<(u64, RequestEvent)>),
    Stats(RankSnapshot),
    /// The rank's engine has ended and every event it produced was sent before this.
    Stopped,
}

fn is_terminal(ev: &RequestEvent) -> bool {
    matches!(ev, RequestEvent::Finished { .. } | RequestEvent::Failed { .. })
}

fn mpi_error(what: &str) -> impl FnOnce(serde_json::Error) -> DpError + '_ {
    move |e| DpError::Mpi(format!("bad {what} message on the serving bridge (do all ranks run the same specula build?): {e}"))
}

/// The bridge's communicator and the messages received but not handled yet.
struct Link {
    comm: SimpleCommunicator,
    inbox: VecDeque<(usize, Vec<u8>)>,
}

impl Link {
    /// Collective over MPI_COMM_WORLD: every rank's bridge thread calls it at start-up while the
    /// rank's main thread waits, so it cannot interleave with another world collective.
    fn open() -> Self {
        Self { comm: SimpleCommunicator::world().duplicate(), inbox: VecDeque::new() }
    }

    /// Moves every message with `tag` that has arrived into the inbox; whether any had.
    fn receive(&mut self, tag: mpi::Tag) -> bool {
        receive_into(&self.comm, &mut self.inbox, tag)
    }

    /// Sends `body` to `rank`; while the send is pending, receives `inbound` messages into the
    /// inbox (the peer may be sending to us at the same moment).
    fn send(&mut self, rank: usize, tag: mpi::Tag, body: &[u8], inbound: mpi::Tag) {
        let (comm, inbox) = (&self.comm, &mut self.inbox);
        mpi::request::scope(|scope| {
            let mut req = comm.process_at_rank(rank as mpi::Rank).immediate_send_with_tag(scope, body, tag);
            loop {
                match req.test() {
                    Ok(_) => break,
                    Err(pending) => {
                        req = pending;
                        if !receive_into(comm, inbox, inbound) {
                            std::thread::yield_now();
                        }
                    }
                }
            }
        });
    }
}

fn receive_into(comm: &SimpleCommunicator, inbox: &mut VecDeque<(usize, Vec<u8>)>, tag: mpi::Tag) -> bool {
    let mut any = false;
    while let Some(probed) = comm.any_process().immediate_matched_probe_with_tag(tag) {
        let from = probed.1.source_rank() as usize;
        let (body, _) = probed.matched_receive_vec::<u8>();
        inbox.push_back((from, body));
        any = true;
    }
    any
}

/// Sleeps longer the longer the bridge has been idle, up to `MAX_IDLE_SLEEP`.
#[derive(Default)]
struct Backoff {
    idle_rounds: u32,
}

impl Backoff {
    fn pause(&mut self, busy: bool) {
        if busy {
            self.idle_rounds = 0;
            return;
        }
        self.idle_rounds = self.idle_rounds.saturating_add(1);
        let micros = (16u64 << self.idle_rounds.min(7)).min(MAX_IDLE_SLEEP.as_micros() as u64);
        std::thread::sleep(Duration::from_micros(micros));
    }
}

fn spawn_bridge<F>(name: &str, body: F) -> Result<JoinHandle<Result<(), DpError>>, DpError>
where
    F: FnOnce(Link) -> Result<(), DpError> + Send + 'static,
{
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let join = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let link = Link::open();
            let _ = ready_tx.send(());
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(link)))
                .unwrap_or_else(|p| Err(DpError::Mpi(format!("the MPI bridge thread panicked: {}", crate::error::panic_message(&p)))));
            if let Err(e) = &result {
                // the peers' bridges would wait for this one's messages forever: end the job
                tracing::error!("{e}; aborting the MPI job");
                eprintln!("error: {e}; aborting the MPI job");
                SimpleCommunicator::world().abort(1);
            }
            result
        })
        .map_err(|e| DpError::Mpi(format!("cannot start the MPI bridge thread: {e}")))?;
    ready_rx.recv().map_err(|_| DpError::Mpi("the MPI bridge thread ended during start-up".into()))?;
    Ok(join)
}

fn join_bridge(join: JoinHandle<Result<(), DpError>>) -> Result<(), DpError> {
    join.join().unwrap_or_else(|_| Err(DpError::Mpi("the MPI bridge thread ended abnormally".into())))
}

// ---------------------------------------------------------------------------------------------
// Rank 0
// ---------------------------------------------------------------------------------------------

/// Rank 0's side: one engine handle per remote rank, for the router.
pub struct FrontBridge {
    /// Handles of ranks 1..size, in rank order: the router takes them after rank 0's own.
    pub handles: Vec<EngineHandle>,
    join: JoinHandle<Result<(), DpError>>,
}

/// What rank 0 knows of one remote rank.
struct Remote {
    rank: usize,
    /// Commands the router sent to this rank's handle.
    rx: Receiver<EngineCommand>,
    counters: Arc<QueueCounters>,
    shutdown_sent: bool,
    stopped: bool,
    metrics: RankMetrics,
}

/// A request running on a remote rank.
struct RemoteRequest {
    rank: usize,
    events: UnboundedSender<RequestEvent>,
    /// Whether the rank has reported anything for it yet. Until then it counts as waiting on the
    /// remote handle, so the handle refuses submits (503 at the front) before the rank's own
    /// queue would: the rank only refuses by failing the stream.
    started: bool,
}

impl FrontBridge {
    /// Starts rank 0's bridge for a group of `size` processes. Collective: every other rank calls
    /// `RankBridge::start` at the same point. `max_waiting` bounds each remote handle's queue as
    /// an engine handle's would be (the remote rank enforces its own limit as well).
    pub fn start(size: usize, max_waiting: usize) -> Result<Self, DpError> {
        let mut handles = Vec::new();
        let mut remotes = Vec::new();
        for rank in 1..size {
            let (h, rx, counters) = EngineHandle::channel(max_waiting);
            handles.push(h);
            remotes.push(Remote { rank, rx, counters, shutdown_sent: false, stopped: false, metrics: RankMetrics::new(rank) });
        }
        let join = spawn_bridge("specula-mpi-bridge", move |link| FrontLoop { link, remotes, requests: HashMap::new() }.run())?;
        Ok(Self { handles, join })
    }

    /// Waits for the bridge, which ends once every remote rank has stopped (after a shutdown
    /// sent through the router, or their own signal).
    pub fn join(self) -> Result<(), DpError> {
        drop(self.handles);
        join_bridge(self.join)
    }
}

struct FrontLoop {
    link: Link,
    remotes: Vec<Remote>,
    requests: HashMap<RequestId, RemoteRequest>,
}

impl FrontLoop {
    fn run(mut self) -> Result<(), DpError> {
        let mut backoff = Backoff::default();
        while !self.remotes.iter().all(|r| r.stopped) {
            let mut busy = self.take_commands()?;
            busy |= self.abort_disconnected()?;
            busy |= self.link.receive(TAG_UP);
            while let Some((from, body)) = self.link.inbox.pop_front() {
                busy = true;
                self.on_up(from, &body)?;
            }
            backoff.pause(busy);
        }
        for rank in 1..=self.remotes.len() {
            self.send(rank, &Down::Done)?;
        }
        tracing::info!("MPI bridge: every rank stopped");
        Ok(())
    }

    fn send(&mut self, rank: usize, msg: &Down) -> Result<(), DpError> {
        let body = serde_json::to_vec(msg).map_err(mpi_error("outgoing"))?;
        self.link.send(rank, TAG_DOWN, &body, TAG_UP);
        Ok(())
    }

    /// Forwards what the router sent to the remote ranks' handles.
    fn take_commands(&mut self) -> Result<bool, DpError> {
        let mut busy = false;
        for i in 0..self.remotes.len() {
            loop {
                let cmd = match self.remotes[i].rx.try_recv() {
                    Ok(cmd) => cmd,
                    Err(TryRecvError::Empty) => break,
                    // every handle is gone: nothing can come any more (not busy: keep backing off)
                    Err(TryRecvError::Disconnected) if self.remotes[i].shutdown_sent => break,
                    Err(TryRecvError::Disconnected) => EngineCommand::Shutdown,
                };
                busy = true;
                let rank = self.remotes[i].rank;
                match cmd {
                    EngineCommand::Submit(req) => {
                        if self.remotes[i].stopped || self.remotes[i].shutdown_sent {
                            self.remotes[i].counters.waiting.fetch_sub(1, Ordering::Relaxed);
                            let _ = req.events.send(RequestEvent::Failed { message: "the server is shutting down".into() });
                            continue;
                        }
                        // still waiting (on its way, or queued on the rank) until the rank reports on it
                        let GenerateRequest { id, prompt, params, events, .. } = req;
                        self.requests.insert(id, RemoteRequest { rank, events, started: false });
                        self.send(rank, &Down::Submit { id: id.0, prompt, params })?;
                    }
                    EngineCommand::Abort(id) => {
                        // the entry stays until the rank's terminal event (Finished with Abort)
                        if self.requests.contains_key(&id) {
                            self.send(rank, &Down::Abort { id: id.0 })?;
                        }
                    }
                    EngineCommand::Shutdown => {
                        if !self.remotes[i].shutdown_sent {
                            self.remotes[i].shutdown_sent = true;
                            if !self.remotes[i].stopped {
                                self.send(rank, &Down::Shutdown)?;
                            }
                        }
                        break;
                    }
                }
            }
        }
        Ok(busy)
    }

    /// Requests whose client went away (the router dropped their event receiver): abort them on
    /// their rank, as an engine does before each step.
    fn abort_disconnected(&mut self) -> Result<bool, DpError> {
        let gone: Vec<(RequestId, usize)> = self.requests.iter().filter(|(_, r)| r.events.is_closed()).map(|(id, r)| (*id, r.rank)).collect();
        for &(id, rank) in &gone {
            self.requests.remove(&id);
            tracing::debug!(request = %id, rank, "client disconnected; aborting on its rank");
            self.send(rank, &Down::Abort { id: id.0 })?;
        }
        Ok(!gone.is_empty())
    }

    fn on_up(&mut self, from: usize, body: &[u8]) -> Result<(), DpError> {
        let Some(remote) = from.checked_sub(1).and_then(|i| self.remotes.get_mut(i)) else {
            return Err(DpError::Mpi(format!("message from unexpected rank {from}")));
        };
        match serde_json::from_slice::<Up>(body).map_err(mpi_error("incoming"))? {
            Up::Events(events) => {
                for (id, ev) in events {
                    let id = RequestId(id);
                    let terminal = is_terminal(&ev);
                    if let Some(r) = self.requests.get_mut(&id) {
                        if !r.started {
                            r.started = true;
                            remote.counters.waiting.fetch_sub(1, Ordering::Relaxed);
                        }
                        let _ = r.events.send(ev);
                        if terminal {
                            self.requests.remove(&id);
                        }
                    }
                }
            }
            Up::Stats(s) => remote.metrics.publish_snapshot(&s),
            Up::Stopped => {
                remote.stopped = true;
                tracing::info!(rank = from, "MPI rank stopped");
                let message = format!("data-parallel rank {from} stopped before the request finished");
                let counters = &remote.counters;
                self.requests.retain(|_, r| {
                    if r.rank == from {
                        if !r.started {
                            counters.waiting.fetch_sub(1, Ordering::Relaxed);
                        }
                        let _ = r.events.send(RequestEvent::Failed { message: message.clone() });
                    }
                    r.rank != from
                });
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Ranks 1..N
// ---------------------------------------------------------------------------------------------

/// A remote rank's side: feeds the local engine and reports back to rank 0.
pub struct RankBridge {
    join: JoinHandle<Result<(), DpError>>,
}

impl RankBridge {
    /// Starts the bridge of a rank other than 0 (collective with rank 0's `FrontBridge::start`).
    /// `local` is this rank's engine handle, `stats` its counters (sent to rank 0's /metrics),
    /// and `engine_stopped` is set by the caller once the rank's engine loop has ended.
    /// `tokenizer` compiles the constraints of requests that come with one (a compiled grammar
    /// does not cross MPI; the bridge compiles it again here, off the engine thread).
    pub fn start(local: EngineHandle, tokenizer: Arc<Tokenizer>, stats: Arc<RankStats>, engine_stopped: Arc<AtomicBool>) -> Result<Self, DpError> {
        let join = spawn_bridge("specula-mpi-bridge", move |link| {
            RankLoop { link, local, tokenizer, stats, engine_stopped, requests: HashMap::new(), outbox: Vec::new(), last_stats: None, stats_at: Instant::now() }
                .run()
        })?;
        Ok(Self { join })
    }

    /// Waits for the bridge, which ends when rank 0 says every rank has stopped.
    pub fn join(self) -> Result<(), DpError> {
        join_bridge(self.join)
    }
}

struct RankLoop {
    link: Link,
    local: EngineHandle,
    tokenizer: Arc<Tokenizer>,
    stats: Arc<RankStats>,
    engine_stopped: Arc<AtomicBool>,
    /// Event streams of the requests submitted to the local engine, by request id.
    requests: HashMap<u64, UnboundedReceiver<RequestEvent>>,
    /// Events gathered this round, sent as one message.
    outbox: Vec<(u64, RequestEvent)>,
    last_stats: Option<RankSnapshot>,
    stats_at: Instant,
}

impl RankLoop {
    fn run(mut self) -> Result<(), DpError> {
        let mut backoff = Backoff::default();
        let mut stopped_sent = false;
        loop {
            let mut busy = self.link.receive(TAG_DOWN);
            let mut done = false;
            while let Some((_, body)) = self.link.inbox.pop_front() {
                busy = true;
                done |= self.on_down(&body)?;
            }
            // read before draining: once the engine has ended, this drain gets its last events
            let engine_ended = self.engine_stopped.load(Ordering::Acquire);
            busy |= self.collect_events();
            if !self.outbox.is_empty() {
                let events = std::mem::take(&mut self.outbox);
                self.send(&Up::Events(events))?;
            }
            self.send_stats(engine_ended)?;
            if engine_ended && !stopped_sent {
                self.send(&Up::Stopped)?;
                stopped_sent = true;
            }
            if done {
                return Ok(());
            }
            backoff.pause(busy);
        }
    }

    fn send(&mut self, msg: &Up) -> Result<(), DpError> {
        let body = serde_json::to_vec(msg).map_err(mpi_error("outgoing"))?;
        self.link.send(0, TAG_UP, &body, TAG_DOWN);
        Ok(())
    }

    /// Handles one message from rank 0; whether it was `Done`.
    fn on_down(&mut self, body: &[u8]) -> Result<bool, DpError> {
        match serde_json::from_slice::<Down>(body).map_err(mpi_error("incoming"))? {
            Down::Submit { id, prompt, params } => {
                let grammar = match crate::api::compile_params(&self.tokenizer, &params) {
                    Ok(g) => g,
                    Err(e) => {
                        self.outbox.push((id, RequestEvent::Failed { message: e.0 }));
                        return Ok(false);
                    }
                };
                let (events, rx) = unbounded_channel();
                match self.local.submit(GenerateRequest { id: RequestId(id), prompt, params, events, grammar }) {
                    Ok(()) => {
                        self.requests.insert(id, rx);
                    }
                    Err(e) => self.outbox.push((id, RequestEvent::Failed { message: e.to_string() })),
                }
            }
            Down::Abort { id } => self.local.abort(RequestId(id)),
            Down::Shutdown => self.local.shutdown(),
            Down::Done => return Ok(true),
        }
        Ok(false)
    }

    /// Moves every event the local engine produced into the outbox; whether there were any.
    fn collect_events(&mut self) -> bool {
        let before = self.outbox.len();
        let outbox = &mut self.outbox;
        self.requests.retain(|&id, rx| loop {
            match rx.try_recv() {
                Ok(ev) => {
                    let terminal = is_terminal(&ev);
                    outbox.push((id, ev));
                    if terminal {
                        return false;
                    }
                }
                Err(EventTryRecvError::Empty) => return true,
                Err(EventTryRecvError::Disconnected) => {
                    outbox.push((id, RequestEvent::Failed { message: "the data-parallel rank dropped the request without finishing it".into() }));
                    return false;
                }
            }
        });
        self.outbox.len() > before
    }

    /// Sends the rank's metrics when they changed and `STATS_INTERVAL` has passed (or `now`).
    fn send_stats(&mut self, now: bool) -> Result<(), DpError> {
        if !now && self.stats_at.elapsed() < STATS_INTERVAL {
            return Ok(());
        }
        self.stats_at = Instant::now();
        let s = self.stats.snapshot();
        if self.last_stats != Some(s) {
            self.last_stats = Some(s);
            self.send(&Up::Stats(s))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{FinishReason, TokenLogprob};

    #[test]
    fn messages_round_trip_through_their_wire_form() {
        let params = SamplingParams { temperature: 0.7, seed: Some(3), stop: Arc::from(["\n\n".to_string()]), logprobs: Some(2), ..SamplingParams::greedy(9) };
        let down = Down::Submit { id: 41, prompt: vec![1, 2, 65535], params: params.clone() };
        let back: Down = serde_json::from_slice(&serde_json::to_vec(&down).unwrap()).unwrap();
        assert!(matches!(back, Down::Submit { id: 41, ref prompt, params: ref p } if prompt == &[1, 2, 65535] && *p == params));
        let events = vec![
            (
                41,
                RequestEvent::Delta {
                    tokens: vec![7],
                    text: "é".into(),
                    logprobs: vec![TokenLogprob { token: 7, logprob: -0.25, top: vec![(7, -0.25), (8, -1.5)] }],
                },
            ),
            (41, RequestEvent::Finished { reason: FinishReason::Length, prompt_tokens: 3, completion_tokens: 1, cached_tokens: 2 }),
            (42, RequestEvent::Failed { message: "x".into() }),
        ];
        let back: Up = serde_json::from_slice(&serde_json::to_vec(&Up::Events(events.clone())).unwrap()).unwrap();
        assert!(matches!(back, Up::Events(ref e) if *e == events));
        let snap = RankSnapshot { running: 2, waiting: 1, kv_usage: 0.125, dummy_steps: 9, collective_nanos: 123, ..Default::default() };
        let back: Up = serde_json::from_slice(&serde_json::to_vec(&Up::Stats(snap)).unwrap()).unwrap();
        assert!(matches!(back, Up::Stats(s) if s == snap));
    }

    #[test]
    fn a_body_from_another_build_is_a_clear_error() {
        let e = serde_json::from_slice::<Up>(b"{\"Telemetry\":1}").map_err(mpi_error("incoming")).unwrap_err();
        assert!(e.to_string().contains("same specula build"), "{e}");
    }
}
