//! The engine: the model, the KV tensors, the sampler and the proposer (compute state) on one
//! thread, and the host state (`host::Host`: requests, scheduler, KV block manager) beside them.
//! Each call to [`Engine::step`] runs one forward pass through the step of docs/architecture.md ("One step") —
//! schedule -> prepare -> execute -> sample -> update.
//!
//! Synchronously, the host work runs inline around the compute. With `async_scheduling`, while
//! step N computes on this thread, the host moves into a job on the [`AsyncRunner`] that applies
//! and streams step N-1 and schedules and prepares step N+1; when N is done this thread takes the
//! host back, finalizes N+1 from N's output (`batch::finalize`: the tokens N sampled, how many of
//! its drafts it accepted, the drafts it proposed, the sequences that ended) and starts N+1's
//! forward pass. Between two forward passes there is no thread hand-off to wait for, only that
//! settling (see `step_async`).

use crate::api::GenerateRequest;
use crate::batch::finalize;
use crate::config::EngineConfig;
use crate::error::{panic_message, StepFailure};
use crate::handle::{EngineHandle, QueueCounters};
use crate::host::worker::{AsyncRunner, AsyncRunnerError};
use crate::host::{record_timings, Host, HostDone};
use crate::runner::job::{run_job, ComputeState, JobContext};
use crate::sampling::Sampler;
use crate::speculative::cost::CostModel;
use crate::speculative::{Proposer, SpecConfig, SpecMetrics, Speculation};
use crate::step::{Computed, JobTimings, PreparedStep, StepJob, StepPlan};
use crate::types::{RequestId, SeqId};
use specula_kernels::attention::KvLayout;
use specula_model::llama::NO_SLOT;
use specula_model::{ForwardBatch, KvStore, LlamaModel, SeqSpan, Tokenizer};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

pub use crate::error::EngineError;
pub use crate::step::{StepStats, StepTimings};

pub struct Engine {
    pub(crate) cfg: EngineConfig,
    pub(crate) ctx: JobContext,
    pub(crate) compute: ComputeState,
    counters: Arc<QueueCounters>,
    /// Home between calls; inside the host job while a forward pass runs (async).
    host: Option<Host>,
    /// The host job's worker, when `async_scheduling` is on.
    runner: Option<AsyncRunner<HostDone>>,
    /// The next step, prepared during the last forward pass (async).
    prepared: Option<PreparedStep>,
    /// The last step computed and not yet applied (async: the next host job applies it).
    computed: Option<Computed>,
    /// The last compute job's timings while steps follow each other (the gaps before the next
    /// forward pass are measured from it); `None` after the engine went idle.
    last_job: Option<JobTimings>,
    /// Timings of the last step, recorded as metrics by the next host job (async).
    unrecorded: Option<StepTimings>,
    /// Steps scheduled and prepared on the async runner while a forward pass ran.
    steps_prepared_ahead: u64,
}

impl Engine {
    /// A guard that marks this engine stopped in its handle's counters when dropped (also while a
    /// panic unwinds): the thread that runs the engine holds it for its whole life, so that
    /// `EngineHandle::is_running` (and `/health`) sees the thread end however it ends.
    pub(crate) fn stopped_guard(&self) -> crate::handle::StoppedOnDrop {
        crate::handle::StoppedOnDrop(self.counters.clone())
    }

