"""Overload, disconnects and the KV-block invariant, seen from outside through /metrics:
a full queue answers 503; a client that goes away mid-stream (or mid-request) frees its blocks;
after finished, stopped, aborted and failed requests the block pool is whole again; preemption
under a tiny KV cache changes no greedy output."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from server_fixture import httpx, server_fixture, sse_events

server = server_fixture()
busy_server = server_fixture("--max-waiting", "1", "--max-num-seqs", "1")
tiny_kv_server = server_fixture("--kv-cache-tokens", "128", "--max-model-len", "128", "--max-num-seqs", "4")

STORY = "Once upon a time, in a small village at the edge of a great forest, there lived"

REQUIRED_METRICS = [
    "specula:time_to_first_token_seconds",
    "specula:e2e_request_latency_seconds",
    "specula:prompt_tokens_total",
    "specula:generation_tokens_total",
    "specula:num_requests_running",
    "specula:num_requests_waiting",
    "specula:kv_cache_usage_perc",
    "specula:num_preemptions_total",
]


def metric_names(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
    return names


def assert_pool_whole(srv, timeout=15.0):
    m = srv.wait_idle(timeout)
    assert m.get("specula:kv_cache_usage_perc") == 0, {k: v for k, v in m.items() if "num_req" in k or "kv" in k}
    assert m.get("specula:num_requests_running") == 0, m
    assert m.get("specula:num_requests_waiting") == 0, m
    return m


ABORTED = 'specula:request_success_total{finished_reason="abort"}'
GENERATED = "specula:generation_tokens_total"


def assert_aborted_early(srv, before, asked, aborts=1):
    """After a client went away: the abort counter rose by `aborts`, and the engine generated far
    fewer tokens than the `asked` it would have run to without the abort."""
    m = srv.metrics()
    assert m.get(ABORTED, 0) - before.get(ABORTED, 0) == aborts, {k: v for k, v in m.items() if "request_success" in k}
    generated = m.get(GENERATED, 0) - before.get(GENERATED, 0)
    assert generated < asked / 4, f"{generated} tokens generated of {asked} asked: the request was not cut short"


def wait_until_running(srv, n=1, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = srv.metrics()
        if m.get("specula:num_requests_running", 0) >= n and m.get("specula:kv_cache_usage_perc", 0) > 0:
            return m
        time.sleep(0.05)
    pytest.fail(f"the engine never showed {n} running request(s) holding KV blocks: {srv.metrics()}")


# ---------------------------------------------------------------------------------------------
# Queue full
# ---------------------------------------------------------------------------------------------


def test_queue_full_is_503_and_the_rest_complete(busy_server):
    body = {"prompt": STORY, "max_tokens": 32, "temperature": 0, "ignore_eos": True}

    def send(_):
        with busy_server.http() as http:
            return http.post("/v1/completions", json=body)

    # One runs, one waits; everything beyond that has to be refused rather than queued.
    with ThreadPoolExecutor(max_workers=6) as pool:
        responses = list(pool.map(send, range(6)))
    codes = sorted(r.status_code for r in responses)
    refused = [r for r in responses if r.status_code == 503]
    done = [r for r in responses if r.status_code == 200]
    assert refused, f"no request was refused: {codes}"
    assert len(done) >= 1 and len(refused) + len(done) == 6, codes
    for r in refused:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "server_error" and err["code"] == "overloaded"
        assert "overloaded" in err["message"] and "retry" in err["message"].lower(), err["message"]
        assert r.headers.get("retry-after") == "1"
    texts = {r.json()["choices"][0]["text"] for r in done}
    assert len(texts) == 1, "the same greedy request must give the same text"
    for r in done:
        assert r.json()["usage"]["completion_tokens"] == 32
    assert_pool_whole(busy_server)


def test_more_choices_than_the_queue_holds_are_refused_whole_with_the_openai_client(busy_server):
    """While one request runs: an n=3 request can never fit a waiting queue of 1, so it is a 400
    that says so, at once and whole: no choice is queued (nothing waits, nothing to withdraw),
    and the server goes on (the running request finishes, the next one runs)."""
    c = busy_server.client()
    long = {"prompt": STORY, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with busy_server.http() as http, http.stream("POST", "/v1/completions", json=long) as running:
        assert running.status_code == 200
        events = sse_events(running)
        next(events)
        wait_until_running(busy_server)
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(model=busy_server.model_name, prompt="Hello", max_tokens=4, n=3, seed=1, temperature=0.5)
        assert e.value.status_code == 400
        assert "--max-waiting" in str(e.value), str(e.value)
        m = busy_server.metrics()
        assert m["specula:num_requests_running"] == 1 and m["specula:num_requests_waiting"] == 0
    assert_pool_whole(busy_server)
    r = c.completions.create(model=busy_server.model_name, prompt="Hello", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3


# ---------------------------------------------------------------------------------------------
# Disconnects free KV blocks
# ---------------------------------------------------------------------------------------------


def test_disconnect_mid_stream_frees_blocks(server):
    body = {"prompt": STORY, "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}
    before = assert_pool_whole(server)
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = sse_events(r)
        chunks = [json.loads(next(events)) for _ in range(3)]
        assert all(ch["choices"][0]["finish_reason"] is None for ch in chunks)
        wait_until_running(server)
    # 2000 tokens take far longer than this: only an abort can empty the engine in time.
    t0 = time.monotonic()
    assert_pool_whole(server, timeout=10)
    assert time.monotonic() - t0 < 10
    assert_aborted_early(server, before, asked=2000)


def test_openai_stream_close_frees_blocks(server):
    c = server.client()
    before = assert_pool_whole(server)
    stream = c.chat.completions.create(model=server.model_name, messages=[{"role": "user", "content": "Tell a long story."}],
                                       max_tokens=2000, temperature=0.7, seed=5, stream=True,
                                       extra_body={"ignore_eos": True})
    got = 0
    for chunk in stream:
        got += 1
        if got == 4:
            break
    wait_until_running(server)
    stream.close()
    assert_pool_whole(server, timeout=10)
    assert_aborted_early(server, before, asked=2000)


def test_disconnect_during_non_streaming_request_frees_blocks(server):
    body = {"prompt": STORY, "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    before = assert_pool_whole(server)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url("/v1/completions"), json=body, timeout=httpx.Timeout(1.0, connect=5.0))
    assert_pool_whole(server, timeout=10)
    assert_aborted_early(server, before, asked=2000)


# ---------------------------------------------------------------------------------------------
# The mix: finished, stopped, aborted and failed requests all give their blocks back
# ---------------------------------------------------------------------------------------------


def test_mixed_outcomes_leave_the_pool_whole_and_metrics_exposed(server):
    c = server.client()
    before = server.metrics()
    expected_gen = 0
    expected_prompt = 0

    def work(kind: int):
        nonlocal expected_gen, expected_prompt
        if kind == 0:  # finished by length
            r = c.completions.create(model=server.model_name, prompt=STORY, max_tokens=10, temperature=0.8, seed=kind)
            assert r.choices[0].finish_reason == "length"
            return r.usage
        if kind == 1:  # stopped by a stop string
            r = c.chat.completions.create(model=server.model_name, messages=[{"role": "user", "content": "Say hello."}],
                                          max_tokens=40, temperature=0, stop=[" ", "!", ".", "\n"])
            assert r.choices[0].finish_reason == "stop"
            return r.usage
        if kind == 2:  # aborted mid-stream
            with server.http() as http, http.stream("POST", "/v1/completions", json={
                    "prompt": STORY, "max_tokens": 1000, "ignore_eos": True, "stream": True}) as resp:
                events = sse_events(resp)
                next(events)
                next(events)
            return None
        if kind == 3:  # failed validation (never reaches the engine)
            with pytest.raises(openai.BadRequestError):
                c.completions.create(model=server.model_name, prompt=STORY, max_tokens=10, top_p=2.0)
            return None
        if kind == 4:  # n=2, streamed to the end with usage
            chunks = list(c.completions.create(model=server.model_name, prompt=STORY, max_tokens=6, n=2, seed=9,
                                               temperature=1.0, stream=True, stream_options={"include_usage": True}))
            return chunks[-1].usage
        raise AssertionError(kind)

    with ThreadPoolExecutor(max_workers=10) as pool:
        usages = list(pool.map(work, [0, 1, 2, 3, 4, 0, 1, 2, 4, 2]))
    m = assert_pool_whole(server)
    for u in usages:
        if u is not None:
            expected_gen += u.completion_tokens
            expected_prompt += u.prompt_tokens
    # Completed requests are counted; aborted ones may add their partial tokens on top.
    assert m["specula:generation_tokens_total"] - before.get("specula:generation_tokens_total", 0) >= expected_gen
    assert m["specula:prompt_tokens_total"] - before.get("specula:prompt_tokens_total", 0) >= expected_prompt - 1e-9
    assert m["specula:e2e_request_latency_seconds_count"] > before.get("specula:e2e_request_latency_seconds_count", 0)
    assert m["specula:time_to_first_token_seconds_count"] > before.get("specula:time_to_first_token_seconds_count", 0)

    text = server.metrics_text()
    names = metric_names(text)
    missing = [n for n in REQUIRED_METRICS if n not in names]
    assert not missing, f"/metrics lacks {missing}; it has {sorted(names)}"
    types = {line.split()[2]: line.split()[3] for line in text.splitlines() if line.startswith("# TYPE ")}
    assert types["specula:time_to_first_token_seconds"] == "histogram"
    assert types["specula:e2e_request_latency_seconds"] == "histogram"
    assert types["specula:prompt_tokens_total"] == "counter"
    assert types["specula:num_preemptions_total"] == "counter"
    assert types["specula:kv_cache_usage_perc"] == "gauge"
    # the server still serves
    r = c.completions.create(model=server.model_name, prompt="Hi", max_tokens=2)
    assert r.usage.completion_tokens == 2


def test_metrics_are_listed_from_the_start():
    """A fresh server lists the engine's gauges and counters before any request."""
    from server_fixture import running_server

    with running_server() as fresh:
        names = metric_names(fresh.metrics_text())
        m = fresh.metrics()
    for n in ["specula:num_requests_running", "specula:num_requests_waiting", "specula:kv_cache_usage_perc",
              "specula:num_preemptions_total"]:
        assert n in names, f"{n} missing from a fresh server's /metrics: {sorted(names)}"
    assert m["specula:kv_cache_usage_perc"] == 0 and m["specula:num_preemptions_total"] == 0


