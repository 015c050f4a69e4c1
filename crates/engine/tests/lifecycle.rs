//! Request lifecycle through the engine on the tiny model: the event protocol, finish reasons,
//! abort and client disconnect (blocks come back), and bad input failing only its own request.

mod common;

use common::{greedy, prompt, End, Harness, Spec};
use specula_engine::{FinishReason, RequestEvent, SamplingParams};

#[test]
fn every_request_streams_deltas_then_exactly_one_finished() {
    let mut h = Harness::new(common::tiny_config());
    let mut clients: Vec<_> = (0..6)
        .map(|i| {
            let params = if i % 2 == 0 { greedy(5 + i * 3) } else { common::seeded(5 + i * 3, 0.9, i as u64) };
            h.submit(prompt(3 + i * 17, i as u64), params)
        })
        .collect();
    let mut refs: Vec<&mut _> = clients.iter_mut().collect();
    h.run(&mut refs, 500);
    for (i, c) in clients.iter().enumerate() {
        // completion_tokens == tokens streamed is checked inside `finished_tokens`
        assert_eq!(c.finished_tokens(FinishReason::Length).len(), 5 + i * 3);
        assert!(c.events.iter().rev().skip(1).all(|e| matches!(e, specula_engine::RequestEvent::Delta { .. })));
    }
    h.assert_idle_and_leak_free();
}

#[test]
fn max_tokens_ends_with_length_and_exactly_that_many_tokens() {
    let mut h = Harness::new(common::tiny_config());
    let mut c = h.submit(prompt(10, 1), greedy(7));
    h.run(&mut [&mut c], 100);
    assert_eq!(c.finished_tokens(FinishReason::Length).len(), 7);
    h.assert_idle_and_leak_free();
}

#[test]
fn full_context_ends_with_length() {
    let cfg = common::tiny_config();
    let max_len = cfg.max_model_len;
    let mut h = Harness::new(cfg);
    let mut c = h.submit(prompt(max_len - 3, 2), greedy(100));
    h.run(&mut [&mut c], 100);
    assert_eq!(c.finished_tokens(FinishReason::Length).len(), 3, "prompt + output fill --max-model-len exactly");
    h.assert_idle_and_leak_free();
}

#[test]
fn stop_string_ends_with_stop_and_is_not_returned() {
    let mut h = Harness::new(common::tiny_config());
    let p = h.text("Tell me a story about a robot.");
    let mut free = h.submit(p.clone(), greedy(40));
    h.run(&mut [&mut free], 200);
    free.finished_tokens(FinishReason::Length);
    let full = free.text();
    // a two-character stop string taken from the middle of the free-running text, avoiding the
    // replacement character (random byte tokens are often invalid UTF-8)
    let chars: Vec<(usize, char)> = full.char_indices().collect();
    let at = (chars.len() / 3..chars.len().saturating_sub(2))
        .find(|&i| chars[i].1 != '\u{FFFD}' && chars[i + 1].1 != '\u{FFFD}')
        .unwrap_or_else(|| panic!("no usable stop string in {full:?}"));
    let stop: String = [chars[at].1, chars[at + 1].1].iter().collect();
    let expected = &full[..full.find(&stop).unwrap()];

    let mut c = h.submit(p, SamplingParams { stop: vec![stop.clone()].into(), ..greedy(40) });
    h.run(&mut [&mut c], 200);
    let tokens = c.finished_tokens(FinishReason::Stop);
    assert_eq!(c.text(), expected, "text up to (not including) the stop string {stop:?}");
    assert!(tokens.len() < 40);
    assert_eq!(tokens[..], free.tokens()[..tokens.len()], "same greedy tokens up to the stop");
    h.assert_idle_and_leak_free();
}

#[test]
fn stop_token_ends_with_stop_and_is_streamed() {
    let mut h = Harness::new(common::tiny_config());
    let p = prompt(12, 3);
    let mut free = h.submit(p.clone(), greedy(30));
    h.run(&mut [&mut free], 200);
    let out = free.finished_tokens(FinishReason::Length);
    let stop_id = out[6];
    let first = out.iter().position(|&t| t == stop_id).unwrap();

    let mut by_id = h.submit(p.clone(), SamplingParams { stop_token_ids: vec![stop_id].into(), ..greedy(30) });
    h.run(&mut [&mut by_id], 200);
    assert_eq!(by_id.finished_tokens(FinishReason::Stop), out[..=first], "stops at (and streams) the stop token");
    h.assert_idle_and_leak_free();
}

