//! Drives `specula_engine::Engine` step by step on the tiny random model (written to a temporary
//! folder), with one client per request that records every event and checks the event protocol:
//! zero or more `Delta`s, then exactly one `Finished` or `Failed`, then nothing.

#![allow(dead_code)]

use specula_engine::handle::QueueCounters;
use specula_engine::speculative::{build_proposer, DraftWeights, SpecConfig, SpecMethod};
use specula_engine::types::RequestId;
use specula_engine::{Engine, EngineConfig, FinishReason, GenerateRequest, RequestEvent, SamplingParams};
use specula_model::testing::{write_tiny_llama, TinySpec};
use specula_model::{load_model, Tokenizer};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// The tiny random model on disk (and a draft model beside it); the files go away with this value.
pub struct TinyModel {
    _dir: tempfile::TempDir,
    pub path: PathBuf,
    /// Another tiny model (other seed, one layer) with the same vocabulary: a poor draft, so
    /// verification rejects often.
    pub draft: PathBuf,
}

impl TinyModel {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("tiny.gguf");
        write_tiny_llama(&path, &TinySpec { seed: 11, ..Default::default() }).expect("write tiny model");
        let draft = dir.path().join("draft.gguf");
        write_tiny_llama(&draft, &TinySpec { seed: 12, layers: 1, ..Default::default() }).expect("write draft model");
        Self { _dir: dir, path, draft }
    }

    /// A tiny hybrid (Qwen3.5's three Gated DeltaNet layers to one gated-attention layer), as
    /// the main model; the draft is the ordinary tiny model.
    pub fn hybrid() -> Self {
        let m = Self::new();
        // with its own prediction layer, as Qwen3.5 files ship (`Spec::Nextn`)
        let spec = TinySpec { seed: 13, layers: 4, arch: specula_model::Arch::Qwen35, nextn: true, ..Default::default() };
        write_tiny_llama(&m.path, &spec).expect("write tiny hybrid");
        m
    }

    /// [`Self::hybrid`] whose draft is a hybrid too (another seed), as a small Qwen3.5 drafts for
    /// a large one.
    pub fn hybrid_with_hybrid_draft() -> Self {
        let m = Self::hybrid();
        let spec = TinySpec { seed: 14, layers: 4, arch: specula_model::Arch::Qwen35, ..Default::default() };
        write_tiny_llama(&m.draft, &spec).expect("write tiny hybrid draft");
        m
    }
}

/// Speculative decoding for a test engine (not adaptive, so it always speculates, unless built
/// with `Harness::on_with(.., true)` or `Harness::speculating_adaptive`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spec {
    None,
    Ngram(usize),
    /// The target itself as its own draft: every greedy draft token is accepted.
    SelfDraft(usize),
    /// The other tiny model as draft: most draft tokens are rejected.
    OtherDraft(usize),
    /// A random mtp head (pruned vocabulary of 64 tokens) written beside the model.
    Mtp(usize),
    /// The model file's own prediction layer (`TinyModel::hybrid` has one).
    Nextn(usize),
}

/// Small limits that make prefills chunk: 16 sequences, 64 tokens a step, 256-token context.
pub fn tiny_config() -> EngineConfig {
    EngineConfig {
        max_num_seqs: 16,
        max_num_batched_tokens: 64,
        max_model_len: 256,
        block_size: 16,
        num_kv_blocks: 256,
        enable_prefix_caching: true,
        threads: 2,
        ..Default::default()
    }
}

pub struct Harness {
    pub engine: Engine,
    pub counters: Arc<QueueCounters>,
    pub tokenizer: Arc<Tokenizer>,
    pub steps: usize,
    /// Sum of `StepStats::num_tokens`: tokens actually run through the model.
    pub tokens_computed: usize,
    /// Most sequences seen in one step's batch.
    pub max_batch_seqs: usize,
    next_id: u64,
    _model: Option<TinyModel>,
}

impl Harness {
    /// An engine on a freshly written tiny model.
    pub fn new(cfg: EngineConfig) -> Self {
        let m = TinyModel::new();
        let mut h = Self::on(&m, cfg, Spec::None);
        h._model = Some(m);
        h
    }

    /// An engine with speculative decoding on a freshly written tiny model.
    pub fn speculating(cfg: EngineConfig, spec: Spec) -> Self {
        let m = TinyModel::new();
        let mut h = Self::on(&m, cfg, spec);
        h._model = Some(m);
        h
    }

    /// An engine with speculative decoding and adaptive k (the engine's default) on a freshly
    /// written tiny model.
    pub fn speculating_adaptive(cfg: EngineConfig, spec: Spec) -> Self {
        let m = TinyModel::new();
        let mut h = Self::on_with(&m, cfg, spec, true);
        h._model = Some(m);
        h
    }

