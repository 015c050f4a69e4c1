//! Replica data parallelism: N independent engines behind one routed handle. Each request's
//! output equals a single engine's, load spreads over the ranks, aborts reach the owning rank,
//! shutdown stops every rank, and a rank that dies makes the group's handle say so.

mod common;
mod dp_support;

use common::{greedy, prompt, seeded, TinyModel};
use dp_support::*;
use specula_engine::dp::RankStats;
use specula_engine::fault::{FaultInjection, FaultKind, FaultPhase};
use specula_engine::{FinishReason, RequestEvent};
use std::time::{Duration, Instant};

#[test]
fn every_request_gets_the_single_engine_output_and_both_ranks_work() {
    let _serial = serial();
    let m = TinyModel::new();
    let reqs: Vec<_> = (0..10).map(|i| (prompt(4 + 23 * i, 300 + i as u64), if i % 3 == 0 { seeded(20, 0.8, i as u64) } else { greedy(12 + 3 * i) })).collect();
    let expected = single_engine_outputs(&m, &reqs);
    let group = replicas(&m, 2);
    let mut streams: Vec<_> = reqs.iter().map(|(p, params)| submit(&group.handle, p.clone(), params.clone())).collect();
    for (i, (s, want)) in streams.iter_mut().zip(&expected).enumerate() {
        assert_eq!(&s.finished(FinishReason::Length), want, "request {i}");
    }
    assert_eq!(group.router.outstanding_tokens(), vec![0, 0], "finished requests leave no load");
    let stats = group.stats.clone();
    assert!(shutdown_and_join(group).iter().all(|r| r.is_ok()));
    for (r, s) in stats.iter().enumerate() {
        assert!(RankStats::get(&s.tokens) > 0, "rank {r} got no work");
    }
}

#[test]
fn an_abort_through_the_routed_handle_reaches_the_owning_rank() {
    let _serial = serial();
    let m = TinyModel::new();
    let group = replicas(&m, 3);
    let mut others: Vec<_> = (0..2).map(|i| submit(&group.handle, prompt(30, i), greedy(40))).collect();
    let mut target = submit(&group.handle, prompt(20, 9), greedy(200));
    target.wait_tokens(3);
    let owner = group.router.owner(target.id).expect("in flight");
    assert_eq!(owner, 2, "the third request goes to the third (idle) rank");
    group.handle.abort(target.id);
    assert!(matches!(target.wait_end(), RequestEvent::Finished { reason: FinishReason::Abort, .. }));
    for o in &mut others {
        assert_eq!(o.finished(FinishReason::Length).len(), 40);
    }
    assert!(shutdown_and_join(group).iter().all(|r| r.is_ok()));
}

#[test]
fn a_client_that_disconnects_frees_its_rank() {
    let _serial = serial();
    let m = TinyModel::new();
    let group = replicas(&m, 2);
    let mut s = submit(&group.handle, prompt(20, 1), greedy(200));
    s.wait_tokens(2);
    let owner = group.router.owner(s.id).expect("in flight");
    drop(s);
    let deadline = std::time::Instant::now() + HANG;
    while group.router.outstanding_tokens().iter().any(|&t| t > 0) {
        assert!(std::time::Instant::now() < deadline, "load never released");
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    // every KV block of the owning rank is back (its gauges, published when it went idle)
    while group.stats[owner].snapshot().kv_usage > 0.0 || group.stats[owner].snapshot().running > 0 {
        assert!(std::time::Instant::now() < deadline, "rank {owner} kept KV blocks after its client disconnected: {:?}", group.stats[owner].snapshot());
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    // and the rank serves the next request normally
    let mut next = submit(&group.handle, prompt(20, 2), greedy(10));
    assert_eq!(next.finished(FinishReason::Length).len(), 10);
    let stats = group.stats.clone();
    assert!(shutdown_and_join(group).iter().all(|r| r.is_ok()));
    // and when the ranks stopped, every block of every rank was back
    for (r, s) in stats.iter().enumerate() {
        let snap = s.snapshot();
        assert_eq!((snap.kv_usage, snap.running, snap.waiting), (0.0, 0, 0), "rank {r}");
    }
}

#[test]
fn a_dead_rank_makes_the_routed_handle_say_it_is_not_running() {
    let _serial = serial();
    let m = TinyModel::new();
    // rank 1's engine thread dies before its second step
    let fault = FaultInjection { step: 2, kind: FaultKind::Panic, phase: FaultPhase::EngineLoop };
    let group = replicas_with_fault(&m, 2, 1, fault);
    assert!(group.handle.is_running());
    let _s = submit(&group.rank_handles[1], prompt(8, 1), greedy(10));
    let t = Instant::now();
    // `/health` answers from this: it must stop saying 200 at once (the rank's second step
    // comes within milliseconds of the submit)
    while group.handle.is_running() {
        assert!(t.elapsed() < Duration::from_secs(2), "the group still says running 2 s after rank 1 was sent work that kills it");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(group.rank_handles[0].is_running(), "rank 0 did not die");
    let _ = shutdown_and_join(group);
}
