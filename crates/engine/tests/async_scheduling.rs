//! Async scheduling (`EngineConfig::async_scheduling`): step N+1 is scheduled and prepared while
//! step N's compute job runs on the async runner. Checked here:
//! - token-for-token identical outputs with it on and off, greedy and seeded sampling, with no
//!   speculation and with each proposer (ngram, draft model, mtp head), on 20 requests arriving
//!   staggered, some aborted mid-stream, some with logprobs and penalties; the same speculation
//!   counters (but for the one step async verifies for a client that went away, see
//!   `assert_same_spec_counters_but_the_disconnect`);
//! - the same under KV pressure (preemption) and with prefix-cache hits, greedy;
//! - an error or a panic injected into one step's job fails exactly that step's requests, with a
//!   clear message, and the engine keeps serving (through the engine thread, under a timeout);
//! - every KV block comes back after aborts, failures and a shutdown with a job in flight.

mod common;

use common::*;
use specula_engine::api::RequestEvent;
use specula_engine::fault::{FaultInjection, FaultKind, FaultPhase};
use specula_engine::speculative::SpecMetrics;
use specula_engine::{spawn_engine, EngineConfig, FinishReason, GenerateRequest, SamplingParams};
use specula_model::load_model;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Room for every decode's drafts in each step's token budget and no KV pressure, so the drafts a
/// sequence gets (and so a seeded sequence's random draws) do not depend on the schedule.
fn roomy(async_scheduling: bool) -> EngineConfig {
    EngineConfig { max_num_seqs: 8, max_num_batched_tokens: 256, max_model_len: 256, num_kv_blocks: 256, async_scheduling, ..tiny_config() }
}

#[derive(Clone, Copy, Debug)]
enum Mode {
    Greedy,
    Seeded,
}

/// What each of the 20 requests produced: its tokens and how it ended.
#[derive(Debug, PartialEq)]
struct Outcome {
    tokens: Vec<u32>,
    end: End,
    logprobs: Vec<Vec<(u32, u32)>>,
}

fn params(mode: Mode, i: usize) -> SamplingParams {
    let max_tokens = 12 + (i * 7) % 20;
    let mut p = match mode {
        Mode::Greedy => greedy(max_tokens),
        Mode::Seeded => seeded(max_tokens, 0.8, 1000 + i as u64),
    };
    if i % 4 == 1 {
        p.logprobs = Some(3);
    }
    if i % 5 == 2 {
        p.frequency_penalty = 0.5;
        p.repetition_penalty = 1.2;
    }
    if i % 6 == 3 {
        p.top_k = 20;
        p.top_p = 0.9;
    }
    p
}

/// 20 requests: a few at the start, then one every other step; requests 5 and 13 are aborted a
/// few steps after they arrive (an abort command and a client disconnect). Prompts repeat a motif
/// so the n-gram proposer finds matches.
fn scenario(model: &TinyModel, spec: Spec, mode: Mode, async_scheduling: bool, cfg: EngineConfig) -> (Vec<Outcome>, usize) {
    let run = scenario_run(model, spec, mode, async_scheduling, cfg, false, true);
    (run.outcomes, run.steps)
}

/// What a scenario run produced, with the engine's counters at the end.
struct Run {
    outcomes: Vec<Outcome>,
    steps: usize,
    /// Speculation counters (`None` without speculation).
    metrics: Option<SpecMetrics>,
    /// Steps prepared on the async runner beside a forward pass.
    ahead: u64,
}