#[test]
fn abort_mid_generation_returns_every_block() {
    let mut h = Harness::new(common::tiny_config());
    let total = h.engine.num_total_blocks();
    let mut a = h.submit(prompt(40, 4), greedy(100));
    let mut b = h.submit(prompt(70, 5), greedy(100));
    for _ in 0..6 {
        h.step();
    }
    a.drain(h.steps);
    assert!(!a.tokens().is_empty(), "generation under way before the abort");
    assert!(h.engine.num_free_blocks() < total);
    h.engine.abort(a.id);
    h.engine.abort(b.id);
    assert_eq!(h.engine.num_free_blocks(), total, "abort frees at once");
    a.drain(h.steps);
    b.drain(h.steps);
    assert_eq!(a.end(), End::Finished(FinishReason::Abort));
    assert_eq!(b.end(), End::Finished(FinishReason::Abort));
    h.engine.abort(a.id); // aborting twice is harmless
    h.assert_idle_and_leak_free();
}

#[test]
fn aborting_a_waiting_request_balances_the_queue_counter() {
    let cfg = specula_engine::EngineConfig { max_num_seqs: 1, ..common::tiny_config() };
    let mut h = Harness::new(cfg);
    let mut running = h.submit(prompt(10, 6), greedy(20));
    let mut waiting = h.submit(prompt(10, 7), greedy(20));
    h.step();
    h.engine.abort(waiting.id);
    waiting.drain(h.steps);
    assert_eq!(waiting.end(), End::Finished(FinishReason::Abort));
    assert!(waiting.tokens().is_empty());
    h.run(&mut [&mut running], 100);
    running.finished_tokens(FinishReason::Length);
    h.assert_idle_and_leak_free();
}

#[test]
fn client_disconnect_frees_blocks_on_the_next_step() {
    let mut h = Harness::new(common::tiny_config());
    let total = h.engine.num_total_blocks();
    let mut gone = h.submit(prompt(50, 8), greedy(100));
    let mut stays = h.submit(prompt(20, 9), greedy(10));
    for _ in 0..4 {
        h.step();
    }
    gone.drain(h.steps);
    assert!(!gone.tokens().is_empty());
    gone.disconnect();
    h.run(&mut [&mut stays], 100);
    stays.finished_tokens(FinishReason::Length);
    h.assert_idle_and_leak_free();

    // alone: the very next step frees everything
    let mut c = h.submit(prompt(50, 10), greedy(100));
    for _ in 0..4 {
        h.step();
    }
    c.drain(h.steps);
    assert!(h.engine.num_free_blocks() < total);
    c.disconnect();
    h.step();
    assert_eq!(h.engine.num_free_blocks(), total);
    h.assert_idle_and_leak_free();
}

#[test]
fn bad_input_fails_that_request_only() {
    let cfg = common::tiny_config();
    let max_len = cfg.max_model_len;
    let mut h = Harness::new(cfg);
    let good_prompt = prompt(30, 11);
    let mut alone = h.submit(good_prompt.clone(), greedy(25));
    h.run(&mut [&mut alone], 200);
    let expected = alone.finished_tokens(FinishReason::Length);

    let mut good = h.submit(good_prompt, greedy(25));
    h.step();
    let mut bad = vec![
        (h.submit(vec![], greedy(5)), "empty"),
        (h.submit(prompt(max_len, 12), greedy(5)), "--max-model-len"),
        (h.submit(prompt(max_len + 40, 12), greedy(5)), "--max-model-len"),
        (h.submit(vec![1, 2, 259, 3], greedy(5)), "token id 259 is outside the vocabulary of 259"),
        (h.submit(vec![1, u32::MAX], greedy(5)), "outside the vocabulary"),
        (h.submit(prompt(5, 13), SamplingParams { max_tokens: 0, ..greedy(1) }), "max_tokens"),
        (h.submit(prompt(5, 13), SamplingParams { temperature: -1.0, ..greedy(5) }), "temperature"),
        (h.submit(prompt(5, 13), SamplingParams { top_p: 0.0, ..greedy(5) }), "top_p"),
    ];
    let mut refs: Vec<&mut common::Client> = bad.iter_mut().map(|(c, _)| c).collect();
    refs.push(&mut good);
    h.run(&mut refs, 200);
    for (c, needle) in &bad {
        match c.end() {
            End::Failed(msg) => assert!(msg.contains(needle), "message {msg:?} should mention {needle:?}"),
            other => panic!("bad request ended {other:?}"),
        }
        assert!(c.tokens().is_empty());
    }
    assert_eq!(good.finished_tokens(FinishReason::Length), expected, "a neighbour's bad input changed nothing");
    h.assert_idle_and_leak_free();
}

