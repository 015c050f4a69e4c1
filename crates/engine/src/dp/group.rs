//! Starting a data-parallel group in this process: N engine ranks, each with its own model
//! instance, KV cache and compute threads (`--threads` split evenly), behind one routed
//! `EngineHandle`. Replica ranks step independently; lockstep ranks step together through a
//! communicator and check at start-up that they all run the same configuration.

use super::communicator::{Communicator, DpError};
use super::lockstep::LockstepRank;
use super::metadata::check_same_config;
pub use super::rank::RankSetup;
use super::rank::{RankMetrics, RankStats};
use super::router::ReplicaRouter;
use crate::config::EngineConfig;
use crate::engine::Engine;
use crate::engine_loop::LoopHook;
use crate::error::EngineError;
use crate::handle::{EngineCommand, EngineHandle};
use crate::speculative::cost::CostModel;
use crate::speculative::SpecConfig;
use crate::step::StepStats;
use specula_model::Tokenizer;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::thread::JoinHandle;

/// How the ranks of a group step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DpMode {
    /// Independent engines (dense models; the default).
    Replica,
    /// Every rank steps together, padding to the largest batch (needed for expert-parallel MoE).
    Lockstep,
}

impl DpMode {
    pub fn as_str(self) -> &'static str {
        match self {
            DpMode::Replica => "replica",
            DpMode::Lockstep => "lockstep",
        }
    }
}

/// A running group.
pub struct DpGroup {
    /// Routes over every rank: what a front end uses.
    pub handle: EngineHandle,
    pub router: Arc<ReplicaRouter>,
    /// Each rank's own handle, bypassing the router (tests that put work on one rank).
    pub rank_handles: Vec<EngineHandle>,
    pub stats: Vec<Arc<RankStats>>,
    joins: Vec<JoinHandle<Result<(), DpError>>>,
}

impl DpGroup {
    pub fn size(&self) -> usize {
        self.rank_handles.len()
    }

    /// Stops taking work on every rank; in-flight requests get the engines' grace period.
    pub fn shutdown(&self) {
        self.handle.shutdown();
    }

    /// Whether every rank thread has ended.
    pub fn is_finished(&self) -> bool {
        self.joins.iter().all(|j| j.is_finished())
    }

    /// Drops this group's handles and waits for every rank; each rank's result, in rank order.
    /// Ranks end after `shutdown` or once every clone of the handles is gone.
    pub fn join(self) -> Vec<Result<(), DpError>> {
        let Self { handle, router, rank_handles, joins, .. } = self;
        drop((handle, router, rank_handles));
        joins.into_iter().map(|j| j.join().unwrap_or_else(|p| Err(DpError::RankFailed(crate::error::panic_message(&p))))).collect()
    }
}

/// The engine configuration of one rank of `n`: the compute threads are shared out.
pub fn rank_config(cfg: &EngineConfig, n: usize) -> EngineConfig {
    EngineConfig { threads: (cfg.threads / n.max(1)).max(1), publish_gauges: false, ..cfg.clone() }
}

/// `key=value` lines every rank must agree on (thread counts may differ between hosts).
pub fn describe_config(cfg: &EngineConfig, model: &specula_model::ModelConfig, spec: Option<&SpecConfig>, size: usize, mode: DpMode) -> String {
    let spec = spec.map_or("none".to_string(), |s| format!("{:?} k={}", s.method, s.num_speculative_tokens));
    [
        format!("data_parallel_size={size}"),
        format!("data_parallel_mode={}", mode.as_str()),
        format!("max_num_seqs={}", cfg.max_num_seqs),
        format!("max_num_batched_tokens={}", cfg.max_num_batched_tokens),
        format!("max_model_len={}", cfg.max_model_len),
        format!("block_size={}", cfg.block_size),
        format!("num_kv_blocks={}", cfg.num_kv_blocks),
        format!("enable_prefix_caching={}", cfg.enable_prefix_caching),
        format!("speculative={spec}"),
        format!(
            "model={} vocab={} hidden={} layers={} heads={}/{}",
            model.arch, model.vocab_size, model.hidden_size, model.n_layers, model.n_heads, model.n_kv_heads
        ),
        format!("moe={:?}", model.moe),
    ]
    .join("\n")
}

/// One rank's engine and command channel, built but not running yet.
pub struct BuiltRank {
    pub engine: Engine,
    pub rx: Receiver<EngineCommand>,
    /// The rank's own handle (from `EngineHandle::channel`).
    pub handle: EngineHandle,
}

