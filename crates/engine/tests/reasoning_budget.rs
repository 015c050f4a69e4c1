//! Reasoning budgets on the tiny random model: a budgeted greedy output is exactly the free
//! greedy outputs stitched at the forced tokens (the oracle: the opening appended to the prompt,
//! the model's own thoughts up to the budget or its own closing, the closing, then the model's
//! own answer), and every budgeted output, greedy or seeded, is token for token the same without
//! speculation, with n-gram and draft-model speculation, and with async scheduling.

mod common;

use common::{greedy, prompt, seeded, tiny_config, Harness, Spec, TinyModel};
use specula_engine::{EngineConfig, FinishReason, ReasoningBudget, SamplingParams};

/// Ordinary byte tokens standing for `<think>` and `</think>`.
const OPEN: u32 = b'{' as u32;
const CLOSE: u32 = b'}' as u32;
const BUDGET: usize = 6;
const MAX_TOKENS: usize = 24;

fn budgeted(mut p: SamplingParams, open: Option<u32>) -> SamplingParams {
    p.reasoning_budget = Some(ReasoningBudget { tokens: BUDGET, open, close: CLOSE });
    p
}

fn run(h: &mut Harness, prompts: &[Vec<u32>], params: &[SamplingParams]) -> Vec<Vec<u32>> {
    let mut clients: Vec<_> = prompts.iter().zip(params).map(|(p, sp)| h.submit(p.clone(), sp.clone())).collect();
    h.run(&mut clients.iter_mut().collect::<Vec<_>>(), 2000);
    h.assert_idle_and_leak_free();
    clients.iter().map(|c| c.finished_tokens(FinishReason::Length)).collect()
}

/// The free greedy continuation of `context`, `n` tokens.
fn free(model: &TinyModel, context: &[u32], n: usize) -> Vec<u32> {
    let mut h = Harness::on(model, tiny_config(), Spec::None);
    run(&mut h, &[context.to_vec()], &[greedy(n)]).remove(0)
}

/// What a budgeted greedy output must be, from free greedy runs: `(tokens, whether the closing
/// was forced)`.
fn stitched(model: &TinyModel, prompt: &[u32], open: bool) -> (Vec<u32>, bool) {
    let mut out: Vec<u32> = if open { vec![OPEN] } else { Vec::new() };
    let context = [prompt, &out[..]].concat();
    let thoughts = free(model, &context, BUDGET);
    let (thoughts, forced) = match thoughts.iter().position(|&t| t == CLOSE) {
        Some(i) => (thoughts[..=i].to_vec(), false),
        None => ([&thoughts[..], &[CLOSE]].concat(), true),
    };
    out.extend(&thoughts);
    let rest = free(model, &[prompt, &out[..]].concat(), MAX_TOKENS - out.len());
    out.extend(rest);
    (out, forced)
}

fn configs() -> Vec<(Spec, bool)> {
    vec![(Spec::None, false), (Spec::None, true), (Spec::Ngram(4), false), (Spec::Ngram(4), true), (Spec::SelfDraft(4), true), (Spec::OtherDraft(3), false)]
}

fn config(async_scheduling: bool) -> EngineConfig {
    EngineConfig { async_scheduling, ..tiny_config() }
}

#[test]
fn a_budgeted_greedy_output_is_the_free_outputs_stitched_at_the_forced_tokens() {
    let model = TinyModel::new();
    // some prompts repeat themselves so n-gram drafts cross the budget's end
    let prompts: Vec<Vec<u32>> = (0..6u64).map(|s| if s % 2 == 0 { prompt(20, s) } else { prompt(8, s).repeat(4) }).collect();
    let mut forced = 0;
    for open in [true, false] {
        let expected: Vec<(Vec<u32>, bool)> = prompts.iter().map(|p| stitched(&model, p, open)).collect();
        forced += expected.iter().filter(|(_, f)| *f).count();
        let params: Vec<SamplingParams> = prompts.iter().map(|_| budgeted(greedy(MAX_TOKENS), open.then_some(OPEN))).collect();
        for (spec, async_scheduling) in configs() {
            let mut h = Harness::on(&model, config(async_scheduling), spec);
            let got = run(&mut h, &prompts, &params);
            for (i, (g, (e, _))) in got.iter().zip(&expected).enumerate() {
                assert_eq!(g, e, "prompt {i}, open {open}, {spec:?}, async {async_scheduling}");
            }
        }
    }
    assert!(forced >= 2, "the budget forced the closing only {forced} times: the test does not test it");
}

#[test]
fn budgeted_seeded_outputs_are_the_same_under_speculation_and_async_scheduling() {
    let model = TinyModel::new();
    let prompts: Vec<Vec<u32>> = (0..6u64).map(|s| prompt(8, s + 40).repeat(3)).collect();
    let params: Vec<SamplingParams> = (0..6u64).map(|s| budgeted(seeded(MAX_TOKENS, 0.8, s), Some(OPEN))).collect();
    let mut reference = None;
    for (spec, async_scheduling) in configs() {
        let mut h = Harness::on(&model, config(async_scheduling), spec);
        let got = run(&mut h, &prompts, &params);
        for g in &got {
            assert_eq!(g[0], OPEN, "the opening is forced");
            let close = g.iter().position(|&t| t == CLOSE).expect("the block closes within the budget");
            assert!(close <= BUDGET + 1, "{close} tokens before the closing: over the budget of {BUDGET}");
        }
        match &reference {
            None => reference = Some(got),
            Some(r) => assert_eq!(&got, r, "{spec:?}, async {async_scheduling}"),
        }
    }
}
