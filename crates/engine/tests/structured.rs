//! Structured outputs on the default model (`SPECULA_MODEL`; skipped with a note when unset,
//! failing under CI): every output stays inside its constraint (checked by parsers written here,
//! not by llguidance), outputs are token for token the same with and without speculation and
//! with async scheduling on and off, invalid constraints fail before running, and constrained
//! sampling with speculation follows the masked target distribution (chi-square against the
//! target's own logits, masked by a token set derived here from the tokenizer).

mod spec_support;

use spec_support::{spec_config, End, Outcome, Rig};
use specula_engine::constraint::compile;
use specula_engine::fault::{FaultInjection, FaultKind, FaultPhase};
use specula_engine::speculative::SpecMethod;
use specula_engine::{Constraint, EngineConfig, FinishReason, SamplingParams};
use specula_model::testing::model_for_tests;
use specula_model::{load_model, ChatMessage, Tokenizer};
use std::path::Path;
use std::sync::Arc;

fn config(async_scheduling: bool) -> EngineConfig {
    EngineConfig {
        max_num_seqs: 32,
        max_num_batched_tokens: 512,
        max_model_len: 512,
        block_size: 16,
        num_kv_blocks: 320,
        enable_prefix_caching: true,
        threads: 2,
        async_scheduling,
        ..Default::default()
    }
}

fn chat(model: &Path, text: &str) -> Vec<u32> {
    let loaded = load_model(model).expect("load default model");
    let template = loaded.chat_template.expect("the default model ships a chat template");
    let msgs = [ChatMessage { role: "user".into(), content: text.into() }];
    loaded.tokenizer.encode(&template.render(&msgs, true).expect("render chat")).expect("encode")
}

fn tokenizer(model: &Path) -> Tokenizer {
    load_model(model).expect("load default model").tokenizer
}

const PERSON_SCHEMA: &str = r#"{"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150}, "city": {"enum": ["Paris", "Rome", "Oslo"]}}, "required": ["name", "age", "city"], "additionalProperties": false}"#;

/// The constrained requests every test below runs: (prompt, constraint).
fn requests(model: &Path) -> Vec<(Vec<u32>, Constraint)> {
    vec![
        (chat(model, "Give me a US phone number."), Constraint::Regex(r"\(\d{3}\) \d{3}-\d{4}".into())),
        (chat(model, "Is the sky blue? Answer yes or no."), Constraint::Choice(vec!["yes".into(), "no".into(), "maybe".into()])),
        (chat(model, "Describe a person called Alice, 31, from Paris, as JSON."), Constraint::JsonSchema(PERSON_SCHEMA.into())),
        (chat(model, "Return a JSON object describing a cat."), Constraint::JsonObject),
        (
            chat(model, "Write the numbers 1, 2, 3, 1, 2, 3, 1, 2, 3 as a JSON list in an object under \"n\"."),
            Constraint::JsonSchema(
                r#"{"type": "object", "properties": {"n": {"type": "array", "items": {"type": "integer"}, "maxItems": 12}}, "required": ["n"]}"#.into(),
            ),
        ),
        (chat(model, "Count: one two three"), Constraint::Lark("start: word (\" \" word)*\nword: \"one\" | \"two\" | \"three\"".into())),
    ]
}

fn params(c: &Constraint, max_tokens: usize) -> SamplingParams {
    SamplingParams { constraint: Some(Arc::new(c.clone())), ..SamplingParams::greedy(max_tokens) }
}

