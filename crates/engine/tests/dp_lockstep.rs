//! Lockstep data parallelism never hangs (docs/architecture.md invariant 6): four in-process ranks on the
//! tiny model with one request, with requests arriving seconds apart on different ranks, with an
//! abort mid-stream, idle then a burst; exactly one metadata collective per step; greedy outputs
//! equal a single engine's; a fault injected into one rank, in any phase of one step, fails only
//! that step's requests and every rank gives back every KV block. Every wait has a deadline, so
//! a hang fails instead of stalling.

mod common;
mod dp_support;

use common::{greedy, prompt, TinyModel};
use dp_support::*;
use specula_engine::dp::{CollectiveKind, CountingComm, DpGroup, LocalGroup, RankStats};
use specula_engine::fault::{FaultInjection, FaultKind, FaultPhase};
use specula_engine::{EngineConfig, FinishReason, RequestEvent, SamplingParams};
use std::time::{Duration, Instant};

fn get(c: &std::sync::atomic::AtomicU64) -> u64 {
    RankStats::get(c)
}

#[test]
fn one_request_on_four_ranks_finishes_while_the_other_ranks_run_dummy_batches() {
    let _serial = serial();
    let m = TinyModel::new();
    let p = prompt(70, 1);
    let expected = single_engine_outputs(&m, &[(p.clone(), greedy(30))]);
    let group = lockstep(&m, 4);
    let mut s = submit(&group.rank_handles[2], p, greedy(30));
    assert_eq!(s.finished(FinishReason::Length), expected[0]);
    let stats = group.stats.clone();
    assert!(shutdown_and_join(group).iter().all(|r| r.is_ok()));
    // rank 2 ran 2 prefill chunks (64 + 6 tokens) and 29 decode steps; every other rank ran a
    // dummy batch of the same padded size in each of those steps
    let real = get(&stats[2].steps);
    assert_eq!(real, 2 + 29);
    for (r, st) in stats.iter().enumerate() {
        assert_eq!(get(&st.agreements), get(&stats[0].agreements), "rank {r} agreed a different number of times");
        if r != 2 {
            assert_eq!((get(&st.steps), get(&st.dummy_steps)), (0, real), "rank {r}");
            assert_eq!(get(&st.padding_tokens), 70 + 29, "rank {r} padded to rank 2's batch sizes");
        }
    }
}

#[test]
fn requests_arriving_a_second_apart_on_different_ranks_all_finish_with_single_engine_outputs() {
    let _serial = serial();
    let m = TinyModel::new();
    let reqs: Vec<_> = (0..3).map(|i| (prompt(20 + 25 * i, 10 + i as u64), greedy(24))).collect();
    let expected = single_engine_outputs(&m, &reqs);
    let group = lockstep(&m, 4);
    let mut streams = Vec::new();
    for (i, (p, params)) in reqs.iter().enumerate() {
        if i > 0 {
            std::thread::sleep(Duration::from_millis(1000)); // the group goes idle in between
        }
        streams.push(submit(&group.rank_handles[[3, 0, 1][i]], p.clone(), params.clone()));
    }
    for (s, want) in streams.iter_mut().zip(&expected) {
        assert_eq!(&s.finished(FinishReason::Length), want);
    }
    let stats = group.stats.clone();
    assert!(shutdown_and_join(group).iter().all(|r| r.is_ok()));
    assert!(get(&stats[2].dummy_steps) > 0, "rank 2 never had a request and must have padded");
    assert!(get(&stats[0].idle_agreements) > 0, "the group idled between arrivals");
}

#[test]
fn an_abort_mid_stream_ends_that_request_and_the_group_goes_on() {
    let _serial = serial();
    let m = TinyModel::new();
    let group = lockstep(&m, 4);
    let mut long = submit(&group.handle, prompt(30, 3), greedy(200));
    let mut other = submit(&group.handle, prompt(40, 4), greedy(60));
    long.wait_tokens(5);
    group.handle.abort(long.id);
    match long.wait_end() {
        RequestEvent::Finished { reason: FinishReason::Abort, .. } => {}
        e => panic!("expected an abort, got {e:?}"),
    }
    assert!(long.tokens().len() < 200);
    assert_eq!(other.finished(FinishReason::Length).len(), 60);
    // the rank that lost its request keeps joining; a new request still runs
    let mut after = submit(&group.handle, prompt(10, 5), greedy(8));
    assert_eq!(after.finished(FinishReason::Length).len(), 8);
    assert!(shutdown_and_join(group).iter().all(|r| r.is_ok()));
}