# ---------------------------------------------------------------------------------------------
# Preemption under a tiny KV cache
# ---------------------------------------------------------------------------------------------


def test_preemption_keeps_greedy_outputs_and_frees_blocks(tiny_kv_server):
    """128 KV tokens (8 blocks) for four 60-token sequences: the scheduler has to preempt and
    recompute, and the greedy texts must still equal those of each request run alone."""
    c = tiny_kv_server.client()
    prompts = [f"Story {i}: {STORY}" for i in range(4)]
    kw = dict(model=tiny_kv_server.model_name, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    alone = [c.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    before = tiny_kv_server.metrics().get("specula:num_preemptions_total", 0)
    barrier = threading.Barrier(len(prompts))

    def run(p):
        barrier.wait()
        return c.completions.create(prompt=p, **kw)

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        together = list(pool.map(run, prompts))
    assert [r.choices[0].text for r in together] == alone
    assert all(r.usage.completion_tokens == 40 for r in together)
    m = assert_pool_whole(tiny_kv_server)
    assert m["specula:num_preemptions_total"] > before, "four 60-token sequences in 128 KV tokens must preempt"


def test_chat_without_max_tokens_ends_at_the_context_left(tiny_kv_server):
    """No max_tokens on a chat request means all the context left (vLLM's behaviour): with EOS
    ignored the answer runs exactly to --max-model-len and ends with finish_reason "length"."""
    c = tiny_kv_server.client()
    r = c.chat.completions.create(model=tiny_kv_server.model_name, messages=[{"role": "user", "content": "Count to a thousand."}],
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 128, r.usage
    assert_pool_whole(tiny_kv_server)
