//! The front end of N ranks: routes each request to the rank with the fewest outstanding tokens
//! (prompt + max_tokens of its unfinished requests), preferring a rank that recently took a
//! request with the same first KV block (its prefix cache likely holds it), and sends aborts to
//! the rank that owns the request. An `EngineHandle` built with `EngineHandle::routed` fronts
//! it, so the server needs no change.
//!
//! A request's events pass through a small forwarding task (on the router's own thread) that
//! holds a `Lease`: when the request ends, any way at all, the lease drops and its tokens leave
//! the rank's outstanding count.

use crate::api::{GenerateRequest, RequestEvent};
use crate::handle::{EngineHandle, Router, SubmitError};
use crate::types::{RequestId, TokenId};
use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// First-block keys remembered for prefix affinity (oldest forgotten first).
const AFFINITY_CAPACITY: usize = 1 << 16;

/// Load of each rank, shared with the forwarding tasks.
struct Loads {
    /// Prompt + max_tokens of each rank's unfinished requests.
    outstanding: Vec<AtomicUsize>,
    /// Which rank owns each unfinished request (where its abort goes).
    owners: Mutex<HashMap<RequestId, usize>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // nothing panics while holding these locks; a poisoned one still holds consistent data
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One routed request's claim on its rank's load; dropping it releases the claim.
struct Lease {
    loads: Arc<Loads>,
    rank: usize,
    id: RequestId,
    tokens: usize,
}

impl Lease {
    fn new(loads: &Arc<Loads>, rank: usize, id: RequestId, tokens: usize) -> Self {
        loads.outstanding[rank].fetch_add(tokens, Ordering::Relaxed);
        lock(&loads.owners).insert(id, rank);
        let lease = Self { loads: loads.clone(), rank, id, tokens };
        lease.publish();
        lease
    }

    fn publish(&self) {
        let v = self.loads.outstanding[self.rank].load(Ordering::Relaxed);
        metrics::gauge!("specula:dp_outstanding_tokens", "rank" => self.rank.to_string()).set(v as f64);
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.loads.outstanding[self.rank].fetch_sub(self.tokens, Ordering::Relaxed);
        lock(&self.loads.owners).remove(&self.id);
        self.publish();
    }
}

/// Which ranks recently took a request starting with a given first block of tokens.
#[derive(Default)]
struct PrefixAffinity {
    /// first-block key -> bit set of ranks (ranks >= 64 are not tracked)
    ranks: HashMap<u64, u64>,
    /// keys in insertion order, for forgetting the oldest
    order: VecDeque<u64>,
}

impl PrefixAffinity {
    fn get(&self, key: u64) -> u64 {
        self.ranks.get(&key).copied().unwrap_or(0)
    }

    fn record(&mut self, key: u64, rank: usize) {
        if rank >= 64 {
            return;
        }
        if !self.ranks.contains_key(&key) {
            if self.order.len() >= AFFINITY_CAPACITY {
                if let Some(old) = self.order.pop_front() {
                    self.ranks.remove(&old);
                }
            }
            self.order.push_back(key);
        }
        *self.ranks.entry(key).or_insert(0) |= 1 << rank;
    }
}

/// Runs the forwarding tasks on a dedicated thread with its own single-threaded tokio runtime,
/// so routing works with or without the caller's runtime. Dropping it stops the thread; tasks
/// still running are dropped (their leases released, their engine-side receivers closed, which
/// the engines treat as a client disconnect).
struct Forwarder {
    rt: tokio::runtime::Handle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Forwarder {
    fn start() -> std::io::Result<Self> {
        let (handle_tx, handle_rx) = std::sync::mpsc::channel();
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new().name("specula-dp-router".into()).spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread().build() {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = handle_tx.send(Err(e));
                    return;
                }
            };
            let _ = handle_tx.send(Ok(rt.handle().clone()));
            rt.block_on(async move {
                let _ = stop_rx.await;
            });
        })?;
        let rt = handle_rx.recv().map_err(|_| std::io::Error::other("the router thread exited before starting"))??;
        Ok(Self { rt, stop: Some(stop) })
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Passes a request's events from its rank to its client; ends after the terminal event, when
/// the client goes away (dropping `from` tells the engine), or when the rank drops the request
/// without one (then the client gets a `Failed`).
async fn forward(mut from: UnboundedReceiver<RequestEvent>, to: UnboundedSender<RequestEvent>, lease: Lease) {
    loop {
        tokio::select! {
            ev = from.recv() => match ev {
                Some(ev) => {
                    let terminal = matches!(ev, RequestEvent::Finished { .. } | RequestEvent::Failed { .. });
                    if to.send(ev).is_err() || terminal {
                        break;
                    }
                }
                None => {
                    let message = format!("data-parallel rank {} stopped before the request finished", lease.rank);
                    let _ = to.send(RequestEvent::Failed { message });
                    break;
                }
            },
            _ = to.closed() => break,
        }
    }
    drop(lease);
}

/// Routes requests over the command channels of N ranks (replicas or lockstep ranks).
pub struct ReplicaRouter {
    ranks: Vec<EngineHandle>,
    loads: Arc<Loads>,
    affinity: Mutex<PrefixAffinity>,
    /// Tokens in the block the prefix cache hashes first; prompts shorter than this carry no
    /// affinity.
    block_size: usize,
    forwarder: Forwarder,
}

impl ReplicaRouter {
    /// `ranks[r]` is rank r's own handle (from `EngineHandle::channel`).
    pub fn new(ranks: Vec<EngineHandle>, block_size: usize) -> std::io::Result<Self> {
        assert!(!ranks.is_empty(), "a router needs at least one rank");
        let loads = Arc::new(Loads { outstanding: ranks.iter().map(|_| AtomicUsize::new(0)).collect(), owners: Mutex::new(HashMap::new()) });
        for r in 0..ranks.len() {
            metrics::gauge!("specula:dp_outstanding_tokens", "rank" => r.to_string()).set(0.0);
        }
        Ok(Self { ranks, loads, affinity: Mutex::new(PrefixAffinity::default()), block_size: block_size.max(1), forwarder: Forwarder::start()? })
    }