/// `scenario`, with adaptive k (`adaptive`) and without the abort and the disconnect (`aborts`
/// false: every request runs to its end, so the whole run is deterministic).
fn scenario_run(model: &TinyModel, spec: Spec, mode: Mode, async_scheduling: bool, cfg: EngineConfig, adaptive: bool, aborts: bool) -> Run {
    let mut h = Harness::on_with(model, EngineConfig { async_scheduling, ..cfg }, spec, adaptive);
    let mut clients = Vec::new();
    let mut next = 0;
    let mut steps = 0;
    while next < 20 || h.engine.has_work() {
        assert!(steps < 2000, "scenario did not finish");
        while next < 20 && (next < 4 || steps >= 2 * next) {
            let motif = prompt(6, next as u64 % 3);
            let mut p: Vec<u32> = motif.iter().cycle().take(12 + next % 5).copied().collect();
            p.extend(prompt(4 + next % 9, next as u64));
            clients.push(h.submit(p, params(mode, next)));
            next += 1;
        }
        h.step();
        steps += 1;
        for c in clients.iter_mut() {
            c.drain(h.steps);
        }
        if aborts && clients.len() > 5 && steps == 2 * 5 + 3 {
            let id = clients[5].id;
            h.engine.abort(id);
        }
        if aborts && clients.len() > 13 && steps == 2 * 13 + 2 {
            clients[13].disconnect();
        }
    }
    h.assert_idle_and_leak_free();
    let outcomes = clients
        .iter()
        .map(|c| {
            let logprobs = c
                .events
                .iter()
                .flat_map(|e| match e {
                    RequestEvent::Delta { logprobs, .. } => logprobs.clone(),
                    _ => vec![],
                })
                .map(|l| std::iter::once((l.token, l.logprob.to_bits())).chain(l.top.iter().map(|t| (t.0, t.1.to_bits()))).collect())
                .collect();
            let end = if c.is_done() { c.end() } else { End::Failed("disconnected".into()) };
            Outcome { tokens: c.tokens(), end, logprobs }
        })
        .collect();
    Run { outcomes, steps, metrics: h.engine.spec_metrics().cloned(), ahead: h.engine.num_steps_prepared_ahead() }
}

/// Sync and async runs agree on every request. Aborted requests stop at a point that depends on
/// timing, so for those only "a prefix of the same tokens" is required.
fn assert_identical(spec: Spec, mode: Mode) {
    assert_identical_with(spec, mode, tiny_config().threads);
}

fn assert_identical_with(spec: Spec, mode: Mode, threads: usize) {
    let model = TinyModel::new();
    let sync_run = scenario_run(&model, spec, mode, false, EngineConfig { threads, ..roomy(false) }, false, true);
    let async_run = scenario_run(&model, spec, mode, true, EngineConfig { threads, ..roomy(true) }, false, true);
    let (sync, sync_steps, asyn, async_steps) = (sync_run.outcomes, sync_run.steps, async_run.outcomes, async_run.steps);
    assert!(sync_steps > 20 && async_steps > 20);
    // the async run really prepared steps beside forward passes (the sync one never does)
    assert_eq!(sync_run.ahead, 0);
    assert!(async_run.ahead * 2 > async_steps as u64, "{spec:?} {mode:?}: only {} of {async_steps} steps prepared ahead", async_run.ahead);
    let mut compared = 0;
    for (i, (a, b)) in sync.iter().zip(&asyn).enumerate() {
        if i == 5 || i == 13 {
            let n = a.tokens.len().min(b.tokens.len());
            assert_eq!(a.tokens[..n], b.tokens[..n], "{spec:?} {mode:?}: aborted request {i} diverged");
            continue;
        }
        assert_eq!(a.end, End::Finished(FinishReason::Length), "{spec:?} {mode:?} request {i}");
        assert_eq!(a, b, "{spec:?} {mode:?}: request {i} differs between sync and async scheduling");
        if i % 4 == 1 {
            assert_eq!(a.logprobs.len(), a.tokens.len(), "request {i} asked for logprobs");
        }
        compared += 1;
    }
    assert_eq!(compared, 18);
    assert_same_spec_counters_but_the_disconnect(spec, mode, sync_run.metrics.as_ref(), async_run.metrics.as_ref());
}