    /// An engine on an already written model.
    pub fn on(model: &TinyModel, cfg: EngineConfig, spec: Spec) -> Self {
        Self::on_with(model, cfg, spec, false)
    }

    /// An engine on an already written model; `adaptive`: adaptive k (the engine's default)
    /// instead of always proposing k drafts.
    pub fn on_with(model: &TinyModel, cfg: EngineConfig, spec: Spec, adaptive: bool) -> Self {
        let loaded = load_model(&model.path).expect("load tiny model");
        let tokenizer = Arc::new(loaded.tokenizer);
        let counters = Arc::new(QueueCounters::default());
        let target_config = loaded.model.config.clone();
        let mut engine = Engine::new(loaded.model, tokenizer.clone(), cfg.clone(), counters.clone()).expect("engine");
        let spec_cfg = match spec {
            Spec::None => None,
            Spec::Ngram(k) => Some(SpecConfig { ngram_min: 1, ..SpecConfig::new(SpecMethod::Ngram, k) }),
            // a draft token given as a tenth of a target step: the tiny draft models and head are
            // about as large as the tiny target, so by their shapes drafting would never pay and
            // adaptive k would never draft (nothing to compare). A draft model's verification is
            // given as on a memory-bound target (a 1.5B on a CPU: +5% per verified token), so
            // drafting pays at the tests' batch sizes from a sequence's first decode step (later,
            // the draft's catch-up over what it missed must repay itself, and in these short
            // requests it would not)
            Spec::SelfDraft(k) => Some(SpecConfig { draft_model: Some(model.path.clone()), ..draft_spec(k) }),
            Spec::OtherDraft(k) => Some(SpecConfig { draft_model: Some(model.draft.clone()), ..draft_spec(k) }),
            Spec::Mtp(k) => Some(SpecConfig {
                draft_model: Some(model.path.with_file_name("head.safetensors")),
                draft_cost: Some(0.1),
                ..SpecConfig::new(SpecMethod::Mtp, k)
            }),
            Spec::Nextn(k) => Some(SpecConfig { draft_cost: Some(0.1), ..SpecConfig::new(SpecMethod::Mtp, k) }),
        };
        if let Some(sc) = spec_cfg {
            let sc = SpecConfig { adaptive, ..sc };
            let proposer = if let Spec::Mtp(_) = spec {
                // the mtp head reads the target's embedding: build it over a second copy
                let target = load_model(&model.path).expect("load tiny model").model;
                let head = model.path.with_file_name("head.safetensors");
                if !head.exists() {
                    specula_engine::speculative::mtp_format::write_random_head(&head, &target, 64, 5).expect("write head");
                }
                build_proposer(&sc, &target, &cfg).expect("proposer")
            } else if let Spec::Nextn(_) = spec {
                let options = specula_model::LoadOptions { nextn: true, ..Default::default() };
                let target = specula_model::load_model_with(&model.path, &options).expect("load tiny model").model;
                build_proposer(&sc, &target, &cfg).expect("proposer")
            } else {
                build_proposer(&sc, &target_config, &cfg).expect("proposer")
            };
            engine = engine.with_speculation(sc, proposer).expect("speculation");
        }
        Self { engine, counters, tokenizer, steps: 0, tokens_computed: 0, max_batch_seqs: 0, next_id: 1, _model: None }
    }

    /// Submits like `EngineHandle::submit` does (counting the request as waiting first).
    pub fn submit(&mut self, prompt: Vec<u32>, params: SamplingParams) -> Client {
        let id = RequestId(self.next_id);
        self.next_id += 1;
        let (tx, rx) = unbounded_channel();
        let prompt_len = prompt.len();
        self.counters.waiting.fetch_add(1, Ordering::Relaxed);
        // compiled as a front end does, before submitting: an invalid one fails the request there
        match specula_engine::api::compile_params(&self.tokenizer, &params) {
            Ok(grammar) => self.engine.add_request(GenerateRequest { id, prompt, params, events: tx, grammar }),
            Err(e) => {
                self.counters.waiting.fetch_sub(1, Ordering::Relaxed);
                let _ = tx.send(specula_engine::api::RequestEvent::Failed { message: e.0 });
            }
        }
        Client { id, prompt_len, rx: Some(rx), events: Vec::new(), submitted_at: self.steps, ended_at: None }
    }

    pub fn step(&mut self) {
        let stats = self.engine.step();
        self.steps += 1;
        self.tokens_computed += stats.num_tokens;
        self.max_batch_seqs = self.max_batch_seqs.max(stats.num_seqs);
    }

