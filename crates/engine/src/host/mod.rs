//! The engine's host side: the requests and their sequences, the scheduler and the KV block
//! manager, and the work done on them around a forward pass — apply a computed step's tokens and
//! stream them (update), schedule the next step, and prepare its inputs.
//!
//! With async scheduling a [`Host`] moves, whole, into the job that runs on the
//! [`AsyncRunner`](worker::AsyncRunner) while the engine thread runs the forward pass, and
//! comes back with the next step prepared ([`Host::work`]); nothing else is shared. Synchronously,
//! the engine calls the same methods inline.

pub mod worker;

use crate::api::{FinishReason, GenerateRequest, RequestEvent, TokenLogprob};
use crate::batch::prepare;
use crate::config::EngineConfig;
use crate::error::{panic_message, EngineError, StepError, StepFailure};
use crate::fault::{FaultInjection, FaultPhase};
use crate::handle::QueueCounters;
use crate::kv_cache::{expect_kv, KvCacheManager};
use crate::sampling::{unpack, RankedLogprob, StopCheck};
use crate::scheduler::Scheduler;
use crate::sequence::{is_stop_token, token_finish, Sequence};
use crate::step::{Computed, HostWork, JobOutput, PreparedStep, StepPlan, StepTimings};
use crate::types::{RequestId, SeqId, Tenant, TokenId};
use specula_model::Tokenizer;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// Failed steps, by the part of the engine that failed (`StepError::kind`).
pub const STEP_FAILURES: &str = "specula:step_failures_total";

/// What a host job hands back: the host, and the next step prepared (none if nothing is to run,
/// or if preparing it failed, in which case its requests have been failed).
pub(crate) struct HostDone {
    pub host: Host,
    pub prepared: Option<PreparedStep>,
    pub work: HostWork,
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

pub(crate) struct Host {
    pub cfg: EngineConfig,
    pub tokenizer: Arc<Tokenizer>,
    pub kv: KvCacheManager,
    pub scheduler: Scheduler,
    pub seqs: BTreeMap<SeqId, Sequence>,
    pub by_request: BTreeMap<RequestId, SeqId>,
    pub counters: Arc<QueueCounters>,
    vocab_size: usize,
    next_seq: u64,
    /// Steps prepared so far (the next one prepared is number `steps + 1`).
    steps: u64,
    /// Sequences removed since the engine last asked: the proposer forgets them.
    removed: Vec<SeqId>,
    /// The sequences that finished since the engine last asked, with their tenants: speculation
    /// weighs a draft model's catch-ups against their lengths and the n-gram proposer's
    /// cross-request index keeps them.
    finished: Vec<(Tenant, Vec<TokenId>)>,
}

impl Host {
    pub fn new(cfg: EngineConfig, tokenizer: Arc<Tokenizer>, counters: Arc<QueueCounters>, vocab_size: usize) -> Result<Self, EngineError> {
        let kv = KvCacheManager::new(cfg.num_kv_blocks, cfg.block_size, cfg.enable_prefix_caching).map_err(|e| EngineError::Config(e.to_string()))?;
        Ok(Self {
            scheduler: Scheduler::new(cfg.clone()),
            cfg,
            tokenizer,
            kv,
            seqs: BTreeMap::new(),
            by_request: BTreeMap::new(),
            counters,
            vocab_size,
            next_seq: 1,
            steps: 0,
            removed: Vec::new(),
            finished: Vec::new(),
        })
    }

    /// Sequences removed since the last call.
    pub fn take_removed(&mut self) -> Vec<SeqId> {
        std::mem::take(&mut self.removed)
    }

    /// The outputs (and tenants) of the sequences that finished since the last call.
    pub fn take_finished(&mut self) -> Vec<(Tenant, Vec<TokenId>)> {
        std::mem::take(&mut self.finished)
    }