/// The speculation counters (drafts verified, draft tokens, accepted tokens, accepted per
/// position, forced tokens) of a scenario run with its abort and disconnect, sync against async.
/// With plain k, a sequence's drafts depend only on its own tokens, which are the same in both
/// runs, so every verification of the requests that run to their end is the same. The abort of
/// request 5 happens between two `step` calls and both modes verified the same steps of it by
/// then (async's step prepared ahead is settled without it). The client of request 13 goes away
/// between two calls too, but it is noticed when the host reaps disconnected clients: before
/// scheduling synchronously, and with async scheduling on the host job beside the next forward
/// pass, which runs the step already prepared for request 13 (its result is dropped). So async
/// may verify one draft more, of at most k tokens: its counters are sync's plus at most one
/// `record`, and nothing else may differ.
fn assert_same_spec_counters_but_the_disconnect(spec: Spec, mode: Mode, sync: Option<&SpecMetrics>, asyn: Option<&SpecMetrics>) {
    let k = match spec {
        Spec::None => {
            assert!(sync.is_none() && asyn.is_none());
            return;
        }
        Spec::Ngram(k) | Spec::SelfDraft(k) | Spec::OtherDraft(k) | Spec::Mtp(k) | Spec::Nextn(k) => k as u64,
    };
    let (ms, ma) = (sync.expect("speculating"), asyn.expect("speculating"));
    assert!(ms.num_draft_tokens > 0, "{spec:?} {mode:?}: never drafted, the comparison would prove nothing");
    let mut expected = ms.clone();
    if ma.num_drafts == ms.num_drafts + 1 {
        // the disconnected request's step prepared ahead (see above)
        let proposed = ma.num_draft_tokens.saturating_sub(ms.num_draft_tokens);
        let accepted = ma.num_accepted_tokens.saturating_sub(ms.num_accepted_tokens);
        assert!((1..=k).contains(&proposed), "{spec:?} {mode:?}: one more draft but {proposed} more draft tokens: {ms:?} vs {ma:?}");
        expected.record(proposed as usize, accepted as usize);
    }
    assert_eq!(
        &expected, ma,
        "{spec:?} {mode:?}: speculation counters differ between sync and async scheduling beyond the disconnected request's step prepared ahead"
    );
}

#[test]
fn async_equals_sync_greedy_no_speculation() {
    assert_identical(Spec::None, Mode::Greedy);
}

#[test]
fn async_equals_sync_seeded_no_speculation() {
    assert_identical(Spec::None, Mode::Seeded);
}

#[test]
fn async_equals_sync_ngram() {
    assert_identical(Spec::Ngram(3), Mode::Greedy);
    assert_identical(Spec::Ngram(3), Mode::Seeded);
}

/// One compute thread (on a machine with more cores the host job then has a core of its own).
#[test]
fn async_equals_sync_with_a_core_free_beside_the_compute() {
    assert_identical_with(Spec::Ngram(3), Mode::Greedy, 1);
    assert_identical_with(Spec::None, Mode::Seeded, 1);
}

#[test]
fn async_equals_sync_draft_model() {
    assert_identical(Spec::SelfDraft(3), Mode::Greedy);
    assert_identical(Spec::OtherDraft(2), Mode::Seeded);
}

#[test]
fn async_equals_sync_mtp_head() {
    assert_identical(Spec::Mtp(3), Mode::Greedy);
    assert_identical(Spec::Mtp(2), Mode::Seeded);
}

