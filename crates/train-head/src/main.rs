//! `specula-train-head`: distils and trains the mtp draft head for a target
//! (docs/mtp-head-format.md). `data` has the target answer a built-in prompt set and records what
//! the head sees at inference; `fit` trains the head on it with candle (CPU) and writes a head
//! file per epoch; `quantize` writes a head in its shipped form. A tool of its own, so the serving
//! binary `specula` compiles no training code (candle-nn); it only loads the heads written here.

mod data;
mod fit;
mod prompts;
mod quantize;
mod shard;

use anyhow::{bail, Result};
use clap::{Parser, Subcommand};
use std::path::Path;

#[derive(Parser)]
#[command(name = "specula-train-head", version, about = "Distil, train and pack the mtp draft head of a target model")]
struct Cli {
    #[command(subcommand)]
    cmd: TrainHeadCmd,
}

#[derive(Subcommand, Debug)]
enum TrainHeadCmd {
    /// Self-distillation data: the target's answers, hidden states and top tokens, as shards.
    Data(data::DataArgs),
    /// Train the head on those shards (candle, CPU); writes a head file per epoch.
    Fit(fit::FitArgs),
    /// Rewrite a head with its matrices as Q8_0 blocks (the shipped form; what serving runs).
    Quantize(quantize::QuantizeArgs),
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("SPECULA_LOG").unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let result = match Cli::parse().cmd {
        TrainHeadCmd::Data(a) => data::run(a),
        TrainHeadCmd::Fit(a) => fit::run(a),
        TrainHeadCmd::Quantize(a) => quantize::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// The target model `--model` (or `SPECULA_MODEL`) names, which must exist: the trainer fetches
/// nothing (`specula fetch-model --print-path` fetches the default model and prints its path).
fn target_model(path: &Path) -> Result<&Path> {
    if !path.exists() {
        bail!("model {} does not exist (`specula fetch-model --print-path` fetches the default model and prints its path)", path.display());
    }
    Ok(path)
}
