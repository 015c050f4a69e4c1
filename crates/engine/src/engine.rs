//! The engine: one thread owns the model, the KV cache and the scheduler, and runs the step of
//! DESIGN.md — schedule -> prepare -> execute -> sample -> update — for as long as there is
//! work. Requests come in and events go out over channels (see `handle`).
//!
//! Execute and sample (and the next step's draft proposals) form one compute job
//! (`runner::job`). Synchronously, the engine runs it inline. With `async_scheduling`, the job of
//! step N runs on the [`AsyncRunner`] while this thread schedules step N+1; then it collects N,
//! applies N's tokens, finalizes and submits N+1, and streams N's text while N+1 computes (see
//! `step_async`).

use crate::api::{FinishReason, GenerateRequest, RequestEvent, TokenLogprob};
use crate::config::EngineConfig;
use crate::handle::{EngineCommand, EngineHandle, QueueCounters};
use crate::kv_cache::KvCacheManager;
use crate::runner::job::{is_stop_token, panic_message, run_job, token_finish, ComputeState, JobContext, JobDone, JobOutput, JobTimings, SampleItem, StepJob};
use crate::runner::{prepare, AsyncRunner};
use crate::sampling::{unpack, RankedLogprob, Sampler, SeqRng, StopCheck};
use crate::scheduler::{InFlight, Scheduler, StepPlan};
use crate::sequence::Sequence;
use crate::spec::{Draft, Proposer, SpecConfig, SpecMetrics, Speculation};
use crate::types::{RequestId, SeqId, TokenId};
use specula_kernels::attention::KvLayout;
use specula_model::{KvStore, LlamaModel, Tokenizer};
use std::collections::{BTreeMap, BTreeSet};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("invalid engine configuration: {0}")]
    Config(String),
    #[error("cannot start the compute thread pool: {0}")]
    ThreadPool(String),
    #[error("cannot start the engine thread: {0}")]
    Spawn(std::io::Error),
}

/// Where one step's time went. Host phases run on the engine thread; `forward`, `sample` and
/// `propose` are the compute job. With async scheduling, `schedule` and `prepare` belong to the
/// next step and overlap this one's forward pass.
#[derive(Clone, Debug, Default)]
pub struct StepTimings {
    pub schedule: Duration,
    pub prepare: Duration,
    pub forward: Duration,
    pub sample: Duration,
    pub propose: Duration,
    /// Applying the sampled tokens and streaming them (detokenize, stop strings, deltas).
    pub update: Duration,
    /// Time between the end of the previous forward pass and the start of this one (`None` for
    /// the first forward pass after the engine was idle). Includes sampling, which the next
    /// forward pass waits for whatever the scheduling.
    pub gap: Option<Duration>,
    /// Time between the end of the previous compute job (forward, sample, propose) and the start
    /// of this forward pass: the compute side waiting on host work.
    pub host_gap: Option<Duration>,
}

/// What one step did, for logs, benchmarks and tests.
#[derive(Clone, Debug, Default)]
pub struct StepStats {
    pub num_seqs: usize,
    pub num_tokens: usize,
    pub num_emitted: usize,
    pub has_prefill: bool,
    /// Whether a forward pass was collected by this call (async: the previous step's).
    pub ran_forward: bool,
    pub timings: StepTimings,
}

pub struct Engine {
    pub(crate) cfg: EngineConfig,
    pub(crate) model: Arc<LlamaModel>,
    pub(crate) tokenizer: Arc<Tokenizer>,
    pub(crate) kv_store: KvStore,
    pub(crate) kv: KvCacheManager,
    pub(crate) scheduler: Scheduler,
    pub(crate) seqs: BTreeMap<SeqId, Sequence>,
    pub(crate) by_request: BTreeMap<RequestId, SeqId>,
    pub(crate) pool: Arc<rayon::ThreadPool>,
    pub(crate) sampler: Sampler,
    pub(crate) counters: Arc<QueueCounters>,
    pub(crate) next_seq: u64,
    pub(crate) spec: Option<Speculation>,
    /// Jobs submitted so far (the step number of the next is this + 1).
    steps: u64,
    /// The async worker, when `async_scheduling` is on.
    runner: Option<AsyncRunner<JobDone>>,
    /// The step whose job is on the runner.
    in_flight: Option<StepPlan>,
    /// Sequences that ended while the proposer was away in a job; forgotten when it returns.
    spec_removals: Vec<SeqId>,
    /// The timings of the last compute job collected, while steps follow each other (the gaps
    /// before the next forward pass are measured from it); `None` after the engine went idle.
    last_job: Option<JobTimings>,
    /// When the job in flight should end, judging by the last one's duration.
    job_expected_end: Option<Instant>,
    /// Drafts a sequence may get per step (0 without speculation): the reservation of a decode
    /// scheduled ahead.
    spec_k: usize,
}

