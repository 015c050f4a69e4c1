//! A hybrid model (Gated DeltaNet layers beside gated attention, Qwen3.5's `qwen35`) through the
//! whole engine: each running sequence holds one slot of recurrent state from admission to its
//! end, so a request's greedy tokens and a seeded request's sampled tokens are the same alone, among
//! 15 others arriving at staggered times (chunked prefills beside decodes), with async scheduling,
//! and when a tiny KV pool forces preemption (a preempted sequence starts its state over); and the
//! same greedy tokens with speculative decoding (n-gram, a draft model, an mtp head, the file's
//! own prediction layer), whose
//! rejected drafts the model rolls back out of the recurrent state (`RecurrentStore`); lockstep data
//! parallelism's dummy batches; the prefix cache through state checkpoints.

mod common;
mod dp_support;

use common::{greedy, prompt, seeded, Client, Harness, Spec, TinyModel};
use specula_engine::{EngineConfig, FinishReason, SamplingParams};

fn alone(m: &TinyModel, cfg: EngineConfig, p: Vec<u32>, params: SamplingParams) -> Vec<u32> {
    alone_with(m, cfg, Spec::None, p, params).0
}

/// The tokens, and the draft tokens verified and accepted.
fn alone_with(m: &TinyModel, cfg: EngineConfig, spec: Spec, p: Vec<u32>, params: SamplingParams) -> (Vec<u32>, (u64, u64)) {
    let mut h = Harness::on(m, cfg, spec);
    let mut c = h.submit(p, params);
    h.run(&mut [&mut c], 1000);
    h.assert_idle_and_leak_free();
    let drafted = h.engine.spec_metrics().map_or((0, 0), |s| (s.num_draft_tokens, s.num_accepted_tokens));
    (c.finished_tokens(FinishReason::Length), drafted)
}

fn in_a_crowd(m: &TinyModel, cfg: EngineConfig, p: Vec<u32>, params: SamplingParams) -> Vec<u32> {
    in_a_crowd_with(m, cfg, Spec::None, p, params)
}

fn in_a_crowd_with(m: &TinyModel, cfg: EngineConfig, spec: Spec, p: Vec<u32>, params: SamplingParams) -> Vec<u32> {
    common::in_a_crowd(Harness::on(m, cfg, spec), p, params)
}

#[test]
fn hybrid_outputs_alone_equal_outputs_in_a_crowd_with_and_without_async_scheduling() {
    let m = TinyModel::hybrid();
    let p = prompt(77, 1);
    for params in [greedy(40), seeded(40, 0.8, 42)] {
        let a = alone(&m, common::tiny_config(), p.clone(), params.clone());
        assert_eq!(a.len(), 40);
        assert_eq!(a, in_a_crowd(&m, common::tiny_config(), p.clone(), params.clone()), "{params:?}");
        let chunked = EngineConfig { max_num_batched_tokens: 24, threads: 1, ..common::tiny_config() };
        assert_eq!(a, in_a_crowd(&m, chunked, p.clone(), params.clone()), "{params:?}, 24-token steps, one thread");
        let ahead = EngineConfig { async_scheduling: true, ..common::tiny_config() };
        assert_eq!(a, in_a_crowd(&m, ahead, p.clone(), params.clone()), "{params:?}, async scheduling");
    }
}

#[test]
fn hybrid_preemption_under_a_tiny_kv_pool_changes_no_output() {
    let m = TinyModel::hybrid();
    let run = |cfg: EngineConfig| -> (Vec<Vec<u32>>, usize) {
        let mut h = Harness::on(&m, cfg, Spec::None);
        let mut clients: Vec<Client> = (0..8u64).map(|i| h.submit(prompt(20 + (i as usize * 13) % 41, 200 + i), greedy(60))).collect();
        let mut refs: Vec<&mut Client> = clients.iter_mut().collect();
        h.run(&mut refs, 5000);
        h.assert_idle_and_leak_free();
        (clients.iter().map(|c| c.finished_tokens(FinishReason::Length)).collect(), h.tokens_computed)
    };
    let (expected, work_big) = run(common::tiny_config());
    // 8 blocks of 16 = 128 tokens: one request at full length fits, eight do not
    let (got, work_small) = run(EngineConfig { num_kv_blocks: 8, max_model_len: 128, ..common::tiny_config() });
    assert_eq!(expected, got);
    assert!(work_small > work_big, "no preemption: {work_small} tokens computed vs {work_big}");
    // fewer state slots than requests: the rest wait for a running one to end
    let (few, _) = run(EngineConfig { max_num_seqs: 2, ..common::tiny_config() });
    assert_eq!(expected, few, "two sequences at a time");
}