/// Checks `text` against `c` with a hand-written oracle (not llguidance). `complete`: the output
/// ended for a reason other than the length limit, so it must be a whole word of the language.
fn check(c: &Constraint, text: &str, complete: bool) {
    match c {
        Constraint::Regex(_) => {
            // (ddd) ddd-dddd, char by char
            let shape = "(ddd) ddd-dddd";
            assert!(text.len() <= shape.len(), "{text:?}");
            for (a, b) in text.chars().zip(shape.chars()) {
                assert!(if b == 'd' { a.is_ascii_digit() } else { a == b }, "{text:?} does not match {shape}");
            }
            if complete {
                assert_eq!(text.len(), shape.len(), "{text:?}");
            }
        }
        Constraint::Choice(opts) => {
            if complete {
                assert!(opts.iter().any(|o| o == text), "{text:?} not in {opts:?}");
            } else {
                assert!(opts.iter().any(|o| o.starts_with(text)), "{text:?} is no prefix of {opts:?}");
            }
        }
        Constraint::JsonObject | Constraint::JsonSchema(_) if complete => {
            let v: serde_json::Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?} is not JSON: {e}"));
            let obj = v.as_object().unwrap_or_else(|| panic!("{text:?} is not an object"));
            if let Constraint::JsonSchema(s) = c {
                if s == PERSON_SCHEMA {
                    let keys: Vec<&str> = obj.keys().map(String::as_str).collect();
                    assert_eq!(keys.len(), 3, "{text:?}");
                    assert!(obj["name"].as_str().is_some_and(|n| n.chars().count() <= 20), "{text:?}");
                    assert!(obj["age"].as_u64().is_some_and(|a| a <= 150), "{text:?}");
                    assert!(["Paris", "Rome", "Oslo"].contains(&obj["city"].as_str().unwrap_or("")), "{text:?}");
                } else if s == RECORD_SCHEMA {
                    let keys: Vec<&str> = obj.keys().map(String::as_str).collect();
                    let want = ["first_name", "last_name", "email_address", "is_active_member", "country_of_residence", "year_of_birth"];
                    assert_eq!(keys, want, "{text:?}");
                    assert!(obj["is_active_member"].is_boolean() && obj["first_name"].as_str().is_some_and(|n| n.chars().count() <= 12), "{text:?}");
                    assert!(["France", "Italy", "Norway"].contains(&obj["country_of_residence"].as_str().unwrap_or("")), "{text:?}");
                    assert!(obj["year_of_birth"].as_u64().is_some_and(|y| (1900..=2025).contains(&y)), "{text:?}");
                } else {
                    let n = obj["n"].as_array().unwrap_or_else(|| panic!("{text:?}: n is no array"));
                    assert!(n.len() <= 12 && n.iter().all(|x| x.is_i64()), "{text:?}");
                }
            }
        }
        Constraint::JsonObject | Constraint::JsonSchema(_) => assert!(text.starts_with('{'), "{text:?}"),
        Constraint::Lark(_) => {
            let words: Vec<&str> = text.split(' ').collect();
            let last = words.len() - 1;
            for (i, w) in words.iter().enumerate() {
                let ok = ["one", "two", "three"].contains(w) || (i == last && !complete && ["one", "two", "three"].iter().any(|o| o.starts_with(w)));
                assert!(ok, "{text:?}: word {w:?}");
            }
        }
    }
}

fn run(model: &Path, cfg: EngineConfig, spec: Option<SpecMethod>, reqs: &[(Vec<u32>, SamplingParams)]) -> (Vec<Outcome>, u64) {
    // the draft-model proposer drafts with the target itself (stochastic drafts with their
    // distributions, most of them accepted)
    let draft = (spec == Some(SpecMethod::Draft)).then_some(model);
    let mut rig = Rig::new(model, cfg, spec.map(|m| spec_config(m, 3, draft)));
    let out = rig.run_batch(reqs);
    rig.assert_no_leaks();
    let accepted = rig.engine.spec_metrics().map_or(0, |m| m.num_accepted_tokens);
    (out, accepted)
}