/// One sequence's tokens applied by a step, to be streamed.
struct AppliedSeq {
    seq: SeqId,
    /// Index in `tokens` of the first token this step appended, and how many it appended.
    first: usize,
    count: usize,
    lp_first: Option<usize>,
    /// A finish decided from tokens alone (stop token, length); stop strings are found when streaming.
    finish: Option<FinishReason>,
}

/// A step's tokens, applied to the sequences and waiting to be streamed.
#[derive(Default)]
struct Applied {
    seqs: Vec<AppliedSeq>,
    lp_rows: Vec<RankedLogprob>,
}

impl Applied {
    fn finishing(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.iter().filter(|a| a.finish.is_some()).map(|a| a.seq)
    }
}

impl Engine {
    pub fn new(model: LlamaModel, tokenizer: Arc<Tokenizer>, cfg: EngineConfig, counters: Arc<QueueCounters>) -> Result<Self, EngineError> {
        cfg.validate(model.config.context_length).map_err(EngineError::Config)?;
        let c = &model.config;
        let layout = KvLayout { block_size: cfg.block_size, n_heads: c.n_heads, n_kv_heads: c.n_kv_heads, head_dim: c.head_dim };
        let kv_store = KvStore::new(c.n_layers, layout, cfg.num_kv_blocks);
        let kv = KvCacheManager::new(cfg.num_kv_blocks, cfg.block_size, cfg.enable_prefix_caching).map_err(|e| EngineError::Config(e.to_string()))?;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(cfg.threads)
            .thread_name(|i| format!("specula-compute-{i}"))
            .build()
            .map_err(|e| EngineError::ThreadPool(e.to_string()))?;
        let runner = if cfg.async_scheduling { Some(AsyncRunner::new("specula-step").map_err(|e| EngineError::ThreadPool(e.to_string()))?) } else { None };
        tracing::info!(
            kv_tokens = cfg.num_kv_blocks * cfg.block_size,
            kv_mb = KvStore::bytes_per_token(c.n_layers, &layout) * cfg.num_kv_blocks * cfg.block_size / 1_000_000,
            threads = cfg.threads,
            async_scheduling = cfg.async_scheduling,
            "{}",
            specula_kernels::cpu::describe()
        );
        Ok(Self {
            scheduler: Scheduler::new(cfg.clone()),
            cfg,
            model: Arc::new(model),
            tokenizer,
            kv_store,
            kv,
            seqs: BTreeMap::new(),
            by_request: BTreeMap::new(),
            pool: Arc::new(pool),
            sampler: Sampler::new(),
            counters,
            next_seq: 1,
            spec: None,
            steps: 0,
            runner,
            in_flight: None,
            spec_removals: Vec::new(),
            last_job: None,
            job_expected_end: None,
            spec_k: 0,
        })
    }

    /// Turns on speculative decoding with `proposer`.
    pub fn with_speculation(mut self, cfg: SpecConfig, proposer: Box<dyn Proposer>) -> Result<Self, EngineError> {
        cfg.validate().map_err(EngineError::Config)?;
        self.spec_k = cfg.num_speculative_tokens;
        self.spec = Some(Speculation::new(cfg, proposer, &self.model.config));
        Ok(self)
    }

    /// Acceptance counters, when speculating (and no step is in flight).
    pub fn spec_metrics(&self) -> Option<&SpecMetrics> {
        self.spec.as_ref().map(|s| &s.metrics)
    }

