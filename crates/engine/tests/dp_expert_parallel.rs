//! Expert-parallel MoE in lockstep data parallelism: a tiny random MoE model (8 experts, top-2)
//! gives the same greedy tokens as one plain engine at DP=1, 2 and 4 with each rank holding 1/N
//! of the experts (batch invariance across the exchange), with concurrent requests, fewer
//! requests than ranks and requests on one rank only; the step agreement stays one collective
//! per step while the MoE layers exchange tokens; bad configurations fail at start-up. Every
//! wait has a deadline (dp_support::HANG).

mod common;
mod dp_support;

use common::{greedy, prompt};
use dp_support::*;
use specula_engine::dp::expert::{enable_local_expert_parallel, CommExchange};
use specula_engine::dp::{spawn_lockstep, spawn_replicas, CollectiveKind, CountingComm, DpGroup, LocalGroup, RankSetup, RankStats};
use specula_engine::{spawn_engine, FinishReason, SamplingParams};
use specula_model::testing::{write_tiny_moe, GgmlDType, TinyMoe, TinySpec};
use specula_model::{load_model, FeedForward, Tokenizer};
use std::path::{Path, PathBuf};
use std::sync::Arc;

struct TinyMoeModel {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

fn tiny_moe() -> TinyMoeModel {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("moe.gguf");
    let spec = TinySpec { seed: 21, weight_format: GgmlDType::Q4_1, moe: Some(TinyMoe { experts: 8, used: 2, ..Default::default() }), ..Default::default() };
    write_tiny_moe(&path, &spec).expect("write tiny MoE");
    TinyMoeModel { _dir: dir, path }
}

fn setups(path: &Path, n: usize) -> (Vec<RankSetup>, Arc<Tokenizer>) {
    let mut tokenizer = None;
    let ranks = (0..n)
        .map(|_| {
            let loaded = load_model(path).expect("load tiny MoE");
            tokenizer.get_or_insert(Arc::new(loaded.tokenizer));
            RankSetup::new(loaded.model)
        })
        .collect();
    (ranks, tokenizer.expect("n >= 1"))
}

/// A lockstep group of `n` ranks, each holding 1/n of the experts.
fn expert_parallel(path: &Path, n: usize) -> DpGroup {
    let (mut ranks, tokenizer) = setups(path, n);
    enable_local_expert_parallel(&mut ranks).expect("expert parallel");
    for r in &ranks {
        let FeedForward::Moe(f) = &r.model.layers[0].ffn else { panic!("dense layer") };
        assert_eq!(f.experts.iter().filter(|e| e.is_some()).count(), 8 / n, "each rank holds 1/{n} of the experts");
    }
    spawn_lockstep(ranks, LocalGroup::new(n), tokenizer, dp_config(n)).expect("start lockstep group")
}

/// Each request's tokens from one plain engine holding every expert: the reference.
fn single_engine(path: &Path, reqs: &[(Vec<u32>, SamplingParams)]) -> Vec<Vec<u32>> {
    let loaded = load_model(path).unwrap();
    let (h, join) = spawn_engine(loaded.model, Arc::new(loaded.tokenizer), dp_config(1), None).unwrap();
    let mut streams: Vec<Stream> = reqs.iter().map(|(p, params)| submit(&h, p.clone(), params.clone())).collect();
    let out = streams.iter_mut().map(|s| s.finished(FinishReason::Length)).collect();
    h.shutdown();
    drop(h);
    join.join().unwrap();
    out
}

#[test]
fn greedy_tokens_are_the_same_at_dp1_dp2_dp4_with_expert_parallel() {
    let _serial = serial();
    let m = tiny_moe();
    let reqs: Vec<_> = (0..6).map(|i| (prompt(9 + 23 * i, 40 + i as u64), greedy(12 + 3 * i))).collect();
    let expected = single_engine(&m.path, &reqs);
    assert!(expected.iter().any(|t| t.iter().collect::<std::collections::HashSet<_>>().len() > 3), "degenerate outputs prove nothing");
    for n in [1, 2, 4] {
        let group = expert_parallel(&m.path, n);
        let started = std::time::Instant::now();
        // all at once through the router: batches mix prefill and decode on every rank
        let mut streams: Vec<_> = reqs.iter().map(|(p, params)| submit(&group.handle, p.clone(), params.clone())).collect();
        for (i, (s, want)) in streams.iter_mut().zip(&expected).enumerate() {
            assert_eq!(&s.finished(FinishReason::Length), want, "DP={n}: request {i} differs from the single engine");
        }
        let wall = started.elapsed();
        let stats = group.stats.clone();
        assert!(shutdown_and_join(group).iter().all(|r| r.is_ok()), "DP={n}: a rank failed");
        let in_collectives: Vec<String> = stats.iter().map(|s| format!("{:.0}%", 100.0 * s.collective_time().as_secs_f64() / wall.as_secs_f64())).collect();
        eprintln!("DP={n} expert parallel: 6 requests in {wall:.2?}; time in collectives (step agreement + MoE exchanges, waiting for the slowest rank included) per rank: {in_collectives:?}");
        let busy = stats.iter().filter(|s| RankStats::get(&s.steps) > 0).count();
        assert!(busy >= n.min(2), "DP={n}: the router should have used several ranks ({busy} busy)");
    }
}

#[test]
fn fewer_requests_than_ranks_and_requests_on_one_rank_only_finish_with_single_engine_tokens() {
    let _serial = serial();
    let m = tiny_moe();
    let reqs: Vec<_> = (0..3).map(|i| (prompt(30 + 11 * i, 70 + i as u64), greedy(20))).collect();
    let expected = single_engine(&m.path, &reqs);
    let group = expert_parallel(&m.path, 4);
    // one request on rank 3: ranks 0-2 only run dummy batches, yet hold 3/4 of its experts
    let mut one = submit(&group.rank_handles[3], reqs[0].0.clone(), reqs[0].1.clone());
    assert_eq!(one.finished(FinishReason::Length), expected[0]);
    // then two requests, both on rank 1
    let mut two: Vec<_> = reqs[1..].iter().map(|(p, params)| submit(&group.rank_handles[1], p.clone(), params.clone())).collect();
    for (s, want) in two.iter_mut().zip(&expected[1..]) {
        assert_eq!(&s.finished(FinishReason::Length), want);
    }
    let stats = group.stats.clone();
    assert!(shutdown_and_join(group).iter().all(|r| r.is_ok()));
    assert_eq!(RankStats::get(&stats[2].steps), 0);
    assert!(RankStats::get(&stats[2].dummy_steps) > 0, "rank 2 had no request and joined every step with dummy batches");
    assert!(stats.iter().all(|s| s.collective_time() > std::time::Duration::ZERO));
}

#[test]
fn the_step_agreement_stays_one_collective_while_moe_layers_exchange_tokens() {
    let _serial = serial();
    let m = tiny_moe();
    let n = 2;
    let (mut ranks, tokenizer) = setups(&m.path, n);
    // count the exchanges too: each rank's exchange over a counting in-process group
    let mut exchange_counts = Vec::new();
    for (r, c) in ranks.iter_mut().zip(LocalGroup::new(n)) {
        let c = CountingComm::new(c);
        exchange_counts.push(c.counts());
        r.model.enable_expert_parallel(Arc::new(CommExchange::new(c))).unwrap();
    }
    let layers = ranks[0].model.config.n_layers as u64;
    let metadata: Vec<_> = LocalGroup::new(n).into_iter().map(CountingComm::new).collect();
    let meta_counts: Vec<_> = metadata.iter().map(|c| c.counts()).collect();
    let group = spawn_lockstep(ranks, metadata, tokenizer, dp_config(n)).unwrap();
    let mut a = submit(&group.rank_handles[0], prompt(70, 1), greedy(10));
    let mut b = submit(&group.rank_handles[0], prompt(5, 2), greedy(25));
    a.finished(FinishReason::Length);
    b.finished(FinishReason::Length);
    let stats = group.stats.clone();
    assert!(shutdown_and_join(group).iter().all(|r| r.is_ok()));
    for r in 0..n {
        let agreements = RankStats::get(&stats[r].agreements);
        let c = &meta_counts[r];
        assert_eq!(c.get(CollectiveKind::AllReduceSum), agreements, "rank {r}: one metadata all-reduce per agreement");
        // the start-up configuration check is the only other collective on the metadata group
        assert_eq!(
            c.total() - c.get(CollectiveKind::AllReduceSum),
            c.get(CollectiveKind::AllReduceMax) + c.get(CollectiveKind::Broadcast) + c.get(CollectiveKind::AllGather) + c.get(CollectiveKind::Barrier)
        );
        assert_eq!(c.get(CollectiveKind::AllToAll), 0, "MoE traffic stays off the metadata group");
        // every step with tokens anywhere: one all-gather and one all-to-all per MoE layer on every rank
        let stepped = RankStats::get(&stats[r].steps) + RankStats::get(&stats[r].dummy_steps);
        let x = &exchange_counts[r];
        assert!(stepped > 0);
        assert_eq!(x.get(CollectiveKind::AllGather), stepped * layers, "rank {r}");
        assert_eq!(x.get(CollectiveKind::AllToAll), stepped * layers, "rank {r}");
        assert_eq!(x.total(), 2 * stepped * layers, "rank {r}");
    }
    assert_eq!(RankStats::get(&stats[1].steps), 0, "rank 1 had no requests: all its exchanges came from dummy batches");
}

#[test]
fn bad_expert_parallel_configurations_fail_at_start_up() {
    let _serial = serial();
    let m = tiny_moe();
    // 8 experts over 3 ranks
    let (mut ranks, _) = setups(&m.path, 3);
    let e = enable_local_expert_parallel(&mut ranks).unwrap_err().to_string();
    assert!(e.contains("8 experts") && e.contains("3 ranks"), "{e}");
    // a dense model
    let dense = common::TinyModel::new();
    let (mut ranks, _) = setups(&dense.path, 2);
    let e = enable_local_expert_parallel(&mut ranks).unwrap_err().to_string();
    assert!(e.contains("dense"), "{e}");
    // replica mode cannot run expert parallel
    let (mut ranks, tokenizer) = setups(&m.path, 2);
    enable_local_expert_parallel(&mut ranks).unwrap();
    let e = spawn_replicas(ranks, tokenizer, dp_config(2)).err().expect("refused").to_string();
    assert!(e.contains("lockstep"), "{e}");
    // ranks that disagree on expert parallelism (one rank without it) fail the start-up check
    let (mut ranks, tokenizer) = setups(&m.path, 2);
    let comm = LocalGroup::new(2).remove(0);
    ranks[0].model.enable_expert_parallel(Arc::new(CommExchange::new(comm))).unwrap();
    let e = spawn_lockstep(ranks, LocalGroup::new(2), tokenizer, dp_config(2)).err().expect("refused").to_string();
    assert!(e.contains("disagree"), "{e}");
}

/// Forwards to a real exchange but panics inside the `panic_at`-th all-gather (counted over the
/// rank's life): a rank failing half-way through its forward pass.
struct PanickingExchange {
    inner: CommExchange<specula_engine::dp::LocalComm>,
    gathers: std::sync::atomic::AtomicUsize,
    panic_at: usize,
}

impl specula_model::ExpertExchange for PanickingExchange {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn begin_step(&self, rows: usize) {
        self.inner.begin_step(rows)
    }
    fn step_rows(&self) -> usize {
        self.inner.step_rows()
    }
    fn exchanges_this_step(&self) -> usize {
        self.inner.exchanges_this_step()
    }
    fn all_gather(&self, local: &[f32], out: &mut [f32]) -> Result<(), specula_model::ExchangeError> {
        if self.gathers.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1 == self.panic_at {
            panic!("injected failure inside an expert exchange");
        }
        self.inner.all_gather(local, out)
    }
    fn all_to_all(&self, send: &[f32], recv: &mut [f32]) -> Result<(), specula_model::ExchangeError> {
        self.inner.all_to_all(send, recv)
    }
    fn abort(&self) {
        self.inner.abort()
    }
}

#[test]
fn a_rank_panicking_inside_an_expert_exchange_stops_the_group_without_a_hang() {
    use specula_engine::dp::Communicator as _;
    let _serial = serial();
    let m = tiny_moe();
    let n = 2;
    let (mut ranks, tokenizer) = setups(&m.path, n);
    for (r, c) in ranks.iter_mut().zip(LocalGroup::new(n)) {
        // rank 1 panics in the second layer's all-gather of the 6th forward pass (2 MoE layers)
        let panic_at = if c.rank() == 1 { 2 * 5 + 2 } else { usize::MAX };
        let x = PanickingExchange { inner: CommExchange::new(c), gathers: 0.into(), panic_at };
        r.model.enable_expert_parallel(Arc::new(x)).unwrap();
    }
    let group = spawn_lockstep(ranks, LocalGroup::new(n), tokenizer, dp_config(n)).unwrap();
    let mut a = submit(&group.rank_handles[0], prompt(20, 1), greedy(40));
    let mut b = submit(&group.rank_handles[1], prompt(9, 2), greedy(40));
    for s in [&mut a, &mut b] {
        match s.wait_end() {
            specula_engine::RequestEvent::Failed { message } => assert!(!message.is_empty()),
            other => panic!("{}: expected a failure, got {other:?}", s.id),
        }
        assert!(s.tokens().len() < 40);
    }
    // every rank leaves the loop with an error, within the deadline
    let results = join_within(group);
    assert!(results.iter().all(|r| r.is_err()), "{results:?}");
}