#[test]
fn greedy_constrained_outputs_satisfy_their_constraints_and_do_not_depend_on_speculation_or_async() {
    let Some(model) = model_for_tests("greedy_constrained_outputs_satisfy_their_constraints_and_do_not_depend_on_speculation_or_async") else {
        return;
    };
    let tok = tokenizer(&model);
    let reqs: Vec<(Vec<u32>, SamplingParams)> = requests(&model).iter().map(|(p, c)| (p.clone(), params(c, 60))).collect();
    let (base, _) = run(&model, config(false), None, &reqs);
    for ((_, c), o) in requests(&model).iter().zip(&base) {
        let text = tok.decode(&o.tokens, true).unwrap();
        let End::Finished(reason) = &o.end else { panic!("{c:?}: {:?}", o.end) };
        eprintln!("{c:?} -> {text:?} ({reason:?})");
        check(c, &text, *reason == FinishReason::Stop);
    }
    // a choice and the regex end when the grammar does: finish reason stop
    assert_eq!(base[0].end, End::Finished(FinishReason::Stop));
    assert_eq!(base[1].end, End::Finished(FinishReason::Stop));
    for (name, cfg, spec) in [
        ("ngram", config(false), Some(SpecMethod::Ngram)),
        ("async", config(true), None),
        ("ngram+async", config(true), Some(SpecMethod::Ngram)),
        ("draft+async", config(true), Some(SpecMethod::Draft)),
    ] {
        let (out, accepted) = run(&model, cfg, spec, &reqs);
        for (i, (a, b)) in base.iter().zip(&out).enumerate() {
            assert_eq!((&a.tokens, &a.end), (&b.tokens, &b.end), "{name}: request {i} differs");
        }
        if spec.is_some() {
            assert!(accepted > 0, "{name}: no draft token was accepted, speculation was not exercised");
        }
    }
}

/// 8 KV blocks of 16 (128 tokens) for six requests of 30-100 tokens each: requests wait for room
/// and running ones are preempted and recomputed; the grammar state stays with the sequence, so
/// the outputs do not change (sync and async, with n-gram speculation).
#[test]
fn constrained_outputs_do_not_change_under_a_tiny_kv_pool() {
    let Some(model) = model_for_tests("constrained_outputs_do_not_change_under_a_tiny_kv_pool") else {
        return;
    };
    let reqs: Vec<(Vec<u32>, SamplingParams)> = requests(&model).iter().map(|(p, c)| (p.clone(), params(c, 40))).collect();
    let (base, _) = run(&model, config(false), None, &reqs);
    for (async_scheduling, spec) in [(false, None), (true, None), (true, Some(SpecMethod::Ngram))] {
        let small = EngineConfig { num_kv_blocks: 8, max_model_len: 128, max_num_batched_tokens: 64, ..config(async_scheduling) };
        let (out, _) = run(&model, small, spec, &reqs);
        for (i, (a, b)) in base.iter().zip(&out).enumerate() {
            assert_eq!((&a.tokens, &a.end), (&b.tokens, &b.end), "async {async_scheduling}, {spec:?}: request {i} differs");
        }
    }
}

#[test]
fn seeded_constrained_sampling_is_the_same_with_async_scheduling_on_and_off() {
    let Some(model) = model_for_tests("seeded_constrained_sampling_is_the_same_with_async_scheduling_on_and_off") else {
        return;
    };
    let tok = tokenizer(&model);
    let reqs: Vec<(Vec<u32>, SamplingParams)> = requests(&model)
        .iter()
        .enumerate()
        .map(|(i, (p, c))| (p.clone(), SamplingParams { temperature: 0.9, seed: Some(100 + i as u64), ..params(c, 60) }))
        .collect();
    for spec in [None, Some(SpecMethod::Ngram)] {
        let (sync, _) = run(&model, config(false), spec, &reqs);
        let (asyn, _) = run(&model, config(true), spec, &reqs);
        assert_eq!(sync, asyn, "{spec:?}");
        for ((_, c), o) in requests(&model).iter().zip(&sync) {
            let End::Finished(reason) = &o.end else { panic!("{c:?}: {:?}", o.end) };
            check(c, &tok.decode(&o.tokens, true).unwrap(), *reason == FinishReason::Stop);
        }
    }
}