    /// (free, total) blocks of the proposer's own KV cache, if it has one.
    pub fn draft_kv_blocks(&self) -> Option<(usize, usize)> {
        self.spec.as_ref().and_then(|s| s.proposer.kv_blocks())
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }
    /// Whether a step could do something: requests queued or running, or a step in flight.
    pub fn has_work(&self) -> bool {
        self.scheduler.has_work() || self.in_flight.is_some()
    }
    pub fn num_free_blocks(&self) -> usize {
        self.kv.num_free_blocks()
    }
    pub fn num_total_blocks(&self) -> usize {
        self.kv.num_total_blocks()
    }

    /// Accepts a request, or fails it at once with a clear message.
    pub fn add_request(&mut self, req: GenerateRequest) {
        let fail = |req: &GenerateRequest, msg: String| {
            let _ = req.events.send(RequestEvent::Failed { message: msg });
        };
        let n = req.prompt.len();
        let problem = if n == 0 {
            Some("the prompt is empty".to_string())
        } else if n >= self.cfg.max_model_len {
            Some(format!("prompt has {n} tokens but --max-model-len is {} (room is needed for at least one generated token)", self.cfg.max_model_len))
        } else if let Some(t) = req.prompt.iter().find(|&&t| t as usize >= self.model.config.vocab_size) {
            Some(format!("token id {t} is outside the vocabulary of {} tokens", self.model.config.vocab_size))
        } else {
            req.params.validate(usize::MAX).err().map(|e| e.message)
        };
        if let Some(msg) = problem {
            self.counters.waiting.fetch_sub(1, Ordering::Relaxed);
            fail(&req, msg);
            return;
        }
        let id = SeqId(self.next_seq);
        self.next_seq += 1;
        self.by_request.insert(req.id, id);
        self.seqs.insert(id, Sequence::new(id, req.id, req.prompt, req.params, req.events));
        self.scheduler.add(id);
    }

    /// Cancels a request wherever it is; its blocks go back at once.
    pub fn abort(&mut self, id: RequestId) {
        if let Some(&seq) = self.by_request.get(&id) {
            self.finish(seq, FinishReason::Abort);
        }
    }

    /// Fails every live request with `message` (shutdown, fatal errors).
    pub fn fail_all(&mut self, message: &str) {
        let ids: Vec<SeqId> = self.seqs.keys().copied().collect();
        for id in ids {
            self.fail(id, message);
        }
    }

    /// Waits for a step in flight (if any) and drops its result: after `fail_all`, or at shutdown.
    pub fn discard_in_flight(&mut self) {
        if self.in_flight.take().is_some() {
            if let Some(done) = self.runner.as_mut().and_then(|r| r.sync().ok()) {
                self.restore(done.state);
            }
        }
    }

    /// One engine step (synchronous or async by configuration). Returns what it did; failures
    /// are reported to the affected requests.
    pub fn step(&mut self) -> StepStats {
        let stats = if self.runner.is_some() { self.step_async() } else { self.step_sync() };
        self.export_gauges();
        if stats.ran_forward {
            record_timings(&stats.timings);
        }
        stats
    }

    fn step_sync(&mut self) -> StepStats {
        let _span = tracing::debug_span!("step").entered();
        self.reap_disconnected();
        let t = Instant::now();
        let plan = self.schedule_next();
        let mut stats = StepStats { num_seqs: plan.seqs.len(), num_tokens: plan.total_tokens, has_prefill: plan.has_prefill(), ..Default::default() };
        stats.timings.schedule = t.elapsed();
        if !plan.is_empty() {
            let result = catch_unwind(AssertUnwindSafe(|| self.run_plan_timed(&plan, &mut stats)));
            match result {
                Ok(Ok(())) => {}
                Ok(Err(msg)) => self.fail_plan(&plan, &msg),
                Err(panic) => {
                    let msg = panic_message(&panic);
                    tracing::error!("engine step panicked: {msg}");
                    self.fail_plan(&plan, &format!("internal error in engine step: {msg}"));
                }
            }
        } else {
            self.idle();
        }
        stats
    }

    /// No step follows at once: the next forward pass starts no gap.
    fn idle(&mut self) {
        self.last_job = None;
    }

    /// Runs a scheduled plan to the end: prepare, the compute job inline, update. The data-parallel
    /// lockstep loop calls this between its agreement and the next step.
    pub(crate) fn run_plan(&mut self, plan: &StepPlan) -> Result<usize, String> {
        let mut stats = StepStats::default();
        self.run_plan_timed(plan, &mut stats)?;
        Ok(stats.num_emitted)
    }

