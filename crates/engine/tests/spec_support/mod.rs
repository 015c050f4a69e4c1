//! Shared by the speculative-decoding tests: builds an `Engine` (with or without a proposer, the
//! proposer made by the production `build_proposer`), runs requests to completion by calling
//! `step()` directly, and collects each request's streamed tokens, logprobs and ending.

#![allow(dead_code)]

use specula_engine::handle::QueueCounters;
use specula_engine::speculative::{build_proposer, DraftWeights, Proposer, SpecConfig, SpecMethod};
use specula_engine::types::RequestId;
use specula_engine::{Engine, EngineConfig, FinishReason, GenerateRequest, RequestEvent, SamplingParams, TokenLogprob};
use specula_model::load_model;
use specula_model::testing::{write_tiny_llama, TinySpec};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// Writes the tiny random Llama with `seed` into `dir` (different seeds: different weights, the
/// same 259-token vocabulary).
pub fn tiny_model(dir: &Path, seed: u64) -> PathBuf {
    let path = dir.join(format!("tiny-{seed}.gguf"));
    write_tiny_llama(&path, &TinySpec { seed, ..Default::default() }).expect("write tiny model");
    path
}

/// Speculation settings for the tests: adaptive k off, so every decoding sequence is offered
/// `k` drafts every step and the verification path always runs.
/// The draft model's weights stay as stored: a model drafting for itself is then the target
/// itself, which several tests' exact acceptance counts rest on (the default re-encodes a draft
/// as Q4_0; `seeded_sampling_with_speculation_is_plain_decoding_token_for_token` runs that too).
pub fn spec_config(method: SpecMethod, k: usize, draft: Option<&Path>) -> SpecConfig {
    SpecConfig { adaptive: false, draft_model: draft.map(Path::to_path_buf), draft_weights: DraftWeights::Stored, ..SpecConfig::new(method, k) }
}

/// The engine settings of the tiny-model tests: 16 sequences, 64 blocks of 16, prefix caching.
pub fn tiny_config() -> EngineConfig {
    EngineConfig {
        max_num_seqs: 16,
        max_num_batched_tokens: 128,
        max_model_len: 256,
        block_size: 16,
        num_kv_blocks: 64,
        enable_prefix_caching: true,
        threads: 1,
        ..Default::default()
    }
}

/// An engine and the queue counters it shares with its (simulated) front end.
pub struct Rig {
    pub engine: Engine,
    counters: Arc<QueueCounters>,
    /// Compiles constraints before submission, as a front end does.
    tokenizer: Arc<specula_model::Tokenizer>,
    next_id: u64,
}

impl Rig {
    /// An engine on the model at `path`, speculating with the proposer `spec` names (if any),
    /// built by the production `build_proposer`.
    pub fn new(path: &Path, cfg: EngineConfig, spec: Option<SpecConfig>) -> Self {
        let proposer = spec.as_ref().map(|s| {
            let target = load_model(path).expect("load model");
            // the loaded target, not only its config: the mtp proposer reads its weights
            build_proposer(s, &target.model, &cfg).expect("build proposer")
        });
        Self::with_proposer(path, cfg, spec.zip(proposer))
    }

    /// An engine on the model at `path` with an explicitly built proposer.
    pub fn with_proposer(path: &Path, cfg: EngineConfig, spec: Option<(SpecConfig, Box<dyn Proposer>)>) -> Self {
        let loaded = load_model(path).expect("load model");
        let counters = Arc::new(QueueCounters::default());
        let tokenizer = Arc::new(loaded.tokenizer);
        let mut engine = Engine::new(loaded.model, tokenizer.clone(), cfg, counters.clone()).expect("engine");
        if let Some((c, p)) = spec {
            engine = engine.with_speculation(c, p).expect("speculation config");
        }
        Self { engine, counters, tokenizer, next_id: 1 }
    }

    /// Submits one request the way `EngineHandle::submit` does (counted as waiting first).
    pub fn submit(&mut self, prompt: Vec<u32>, params: SamplingParams) -> Client {
        let id = RequestId(self.next_id);
        self.next_id += 1;
        let (tx, rx) = unbounded_channel();
        self.counters.waiting.fetch_add(1, Ordering::Relaxed);
        // as the server does; a constraint that does not compile is submitted without a grammar,
        // which the engine refuses at admission
        let grammar = specula_engine::api::compile_params(&self.tokenizer, &params).ok().flatten();
        self.engine.add_request(GenerateRequest { id, prompt, params, events: tx, grammar });
        Client { id, rx: Some(rx), events: Vec::new(), step_sizes: Vec::new() }
    }