#[test]
fn a_grammar_that_fails_at_run_time_fails_its_own_request_only() {
    // invariant 5: a matcher error (or a panic inside llguidance) while a step runs fails the
    // constrained request whose grammar failed; the free requests of the same step go on exactly
    // as without the fault, every KV block comes back, and the engine serves the next request
    let Some(model) = model_for_tests("a_grammar_that_fails_at_run_time_fails_its_own_request_only") else {
        return;
    };
    let (schema_prompt, schema) = requests(&model).swap_remove(2);
    let batch = vec![
        (chat(&model, "Name three colors."), SamplingParams::greedy(24)),
        (schema_prompt, params(&schema, 40)),
        (chat(&model, "Count from one to five."), SamplingParams::greedy(24)),
    ];
    for (async_scheduling, spec) in [(false, None), (true, None), (false, Some(SpecMethod::Ngram)), (true, Some(SpecMethod::Ngram))] {
        let (base, _) = run(&model, config(async_scheduling), spec, &batch);
        assert!(base.iter().all(|o| matches!(o.end, End::Finished(_))), "{base:?}");
        for kind in [FaultKind::Error, FaultKind::Panic] {
            let what = format!("async {async_scheduling}, {spec:?}, {kind:?}");
            // step 3 samples the constrained sequence's third token
            let fault = Some(FaultInjection { step: 3, kind, phase: FaultPhase::Grammar });
            let mut rig = Rig::new(&model, EngineConfig { fault_injection: fault, ..config(async_scheduling) }, spec.map(|m| spec_config(m, 3, None)));
            let out = rig.run_batch(&batch);
            for i in [0, 2] {
                assert_eq!((&out[i].tokens, &out[i].end), (&base[i].tokens, &base[i].end), "{what}: free request {i}");
            }
            let End::Failed(message) = &out[1].end else { panic!("{what}: the constrained request did not fail: {:?}", out[1]) };
            assert!(message.contains("structured output failed"), "{what}: {message}");
            assert!(out[1].tokens.len() < base[1].tokens.len(), "{what}: {:?}", out[1]);
            rig.assert_no_leaks();
            // the engine goes on: the same constrained request again completes as it did
            let again = rig.run_batch(&batch[1..2]);
            assert_eq!((&again[0].tokens, &again[0].end), (&base[1].tokens, &base[1].end), "{what}: the request after the fault");
            rig.assert_no_leaks();
        }
    }
}

#[test]
fn invalid_constraints_fail_before_running_and_name_the_problem() {
    let Some(model) = model_for_tests("invalid_constraints_fail_before_running_and_name_the_problem") else {
        return;
    };
    let tok = Arc::new(tokenizer(&model));
    let bad = [
        (Constraint::Regex("(ab".into()), "regex"),
        (Constraint::JsonSchema("{\"type\": \"object\", \"properties\": 3}".into()), "JSON schema"),
        (Constraint::JsonSchema("{\"type\": \"strin\"}".into()), "JSON schema"),
        (Constraint::Lark("start: missing_rule".into()), "grammar"),
    ];
    for (c, what) in &bad {
        let e = compile(&tok, c).unwrap_err().0;
        assert!(e.contains(what), "{c:?}: {e}");
    }
    assert!(compile(&tok, &Constraint::JsonSchema(PERSON_SCHEMA.into())).is_ok());
    // submitted anyway (without the grammar they cannot compile to): failed at admission,
    // nothing runs, nothing leaks; the engine thread never compiles
    let mut rig = Rig::new(&model, config(false), None);
    let out = rig.run_batch(&bad.iter().map(|(c, _)| (chat(&model, "hi"), params(c, 8))).collect::<Vec<_>>());
    for o in &out {
        assert!(matches!(&o.end, End::Failed(m) if m.contains("compiled grammar")), "{:?}", o.end);
        assert!(o.tokens.is_empty());
    }
    rig.assert_no_leaks();
}

