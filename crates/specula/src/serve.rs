//! `specula serve`: the OpenAI-compatible server over one engine, over data-parallel ranks in
//! this process, or (`--data-parallel-backend mpi`, cargo feature `mpi`) over one rank per MPI
//! process (`serve_mpi.rs`). SIGINT/SIGTERM stop accepting connections, give in-flight requests
//! a bounded grace period, then abort what is left with a clear error and exit 0.

use crate::engine_args::EngineArgs;
use anyhow::{Context, Result};
use clap::Args;
use specula_engine::dp::DpMode;
use specula_engine::{spawn_engine, EngineHandle};
use specula_model::load_model_with;
use specula_server::{AppState, ServerConfig};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

#[cfg(feature = "mpi")]
#[path = "serve_mpi.rs"]
mod mpi_ranks;

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer <key>` (or `x-api-key`) on /v1/* routes. Repeat it to let
    /// several keys in: each is a tenant, whose stored responses and speculation's
    /// cross-request index no other key reaches.
    #[arg(long = "api-key", env = "SPECULA_API_KEY")]
    pub api_keys: Vec<String>,
    /// Name clients use in `model` (default: the model file's name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Largest logprobs / top_logprobs a request may ask for.
    #[arg(long, default_value_t = 20)]
    pub max_logprobs: usize,
    /// Most stop strings one request may give (more is a 400).
    #[arg(long, default_value_t = 16)]
    pub max_stop_strings: usize,
    /// Longest stop string in characters (longer is a 400).
    #[arg(long, default_value_t = 256)]
    pub max_stop_string_chars: usize,
    /// Most prompts in one /v1/completions request (more is a 400); prompts x n must also fit the
    /// room left in the waiting queue (--max-waiting), checked before anything is tokenized.
    #[arg(long, default_value_t = 256)]
    pub max_prompts_per_request: usize,
    /// Most logit_bias entries one request may give (more is a 400).
    #[arg(long, default_value_t = 1024)]
    pub max_logit_bias: usize,
    /// Threads that tokenize, render chat templates and compile grammars, off the HTTP workers
    /// (default: the machine's cores).
    #[arg(long)]
    pub prep_threads: Option<usize>,
    /// Seconds a client has to send a request's line and headers, counted from when the server
    /// waits for them (a kept-alive connection that sends nothing this long is closed).
    #[arg(long, default_value = "10", value_parser = parse_seconds)]
    pub header_read_timeout: Duration,
    /// Seconds a request body may pause before the request fails and its connection closes.
    #[arg(long, default_value = "30", value_parser = parse_seconds)]
    pub idle_timeout: Duration,
    /// Share (0 to 1) of finished greedy or seeded requests replayed without speculation, in
    /// idle time, and compared with what was served; /metrics counts identical and diverged
    /// (specula:spec_audit_requests_total) and a divergence is logged. Needs a speculative method.
    #[arg(long, default_value_t = 0.0)]
    pub speculative_audit: f64,
    /// Open connections at most; more are closed as soon as they are accepted.
    #[arg(long, default_value_t = 512)]
    pub max_connections: usize,
    /// Seconds of silence after which a stream sends an SSE keep-alive comment.
    #[arg(long, default_value = "15", value_parser = parse_seconds)]
    pub sse_keep_alive: Duration,
    /// Browser origins (e.g. https://app.example) that may call a server without --api-key,
    /// beside loopback ones; comma-separated, `*` for any. Without it such requests get 403.
    #[arg(long, value_delimiter = ',')]
    pub allowed_origins: Vec<String>,
    /// Seconds in-flight requests get to finish after SIGINT/SIGTERM.
    #[arg(long, default_value_t = 10)]
    pub shutdown_grace_secs: u64,
    /// Engine ranks (each with its own KV cache; --threads is split across in-process ranks).
    /// Default: 1, or with --data-parallel-backend mpi the number of processes mpirun started.
    #[arg(long)]
    pub data_parallel_size: Option<usize>,
    /// How data-parallel ranks step.
    #[arg(long, value_enum, default_value_t = DataParallelMode::Replica)]
    pub data_parallel_mode: DataParallelMode,
    /// Where data-parallel ranks run.
    #[arg(long, value_enum, default_value_t = DataParallelBackend::Local)]
    pub data_parallel_backend: DataParallelBackend,
}

/// `--data-parallel-mode`: the engine's `DpMode`, as the command line spells it.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataParallelMode {
    /// Independent engines behind a least-outstanding-tokens router (dense models).
    Replica,
    /// Ranks agree on every step with one packed all-reduce; idle ranks run dummy batches.
    Lockstep,
}

impl From<DataParallelMode> for DpMode {
    fn from(m: DataParallelMode) -> Self {
        match m {
            DataParallelMode::Replica => DpMode::Replica,
            DataParallelMode::Lockstep => DpMode::Lockstep,
        }
    }
}

/// `--data-parallel-backend`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataParallelBackend {
    /// Ranks are threads of this process.
    Local,
    /// Ranks are processes launched by `mpirun -np N` (rank 0 serves HTTP; --threads is per
    /// process; needs a build with the cargo feature `mpi`).
    Mpi,
}

pub fn run(args: ServeArgs) -> Result<()> {
    if args.engine.async_scheduling && args.data_parallel_mode == DataParallelMode::Lockstep {
        // lockstep ranks agree on a step's shape before it is scheduled; a step prepared ahead
        // would need the next agreement during the current step
        anyhow::bail!("--async-scheduling does not work with --data-parallel-mode lockstep; use --data-parallel-mode replica (each rank schedules ahead on its own) or drop --async-scheduling");
    }
    if args.data_parallel_backend == DataParallelBackend::Mpi {
        return run_mpi(args);
    }
    let path = crate::fetch::resolve_model(&args.engine.model)?;
    let dp_size = args.data_parallel_size.unwrap_or(1);
    // one choice for every in-process rank (their copies are counted before the first is made)
    let load_options = args.engine.load_options(&path, dp_size);
    let loaded = load_model_with(&path, &load_options)?;
    let in_place = loaded.model.in_place_bytes();
    if in_place > 0 {
        let choice = clap::ValueEnum::to_possible_value(&args.engine.expert_weights).map_or_else(String::new, |v| v.get_name().to_string());
        eprintln!("expert weights read in place from the file's map: {:.2} GB (--expert-weights {choice})", in_place as f64 / 1e9);
    }
    let mut cfg = args.engine.to_config(&path, &loaded, dp_size)?;
    let c = &loaded.model.config;
    let kv_tokens = cfg.num_kv_blocks * cfg.block_size;
    let kv_bytes = kv_tokens * c.kv_bytes_per_token(cfg.kv_cache_dtype);
    eprintln!(
        "context: {} tokens a sequence (the model's: {}); KV cache: {kv_tokens} tokens as {} ({:.2} GiB{})",
        cfg.max_model_len,
        c.context_length,
        cfg.kv_cache_dtype,
        kv_bytes as f64 / (1u64 << 30) as f64,
        if dp_size > 1 { ", each rank" } else { "" }
    );
    let tiers = &cfg.prefix_tiers;
    if args.engine.enable_prefix_caching && !tiers.is_off() {
        let disk = tiers.disk.as_ref().map(|d| format!(", then {} (up to {:.1} GiB)", d.dir.display(), d.max_bytes as f64 / (1u64 << 30) as f64));
        eprintln!("prefix cache: the KV cache, then {:.1} GiB of host memory{}", tiers.host_bytes as f64 / (1u64 << 30) as f64, disk.unwrap_or_default());
    }
    match args.engine.spec.to_config() {
        Some(sc) => eprintln!(
            "speculative decoding: {}, up to {} draft tokens, {} (--speculative-method none turns it off)",
            args.engine.spec.speculative_method,
            sc.num_speculative_tokens,
            if sc.adaptive { "as many as the measured cost model says pay" } else { "always all of them" }
        ),
        None => eprintln!("speculative decoding: off"),
    }
    cfg.shutdown_grace = Duration::from_secs(args.shutdown_grace_secs);
    // the test switch of the fault tests (python/tests/test_hostile_connections.py)
    if let Ok(spec) = std::env::var("SPECULA_INJECT_FAULT") {
        cfg.fault_injection = Some(specula_engine::fault::FaultInjection::parse(&spec).map_err(anyhow::Error::msg)?);
        eprintln!("SPECULA_INJECT_FAULT={spec}: a fault will be injected (test switch)");
    }
    let server_cfg = server_config(&args, &cfg, &loaded.name);
    // the metrics recorder must exist before the engine records anything
    let _ = specula_server::metrics::prometheus_handle();
    let tokenizer = Arc::new(loaded.tokenizer);
    let chat = loaded.chat_template.map(Arc::new);
    if args.engine.enable_expert_parallel && dp_size < 2 {
        anyhow::bail!("--enable-expert-parallel spreads the experts over data-parallel ranks: pass --data-parallel-size N (N > 1) --data-parallel-mode lockstep, or run with mpirun and --data-parallel-backend mpi");
    }
    let (engine, join) = if dp_size > 1 {
        let group = spawn_dp_group(&args, dp_size, &path, &load_options, loaded.model, tokenizer.clone(), cfg)?;
        let handle = group.handle.clone();
        (handle, EngineJoin::Group(group))
    } else {
        let spec = args.engine.spec.build(&loaded.model, &tokenizer, &cfg)?;
        let (h, j) = spawn_engine(loaded.model, tokenizer.clone(), cfg, spec)?;
        (h, EngineJoin::Single(j))
    };
    let state = AppState::new(engine.clone(), tokenizer, chat, server_cfg);
    serve_http(&args, state, engine.clone(), &loaded.name, engine_gone(engine.clone()))?;
    // an engine that ended before it was asked to is a failure, whatever the HTTP side did
    let died = !engine.is_running();
    engine.shutdown();
    drop(engine);
    join.join()?;
    if died {
        anyhow::bail!("the engine stopped on its own; the server shut down because it could no longer generate");
    }
    Ok(())
}

/// Resolves once the engine behind `engine` has stopped (checked every 100 ms): a dead engine
/// thread shuts the server down instead of leaving it up unable to generate.
async fn engine_gone(engine: EngineHandle) {
    while engine.is_running() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[cfg(feature = "mpi")]
fn run_mpi(args: ServeArgs) -> Result<()> {
    mpi_ranks::run(args)
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(_args: ServeArgs) -> Result<()> {
    anyhow::bail!(
        "--data-parallel-backend mpi: this specula was built without MPI support; rebuild with `cargo build --release -p specula --features mpi` (needs Open MPI and libclang: apt-get install openmpi-bin libopenmpi-dev libclang-dev) and launch it with `mpirun -np N specula serve --data-parallel-backend mpi ...`"
    )
}

fn server_config(args: &ServeArgs, cfg: &specula_engine::EngineConfig, model_name: &str) -> ServerConfig {
    let mut server_cfg = ServerConfig::new(args.served_model_name.clone().unwrap_or_else(|| model_name.to_string()));
    if args.served_model_name.is_none() {
        // `serve --model qwen2.5-coder-1.5b-instruct` serves the file `...-q4_k_m`; the name the
        // user typed is accepted as well
        server_cfg.model_aliases = crate::fetch::known_name(&args.engine.model).filter(|n| *n != model_name).map(String::from).into_iter().collect();
    }
    server_cfg.max_model_len = cfg.max_model_len;
    server_cfg.max_logprobs = args.max_logprobs;
    server_cfg.max_stop_strings = args.max_stop_strings;
    server_cfg.max_stop_string_chars = args.max_stop_string_chars;
    server_cfg.max_prompts_per_request = args.max_prompts_per_request;
    server_cfg.max_logit_bias = args.max_logit_bias;
    if let Some(threads) = args.prep_threads {
        server_cfg.prep_threads = threads;
    }
    server_cfg.api_keys = args.api_keys.clone();
    server_cfg.connections = specula_server::ConnectionLimits {
        header_read_timeout: args.header_read_timeout,
        idle_timeout: args.idle_timeout,
        max_connections: args.max_connections,
        sse_keep_alive: args.sse_keep_alive,
    };
    server_cfg.allowed_origins = args.allowed_origins.clone();
    server_cfg.speculative_audit = args.speculative_audit;
    if args.speculative_audit > 0.0 && args.engine.spec.speculative_method.0.is_none() {
        tracing::warn!("--speculative-audit has nothing to check without --speculative-method: the audit is off");
        server_cfg.speculative_audit = 0.0;
    }
    server_cfg
}

/// A positive number of seconds (fractions allowed: `0.5`).
fn parse_seconds(s: &str) -> Result<Duration, String> {
    let secs: f64 = s.parse().map_err(|_| format!("'{s}' is not a number of seconds"))?;
    if !(secs > 0.0 && secs < 1e9) {
        return Err(format!("{s} seconds is out of range: give a positive number"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Serves HTTP on the calling thread until SIGINT/SIGTERM or `engine_stopped` completes (the
/// engine behind `engine` ended on its own); then asks the engine to shut down and waits (within
/// the grace period) for open connections.
fn serve_http(
    args: &ServeArgs,
    state: AppState,
    engine: EngineHandle,
    model_name: &str,
    engine_stopped: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let grace = Duration::from_secs(args.shutdown_grace_secs);
    rt.block_on(async move {
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr).await.with_context(|| format!("cannot listen on {addr}"))?;
        let base = format!("http://{}", listener.local_addr().map_or(addr.clone(), |a| a.to_string()));
        eprintln!("specula serving {model_name} on {base} (OpenAI API under /v1)");
        eprintln!("  OpenAI chat/completions  {base}/v1  (OPENAI_BASE_URL)");
        eprintln!("  Anthropic Messages       {base}  (ANTHROPIC_BASE_URL, e.g. for Claude Code)");
        eprintln!("  OpenAI Responses         {base}/v1  (POST {base}/v1/responses; Agents SDK, Codex-style clients)");
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            tokio::select! {
                _ = wait_for_signal() => eprintln!("shutting down: no new connections; in-flight requests have {}s to finish", grace.as_secs()),
                _ = engine_stopped => eprintln!("shutting down: the engine stopped"),
            }
            engine.shutdown();
            let _ = stop_tx.send(true);
        });
        let mut stop_server = stop_rx.clone();
        let server = specula_server::serve(listener, state, async move {
            let _ = stop_server.wait_for(|s| *s).await;
        });
        // After the grace period the engine fails what is left, which ends those streams; the
        // margin only guards against a client that never reads its socket.
        let mut stop_timer = stop_rx;
        let hard_stop = async move {
            let _ = stop_timer.wait_for(|s| *s).await;
            tokio::time::sleep(grace + Duration::from_secs(5)).await;
        };
        tokio::select! {
            r = server => r.map_err(|e| anyhow::anyhow!("{e}"))?,
            _ = hard_stop => eprintln!("some connections did not close in time; exiting anyway"),
        }
        anyhow::Ok(())
    })
}

/// The engine threads behind the server: one engine, or a data-parallel group.
enum EngineJoin {
    Single(std::thread::JoinHandle<()>),
    Group(specula_engine::dp::DpGroup),
}

impl EngineJoin {
    /// Waits for the engine threads; an error when one of them panicked.
    fn join(self) -> Result<()> {
        match self {
            EngineJoin::Single(j) => {
                if j.join().is_err() {
                    anyhow::bail!("the engine thread panicked (see the log above); exiting");
                }
            }
            EngineJoin::Group(g) => {
                g.shutdown();
                for (rank, r) in g.join().into_iter().enumerate() {
                    if let Err(e) = r {
                        eprintln!("data-parallel rank {rank} ended with an error: {e}");
                    }
                }
            }
        }
        Ok(())
    }
}

/// Loads one model per rank (weights are memory-mapped, so ranks share the page cache) and
/// starts the group.
fn spawn_dp_group(
    args: &ServeArgs,
    n: usize,
    path: &std::path::Path,
    load_options: &specula_model::LoadOptions,
    first: specula_model::LlamaModel,
    tokenizer: Arc<specula_model::Tokenizer>,
    cfg: specula_engine::EngineConfig,
) -> Result<specula_engine::dp::DpGroup> {
    use specula_engine::dp::{spawn_lockstep, spawn_replicas, LocalGroup, RankSetup};
    if n == 0 {
        anyhow::bail!("--data-parallel-size must be at least 1");
    }
    let rank_cfg = specula_engine::dp::group::rank_config(&cfg, n);
    let mut ranks = Vec::with_capacity(n);
    let mut models = vec![first];
    for _ in 1..n {
        models.push(load_model_with(path, load_options)?.model);
    }
    for model in models {
        let spec = args.engine.spec.build(&model, &tokenizer, &rank_cfg)?;
        let mut r = RankSetup::new(model);
        if let Some((c, p)) = spec {
            r = r.with_speculation(c, p);
        }
        ranks.push(r);
    }
    let mode = DpMode::from(args.data_parallel_mode);
    args.engine.setup_expert_parallel(&mut ranks, mode == DpMode::Lockstep)?;
    eprintln!("data parallel: {n} {} ranks, {} compute thread(s) each", mode.as_str(), rank_cfg.threads);
    let group = match mode {
        DpMode::Lockstep => spawn_lockstep(ranks, LocalGroup::new(n), tokenizer, cfg)?,
        DpMode::Replica => spawn_replicas(ranks, tokenizer, cfg)?,
    };
    Ok(group)
}

async fn wait_for_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => {
                let _ = ctrl_c.await;
                return;
            }
        };
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    #[test]
    fn data_parallel_flags_take_the_same_spellings_as_before_and_refuse_others() {
        let parse = |a: &[&str]| {
            Cli::try_parse_from(std::iter::once("x").chain(a.iter().copied())).map(|c| (c.serve.data_parallel_mode, c.serve.data_parallel_backend))
        };
        assert_eq!(parse(&[]).unwrap(), (DataParallelMode::Replica, DataParallelBackend::Local));
        assert_eq!(parse(&["--data-parallel-mode", "lockstep"]).unwrap().0, DataParallelMode::Lockstep);
        assert_eq!(parse(&["--data-parallel-mode", "replica"]).unwrap().0, DataParallelMode::Replica);
        assert_eq!(parse(&["--data-parallel-backend", "mpi"]).unwrap().1, DataParallelBackend::Mpi);
        assert_eq!(parse(&["--data-parallel-backend", "local"]).unwrap().1, DataParallelBackend::Local);
        for bad in [["--data-parallel-mode", "pipeline"], ["--data-parallel-backend", "nccl"]] {
            let e = parse(&bad).expect_err("an unknown value is refused").to_string();
            assert!(e.contains("possible values"), "{e}");
        }
        assert_eq!(DpMode::from(DataParallelMode::Lockstep).as_str(), "lockstep");
        assert_eq!(DpMode::from(DataParallelMode::Replica).as_str(), "replica");
    }
}