    /// Steps until the engine has no work (at most `max_steps`), collecting every client's events.
    pub fn run(&mut self, clients: &mut [&mut Client], max_steps: usize) {
        for c in clients.iter_mut() {
            c.drain(self.steps);
        }
        let mut n = 0;
        while self.engine.has_work() {
            assert!(n < max_steps, "engine still busy after {max_steps} steps: a request is starving");
            self.step();
            n += 1;
            for c in clients.iter_mut() {
                c.drain(self.steps);
            }
        }
    }

    /// Every KV block is back in the pool and nothing is counted as waiting.
    pub fn assert_idle_and_leak_free(&self) {
        assert!(!self.engine.has_work(), "engine still has work");
        assert_eq!(self.engine.num_free_blocks(), self.engine.num_total_blocks(), "KV blocks leaked");
        assert_eq!(self.engine.num_seq_records(), 0, "sequence records leaked");
        if let Some((free, total)) = self.engine.draft_kv_blocks() {
            assert_eq!(free, total, "draft-model KV blocks leaked");
        }
        assert_eq!(self.counters.waiting.load(Ordering::Relaxed), 0, "waiting counter out of balance");
    }

    pub fn text(&self, s: &str) -> Vec<u32> {
        self.tokenizer.encode(s).unwrap()
    }
}

/// One request's side: its receiver and everything received so far.
pub struct Client {
    pub id: RequestId,
    pub prompt_len: usize,
    rx: Option<UnboundedReceiver<RequestEvent>>,
    pub events: Vec<RequestEvent>,
    pub submitted_at: usize,
    /// Step count at which the terminal event was first seen.
    pub ended_at: Option<usize>,
}

impl Client {
    /// The prompt logprobs received (`RequestEvent::PromptLogprobs`), checking there was at most
    /// one such event and that it came before every `Delta`.
    pub fn prompt_logprobs(&self) -> Option<Vec<specula_engine::TokenLogprob>> {
        let at: Vec<usize> = self.events.iter().enumerate().filter(|(_, e)| matches!(e, RequestEvent::PromptLogprobs { .. })).map(|(i, _)| i).collect();
        assert!(at.len() <= 1, "{}: {} PromptLogprobs events", self.id, at.len());
        let i = *at.first()?;
        assert!(!self.events[..i].iter().any(|e| matches!(e, RequestEvent::Delta { .. })), "{}: PromptLogprobs after a Delta", self.id);
        match &self.events[i] {
            RequestEvent::PromptLogprobs { logprobs, ranks } => {
                assert_eq!(ranks.len(), logprobs.len(), "{}: one rank per prompt logprob", self.id);
                for (e, &r) in logprobs.iter().zip(ranks) {
                    if let Some(at) = e.top.iter().position(|&(t, _)| t == e.token) {
                        assert!(r as usize <= at + 1, "{}: rank {r} but top position {}", self.id, at + 1);
                    } else {
                        assert!(r as usize > e.top.len(), "{}: rank {r} for a token outside the top {}", self.id, e.top.len());
                    }
                }
                Some(logprobs.clone())
            }
            _ => unreachable!(),
        }
    }
}

/// How a request ended, after the protocol checks.
#[derive(Clone, Debug, PartialEq)]
pub enum End {
    Finished(FinishReason),
    Failed(String),
}

impl Client {
    pub fn drain(&mut self, step: usize) {
        if let Some(rx) = self.rx.as_mut() {
            while let Ok(ev) = rx.try_recv() {
                self.events.push(ev);
            }
        }
        if self.ended_at.is_none() && self.events.iter().any(is_terminal) {
            self.ended_at = Some(step);
        }
    }

    /// Drops the receiver, as a client that disconnects does.
    pub fn disconnect(&mut self) {
        self.rx = None;
    }

    pub fn is_done(&self) -> bool {
        self.events.iter().any(is_terminal)
    }

    /// Tokens streamed in deltas.
    pub fn tokens(&self) -> Vec<u32> {
        specula_engine::api::streamed_tokens(&self.events)
    }

    /// Text streamed in deltas.
    pub fn text(&self) -> String {
        self.events
            .iter()
            .map(|e| match e {
                RequestEvent::Delta { text, .. } => text.as_str(),
                _ => "",
            })
            .collect()
    }