/// The distribution check: a regex whose last character is one of A, B, C, D after a fixed
/// text; the prompt contains that text followed by "B", so the n-gram proposer drafts " B" there
/// and the choice is made by verification (accept, or resample from the residual). Among samples
/// whose tokens before that point are the canonical tokenization of the fixed text, the token
/// chosen there must follow the target's softmax at temperature 1 restricted to the tokens that
/// keep the text inside the regex (derived here from each token's decoded text). Pearson's
/// chi-square against a p = 0.001 critical value.
#[test]
fn constrained_sampling_with_ngram_speculation_follows_the_masked_target_distribution() {
    let Some(model) = model_for_tests("constrained_sampling_with_ngram_speculation_follows_the_masked_target_distribution") else {
        return;
    };
    let tok = tokenizer(&model);
    let lead = "The answer is";
    let prompt = chat(&model, "Pick one letter among A, B, C and D and reply like this: The answer is B");
    let lead_tokens = tok.encode(lead).unwrap();
    let constraint = Constraint::Regex("The answer is [ABCD]".into());

    // the oracle: the target's logits after the canonical lead, masked to the allowed tokens
    let mut at_lead = prompt.clone();
    at_lead.extend_from_slice(&lead_tokens);
    let vocab = tok.vocab_size();
    let mut rig = Rig::new(&model, config(false), None);
    let oracle = rig.run_batch(&[(at_lead, SamplingParams { logprobs: Some(vocab), ..SamplingParams::greedy(1) })]);
    let row = &oracle[0].logprobs[0].top;
    let allowed: Vec<u32> = (0..vocab as u32)
        .filter(|&t| {
            let s = tok.decode(&[t], false).unwrap();
            !s.is_empty() && ["A", "B", "C", "D"].iter().any(|x| format!(" {x}").starts_with(&s))
        })
        .collect();
    assert!(allowed.len() >= 5, "allowed continuations: {allowed:?}");
    let logit = |t: u32| row.iter().find(|(id, _)| *id == t).map(|(_, lp)| *lp as f64).unwrap();
    let z: f64 = allowed.iter().map(|&t| logit(t).exp()).sum();
    let expected: Vec<f64> = allowed.iter().map(|&t| logit(t).exp() / z).collect();

    // the samples, with n-gram speculation and async scheduling
    let n = 480;
    let reqs: Vec<(Vec<u32>, SamplingParams)> = (0..n)
        .map(|i| {
            (
                prompt.clone(),
                SamplingParams { temperature: 1.0, seed: Some(7000 + i), constraint: Some(Arc::new(constraint.clone())), max_tokens: 12, ..Default::default() },
            )
        })
        .collect();
    let mut rig = Rig::new(&model, config(true), Some(spec_config(SpecMethod::Ngram, 3, None)));
    let out = rig.run_batch(&reqs);
    rig.assert_no_leaks();
    let spec_drafts = rig.engine.spec_metrics().map_or((0, 0), |m| (m.num_draft_tokens, m.num_accepted_tokens));
    let mut counts = vec![0usize; allowed.len()];
    for o in &out {
        let text = tok.decode(&o.tokens, true).unwrap();
        assert!(text.len() == lead.len() + 2 && text.starts_with(lead), "{text:?}");
        if o.tokens.len() > lead_tokens.len() && o.tokens[..lead_tokens.len()] == lead_tokens[..] {
            let t = o.tokens[lead_tokens.len()];
            counts[allowed.iter().position(|&a| a == t).expect("a token outside the mask")] += 1;
        }
    }
    let total: usize = counts.iter().sum();
    assert!(total >= n as usize / 4, "only {total} samples took the canonical lead");
    // drafts were verified (the n-gram proposer drafts the letter from the prompt), some accepted
    assert!(spec_drafts.1 > 0 && spec_drafts.0 > 0, "drafts (proposed, accepted): {spec_drafts:?}");
    // bins with expected count < 5 are merged
    let (mut stat, mut df, mut small_obs, mut small_exp) = (0.0, 0usize, 0.0, 0.0);
    for (c, p) in counts.iter().zip(&expected) {
        let e = p * total as f64;
        if e < 5.0 {
            small_obs += *c as f64;
            small_exp += e;
        } else {
            stat += (*c as f64 - e).powi(2) / e;
            df += 1;
        }
    }
    if small_exp > 0.0 {
        stat += (small_obs - small_exp).powi(2) / small_exp.max(1.0);
        df += 1;
    }
    let df = df.saturating_sub(1).max(1);
    // chi-square critical values at p = 0.001 for 1..=6 degrees of freedom
    let critical = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46][df.min(6) - 1];
    eprintln!("counts {counts:?} expected {expected:?} over {total}: chi2 {stat:.2} (df {df}, critical {critical})");
    assert!(stat < critical, "chi-square {stat:.2} >= {critical} (df {df}): counts {counts:?}, expected probabilities {expected:?}");
}