/// Adaptive k (the engine's default), and no abort or disconnect, so every request runs to its
/// end in both runs: identical tokens, ends and logprobs, identical speculation counters (drafts
/// verified and accepted, per position), and the async run really prepared its steps ahead.
fn assert_identical_adaptive(spec: Spec, mode: Mode) {
    let model = TinyModel::new();
    // A slot for every request: with adaptive k a sequence's drafts depend on how many decode
    // beside it, and async scheduling may admit a waiting request one step later than sync (a
    // sequence that ends in the running step holds its slot in the step scheduled ahead).
    let cfg = |async_scheduling| EngineConfig { max_num_seqs: 32, ..roomy(async_scheduling) };
    let sync = scenario_run(&model, spec, mode, false, cfg(false), true, false);
    let asyn = scenario_run(&model, spec, mode, true, cfg(true), true, false);
    assert_eq!((sync.outcomes.len(), asyn.outcomes.len()), (20, 20));
    for (i, (a, b)) in sync.outcomes.iter().zip(&asyn.outcomes).enumerate() {
        assert_eq!(a.end, End::Finished(FinishReason::Length), "{spec:?} {mode:?} request {i}");
        assert_eq!(a, b, "{spec:?} {mode:?} adaptive: request {i} differs between sync and async scheduling");
    }
    assert_eq!(sync.ahead, 0);
    assert!(asyn.ahead * 2 > asyn.steps as u64, "{spec:?} {mode:?}: only {} of {} steps prepared ahead", asyn.ahead, asyn.steps);
    let (ms, ma) = (sync.metrics.expect("speculating"), asyn.metrics.expect("speculating"));
    assert!(ms.num_draft_tokens > 0, "{spec:?} {mode:?}: adaptive k never drafted, the test would prove nothing");
    assert_eq!(ms, ma, "{spec:?} {mode:?}: speculation counters differ between sync and async scheduling");
}

#[test]
fn async_equals_sync_greedy_adaptive_k() {
    for spec in [Spec::Ngram(3), Spec::SelfDraft(3), Spec::OtherDraft(3)] {
        assert_identical_adaptive(spec, Mode::Greedy);
    }
}

#[test]
fn async_equals_sync_seeded_adaptive_k() {
    for spec in [Spec::Ngram(3), Spec::OtherDraft(2), Spec::Mtp(2)] {
        assert_identical_adaptive(spec, Mode::Seeded);
    }
}

/// Under KV pressure (preemption by recompute) and chunked prefill, with prefix-cache hits from
/// shared prompts: greedy outputs still match, nothing leaks. The speculation counters are not
/// compared here: a decode scheduled ahead reserves 1 + k slots, so the two modes run out of KV
/// blocks, and can preempt, at different steps, and a preempted sequence's recompute ends in a
/// prefill step that samples its next token without drafts, where the other mode may verify a
/// draft for the same token (the tokens stay the same; what is verified does not).
#[test]
fn async_equals_sync_under_preemption_and_chunking() {
    let model = TinyModel::new();
    for spec in [Spec::None, Spec::Ngram(2)] {
        let cfg = EngineConfig { max_num_seqs: 8, max_num_batched_tokens: 48, num_kv_blocks: 24, ..tiny_config() };
        let (sync, _) = scenario(&model, spec, Mode::Greedy, false, cfg.clone());
        let (asyn, _) = scenario(&model, spec, Mode::Greedy, true, cfg);
        for (i, (a, b)) in sync.iter().zip(&asyn).enumerate() {
            if i == 5 || i == 13 {
                continue;
            }
            assert_eq!(a, b, "{spec:?}: request {i} differs under preemption");
        }
    }
}