    /// Accepts a request, or fails it at once with a clear message.
    pub fn add_request(&mut self, req: GenerateRequest) {
        let n = req.prompt.len();
        let mut problem = if n == 0 {
            Some("the prompt is empty".to_string())
        } else if n >= self.cfg.max_model_len {
            Some(format!("prompt has {n} tokens but --max-model-len is {} (room is needed for at least one generated token)", self.cfg.max_model_len))
        } else if let Some(t) = req.prompt.iter().find(|&&t| t as usize >= self.vocab_size) {
            Some(format!("token id {t} is outside the vocabulary of {} tokens", self.vocab_size))
        } else {
            req.params.validate(usize::MAX).err().map(|e| e.message)
        };
        // compiled by the front end, off this thread; one is never compiled here
        let GenerateRequest { id: request_id, prompt, params, events, grammar } = req;
        if problem.is_none() && params.needs_grammar() != grammar.is_some() {
            problem = Some("the request's constraint and its compiled grammar do not match (compile it with api::compile_params before submitting)".into());
        }
        if let Some(message) = problem {
            self.counters.waiting.fetch_sub(1, Ordering::Relaxed);
            let _ = events.send(RequestEvent::Failed { message });
            return;
        }
        let id = SeqId(self.next_seq);
        self.next_seq += 1;
        self.by_request.insert(request_id, id);
        let mut seq = Sequence::new(id, request_id, prompt, params, events);
        if let Some(h) = seq.handoff.as_mut() {
            h.grammar = grammar;
        }
        self.seqs.insert(id, seq);
        self.scheduler.add(id);
        self.counters.waiting_in_host.fetch_add(1, Ordering::Relaxed);
    }

    /// Cancels a request wherever it is; its blocks go back at once. A step computing it (async)
    /// has its result dropped when applied.
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

    /// Fails every request of a step that failed, with the step's error.
    pub fn fail_plan(&mut self, plan: &StepPlan, err: &StepError) {
        metrics::counter!(STEP_FAILURES, "kind" => err.kind()).increment(1);
        let msg = err.to_string();
        for s in &plan.seqs {
            self.fail(s.seq, &msg);
        }
    }

    pub fn fail(&mut self, id: SeqId, message: &str) {
        if let Some(s) = self.remove(id) {
            s.send(RequestEvent::Failed { message: message.to_string() });
        }
    }

    fn finish(&mut self, id: SeqId, reason: FinishReason) {
        if let Some(mut s) = self.remove(id) {
            // flush text held back for a possible stop string that never came
            if s.text_sent < s.text.len() {
                s.send_delta(vec![], s.text[s.text_sent..].to_string(), vec![]);
            }
            s.send(RequestEvent::Finished { reason, prompt_tokens: s.prompt_len, completion_tokens: s.output_len(), cached_tokens: s.cached_prompt_tokens });
            // the sequence is gone: its output moves to speculation, not copied
            let output = s.tokens.split_off(s.prompt_len);
            self.finished.push((s.params.tenant, output));
        }
    }

    /// Removes a sequence from every structure and returns its blocks to the pool.
    fn remove(&mut self, id: SeqId) -> Option<Sequence> {
        let s = self.seqs.remove(&id)?;
        self.removed.push(id);
        self.by_request.remove(&s.request);
        self.scheduler.remove(id);
        self.kv.release(id);
        if !s.admitted {
            self.counters.waiting.fetch_sub(1, Ordering::Relaxed);
            self.counters.waiting_in_host.fetch_sub(1, Ordering::Relaxed);
        }
        Some(s)
    }

    /// Aborts sequences whose client has gone away, freeing their blocks before the next schedule.
    pub fn reap_disconnected(&mut self) {
        let gone: Vec<SeqId> = self.seqs.values().filter(|s| s.events.is_closed()).map(|s| s.id).collect();
        for id in gone {
            tracing::debug!(seq = %id, "client disconnected; aborting");
            self.finish(id, FinishReason::Abort);
        }
    }

    /// Schedules the next step; with a step still running (async), ahead of it: the sequences'
    /// counters say what is in flight (`Scheduler::schedule`), and a decode scheduled ahead
    /// reserves `spec_k` draft tokens.
    pub fn schedule(&mut self, spec_k: usize) -> StepPlan {
        if !self.scheduler.has_work() {
            return StepPlan::default();
        }
        let _s = tracing::trace_span!("schedule").entered();
        let plan = self.scheduler.schedule(&mut self.seqs, &mut self.kv, spec_k);
        self.counters.waiting.fetch_sub(plan.newly_admitted.len(), Ordering::Relaxed);
        self.counters.waiting_in_host.fetch_sub(plan.newly_admitted.len(), Ordering::Relaxed);
        plan
    }