    pub fn new(mut model: LlamaModel, tokenizer: Arc<Tokenizer>, cfg: EngineConfig, counters: Arc<QueueCounters>) -> Result<Self, EngineError> {
        cfg.validate(model.config.context_length).map_err(EngineError::Config)?;
        model.fit_context(cfg.max_model_len);
        let c = &model.config;
        let layout = KvLayout { block_size: cfg.block_size, n_heads: c.n_heads, n_kv_heads: c.n_kv_heads, head_dim: c.head_dim };
        // a hybrid's state slots: one per sequence, and one more for a lockstep rank's dummy
        // batches (`run_dummy_batch`)
        let state_slots = cfg.max_num_seqs + usize::from(c.arch_options.recurrent.is_some());
        let kv_store = KvStore::for_model(c, layout, cfg.num_kv_blocks, cfg.kv_cache_dtype, state_slots)?;
        let mut host = Host::new(cfg.clone(), tokenizer.clone(), counters.clone(), c.vocab_size)?;
        // a hybrid's recurrent state goes with each running sequence (rolled back by the model
        // past rejected drafts); its cached prefixes are used with checkpoints of that state, and
        // the prefix cache's tiers (set below) are not taken
        if let Some(r) = &c.arch_options.recurrent {
            host.kv.set_state_slots(cfg.max_num_seqs, cfg.state_checkpoints);
            let prefix = match host.kv.state_checkpoints() {
                Some((_, n)) => {
                    format!("prefix caching with up to {n} state checkpoints of {:.1} MB (--state-checkpoints)", r.bytes_per_sequence() as f64 / 1e6)
                }
                None => "prefix caching is off for this model".into(),
            };
            tracing::info!(
                recurrent_layers = r.count(),
                state_mb_per_sequence = r.bytes_per_sequence() as f64 / 1e6,
                state_mb = (r.bytes_per_sequence() * cfg.max_num_seqs) as f64 / 1e6,
                "recurrent state for {} sequences; {prefix}",
                cfg.max_num_seqs
            );
        }
        let shape = format!("{} block {} layers {} kv heads {} head dim {}", cfg.kv_cache_dtype, cfg.block_size, c.n_layers, c.n_kv_heads, c.head_dim);
        let namespace = cfg.prefix_tiers.disk.as_ref().map_or(0, |d| crate::kv_cache::disk_tier::namespace(d.model_key, &shape));
        let tiers = crate::kv_cache::PrefixTiers::open(&cfg.prefix_tiers, namespace, kv_store.block_bytes()).map_err(|e| {
            EngineError::Config(format!("--prefix-cache-dir {}: {e}", cfg.prefix_tiers.disk.as_ref().map_or_else(String::new, |d| d.dir.display().to_string())))
        })?;
        host.kv.set_tiers(tiers);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(cfg.threads)
            .thread_name(|i| format!("specula-compute-{i}"))
            .build()
            .map_err(|e| EngineError::ThreadPool(e.to_string()))?;
        let runner = if cfg.async_scheduling { Some(host_runner()?) } else { None };
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        if cfg.async_scheduling && cfg.threads >= cores {
            tracing::warn!(
                "--async-scheduling with {} compute threads on {cores} cores: the host worker has no core of its own and preempts a compute thread every step, which can cost more than it saves; leave a core free (--threads {})",
                cfg.threads,
                cores.saturating_sub(1).max(1)
            );
        }
        tracing::info!(
            kv_tokens = cfg.num_kv_blocks * cfg.block_size,
            kv_mb = c.kv_bytes_per_token(cfg.kv_cache_dtype) * cfg.num_kv_blocks * cfg.block_size / 1_000_000,
            kv_dtype = %cfg.kv_cache_dtype,
            max_model_len = cfg.max_model_len,
            threads = cfg.threads,
            async_scheduling = cfg.async_scheduling,
            "{}",
            specula_kernels::cpu::describe()
        );
        let ctx = JobContext {
            model: Arc::new(model),
            tokenizer,
            pool: Arc::new(pool),
            max_model_len: cfg.max_model_len,
            fault: cfg.fault_injection,
            jump_forward: cfg.jump_forward,
            queue: counters.clone(),
            max_num_seqs: cfg.max_num_seqs,
        };
        Ok(Self {
            cfg,
            ctx,
            compute: ComputeState { kv_store, sampler: Sampler::new(), spec: None, records: Default::default() },
            counters,
            host: Some(host),
            runner,
            prepared: None,
            computed: None,
            last_job: None,
            unrecorded: None,
            steps_prepared_ahead: 0,
        })
    }

    /// Turns on speculative decoding with `proposer`, its cost model measured now (or given by
    /// `cfg`'s figures).
    pub fn with_speculation(self, cfg: SpecConfig, proposer: Box<dyn Proposer>) -> Result<Self, EngineError> {
        self.with_speculation_cost(cfg, proposer, None)
    }

    /// Drafts a sequence may get per step (0 without speculation): the reservation of a decode
    /// scheduled ahead. Read from the live speculation state, so it is 0 once speculation is gone
    /// (after a lost worker) and never a stale copy.
    fn spec_k(&self) -> usize {
        self.compute.spec.as_ref().map_or(0, |sp| sp.cfg.num_speculative_tokens)
    }

