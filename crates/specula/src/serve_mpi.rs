//! `mpirun -np N specula serve --data-parallel-backend mpi [--data-parallel-mode replica|lockstep]`:
//! one engine rank per MPI process. Every process loads the model and builds its engine; all
//! check together that they could and that they run the same configuration (a rank that cannot
//! start makes every rank exit with the reason). Rank 0 then serves HTTP and routes requests
//! (least outstanding tokens, prefix affinity) to its own engine or, through the MPI bridge
//! (`dp::bridge`), to the other ranks'. Replica ranks step independently; lockstep ranks agree on
//! every step over MPI_COMM_WORLD, and with --enable-expert-parallel each holds 1/N of a MoE
//! model's experts and exchanges tokens with the others every MoE layer (`dp::mpi_expert`).
//! SIGINT/SIGTERM on any rank start the agreed shutdown.
//!
//! SIGTERM to mpirun reaches the ranks `odls_base_sigkill_timeout` seconds later (default 1) and
//! mpirun sends SIGKILL as long again after that; for a longer grace period raise it
//! (`mpirun --mca odls_base_sigkill_timeout 15 ...`) or signal rank 0 itself.

use super::{serve_http, server_config, wait_for_signal, ServeArgs};
use anyhow::{anyhow, Context, Result};
use specula_engine::dp::bridge::{FrontBridge, RankBridge};
use specula_engine::dp::group::describe_config;
use specula_engine::dp::mpi::{MpiComm, Threading};
use specula_engine::dp::{
    build_rank, check_same_config, spawn_replica_rank, BuiltRank, Communicator, DpMode, LockstepRank, RankSetup, RankStats, ReplicaRouter,
};
use specula_engine::{EngineConfig, EngineHandle};
use specula_model::{load_model_with, Tokenizer};
use specula_server::AppState;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// What a process built before the start-up check.
struct Built {
    rank: BuiltRank,
    tokenizer: Arc<Tokenizer>,
    chat: Option<Arc<specula_model::ChatTemplate>>,
    model_name: String,
    cfg: EngineConfig,
    /// The configuration every rank must share (`describe_config` plus the build).
    desc: String,
}

pub fn run(args: ServeArgs) -> Result<()> {
    let mode = DpMode::from(args.data_parallel_mode);
    // the metrics recorder must exist before any rank records anything
    let _ = specula_server::metrics::prometheus_handle();
    let (env, comm) = MpiComm::init_threaded(Threading::Multiple)?;
    let (rank, size) = (comm.rank(), comm.size());
    if let Some(n) = args.data_parallel_size {
        comm.expect_size(n)?; // the same answer on every rank: all exit together
    }
    let built = build(&args, mode, size);
    let own_error = built.as_ref().err().map(|e| format!("{e:#}"));
    let local = match (&built, &own_error) {
        (Ok(b), _) => Ok(b.desc.as_str()),
        (Err(_), Some(e)) => Err(e.as_str()),
        (Err(_), None) => Err("could not start"),
    };
    if let Err(e) = check_same_config(&comm, local) {
        let msg = match own_error {
            Some(own) => format!("MPI rank {rank} of {size} could not start: {own}\n(every rank stops: {e})"),
            None => format!("MPI rank {rank} of {size}: {e}"),
        };
        // every rank says why before any exits: mpirun aborts the job at the first non-zero exit,
        // which would otherwise cut off the ranks that are still on their way to printing
        eprintln!("error: {msg}");
        let _ = comm.barrier();
        drop(comm);
        drop(env);
        std::process::exit(1);
    }
    let built = built?; // Ok: the check above failed on every rank otherwise
    eprintln!("MPI rank {rank} of {size}: {} mode, {} compute thread(s)", mode.as_str(), built.cfg.threads);
    let result = if rank == 0 { run_front(args, mode, comm, built) } else { run_remote(mode, comm, built) };
    // MPI finalizes here, after every thread that used it has ended
    drop(env);
    result
}

/// Loads the model and builds this process's engine rank.
fn build(args: &ServeArgs, mode: DpMode, size: usize) -> Result<Built> {
    let path = crate::fetch::resolve_model(&args.engine.model)?;
    let mut loaded = load_model_with(&path, &args.engine.load_options(&path, 1))?;
    let mut cfg = args.engine.to_config(&path, &loaded, 1)?;
    cfg.shutdown_grace = Duration::from_secs(args.shutdown_grace_secs);
    if args.engine.threads.is_none() {
        cfg.threads = default_threads();
    }
    let spec = args.engine.spec.build(&loaded.model, &loaded.tokenizer, &cfg)?;
    // this process keeps its 1/N of the experts (fails alike on every rank for a bad N)
    args.engine.setup_expert_parallel_mpi(&mut loaded.model, mode == DpMode::Lockstep)?;
    let desc =
        format!("specula_version={}\n{}", env!("CARGO_PKG_VERSION"), describe_config(&cfg, &loaded.model.config, spec.as_ref().map(|s| &s.0), size, mode));
    let mut setup = RankSetup::new(loaded.model);
    if let Some((c, p)) = spec {
        setup = setup.with_speculation(c, p);
    }
    let tokenizer = Arc::new(loaded.tokenizer);
    let rank = build_rank(setup, tokenizer.clone(), &cfg)?;
    Ok(Built { rank, tokenizer, chat: loaded.chat_template.map(Arc::new), model_name: loaded.name, cfg, desc })
}

