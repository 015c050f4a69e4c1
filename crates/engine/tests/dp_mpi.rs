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
        handle.submit(GenerateRequest { id: handle.next_request_id(), prompt: prompt(40, 1), params: greedy(25), events: tx }).unwrap();
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