    /// Prepares a scheduled step: block tables, known input tokens, each sampled sequence's
    /// sampling state. A failure (or the test switch) fails the step's requests and prepares nothing.
    pub fn prepare(&mut self, plan: StepPlan) -> Option<PreparedStep> {
        if plan.is_empty() {
            return None;
        }
        let _s = tracing::trace_span!("prepare").entered();
        self.steps += 1;
        let step = self.steps;
        let fault = self.cfg.fault_injection;
        // a failed step's copies are dropped with it: its loads were for its own sequences, which
        // fail; a save not done only loses a cache entry
        let transfers = self.kv.take_transfers();
        let result = catch_unwind(AssertUnwindSafe(|| {
            FaultInjection::trip(fault, step, FaultPhase::Prepare)?;
            prepare(&plan, &mut self.seqs, &self.kv)
        }));
        let err = match result {
            Ok(Ok(seqs)) => return Some(PreparedStep { step, plan, seqs, transfers }),
            Ok(Err(failure)) => StepError::Failed { step, failure },
            Err(panic) => {
                let message = panic_message(&panic);
                tracing::error!("preparing step {step} panicked: {message}");
                StepError::Panicked { step, message }
            }
        };
        self.fail_plan(&plan, &err);
        None
    }

    /// Adds the requests that arrived since `p` was prepared (ahead, during the step before) to it,
    /// as far as its budget allows, so that async scheduling does not make them wait a step
    /// longer. Runs between two forward passes, so only when something is waiting.
    pub fn admit_late(&mut self, p: &mut PreparedStep) {
        if self.scheduler.num_waiting() == 0 {
            return;
        }
        let (first, admitted) = (p.plan.seqs.len(), p.plan.newly_admitted.len());
        self.scheduler.admit_waiting(&mut p.plan, &mut self.seqs, &mut self.kv);
        self.counters.waiting.fetch_sub(p.plan.newly_admitted.len() - admitted, Ordering::Relaxed);
        self.counters.waiting_in_host.fetch_sub(p.plan.newly_admitted.len() - admitted, Ordering::Relaxed);
        if p.plan.seqs.len() == first {
            return;
        }
        p.transfers.append(self.kv.take_transfers());
        let late = StepPlan { seqs: p.plan.seqs[first..].to_vec(), ..Default::default() };
        match prepare(&late, &mut self.seqs, &self.kv) {
            Ok(seqs) => p.seqs.extend(seqs),
            Err(e) => {
                p.plan.seqs.truncate(first);
                p.plan.total_tokens = p.plan.seqs.iter().map(|s| s.num_tokens).sum();
                self.fail_plan(&late, &StepError::Failed { step: p.step, failure: e });
            }
        }
    }

    /// Applies and streams a computed step. `next` is the step already running after it (async):
    /// its sequences keep the KV it writes, and the blocks reserved for its decodes beyond what
    /// they compute go back to the pool. Returns the tokens streamed.
    pub fn complete(&mut self, mut done: Computed, next: Option<&StepPlan>) -> usize {
        if let Ok(out) = done.outcome.as_mut() {
            self.kv.finish_transfers(std::mem::take(&mut out.transfers));
        }
        let emitted = match done.outcome {
            Ok(out) => match catch_unwind(AssertUnwindSafe(|| self.apply(done.step, &done.plan, out, next))) {
                Ok(Ok(applied)) => self.emit(applied),
                Ok(Err(err)) => {
                    self.fail_plan(&done.plan, &err);
                    0
                }
                Err(p) => {
                    self.fail_plan(&done.plan, &StepError::ApplyPanicked(panic_message(&p)));
                    0
                }
            },
            Err(err) => {
                self.fail_plan(&done.plan, &err);
                0
            }
        };
        if let Some(next) = next {
            self.settle(next);
        }
        emitted
    }