#[test]
fn speculation_never_overshoots_max_tokens_or_the_context() {
    for spec in [Spec::SelfDraft(4), Spec::Ngram(4)] {
        let cfg = common::tiny_config();
        let max_len = cfg.max_model_len;
        let mut h = Harness::speculating(cfg, spec);
        let mut short = h.submit(prompt(10, 20), greedy(7));
        let mut full = h.submit(prompt(max_len - 6, 21), greedy(100));
        h.run(&mut [&mut short, &mut full], 200);
        assert_eq!(short.finished_tokens(FinishReason::Length).len(), 7, "{spec:?}");
        assert_eq!(full.finished_tokens(FinishReason::Length).len(), 6, "{spec:?}");
        h.assert_idle_and_leak_free();
    }
}

#[test]
fn logprobs_come_one_per_streamed_token() {
    for spec in [Spec::None, Spec::SelfDraft(3), Spec::OtherDraft(3)] {
        let mut h = Harness::speculating(common::tiny_config(), spec);
        let mut with = h.submit(prompt(15, 22), SamplingParams { logprobs: Some(3), ..greedy(20) });
        let mut zero = h.submit(prompt(15, 23), SamplingParams { logprobs: Some(0), ..common::seeded(20, 0.8, 5) });
        let mut without = h.submit(prompt(15, 24), greedy(20));
        h.run(&mut [&mut with, &mut zero, &mut without], 200);
        for (c, k) in [(&with, Some(3)), (&zero, Some(0)), (&without, None)] {
            c.finished_tokens(FinishReason::Length);
            for e in &c.events {
                if let RequestEvent::Delta { tokens, logprobs, .. } = e {
                    match k {
                        None => assert!(logprobs.is_empty(), "{spec:?}: logprobs nobody asked for"),
                        Some(k) => {
                            assert_eq!(logprobs.len(), tokens.len(), "{spec:?}: one logprob entry per token");
                            for (lp, &t) in logprobs.iter().zip(tokens) {
                                assert_eq!(lp.token, t);
                                assert!(lp.logprob <= 0.0 && lp.logprob.is_finite());
                                assert_eq!(lp.top.len(), k, "{spec:?}: top-k alternatives");
                                assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1), "top sorted by logprob");
                            }
                        }
                    }
                }
            }
        }
        // greedy picks the most likely token: its logprob is the top one
        for e in &with.events {
            if let RequestEvent::Delta { logprobs, .. } = e {
                for lp in logprobs {
                    assert_eq!(lp.top[0].0, lp.token, "{spec:?}: greedy token is not the top-1");
                }
            }
        }
        h.assert_idle_and_leak_free();
    }
}

#[test]
fn text_held_back_for_a_stop_string_is_flushed_when_the_request_ends() {
    let mut h = Harness::new(common::tiny_config());
    let p = prompt(9, 25);
    let mut free = h.submit(p.clone(), greedy(30));
    h.run(&mut [&mut free], 200);
    free.finished_tokens(FinishReason::Length);
    // stop strings that start like the end of the output but never complete: the tail is held
    // back while it might still grow into one, then sent when max_tokens ends the request
    let last: String = free.text().chars().last().into_iter().collect();
    let stops = vec![format!("{last}\u{1}\u{2}never"), "\u{0}absent".to_string()];
    let mut c = h.submit(p, SamplingParams { stop: stops.into(), ..greedy(30) });
    h.run(&mut [&mut c], 200);
    assert_eq!(c.finished_tokens(FinishReason::Length), free.tokens());
    assert_eq!(c.text(), free.text());
    h.assert_idle_and_leak_free();
}

#[test]
fn engine_refuses_a_max_model_len_beyond_the_model_context() {
    let m = common::TinyModel::new();
    let loaded = specula_model::load_model(&m.path).unwrap();
    let cfg = specula_engine::EngineConfig { max_model_len: 1024, ..common::tiny_config() };
    let counters = std::sync::Arc::new(specula_engine::handle::QueueCounters::default());
    match specula_engine::Engine::new(loaded.model, std::sync::Arc::new(loaded.tokenizer), cfg, counters) {
        Ok(_) => panic!("accepted --max-model-len 1024 for a 512-token model"),
        Err(e) => assert!(e.to_string().contains("--max-model-len 1024 exceeds the model's context length 512"), "{e}"),
    }
}
