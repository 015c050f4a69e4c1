//! Shared by the data-parallel tests: groups of ranks on the tiny model, streams read with a
//! deadline (a hang fails the test instead of stalling it), a single-engine reference, and the
//! process's CPU time. Tests of one binary take `serial()` so CPU and timing measurements see
//! only their own group.

#![allow(dead_code)]

use crate::common::{tiny_config, TinyModel};
use specula_engine::dp::{spawn_lockstep, spawn_replicas, Communicator, DpError, DpGroup, LocalGroup, RankSetup};
use specula_engine::fault::FaultInjection;
use specula_engine::handle::EngineHandle;
use specula_engine::types::RequestId;
use specula_engine::{spawn_engine, EngineConfig, FinishReason, GenerateRequest, RequestEvent, SamplingParams};
use specula_model::{load_model, Tokenizer};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// Longest any single wait in these tests may take before it counts as a hang.
pub const HANG: Duration = Duration::from_secs(20);

pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Per-rank limits: chunked prefill (64 tokens a step), a 256-token context, one thread a rank.
pub fn dp_config(ranks: usize) -> EngineConfig {
    EngineConfig { num_kv_blocks: 96, threads: ranks, ..tiny_config() }
}

fn setups(m: &TinyModel, n: usize) -> (Vec<RankSetup>, Arc<Tokenizer>) {
    let mut tokenizer = None;
    let ranks = (0..n)
        .map(|_| {
            let loaded = load_model(&m.path).expect("load tiny model");
            tokenizer.get_or_insert(Arc::new(loaded.tokenizer));
            RankSetup::new(loaded.model)
        })
        .collect();
    (ranks, tokenizer.expect("n >= 1"))
}

pub fn lockstep_on<C: Communicator + Send + 'static>(m: &TinyModel, comms: Vec<C>) -> DpGroup {
    let n = comms.len();
    let (ranks, tokenizer) = setups(m, n);
    spawn_lockstep(ranks, comms, tokenizer, dp_config(n)).expect("start lockstep group")
}

pub fn lockstep(m: &TinyModel, n: usize) -> DpGroup {
    lockstep_on(m, LocalGroup::new(n))
}

/// A lockstep group of `n` in-process ranks on `cfg`, with `fault` injected into rank `rank` alone.
pub fn lockstep_with_fault(m: &TinyModel, n: usize, cfg: EngineConfig, rank: usize, fault: FaultInjection) -> DpGroup {
    let (mut ranks, tokenizer) = setups(m, n);
    let faulty = ranks.remove(rank).with_fault_injection(fault);
    ranks.insert(rank, faulty);
    spawn_lockstep(ranks, LocalGroup::new(n), tokenizer, cfg).expect("start lockstep group")
}

/// Replicas of `n` in-process ranks with `fault` injected into rank `rank` alone.
pub fn replicas_with_fault(m: &TinyModel, n: usize, rank: usize, fault: FaultInjection) -> DpGroup {
    let (mut ranks, tokenizer) = setups(m, n);
    let faulty = ranks.remove(rank).with_fault_injection(fault);
    ranks.insert(rank, faulty);
    spawn_replicas(ranks, tokenizer, dp_config(n)).expect("start replicas")
}

pub fn replicas(m: &TinyModel, n: usize) -> DpGroup {
    let (ranks, tokenizer) = setups(m, n);
    spawn_replicas(ranks, tokenizer, dp_config(n)).expect("start replicas")
}

/// One request's events as they arrive.
pub struct Stream {
    pub id: RequestId,
    rx: UnboundedReceiver<RequestEvent>,
    pub events: Vec<RequestEvent>,
}

pub fn submit(h: &EngineHandle, prompt: Vec<u32>, params: SamplingParams) -> Stream {
    let id = h.next_request_id();
    let (tx, rx) = unbounded_channel();
    h.submit(GenerateRequest { id, prompt, params, events: tx, grammar: None }).expect("submit");
    Stream { id, rx, events: Vec::new() }
}

impl Stream {
    fn poll(&mut self) {
        while let Ok(ev) = self.rx.try_recv() {
            self.events.push(ev);
        }
    }

    pub fn ended(&self) -> bool {
        self.events.iter().any(|e| matches!(e, RequestEvent::Finished { .. } | RequestEvent::Failed { .. }))
    }

    /// Waits (at most `HANG`) for at least `n` tokens or the end.
    pub fn wait_tokens(&mut self, n: usize) {
        let deadline = Instant::now() + HANG;
        loop {
            self.poll();
            if self.tokens().len() >= n || self.ended() {
                return;
            }
            assert!(Instant::now() < deadline, "{}: no progress within {HANG:?} (hang?)", self.id);
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Waits (at most `HANG`) for the terminal event; returns it.
    pub fn wait_end(&mut self) -> RequestEvent {
        let deadline = Instant::now() + HANG;
        loop {
            self.poll();
            if self.ended() {
                let terminals = self.events.iter().filter(|e| !matches!(e, RequestEvent::Delta { .. })).count();
                assert_eq!(terminals, 1, "{}: {:?}", self.id, self.events);
                return self.events.last().cloned().expect("ended");
            }
            assert!(Instant::now() < deadline, "{}: did not finish within {HANG:?} (hang?)", self.id);
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Waits for the end, checks it is `Finished` with `reason`, returns the streamed tokens.
    pub fn finished(&mut self, reason: FinishReason) -> Vec<u32> {
        match self.wait_end() {
            RequestEvent::Finished { reason: r, completion_tokens, .. } => {
                assert_eq!(r, reason, "{}", self.id);
                assert_eq!(completion_tokens, self.tokens().len());
            }
            other => panic!("{}: expected Finished({reason:?}), got {other:?}", self.id),
        }
        self.tokens()
    }

    pub fn tokens(&self) -> Vec<u32> {
        specula_engine::api::streamed_tokens(&self.events)
    }
}

/// Each request's tokens from one plain engine (the reference every DP output must equal).
pub fn single_engine_outputs(m: &TinyModel, requests: &[(Vec<u32>, SamplingParams)]) -> Vec<Vec<u32>> {
    let loaded = load_model(&m.path).expect("load tiny model");
    let (h, join) = spawn_engine(loaded.model, Arc::new(loaded.tokenizer), dp_config(1), None).expect("engine");
    let mut streams: Vec<Stream> = requests.iter().map(|(p, params)| submit(&h, p.clone(), params.clone())).collect();
    let out = streams.iter_mut().map(|s| s.finished(FinishReason::Length)).collect();
    h.shutdown();
    drop(h);
    join.join().unwrap();
    out
}

/// Shuts the group down and waits (at most `HANG`) for every rank; each rank's result.
pub fn shutdown_and_join(group: DpGroup) -> Vec<Result<(), DpError>> {
    group.shutdown();
    join_within(group)
}

pub fn join_within(group: DpGroup) -> Vec<Result<(), DpError>> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(group.join());
    });
    rx.recv_timeout(HANG).expect("ranks did not stop within the deadline (hang)")
}

/// User + system CPU time of this whole process.
pub fn process_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
    let after_name = &stat[stat.rfind(')').expect("comm field") + 2..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // fields 14 and 15 of the file (utime, stime) are 11 and 12 after the name and state
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 10) // USER_HZ is 100 on Linux
}