/// A schema whose output is mostly boilerplate: every key required, in order, no others, so
/// each key (with its quotes, colon and separators) is forced by the grammar.
const RECORD_SCHEMA: &str = r#"{"type": "object", "properties": {"first_name": {"type": "string", "maxLength": 12}, "last_name": {"type": "string", "maxLength": 12}, "email_address": {"type": "string", "maxLength": 24}, "is_active_member": {"type": "boolean"}, "country_of_residence": {"enum": ["France", "Italy", "Norway"]}, "year_of_birth": {"type": "integer", "minimum": 1900, "maximum": 2025}}, "required": ["first_name", "last_name", "email_address", "is_active_member", "country_of_residence", "year_of_birth"], "additionalProperties": false}"#;

/// Schema-heavy requests: the record schema and the person schema.
fn schema_requests(model: &Path, max_tokens: usize) -> Vec<(Vec<u32>, SamplingParams)> {
    let record = Constraint::JsonSchema(RECORD_SCHEMA.into());
    let person = Constraint::JsonSchema(PERSON_SCHEMA.into());
    vec![
        (chat(model, "Make up a club member record as JSON."), params(&record, max_tokens)),
        (chat(model, "Describe a person called Bob, 40, from Rome, as JSON."), params(&person, max_tokens)),
        (chat(model, "A member record for Ann Lee, born 1990, living in Norway, as JSON."), params(&record, max_tokens)),
    ]
}

fn without_jump_forward(cfg: EngineConfig) -> EngineConfig {
    EngineConfig { jump_forward: false, ..cfg }
}

/// Outcomes, forced draft tokens (proposed, accepted; speculation only) and the proposer's
/// (proposed, accepted) draft tokens.
fn run_counting(model: &Path, cfg: EngineConfig, spec: Option<SpecMethod>, reqs: &[(Vec<u32>, SamplingParams)]) -> (Vec<Outcome>, (u64, u64), (u64, u64)) {
    let mut rig = Rig::new(model, cfg, spec.map(|m| spec_config(m, 4, None)));
    let out = rig.run_batch(reqs);
    rig.assert_no_leaks();
    let m = rig.engine.spec_metrics();
    let forced = m.map_or((0, 0), |m| (m.num_forced_tokens, m.num_forced_accepted_tokens));
    let proposer = m.map_or((0, 0), |m| (m.num_draft_tokens, m.num_accepted_tokens));
    (out, forced, proposer)
}