/// Builds one rank with `cfg` as its own configuration (the caller has already shared out the
/// threads). An MPI process builds its rank this way before the start-up check, so that a
/// configuration error reaches every rank instead of leaving them waiting.
pub fn build_rank(setup: RankSetup, tokenizer: Arc<Tokenizer>, cfg: &EngineConfig) -> Result<BuiltRank, EngineError> {
    build_rank_with_cost(setup, tokenizer, cfg, None)
}

/// [`build_rank`] with the speculation cost model a rank built before measured (`None`: measure).
fn build_rank_with_cost(setup: RankSetup, tokenizer: Arc<Tokenizer>, cfg: &EngineConfig, cost: Option<CostModel>) -> Result<BuiltRank, EngineError> {
    let (handle, rx, counters) = EngineHandle::channel(cfg.max_waiting);
    let cfg = setup.config(cfg);
    let mut engine = Engine::new(setup.model, tokenizer, cfg, counters)?;
    if let Some((c, p)) = setup.spec {
        engine = engine.with_speculation_cost(c, p, cost)?;
    }
    Ok(BuiltRank { engine, rx, handle })
}

/// Builds each rank's engine (on the calling thread, so configuration errors come back here)
/// and its channel.
fn build_engines(
    ranks: Vec<RankSetup>,
    tokenizer: &Arc<Tokenizer>,
    cfg: &EngineConfig,
) -> Result<Vec<(Engine, Receiver<EngineCommand>, EngineHandle)>, EngineError> {
    let n = ranks.len();
    if n == 0 {
        return Err(EngineError::Config("--data-parallel-size must be at least 1".into()));
    }
    let rank_cfg = rank_config(cfg, n);
    // every rank has the same model, proposer and threads: the first measures what speculation
    // costs (a few seconds for a real model) and the others take its figures
    let mut cost = None;
    let mut built = Vec::with_capacity(n);
    for setup in ranks {
        let b = build_rank_with_cost(setup, tokenizer.clone(), &rank_cfg, cost.clone())?;
        cost = cost.or_else(|| b.engine.spec_cost().cloned());
        built.push((b.engine, b.rx, b.handle));
    }
    Ok(built)
}

fn routed(rank_handles: &[EngineHandle], cfg: &EngineConfig) -> Result<Arc<ReplicaRouter>, EngineError> {
    ReplicaRouter::new(rank_handles.to_vec(), cfg.block_size).map(Arc::new).map_err(EngineError::Spawn)
}

/// Starts `ranks.len()` independent engine replicas behind one router.
pub fn spawn_replicas(ranks: Vec<RankSetup>, tokenizer: Arc<Tokenizer>, cfg: EngineConfig) -> Result<DpGroup, EngineError> {
    if ranks.iter().any(|r| r.model.expert_exchange().is_some()) {
        return Err(EngineError::Config(
            "--enable-expert-parallel needs --data-parallel-mode lockstep (replicas step independently, so their expert exchanges could never meet)".into(),
        ));
    }
    let engines = build_engines(ranks, &tokenizer, &cfg)?;
    let rank_handles: Vec<EngineHandle> = engines.iter().map(|(_, _, h)| h.clone()).collect();
    let router = routed(&rank_handles, &cfg)?;
    let mut stats = Vec::new();
    let mut joins = Vec::new();
    for (rank, (engine, rx, _)) in engines.into_iter().enumerate() {
        let s = Arc::new(RankStats::default());
        stats.push(s.clone());
        let join = std::thread::Builder::new()
            .name(format!("specula-dp-{rank}"))
            .spawn(move || {
                let _stopped = engine.stopped_guard();
                run_replica(engine, rx, rank, &s);
                Ok(())
            })
            .map_err(EngineError::Spawn)?;
        joins.push(join);
    }
    tracing::info!(ranks = rank_handles.len(), threads_per_rank = rank_config(&cfg, rank_handles.len()).threads, "data parallel: replica mode");
    Ok(DpGroup { handle: EngineHandle::routed(router.clone()), router, rank_handles, stats, joins })
}

/// One replica: the engine loop, with per-rank counters and labeled metrics as its hook.
fn run_replica(engine: Engine, rx: Receiver<EngineCommand>, rank: usize, stats: &RankStats) {
    engine.run_with(rx, &mut ReplicaHook { rank, stats, metrics: RankMetrics::new(rank) });
}