#[test]
fn idle_ranks_use_almost_no_cpu_then_a_burst_is_served_with_single_engine_outputs() {
    let _serial = serial();
    let m = TinyModel::new();
    let reqs: Vec<_> = (0..12).map(|i| (prompt(5 + 17 * i, 100 + i as u64), greedy(16 + i))).collect();
    let expected = single_engine_outputs(&m, &reqs);
    let group = lockstep(&m, 4);
    std::thread::sleep(Duration::from_millis(200));
    let (cpu0, t0) = (process_cpu(), Instant::now());
    let agreements0 = get(&group.stats[0].agreements);
    std::thread::sleep(Duration::from_secs(2));
    let (cpu, wall) = (process_cpu() - cpu0, t0.elapsed());
    let idle_rounds = get(&group.stats[0].agreements) - agreements0;
    let share = cpu.as_secs_f64() / wall.as_secs_f64();
    eprintln!("4 idle lockstep ranks: {:.1}% of one core over {wall:.2?} ({idle_rounds} idle agreements)", share * 100.0);
    assert!(share < 0.10, "idle ranks burn {:.0}% of a core", share * 100.0);
    assert!(idle_rounds <= (wall.as_secs_f64() / dp_support_idle_poll()) as u64 + 10, "idle agreements not paced: {idle_rounds}");

    let t = Instant::now();
    let before: Vec<(u64, Duration)> = group.stats.iter().map(|s| (get(&s.agreements), s.collective_time())).collect();
    let mut streams: Vec<_> = reqs.iter().map(|(p, params)| submit(&group.handle, p.clone(), params.clone())).collect();
    for (s, want) in streams.iter_mut().zip(&expected) {
        assert_eq!(&s.finished(FinishReason::Length), want);
    }
    let burst = t.elapsed();
    let (agreements, collective) =
        group.stats.iter().zip(&before).fold((0, Duration::ZERO), |(n, d), (s, (n0, d0))| (n + get(&s.agreements) - n0, d + (s.collective_time() - *d0)));
    eprintln!(
        "burst of 12 served in {burst:.2?}: {} agreements per rank, {:.1} us per agreement per rank (waiting for the slowest rank included), {:.1}% of rank time in the collective",
        agreements / 4,
        collective.as_secs_f64() * 1e6 / agreements as f64,
        collective.as_secs_f64() * 100.0 / (4.0 * burst.as_secs_f64())
    );
    assert!(shutdown_and_join(group).iter().all(|r| r.is_ok()));
}

fn dp_support_idle_poll() -> f64 {
    specula_engine::dp::IDLE_POLL.as_secs_f64()
}

#[test]
fn exactly_one_metadata_collective_per_step_whatever_the_batch_holds() {
    let _serial = serial();
    let m = TinyModel::new();
    let comms: Vec<_> = LocalGroup::new(3).into_iter().map(CountingComm::new).collect();
    let counts: Vec<_> = comms.iter().map(|c| c.counts()).collect();
    let group = lockstep_on(&m, comms);
    // prefill chunks, decodes, mixed batches, a rank with nothing, idle stretches
    let mut a = submit(&group.rank_handles[0], prompt(150, 7), greedy(20));
    let mut b = submit(&group.rank_handles[1], prompt(3, 8), greedy(40));
    a.finished(FinishReason::Length);
    std::thread::sleep(Duration::from_millis(100));
    let mut c = submit(&group.rank_handles[1], prompt(90, 9), greedy(5));
    b.finished(FinishReason::Length);
    c.finished(FinishReason::Length);
    let stats = group.stats.clone();
    assert!(shutdown_and_join(group).iter().all(|r| r.is_ok()));
    for (r, (count, st)) in counts.iter().zip(&stats).enumerate() {
        let agreements = get(&st.agreements);
        assert!(agreements > 40, "rank {r}: only {agreements} agreements");
        assert_eq!(count.get(CollectiveKind::AllReduceSum), agreements, "rank {r}: one sum all-reduce per agreement");
        assert_eq!(
            agreements,
            get(&st.steps) + get(&st.dummy_steps) + get(&st.idle_agreements) + 1,
            "rank {r}: every agreement but the last (stop) runs a step"
        );
        // start-up configuration check: one broadcast + one max all-reduce; nothing else ever
        assert_eq!(count.get(CollectiveKind::Broadcast), 1, "rank {r}");
        assert_eq!(count.get(CollectiveKind::AllReduceMax), 1, "rank {r}");
        assert_eq!(count.total(), agreements + 2, "rank {r}: no other collective");
    }
    assert_eq!(get(&stats[2].steps), 0);
    assert!(get(&stats[2].dummy_steps) > 0);
}

#[test]
fn dropping_every_handle_stops_all_ranks_after_in_flight_work() {
    let _serial = serial();
    let m = TinyModel::new();
    let group = lockstep(&m, 3);
    let mut s = submit(&group.rank_handles[1], prompt(12, 1), greedy(30));
    // no shutdown command: the handles go away while the request runs
    let results = join_within(group);
    assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
    assert_eq!(s.finished(FinishReason::Length).len(), 30);
}