    /// [`Self::with_speculation`] with the cost model another engine of the same model, proposer
    /// and thread count measured (a data-parallel group measures once, on its first rank).
    pub fn with_speculation_cost(mut self, cfg: SpecConfig, proposer: Box<dyn Proposer>, cost: Option<CostModel>) -> Result<Self, EngineError> {
        cfg.validate().map_err(EngineError::Config)?;
        let mut proposer = proposer;
        let cost = match cost {
            Some(c) => {
                c.publish();
                c
            }
            None => crate::speculative::cost_model(&cfg, proposer.as_mut(), &self.ctx.model, self.cfg.kv_cache_dtype, &self.ctx.pool)
                .map_err(|e| EngineError::Config(format!("speculation cost model: {e}")))?,
        };
        self.compute.spec = Some(Speculation::new(cfg, proposer, cost));
        Ok(self)
    }

    /// The speculation cost model in use, when speculating.
    pub fn spec_cost(&self) -> Option<&CostModel> {
        self.compute.spec.as_ref().map(|s| &s.cost)
    }

    /// Acceptance counters, when speculating.
    pub fn spec_metrics(&self) -> Option<&SpecMetrics> {
        self.compute.spec.as_ref().map(|s| &s.metrics)
    }

    /// Sequences the compute side keeps a record of (`crate::record`): the live ones, for leak
    /// checks (0 once idle).
    pub fn num_seq_records(&self) -> usize {
        self.compute.records.len()
    }

    /// (free, total) blocks of the proposer's own KV cache, if it has one.
    pub fn draft_kv_blocks(&self) -> Option<(usize, usize)> {
        self.compute.spec.as_ref().and_then(|s| s.proposer.kv_blocks())
    }

    /// Steps whose scheduling and preparation ran on the async runner beside a forward pass (0
    /// with synchronous scheduling): what shows async scheduling really overlapped.
    pub fn num_steps_prepared_ahead(&self) -> u64 {
        self.steps_prepared_ahead
    }

    /// Turns async scheduling on or off while the engine is idle (nothing queued, running,
    /// prepared or computed), so a benchmark can compare both modes on one loaded model, with the
    /// same weights and KV memory. Refused with work in flight: a prepared step cannot be
    /// unscheduled.
    pub fn set_async_scheduling(&mut self, on: bool) -> Result<(), EngineError> {
        if self.has_work() {
            return Err(EngineError::Config("async scheduling can be switched only while the engine is idle".into()));
        }
        if on && self.runner.is_none() {
            self.runner = Some(host_runner()?);
        } else if !on {
            self.runner = None;
        }
        self.cfg.async_scheduling = on;
        self.last_job = None;
        Ok(())
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    pub(crate) fn model(&self) -> &LlamaModel {
        &self.ctx.model
    }

    /// The host state; always home between calls.
    pub(crate) fn host(&self) -> &Host {
        self.host.as_ref().expect("the host state is home between engine calls")
    }

    /// The host, borrowed for a change; when the borrow ends, the compute side forgets the
    /// sequences the change removed ([`HostMut`]).
    pub(crate) fn host_mut(&mut self) -> HostMut<'_> {
        HostMut { host: self.host.as_mut().expect("the host state is home between engine calls"), compute: &mut self.compute }
    }

    /// Takes the host out of its slot (to move it into the async host job).
    fn take_host(&mut self) -> Host {
        self.host.take().expect("the host state is home between engine calls")
    }

    /// Puts the host back in its slot; the compute side forgets what the host removed while away.
    fn put_host(&mut self, mut host: Host) {
        sync_compute(&mut host, &mut self.compute);
        self.host = Some(host);
    }

    /// Whether a step could do something: requests queued or running, or a step computed or
    /// prepared and not yet applied.
    pub fn has_work(&self) -> bool {
        self.host().scheduler.has_work() || self.prepared.is_some() || self.computed.is_some()
    }
    pub fn num_free_blocks(&self) -> usize {
        self.host().kv.num_free_blocks()
    }
    pub fn num_total_blocks(&self) -> usize {
        self.host().kv.num_total_blocks()
    }