    /// Steps until the engine is idle (at most `max_steps`), draining every client after each step.
    pub fn run_until_idle(&mut self, clients: &mut [Client], max_steps: usize) {
        let mut n = 0;
        while self.engine.has_work() {
            assert!(n < max_steps, "engine still busy after {max_steps} steps");
            self.engine.step();
            n += 1;
            clients.iter_mut().for_each(Client::drain);
        }
        clients.iter_mut().for_each(Client::drain);
    }

    /// Submits every request at once, runs them all to the end, returns their outcomes in order.
    pub fn run_batch(&mut self, reqs: &[(Vec<u32>, SamplingParams)]) -> Vec<Outcome> {
        let mut clients: Vec<Client> = reqs.iter().map(|(p, s)| self.submit(p.clone(), s.clone())).collect();
        self.run_until_idle(&mut clients, 100_000);
        clients.iter().map(Client::outcome).collect()
    }

    /// Every target KV block, and every block of the proposer's own KV cache, is back in its
    /// pool, and nothing is counted as waiting.
    pub fn assert_no_leaks(&self) {
        assert!(!self.engine.has_work(), "engine still has work");
        assert_eq!(self.engine.num_free_blocks(), self.engine.num_total_blocks(), "target KV blocks leaked");
        assert_eq!(self.engine.num_seq_records(), 0, "sequence records leaked");
        if let Some((free, total)) = self.engine.draft_kv_blocks() {
            assert_eq!(free, total, "draft KV blocks leaked");
        }
        assert_eq!(self.counters.waiting.load(Ordering::Relaxed), 0, "waiting counter out of balance");
    }
}

/// What one request received.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<TokenLogprob>,
    /// Tokens received after each engine step that sent any (more than 1: verified draft tokens).
    pub step_sizes: Vec<usize>,
    pub end: End,
}

#[derive(Clone, Debug, PartialEq)]
pub enum End {
    Finished(FinishReason),
    Failed(String),
    /// The client dropped its receiver before the end.
    Disconnected,
}

/// One submitted request, from the client's side.
pub struct Client {
    pub id: RequestId,
    rx: Option<UnboundedReceiver<RequestEvent>>,
    pub events: Vec<RequestEvent>,
    step_sizes: Vec<usize>,
}

impl Client {
    /// Takes every event sent so far (called once per engine step).
    pub fn drain(&mut self) {
        let mut tokens = 0;
        if let Some(rx) = self.rx.as_mut() {
            while let Ok(ev) = rx.try_recv() {
                if let RequestEvent::Delta { tokens: t, .. } = &ev {
                    tokens += t.len();
                }
                self.events.push(ev);
            }
        }
        if tokens > 0 {
            self.step_sizes.push(tokens);
        }
    }

    /// Drops the receiver, as a client that goes away does.
    pub fn disconnect(&mut self) {
        self.rx = None;
    }

    pub fn is_done(&self) -> bool {
        self.events.iter().any(|e| !matches!(e, RequestEvent::Delta { .. }))
    }

    /// The events as an outcome, after checking the protocol: deltas, then exactly one terminal
    /// event, last (unless the client disconnected); `Finished` counts what was streamed.
    pub fn outcome(&self) -> Outcome {
        let mut out = Outcome { tokens: vec![], logprobs: vec![], step_sizes: self.step_sizes.clone(), end: End::Disconnected };
        for ev in &self.events {
            assert_eq!(out.end, End::Disconnected, "{}: event after the terminal one: {:?}", self.id, self.events);
            match ev {
                RequestEvent::Delta { tokens, logprobs, .. } => {
                    out.tokens.extend_from_slice(tokens);
                    out.logprobs.extend_from_slice(logprobs);
                }
                RequestEvent::Finished { reason, completion_tokens, .. } => {
                    assert_eq!(*completion_tokens, out.tokens.len(), "{}: completion_tokens != tokens streamed", self.id);
                    out.end = End::Finished(*reason);
                }
                RequestEvent::Failed { message } => out.end = End::Failed(message.clone()),
                RequestEvent::PromptLogprobs { .. } => {}
            }
        }
        assert!(self.rx.is_none() || out.end != End::Disconnected, "{}: no terminal event: {:?}", self.id, self.events);
        out
    }
}

/// Deterministic pseudo-random numbers (SplitMix64) for test scenarios: no dependency, and a
/// seed names one scenario on every platform.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next_u64() % (hi - lo) as u64) as usize
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 > 1.0 - p
    }
}