/// With async scheduling, a job that fails (error or panic) at step `at` fails the requests of
/// that step only; requests waiting outside it, and requests submitted later, complete.
fn fault_case(kind: FaultKind) {
    let model = TinyModel::new();
    let loaded = load_model(&model.path).unwrap();
    let tok = Arc::new(loaded.tokenizer);
    // two requests run per step; the third waits until a slot frees
    let cfg = EngineConfig {
        max_num_seqs: 2,
        async_scheduling: true,
        fault_injection: Some(FaultInjection { step: 4, kind, phase: FaultPhase::Prepare }),
        ..tiny_config()
    };
    let (handle, join) = spawn_engine(loaded.model, tok, cfg, None).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let deadline = Duration::from_secs(60);
        let submit = |p: Vec<u32>, params: SamplingParams| {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            handle.submit(GenerateRequest { id: handle.next_request_id(), prompt: p, params, events: tx, grammar: None }).unwrap();
            rx
        };
        let a = submit(prompt(10, 1), greedy(30));
        let b = submit(prompt(10, 2), greedy(30));
        let c = submit(prompt(10, 3), greedy(5));
        let (ea, eb, ec) = tokio::time::timeout(deadline, async { tokio::join!(collect_events(a), collect_events(b), collect_events(c)) })
            .await
            .expect("engine hung after an injected fault");
        for evs in [&ea, &eb] {
            match evs.last() {
                Some(RequestEvent::Failed { message }) => {
                    assert!(message.contains("step 4"), "message names the step: {message}");
                    assert!(message.contains(if kind == FaultKind::Panic { "panicked" } else { "injected fault" }), "{message}");
                }
                other => panic!("a request of the failed step did not fail: {other:?}"),
            }
        }
        assert!(matches!(ec.last(), Some(RequestEvent::Finished { reason: FinishReason::Length, .. })), "the waiting request must survive: {ec:?}");
        // the engine still serves
        let d = submit(prompt(12, 4), greedy(6));
        let ed = tokio::time::timeout(deadline, collect_events(d)).await.expect("engine hung");
        assert!(matches!(ed.last(), Some(RequestEvent::Finished { reason: FinishReason::Length, completion_tokens: 6, .. })), "{ed:?}");
    });
    handle.shutdown();
    drop(handle);
    join.join().unwrap();
}

#[test]
fn injected_error_fails_only_that_step() {
    fault_case(FaultKind::Error);
}

#[test]
fn injected_panic_fails_only_that_step() {
    fault_case(FaultKind::Panic);
}

/// A fault injected into one phase of step 4 (prepare, forward pass, sampling, apply), as an
/// error or a panic, with synchronous or async scheduling: exactly that step's two requests fail,
/// naming the injected fault; the request waiting beside them and one submitted after complete;
/// every KV block comes back.
fn fault_in_phase(model: &TinyModel, phase: FaultPhase, kind: FaultKind, async_scheduling: bool) {
    let case = format!("{phase:?} {kind:?} async={async_scheduling}");
    // two requests run per step; the third waits until a slot frees
    let cfg = EngineConfig { max_num_seqs: 2, async_scheduling, fault_injection: Some(FaultInjection { step: 4, kind, phase }), ..tiny_config() };
    let mut h = Harness::on(model, cfg, Spec::None);
    let mut a = h.submit(prompt(10, 1), greedy(30));
    let mut b = h.submit(prompt(10, 2), greedy(30));
    let mut c = h.submit(prompt(10, 3), greedy(5));
    h.run(&mut [&mut a, &mut b, &mut c], 500);
    for x in [&a, &b] {
        match x.end() {
            End::Failed(message) => assert!(message.contains("injected"), "{case}: {message}"),
            other => panic!("{case}: a request of the failed step did not fail: {other:?}"),
        }
        assert!(x.tokens().len() < 30, "{case}");
    }
    assert_eq!(c.finished_tokens(FinishReason::Length).len(), 5, "{case}: the waiting request must survive");
    h.assert_idle_and_leak_free();
    let mut d = h.submit(prompt(12, 4), greedy(6));
    h.run(&mut [&mut d], 100);
    assert_eq!(d.finished_tokens(FinishReason::Length).len(), 6, "{case}: the engine still serves");
    h.assert_idle_and_leak_free();
}

#[test]
fn an_injected_fault_in_any_phase_fails_only_that_step_and_returns_every_block() {
    let model = TinyModel::new();
    for phase in [FaultPhase::Prepare, FaultPhase::Forward, FaultPhase::Sample, FaultPhase::Apply] {
        for kind in [FaultKind::Error, FaultKind::Panic] {
            for async_scheduling in [false, true] {
                fault_in_phase(&model, phase, kind, async_scheduling);
            }
        }
    }
}