    /// Accepts a request, or fails it at once with a clear message.
    pub fn add_request(&mut self, req: GenerateRequest) {
        self.host_mut().add_request(req);
    }

    /// Cancels a request wherever it is; its blocks go back at once. A step that computes it
    /// anyway (prepared or computed already) has its result for it dropped.
    pub fn abort(&mut self, id: RequestId) {
        self.host_mut().abort(id);
    }

    /// Fails every live request with `message` (shutdown, fatal errors).
    pub fn fail_all(&mut self, message: &str) {
        self.host_mut().fail_all(message);
    }

    /// Settles what the pipeline still holds (async): the computed step is applied, the prepared
    /// one dropped. After `fail_all`, or at shutdown, nothing of theirs reaches a client.
    pub fn discard_in_flight(&mut self) {
        self.prepared = None;
        if let Some(done) = self.computed.take() {
            self.host_mut().complete(done, None);
        }
    }

    /// One engine step (synchronous or async by configuration): at most one forward pass.
    /// Failures are reported to the affected requests.
    pub fn step(&mut self) -> StepStats {
        let stats = if self.runner.is_some() { self.step_async() } else { self.step_sync() };
        if stats.ran_forward {
            if self.runner.is_some() {
                self.unrecorded = Some(stats.timings.clone());
            } else {
                record_timings(&stats.timings);
            }
        }
        if self.runner.is_none() || !self.has_work() {
            self.flush_metrics();
        }
        stats
    }

    fn step_sync(&mut self) -> StepStats {
        let _span = tracing::debug_span!("step").entered();
        let mut stats = StepStats::default();
        let mut host = self.host_mut();
        host.reap_disconnected();
        debug_assert!(
            host.seqs.values().all(|s| s.num_scheduled == s.num_computed && s.num_placeholders() == 0),
            "synchronously nothing is in flight between steps (docs/architecture.md, counters)"
        );
        let t = Instant::now();
        let plan = host.schedule(0);
        stats.timings.schedule = t.elapsed();
        let t = Instant::now();
        let prepared = host.prepare(plan);
        stats.timings.prepare = t.elapsed();
        drop(host);
        match prepared {
            Some(p) => stats.num_emitted = self.run_prepared(p, &mut stats),
            None => self.idle(),
        }
        stats
    }

    /// Settles, computes and applies a prepared step on this thread (synchronous scheduling).
    /// Returns the tokens streamed.
    fn run_prepared(&mut self, p: PreparedStep, stats: &mut StepStats) -> usize {
        let (plan, job) = self.finalize(p, stats);
        if plan.is_empty() {
            return 0;
        }
        let done = compute(&self.ctx, &mut self.compute, &mut self.last_job, plan, job, stats, || {});
        let t = Instant::now();
        let emitted = self.host_mut().complete(done, None);
        stats.timings.update = t.elapsed();
        emitted
    }

    /// Runs a scheduled plan to the end: prepare, compute, update. The data-parallel lockstep
    /// loop calls this between its agreement and the next step; failures are reported to the
    /// plan's requests. Returns the tokens streamed.
    pub(crate) fn run_plan(&mut self, plan: &StepPlan) -> usize {
        let mut stats = StepStats::default();
        let prepared = self.host_mut().prepare(plan.clone());
        prepared.map_or(0, |p| self.run_prepared(p, &mut stats))
    }

    /// Async scheduling, one forward pass per call (see the module docs). It reads like the plain
    /// step, with the host work of two steps beside the forward pass:
    /// 1. take the next step: the one prepared during the last forward pass, finalized from that
    ///    pass's output (or, if there is none or nothing of it is left, schedule one now);
    /// 2. launch its forward pass, sampling and proposals here, the host job beside it on the
    ///    worker (process the previous step's result: apply and stream it; schedule and prepare
    ///    the step after this one);
    /// 3. take the host back with that step prepared, and keep this step's result for the next call.
    fn step_async(&mut self) -> StepStats {
        let _span = tracing::debug_span!("step_async").entered();
        let mut stats = StepStats::default();
        let Some((plan, job)) = self.next_async_step(&mut stats) else {
            self.idle();
            return stats;
        };
        let (computed, back) = self.launch_beside_host_job(plan, job, &mut stats);
        match back {
            Ok((done, overlapped)) => {
                if overlapped && done.prepared.is_some() {
                    self.steps_prepared_ahead += 1;
                }
                self.put_host(done.host);
                self.prepared = done.prepared;
                stats.add_host_work(done.work);
                self.computed = Some(computed);
            }
            Err(e) => self.host_lost(&e),
        }
        stats
    }

