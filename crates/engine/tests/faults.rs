//! Faults stay where they happen, and the ones that cannot be contained are visible:
//! - a panic (or error) while sampling one sequence fails that sequence only; its batch
//!   neighbours finish with the tokens they would have had without it, sync and async;
//! - a proposer that fails or panics costs that step's drafts, never a token: every sequence
//!   finishes with the tokens it has without the fault, speculation resumes after it, and no KV
//!   block (target or draft) leaks;
//! - an engine thread that dies marks its handle stopped (what `/health` answers from) and its
//!   handle refuses new work at once.

mod common;

use common::*;
use specula_engine::api::RequestEvent;
use specula_engine::fault::{FaultInjection, FaultKind, FaultPhase};
use specula_engine::{spawn_engine, EngineConfig, FinishReason, GenerateRequest, SamplingParams};
use specula_model::load_model;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn tokens(evs: &[RequestEvent]) -> Vec<u32> {
    evs.iter().flat_map(|e| if let RequestEvent::Delta { tokens, .. } = e { tokens.clone() } else { Vec::new() }).collect()
}

/// Runs two requests side by side (both in every step) on an engine with `fault`; returns their events.
fn two_side_by_side(fault: Option<FaultInjection>, async_scheduling: bool) -> (Vec<RequestEvent>, Vec<RequestEvent>) {
    let model = TinyModel::new();
    let loaded = load_model(&model.path).unwrap();
    let cfg = EngineConfig { max_num_seqs: 4, async_scheduling, fault_injection: fault, ..tiny_config() };
    let (handle, join) = spawn_engine(loaded.model, Arc::new(loaded.tokenizer), cfg, None).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let out = rt.block_on(async {
        let submit = |p: Vec<u32>, params: SamplingParams| {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            handle.submit(GenerateRequest { id: handle.next_request_id(), prompt: p, params, events: tx, grammar: None }).unwrap();
            rx
        };
        let a = submit(prompt(10, 1), greedy(12));
        let b = submit(prompt(10, 2), greedy(12));
        tokio::time::timeout(Duration::from_secs(60), async { tokio::join!(collect_events(a), collect_events(b)) })
            .await
            .expect("engine hung after an injected fault")
    });
    handle.shutdown();
    drop(handle);
    join.join().unwrap();
    out
}

fn sampling_one_sequence_fails_only_that_sequence(kind: FaultKind, async_scheduling: bool) {
    let case = format!("{kind:?}, async {async_scheduling}");
    let (clean_a, clean_b) = two_side_by_side(None, async_scheduling);
    assert!(matches!(clean_a.last(), Some(RequestEvent::Finished { reason: FinishReason::Length, .. })), "{case}: {clean_a:?}");
    // step 3 samples both (the prompts were prefilled together in step 1); the first one's sampling fails
    let fault = FaultInjection { step: 3, kind, phase: FaultPhase::SampleSequence };
    let (a, b) = two_side_by_side(Some(fault), async_scheduling);
    let failed: Vec<&Vec<RequestEvent>> = [&a, &b].into_iter().filter(|e| matches!(e.last(), Some(RequestEvent::Failed { .. }))).collect();
    assert_eq!(failed.len(), 1, "{case}: exactly one of the two fails: {a:?} / {b:?}");
    match failed[0].last() {
        Some(RequestEvent::Failed { message }) => {
            assert!(message.contains("sampling this sequence"), "{case}: {message}");
            assert!(message.contains(if kind == FaultKind::Panic { "panicked" } else { "injected fault" }), "{case}: {message}");
        }
        other => panic!("{case}: {other:?}"),
    }
    // the neighbour finishes with exactly the tokens it has without the fault
    let (survivor, clean) = if std::ptr::eq(failed[0], &a) { (&b, &clean_b) } else { (&a, &clean_a) };
    assert!(matches!(survivor.last(), Some(RequestEvent::Finished { reason: FinishReason::Length, completion_tokens: 12, .. })), "{case}: {survivor:?}");
    assert_eq!(tokens(survivor), tokens(clean), "{case}: the neighbour's output changed");
}

#[test]
fn a_panic_sampling_one_sequence_fails_only_that_sequence() {
    sampling_one_sequence_fails_only_that_sequence(FaultKind::Panic, false);
    sampling_one_sequence_fails_only_that_sequence(FaultKind::Panic, true);
}

#[test]
fn an_error_sampling_one_sequence_fails_only_that_sequence() {
    sampling_one_sequence_fails_only_that_sequence(FaultKind::Error, false);
}

