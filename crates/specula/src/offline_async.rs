//! `specula bench offline --async-compare`: the engine (no HTTP) decoding a batch of requests with
//! synchronous and with async scheduling, in the same run, and where each step's time goes
//! (schedule, prepare, finalize, forward, sample, propose, update, and the compute gap between
//! consecutive forward passes). The workload is the copy-this-passage prompts of `bench/copy_passages.jsonl`
//! with n-gram speculation (non-adaptive, so it speculates at every batch size), greedy. Both modes
//! run on one loaded engine, switched while idle, alternating; every run's outputs must equal the
//! warm-up run's.

use crate::bench::stats::Summary;
use crate::bench::workload::parse_prompts;
use anyhow::{Context, Result};
use specula_engine::handle::QueueCounters;
use specula_engine::speculative::{build_proposer, SpecConfig, SpecMethod};
use specula_engine::types::{RequestId, TokenId};
use specula_engine::{Engine, EngineConfig, GenerateRequest, RequestEvent, SamplingParams, StepTimings};
use specula_model::{load_model, ChatMessage, Tokenizer};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Per-step means of one run.
pub struct AsyncRow {
    pub threads: usize,
    pub async_scheduling: bool,
    pub output_tok_s: f64,
    pub steps: usize,
    pub mean: StepTimings,
    /// Mean wall time of a decode step (all phases plus the waits between them).
    pub step_wall: Duration,
}

const PASSAGES: &str = include_str!("../../../bench/copy_passages.jsonl");

/// One engine per thread count, loaded once; each run switches its scheduling mode while idle
/// (`Engine::set_async_scheduling`), so sync and async share the weights' and the KV's memory and
/// only the mode differs between them. No cross-request index: every run drafts from its own
/// prompt alone, as the first did.
struct Bench {
    engine: Engine,
    tokenizer: Arc<Tokenizer>,
    prompts: Vec<String>,
    threads: usize,
    max_tokens: usize,
    next_id: u64,
}

impl Bench {
    fn new(path: &Path, threads: usize, batch: usize, max_tokens: usize, k: usize) -> Result<Self> {
        let loaded = load_model(path)?;
        let tokenizer = Arc::new(loaded.tokenizer);
        let template = loaded.chat_template.context("the model has no chat template")?;
        let cfg = EngineConfig { max_num_seqs: batch, max_num_batched_tokens: 2048, max_model_len: 2048, threads, ..Default::default() };
        let spec = SpecConfig { adaptive: false, corpus_tokens: 0, ..SpecConfig::new(SpecMethod::Ngram, k) };
        let proposer = build_proposer(&spec, &loaded.model.config, &cfg)?;
        let engine = Engine::new(loaded.model, tokenizer.clone(), cfg, Arc::new(QueueCounters::default()))?.with_speculation(spec, proposer)?;
        let prompts = parse_prompts(PASSAGES, "bench/copy_passages.jsonl", batch, max_tokens)?
            .into_iter()
            .map(|p| template.render(&[ChatMessage { role: "user".into(), content: p.text }], true))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { engine, tokenizer, prompts, threads, max_tokens, next_id: 0 })
    }

    /// One run: the batch's requests decoding together in `async_scheduling` mode; timings
    /// averaged over the steps without prefill. Returns the row and every request's tokens.
    fn run(&mut self, async_scheduling: bool) -> Result<(AsyncRow, Vec<Vec<TokenId>>)> {
        self.engine.set_async_scheduling(async_scheduling)?;
        let mut rxs = Vec::new();
        for text in &self.prompts {
            self.next_id += 1;
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(self.max_tokens) };
            self.engine.add_request(GenerateRequest { id: RequestId(self.next_id), prompt: self.tokenizer.encode(text)?, params, events: tx, grammar: None });
            rxs.push(rx);
        }
        // the clients read their streams on their own thread, as a server's connections do
        let clients = std::thread::spawn(move || {
            rxs.into_iter()
                .map(|mut rx| {
                    let mut tokens = Vec::new();
                    while let Some(e) = rx.blocking_recv() {
                        if let RequestEvent::Delta { tokens: t, .. } = e {
                            tokens.extend(t);
                        }
                    }
                    tokens
                })
                .collect::<Vec<_>>()
        });
        let mut sum = StepTimings::default();
        let (mut gaps, mut host_gaps) = (Duration::ZERO, Duration::ZERO);
        let (mut steps, mut gap_steps, mut tokens) = (0usize, 0usize, 0usize);
        let mut wall = Duration::ZERO;
        while self.engine.has_work() {
            let t = Instant::now();
            let s = self.engine.step();
            let dt = t.elapsed();
            if !s.ran_forward || s.has_prefill {
                continue;
            }
            steps += 1;
            wall += dt;
            tokens += s.num_emitted;
            sum.schedule += s.timings.schedule;
            sum.prepare += s.timings.prepare;
            sum.finalize += s.timings.finalize;
            sum.forward += s.timings.forward;
            sum.sample += s.timings.sample;
            sum.propose += s.timings.propose;
            sum.update += s.timings.update;
            if let (Some(g), Some(h)) = (s.timings.gap, s.timings.host_gap) {
                gaps += g;
                host_gaps += h;
                gap_steps += 1;
            }
        }
        // the last step's events are sent; the requests' channels close as they finish
        let outputs = clients.join().map_err(|_| anyhow::anyhow!("the stream reader panicked"))?;
        let n = steps.max(1) as u32;
        let mean = StepTimings {
            schedule: sum.schedule / n,
            prepare: sum.prepare / n,
            finalize: sum.finalize / n,
            forward: sum.forward / n,
            sample: sum.sample / n,
            propose: sum.propose / n,
            update: sum.update / n,
            gap: Some(gaps / gap_steps.max(1) as u32),
            host_gap: Some(host_gaps / gap_steps.max(1) as u32),
        };
        let row = AsyncRow { threads: self.threads, async_scheduling, output_tok_s: tokens as f64 / wall.as_secs_f64(), steps, mean, step_wall: wall / n };
        Ok((row, outputs))
    }
}