    /// The step to launch next (async): the one prepared during the last forward pass, with the
    /// requests that arrived since admitted and finalized from that pass's output; if there is none,
    /// or nothing of it is left, the last step is applied here and a step scheduled and prepared now.
    fn next_async_step(&mut self, stats: &mut StepStats) -> Option<(StepPlan, StepJob)> {
        if let Some(next) = self.prepared.take().and_then(|p| self.admit_and_finalize(p, stats)) {
            return Some(next);
        }
        let host = self.take_host();
        let done = host.work(self.computed.take(), None, self.spec_k(), self.unrecorded.take());
        self.put_host(done.host);
        stats.add_host_work(done.work);
        done.prepared.and_then(|p| self.admit_and_finalize(p, stats))
    }

    /// Admits late arrivals into a prepared step and finalizes it; `None` if nothing of it is left.
    fn admit_and_finalize(&mut self, mut p: PreparedStep, stats: &mut StepStats) -> Option<(StepPlan, StepJob)> {
        self.host_mut().admit_late(&mut p);
        let (plan, job) = self.finalize(p, stats);
        (!plan.is_empty()).then_some((plan, job))
    }

    /// Runs a step's compute job here with the host job beside it: the host goes to the worker
    /// once the forward pass is under way (waking the worker then costs the forward pass nothing);
    /// if the job fails before that, the host work runs here after it. Returns the step's result
    /// and the host job's (with whether it really overlapped the forward pass), or why the worker
    /// lost the host.
    fn launch_beside_host_job(&mut self, plan: StepPlan, job: StepJob, stats: &mut StepStats) -> (Computed, Result<(HostDone, bool), AsyncRunnerError>) {
        let host = self.take_host();
        let mut handoff = Some((host, self.computed.take(), plan.clone(), self.unrecorded.take()));
        let mut submitted = None;
        let (step, spec_k) = (job.step, self.spec_k());
        let runner = self.runner.as_mut().expect("async engine has a runner");
        let computed = compute(&self.ctx, &mut self.compute, &mut self.last_job, plan, job, stats, || {
            if let Some((host, done, running, record)) = handoff.take() {
                submitted = Some(runner.submit(step, move || Ok(host.work(done, Some(&running), spec_k, record))));
            }
        });
        let back = match submitted {
            Some(Ok(())) => runner.sync().map(|done| (done, true)),
            Some(Err(e)) => Err(e),
            None => {
                let (host, done, running, record) = handoff.take().expect("the host was not handed off");
                Ok((host.work(done, Some(&running), spec_k, record), false))
            }
        };
        (computed, back)
    }

    /// Settles a prepared step from the step computed before it, if that has not been applied.
    fn finalize(&mut self, p: PreparedStep, stats: &mut StepStats) -> (StepPlan, StepJob) {
        let t = Instant::now();
        let host = self.host.as_ref().expect("the host state is home between engine calls");
        let finalized = finalize(p, self.computed.as_ref(), |id| host.seqs.contains_key(&id), self.cfg.block_size);
        stats.timings.finalize += t.elapsed();
        finalized
    }

    /// No step follows at once: the next forward pass starts no gap. Block copies the prefix
    /// cache's tiers decided since the last step (the saves of the blocks the last step registered)
    /// are done now rather than at the next step, which may never come.
    pub(crate) fn idle(&mut self) {
        self.last_job = None;
        let Some(host) = self.host.as_mut() else { return };
        let transfers = host.kv.take_transfers();
        if transfers.is_empty() {
            return;
        }
        match crate::runner::run_transfers(&mut self.compute.kv_store, transfers) {
            Ok(done) => host.kv.finish_transfers(done),
            Err(e) => tracing::error!("prefix cache block copies failed: {e}"),
        }
    }

    /// Prefix-cache counters since start-up (hits from the KV store and from its tiers).
    pub fn prefix_cache_stats(&self) -> crate::kv_cache::PrefixCacheStats {
        self.host().kv.prefix_cache_stats()
    }

