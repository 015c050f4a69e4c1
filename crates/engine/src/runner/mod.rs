//! Turns a step plan into model inputs and runs them: `prepare` builds the flat batch (token ids,
//! positions via spans, slot mapping, block tables, logits rows) from the plan and the KV
//! manager; `execute` runs the forward pass on the compute pool.

pub mod async_runner;
pub mod job;
mod prepare;

pub use async_runner::{AsyncRunner, AsyncRunnerError};
pub use prepare::{prepare, BatchInputs, RowRange};

use specula_model::{ForwardBatch, ForwardOutput, KvStore, LlamaModel, ModelError, SeqSpan};

/// Runs a prepared batch through the model on `pool`.
pub fn execute(model: &LlamaModel, kv: &mut KvStore, pool: &rayon::ThreadPool, inputs: &BatchInputs) -> Result<ForwardOutput, ModelError> {
    let spans: Vec<SeqSpan> = inputs
        .spans
        .iter()
        .zip(&inputs.block_tables)
        .map(|(r, t)| SeqSpan { q_start: r.q_start, q_len: r.q_len, context_len: r.context_len, block_table: t })
        .collect();
    let batch = ForwardBatch { tokens: &inputs.tokens, seqs: &spans, slots: &inputs.slots, logits_rows: &inputs.logits_rows, want_hidden: inputs.want_hidden };
    pool.install(|| model.forward(&batch, kv))
}