    fn run_plan_timed(&mut self, plan: &StepPlan, stats: &mut StepStats) -> Result<(), String> {
        let t = Instant::now();
        let job = self.build_job(plan)?;
        stats.timings.prepare = t.elapsed();
        let ctx = self.job_context();
        let state = self.take_compute();
        let done = run_job(&ctx, state, job);
        self.restore(done.state);
        let out = done.outcome?;
        self.note_job(&out, stats);
        let t = Instant::now();
        let applied = self.apply(plan, out, None)?;
        stats.num_emitted = self.emit(applied);
        stats.timings.update = t.elapsed();
        Ok(())
    }

    /// Async scheduling, one call per forward pass (see the module docs):
    /// 1. schedule step N+1 while step N's job runs (its sequences' new tokens are provisional);
    /// 2. collect N and apply its tokens (KV bookkeeping, token-level finishes);
    /// 3. finalize N+1 from N's output (drop what finished or went away, fill in the tokens and
    ///    drafts N produced, release unreserved KV), prepare and submit it;
    /// 4. stream N's tokens (detokenize, stop strings) while N+1 computes.
    fn step_async(&mut self) -> StepStats {
        let _span = tracing::debug_span!("step_async").entered();
        self.reap_disconnected();
        let mut stats = StepStats::default();

        let t = Instant::now();
        let mut next = self.schedule_next();
        stats.timings.schedule = t.elapsed();

        let mut applied = None;
        if let Some(plan) = self.in_flight.take() {
            let runner = self.runner.as_mut().expect("async engine has a runner");
            // with a core to spare, be awake when the job ends instead of waiting to be woken
            let synced = match self.job_expected_end {
                Some(end) if self.cfg.threads < available_cores() => runner.sync_near(end, Duration::from_millis(6)),
                _ => runner.sync(),
            };
            stats.num_seqs = plan.seqs.len();
            stats.num_tokens = plan.total_tokens;
            stats.has_prefill = plan.has_prefill();
            match synced {
                Ok(done) => {
                    self.restore(done.state);
                    match done.outcome {
                        Ok(out) => {
                            self.note_job(&out, &mut stats);
                            let t = Instant::now();
                            match catch_unwind(AssertUnwindSafe(|| self.apply(&plan, out, Some(&next)))) {
                                Ok(Ok(a)) => applied = Some(a),
                                Ok(Err(msg)) => self.fail_plan(&plan, &msg),
                                Err(p) => self.fail_plan(&plan, &format!("internal error in engine step: {}", panic_message(&p))),
                            }
                            stats.timings.update = t.elapsed();
                        }
                        Err(msg) => self.fail_plan(&plan, &msg),
                    }
                }
                Err(e) => self.compute_state_lost(&plan, &e.to_string()),
            }
        }

        let t = Instant::now();
        if let Some(a) = &applied {
            let finishing: BTreeSet<SeqId> = a.finishing().collect();
            next.seqs.retain(|s| !finishing.contains(&s.seq));
        }
        self.finalize(&mut next);
        if !next.is_empty() {
            match catch_unwind(AssertUnwindSafe(|| self.build_job(&next))) {
                Ok(Ok(job)) => {
                    let ctx = self.job_context();
                    let state = self.take_compute();
                    let step = job.step;
                    let submitted = self.runner.as_mut().expect("async engine has a runner").submit(step, move || Ok(run_job(&ctx, state, job)));
                    match submitted {
                        Ok(()) => {
                            self.in_flight = Some(next);
                            self.job_expected_end = self.last_job.map(|j| Instant::now() + j.duration());
                        }
                        Err(e) => self.compute_state_lost(&next, &e.to_string()),
                    }
                }
                Ok(Err(msg)) => self.fail_plan(&next, &msg),
                Err(p) => self.fail_plan(&next, &format!("internal error preparing engine step: {}", panic_message(&p))),
            }
        }
        stats.timings.prepare = t.elapsed();

        if let Some(a) = applied {
            let t = Instant::now();
            stats.num_emitted = self.emit(a);
            stats.timings.update += t.elapsed();
        }
        if !self.has_work() {
            self.idle();
        }
        stats
    }

