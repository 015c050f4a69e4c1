//! `specula serve`: the OpenAI-compatible server over one engine. SIGINT/SIGTERM stop accepting
//! connections, give in-flight requests a bounded grace period, then abort what is left with a
//! clear error and exit 0.

use crate::engine_args::EngineArgs;
use anyhow::{Context, Result};
use clap::Args;
use specula_engine::spawn_engine;
use specula_model::load_model;
use specula_server::{AppState, ServerConfig};
use std::sync::Arc;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer <key>` on /v1/* routes.
    #[arg(long, env = "SPECULA_API_KEY")]
    pub api_key: Option<String>,
    /// Name clients use in `model` (default: the model file's name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Largest logprobs / top_logprobs a request may ask for.
    #[arg(long, default_value_t = 20)]
    pub max_logprobs: usize,
    /// Seconds in-flight requests get to finish after SIGINT/SIGTERM.
    #[arg(long, default_value_t = 10)]
    pub shutdown_grace_secs: u64,
}

pub fn run(args: ServeArgs) -> Result<()> {
    let path = crate::fetch::resolve_model(&args.engine.model)?;
    let loaded = load_model(&path)?;
    let mut cfg = args.engine.to_config(&loaded.model.config)?;
    cfg.shutdown_grace = Duration::from_secs(args.shutdown_grace_secs);
    let mut server_cfg = ServerConfig::new(args.served_model_name.clone().unwrap_or_else(|| loaded.name.clone()));
    server_cfg.max_model_len = cfg.max_model_len;
    server_cfg.max_logprobs = args.max_logprobs;
    server_cfg.api_key = args.api_key.clone();
    // the metrics recorder must exist before the engine records anything
    let _ = specula_server::metrics::prometheus_handle();
    let tokenizer = Arc::new(loaded.tokenizer);
    let chat = loaded.chat_template.map(Arc::new);
    let spec = args.engine.spec.build(&loaded.model, &cfg)?;
    let (engine, join) = spawn_engine(loaded.model, tokenizer.clone(), cfg, spec)?;
    let state = AppState::new(engine.clone(), tokenizer, chat, server_cfg);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let grace = Duration::from_secs(args.shutdown_grace_secs);
    let engine_in_rt = engine.clone();
    rt.block_on(async move {
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr).await.with_context(|| format!("cannot listen on {addr}"))?;
        eprintln!("specula serving {} on http://{addr} (OpenAI API under /v1)", loaded.name);
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            wait_for_signal().await;
            eprintln!("shutting down: no new connections; in-flight requests have {}s to finish", grace.as_secs());
            engine_in_rt.shutdown();
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
    })?;
    engine.shutdown();
    drop(engine);
    let _ = join.join();
    Ok(())
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
