//! Lockstep data parallelism: every rank steps together, so collectives inside the model (an
//! expert-parallel MoE layer's all-to-all) always have every rank present. Each iteration of a
//! rank's loop:
//!
//! 1. take commands from its channel (sleeping up to `IDLE_POLL` first when the whole group was
//!    idle at the last agreement, so idle ranks cost ~0 CPU),
//! 2. schedule its own batch,
//! 3. agree with every other rank in exactly one collective (`metadata::agree`),
//! 4. run its batch, or a dummy batch of the agreed padded size when it has nothing scheduled but
//!    another rank does, or nothing when no rank has tokens.
//!
//! Shutdown and fatal errors travel in the same agreement, so every rank leaves the loop at the
//! same step and none is left in a collective; a rank whose thread dies makes its peers' next
//! collective fail (`DpError::PeerGone`) instead of hanging.

use super::communicator::{Communicator, DpError};
use super::expert;
use super::metadata::{agree, GlobalStep, StepMetadata};
use super::rank::{Commands, RankMetrics, RankStats};
use crate::engine::Engine;
use crate::error::panic_message;
use crate::handle::EngineCommand;
use crate::step::StepPlan;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long an idle rank waits for a command before agreeing again. Bounds the extra latency a
/// request arriving at an idle group sees (the other ranks join within this time) and the idle
/// CPU (one tiny all-reduce per rank per period).
pub const IDLE_POLL: Duration = Duration::from_millis(10);

/// One rank of a lockstep group: its engine, its end of the communicator, its command channel.
pub struct LockstepRank<C: Communicator> {
    engine: Engine,
    comm: C,
    rx: Receiver<EngineCommand>,
    stats: Arc<RankStats>,
    metrics: RankMetrics,
    commands: Commands,
    /// Agreements made so far; the next agreement's `StepMetadata::step`.
    step: u64,
    /// Every handle is gone: no command can come any more, so this rank votes to shut down.
    channel_closed: bool,
    /// A local error the group must stop for, voted at the next agreement.
    fatal: Option<String>,
    /// No rank had tokens at the last agreement: wait for commands before the next one.
    all_idle: bool,
    /// Expert-exchange time already added to the stats (the exchange keeps a running total).
    expert_nanos_seen: u64,
}

impl<C: Communicator> LockstepRank<C> {
    pub fn new(engine: Engine, comm: C, rx: Receiver<EngineCommand>, stats: Arc<RankStats>) -> Self {
        let metrics = RankMetrics::new(comm.rank());
        Self {
            engine,
            comm,
            rx,
            stats,
            metrics,
            commands: Commands::default(),
            step: 0,
            channel_closed: false,
            fatal: None,
            all_idle: true,
            expert_nanos_seen: 0,
        }
    }

    /// Runs until the group agrees to stop (Ok) or the group fails (Err, on every rank). Either
    /// way every request this rank held has had its terminal event.
    pub fn run(mut self) -> Result<(), DpError> {
        let rank = self.comm.rank();
        let result = self.run_loop();
        match &result {
            Ok(()) => tracing::info!(rank, steps = self.step, "data-parallel rank stopped"),
            Err(e) => {
                tracing::error!(rank, "data-parallel rank stopped: {e}");
                self.engine.fail_all(&format!("data-parallel rank {rank} stopped: {e}"));
            }
        }
        // requests that arrived after the last agreement
        while let Ok(cmd) = self.rx.try_recv() {
            self.commands.begin_shutdown(Duration::ZERO);
            self.commands.apply(&mut self.engine, cmd);
        }
        self.engine.fail_all("the server is shutting down");
        self.metrics.publish(&self.engine, &self.stats);
        result
    }

    fn run_loop(&mut self) -> Result<(), DpError> {
        loop {
            self.take_commands();
            if self.commands.grace_over() && self.engine.has_work() {
                self.engine.fail_all("the server is shutting down and the grace period for in-flight requests ended");
            }
            self.engine.reap_disconnected();
            let plan = self.schedule();
            let local = StepMetadata {
                step: self.step,
                num_tokens: plan.total_tokens,
                has_prefill: plan.has_prefill(),
                has_spec: plan.seqs.iter().any(|s| s.num_drafts > 0),
                has_work: self.engine.has_work(),
                wants_shutdown: self.commands.shutdown_at.is_some() || self.channel_closed,
                has_error: self.fatal.is_some(),
            };
            let started = Instant::now();
            let global = agree(&self.comm, &local);
            RankStats::add(&self.stats.collective_nanos, started.elapsed().as_nanos() as u64);
            RankStats::add(&self.stats.agreements, 1);
            let global = global?;
            self.step += 1;
            if global.error_ranks > 0 {
                let rank = self.comm.rank();
                return Err(DpError::RankFailed(match &self.fatal {
                    Some(msg) => format!("this rank ({rank}): {msg}"),
                    None => format!("{} other rank(s) failed; see their logs", global.error_ranks),
                }));
            }
            if global.can_stop() {
                return Ok(());
            }
            if global.shutdown_requested() {
                self.commands.begin_shutdown(self.engine.config().shutdown_grace);
            }
            self.execute(&plan, &global);
            let was_idle = self.all_idle;
            self.all_idle = global.all_idle();
            if !(was_idle && self.all_idle) {
                self.metrics.publish(&self.engine, &self.stats);
            }
        }
    }

