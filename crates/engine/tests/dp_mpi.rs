//! The MPI communicator across real processes (needs the `mpi` feature and Open MPI). Each test
//! started normally relaunches itself under `mpirun -np 2` (with a deadline: a hang fails the
//! test) and checks that every process succeeded; under mpirun it runs the checks for real.

#![cfg(feature = "mpi")]

mod common;

use common::{greedy, prompt, TinyModel};
use specula_engine::dp::metadata::{agree, check_same_config, StepMetadata};
use specula_engine::dp::mpi::{launched_by_mpirun, MpiComm};
use specula_engine::dp::{Communicator, DpError, LockstepRank, RankStats};
use specula_engine::handle::EngineHandle;
use specula_engine::{Engine, EngineConfig, FinishReason, GenerateRequest, RequestEvent};
use specula_model::load_model;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Runs this test binary's test `name` in `n` MPI processes; panics unless all succeed in time.
fn relaunch_under_mpirun(name: &str, n: usize) {
    let exe = std::env::current_exe().expect("test binary path");
    let mut child = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", &n.to_string()])
        .arg(exe)
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env("OMPI_MCA_btl", "self,tcp,vader")
        .spawn()
        .expect("cannot run mpirun (install openmpi-bin)");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = child.try_wait().expect("wait for mpirun") {
            assert!(status.success(), "{name} failed under mpirun: {status}");
            return;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{name} did not finish under mpirun within 60 s (hang)");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn mpi_backend_without_mpirun_is_a_clear_start_up_error() {
    if launched_by_mpirun() {
        return;
    }
    let e = MpiComm::init().err().expect("refused outside mpirun");
    assert!(matches!(&e, DpError::Config(m) if m.contains("mpirun -np N")), "{e}");
}

#[test]
fn mpi_collectives_across_two_processes() {
    if !launched_by_mpirun() {
        return relaunch_under_mpirun("mpi_collectives_across_two_processes", 2);
    }
    let c = MpiComm::init().expect("MPI");
    assert_eq!(c.size(), 2);
    assert!(c.expect_size(3).is_err());
    let r = c.rank() as i64;
    let mut v = [r, 10 * r, 1];
    c.all_reduce_sum_i64(&mut v).unwrap();
    assert_eq!(v, [1, 10, 2]);
    let mut m = [r, -r];
    c.all_reduce_max_i64(&mut m).unwrap();
    assert_eq!(m, [1, 0]);
    let mut g = [0f32; 4];
    c.all_gather_f32(&[r as f32, 0.5], &mut g).unwrap();
    assert_eq!(g, [0.0, 0.5, 1.0, 0.5]);
    let send: Vec<f32> = (0..2).map(|j| 10.0 * r as f32 + j as f32).collect();
    let mut recv = [0f32; 2];
    c.all_to_all_f32(&send, &mut recv).unwrap();
    assert_eq!(recv, [r as f32, 10.0 + r as f32]);
    let mut b = if r == 1 { b"from rank one".to_vec() } else { Vec::new() };
    c.broadcast_bytes(1, &mut b).unwrap();
    assert_eq!(b, b"from rank one");
    c.barrier().unwrap();
    // the step agreement, many rounds, with rank-dependent loads
    let started = Instant::now();
    for step in 0..1000u64 {
        let local = StepMetadata { step, num_tokens: (step as usize + c.rank()) % 7, has_prefill: r == 0, has_work: true, ..Default::default() };
        let g = agree(&c, &local).unwrap();
        assert_eq!(g.per_rank_tokens, vec![step as usize % 7, (step as usize + 1) % 7]);
        assert_eq!((g.prefill_ranks, g.busy_ranks), (1, 2));
    }
    eprintln!("rank {r}: {:.1} us per MPI step agreement", started.elapsed().as_secs_f64() * 1e6 / 1000.0);
    // a configuration mismatch fails on both ranks
    let desc = format!("max_num_seqs={}", 16 + r);
    let e = check_same_config(&c, Ok(&desc)).unwrap_err();
    assert!(matches!(e, DpError::ConfigMismatch(_)), "{e}");
    check_same_config(&c, Ok("same=1")).unwrap();
}

#[test]
fn mpi_lockstep_with_one_request_on_rank_one_finishes_and_both_ranks_stop() {
    if !launched_by_mpirun() {
        return relaunch_under_mpirun("mpi_lockstep_with_one_request_on_rank_one_finishes_and_both_ranks_stop", 2);
    }
    let comm = MpiComm::init().expect("MPI");
    let m = TinyModel::new(); // same seed on every rank: the same model
    let loaded = load_model(&m.path).unwrap();
    let cfg = EngineConfig { num_kv_blocks: 64, threads: 1, ..common::tiny_config() };
    let (handle, rx, counters) = EngineHandle::channel(cfg.max_waiting);
    let engine = Engine::new(loaded.model, Arc::new(loaded.tokenizer), cfg, counters).unwrap();
    check_same_config(&comm, Ok("tiny=1")).unwrap();
    let watcher = if comm.rank() == 1 {
        let (tx, mut events) = tokio::sync::mpsc::unbounded_channel();
        handle.submit(GenerateRequest { id: handle.next_request_id(), prompt: prompt(40, 1), params: greedy(25), events: tx, grammar: None }).unwrap();
        let h = handle.clone();
        std::thread::spawn(move || {
            let mut tokens = 0;
            loop {
                match events.blocking_recv() {
                    Some(RequestEvent::Delta { tokens: t, .. }) => tokens += t.len(),
                    Some(RequestEvent::Finished { reason, .. }) => {
                        assert_eq!((reason, tokens), (FinishReason::Length, 25));
                        break;
                    }
                    other => panic!("unexpected {other:?}"),
                }
            }
            h.shutdown();
        })
    } else {
        std::thread::spawn(|| {})
    };
    drop(handle);
    let stats = Arc::new(RankStats::default());
    LockstepRank::new(engine, comm, rx, stats.clone()).run().expect("rank stops cleanly");
    watcher.join().expect("request finished");
    let (steps, dummy) = (RankStats::get(&stats.steps), RankStats::get(&stats.dummy_steps));
    eprintln!("rank stats: {steps} steps, {dummy} dummy steps, {:.2?} in collectives", stats.collective_time());
    assert!(steps + dummy >= 25, "rank joined every step");
}

/// Greedy tokens of `reqs` from one plain engine holding every expert (computed by each process
/// on its own before MPI is involved): the reference for the expert-parallel run.
fn moe_single_engine(path: &std::path::Path, reqs: &[(Vec<u32>, specula_engine::SamplingParams)]) -> Vec<Vec<u32>> {
    let loaded = load_model(path).unwrap();
    let cfg = EngineConfig { num_kv_blocks: 64, threads: 1, ..common::tiny_config() };
    let (h, join) = specula_engine::spawn_engine(loaded.model, Arc::new(loaded.tokenizer), cfg, None).unwrap();
    let mut rxs = Vec::new();
    for (p, params) in reqs {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        h.submit(GenerateRequest { id: h.next_request_id(), prompt: p.clone(), params: params.clone(), events: tx, grammar: None }).unwrap();
        rxs.push(rx);
    }
    let out = rxs.into_iter().map(collect_tokens).collect();
    h.shutdown();
    drop(h);
    join.join().unwrap();
    out
}

/// Reads a request's events to the end; its tokens (panics unless it finished by length).
fn collect_tokens(mut events: tokio::sync::mpsc::UnboundedReceiver<RequestEvent>) -> Vec<u32> {
    let mut tokens = Vec::new();
    loop {
        match events.blocking_recv() {
            Some(RequestEvent::Delta { tokens: t, .. }) => tokens.extend(t),
            Some(RequestEvent::Finished { reason, .. }) => {
                assert_eq!(reason, FinishReason::Length);
                return tokens;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}

#[test]
fn mpi_lockstep_expert_parallel_moe_gives_the_single_engine_tokens() {
    use specula_engine::dp::mpi::Threading;
    use specula_engine::dp::mpi_expert::enable_mpi_expert_parallel;
    use specula_model::testing::{write_tiny_moe, GgmlDType, TinyMoe, TinySpec};
    if !launched_by_mpirun() {
        return relaunch_under_mpirun("mpi_lockstep_expert_parallel_moe_gives_the_single_engine_tokens", 2);
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("moe.gguf");
    // same seed on every rank: the same model, byte for byte
    let spec = TinySpec { seed: 21, weight_format: GgmlDType::Q4_1, moe: Some(TinyMoe { experts: 8, used: 2, ..Default::default() }), ..Default::default() };
    write_tiny_moe(&path, &spec).unwrap();
    let all: Vec<_> = (0..3).map(|i| (prompt(12 + 21 * i, 90 + i as u64), greedy(10 + 4 * i))).collect();
    let expected = moe_single_engine(&path, &all);

    let (_env, comm) = MpiComm::init_threaded(Threading::Serialized).expect("MPI");
    let rank = comm.rank();
    let mut loaded = load_model(&path).unwrap();
    let enabled = enable_mpi_expert_parallel(&mut loaded.model);
    let desc = format!("{:?}", loaded.model.config.moe);
    let err = enabled.err().map(|e| e.to_string());
    check_same_config(&comm, err.as_deref().map_or(Ok(desc.as_str()), Err)).expect("same configuration");
    let cfg = EngineConfig { num_kv_blocks: 64, threads: 1, ..common::tiny_config() };
    let (handle, rx, counters) = EngineHandle::channel(cfg.max_waiting);
    let engine = Engine::new(loaded.model, Arc::new(loaded.tokenizer), cfg, counters).unwrap();
    // rank 0 gets request 0, rank 1 requests 1 and 2, all submitted before the ranks start (a
    // shutdown is agreed group-wide: a rank shuts down once its own requests are done, and the
    // others' in-flight requests finish within the grace period)
    let mine: Vec<usize> = if rank == 0 { vec![0] } else { vec![1, 2] };
    let streams: Vec<_> = mine
        .into_iter()
        .map(|i| {
            let (tx, events) = tokio::sync::mpsc::unbounded_channel();
            handle
                .submit(GenerateRequest { id: handle.next_request_id(), prompt: all[i].0.clone(), params: all[i].1.clone(), events: tx, grammar: None })
                .unwrap();
            (i, events)
        })
        .collect();
    let h = handle.clone();
    let watcher = std::thread::spawn(move || {
        for (i, events) in streams {
            assert_eq!(collect_tokens(events), expected[i], "rank {rank}: request {i} differs from the single engine");
        }
        h.shutdown();
    });
    drop(handle);
    let stats = Arc::new(RankStats::default());
    LockstepRank::new(engine, comm, rx, stats.clone()).run().expect("rank stops cleanly");
    watcher.join().expect("requests finished with the single-engine tokens");
    let (steps, dummy) = (RankStats::get(&stats.steps), RankStats::get(&stats.dummy_steps));
    eprintln!("rank {rank}: {steps} steps, {dummy} dummy steps, {:.2?} in collectives (metadata + expert exchanges)", stats.collective_time());
    if rank == 0 {
        assert!(dummy > 0, "rank 0 ran dummy batches while rank 1 worked alone");
    }
}

#[test]
fn mpi_expert_parallel_over_a_size_that_does_not_divide_the_experts_fails_on_every_rank() {
    use specula_engine::dp::mpi::Threading;
    use specula_engine::dp::mpi_expert::enable_mpi_expert_parallel;
    use specula_model::testing::{write_tiny_moe, TinyMoe, TinySpec};
    if !launched_by_mpirun() {
        return relaunch_under_mpirun("mpi_expert_parallel_over_a_size_that_does_not_divide_the_experts_fails_on_every_rank", 2);
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("moe.gguf");
    write_tiny_moe(&path, &TinySpec { moe: Some(TinyMoe { experts: 3, used: 2, ..Default::default() }), ..Default::default() }).unwrap();
    let (_env, comm) = MpiComm::init_threaded(Threading::Serialized).expect("MPI");
    let mut m = load_model(&path).unwrap().model;
    let e = enable_mpi_expert_parallel(&mut m).unwrap_err();
    assert!(e.to_string().contains("3 experts") && e.to_string().contains("2 ranks"), "{e}");
    // the start-up check carries the error to every rank (no rank waits in a collective)
    let checked = check_same_config(&comm, Err(&e.to_string()));
    assert!(checked.is_err());
}