    pub fn num_ranks(&self) -> usize {
        self.ranks.len()
    }

    /// Outstanding tokens of each rank (prompt + max_tokens of its unfinished requests).
    pub fn outstanding_tokens(&self) -> Vec<usize> {
        self.loads.outstanding.iter().map(|a| a.load(Ordering::Relaxed)).collect()
    }

    /// The rank that owns an unfinished request.
    pub fn owner(&self, id: RequestId) -> Option<usize> {
        lock(&self.loads.owners).get(&id).copied()
    }

    /// The rank a request with this prompt goes to: the least loaded one (lowest rank on ties),
    /// unless a rank that recently took the same first block is loaded by at most the prompt's
    /// length more (a prefix-cache hit saves at most that much prefill).
    pub fn pick(&self, prompt: &[TokenId]) -> usize {
        let loads = self.outstanding_tokens();
        let least = (0..loads.len()).min_by_key(|&r| (loads[r], r)).expect("at least one rank");
        let Some(key) = self.first_block_key(prompt) else { return least };
        let mut affinity = lock(&self.affinity);
        let holders = affinity.get(key);
        let warm = (0..loads.len().min(64)).filter(|&r| holders & (1 << r) != 0).min_by_key(|&r| (loads[r], r));
        let chosen = match warm {
            Some(r) if loads[r] <= loads[least] + prompt.len() => r,
            _ => least,
        };
        affinity.record(key, chosen);
        chosen
    }

    fn first_block_key(&self, prompt: &[TokenId]) -> Option<u64> {
        let block = prompt.get(..self.block_size)?;
        let mut h = DefaultHasher::new();
        block.hash(&mut h);
        Some(h.finish())
    }

    pub fn submit(&self, mut req: GenerateRequest) -> Result<(), SubmitError> {
        let rank = self.pick(&req.prompt);
        let (to_rank, from_rank) = unbounded_channel();
        let client = std::mem::replace(&mut req.events, to_rank);
        let lease = Lease::new(&self.loads, rank, req.id, req.prompt.len() + req.params.max_tokens);
        self.ranks[rank].submit(req)?;
        self.forwarder.rt.spawn(forward(from_rank, client, lease));
        Ok(())
    }

    /// Sends the abort to the owning rank; harmless if the request already ended.
    pub fn abort(&self, id: RequestId) {
        if let Some(rank) = self.owner(id) {
            self.ranks[rank].abort(id);
        }
    }

    pub fn shutdown(&self) {
        for r in &self.ranks {
            r.shutdown();
        }
    }

    /// Requests waiting on all ranks.
    pub fn waiting(&self) -> usize {
        self.ranks.iter().map(|r| r.waiting()).sum()
    }