    /// Drains the command channel; when the group was idle, first sleeps until a command comes
    /// or `IDLE_POLL` passes.
    fn take_commands(&mut self) {
        if self.all_idle && !self.channel_closed {
            match self.rx.recv_timeout(IDLE_POLL) {
                Ok(cmd) => self.commands.apply(&mut self.engine, cmd),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => self.channel_closed = true,
            }
        }
        loop {
            match self.rx.try_recv() {
                Ok(cmd) => self.commands.apply(&mut self.engine, cmd),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    self.channel_closed = true;
                    break;
                }
            }
        }
    }

    fn schedule(&mut self) -> StepPlan {
        self.engine.schedule_step()
    }

    /// Runs this rank's share of the agreed step.
    fn execute(&mut self, plan: &StepPlan, global: &GlobalStep) {
        if global.max_tokens > 0 {
            // An expert-parallel model pads its exchanges to the agreed size (dense layers need
            // no padding: only collectives inside the model care).
            expert::begin_step(self.engine.model(), global.max_tokens);
        }
        self.run_batch(plan, global);
        if global.max_tokens > 0 {
            self.finish_expert_step();
        }
    }

    /// After the step's forward pass: makes sure this rank joined every MoE exchange of the
    /// step, and counts the exchange time as collective time.
    fn finish_expert_step(&mut self) {
        if let Err(msg) = expert::finish_step(self.engine.model()) {
            tracing::error!(rank = self.comm.rank(), "{msg}");
            self.fatal.get_or_insert(msg);
        }
        if let Some(x) = self.engine.model().expert_exchange() {
            let total = x.exchange_nanos();
            let delta = total.saturating_sub(self.expert_nanos_seen);
            self.expert_nanos_seen = total;
            RankStats::add(&self.stats.collective_nanos, delta);
            // (also inside specula:dp_collective_seconds_total, which counts every collective)
            metrics::gauge!("specula:dp_expert_exchange_seconds_total", "rank" => self.comm.rank().to_string()).increment(delta as f64 * 1e-9);
        }
    }

    fn run_batch(&mut self, plan: &StepPlan, global: &GlobalStep) {
        if !plan.is_empty() {
            self.run_plan(plan);
            RankStats::add(&self.stats.steps, 1);
            RankStats::add(&self.stats.tokens, plan.total_tokens as u64);
            RankStats::add(&self.stats.padding_tokens, (global.max_tokens - plan.total_tokens) as u64);
        } else if global.max_tokens > 0 {
            if let Err(msg) = self.run_dummy(global.max_tokens) {
                tracing::error!(rank = self.comm.rank(), "dummy batch failed: {msg}");
                self.fatal = Some(format!("dummy batch failed: {msg}"));
            }
            RankStats::add(&self.stats.dummy_steps, 1);
            RankStats::add(&self.stats.padding_tokens, global.max_tokens as u64);
        } else {
            RankStats::add(&self.stats.idle_agreements, 1);
        }
    }

    /// This rank's real batch, with `Engine::step`'s isolation: a failure or panic fails the
    /// step's requests, not the rank.
    fn run_plan(&mut self, plan: &StepPlan) {
        let Err(panic) = catch_unwind(AssertUnwindSafe(|| self.engine.run_plan(plan))) else { return };
        let msg = panic_message(&panic);
        tracing::error!(rank = self.comm.rank(), "engine step panicked: {msg}");
        let msg = format!("internal error in engine step: {msg}");
        for s in &plan.seqs {
            self.engine.fail_request(s.seq, &msg);
        }
    }

    /// A dummy forward pass of `n` tokens (see `Engine::run_dummy_batch`).
    fn run_dummy(&mut self, n: usize) -> Result<(), String> {
        self.engine.run_dummy_batch(n)
    }
}
