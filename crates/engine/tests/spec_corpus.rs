//! The n-gram proposer's cross-request index (`speculative::corpus`) through the whole engine:
//! a request drafts from the outputs of its tenant's earlier requests, never from another
//! tenant's, and the output is token for token the one without speculation either way.
//!
//! Oracle: plain decoding of the same requests on the same model; for the tenants, the run of a
//! request whose tenant has no earlier output must draft exactly as its first run did (same
//! draft and accepted counts), since its own text is the same.

mod spec_support;

use spec_support::{spec_config, tiny_config, tiny_model, End, Rig, Rng};
use specula_engine::speculative::SpecMethod;
use specula_engine::types::Tenant;
use specula_engine::{FinishReason, SamplingParams};

/// 24 random tokens of the tiny vocabulary.
fn prompt() -> Vec<u32> {
    let mut rng = Rng(7);
    (0..24).map(|_| rng.range(3, 253) as u32).collect()
}

/// (draft tokens proposed, accepted) so far.
fn counts(rig: &Rig) -> (u64, u64) {
    let m = rig.engine.spec_metrics().expect("speculating");
    (m.num_draft_tokens, m.num_accepted_tokens)
}

#[test]
fn a_request_drafts_from_its_tenant_s_earlier_outputs_only_and_its_output_does_not_change() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 31);
    let prompt = prompt();
    let params = |tenant| SamplingParams { ignore_eos: true, tenant: Tenant(tenant), ..SamplingParams::greedy(64) };

    let mut plain = Rig::new(&model, tiny_config(), None);
    let expected = plain.run_batch(&[(prompt.clone(), params(1))]).remove(0);
    assert_eq!(expected.end, End::Finished(FinishReason::Length));

    let mut rig = Rig::new(&model, tiny_config(), Some(spec_config(SpecMethod::Ngram, 4, None)));
    let run = |rig: &mut Rig, tenant| {
        let before = counts(rig);
        let out = rig.run_batch(&[(prompt.clone(), params(tenant))]).remove(0);
        assert_eq!(out.tokens, expected.tokens, "tenant {tenant}: the output changed under speculation");
        assert_eq!(out.logprobs, expected.logprobs);
        let after = counts(rig);
        (after.0 - before.0, after.1 - before.1)
    };
    // (seed 31, this prompt: the first run accepts 10 of 21 drafted tokens, the second 48 of 48)
    let first = run(&mut rig, 1);
    // tenant 2 has no earlier output: it drafts from its own text only, as the first run did
    assert_eq!(run(&mut rig, 2), first, "tenant 2 drafted from tenant 1's output");
    // tenant 1 again: its first output is in the index, so from its fourth token on (the
    // shortest corpus match) every draft is kept: 4 of each step's 5 tokens
    let again = run(&mut rig, 1);
    assert!(again.1 >= first.1 + 24, "the index did not draft: first run accepted {} of {}, second {} of {}", first.1, first.0, again.1, again.0);
    assert!(again.1 >= 44 && again.1 * 10 >= again.0 * 9, "accepted {} of {} drafted from the earlier output", again.1, again.0);
    rig.assert_no_leaks();
}

#[test]
fn a_corpus_budget_of_zero_drafts_from_the_sequence_s_own_text_only() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 31);
    let prompt = prompt();
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(64) };
    let spec = specula_engine::speculative::SpecConfig { corpus_tokens: 0, ..spec_config(SpecMethod::Ngram, 4, None) };
    let mut rig = Rig::new(&model, tiny_config(), Some(spec));
    rig.run_batch(&[(prompt.clone(), params.clone())]);
    let first = counts(&rig);
    rig.run_batch(&[(prompt, params)]);
    let second = counts(&rig);
    assert_eq!((second.0 - first.0, second.1 - first.1), first);
}

#[test]
fn a_request_drafts_from_the_prompt_of_another_running_request_of_its_tenant_only() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 31);
    let prompt = prompt();
    let params = |tenant| SamplingParams { ignore_eos: true, tenant: Tenant(tenant), ..SamplingParams::greedy(64) };
    let mut plain = Rig::new(&model, tiny_config(), None);
    let written = plain.run_batch(&[(prompt.clone(), params(1))]).remove(0).tokens;
    // another agent's request whose prompt already holds what the first will write (a file it
    // sends), after text of its own
    let mut rng = Rng(11);
    let holder: Vec<u32> = (0..16).map(|_| rng.range(3, 253) as u32).chain(written.iter().copied()).collect();
    let expected = plain.run_batch(&[(prompt.clone(), params(1)), (holder.clone(), params(1))]);

    // no finished outputs kept: what is drafted beyond the request's own text comes from the other's
    let spec = specula_engine::speculative::SpecConfig { corpus_tokens: 0, ..spec_config(SpecMethod::Ngram, 4, None) };
    let run = |holder_tenant| {
        let mut rig = Rig::new(&model, tiny_config(), Some(spec.clone()));
        let out = rig.run_batch(&[(prompt.clone(), params(1)), (holder.clone(), params(holder_tenant))]);
        for (o, e) in out.iter().zip(&expected) {
            assert_eq!(o.tokens, e.tokens, "the output changed under speculation");
            assert_eq!(o.logprobs, e.logprobs);
        }
        rig.assert_no_leaks();
        counts(&rig)
    };
    let apart = run(2);
    let together = run(1);
    assert!(
        together.1 >= apart.1 + 24,
        "the running prompt did not draft: accepted {} of {} across tenants, {} of {} within one",
        apart.1,
        apart.0,
        together.1,
        together.0
    );
}
