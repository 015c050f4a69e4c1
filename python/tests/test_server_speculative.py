"""Speculative decoding through the real server: greedy output and logprobs are those of plain
decoding (ngram proposer, and the model as its own draft), seeded sampling is reproducible,
streams equal whole responses, aborts give every block back, and the spec counters move."""

from __future__ import annotations

import json
import time

import pytest

from server_fixture import server_fixture, sse_events

KV = ("--kv-cache-tokens", "4096", "--max-model-len", "2048")
plain = server_fixture(*KV)
ngram = server_fixture(*KV, "--speculative-method", "ngram", "--num-speculative-tokens", "3", "--no-speculative-adaptive")


@pytest.fixture(scope="module")
def draft(plain):
    """The model drafting for itself (its weights as stored, not re-encoded as Q4_0): every greedy
    draft is accepted, so verification is exercised fully."""
    from server_fixture import SpeculaServer

    srv = SpeculaServer(*KV, "--speculative-method", "draft", "--draft-model", str(plain.model), "--draft-weights", "stored",
                        "--num-speculative-tokens", "3", "--no-speculative-adaptive").start()
    try:
        yield srv
    finally:
        srv.stop()


CODE = '''def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def fibonacci_list(n):
    return [fibonacci(i) for i in range(n)]


def fibonacci'''
REPEAT = "one two three four five, one two three four five, one two three four five, one two"
PROMPTS = [CODE, REPEAT, "The capital of France is"]


def greedy(srv, prompt, **kw):
    c = srv.client()
    return c.completions.create(model=srv.model_name, prompt=prompt, max_tokens=kw.pop("max_tokens", 32), temperature=0,
                                extra_body={"ignore_eos": True}, **kw)


@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_greedy_equals_plain_decoding(plain, spec, request):
    srv = request.getfixturevalue(spec)
    for p in PROMPTS:
        want = greedy(plain, p).choices[0].text
        got = greedy(srv, p)
        assert got.choices[0].text == want, f"{spec} changed the greedy output for {p[:30]!r}"
        assert got.usage.completion_tokens == 32


@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_logprobs_equal_plain_decoding(plain, spec, request):
    srv = request.getfixturevalue(spec)
    want = greedy(plain, CODE, max_tokens=16, logprobs=3).choices[0].logprobs
    got = greedy(srv, CODE, max_tokens=16, logprobs=3).choices[0].logprobs
    assert got.tokens == want.tokens
    # the engine is batch invariant: a verified row's logits are the plain step's, bit for bit,
    # and JSON carries floats exactly
    assert got.token_logprobs == want.token_logprobs
    assert got.top_logprobs == want.top_logprobs


@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_seeded_sampling_is_reproducible_and_streams_match(spec, request):
    srv = request.getfixturevalue(spec)
    c = srv.client()
    kw = dict(model=srv.model_name, prompt=CODE, max_tokens=24, temperature=0.8, seed=11)
    a = c.completions.create(**kw).choices[0].text
    b = c.completions.create(**kw).choices[0].text
    s = "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw) if ch.choices)
    assert a == b == s


@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_concurrent_greedy_with_speculation(plain, spec, request):
    from concurrent.futures import ThreadPoolExecutor

    srv = request.getfixturevalue(spec)
    want = [greedy(plain, p, max_tokens=20).choices[0].text for p in PROMPTS]
    with ThreadPoolExecutor(max_workers=6) as pool:
        got = list(pool.map(lambda p: greedy(srv, p, max_tokens=20).choices[0].text, PROMPTS * 2))
    assert got == want * 2


@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_stop_string_and_abort_with_speculation(spec, request):
    srv = request.getfixturevalue(spec)
    full = greedy(srv, REPEAT, max_tokens=16).choices[0].text
    stop = full.split()[2]
    r = greedy(srv, REPEAT, max_tokens=16, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[: full.index(stop)]

    body = {"prompt": CODE, "max_tokens": 1900, "temperature": 0, "ignore_eos": True, "stream": True}
    with srv.http() as http, http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, resp.read()
        events = sse_events(resp)
        for _ in range(4):
            json.loads(next(events))
    m = srv.wait_idle(10)
    assert m["specula:kv_cache_usage_perc"] == 0 and m["specula:num_requests_running"] == 0, m


@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_spec_metrics_count_drafts(spec, request):
    srv = request.getfixturevalue(spec)
    greedy(srv, CODE, max_tokens=24)
    time.sleep(0.1)
    m = srv.metrics()
    drafts = m.get("specula:spec_decode_num_drafts", 0)
    draft_tokens = m.get("specula:spec_decode_num_draft_tokens", 0)
    accepted = m.get("specula:spec_decode_num_accepted_tokens", 0)
    assert drafts > 0 and draft_tokens > 0, {k: v for k, v in m.items() if "spec" in k}
    assert 0 < accepted <= draft_tokens
    if spec == "draft":
        # The model drafting for itself under greedy decoding: every draft token is accepted.
        assert accepted == draft_tokens
