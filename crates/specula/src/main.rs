//! The `specula` binary: clap CLI wiring the engine, server and benchmarks together.

mod baseline_tool;
mod bench;
mod debug;
mod engine_args;
mod fetch;
mod generate;
mod kv_fidelity;
mod offline;
mod offline_async;
mod offline_depth;
mod sampling_args;
mod serve;
mod shipped_head;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "specula",
    version,
    about = "Fast, lossless, observable speculative decoding; OpenAI-compatible serving",
    after_help = "Training an mtp draft head is the separate `specula-train-head` binary (crates/train-head)."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Put a known model in the cache (default: SmolLM2-135M-Instruct Q4_1); `--list` shows them.
    FetchModel {
        /// A known model's name (`--list`); the default model when left out.
        name: Option<String>,
        /// List the known models and whether each is cached.
        #[arg(long)]
        list: bool,
        /// Only print where the model is (or will be) cached.
        #[arg(long)]
        print_path: bool,
    },
    /// OpenAI-compatible HTTP server (default: the default model on 127.0.0.1:8000).
    Serve(serve::ServeArgs),
    /// Generate text for one prompt, streaming it to stdout.
    Generate(generate::GenerateArgs),
    /// Benchmarks: engine throughput without HTTP, or load against a server.
    #[command(subcommand)]
    Bench(BenchCmd),
    /// Machine-readable hooks for the test oracles.
    #[command(subcommand, hide = true)]
    Debug(debug::DebugCmd),
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Prefill and decode throughput of the engine, beside candle's quantized path.
    Offline(offline::OfflineArgs),
    /// Load against an OpenAI-compatible server (specula, llama-server, vLLM).
    Serve(bench::serve::BenchServeArgs),
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("SPECULA_LOG").unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        // colours only for a terminal: a log file or a journal gets plain text
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    if let Err(e) = run(Cli::parse()) {
        // one line, whatever the message carries (a file's keys and names can hold newlines)
        eprintln!("error: {}", format!("{e:#}").replace(['\n', '\r'], " "));
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::FetchModel { name, list, print_path } => fetch::run(name.as_deref(), list, print_path),
        Cmd::Debug(d) => debug::run(d),
        Cmd::Generate(a) => generate::run(a),
        Cmd::Bench(BenchCmd::Offline(a)) => offline::run(a),
        Cmd::Bench(BenchCmd::Serve(a)) => tokio::runtime::Runtime::new()?.block_on(bench::serve::run(a)),
        Cmd::Serve(a) => serve::run(a),
    }
}