    /// Schedules the next step, around the one in flight if any.
    fn schedule_next(&mut self) -> StepPlan {
        if !self.scheduler.has_work() {
            return StepPlan::default();
        }
        let _s = tracing::trace_span!("schedule").entered();
        let plan = match &self.in_flight {
            None => self.scheduler.schedule(&mut self.seqs, &mut self.kv),
            Some(running) => {
                let flight: BTreeMap<SeqId, InFlight> = running.seqs.iter().map(|s| (s.seq, InFlight { end: s.start + s.num_tokens, sample: s.sample })).collect();
                self.scheduler.schedule_ahead(&mut self.seqs, &mut self.kv, &flight, self.spec_k)
            }
        };
        for _ in &plan.newly_admitted {
            self.counters.waiting.fetch_sub(1, Ordering::Relaxed);
        }
        plan
    }

    /// Settles the provisional entries of a plan scheduled ahead, now that the step before it has
    /// been applied: sequences that ended leave it, each decode computes its one new token plus
    /// the drafts proposed for it (if they fit the reservation), and reserved blocks past what the
    /// step writes go back to the pool.
    fn finalize(&mut self, plan: &mut StepPlan) {
        let seqs = &mut self.seqs;
        let kv = &mut self.kv;
        plan.seqs.retain_mut(|sch| {
            let Some(s) = seqs.get_mut(&sch.seq) else { return false };
            if !sch.provisional {
                return true;
            }
            let pending = s.tokens.len().saturating_sub(s.num_computed);
            if pending != 1 {
                // not a plain decode after all (never expected): let the next schedule decide
                return false;
            }
            if 1 + s.draft.tokens.len() > sch.num_tokens {
                s.draft = Draft::default();
            }
            sch.start = s.num_computed;
            sch.num_drafts = s.draft.tokens.len();
            sch.num_tokens = 1 + sch.num_drafts;
            sch.provisional = false;
            let _ = kv.truncate(sch.seq, sch.start + sch.num_tokens);
            kv.ensure_capacity(sch.seq, sch.start + sch.num_tokens).is_ok()
        });
        plan.total_tokens = plan.seqs.iter().map(|s| s.num_tokens).sum();
    }

    /// The step's inputs and the sampled sequences' state, handed to the compute job.
    fn build_job(&mut self, plan: &StepPlan) -> Result<StepJob, String> {
        let _s = tracing::trace_span!("prepare").entered();
        let inputs = prepare(plan, &self.seqs, &self.kv).map_err(|e| e.to_string())?;
        let by_seq: BTreeMap<SeqId, &crate::scheduler::ScheduledSeq> = plan.seqs.iter().map(|s| (s.seq, s)).collect();
        let mut items = Vec::with_capacity(inputs.sample_rows.len());
        for &(seq, first_row, rows) in &inputs.sample_rows {
            let s = self.seqs.get_mut(&seq).ok_or("sequence vanished during the step")?;
            let sch = by_seq[&seq];
            items.push(SampleItem {
                seq,
                first_row,
                rows,
                start: sch.start,
                num_tokens: sch.num_tokens,
                params: s.params.clone(),
                tokens: s.tokens.clone(),
                prompt_len: s.prompt_len,
                rng: std::mem::replace(&mut s.rng, SeqRng::new(Some(0), 0)),
                draft: std::mem::take(&mut s.draft),
            });
        }
        self.steps += 1;
        let fault = self.cfg.fault_injection.filter(|f| f.step == self.steps).map(|f| f.kind);
        Ok(StepJob { step: self.steps, inputs, items, fault })
    }

    fn job_context(&self) -> JobContext {
        JobContext { model: self.model.clone(), tokenizer: self.tokenizer.clone(), pool: self.pool.clone(), max_model_len: self.cfg.max_model_len }
    }

    fn take_compute(&mut self) -> ComputeState {
        let c = &self.model.config;
        let empty = KvStore::new(c.n_layers, self.kv_store.layout, 0);
        ComputeState { kv_store: std::mem::replace(&mut self.kv_store, empty), sampler: std::mem::take(&mut self.sampler), spec: self.spec.take() }
    }

    fn restore(&mut self, state: ComputeState) {
        self.kv_store = state.kv_store;
        self.sampler = state.sampler;
        self.spec = state.spec;
        if let Some(sp) = self.spec.as_mut() {
            for id in self.spec_removals.drain(..) {
                sp.remove(id);
            }
        }
        self.spec_removals.clear();
    }