/// Jump-forward: on schema-heavy outputs the grammar's forced tokens are drafted and accepted
/// (several tokens per step without any speculative method; counted apart from the n-gram
/// proposer's drafts with one), and greedy outputs are token for token plain constrained
/// decoding's (jump-forward off, no speculation), sync and async.
#[test]
fn jump_forward_drafts_forced_tokens_that_are_accepted_and_change_no_greedy_output() {
    let Some(model) = model_for_tests("jump_forward_drafts_forced_tokens_that_are_accepted_and_change_no_greedy_output") else {
        return;
    };
    let tok = tokenizer(&model);
    let reqs = schema_requests(&model, 80);
    let (base, forced, _) = run_counting(&model, without_jump_forward(config(false)), None, &reqs);
    assert_eq!(forced, (0, 0));
    assert!(base.iter().all(|o| o.step_sizes.iter().all(|&n| n == 1)), "plain decoding emits one token per step");
    for ((_, p), o) in reqs.iter().zip(&base) {
        let text = tok.decode(&o.tokens, true).unwrap();
        eprintln!("{text:?} ({:?})", o.end);
        check(p.constraint.as_ref().unwrap(), &text, o.end == End::Finished(FinishReason::Stop));
    }
    let base_tokens: usize = base.iter().map(|o| o.tokens.len()).sum();
    for (name, cfg, spec) in [
        ("jump-forward", config(false), None),
        ("jump-forward+async", config(true), None),
        ("jump-forward+ngram", config(false), Some(SpecMethod::Ngram)),
        ("jump-forward+ngram+async", config(true), Some(SpecMethod::Ngram)),
        ("ngram without jump-forward", without_jump_forward(config(true)), Some(SpecMethod::Ngram)),
    ] {
        let (out, forced, proposer) = run_counting(&model, cfg.clone(), spec, &reqs);
        for (i, (a, b)) in base.iter().zip(&out).enumerate() {
            assert_eq!((&a.tokens, &a.end), (&b.tokens, &b.end), "{name}: request {i} differs");
        }
        let steps: usize = out.iter().map(|o| o.step_sizes.len()).sum();
        eprintln!("{name}: {base_tokens} tokens in {steps} steps' deltas; forced (proposed, accepted) {forced:?}, proposer {proposer:?}");
        if cfg.jump_forward {
            // forced tokens arrive with the token after them: far fewer deltas than tokens
            assert!(steps * 10 < base_tokens * 8, "{name}: {steps} deltas for {base_tokens} tokens");
        }
        match (cfg.jump_forward, spec) {
            (true, Some(_)) => {
                assert!(forced.0 > 10, "{name}: forced drafts {forced:?}");
                // one-hot masks: every forced draft token verified is accepted
                assert_eq!(forced.0, forced.1, "{name}");
            }
            (false, Some(_)) => assert_eq!(forced, (0, 0), "{name}"),
            _ => {}
        }
    }
}

/// Seeded constrained sampling with jump-forward is plain constrained sampling token for token
/// (a forced position's masked distribution is one-hot, and every position keeps its own draw),
/// sync and async, without and with n-gram speculation.
#[test]
fn seeded_sampling_with_jump_forward_is_plain_constrained_sampling() {
    let Some(model) = model_for_tests("seeded_sampling_with_jump_forward_is_plain_constrained_sampling") else {
        return;
    };
    let reqs: Vec<(Vec<u32>, SamplingParams)> = schema_requests(&model, 80)
        .into_iter()
        .enumerate()
        .map(|(i, (p, s))| (p, SamplingParams { temperature: 0.8, top_p: 0.95, seed: Some(40 + i as u64), ..s }))
        .collect();
    let (base, _, _) = run_counting(&model, without_jump_forward(config(false)), None, &reqs);
    for (name, cfg, spec) in
        [("jump-forward", config(false), None), ("jump-forward+async", config(true), None), ("jump-forward+ngram+async", config(true), Some(SpecMethod::Ngram))]
    {
        let (out, forced, _) = run_counting(&model, cfg, spec, &reqs);
        for (i, (a, b)) in base.iter().zip(&out).enumerate() {
            assert_eq!((&a.tokens, &a.end), (&b.tokens, &b.end), "{name}: request {i} differs");
        }
        assert!(out.iter().any(|o| o.step_sizes.iter().any(|&n| n > 1)), "{name}: no step emitted forced drafts");
        assert_eq!(forced.0, forced.1, "{name}: a forced draft token was rejected");
    }
}