    /// Records pending step timings and publishes the gauges (what the host job does while steps
    /// follow each other).
    pub(crate) fn flush_metrics(&mut self) {
        if let Some(t) = self.unrecorded.take() {
            record_timings(&t);
        }
        self.host().export_gauges();
    }

    /// The async worker died outside the host job's own panic guard and took the host state with
    /// it (never expected: the job catches its panics). Its requests' streams are gone with it
    /// (their clients see the stream end without a result); the engine starts over with an empty
    /// host on fresh KV, and without speculation (the proposer's per-sequence state is stale).
    fn host_lost(&mut self, msg: &AsyncRunnerError) {
        tracing::error!("the async step runner failed and lost every request in flight: {msg}");
        // the old runner's Drop joins its dead worker
        self.runner = host_runner().ok();
        if self.runner.is_none() {
            tracing::error!("cannot restart the async step runner; continuing with synchronous scheduling");
        }
        self.prepared = None;
        self.computed = None;
        self.last_job = None;
        self.compute.spec = None;
        // the new host numbers its sequences from 1 again
        self.compute.records.clear();
        // the lost host's waiting requests are gone: give their slots back, or the queue would
        // stay that much fuller for ever (requests still in the channel keep theirs)
        let lost = self.counters.waiting_in_host.swap(0, Ordering::AcqRel);
        let _ = self.counters.waiting.fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| Some(w.saturating_sub(lost)));
        match Host::new(self.cfg.clone(), self.ctx.tokenizer.clone(), self.counters.clone(), self.ctx.model.config.vocab_size) {
            Ok(h) => self.host = Some(h),
            Err(e) => panic!("cannot rebuild the engine's host state: {e}"),
        }
    }

    /// Aborts the requests whose client went away (before scheduling; `Engine::step` does it too).
    pub(crate) fn reap_disconnected(&mut self) {
        self.host_mut().reap_disconnected();
    }

    /// Schedules a step with nothing in flight (the data-parallel lockstep loop, which agrees on
    /// it with its peers before running it with [`Self::run_plan`]).
    pub(crate) fn schedule_step(&mut self) -> StepPlan {
        if !self.has_work() {
            return StepPlan::default();
        }
        let _s = tracing::trace_span!("schedule").entered();
        self.host_mut().schedule(0)
    }

    /// Requests running and waiting, and the KV pool's usage: a data-parallel rank's gauges.
    pub(crate) fn load(&self) -> (usize, usize, f32) {
        let host = self.host();
        (host.scheduler.num_running(), host.scheduler.num_waiting(), host.kv.usage())
    }

    /// A forward pass of `n` placeholder tokens that writes no KV and computes no logits: each
    /// token is its own one-token sequence at position 0 reading block 0 (whatever it holds; the
    /// result is discarded). A hybrid's are one sequence of `n` tokens from position 0 in the
    /// state slot kept for them (the last; reset by starting at 0, so no sequence's state is
    /// touched). A lockstep rank with nothing scheduled runs it to join whatever collectives the
    /// model makes, at the padded size. A panic comes back as an error.
    pub(crate) fn run_dummy_batch(&mut self, n: usize) -> Result<(), StepFailure> {
        if n == 0 {
            return Ok(());
        }
        let tokens = vec![0u32; n];
        let recurrent = self.compute.kv_store.recurrent.as_ref().map(|r| r.slots() - 1);
        let table = vec![0u32; if recurrent.is_some() { n.div_ceil(self.compute.kv_store.layout.block_size).max(1) } else { 1 }];
        let spans: Vec<SeqSpan> = match recurrent {
            Some(_) => vec![SeqSpan { q_start: 0, q_len: n, context_len: n, block_table: &table }],
            None => (0..n).map(|i| SeqSpan { q_start: i, q_len: 1, context_len: 1, block_table: &table }).collect(),
        };
        let slots = vec![NO_SLOT; n];
        let state_slots: Vec<usize> = recurrent.into_iter().collect();
        let batch = ForwardBatch { tokens: &tokens, seqs: &spans, slots: &slots, logits_rows: &[], hidden_layers: &[], state_slots: &state_slots };
        let (model, kv, pool) = (&self.ctx.model, &mut self.compute.kv_store, &self.ctx.pool);
        match catch_unwind(AssertUnwindSafe(|| pool.install(|| model.forward(&batch, kv)))) {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(e.into()),
            Err(panic) => Err(StepFailure::Invariant(format!("the forward pass panicked: {}", panic_message(&panic)))),
        }
    }

    /// Fails one request (the data-parallel lockstep loop, when its step cannot run).
    pub(crate) fn fail_request(&mut self, seq: SeqId, message: &str) {
        self.host_mut().fail(seq, message);
    }
}

