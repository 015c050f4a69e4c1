//! Expert parallelism over a lockstep group: the model crate's `ExpertExchange` implemented on a
//! `Communicator`, and installing it on each rank's model (`--enable-expert-parallel`).
//!
//! Every step the lockstep loop tells the exchange the agreed padded row count
//! (`GlobalStep::max_tokens`) before the forward pass, so every rank's MoE all-gather and
//! all-to-all have equal sizes; afterwards it checks the forward pass made all of its exchanges
//! (or none, in which case it joins them with no rows) so a rank whose step failed early never
//! leaves its peers waiting. Not here: the routing math (specula_model::moe).

use super::communicator::{Communicator, DpError};
use super::local::{LocalComm, LocalGroup};
use super::rank::RankSetup;
use specula_model::{ExchangeError, ExpertExchange, LlamaModel};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// A communicator that can make its peers' collectives fail at once (a rank that cannot finish
/// the exchanges it started).
pub trait Abortable {
    fn abort_group(&self);
}

impl Abortable for LocalComm {
    fn abort_group(&self) {
        self.leave();
    }
}

impl<C: Communicator + Abortable> Abortable for super::counting::CountingComm<C> {
    fn abort_group(&self) {
        self.inner().abort_group();
    }
}

/// The MoE exchange of one rank over its own communicator (a group separate from, or the same
/// as, the step agreement's: collectives are ordered identically on every rank either way).
pub struct CommExchange<C> {
    comm: C,
    /// The step's agreed rows per rank (`begin_step`).
    rows: AtomicUsize,
    /// Exchanges since `begin_step`.
    calls: AtomicUsize,
    /// Total time spent in the exchanges (all steps), for the per-rank metrics.
    nanos: AtomicU64,
}

impl<C: Communicator> CommExchange<C> {
    pub fn new(comm: C) -> Self {
        Self { comm, rows: AtomicUsize::new(0), calls: AtomicUsize::new(0), nanos: AtomicU64::new(0) }
    }

    /// Nanoseconds spent in exchanges so far.
    pub fn nanos(&self) -> u64 {
        self.nanos.load(Ordering::Relaxed)
    }

    fn timed(&self, f: impl FnOnce() -> Result<(), DpError>) -> Result<(), ExchangeError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        let r = f();
        self.nanos.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r.map_err(|e| ExchangeError(e.to_string()))
    }
}

impl<C: Communicator + Abortable + Send + Sync> ExpertExchange for CommExchange<C> {
    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn size(&self) -> usize {
        self.comm.size()
    }
    fn begin_step(&self, rows: usize) {
        self.rows.store(rows, Ordering::Relaxed);
        self.calls.store(0, Ordering::Relaxed);
    }
    fn step_rows(&self) -> usize {
        self.rows.load(Ordering::Relaxed)
    }
    fn exchanges_this_step(&self) -> usize {
        self.calls.load(Ordering::Relaxed)
    }
    fn exchange_nanos(&self) -> u64 {
        self.nanos()
    }
    fn all_gather(&self, local: &[f32], out: &mut [f32]) -> Result<(), ExchangeError> {
        self.timed(|| self.comm.all_gather_f32(local, out))
    }
    fn all_to_all(&self, send: &[f32], recv: &mut [f32]) -> Result<(), ExchangeError> {
        self.timed(|| self.comm.all_to_all_f32(send, recv))
    }
    fn abort(&self) {
        self.comm.abort_group();
    }
}

/// Spreads the experts of in-process ranks' models over the group (rank r at index r), with a
/// dedicated in-process group for the exchanges. Fails before anything runs when the model is
/// dense or the rank count does not divide the expert count.
/// Use before `spawn_lockstep(ranks, ..)`.
pub fn enable_local_expert_parallel(ranks: &mut [RankSetup]) -> Result<(), DpError> {
    let comms = LocalGroup::new(ranks.len());
    for (r, c) in ranks.iter_mut().zip(comms) {
        r.model.enable_expert_parallel(Arc::new(CommExchange::new(c))).map_err(|e| DpError::Config(e.to_string()))?;
    }
    Ok(())
}

/// Before a lockstep step's forward pass: the agreed padded row count, for an expert-parallel
/// model (no-op otherwise).
pub(crate) fn begin_step(model: &LlamaModel, rows: usize) {
    if let Some(x) = model.expert_exchange() {
        x.begin_step(rows);
    }
}

/// After the rank's forward pass (or its failure): joins the step's exchanges with no rows if
/// the pass never reached them. A pass that stopped half-way leaves the group unable to agree
/// on the exchanges: that is fatal for the whole group (Err, and the peers' exchanges fail).
pub(crate) fn finish_step(model: &LlamaModel) -> Result<(), crate::error::StepFailure> {
    let Some(x) = model.expert_exchange() else { return Ok(()) };
    let (done, expected) = (x.exchanges_this_step(), model.exchanges_per_forward());
    if done == expected {
        return Ok(());
    }
    if done == 0 {
        return model
            .join_expert_exchanges_idle()
            .map_err(|e| crate::error::StepFailure::Collective(format!("joining the expert exchanges of a failed step: {e}")));
    }
    x.abort();
    Err(crate::error::StepFailure::Collective(format!("the forward pass made {done} of its {expected} expert-parallel exchanges; the group cannot continue")))
}
