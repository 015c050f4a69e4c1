//! docs/architecture.md invariant 4 under random traffic: any interleaving of submissions (valid or not),
//! steps, aborts and client disconnects against a small KV pool, with or without speculative
//! decoding, with or without async scheduling, never leaks a block (target or draft KV) and never
//! starves a request.

mod common;

use common::{prompt, Client, End, Harness, Spec, TinyModel};
use proptest::prelude::*;
use proptest::sample::Index;
use specula_engine::{EngineConfig, FinishReason, SamplingParams};

const MAX_MODEL_LEN: usize = 128;

#[derive(Clone, Debug)]
enum Op {
    /// Prompt length 0 or >= MAX_MODEL_LEN is invalid on purpose. `family` picks a token stream,
    /// so prompts of one family share prefixes (prefix-cache hits).
    Submit {
        prompt_len: usize,
        family: u64,
        max_tokens: usize,
        sampled: bool,
    },
    Step(usize),
    Abort(Index),
    Disconnect(Index),
}

fn spec() -> impl Strategy<Value = Spec> {
    prop_oneof![Just(Spec::None), (1usize..5).prop_map(Spec::Ngram), (1usize..4).prop_map(Spec::SelfDraft), (1usize..4).prop_map(Spec::OtherDraft)]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0usize..MAX_MODEL_LEN + 8, 0u64..3, 1usize..48, any::<bool>())
            .prop_map(|(prompt_len, family, max_tokens, sampled)| Op::Submit { prompt_len, family, max_tokens, sampled }),
        4 => (1usize..5).prop_map(Op::Step),
        1 => any::<Index>().prop_map(Op::Abort),
        1 => any::<Index>().prop_map(Op::Disconnect),
    ]
}

struct Tracked {
    client: Client,
    valid: bool,
    aborted: bool,
    disconnected: bool,
    work: usize,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn random_traffic_on_a_small_pool_never_leaks_or_starves(ops in prop::collection::vec(op(), 1..60), prefix_caching in any::<bool>(), spec in spec(), async_scheduling in any::<bool>()) {
        // 20 blocks of 8 = 160 tokens: two long requests exhaust it; preemption is routine
        let cfg = EngineConfig {
            max_num_seqs: 4,
            max_num_batched_tokens: 32,
            max_model_len: MAX_MODEL_LEN,
            block_size: 8,
            num_kv_blocks: 20,
            enable_prefix_caching: prefix_caching,
            threads: 1,
            async_scheduling,
            ..Default::default()
        };
        let model = TinyModel::new();
        let mut h = Harness::on(&model, cfg, spec);
        let mut reqs: Vec<Tracked> = Vec::new();
        for op in ops {
            match op {
                Op::Submit { prompt_len, family, max_tokens, sampled } => {
                    let params = if sampled {
                        SamplingParams { temperature: 0.9, seed: Some(family), max_tokens, ignore_eos: true, ..Default::default() }
                    } else {
                        common::greedy(max_tokens)
                    };
                    let valid = prompt_len > 0 && prompt_len < MAX_MODEL_LEN;
                    let client = h.submit(prompt(prompt_len, family), params);
                    reqs.push(Tracked { client, valid, aborted: false, disconnected: false, work: prompt_len + max_tokens });
                }
                Op::Step(n) => {
                    for _ in 0..n {
                        h.step();
                    }
                }
                Op::Abort(i) if !reqs.is_empty() => {
                    let n = reqs.len();
                    let r = &mut reqs[i.index(n)];
                    h.engine.abort(r.client.id);
                    r.aborted = true;
                }
                Op::Disconnect(i) if !reqs.is_empty() => {
                    let n = reqs.len();
                    let r = &mut reqs[i.index(n)];
                    r.client.drain(h.steps);
                    r.client.disconnect();
                    r.disconnected = true;
                }
                _ => {}
            }
            for r in reqs.iter_mut() {
                r.client.drain(h.steps);
            }
            prop_assert!(h.engine.num_free_blocks() <= h.engine.num_total_blocks());
        }

        // liveness: everything still running ends within a bound on the remaining work
        let bound = 100 + 4 * reqs.iter().filter(|r| r.valid).map(|r| r.work).sum::<usize>();
        let mut refs: Vec<&mut Client> = reqs.iter_mut().map(|r| &mut r.client).collect();
        h.run(&mut refs, bound);
        h.step();
        h.assert_idle_and_leak_free();

        for r in &reqs {
            let c = &r.client;
            if r.disconnected && !c.is_done() {
                continue; // nobody is listening; the leak check above covers it
            }
            let end = c.end();
            let ended = c.ended_at.unwrap();
            prop_assert!(ended - c.submitted_at <= bound, "{} took {} steps", c.id, ended - c.submitted_at);
            match end {
                End::Failed(msg) => prop_assert!(!r.valid, "valid request {} failed: {msg}", c.id),
                End::Finished(FinishReason::Abort) => prop_assert!(r.aborted || r.disconnected),
                End::Finished(reason) => {
                    prop_assert!(r.valid);
                    prop_assert_eq!(reason, FinishReason::Length);
                }
            }
        }
    }
}
