//! The engine: one thread owns the model, the KV cache and the scheduler, and runs the step of
//! DESIGN.md — schedule -> prepare -> execute -> sample -> update — for as long as there is
//! work. Requests come in and events go out over channels (see `handle`).

use crate::api::{FinishReason, GenerateRequest, RequestEvent, TokenLogprob};
use crate::config::EngineConfig;
use crate::handle::{EngineCommand, EngineHandle, QueueCounters};
use crate::kv_cache::KvCacheManager;
use crate::runner::{execute, prepare, BatchInputs};
use crate::sampling::{pack, ranked_logprob, unpack, PackedLogprobs, Sampler, StopCheck, TokenHistory};
use crate::scheduler::{Scheduler, StepPlan};
use crate::spec::adaptive::{batch_allows_speculation, AcceptanceTracker};
use crate::spec::{verify, DraftRequest, Proposer, SpecConfig, SpecMetrics};
use crate::sequence::Sequence;
use crate::types::{RequestId, SeqId, TokenId};
use specula_kernels::attention::KvLayout;
use specula_model::{KvStore, LlamaModel, Tokenizer};
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::Instant;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("invalid engine configuration: {0}")]
    Config(String),
    #[error("cannot start the compute thread pool: {0}")]
    ThreadPool(String),
    #[error("cannot start the engine thread: {0}")]
    Spawn(std::io::Error),
}

/// What one step did, for logs, benchmarks and tests.
#[derive(Clone, Debug, Default)]
pub struct StepStats {
    pub num_seqs: usize,
    pub num_tokens: usize,
    pub num_emitted: usize,
    pub has_prefill: bool,
}

pub struct Engine {
    pub(crate) cfg: EngineConfig,
    pub(crate) model: LlamaModel,
    pub(crate) tokenizer: Arc<Tokenizer>,
    pub(crate) kv_store: KvStore,
    pub(crate) kv: KvCacheManager,
    pub(crate) scheduler: Scheduler,
    pub(crate) seqs: BTreeMap<SeqId, Sequence>,
    pub(crate) by_request: BTreeMap<RequestId, SeqId>,
    pub(crate) pool: rayon::ThreadPool,
    pub(crate) sampler: Sampler,
    pub(crate) counters: Arc<QueueCounters>,
    pub(crate) next_seq: u64,
    pub(crate) spec: Option<Speculation>,
}

/// Speculative decoding state of an engine.
pub struct Speculation {
    pub cfg: SpecConfig,
    pub proposer: Box<dyn Proposer>,
    pub metrics: SpecMetrics,
    trackers: BTreeMap<SeqId, AcceptanceTracker>,
}

impl Speculation {
    pub fn new(cfg: SpecConfig, proposer: Box<dyn Proposer>) -> Self {
        let metrics = SpecMetrics::new(cfg.num_speculative_tokens);
        Self { cfg, proposer, metrics, trackers: BTreeMap::new() }
    }
}

/// The tokens one sequence emits this step and how many drafts it accepted. Their logprobs, if
/// asked for, are rows `lp_first..lp_first + tokens.len()` of the step's packed logprobs.
struct Emitted {
    tokens: Vec<TokenId>,
    lp_first: Option<usize>,
    num_drafts: usize,
    num_accepted: usize,
}

/// Message flags of the packed per-step logprobs buffer.
const LOGPROBS_FLAG_PLAIN: u32 = 0;
const LOGPROBS_FLAG_VERIFIED: u32 = 1;