/// What a replica adds to the engine loop: its counters and gauges, published after each step
/// and when it goes idle or stops.
struct ReplicaHook<'a> {
    rank: usize,
    stats: &'a RankStats,
    metrics: RankMetrics,
}

impl LoopHook for ReplicaHook<'_> {
    fn on_idle(&mut self, engine: &mut Engine) {
        self.metrics.publish(engine, self.stats);
    }

    fn after_step(&mut self, engine: &mut Engine, s: &StepStats) {
        if s.num_tokens > 0 {
            RankStats::add(&self.stats.steps, 1);
            RankStats::add(&self.stats.tokens, s.num_tokens as u64);
        }
        self.metrics.publish(engine, self.stats);
    }

    fn on_stop(&mut self, engine: &mut Engine) {
        self.metrics.publish(engine, self.stats);
        tracing::info!(rank = self.rank, "data-parallel replica stopped");
    }
}

/// Runs a built rank as an independent replica on its own thread, publishing its metrics under
/// `rank` (an MPI process runs one rank of a larger group). The thread ends after a shutdown and
/// its grace period, or once every handle is gone.
pub fn spawn_replica_rank(built: BuiltRank, rank: usize, stats: Arc<RankStats>) -> Result<JoinHandle<()>, EngineError> {
    let BuiltRank { engine, rx, .. } = built;
    std::thread::Builder::new()
        .name(format!("specula-dp-{rank}"))
        .spawn(move || {
            let _stopped = engine.stopped_guard();
            run_replica(engine, rx, rank, &stats)
        })
        .map_err(EngineError::Spawn)
}

/// Starts a lockstep group over `comms` (rank r's communicator at index r, e.g. from
/// `LocalGroup::new`). Returns once every rank has passed the start-up configuration check, or
/// with the check's error (which every rank reported).
pub fn spawn_lockstep<C: Communicator + Send + 'static>(
    ranks: Vec<RankSetup>,
    comms: Vec<C>,
    tokenizer: Arc<Tokenizer>,
    cfg: EngineConfig,
) -> Result<DpGroup, EngineError> {
    let n = ranks.len();
    if comms.len() != n {
        return Err(EngineError::Config(format!("{n} ranks but {} communicators", comms.len())));
    }
    for (i, c) in comms.iter().enumerate() {
        if c.rank() != i || c.size() != n {
            return Err(EngineError::Config(format!("communicator {i} is rank {} of {}, expected rank {i} of {n}", c.rank(), c.size())));
        }
    }
    let descs: Vec<String> =
        ranks.iter().map(|r| describe_config(&rank_config(&cfg, n), &r.model.config, r.spec.as_ref().map(|s| &s.0), n, DpMode::Lockstep)).collect();
    let engines = build_engines(ranks, &tokenizer, &cfg)?;
    let rank_handles: Vec<EngineHandle> = engines.iter().map(|(_, _, h)| h.clone()).collect();
    let router = routed(&rank_handles, &cfg)?;
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let mut stats = Vec::new();
    let mut joins = Vec::new();
    for (((engine, rx, _), comm), desc) in engines.into_iter().zip(comms).zip(descs) {
        let rank = comm.rank();
        let s = Arc::new(RankStats::default());
        stats.push(s.clone());
        let started = started_tx.clone();
        let join = std::thread::Builder::new()
            .name(format!("specula-dp-{rank}"))
            .spawn(move || {
                let _stopped = engine.stopped_guard();
                let checked = check_same_config(&comm, Ok(&desc));
                let _ = started.send(checked.clone());
                checked?;
                LockstepRank::new(engine, comm, rx, s).run()
            })
            .map_err(EngineError::Spawn)?;
        joins.push(join);
    }
    drop(started_tx);
    let mut first_error = None;
    for _ in 0..n {
        match started_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                first_error.get_or_insert(e);
            }
            Err(_) => {
                first_error.get_or_insert(DpError::RankFailed("a rank thread ended during start-up".into()));
                break;
            }
        }
    }
    if let Some(e) = first_error {
        drop(router);
        for j in joins {
            let _ = j.join();
        }
        return Err(EngineError::Config(e.to_string()));
    }
    tracing::info!(ranks = n, threads_per_rank = rank_config(&cfg, n).threads, "data parallel: lockstep mode");
    Ok(DpGroup { handle: EngineHandle::routed(router.clone()), router, rank_handles, stats, joins })
}