    /// The async worker died outside the job's own panic guard and took the KV tensors and the
    /// proposer with it (never expected: the job catches its panics). The step's requests fail;
    /// every other sequence is recomputed from its tokens on fresh KV; speculation stops.
    fn compute_state_lost(&mut self, plan: &StepPlan, msg: &str) {
        tracing::error!("async step runner failed; rebuilding the KV cache: {msg}");
        self.fail_plan(plan, &format!("internal error: {msg}"));
        // the old runner's Drop joins its dead worker
        self.runner = AsyncRunner::new("specula-step").ok();
        self.kv_store = KvStore::new(self.model.config.n_layers, self.kv_store.layout, self.cfg.num_kv_blocks);
        if let Ok(kv) = KvCacheManager::new(self.cfg.num_kv_blocks, self.cfg.block_size, self.cfg.enable_prefix_caching) {
            self.kv = kv;
        }
        for s in self.seqs.values_mut() {
            s.num_computed = 0;
            s.draft = Draft::default();
        }
        self.scheduler.requeue_all();
        self.spec = None;
        self.spec_removals.clear();
        if self.runner.is_none() {
            tracing::error!("cannot restart the async step runner; continuing with synchronous scheduling");
        }
    }

    /// Records a collected job's timings and the idle gap before its forward pass.
    fn note_job(&mut self, out: &JobOutput, stats: &mut StepStats) {
        let t = &out.timings;
        stats.ran_forward = true;
        stats.timings.forward = t.forward_end - t.forward_start;
        stats.timings.sample = t.sample;
        stats.timings.propose = t.propose;
        stats.timings.gap = self.last_job.map(|j| t.forward_start.saturating_duration_since(j.forward_end));
        stats.timings.host_gap = self.last_job.map(|j| t.forward_start.saturating_duration_since(j.end()));
        self.last_job = Some(*t);
    }

    /// Applies a step's output to its sequences: KV bookkeeping (computed tokens, rejected draft
    /// slots, prefix-cache commits), random streams, the emitted tokens up to a token-level finish,
    /// and the drafts for the next step. `next` is the plan already scheduled after this step
    /// (async): its sequences keep their reserved slots and its preemptions own their KV state.
    fn apply(&mut self, plan: &StepPlan, out: JobOutput, next: Option<&StepPlan>) -> Result<Applied, String> {
        let lp_rows = match &out.logprobs {
            Some(p) => unpack(p.words()).map_err(|e| format!("logprobs transfer: {e}"))?.rows,
            None => Vec::new(),
        };
        let mut results: BTreeMap<SeqId, _> = out.results.into_iter().collect();
        let in_next: BTreeSet<SeqId> = next.map(|p| p.seqs.iter().map(|s| s.seq).collect()).unwrap_or_default();
        let preempted: &[SeqId] = next.map_or(&[], |p| &p.preempted);
        let mut applied = Applied { seqs: Vec::new(), lp_rows };
        for sch in &plan.seqs {
            let Some(s) = self.seqs.get_mut(&sch.seq) else { continue };
            let result = results.remove(&sch.seq);
            // preempted while this step ran: its KV is gone and it recomputes from its tokens
            let kv_live = !preempted.contains(&sch.seq);
            let rejected = result.as_ref().map_or(0, |r| r.num_drafts - r.num_accepted());
            if kv_live {
                s.num_computed = sch.start + sch.num_tokens - rejected;
                if rejected > 0 && !in_next.contains(&sch.seq) {
                    let _ = self.kv.truncate(sch.seq, s.num_computed);
                }
            }
            let Some(r) = result else {
                if kv_live {
                    let _ = self.kv.commit_tokens(sch.seq, &s.tokens[..s.num_computed]);
                }
                continue;
            };
            s.rng = r.rng;
            let first = s.tokens.len();
            let mut finish = None;
            for &tok in &r.tokens {
                s.tokens.push(tok);
                finish = token_finish(&s.params, &self.tokenizer, tok, s.output_len(), s.tokens.len(), self.cfg.max_model_len);
                if finish.is_some() {
                    break;
                }
            }
            s.draft = if finish.is_none() && kv_live { r.next_draft } else { Draft::default() };
            if kv_live {
                // accepted draft tokens are now known tokens with computed KV
                let _ = self.kv.commit_tokens(sch.seq, &s.tokens[..s.num_computed.min(s.tokens.len())]);
            }
            applied.seqs.push(AppliedSeq { seq: sch.seq, first, count: s.tokens.len() - first, lp_first: r.lp_first, finish });
        }
        Ok(applied)
    }