/// Failing everything with a job in flight, then waiting for it: every block is back, and the
/// engine (with its runner thread) drops promptly.
#[test]
fn fail_all_with_a_job_in_flight_leaks_nothing() {
    let model = TinyModel::new();
    let mut h = Harness::on(&model, roomy(true), Spec::Ngram(3));
    let mut clients: Vec<Client> = (0..6).map(|i| h.submit(prompt(30, i), greedy(40))).collect();
    for _ in 0..5 {
        h.step();
    }
    assert!(h.engine.has_work());
    h.engine.fail_all("shutting down");
    h.engine.discard_in_flight();
    for c in clients.iter_mut() {
        c.drain(h.steps);
        assert!(matches!(c.end(), End::Failed(_)));
    }
    h.assert_idle_and_leak_free();
    let t = Instant::now();
    drop(h);
    assert!(t.elapsed() < Duration::from_secs(5));
}

/// Shutdown through the engine thread while steps are in flight (grace 0): the thread returns
/// within a bounded time (its `Drop` joins the async runner's worker, so no thread outlives it)
/// and every request gets its terminal event.
#[test]
fn shutdown_with_a_job_in_flight_is_bounded_and_ends_every_request() {
    let model = TinyModel::new();
    let loaded = load_model(&model.path).unwrap();
    let tok = Arc::new(loaded.tokenizer);
    let cfg = EngineConfig { async_scheduling: true, shutdown_grace: Duration::ZERO, ..roomy(true) };
    let (handle, join) = spawn_engine(loaded.model, tok, cfg, None).unwrap();
    let mut rxs = Vec::new();
    for i in 0..6 {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        handle.submit(GenerateRequest { id: handle.next_request_id(), prompt: prompt(20, i), params: greedy(200), events: tx, grammar: None }).unwrap();
        rxs.push(rx);
    }
    // wait until tokens flow, so steps are being pipelined
    let t = Instant::now();
    let mut first = rxs[0].blocking_recv();
    while !matches!(first, Some(RequestEvent::Delta { .. })) {
        assert!(t.elapsed() < Duration::from_secs(30), "no tokens: {first:?}");
        first = rxs[0].blocking_recv();
    }
    let t = Instant::now();
    handle.shutdown();
    drop(handle);
    join.join().expect("engine thread panicked");
    assert!(t.elapsed() < Duration::from_secs(10), "shutdown took {:?}", t.elapsed());
    for mut rx in rxs {
        let mut last = None;
        while let Ok(e) = rx.try_recv() {
            last = Some(e);
        }
        assert!(matches!(last, Some(RequestEvent::Failed { .. } | RequestEvent::Finished { .. })), "{last:?}");
    }
}

/// A request that finishes (its length) in step N, or is aborted after it, is dropped from step
/// N+1 before that runs: with async scheduling the engine computes exactly the tokens it computes
/// synchronously, in as many forward passes, and streams the same tokens.
#[test]
fn finished_and_aborted_requests_are_not_computed_in_the_step_prepared_after_them() {
    let model = TinyModel::new();
    let run = |async_scheduling: bool| {
        let mut h = Harness::on(&model, roomy(async_scheduling), Spec::Ngram(3));
        let mut clients: Vec<Client> = (0..5).map(|i| h.submit(prompt(10 + i, i as u64), greedy(3 + 5 * i))).collect();
        let (mut forwards, mut tokens, mut calls) = (0, 0, 0);
        while h.engine.has_work() {
            assert!(calls < 500, "did not finish");
            let s = h.engine.step();
            forwards += s.ran_forward as usize;
            tokens += s.num_tokens;
            calls += 1;
            if calls == 6 {
                h.engine.abort(clients[4].id);
            }
        }
        for c in clients.iter_mut() {
            c.drain(calls);
        }
        h.assert_idle_and_leak_free();
        let outputs: Vec<Vec<u32>> = clients[..4].iter().map(|c| c.tokens()).collect();
        assert!(tokens > 0);
        (tokens, forwards, outputs, clients[4].end())
    };
    let (sync_tokens, sync_forwards, sync_out, sync_abort) = run(false);
    let (async_tokens, async_forwards, async_out, async_abort) = run(true);
    assert_eq!(sync_out, async_out);
    for (i, out) in sync_out.iter().enumerate() {
        assert_eq!(out.len(), 3 + 5 * i);
    }
    assert_eq!((sync_abort, async_abort), (End::Finished(FinishReason::Abort), End::Finished(FinishReason::Abort)));
    assert_eq!(sync_forwards, async_forwards, "forward passes");
    assert_eq!(sync_tokens, async_tokens, "tokens computed");
}