#[test]
fn hybrid_greedy_with_speculation_equals_greedy_without() {
    let m = TinyModel::hybrid();
    let p = prompt(77, 1);
    let reference = alone(&m, common::tiny_config(), p.clone(), greedy(40));
    for spec in [Spec::Ngram(3), Spec::OtherDraft(3), Spec::Mtp(2), Spec::Nextn(3)] {
        let (got, (drafted, accepted)) = alone_with(&m, common::tiny_config(), spec, p.clone(), greedy(40));
        assert_eq!(reference, got, "{spec:?} alone");
        // drafts were verified and some rejected: rollbacks ran
        assert!(drafted > accepted, "{spec:?}: {drafted} drafted, {accepted} accepted");
        assert_eq!(reference, in_a_crowd_with(&m, common::tiny_config(), spec, p.clone(), greedy(40)), "{spec:?} in a crowd");
        let ahead = EngineConfig { async_scheduling: true, ..common::tiny_config() };
        assert_eq!(reference, in_a_crowd_with(&m, ahead, spec, p.clone(), greedy(40)), "{spec:?} in a crowd, async scheduling");
    }
    // a seeded stream is the same alone and in a crowd under speculation too
    let seeded_alone = alone_with(&m, common::tiny_config(), Spec::Ngram(3), p.clone(), seeded(40, 0.8, 42)).0;
    assert_eq!(seeded_alone, in_a_crowd_with(&m, common::tiny_config(), Spec::Ngram(3), p.clone(), seeded(40, 0.8, 42)));
}

/// A hybrid draft model (a small Qwen3.5 drafting for a large one): its state is checkpointed
/// where each chain starts and put back after it, so it catches up again from there; the target
/// itself as the draft accepts every greedy draft, another hybrid rejects most, and both give
/// the tokens of no speculation, alone, in a crowd and with async scheduling.
#[test]
fn a_hybrid_draft_model_drafts_exactly() {
    let m = TinyModel::hybrid_with_hybrid_draft();
    let p = prompt(77, 1);
    let reference = alone(&m, common::tiny_config(), p.clone(), greedy(40));
    for spec in [Spec::SelfDraft(3), Spec::OtherDraft(3)] {
        let (got, (drafted, accepted)) = alone_with(&m, common::tiny_config(), spec, p.clone(), greedy(40));
        assert_eq!(reference, got, "{spec:?} alone");
        assert!(drafted > 0, "{spec:?} drafted nothing");
        if spec == Spec::SelfDraft(3) {
            assert_eq!(drafted, accepted, "the target drafting for itself is always right");
        } else {
            assert!(drafted > accepted, "{spec:?}: {drafted} drafted, {accepted} accepted");
        }
        assert_eq!(reference, in_a_crowd_with(&m, common::tiny_config(), spec, p.clone(), greedy(40)), "{spec:?} in a crowd");
        let ahead = EngineConfig { async_scheduling: true, ..common::tiny_config() };
        assert_eq!(reference, in_a_crowd_with(&m, ahead, spec, p.clone(), greedy(40)), "{spec:?} in a crowd, async scheduling");
    }
    let seeded_alone = alone_with(&m, common::tiny_config(), Spec::OtherDraft(3), p.clone(), seeded(40, 0.8, 42)).0;
    assert_eq!(seeded_alone, alone(&m, common::tiny_config(), p.clone(), seeded(40, 0.8, 42)), "seeded, drafted by a hybrid");
}

/// Lockstep data parallelism pads idle ranks with dummy batches: a hybrid's run in a state slot
/// kept for them, so a request on one of three ranks (the others padding every step) and
/// requests spread over the ranks give a single engine's tokens.
#[test]
fn lockstep_data_parallelism_serves_a_hybrid_with_single_engine_outputs() {
    let _serial = dp_support::serial();
    let m = TinyModel::hybrid();
    let reqs: Vec<_> = (0..4).map(|i| (prompt(30 + 23 * i, 40 + i as u64), greedy(20))).collect();
    let expected = dp_support::single_engine_outputs(&m, &reqs);
    let group = dp_support::lockstep(&m, 3);
    let mut alone = dp_support::submit(&group.rank_handles[1], reqs[0].0.clone(), reqs[0].1.clone());
    assert_eq!(alone.finished(FinishReason::Length), expected[0]);
    let mut streams: Vec<_> =
        reqs.iter().enumerate().map(|(i, (p, params))| dp_support::submit(&group.rank_handles[i % 3], p.clone(), params.clone())).collect();
    for (s, want) in streams.iter_mut().zip(&expected) {
        assert_eq!(&s.finished(FinishReason::Length), want);
    }
    let stats = group.stats.clone();
    assert!(dp_support::shutdown_and_join(group).iter().all(|r| r.is_ok()));
    assert!(specula_engine::dp::RankStats::get(&stats[0].dummy_steps) > 0, "rank 0 padded while rank 1 ran alone");
}