/// Two greedy requests side by side on a self-drafting engine (k = 3, always drafting) with
/// `fault`: their tokens and the steps they took. Checks that the engine ends idle, leak-free.
fn self_draft_side_by_side(fault: Option<FaultInjection>, async_scheduling: bool, max_tokens: usize) -> (Vec<u32>, Vec<u32>, usize) {
    let model = TinyModel::new();
    let cfg = EngineConfig { max_num_seqs: 4, async_scheduling, fault_injection: fault, ..tiny_config() };
    let mut h = Harness::on_with(&model, cfg, Spec::SelfDraft(3), false);
    let mut a = h.submit(prompt(10, 1), greedy(max_tokens));
    let mut b = h.submit(prompt(10, 2), greedy(max_tokens));
    h.run(&mut [&mut a, &mut b], 200);
    h.assert_idle_and_leak_free();
    (a.finished_tokens(FinishReason::Length), b.finished_tokens(FinishReason::Length), h.steps)
}

fn a_failing_proposer_costs_drafts_not_tokens(kind: FaultKind, async_scheduling: bool) {
    let case = format!("{kind:?}, async {async_scheduling}");
    const MAX: usize = 30;
    let (plain_a, plain_b, plain_steps) = {
        let mut h = Harness::new(EngineConfig { max_num_seqs: 4, async_scheduling, ..tiny_config() });
        let mut a = h.submit(prompt(10, 1), greedy(MAX));
        let mut b = h.submit(prompt(10, 2), greedy(MAX));
        h.run(&mut [&mut a, &mut b], 200);
        (a.finished_tokens(FinishReason::Length), b.finished_tokens(FinishReason::Length), h.steps)
    };
    let (clean_a, clean_b, clean_steps) = self_draft_side_by_side(None, async_scheduling, MAX);
    assert_eq!((&clean_a, &clean_b), (&plain_a, &plain_b), "{case}: speculation changed greedy tokens");
    // the self draft agrees with the target: about k + 1 tokens a step
    assert!(clean_steps * 2 < plain_steps, "{case}: self drafting took {clean_steps} steps, {plain_steps} without");
    // the proposer fails after drafting for step 3 (early), or for step 5 (in the middle)
    for step in [3, 5] {
        let fault = FaultInjection { step, kind, phase: FaultPhase::Propose };
        let (a, b, steps) = self_draft_side_by_side(Some(fault), async_scheduling, MAX);
        assert_eq!((&a, &b), (&plain_a, &plain_b), "{case}, fault at step {step}: greedy tokens changed");
        // one step without drafts, and the draft model catches up again: far fewer steps than
        // without speculation (had the fault stopped speculation, it would be plain_steps)
        assert!(steps >= clean_steps, "{case}, fault at step {step}: {steps} steps, fewer than without the fault ({clean_steps})");
        assert!(steps * 2 < plain_steps, "{case}, fault at step {step}: speculation did not resume ({steps} steps, {plain_steps} without)");
    }
}

#[test]
fn a_panicking_proposer_costs_drafts_not_tokens() {
    a_failing_proposer_costs_drafts_not_tokens(FaultKind::Panic, false);
    a_failing_proposer_costs_drafts_not_tokens(FaultKind::Panic, true);
}

#[test]
fn a_failing_proposer_costs_drafts_not_tokens_too() {
    a_failing_proposer_costs_drafts_not_tokens(FaultKind::Error, false);
}

#[test]
fn a_dead_engine_thread_marks_its_handle_stopped_and_refuses_work() {
    let model = TinyModel::new();
    let loaded = load_model(&model.path).unwrap();
    let cfg = EngineConfig { fault_injection: Some(FaultInjection { step: 2, kind: FaultKind::Panic, phase: FaultPhase::EngineLoop }), ..tiny_config() };
    let (handle, join) = spawn_engine(loaded.model, Arc::new(loaded.tokenizer), cfg, None).unwrap();
    assert!(handle.is_running());
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    handle.submit(GenerateRequest { id: handle.next_request_id(), prompt: prompt(8, 1), params: greedy(10), events: tx, grammar: None }).unwrap();
    // the request's channel closes with the thread
    while rx.blocking_recv().is_some() {}
    let t = Instant::now();
    while handle.is_running() {
        assert!(t.elapsed() < Duration::from_secs(1), "the handle still says running 1 s after the engine thread died");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(join.join().is_err(), "the engine thread panicked");
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let refused = handle.submit(GenerateRequest { id: handle.next_request_id(), prompt: prompt(8, 2), params: greedy(4), events: tx, grammar: None });
    assert_eq!(refused, Err(specula_engine::handle::SubmitError::Closed));
    assert_eq!(handle.waiting(), 0, "a refused submit takes no waiting slot");
}
