//! Lockstep data parallelism never hangs (docs/architecture.md invariant 6): four in-process ranks on the
//! tiny model with one request, with requests arriving seconds apart on different ranks, with an
//! abort mid-stream, idle then a burst; exactly one metadata collective per step; greedy outputs
//! equal a single engine's. Every wait has a deadline, so a hang fails instead of stalling.

mod common;
mod dp_support;

use common::{greedy, prompt, TinyModel};
use dp_support::*;
use specula_engine::dp::{CollectiveKind, CountingComm, LocalGroup, RankStats};
use specula_engine::{FinishReason, RequestEvent};
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
    let refused = group.rank_handles[3].submit(specula_engine::GenerateRequest { id: late, prompt: prompt(5, 1), params: greedy(5), events: tx });
    assert!(shutdown_and_join(group).iter().all(|r| r.is_ok()));
    assert_eq!(s.finished(FinishReason::Length).len(), 50, "in-flight work finishes within the grace period");
    if refused.is_ok() {
        assert!(matches!(late_rx.try_recv(), Ok(RequestEvent::Failed { .. })), "a request arriving during shutdown is refused");
    }
}