pub fn run(path: &Path, threads: &[usize], batch: usize, max_tokens: usize, k: usize, repeat: usize) -> Result<Vec<AsyncRow>> {
    let mut rows = Vec::new();
    for &t in threads {
        let mut bench = Bench::new(path, t, batch, max_tokens, k)?;
        // a run not measured: first touches of the weights and KV, the pool's threads started
        let (_, expected) = bench.run(false)?;
        // interleaved on one engine, so drift in machine load hits both modes alike
        for _ in 0..repeat {
            for async_scheduling in [false, true] {
                let (row, outputs) = bench.run(async_scheduling)?;
                if outputs != expected {
                    anyhow::bail!("threads {t}, async {async_scheduling}: the outputs differ from the first run's (greedy: they must not)");
                }
                rows.push(row);
            }
        }
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!("\nasync scheduling — batch {batch} decode, ngram k={k} (non-adaptive), greedy, {max_tokens} tokens each; per decode step, ms");
    println!(
        "{:>7} {:>6} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>8} {:>10}",
        "threads", "mode", "tok/s", "schedule", "prepare", "finalize", "forward", "sample", "propose", "update", "gap", "idle gap", "step", "host share"
    );
    for r in &rows {
        let m = &r.mean;
        println!(
            "{:>7} {:>6} {:>9.1} {:>8.3} {:>8.3} {:>8.3} {:>8.2} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>9.3} {:>8.2} {:>9.2}%",
            r.threads,
            if r.async_scheduling { "async" } else { "sync" },
            r.output_tok_s,
            ms(m.schedule),
            ms(m.prepare),
            ms(m.finalize),
            ms(m.forward),
            ms(m.sample),
            ms(m.propose),
            ms(m.update),
            ms(m.gap.unwrap_or_default()),
            ms(m.host_gap.unwrap_or_default()),
            ms(r.step_wall),
            100.0 * host_share(r)
        );
    }
    for &t in threads {
        let pairs: Vec<(&AsyncRow, &AsyncRow)> = rows
            .chunks(2)
            .filter_map(|p| match p {
                [s, a] if s.threads == t => Some((s, a)),
                _ => None,
            })
            .collect();
        if pairs.is_empty() {
            continue;
        }
        let n = pairs.len() as f64;
        let mean = |f: &dyn Fn(&AsyncRow) -> f64, async_mode: bool| pairs.iter().map(|(s, a)| f(if async_mode { a } else { s })).sum::<f64>() / n;
        let idle = |r: &AsyncRow| ms(r.mean.host_gap.unwrap_or_default());
        let gap = |r: &AsyncRow| ms(r.mean.gap.unwrap_or_default());
        let tok = |r: &AsyncRow| r.output_tok_s;
        let ratios: Vec<f64> = pairs.iter().map(|(s, a)| a.output_tok_s / s.output_tok_s).collect();
        let ratio = ratios.iter().sum::<f64>() / n;
        let spread = (ratios.iter().map(|r| (r - ratio).powi(2)).sum::<f64>() / (n - 1.0).max(1.0)).sqrt();
        let median = Summary::of(&ratios).map_or(ratio, |s| s.p50);
        // the standard error of the mean ratio: what the pairs say about a real difference
        let stderr = spread / n.sqrt();
        let (gs, ga, hs, ha) = (mean(&gap, false), mean(&gap, true), mean(&idle, false), mean(&idle, true));
        println!(
            "threads {t} ({} pairs): forward-to-forward gap {gs:.3} -> {ga:.3} ms ({:+.0}%), compute idle gap {hs:.3} -> {ha:.3} ms ({:+.0}%), output tok/s {:.1} -> {:.1} (pairwise mean {:+.1}% ± {:.1}% sd, ± {:.1}% standard error, median {:+.1}%; sync host share {:.2}%)",
            pairs.len(),
            100.0 * (ga - gs) / gs.max(1e-9),
            100.0 * (ha - hs) / hs.max(1e-9),
            mean(&tok, false),
            mean(&tok, true),
            100.0 * (ratio - 1.0),
            100.0 * spread,
            100.0 * stderr,
            100.0 * (median - 1.0),
            100.0 * mean(&host_share, false)
        );
    }
    println!("(gap: end of one forward pass to the start of the next, sampling included; idle gap: end of one compute job (forward + sample + propose) to the next forward pass, i.e. compute waiting on host work; host share: the part of a step's wall time outside the compute job (forward, sample, propose), i.e. host work on the critical path; with async scheduling the schedule, prepare and update columns run on the host worker beside the forward pass, and only finalize stays between two forward passes)");
    Ok(rows)
}

/// The share of a decode step's wall time not spent in its compute job.
fn host_share(r: &AsyncRow) -> f64 {
    let m = &r.mean;
    let compute = m.forward + m.sample + m.propose;
    1.0 - compute.as_secs_f64() / r.step_wall.as_secs_f64().max(1e-12)
}