    /// Streams applied tokens: detokenizes, applies stop strings, sends deltas with logprobs, and
    /// finishes what is done. Returns the number of tokens emitted.
    fn emit(&mut self, applied: Applied) -> usize {
        let _s = tracing::trace_span!("update").entered();
        let mut emitted = 0;
        let mut finished = Vec::new();
        for a in &applied.seqs {
            let Some(s) = self.seqs.get_mut(&a.seq) else { continue };
            let mut stopped = false;
            for j in 0..a.count {
                let tok = s.tokens[a.first + j];
                let lp = match (a.lp_first, s.params.logprobs) {
                    (Some(first), Some(k)) => applied.lp_rows.get(first + j).map(|r| {
                        let mut l = r.logprob.clone();
                        l.top.truncate(k);
                        l
                    }),
                    _ => None,
                };
                emitted += 1;
                if stream_token(s, &self.tokenizer, tok, lp) {
                    // a stop string ended the text: the step's later tokens are not output
                    s.tokens.truncate(a.first + j + 1);
                    stopped = true;
                    break;
                }
            }
            if stopped {
                finished.push((a.seq, FinishReason::Stop));
            } else if let Some(reason) = a.finish {
                finished.push((a.seq, reason));
            }
        }
        for (id, reason) in finished {
            self.finish(id, reason);
        }
        emitted
    }

    fn fail_plan(&mut self, plan: &StepPlan, msg: &str) {
        for s in &plan.seqs {
            self.fail(s.seq, msg);
        }
    }

    fn fail(&mut self, id: SeqId, message: &str) {
        if let Some(s) = self.remove(id) {
            s.send(RequestEvent::Failed { message: message.to_string() });
        }
    }

    fn finish(&mut self, id: SeqId, reason: FinishReason) {
        if let Some(s) = self.remove(id) {
            // flush text held back for a possible stop string that never came
            if s.text_sent < s.text.len() {
                s.send_delta(vec![], s.text[s.text_sent..].to_string(), vec![]);
            }
            s.send(RequestEvent::Finished { reason, prompt_tokens: s.prompt_len, completion_tokens: s.output_len() });
        }
    }

    /// Removes a sequence from every structure and returns its blocks to the pool. A step in
    /// flight may still compute it: its result is dropped when applied.
    fn remove(&mut self, id: SeqId) -> Option<Sequence> {
        let s = self.seqs.remove(&id)?;
        match self.spec.as_mut() {
            Some(sp) => sp.remove(id),
            None if self.in_flight.is_some() => self.spec_removals.push(id),
            None => {}
        }
        self.by_request.remove(&s.request);
        self.scheduler.remove(id);
        let _ = self.kv.free(id);
        if !s.admitted {
            self.counters.waiting.fetch_sub(1, Ordering::Relaxed);
        }
        Some(s)
    }

    /// Aborts sequences whose client has gone away, freeing their blocks before the next step.
    fn reap_disconnected(&mut self) {
        let gone: Vec<SeqId> = self.seqs.values().filter(|s| s.events.is_closed()).map(|s| s.id).collect();
        for id in gone {
            tracing::debug!(seq = %id, "client disconnected; aborting");
            self.finish(id, FinishReason::Abort);
        }
    }

    fn export_gauges(&self) {
        if !self.cfg.publish_gauges {
            return;
        }
        metrics::gauge!("specula:num_requests_running").set(self.scheduler.num_running() as f64);
        metrics::gauge!("specula:num_requests_waiting").set(self.scheduler.num_waiting() as f64);
        metrics::gauge!("specula:kv_cache_usage_perc").set(self.kv.usage() as f64);
        let p = self.kv.prefix_cache_stats();
        metrics::gauge!("specula:prefix_cache_queries").set(p.queried_tokens as f64);
        metrics::gauge!("specula:prefix_cache_hits").set(p.hit_tokens as f64);
    }