/// A token's logprob and its top alternatives, as bits.
type LogprobBits = (u32, u32, Vec<(u32, u32)>);

/// What one turn gave: its tokens and their logprobs.
type TurnOutput = (Vec<u32>, Vec<LogprobBits>);

/// The tokens and, bit for bit, the logprobs (with the top 3) a client received.
fn tokens_and_logprobs(c: &Client) -> TurnOutput {
    let lp = c
        .events
        .iter()
        .filter_map(|e| match e {
            specula_engine::RequestEvent::Delta { logprobs, .. } => {
                Some(logprobs.iter().map(|l| (l.token, l.logprob.to_bits(), l.top.iter().map(|&(t, p)| (t, p.to_bits())).collect())))
            }
            _ => None,
        })
        .flatten()
        .collect();
    (c.finished_tokens(FinishReason::Length), lp)
}

/// A hybrid's prefix cache: a conversation resent with a turn more restarts from the recurrent
/// state checkpointed at the last block boundary of its earlier prompt (its prefill chunk cut
/// there), its KV blocks taken from the cache up to that boundary: the tokens it finds cached
/// are counted, and its tokens and logprobs are, to the bit, those computed from scratch, with
/// async scheduling and with speculation too; with every checkpoint taken by other prompts it
/// recomputes, still the same.
#[test]
fn hybrid_prefix_cache_restores_the_checkpointed_state_and_changes_no_output() {
    let m = TinyModel::hybrid();
    // 70 tokens: the state is checkpointed after 64, four blocks of 16
    let first = prompt(70, 3);
    let with_logprobs = |n| SamplingParams { logprobs: Some(3), ..greedy(n) };
    let run_turns = |cfg: EngineConfig, spec: Spec, turns: &[Vec<u32>]| -> (Vec<TurnOutput>, Vec<u64>) {
        let mut h = Harness::on(&m, cfg, spec);
        let (mut outs, mut hits) = (Vec::new(), Vec::new());
        for t in turns {
            let before = h.engine.prefix_cache_stats().hit_tokens;
            let mut c = h.submit(t.clone(), with_logprobs(16));
            h.run(&mut [&mut c], 1000);
            outs.push(tokens_and_logprobs(&c));
            hits.push(h.engine.prefix_cache_stats().hit_tokens - before);
        }
        h.assert_idle_and_leak_free();
        (outs, hits)
    };
    let cold = EngineConfig { enable_prefix_caching: false, ..common::tiny_config() };
    let (out1, _) = run_turns(cold.clone(), Spec::None, std::slice::from_ref(&first));
    let second = [first.clone(), out1[0].0.clone(), prompt(30, 4)].concat();
    let (expected, _) = run_turns(cold, Spec::None, &[first.clone(), second.clone()]);
    let ahead = EngineConfig { async_scheduling: true, ..common::tiny_config() };
    // a host-memory tier asked for is not taken (its blocks would have no state)
    let tiers = EngineConfig { prefix_tiers: specula_engine::kv_cache::PrefixTierConfig { host_bytes: 64 << 20, disk: None }, ..common::tiny_config() };
    for (cfg, spec) in [
        (common::tiny_config(), Spec::None),
        (ahead, Spec::None),
        (tiers, Spec::None),
        (common::tiny_config(), Spec::Ngram(3)),
        (common::tiny_config(), Spec::Nextn(2)),
    ] {
        let (got, hits) = run_turns(cfg.clone(), spec, &[first.clone(), second.clone()]);
        assert_eq!(hits, [0, 64], "{spec:?}, async {}: the second turn restarts at the first one's checkpoint", cfg.async_scheduling);
        assert!(got == expected, "{spec:?}, async {}: outputs differ from the cold ones", cfg.async_scheduling);
    }
    // one checkpoint, taken by another prompt in between: no usable hit, the same output
    let one = EngineConfig { state_checkpoints: 1, ..common::tiny_config() };
    let (got, hits) = run_turns(one, Spec::None, &[first.clone(), prompt(50, 9), second.clone()]);
    assert_eq!(hits, [0, 0, 0], "the checkpoint was reused for the other prompt");
    assert!(got[0] == expected[0] && got[2] == expected[1]);
}