    /// Waiting-queue capacity of all ranks.
    pub fn capacity(&self) -> usize {
        self.ranks.iter().map(|r| r.capacity()).sum()
    }
}

/// What `EngineHandle::routed` fronts.
impl Router for ReplicaRouter {
    fn submit(&self, req: GenerateRequest) -> Result<(), SubmitError> {
        ReplicaRouter::submit(self, req)
    }

    fn abort(&self, id: RequestId) {
        ReplicaRouter::abort(self, id)
    }

    fn shutdown(&self) {
        ReplicaRouter::shutdown(self)
    }

    fn waiting(&self) -> usize {
        ReplicaRouter::waiting(self)
    }

    fn capacity(&self) -> usize {
        ReplicaRouter::capacity(self)
    }

    /// Every rank's engine thread: one that died (or stopped) makes the group unable to serve
    /// what the router sends it.
    fn is_running(&self) -> bool {
        self.ranks.iter().all(|r| r.is_running())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{FinishReason, SamplingParams};
    use crate::handle::EngineCommand;
    use std::sync::mpsc::Receiver;
    use std::time::{Duration, Instant};

    /// A router over `n` fake ranks whose command channels the test reads.
    fn router(n: usize, block_size: usize) -> (ReplicaRouter, Vec<Receiver<EngineCommand>>) {
        let (handles, rxs): (Vec<_>, Vec<_>) = (0..n).map(|_| EngineHandle::channel(100)).map(|(h, rx, _)| (h, rx)).unzip();
        (ReplicaRouter::new(handles, block_size).unwrap(), rxs)
    }

    fn request(id: u64, prompt: Vec<u32>, max_tokens: usize) -> (GenerateRequest, tokio::sync::mpsc::UnboundedReceiver<RequestEvent>) {
        let (tx, rx) = unbounded_channel();
        (GenerateRequest { id: RequestId(id), prompt, params: SamplingParams::greedy(max_tokens), events: tx, grammar: None }, rx)
    }

    fn submitted(rx: &Receiver<EngineCommand>) -> GenerateRequest {
        match rx.recv_timeout(Duration::from_secs(5)).expect("a command") {
            EngineCommand::Submit(r) => r,
            other => panic!("expected a submit, got {other:?}"),
        }
    }

    fn wait_until(what: &str, f: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !f() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    #[test]
    fn requests_go_to_the_least_loaded_rank_and_leave_its_load_when_finished() {
        let (r, rxs) = router(3, 16);
        let (a, mut a_events) = request(1, vec![1; 10], 90); // 100 tokens -> rank 0
        r.submit(a).unwrap();
        let (b, _b_events) = request(2, vec![2; 5], 15); // 20 tokens -> rank 1
        r.submit(b).unwrap();
        let (c, _c_events) = request(3, vec![3; 5], 5); // 10 tokens -> rank 2
        r.submit(c).unwrap();
        assert_eq!(r.outstanding_tokens(), vec![100, 20, 10]);
        let (d, _d_events) = request(4, vec![4; 2], 2); // -> rank 2 (least loaded)
        r.submit(d).unwrap();
        assert_eq!(r.outstanding_tokens(), vec![100, 20, 14]);
        let a_on_rank = submitted(&rxs[0]);
        let (c_on_rank, d_on_rank) = (submitted(&rxs[2]), submitted(&rxs[2]));
        assert_eq!((c_on_rank.id, d_on_rank.id), (RequestId(3), RequestId(4)));
        // events pass through to the client; the terminal one releases the load
        a_on_rank.events.send(RequestEvent::Delta { tokens: vec![7], text: "x".into(), logprobs: vec![] }).unwrap();
        a_on_rank.events.send(RequestEvent::Finished { reason: FinishReason::Length, prompt_tokens: 10, completion_tokens: 1, cached_tokens: 0 }).unwrap();
        wait_until("the load of rank 0 to drop", || r.outstanding_tokens()[0] == 0);
        assert!(matches!(a_events.try_recv().unwrap(), RequestEvent::Delta { .. }));
        assert!(matches!(a_events.try_recv().unwrap(), RequestEvent::Finished { .. }));
        assert_eq!(r.owner(RequestId(1)), None);
        assert_eq!(r.owner(RequestId(3)), Some(2));
    }

    #[test]
    fn a_shared_first_block_keeps_requests_on_the_warm_rank_within_the_slack() {
        let (r, _rxs) = router(2, 4);
        let system = [9u32, 8, 7, 6];
        let p = |tail: u32| [&system[..], &[tail; 20]].concat();
        let mut keep = Vec::new();
        let (a, ev) = request(1, p(1), 10); // 34 tokens -> rank 0 (tie)
        keep.push(ev);
        r.submit(a).unwrap();
        // rank 0 holds the prefix and is 34 tokens ahead: within a 24-token prompt's slack? no.
        assert_eq!(r.pick(&p(2)), 1, "34 > 0 + 24: the warm rank is too busy");
        // now both ranks hold it; the less loaded wins
        assert_eq!(r.pick(&p(3)), 1);
        // a prompt without the shared block goes by load alone
        assert_eq!(r.pick(&[1, 2, 3]), 1);
        // a long prompt sharing the block tolerates more load difference
        let long = [&system[..], &[5; 60][..]].concat();
        let (b, ev) = request(2, vec![0; 3], 40); // rank 1 gets 43 tokens
        keep.push(ev);
        r.submit(b).unwrap();
        assert_eq!(r.outstanding_tokens(), vec![34, 43]);
        assert_eq!(r.pick(&long), 0, "rank 0 is least loaded and warm");
    }

    #[test]
    fn prefix_affinity_wins_over_a_slightly_less_loaded_rank() {
        let (r, _rxs) = router(2, 4);
        let mut keep = Vec::new();
        let shared = [1u32, 2, 3, 4, 5, 6, 7, 8];
        let (a, ev) = request(1, shared.to_vec(), 2); // 10 tokens -> rank 0
        keep.push(ev);
        r.submit(a).unwrap();
        let (b, ev) = request(2, vec![50, 51], 3); // 5 tokens -> rank 1
        keep.push(ev);
        r.submit(b).unwrap();
        // rank 1 is less loaded (5 < 10), but rank 0 holds the block and 10 <= 5 + 8
        assert_eq!(r.pick(&shared), 0);
    }

    #[test]
    fn abort_goes_to_the_owning_rank_only() {
        let (r, rxs) = router(2, 16);
        let (a, _ea) = request(1, vec![1; 4], 4);
        r.submit(a).unwrap();
        let (b, _eb) = request(2, vec![2; 4], 4);
        r.submit(b).unwrap();
        // held: dropping a submitted request closes its stream, which ends its ownership
        let _ra = submitted(&rxs[0]);
        let _rb = submitted(&rxs[1]);
        r.abort(RequestId(2));
        assert!(matches!(rxs[1].recv_timeout(Duration::from_secs(5)).unwrap(), EngineCommand::Abort(RequestId(2))));
        assert!(rxs[0].try_recv().is_err());
        r.abort(RequestId(77)); // unknown: nothing sent
        assert!(rxs[0].try_recv().is_err() && rxs[1].try_recv().is_err());
    }

    #[test]
    fn a_client_that_goes_away_releases_the_load_and_closes_the_engine_side() {
        let (r, rxs) = router(1, 16);
        let (a, events) = request(1, vec![1; 4], 4);
        r.submit(a).unwrap();
        let on_rank = submitted(&rxs[0]);
        drop(events);
        wait_until("the load to drop", || r.outstanding_tokens()[0] == 0);
        wait_until("the engine side to see the disconnect", || on_rank.events.is_closed());
    }

    #[test]
    fn a_rank_that_drops_a_request_gives_its_client_a_failure() {
        let (r, rxs) = router(1, 16);
        let (a, mut events) = request(1, vec![1; 4], 4);
        r.submit(a).unwrap();
        drop(submitted(&rxs[0]));
        wait_until("the load to drop", || r.outstanding_tokens()[0] == 0);
        assert!(matches!(events.try_recv().unwrap(), RequestEvent::Failed { message } if message.contains("rank 0 stopped")));
    }

    #[test]
    fn a_routed_handle_can_be_shared_across_threads_like_a_single_one() {
        fn shareable<T: Send + Sync + Clone>() {}
        shareable::<EngineHandle>();
    }

    #[test]
    fn a_refused_submit_leaves_no_load() {
        let (handle, rx, _) = EngineHandle::channel(100);
        drop(rx);
        let r = ReplicaRouter::new(vec![handle], 16).unwrap();
        let (a, _e) = request(1, vec![1; 4], 4);
        assert_eq!(r.submit(a), Err(SubmitError::Closed));
        assert_eq!(r.outstanding_tokens(), vec![0]);
        assert_eq!(r.owner(RequestId(1)), None);
    }
}