#[test]
fn shutdown_with_work_on_one_rank_drains_it_then_stops_every_rank() {
    let _serial = serial();
    let m = TinyModel::new();
    let group = lockstep(&m, 4);
    let mut s = submit(&group.rank_handles[3], prompt(40, 2), greedy(50));
    s.wait_tokens(1);
    group.rank_handles[0].shutdown(); // one rank asks; the group agrees
    let late = group.rank_handles[3].next_request_id();
    let (tx, mut late_rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::sleep(Duration::from_millis(50));
    let refused =
        group.rank_handles[3].submit(specula_engine::GenerateRequest { id: late, prompt: prompt(5, 1), params: greedy(5), events: tx, grammar: None });
    assert!(shutdown_and_join(group).iter().all(|r| r.is_ok()));
    assert_eq!(s.finished(FinishReason::Length).len(), 50, "in-flight work finishes within the grace period");
    if refused.is_ok() {
        assert!(matches!(late_rx.try_recv(), Ok(RequestEvent::Failed { .. })), "a request arriving during shutdown is refused");
    }
}

/// A fault injected into rank 1 alone, in one phase of its step 4 (prepare, forward pass,
/// sampling, apply), as an error or a panic (docs/architecture.md invariants 4, 5 and 6): exactly
/// that step's two requests fail, naming the injected fault; the request waiting beside them on
/// rank 1 and the one running on rank 0 meanwhile complete (rank 0's with a single engine's
/// tokens); rank 1 serves a request submitted afterwards; every KV block of every rank is back;
/// the group shuts down cleanly. Every wait is bounded (`HANG`), so a hung group fails the test.
#[test]
fn a_fault_injected_into_one_rank_in_any_phase_fails_only_that_step_and_every_rank_returns_every_block() {
    let _serial = serial();
    let m = TinyModel::new();
    let beside = (prompt(15, 9), greedy(24));
    let expected = single_engine_outputs(&m, std::slice::from_ref(&beside));
    for phase in [FaultPhase::Prepare, FaultPhase::Forward, FaultPhase::Sample, FaultPhase::Apply] {
        for kind in [FaultKind::Error, FaultKind::Panic] {
            lockstep_fault_case(&m, phase, kind, &beside, &expected[0]);
        }
    }
}

fn lockstep_fault_case(m: &TinyModel, phase: FaultPhase, kind: FaultKind, beside: &(Vec<u32>, SamplingParams), beside_tokens: &[u32]) {
    let case = format!("rank 1, step 4, {phase:?} {kind:?}");
    // two requests run per step on a rank; a third waits for a slot
    let cfg = EngineConfig { max_num_seqs: 2, ..dp_config(2) };
    let group = lockstep_with_fault(m, 2, cfg, 1, FaultInjection { step: 4, kind, phase });
    let mut other = submit(&group.rank_handles[0], beside.0.clone(), beside.1.clone());
    let mut a = submit(&group.rank_handles[1], prompt(10, 1), greedy(30));
    let mut b = submit(&group.rank_handles[1], prompt(10, 2), greedy(30));
    let mut c = submit(&group.rank_handles[1], prompt(10, 3), greedy(5));
    for x in [&mut a, &mut b] {
        match x.wait_end() {
            RequestEvent::Failed { message } => assert!(message.contains("injected"), "{case}: {message}"),
            e => panic!("{case}: a request of the failed step did not fail: {e:?}"),
        }
        assert!(x.tokens().len() < 30, "{case}");
    }
    assert_eq!(c.finished(FinishReason::Length).len(), 5, "{case}: the request waiting beside the failed step must survive");
    assert_eq!(other.finished(FinishReason::Length), beside_tokens, "{case}: the other rank's request");
    let mut after = submit(&group.rank_handles[1], prompt(12, 4), greedy(6));
    assert_eq!(after.finished(FinishReason::Length).len(), 6, "{case}: the faulty rank still serves");
    wait_until_every_block_is_back(&group, &case);
    let stats = group.stats.clone();
    let results = shutdown_and_join(group);
    assert!(results.iter().all(|r| r.is_ok()), "{case}: {results:?}");
    for (r, s) in stats.iter().enumerate() {
        let snap = s.snapshot();
        assert_eq!((snap.kv_usage, snap.running, snap.waiting), (0.0, 0, 0), "{case}: rank {r} after shutdown");
        assert_eq!(snap.agreements, stats[0].snapshot().agreements, "{case}: rank {r} agreed a different number of times");
    }
}

/// Waits (at most `HANG`) until every rank's gauges, published after each step, show no request
/// and no KV block held: what a request that ended left behind shows here, before shutdown
/// would free it.
fn wait_until_every_block_is_back(group: &DpGroup, case: &str) {
    let deadline = Instant::now() + HANG;
    for (r, s) in group.stats.iter().enumerate() {
        while s.snapshot().kv_usage > 0.0 || s.snapshot().running > 0 || s.snapshot().waiting > 0 {
            assert!(Instant::now() < deadline, "{case}: rank {r} still holds KV blocks or requests: {:?}", s.snapshot());
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}