/// A request that arrives while the next step is already prepared (during a forward pass) joins
/// that step: its prefill runs in the very next forward pass, as without async scheduling.
#[test]
fn a_request_arriving_mid_stream_starts_in_the_next_forward_pass() {
    let model = TinyModel::new();
    for async_scheduling in [false, true] {
        let mut h = Harness::on(&model, roomy(async_scheduling), Spec::Ngram(3));
        let mut a = h.submit(prompt(12, 1), greedy(20));
        for _ in 0..4 {
            h.engine.step();
        }
        let mut b = h.submit(prompt(23, 2), greedy(5));
        let s = h.engine.step();
        assert!(s.ran_forward && s.has_prefill, "async {async_scheduling}: the new request's prefill did not run at once: {s:?}");
        assert_eq!(s.num_seqs, 2, "async {async_scheduling}");
        assert!(
            (23 + 1..=23 + 1 + 3).contains(&s.num_tokens),
            "async {async_scheduling}: its 23 prompt tokens beside the other's decode (1 + up to 3 drafts): {}",
            s.num_tokens
        );
        h.run(&mut [&mut a, &mut b], 200);
        h.assert_idle_and_leak_free();
    }
}

/// `Engine::set_async_scheduling` (what `bench offline --async-compare` uses to run both modes on
/// one loaded model): refused while a request is in flight, and a run switched between batches
/// gives what an engine that never switched gives (same batches, same prefix-cache state), with
/// its async batches really prepared ahead.
#[test]
fn scheduling_switches_between_batches_and_outputs_do_not_change() {
    let model = TinyModel::new();
    let batches: Vec<Vec<(Vec<u32>, SamplingParams)>> =
        (0..4).map(|b| (0..4).map(|i| (prompt(10 + i, (b % 2) as u64 * 10 + i as u64), greedy(10 + 3 * i))).collect()).collect();
    let run = |switch: bool| {
        let mut h = Harness::on_with(&model, roomy(false), Spec::Ngram(3), false);
        let mut outputs = Vec::new();
        for (b, batch) in batches.iter().enumerate() {
            if switch {
                h.engine.set_async_scheduling(b % 2 == 1).expect("idle between batches");
            }
            let mut clients: Vec<_> = batch.iter().map(|(p, params)| h.submit(p.clone(), params.clone())).collect();
            if switch && b == 1 {
                let refused = h.engine.set_async_scheduling(false).expect_err("a request is queued");
                assert!(refused.to_string().contains("idle"), "{refused}");
            }
            h.run(&mut clients.iter_mut().collect::<Vec<_>>(), 500);
            outputs.extend(clients.iter().map(|c| (c.tokens(), c.end())));
        }
        h.assert_idle_and_leak_free();
        (outputs, h.engine.num_steps_prepared_ahead())
    };
    let (plain, plain_ahead) = run(false);
    let (switched, ahead) = run(true);
    assert_eq!(plain_ahead, 0);
    assert!(ahead > 10, "the async batches prepared only {ahead} steps ahead");
    assert_eq!(switched, plain);
    assert!(plain.iter().all(|(_, e)| *e == End::Finished(FinishReason::Length)));
}
