"""--async-scheduling through the real server with the official openai client: the same greedy and
seeded outputs (and logprobs) as synchronous scheduling, with and without n-gram speculation,
under concurrent streams; the per-phase step histograms and gap histograms appear at /metrics."""

from __future__ import annotations

import concurrent.futures as cf
import subprocess

import pytest

from server_fixture import require_binary_and_model, server_fixture

KV = ("--kv-cache-tokens", "4096", "--max-model-len", "1024")
sync_plain = server_fixture(*KV)
async_plain = server_fixture(*KV, "--async-scheduling")
sync_ngram = server_fixture(*KV, "--speculative-method", "ngram", "--no-speculative-adaptive")
async_ngram = server_fixture(*KV, "--async-scheduling", "--speculative-method", "ngram", "--no-speculative-adaptive")

PROMPTS = [
    "one two three four five, one two three four five, one two",
    "The capital of France is",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return",
    "List three colours:",
    "Écris une phrase sur la mer.",
    "1, 2, 3, 4, 5, 6,",
]


def run_all(srv, seeded: bool):
    """All prompts at once (streams), so they share batches; returns text and logprobs per prompt."""
    c = srv.client()

    def one(i_p):
        i, p = i_p
        kw = dict(temperature=0.8, seed=100 + i, top_p=0.95) if seeded else dict(temperature=0)
        stream = c.completions.create(model=srv.model_name, prompt=p, max_tokens=24 + 4 * i, stream=True, logprobs=2,
                                      extra_body={"ignore_eos": True}, **kw)
        text, lps = "", []
        for chunk in stream:
            ch = chunk.choices[0]
            text += ch.text
            if ch.logprobs and ch.logprobs.token_logprobs:
                lps += ch.logprobs.token_logprobs
        return text, lps

    with cf.ThreadPoolExecutor(len(PROMPTS)) as ex:
        return list(ex.map(one, enumerate(PROMPTS)))


@pytest.mark.parametrize("pair", [("sync_plain", "async_plain"), ("sync_ngram", "async_ngram")])
@pytest.mark.parametrize("seeded", [False, True])
def test_async_outputs_equal_sync(pair, seeded, request):
    sync, asyn = (request.getfixturevalue(n) for n in pair)
    a, b = run_all(sync, seeded), run_all(asyn, seeded)
    for (ta, la), (tb, lb), p in zip(a, b, PROMPTS):
        assert ta == tb, f"{pair} seeded={seeded}: text differs for {p!r}"
        assert len(la) == len(lb) and all(abs(x - y) < 1e-5 for x, y in zip(la, lb)), f"logprobs differ for {p!r}"


def test_step_timing_histograms_at_metrics(async_ngram):
    run_all(async_ngram, seeded=False)
    m = async_ngram.wait_idle()
    assert m.get("specula:kv_cache_usage_perc") == 0
    for phase in ["schedule", "prepare", "forward", "sample", "propose", "update"]:
        assert m.get(f'specula:step_phase_seconds_count{{phase="{phase}"}}', 0) > 0, phase
        assert f'specula:step_phase_seconds_bucket{{phase="{phase}",le="0.001"}}' in m, phase
    # every forward pass but the first after each idle period has a gap
    forwards = m['specula:step_phase_seconds_count{phase="forward"}']
    for name in ["specula:forward_gap_seconds_count", "specula:compute_idle_gap_seconds_count"]:
        assert 0 < m.get(name, 0) < forwards, name


def test_async_with_lockstep_data_parallelism_is_refused_with_the_reason():
    """Lockstep ranks agree on each step before it is scheduled: the combination is refused at
    start-up with a one-line reason and the flag to change, not silently run synchronously."""
    binary, model = require_binary_and_model()
    r = subprocess.run([str(binary), "serve", "--model", str(model), "--port", "0", "--async-scheduling",
                        "--data-parallel-size", "2", "--data-parallel-mode", "lockstep"],
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode != 0
    assert "--async-scheduling does not work with --data-parallel-mode lockstep" in r.stderr, r.stderr
    assert "panicked" not in r.stderr, r.stderr