/// Runs a step's compute job on the engine thread (`while_forward`: see `run_job`), and records
/// its timings and the idle gap before its forward pass.
fn compute(
    ctx: &JobContext,
    state: &mut ComputeState,
    last_job: &mut Option<JobTimings>,
    plan: StepPlan,
    job: StepJob,
    stats: &mut StepStats,
    while_forward: impl FnOnce(),
) -> Computed {
    stats.num_seqs = plan.seqs.len();
    stats.num_tokens = plan.total_tokens;
    stats.has_prefill = plan.has_prefill();
    let step = job.step;
    let outcome = run_job(ctx, state, job, while_forward);
    match &outcome {
        Ok(out) => {
            let t = &out.timings;
            stats.ran_forward = true;
            stats.timings.forward = t.forward_end - t.forward_start;
            stats.timings.sample = t.sample;
            stats.timings.propose = t.propose;
            stats.timings.gap = last_job.map(|j| t.forward_start.saturating_duration_since(j.forward_end));
            stats.timings.host_gap = last_job.map(|j| t.forward_start.saturating_duration_since(j.end()));
            *last_job = Some(*t);
        }
        Err(_) => *last_job = None,
    }
    Computed { step, plan, outcome }
}

/// Starts an engine on its own thread; returns the handle front ends use and the thread.
pub fn spawn_engine(
    model: LlamaModel,
    tokenizer: Arc<Tokenizer>,
    cfg: EngineConfig,
    spec: Option<(SpecConfig, Box<dyn Proposer>)>,
) -> Result<(EngineHandle, std::thread::JoinHandle<()>), EngineError> {
    let (handle, rx, counters) = EngineHandle::channel(cfg.max_waiting);
    let mut engine = Engine::new(model, tokenizer, cfg, counters)?;
    if let Some((c, p)) = spec {
        engine = engine.with_speculation(c, p)?;
    }
    let stopped = engine.stopped_guard();
    let join = std::thread::Builder::new()
        .name("specula-engine".into())
        .spawn(move || {
            let _stopped = stopped;
            engine.run(rx)
        })
        .map_err(EngineError::Spawn)?;
    Ok((handle, join))
}

/// The host borrowed for a change. The one sync point between the host and the compute state:
/// when the borrow ends (and when the host comes back from the async worker, `Engine::put_host`),
/// the compute side forgets the sequences the host removed (their records and the proposer's
/// state) and speculation learns the finished ones' outputs, so no change to the host can leave
/// the compute side holding state (a record, draft-model KV) for a sequence that is gone.
pub(crate) struct HostMut<'a> {
    host: &'a mut Host,
    compute: &'a mut ComputeState,
}

impl std::ops::Deref for HostMut<'_> {
    type Target = Host;
    fn deref(&self) -> &Host {
        self.host
    }
}

impl std::ops::DerefMut for HostMut<'_> {
    fn deref_mut(&mut self) -> &mut Host {
        self.host
    }
}

impl Drop for HostMut<'_> {
    fn drop(&mut self) {
        sync_compute(self.host, self.compute);
    }
}

/// The worker the host job runs on with async scheduling.
fn host_runner() -> Result<AsyncRunner<HostDone>, EngineError> {
    AsyncRunner::new("specula-host").map_err(|e| EngineError::ThreadPool(e.to_string()))
}

fn sync_compute(host: &mut Host, compute: &mut ComputeState) {
    for id in host.take_removed() {
        compute.forget(id);
    }
    let finished = host.take_finished();
    if let Some(sp) = compute.spec.as_mut() {
        for (tenant, output) in finished {
            sp.record_finished(tenant, &output);
        }
    }
}