    /// Checks the event protocol and returns how the request ended: deltas only before exactly
    /// one terminal event, which is last; `Finished` counts match what was streamed.
    pub fn end(&self) -> End {
        let terminals: Vec<usize> = self.events.iter().enumerate().filter(|(_, e)| is_terminal(e)).map(|(i, _)| i).collect();
        assert_eq!(terminals.len(), 1, "{}: expected exactly one Finished/Failed, got {:?}", self.id, self.events);
        assert_eq!(terminals[0], self.events.len() - 1, "{}: events after the terminal one: {:?}", self.id, self.events);
        match self.events.last().unwrap() {
            RequestEvent::Finished { reason, prompt_tokens, completion_tokens, cached_tokens } => {
                assert_eq!(*prompt_tokens, self.prompt_len, "{}: prompt_tokens", self.id);
                assert!(*cached_tokens <= *prompt_tokens, "{}: more prompt tokens cached than sent", self.id);
                assert_eq!(*completion_tokens, self.tokens().len(), "{}: completion_tokens != tokens streamed", self.id);
                End::Finished(*reason)
            }
            RequestEvent::Failed { message } => {
                assert!(self.tokens().is_empty() || !message.is_empty(), "{}: failure without a message", self.id);
                End::Failed(message.clone())
            }
            RequestEvent::Delta { .. } | RequestEvent::PromptLogprobs { .. } => unreachable!(),
        }
    }

    /// The request's generated tokens, after checking it finished (not failed) for `reason`.
    pub fn finished_tokens(&self, reason: FinishReason) -> Vec<u32> {
        assert_eq!(self.end(), End::Finished(reason), "{}: events {:?}", self.id, self.events);
        self.tokens()
    }
}

fn is_terminal(e: &RequestEvent) -> bool {
    matches!(e, RequestEvent::Finished { .. } | RequestEvent::Failed { .. })
}

/// Every event of one request from its channel, up to its end (`Finished` or `Failed`).
pub async fn collect_events(mut rx: tokio::sync::mpsc::UnboundedReceiver<RequestEvent>) -> Vec<RequestEvent> {
    let mut evs = Vec::new();
    while let Some(e) = rx.recv().await {
        let end = is_terminal(&e);
        evs.push(e);
        if end {
            break;
        }
    }
    evs
}

/// Deterministic token ids in the byte range (no control tokens), different per `salt`.
pub fn prompt(len: usize, salt: u64) -> Vec<u32> {
    let mut state = salt.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    (0..len)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 33) % 256) as u32
        })
        .collect()
}

/// Greedy, EOS ignored: always exactly `max_tokens` tokens (unless the context fills).
pub fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_tokens) }
}

pub fn seeded(max_tokens: usize, temperature: f32, seed: u64) -> SamplingParams {
    SamplingParams { temperature, seed: Some(seed), max_tokens, ignore_eos: true, ..Default::default() }
}

/// A draft-model speculation config with the tests' cost figures (see `Harness::on_with`), the
/// draft's weights as stored (a self draft is then the target itself).
fn draft_spec(k: usize) -> SpecConfig {
    SpecConfig { draft_cost: Some(0.1), verify_cost_per_token: Some(0.05), draft_weights: DraftWeights::Stored, ..SpecConfig::new(SpecMethod::Draft, k) }
}

/// Runs `p` on `h` among 15 others that arrive two per step around it (it arrives 6th: greedy,
/// seeded and top-k-sampled neighbours of assorted lengths); returns its tokens and checks every
/// other request finished properly and the crowd shared batches.
pub fn in_a_crowd(mut h: Harness, p: Vec<u32>, params: SamplingParams) -> Vec<u32> {
    let mut others: Vec<Client> = Vec::new();
    let mut target = None;
    for i in 0..16u64 {
        if i == 5 {
            target = Some(h.submit(p.clone(), params.clone()));
        } else {
            let other = match i % 3 {
                0 => greedy(20 + i as usize * 2),
                1 => seeded(30, 1.0, 1000 + i),
                _ => SamplingParams { temperature: 0.7, top_k: 20, max_tokens: 25 + i as usize, ignore_eos: true, ..Default::default() },
            };
            others.push(h.submit(prompt(3 + (i as usize * 29) % 120, 100 + i), other));
        }
        if i % 2 == 1 {
            h.step();
        }
    }
    let mut target = target.expect("the target was submitted");
    let mut refs: Vec<&mut Client> = others.iter_mut().collect();
    refs.push(&mut target);
    h.run(&mut refs, 3000);
    assert!(h.max_batch_seqs >= 6, "the crowd never shared a batch (at most {} sequences a step)", h.max_batch_seqs);
    for o in &others {
        o.finished_tokens(FinishReason::Length);
    }
    h.assert_idle_and_leak_free();
    target.finished_tokens(FinishReason::Length)
}
