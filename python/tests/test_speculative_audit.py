"""The live exactness audit (`--speculative-audit 1`): every finished greedy or seeded request is
replayed without speculation while the server is idle, and /metrics counts the replays that were
identical and those that diverged. With honest speculation every replay is identical (tokens and
logprobs); with `--speculative-force-accept` (every draft accepted: the output changes) the audit
finds the divergence and logs where."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from server_fixture import server_fixture

SPEC = ("--kv-cache-tokens", "4096", "--max-model-len", "2048", "--speculative-method", "ngram", "--num-speculative-tokens", "3", "--no-speculative-adaptive")
audited = server_fixture(*SPEC, "--speculative-audit", "1")
forced = server_fixture(*SPEC, "--speculative-audit", "1", "--speculative-force-accept")

CODE = "def add(a, b):\n    return a + b\n\n\ndef add3(a, b, c):\n    return a + b + c\n\n\ndef add4(a, b, c, d):\n"
REPEAT = "one two three four five, one two three four five, one two three four five, one two"
PROMPTS = [CODE, REPEAT, "The capital of France is"]
AUDIT = "specula:spec_audit_requests_total"
PENDING = "specula:spec_audit_pending"


def audits(srv) -> dict[str, float]:
    m = srv.metrics()
    return {r: m.get(f'{AUDIT}{{result="{r}"}}', 0.0) for r in ("identical", "diverged", "skipped")}


def wait_audited(srv, n: int, timeout: float = 90.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        a = audits(srv)
        if sum(a.values()) >= n:
            return a
        time.sleep(0.1)
    raise AssertionError(f"{n} audits expected within {timeout:.0f}s, have {audits(srv)}")


def complete(srv, prompt, **kw):
    with srv.http() as h:
        r = h.post("/v1/completions", json={"prompt": prompt, "max_tokens": 40, "ignore_eos": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_audit_finds_honest_speculation_identical(audited):
    before = audits(audited)
    assert before == {"identical": 0, "diverged": 0, "skipped": 0}, "the audit counters are listed from the start"
    assert audited.metrics().get(PENDING) == 0, "the pending gauge is listed from the start"
    # greedy, greedy with logprobs, seeded sampling; then four at once (replays wait for idle)
    for p in PROMPTS:
        complete(audited, p, temperature=0)
    complete(audited, CODE, temperature=0, logprobs=3)
    complete(audited, REPEAT, temperature=0.9, seed=7, logprobs=2)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: complete(audited, p, temperature=0), PROMPTS + [CODE]))
    # an unseeded sampled request has no one right output: never audited
    complete(audited, REPEAT, temperature=0.9)
    n = len(PROMPTS) + 2 + len(PROMPTS) + 1
    got = wait_audited(audited, n)
    time.sleep(1.0)
    got = audits(audited)
    assert got == {"identical": n, "diverged": 0, "skipped": 0}, got
    assert audited.metrics().get(PENDING) == 0, "every audited choice judged: nothing pending"
    # the server serves on after its replays, and they left the KV pool whole
    m = audited.wait_idle()
    assert m.get("specula:kv_cache_usage_perc") == 0, m


def test_the_audit_finds_a_forced_divergence_and_says_where(forced):
    for p in PROMPTS:
        complete(forced, p, temperature=0)
    got = wait_audited(forced, len(PROMPTS))
    # force-accept takes wrong n-gram drafts, so some output is not what plain decoding gives
    assert got["diverged"] >= 1, got
    assert got["identical"] + got["diverged"] == len(PROMPTS), got
    log = forced.log_tail(20000)
    assert "DIVERGED" in log and "position=" in log and "served=" in log and "replayed=" in log, log[-2000:]