/// Without --threads: this host's cores shared by the ranks mpirun started on it.
fn default_threads() -> usize {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let local_ranks = std::env::var("OMPI_COMM_WORLD_LOCAL_SIZE").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(1);
    (cores / local_ranks.max(1)).max(1)
}

/// Rank 0: HTTP server and router on top of its own engine rank.
fn run_front(args: ServeArgs, mode: DpMode, comm: MpiComm, built: Built) -> Result<()> {
    let size = comm.size();
    let Built { rank: local, tokenizer, chat, model_name, cfg, .. } = built;
    let front = FrontBridge::start(size, cfg.max_waiting)?;
    let mut handles = vec![local.handle.clone()];
    handles.extend(front.handles.iter().cloned());
    let router = Arc::new(ReplicaRouter::new(handles, cfg.block_size).context("cannot start the request router")?);
    let engine = EngineHandle::routed(router);
    let state = AppState::new(engine.clone(), tokenizer, chat, server_config(&args, &cfg, &model_name));
    let stopped = Arc::new(tokio::sync::Notify::new());
    let http = {
        let (engine, stopped) = (engine.clone(), stopped.clone());
        std::thread::Builder::new()
            .name("specula-http".into())
            .spawn(move || serve_http(&args, state, engine, &model_name, async move { stopped.notified().await }))?
    };
    let rank_result = run_rank(mode, comm, local, Arc::new(RankStats::default()));
    // the HTTP server stops too if the ranks stopped without it (a rank's own signal)
    stopped.notify_one();
    let http_result = http.join().map_err(|_| anyhow!("the HTTP server thread panicked"))?;
    engine.shutdown();
    drop(engine);
    let bridge_result = front.join();
    http_result?;
    rank_result?;
    bridge_result?;
    Ok(())
}

/// Ranks 1..N: their engine rank, fed through the bridge; a signal starts the shutdown here too.
fn run_remote(mode: DpMode, comm: MpiComm, built: Built) -> Result<()> {
    let local = built.rank.handle.clone();
    let stats = Arc::new(RankStats::default());
    let engine_stopped = Arc::new(AtomicBool::new(false));
    let bridge = RankBridge::start(local.clone(), built.tokenizer.clone(), stats.clone(), engine_stopped.clone())?;
    watch_signals(local);
    let rank_result = run_rank(mode, comm, built.rank, stats);
    engine_stopped.store(true, Ordering::Release);
    let bridge_result = bridge.join();
    rank_result?;
    bridge_result?;
    Ok(())
}

/// Runs this process's engine rank until the (agreed) shutdown: a replica on its own thread, a
/// lockstep rank on this one (the MPI communicator stays on the thread that made it).
fn run_rank(mode: DpMode, comm: MpiComm, built: BuiltRank, stats: Arc<RankStats>) -> Result<()> {
    let rank = comm.rank();
    match mode {
        DpMode::Replica => {
            drop(comm);
            let join = spawn_replica_rank(built, rank, stats)?;
            join.join().map_err(|_| anyhow!("MPI rank {rank}: the engine thread panicked"))
        }
        DpMode::Lockstep => {
            let BuiltRank { engine, rx, handle } = built;
            drop(handle);
            LockstepRank::new(engine, comm, rx, stats).run().map_err(|e| anyhow!("MPI rank {rank}: {e}"))
        }
    }
}

/// On SIGINT/SIGTERM, asks this rank's engine to shut down (the group follows: replicas through
/// rank 0's shutdown, lockstep ranks through the next agreement).
fn watch_signals(local: EngineHandle) {
    let spawned = std::thread::Builder::new().name("specula-signals".into()).spawn(move || {
        let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(rt) => rt,
            Err(e) => {
                tracing::warn!("cannot watch for signals ({e}); this rank stops when rank 0 says so");
                return;
            }
        };
        rt.block_on(wait_for_signal());
        eprintln!("shutting down this rank (signal)");
        local.shutdown();
    });
    if let Err(e) = spawned {
        tracing::warn!("cannot start the signal thread ({e}); this rank stops when rank 0 says so");
    }
}