    /// Runs until the command channel closes or a shutdown's grace period ends.
    pub fn run(mut self, rx: Receiver<EngineCommand>) {
        let mut shutdown_at: Option<Instant> = None;
        // Engine metrics exist from the start (a counter such as num_preemptions_total would
        // otherwise be missing from /metrics until its first increment).
        metrics::counter!("specula:num_preemptions_total").increment(0);
        self.export_gauges();
        loop {
            if !self.has_work() && shutdown_at.is_none() {
                // Aborts and refused submits change the pool and queues without a step; publish
                // that before going idle, or the gauges would show the last step's numbers forever.
                self.export_gauges();
                self.idle();
                match rx.recv() {
                    Ok(cmd) => self.handle(cmd, &mut shutdown_at),
                    Err(_) => break,
                }
            }
            while let Ok(cmd) = rx.try_recv() {
                self.handle(cmd, &mut shutdown_at);
            }
            if let Some(deadline) = shutdown_at {
                if !self.has_work() {
                    break;
                }
                if Instant::now() >= deadline {
                    self.fail_all("the server is shutting down and the grace period for in-flight requests ended");
                    break;
                }
            }
            if self.has_work() {
                self.step();
            }
        }
        self.discard_in_flight();
        tracing::info!("engine stopped");
    }

    fn handle(&mut self, cmd: EngineCommand, shutdown_at: &mut Option<Instant>) {
        match cmd {
            EngineCommand::Submit(req) => {
                if shutdown_at.is_some() {
                    self.counters.waiting.fetch_sub(1, Ordering::Relaxed);
                    let _ = req.events.send(RequestEvent::Failed { message: "the server is shutting down".into() });
                } else {
                    self.add_request(req);
                }
            }
            EngineCommand::Abort(id) => self.abort(id),
            EngineCommand::Shutdown => {
                if shutdown_at.is_none() {
                    *shutdown_at = Some(Instant::now() + self.cfg.shutdown_grace);
                }
            }
        }
    }
}

/// Streams one token already appended to `s.tokens`: a stop token goes out without text;
/// otherwise it is detokenized and checked against the stop strings, and the text that can no
/// longer be part of a stop string is released. Returns whether a stop string ended the text.
fn stream_token(s: &mut Sequence, tok: &Tokenizer, id: TokenId, lp: Option<TokenLogprob>) -> bool {
    let logprobs: Vec<TokenLogprob> = lp.into_iter().collect();
    if is_stop_token(&s.params, tok, id) {
        s.send_delta(vec![id], String::new(), logprobs);
        return false;
    }
    let piece = s.decode.step(tok, id).unwrap_or_default();
    let new_len = piece.len();
    s.text.push_str(&piece);
    let (release, stopped) = match s.stops.check(&s.text, new_len) {
        StopCheck::Stopped { end } => {
            s.text.truncate(end);
            (end, true)
        }
        StopCheck::Running { releasable } => (releasable, false),
    };
    let text = if release > s.text_sent { s.text[s.text_sent..release].to_string() } else { String::new() };
    s.text_sent = s.text_sent.max(release);
    s.send_delta(vec![id], text, logprobs);
    stopped
}

fn available_cores() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// Per-phase step times and the compute gap, as Prometheus histograms.
fn record_timings(t: &StepTimings) {
    let phases = [("schedule", t.schedule), ("prepare", t.prepare), ("forward", t.forward), ("sample", t.sample), ("propose", t.propose), ("update", t.update)];
    for (phase, d) in phases {
        metrics::histogram!("specula:step_phase_seconds", "phase" => phase).record(d.as_secs_f64());
    }
    if let Some(g) = t.gap {
        metrics::histogram!("specula:forward_gap_seconds").record(g.as_secs_f64());
    }
    if let Some(g) = t.host_gap {
        metrics::histogram!("specula:compute_idle_gap_seconds").record(g.as_secs_f64());
    }
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
    let join = std::thread::Builder::new().name("specula-engine".into()).spawn(move || engine.run(rx)).map_err(EngineError::Spawn)?;
    Ok((handle, join))
}

/// Step pieces the data-parallel loops (`dp::lockstep`) need: they run `step`'s phases with an
/// agreement between schedule and execute, and fail a step's requests the way `step` does.
impl Engine {
    pub(crate) fn fail_request(&mut self, seq: SeqId, message: &str) {
        self.fail(seq, message);
    }
}