/// What the sample stage hands to update: emitted tokens per sequence and one packed buffer
/// holding every emitted token's logprobs (the batch's largest top-k, computed once).
struct SampleOutput {
    emitted: BTreeMap<SeqId, Emitted>,
    logprobs: Option<PackedLogprobs>,
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
        tracing::info!(
            kv_tokens = cfg.num_kv_blocks * cfg.block_size,
            kv_mb = KvStore::bytes_per_token(c.n_layers, &layout) * cfg.num_kv_blocks * cfg.block_size / 1_000_000,
            threads = cfg.threads,
            "{}",
            specula_kernels::cpu::describe()
        );
        Ok(Self {
            scheduler: Scheduler::new(cfg.clone()),
            cfg,
            model,
            tokenizer,
            kv_store,
            kv,
            seqs: BTreeMap::new(),
            by_request: BTreeMap::new(),
            pool,
            sampler: Sampler::new(),
            counters,
            next_seq: 1,
            spec: None,
        })
    }

    /// Turns on speculative decoding with `proposer`.
    pub fn with_speculation(mut self, cfg: SpecConfig, proposer: Box<dyn Proposer>) -> Result<Self, EngineError> {
        cfg.validate().map_err(EngineError::Config)?;
        self.spec = Some(Speculation::new(cfg, proposer));
        Ok(self)
    }

    /// Acceptance counters, when speculating.
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
    pub fn has_work(&self) -> bool {
        self.scheduler.has_work()
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

    /// One engine step. Returns what it did; failures are reported to the affected requests.
    pub fn step(&mut self) -> StepStats {
        let _span = tracing::debug_span!("step").entered();
        self.reap_disconnected();
        let plan = {
            let _s = tracing::trace_span!("schedule").entered();
            self.scheduler.schedule(&mut self.seqs, &mut self.kv)
        };
        for _ in &plan.newly_admitted {
            self.counters.waiting.fetch_sub(1, Ordering::Relaxed);
        }
        let mut stats = StepStats { num_seqs: plan.seqs.len(), num_tokens: plan.total_tokens, has_prefill: plan.has_prefill(), ..Default::default() };
        if !plan.is_empty() {
            let result = catch_unwind(AssertUnwindSafe(|| self.run_plan(&plan)));
            match result {
                Ok(Ok(n)) => stats.num_emitted = n,
                Ok(Err(msg)) => self.fail_plan(&plan, &msg),
                Err(panic) => {
                    let msg = panic_message(&panic);
                    tracing::error!("engine step panicked: {msg}");
                    self.fail_plan(&plan, &format!("internal error in engine step: {msg}"));
                }
            }
        }
        self.export_gauges();
        stats
    }

    pub(crate) fn run_plan(&mut self, plan: &StepPlan) -> Result<usize, String> {
        let inputs = {
            let _s = tracing::trace_span!("prepare").entered();
            let mut inputs = prepare(plan, &self.seqs, &self.kv).map_err(|e| e.to_string())?;
            inputs.want_hidden = self.spec.as_ref().is_some_and(|sp| sp.proposer.needs_hidden());
            inputs
        };
        let out = {
            let _s = tracing::trace_span!("execute").entered();
            execute(&self.model, &mut self.kv_store, &self.pool, &inputs).map_err(|e| e.to_string())?
        };
        let sampled = {
            let _s = tracing::trace_span!("sample").entered();
            self.sample(&inputs, &out.logits, &out.hidden)?
        };
        let _s = tracing::trace_span!("update").entered();
        self.update(plan, sampled)
    }

    /// The tokens each sampling sequence emits: one sampled token, or, with drafts, the accepted
    /// prefix plus one target token from the rejection sampler. Logprobs come from the raw target
    /// logits of each emitted token's position.
    fn sample(&mut self, inputs: &BatchInputs, logits: &[f32], hidden: &[f32]) -> Result<SampleOutput, String> {
        let h = self.model.config.hidden_size;
        let vocab = self.model.config.vocab_size;
        let force_accept = self.spec.as_ref().is_some_and(|sp| sp.cfg.force_accept);
        // only the largest top-k any sequence of this batch asked for is computed
        let k_max = inputs.sample_rows.iter().filter_map(|(id, _, _)| self.seqs.get(id).and_then(|s| s.params.logprobs)).max();
        let mut lp_rows = Vec::new();
        let mut verified = false;
        let mut emitted = BTreeMap::new();
        for &(id, first, rows) in &inputs.sample_rows {
            let s = self.seqs.get_mut(&id).ok_or("sequence vanished during the step")?;
            let block = &logits[first * vocab..(first + rows) * vocab];
            let num_drafts = rows - 1;
            let toks: Vec<TokenId> = if num_drafts == 0 {
                let history = TokenHistory { prompt: &s.tokens[..s.prompt_len], output: &s.tokens[s.prompt_len..] };
                vec![self.sampler.sample(block, &s.params, history, &mut s.rng).map_err(|e| e.to_string())?]
            } else {
                verified = true;
                let (prompt, output) = s.tokens.split_at(s.prompt_len);
                verify(block, vocab, &s.draft, &s.params, prompt, output, &mut s.rng, force_accept).map_err(|e| e.to_string())?.tokens
            };
            let lp_first = match (s.params.logprobs, k_max) {
                (Some(_), Some(k)) => {
                    let start = lp_rows.len();
                    for (j, &tok) in toks.iter().enumerate() {
                        lp_rows.push(ranked_logprob(&block[j * vocab..(j + 1) * vocab], tok, k).map_err(|e| e.to_string())?);
                    }
                    Some(start)
                }
                _ => None,
            };
            if !hidden.is_empty() {
                // the row that produced the last emitted token
                let r = first + toks.len() - 1;
                s.last_hidden.clear();
                s.last_hidden.extend_from_slice(&hidden[r * h..(r + 1) * h]);
            }
            emitted.insert(id, Emitted { num_accepted: toks.len() - 1, num_drafts, tokens: toks, lp_first });
        }
        let logprobs = match k_max {
            Some(_) if !lp_rows.is_empty() => {
                let cols = (lp_rows[0].logprob.top.len() + 1) as u32;
                let flag = if verified { LOGPROBS_FLAG_VERIFIED } else { LOGPROBS_FLAG_PLAIN };
                Some(pack(&lp_rows, cols, flag).map_err(|e| e.to_string())?)
            }
            _ => None,
        };
        Ok(SampleOutput { emitted, logprobs })
    }

    /// Advances every scheduled sequence (rolling back rejected draft slots), emits deltas,
    /// finishes what is done, then asks the proposer for the next step's drafts.
    fn update(&mut self, plan: &StepPlan, out: SampleOutput) -> Result<usize, String> {
        let SampleOutput { emitted: mut sampled, logprobs } = out;
        let lp_rows = match &logprobs {
            Some(p) => unpack(p.words()).map_err(|e| format!("logprobs transfer: {e}"))?.rows,
            None => Vec::new(),
        };
        let mut emitted = 0;
        let mut finished = Vec::new();
        for sch in &plan.seqs {
            let Some(s) = self.seqs.get_mut(&sch.seq) else { continue };
            let result = sampled.remove(&sch.seq);
            let rejected = result.as_ref().map_or(0, |e| e.num_drafts - e.num_accepted);
            s.num_computed = sch.start + sch.num_tokens - rejected;
            s.draft = Default::default();
            if rejected > 0 {
                let _ = self.kv.truncate(sch.seq, s.num_computed);
            }
            let Some(result) = result else {
                let _ = self.kv.commit_tokens(sch.seq, &s.tokens[..s.num_computed]);
                continue;
            };
            if let Some(sp) = self.spec.as_mut() {
                if result.num_drafts > 0 {
                    sp.metrics.record(result.num_drafts, result.num_accepted);
                    sp.trackers.entry(sch.seq).or_default().record(result.num_drafts, result.num_accepted);
                    sp.proposer.rollback(sch.seq, s.num_computed);
                }
            }
            for (j, tok) in result.tokens.into_iter().enumerate() {
                let lp = match (result.lp_first, s.params.logprobs) {
                    (Some(first), Some(k)) => lp_rows.get(first + j).map(|r| {
                        let mut l = r.logprob.clone();
                        l.top.truncate(k);
                        l
                    }),
                    _ => None,
                };
                emitted += 1;
                if let Some(reason) = append_token(s, &self.tokenizer, tok, lp, self.cfg.max_model_len) {
                    finished.push((sch.seq, reason));
                    break;
                }
            }
            // accepted draft tokens are now known tokens with computed KV
            let _ = self.kv.commit_tokens(sch.seq, &s.tokens[..s.num_computed.min(s.tokens.len())]);
        }
        for (id, reason) in finished {
            self.finish(id, reason);
        }
        if let Err(e) = self.propose() {
            tracing::warn!("speculative proposer failed; decoding without drafts this step: {e}");
        }
        Ok(emitted)
    }

    /// Drafts for every running sequence that decodes next step.
    fn propose(&mut self) -> Result<(), String> {
        let Some(sp) = self.spec.as_mut() else { return Ok(()) };
        let decoding: Vec<SeqId> = self
            .scheduler
            .running()
            .iter()
            .copied()
            .filter(|id| self.seqs.get(id).is_some_and(|s| s.num_computed + 1 == s.tokens.len()))
            .collect();
        if sp.cfg.adaptive && !batch_allows_speculation(decoding.len(), sp.cfg.max_batch_for_speculation) {
            return Ok(());
        }
        let mut reqs = Vec::with_capacity(decoding.len());
        for id in &decoding {
            let s = &self.seqs[id];
            let k = if sp.cfg.adaptive { sp.trackers.entry(*id).or_default().next_k(sp.cfg.num_speculative_tokens) } else { sp.cfg.num_speculative_tokens };
            let room_tokens = s.params.max_tokens.saturating_sub(s.output_len() + 1);
            let room_ctx = self.cfg.max_model_len.saturating_sub(s.tokens.len() + 1);
            let hidden = (!s.last_hidden.is_empty()).then_some(s.last_hidden.as_slice());
            reqs.push(DraftRequest { seq: *id, tokens: &s.tokens, prompt_len: s.prompt_len, max_draft: k.min(room_tokens).min(room_ctx), params: &s.params, hidden });
        }
        if reqs.iter().all(|r| r.max_draft == 0) {
            return Ok(());
        }
        let drafts = sp.proposer.propose(&reqs, &self.pool).map_err(|e| e.to_string())?;
        drop(reqs);
        for (id, mut d) in decoding.into_iter().zip(drafts) {
            if let Some(s) = self.seqs.get_mut(&id) {
                if d.tokens.iter().any(|&t| t as usize >= self.model.config.vocab_size) {
                    continue; // a proposer bug must not crash verification
                }
                if d.tokens.is_empty() {
                    d.probs = None;
                }
                s.draft = d;
            }
        }
        Ok(())
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

    /// Removes a sequence from every structure and returns its blocks to the pool.
    fn remove(&mut self, id: SeqId) -> Option<Sequence> {
        let s = self.seqs.remove(&id)?;
        if let Some(sp) = self.spec.as_mut() {
            sp.proposer.remove(id);
            sp.trackers.remove(&id);
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

/// Appends one sampled token: detokenizes, applies stop rules, streams what can be released.
/// Returns why the sequence finished, if it did.
fn append_token(s: &mut Sequence, tok: &Tokenizer, id: TokenId, lp: Option<TokenLogprob>, max_model_len: usize) -> Option<FinishReason> {
    s.tokens.push(id);
    let logprobs: Vec<TokenLogprob> = lp.into_iter().collect();
    let eos = !s.params.ignore_eos && tok.is_eos(id);
    if eos || s.params.stop_token_ids.contains(&id) {
        s.send_delta(vec![id], String::new(), logprobs);
        return Some(FinishReason::Stop);
    }
    let piece = s.decode.step(tok, id).unwrap_or_default();
    let new_len = piece.len();
    s.text.push_str(&piece);
    let mut finish = None;
    let release = match s.stops.check(&s.text, new_len) {
        StopCheck::Stopped { end } => {
            s.text.truncate(end);
            finish = Some(FinishReason::Stop);
            end
        }
        StopCheck::Running { releasable } => releasable,
    };
    let text = if release > s.text_sent { s.text[s.text_sent..release].to_string() } else { String::new() };
    s.text_sent = s.text_sent.max(release);
    s.send_delta(vec![id], text, logprobs);
    if finish.is_none() && (s.output_len() >= s.params.max_tokens || s.tokens.len() >= max_model_len) {
        finish = Some(FinishReason::Length);
    }
    finish
}

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_else(|| "unknown panic".into())
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
