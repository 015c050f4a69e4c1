//! The compute side of a step: `execute` runs the flat batch's forward pass on the compute pool,
//! `job` is one step's compute (forward, sampling, proposals). What builds the batch is
//! `crate::batch` (between host and compute); the worker the host work runs on with async
//! scheduling is `crate::host::worker`.

pub mod job;

pub use crate::step::{BatchInputs, RowRange};

use crate::kv_cache::transfer::{KvTransfers, SavedBlock, StateSave, TransfersDone};
use specula_model::kv_store::BlockBytesError;
use specula_model::{ForwardBatch, ForwardOutput, KvStore, LlamaModel, ModelError, SeqSpan};

/// Does a step's KV block copies (`crate::kv_cache::transfer`): every save, then every load,
/// then the recurrent-state restores (a hybrid's prefix-cache hits). The state saves come after
/// the forward pass: [`run_state_saves`].
pub(crate) fn run_transfers(kv: &mut KvStore, t: KvTransfers) -> Result<TransfersDone, ModelError> {
    if t.is_empty() {
        return Ok(TransfersDone::default());
    }
    let restores = t.state_restores;
    let saved = t
        .saves
        .into_iter()
        .map(|s| {
            let mut bytes = Vec::new();
            kv.copy_block_out(s.block.0 as usize, &mut bytes);
            SavedBlock { key: s.key, to: s.to, bytes }
        })
        .collect();
    let mut loaded = Vec::with_capacity(t.loads.len());
    for l in t.loads {
        kv.copy_block_in(l.at.block.0 as usize, &l.bytes).map_err(|e: BlockBytesError| ModelError::BadInput(e.to_string()))?;
        loaded.push(l.at);
    }
    for r in restores {
        recurrent(kv)?.restore_checkpoint(r.checkpoint as usize, r.slot as usize, r.position)?;
    }
    Ok(TransfersDone { saved, loaded, states_saved: Vec::new() })
}

/// A hybrid's recurrent-state checkpoints of this step, after its forward pass.
pub(crate) fn run_state_saves(kv: &mut KvStore, saves: Vec<StateSave>) -> Result<Vec<StateSave>, ModelError> {
    for s in &saves {
        recurrent(kv)?.save_checkpoint(s.slot as usize, s.checkpoint as usize, s.position)?;
    }
    Ok(saves)
}

fn recurrent(kv: &mut KvStore) -> Result<&mut specula_model::delta_net::RecurrentStore, ModelError> {
    kv.recurrent.as_mut().ok_or_else(|| ModelError::BadInput("a recurrent-state checkpoint for a model without recurrent state".into()))
}

/// Runs a prepared batch through the model on `pool`. `while_running` runs on the calling thread
/// once the forward pass has been handed to the pool: async scheduling hands the host work to its
/// worker there, so the cost of waking that thread is not paid between two forward passes.
pub fn execute(
    model: &LlamaModel,
    kv: &mut KvStore,
    pool: &rayon::ThreadPool,
    inputs: &BatchInputs,
    while_running: impl FnOnce(),
) -> Result<ForwardOutput, ModelError> {
    let spans: Vec<SeqSpan> = inputs
        .spans
        .iter()
        .zip(&inputs.block_tables)
        .map(|(r, t)| SeqSpan { q_start: r.q_start, q_len: r.q_len, context_len: r.context_len, block_table: t })
        .collect();
    let batch = ForwardBatch {
        tokens: &inputs.tokens,
        seqs: &spans,
        slots: &inputs.slots,
        logits_rows: &inputs.logits_rows,
        hidden_layers: &inputs.hidden_layers,
        state_slots: &inputs.state_slots,
    };
    let mut out = None;
    // a panic in the forward pass comes out of the scope, after `while_running` has run
    pool.in_place_scope(|s| {
        s.spawn(|_| out = Some(model.forward(&batch, kv)));
        while_running();
    });
    out.expect("the scope waits for the forward pass it spawned")
}
