//! Logprobs under speculation are those of plain decoding bit for bit (the engine is batch
//! invariant, so a verified row's logits are the plain step's logits), on the tiny random model,
//! so this runs everywhere without the default model (spec_decoding.rs checks the same on it).

mod common;

use common::*;
use specula_engine::api::{RequestEvent, TokenLogprob};
use specula_engine::EngineConfig;

fn logprobs_of(c: &Client) -> Vec<TokenLogprob> {
    c.events
        .iter()
        .flat_map(|e| match e {
            RequestEvent::Delta { logprobs, .. } => logprobs.clone(),
            _ => Vec::new(),
        })
        .collect()
}

fn run(spec: Spec, async_scheduling: bool) -> (Vec<Vec<u32>>, Vec<Vec<TokenLogprob>>, u64) {
    let mut h = Harness::speculating(EngineConfig { async_scheduling, ..tiny_config() }, spec);
    // repetitive prompts so that n-gram drafts get accepted
    let mut clients: Vec<Client> = (0..4)
        .map(|i| {
            let mut p = prompt(8, i);
            p.extend(p.clone());
            h.submit(p, specula_engine::SamplingParams { logprobs: Some(5), ignore_eos: true, ..greedy(24) })
        })
        .collect();
    let mut refs: Vec<&mut Client> = clients.iter_mut().collect();
    h.run(&mut refs, 500);
    h.assert_idle_and_leak_free();
    let accepted = h.engine.spec_metrics().map(|m| m.num_accepted_tokens).unwrap_or(0);
    (clients.iter().map(Client::tokens).collect(), clients.iter().map(logprobs_of).collect(), accepted)
}

fn bits(l: &TokenLogprob) -> (u32, u32, Vec<(u32, u32)>) {
    (l.token, l.logprob.to_bits(), l.top.iter().map(|&(t, p)| (t, p.to_bits())).collect())
}

#[test]
fn logprobs_with_speculation_and_async_equal_plain_bit_for_bit() {
    let (tokens, logprobs, _) = run(Spec::None, false);
    assert!(logprobs.iter().all(|l| l.len() == 24 && l.iter().all(|x| x.top.len() == 5)));
    for (spec, async_scheduling) in [(Spec::Ngram(3), false), (Spec::Ngram(3), true), (Spec::SelfDraft(4), false), (Spec::SelfDraft(4), true)] {
        let (t, l, accepted) = run(spec, async_scheduling);
        assert!(accepted > 0, "no draft token was accepted (async {async_scheduling}): the verify path was not exercised");
        assert_eq!(t, tokens, "async {async_scheduling}");
        for (a, b) in logprobs.iter().zip(&l) {
            assert_eq!(a.iter().map(bits).collect::<Vec<_>>(), b.iter().map(bits).collect::<Vec<_>>(), "async {async_scheduling}");
        }
    }
}
