//! OpenAI's `logit_bias` on the tiny random model: +100 forces a token and -100 bans it, the
//! same with and without speculation and async scheduling (the bias is part of the target
//! distribution the rejection sampler verifies against).

mod common;

use common::*;

fn with_bias(max_tokens: usize, bias: Vec<(u32, f32)>) -> specula_engine::SamplingParams {
    specula_engine::SamplingParams { ignore_eos: true, logit_bias: bias.into(), ..greedy(max_tokens) }
}

fn run_one(spec: Spec, async_scheduling: bool, params: specula_engine::SamplingParams) -> Vec<u32> {
    let mut h = Harness::speculating(EngineConfig { async_scheduling, ..tiny_config() }, spec);
    let mut c = h.submit(prompt(12, 7), params);
    h.run(&mut [&mut c], 200);
    h.assert_idle_and_leak_free();
    c.tokens()
}

use specula_engine::EngineConfig;

#[test]
fn a_bias_of_100_forces_the_token_under_every_mode() {
    for (spec, async_scheduling) in [(Spec::None, false), (Spec::None, true), (Spec::Ngram(3), false), (Spec::Ngram(3), true), (Spec::SelfDraft(3), true)] {
        let out = run_one(spec, async_scheduling, with_bias(10, vec![(42, 100.0)]));
        assert_eq!(out, vec![42; 10], "async {async_scheduling}");
    }
}

#[test]
fn a_bias_of_minus_100_bans_the_greedy_choice_and_speculation_agrees() {
    let plain = run_one(Spec::None, false, with_bias(12, vec![]));
    let banned = plain[0];
    let biased = run_one(Spec::None, false, with_bias(12, vec![(banned, -100.0)]));
    assert!(!biased.contains(&banned), "{banned} still generated: {biased:?}");
    assert_ne!(biased, plain);
    for (spec, async_scheduling) in [(Spec::Ngram(3), false), (Spec::Ngram(3), true), (Spec::SelfDraft(4), false)] {
        assert_eq!(run_one(spec, async_scheduling, with_bias(12, vec![(banned, -100.0)])), biased, "async {async_scheduling}");
    }
}

#[test]
fn a_bias_outside_plus_minus_100_is_refused() {
    let p = with_bias(4, vec![(3, 100.5)]);
    let e = p.validate(20).unwrap_err();
    assert_eq!(e.param, "logit_bias");
    assert!(with_bias(4, vec![(3, -100.0)]).validate(20).is_ok());
}