    /// Settles `next`, the step scheduled ahead of the one just applied, now that the tokens its
    /// placeholders stood for have landed: each decode scheduled ahead gives back its placeholders
    /// and the KV slots reserved beyond what it computes (`batch::finalize` already moved it to
    /// where the accepted tokens end). With `Host::apply`'s rollback of a step's rejected drafts
    /// (`ScheduledSeq::kept_end`), the one place a reservation made ahead is undone.
    fn settle(&mut self, next: &StepPlan) {
        for sch in next.seqs.iter().filter(|s| s.is_ahead()) {
            if let Some(s) = self.seqs.get_mut(&sch.seq) {
                s.land_placeholders(sch.placeholders);
                s.num_scheduled = sch.start + sch.num_tokens;
                expect_kv(self.kv.truncate(sch.seq, sch.start + sch.num_tokens), "settling a step scheduled ahead", sch.seq);
            }
        }
    }

    /// The host job of an async step (see the module docs): update for the step before, schedule
    /// and prepare the step after the one computing now.
    pub fn work(mut self, job_done: Option<Computed>, running: Option<&StepPlan>, spec_k: usize, record: Option<StepTimings>) -> HostDone {
        if let Some(t) = record {
            record_timings(&t);
        }
        let mut work = HostWork::default();
        let t = Instant::now();
        if let Some(done) = job_done {
            work.emitted = self.complete(done, running);
        }
        self.reap_disconnected();
        work.update = t.elapsed();
        let t = Instant::now();
        let plan = self.schedule(spec_k);
        work.schedule = t.elapsed();
        let t = Instant::now();
        let prepared = self.prepare(plan);
        work.prepare = t.elapsed();
        self.export_gauges();
        HostDone { host: self, prepared, work }
    }

