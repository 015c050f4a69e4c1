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
use super::rank::{RankMetrics, RankStats};
use crate::engine::Engine;
use crate::engine_loop::{Commands, Flow, LoopHook, Wait};
use crate::error::panic_message;
use crate::handle::EngineCommand;
use crate::step::StepPlan;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long an idle rank waits for a command before agreeing again. Bounds the extra latency a
/// request arriving at an idle group sees (the other ranks join within this time) and the idle
/// CPU (one tiny all-reduce per rank per period).
pub const IDLE_POLL: Duration = Duration::from_millis(10);

/// One rank of a lockstep group: its engine, its end of the communicator, its command channel.
/// It runs the engine loop (`engine_loop`) with [`Lockstep`] as the hook.
pub struct LockstepRank<C: Communicator> {
    engine: Engine,
    rx: Receiver<EngineCommand>,
    hook: Lockstep<C>,
}

/// What a lockstep rank does in the engine loop: each iteration one agreement with its peers,
/// then its share of the agreed step.
struct Lockstep<C: Communicator> {
    comm: C,
    stats: Arc<RankStats>,
    metrics: RankMetrics,
    /// Agreements made so far; the next agreement's `StepMetadata::step`.
    step: u64,
    /// A local error the group must stop for, voted at the next agreement.
    fatal: Option<String>,
    /// No rank had tokens at the last agreement: wait for commands before the next one.
    all_idle: bool,
    /// Expert-exchange time already added to the stats (the exchange keeps a running total).
    expert_nanos_seen: u64,
    /// How the group stopped, once it did.
    outcome: Option<Result<(), DpError>>,
}

impl<C: Communicator> LockstepRank<C> {
    pub fn new(engine: Engine, comm: C, rx: Receiver<EngineCommand>, stats: Arc<RankStats>) -> Self {
        let metrics = RankMetrics::new(comm.rank());
        let hook = Lockstep { comm, stats, metrics, step: 0, fatal: None, all_idle: true, expert_nanos_seen: 0, outcome: None };
        Self { engine, rx, hook }
    }

    /// Runs until the group agrees to stop (Ok) or the group fails (Err, on every rank). Either
    /// way every request this rank held has had its terminal event.
    pub fn run(self) -> Result<(), DpError> {
        let Self { engine, rx, mut hook } = self;
        engine.run_with(rx, &mut hook);
        hook.outcome.unwrap_or(Ok(()))
    }
}

impl<C: Communicator> LoopHook for Lockstep<C> {
    /// An idle group polls: a request may arrive at any rank, and the others must join the
    /// agreement that follows, so no rank sleeps longer than `IDLE_POLL`.
    fn wait(&self, _engine: &Engine, commands: &Commands) -> Wait {
        if self.all_idle && !commands.channel_closed {
            Wait::Until(IDLE_POLL)
        } else {
            Wait::No
        }
    }

    fn iterate(&mut self, engine: &mut Engine, commands: &mut Commands) -> Flow {
        if commands.grace_over() && engine.has_work() {
            engine.fail_all("the server is shutting down and the grace period for in-flight requests ended");
        }
        engine.reap_disconnected();
        let plan = engine.schedule_step();
        let local = StepMetadata {
            step: self.step,
            num_tokens: plan.total_tokens,
            has_prefill: plan.has_prefill(),
            has_spec: plan.seqs.iter().any(|s| s.num_drafts > 0),
            has_work: engine.has_work(),
            wants_shutdown: commands.is_stopping(),
            has_error: self.fatal.is_some(),
        };
        let started = Instant::now();
        let global = agree(&self.comm, &local);
        RankStats::add(&self.stats.collective_nanos, started.elapsed().as_nanos() as u64);
        RankStats::add(&self.stats.agreements, 1);
        let global = match global {
            Ok(g) => g,
            Err(e) => return self.stop(Err(e)),
        };
        self.step += 1;
        if global.error_ranks > 0 {
            let rank = self.comm.rank();
            return self.stop(Err(DpError::RankFailed(match &self.fatal {
                Some(msg) => format!("this rank ({rank}): {msg}"),
                None => format!("{} other rank(s) failed; see their logs", global.error_ranks),
            })));
        }
        if global.can_stop() {
            return self.stop(Ok(()));
        }
        if global.shutdown_requested() {
            commands.begin_shutdown(engine.config().shutdown_grace);
        }
        self.execute(engine, &plan, &global);
        let was_idle = self.all_idle;
        self.all_idle = global.all_idle();
        if !(was_idle && self.all_idle) {
            self.metrics.publish(engine, &self.stats);
        }
        Flow::Continue
    }

