//! `specula train-head`: distil and train the mtp draft head for a target (docs/mtp-head-format.md).
//! `data` has the target answer a built-in prompt set and records what the head sees at inference;
//! `fit` trains the head on it with candle (CPU) and writes a head file per epoch; `quantize`
//! writes a head in its shipped form.

pub mod data;
pub mod fit;
pub mod prompts;
mod prompts_3;
pub mod quantize;
pub mod shard;
pub mod shipped;

use clap::Subcommand;

#[derive(Subcommand, Debug)]
pub enum TrainHeadCmd {
    /// Self-distillation data: the target's answers, hidden states and top tokens, as shards.
    Data(data::DataArgs),
    /// Train the head on those shards (candle, CPU); writes a head file per epoch.
    Fit(fit::FitArgs),
    /// Rewrite a head with its matrices as Q8_0 blocks (the shipped form; what serving runs).
    Quantize(quantize::QuantizeArgs),
}

pub fn run(cmd: TrainHeadCmd) -> anyhow::Result<()> {
    match cmd {
        TrainHeadCmd::Data(a) => data::run(a),
        TrainHeadCmd::Fit(a) => fit::run(a),
        TrainHeadCmd::Quantize(a) => quantize::run(a),
    }
}