    /// Applies a step's output to its sequences: KV bookkeeping (computed tokens, rejected draft
    /// slots, prefix-cache commits), random streams, the emitted tokens up to a token-level finish,
    /// and the drafts for the next step. `next` is the step already running after this one
    /// (async): its sequences keep their reserved slots and its preemptions own their KV state.
    fn apply(&mut self, step: u64, plan: &StepPlan, out: JobOutput, next: Option<&StepPlan>) -> Result<Applied, StepError> {
        FaultInjection::trip(self.cfg.fault_injection, step, FaultPhase::Apply).map_err(|injected| StepError::Failed { step, failure: injected.into() })?;
        let lp_rows = match &out.logprobs {
            Some(p) => unpack(p.words()).map_err(|e| StepError::Apply(e.into()))?.rows,
            None => Vec::new(),
        };
        // prompt logprobs, appended in prompt order; a recompute (preemption) repeats rows already held
        for p in &out.prompt_logprobs {
            let Some(s) = self.seqs.get_mut(&p.seq) else { continue };
            let k = s.params.prompt_logprobs.unwrap_or(0);
            for j in 0..p.count {
                if p.first_token + j != s.prompt_lps.len() + 1 {
                    continue;
                }
                let r = lp_rows
                    .get(p.lp_first + j)
                    .ok_or_else(|| StepError::Apply(StepFailure::Invariant(format!("prompt logprobs row {} missing", p.lp_first + j))))?;
                let mut l = r.logprob.clone();
                l.top.truncate(k);
                s.prompt_lps.push(l);
                s.prompt_ranks.push(r.rank);
            }
        }
        let mut results: BTreeMap<SeqId, _> = out.results.into_iter().collect();
        let preempted: &[SeqId] = next.map_or(&[], |p| &p.preempted);
        let mut applied = Applied { seqs: Vec::new(), lp_rows };
        // sequences that failed in the step on their own: failed once the others are applied
        let mut failed = Vec::new();
        for sch in &plan.seqs {
            let Some(s) = self.seqs.get_mut(&sch.seq) else { continue };
            let mut result = results.remove(&sch.seq);
            if let Some(message) = result.as_mut().and_then(|r| r.failed.take()) {
                failed.push((sch.seq, message));
                continue;
            }
            // preempted while this step ran (by the step scheduled ahead of it, or by one prepared
            // ahead and dropped since): its KV is gone and it recomputes from its tokens
            let kv_live = !preempted.contains(&sch.seq) && self.kv.block_table(sch.seq).is_ok();
            let rejected = result.as_ref().map_or(0, |r| r.num_rejected());
            if kv_live {
                s.num_computed = sch.kept_end(rejected);
                if !next.is_some_and(|p| p.seqs.iter().any(|n| n.seq == sch.seq)) {
                    // nothing scheduled after this step: the next one starts where this one kept
                    // (a step scheduled ahead is brought there by `settle`)
                    s.num_scheduled = s.num_computed;
                }
                // a step scheduled ahead of this one keeps its reserved slots until it is settled
                if rejected > 0 && s.num_placeholders() == 0 {
                    expect_kv(self.kv.truncate(sch.seq, s.num_computed), "dropping rejected drafts' slots", sch.seq);
                }
            }
            let Some(r) = result else {
                if kv_live {
                    expect_kv(self.kv.commit_tokens(sch.seq, &s.tokens[..s.num_computed]), "committing computed tokens", sch.seq);
                }
                continue;
            };
            let first = s.tokens.len();
            let mut finish = None;
            for &tok in &r.tokens {
                s.tokens.push(tok);
                finish = token_finish(&s.params, &self.tokenizer, tok, s.output_len(), s.tokens.len(), self.cfg.max_model_len);
                if finish.is_some() {
                    break;
                }
            }
            if finish.is_none() && r.grammar_finished {
                // the constraint's language allows nothing more: done, as if EOS came next
                finish = Some(FinishReason::Stop);
            }
            s.draft = if finish.is_none() && kv_live { r.next_draft } else { Vec::new() };
            if kv_live {
                // accepted draft tokens are now known tokens with computed KV
                expect_kv(self.kv.commit_tokens(sch.seq, &s.tokens[..s.num_computed.min(s.tokens.len())]), "committing accepted tokens", sch.seq);
            }
            applied.seqs.push(AppliedSeq { seq: sch.seq, first, count: s.tokens.len() - first, lp_first: r.lp_first, finish });
        }
        for (id, message) in failed {
            self.fail(id, &message);
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
            if s.wants_prompt_logprobs() && a.count > 0 {
                // its first token: the prompt is computed, every prompt logprob is here
                s.prompt_lps_sent = true;
                let logprobs = std::mem::take(&mut s.prompt_lps);
                let ranks = std::mem::take(&mut s.prompt_ranks);
                s.send(RequestEvent::PromptLogprobs { logprobs, ranks });
            }
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

    pub fn export_gauges(&self) {
        if !self.cfg.publish_gauges {
            return;
        }
        metrics::gauge!("specula:num_requests_running").set(self.scheduler.num_running() as f64);
        metrics::gauge!("specula:num_requests_waiting").set(self.scheduler.num_waiting() as f64);
        metrics::gauge!("specula:kv_cache_usage_perc").set(self.kv.usage() as f64);
        let p = self.kv.prefix_cache_stats();
        metrics::gauge!("specula:prefix_cache_queries").set(p.queried_tokens as f64);
        metrics::gauge!("specula:prefix_cache_hits").set(p.hit_tokens as f64);
        if let Some(t) = self.kv.tier_sizes() {
            // of the hits, the tokens loaded from the host-memory and disk tiers, and what they hold
            metrics::gauge!("specula:prefix_cache_host_hits").set(p.host_hit_tokens as f64);
            metrics::gauge!("specula:prefix_cache_disk_hits").set(p.disk_hit_tokens as f64);
            metrics::gauge!("specula:prefix_cache_host_blocks").set(t.host_blocks as f64);
            metrics::gauge!("specula:prefix_cache_host_bytes").set(t.host_bytes as f64);
            if let Some((disk_blocks, disk_bytes)) = t.disk {
                metrics::gauge!("specula:prefix_cache_disk_blocks").set(disk_blocks as f64);
                metrics::gauge!("specula:prefix_cache_disk_bytes").set(disk_bytes as f64);
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

/// Per-phase step times and the compute gaps, as Prometheus histograms.
pub(crate) fn record_timings(t: &StepTimings) {
    let phases = [
        ("schedule", t.schedule),
        ("prepare", t.prepare),
        ("finalize", t.finalize),
        ("forward", t.forward),
        ("sample", t.sample),
        ("propose", t.propose),
        ("update", t.update),
    ];
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