    /// Every request still held gets its terminal event: the group's error if it failed, else
    /// the shutdown.
    fn on_stop(&mut self, engine: &mut Engine) {
        let rank = self.comm.rank();
        match &self.outcome {
            Some(Err(e)) => {
                tracing::error!(rank, "data-parallel rank stopped: {e}");
                engine.fail_all(&format!("data-parallel rank {rank} stopped: {e}"));
            }
            _ => tracing::info!(rank, steps = self.step, "data-parallel rank stopped"),
        }
        engine.fail_all("the server is shutting down");
        self.metrics.publish(engine, &self.stats);
    }
}

impl<C: Communicator> Lockstep<C> {
    fn stop(&mut self, outcome: Result<(), DpError>) -> Flow {
        self.outcome = Some(outcome);
        Flow::Stop
    }

    /// Runs this rank's share of the agreed step.
    fn execute(&mut self, engine: &mut Engine, plan: &StepPlan, global: &GlobalStep) {
        if global.max_tokens > 0 {
            // An expert-parallel model pads its exchanges to the agreed size (dense layers need
            // no padding: only collectives inside the model care).
            expert::begin_step(engine.model(), global.max_tokens);
        }
        self.run_batch(engine, plan, global);
        if global.max_tokens > 0 {
            self.finish_expert_step(engine);
        }
    }

    /// After the step's forward pass: makes sure this rank joined every MoE exchange of the
    /// step, and counts the exchange time as collective time.
    fn finish_expert_step(&mut self, engine: &Engine) {
        if let Err(failure) = expert::finish_step(engine.model()) {
            tracing::error!(rank = self.comm.rank(), "{failure}");
            self.fatal.get_or_insert(failure.to_string());
        }
        if let Some(x) = engine.model().expert_exchange() {
            let total = x.exchange_nanos();
            let delta = total.saturating_sub(self.expert_nanos_seen);
            self.expert_nanos_seen = total;
            RankStats::add(&self.stats.collective_nanos, delta);
            // (also inside specula:dp_collective_seconds_total, which counts every collective)
            metrics::gauge!("specula:dp_expert_exchange_seconds_total", "rank" => self.comm.rank().to_string()).increment(delta as f64 * 1e-9);
        }
    }

    fn run_batch(&mut self, engine: &mut Engine, plan: &StepPlan, global: &GlobalStep) {
        if !plan.is_empty() {
            self.run_plan(engine, plan);
            RankStats::add(&self.stats.steps, 1);
            RankStats::add(&self.stats.tokens, plan.total_tokens as u64);
            RankStats::add(&self.stats.padding_tokens, (global.max_tokens - plan.total_tokens) as u64);
        } else if global.max_tokens > 0 {
            if let Err(msg) = engine.run_dummy_batch(global.max_tokens) {
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
    fn run_plan(&mut self, engine: &mut Engine, plan: &StepPlan) {
        let Err(panic) = catch_unwind(AssertUnwindSafe(|| engine.run_plan(plan))) else { return };
        let msg = panic_message(&panic);
        tracing::error!(rank = self.comm.rank(), "engine step panicked: {msg}");
        let msg = format!("internal error in engine step: {msg}");
        for s in &plan.seqs {
            engine.fail_request(s.seq, &msg);
        }
    }
}
