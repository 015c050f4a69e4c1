"""lm-evaluation-harness (`pip install "lm-eval[api]==0.4.13"`, in python/requirements.txt; skipped without it
locally, a failure under CI) against the real server: tiny tasks of our own (lm_eval_tasks/) run
through `local-completions` with the server's remote tokenizer (/tokenize, /detokenize,
/tokenizer_info).

- specula_tiny_mc (multiple choice): lm-eval scores each choice with an echo + logprobs request;
  the loglikelihood it reports must be the sum, over the choice's tokens, of the log-softmax of the
  engine's own logits (`specula debug logits`) at those positions (1e-3: a sum of float32
  logprobs). A second server with `--speculative-method ngram --async-scheduling` must report the
  same numbers bit for bit (the engine is batch-invariant; logprobs come from the raw distribution).
- specula_tiny_gen (generate_until, `until` stop strings, exact_match): each generation lm-eval
  records must be the text the server returns for the same token ids, stop strings and
  temperature 0 asked directly, and the metric must be computed.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from server_fixture import debug_logits, log_softmax, server_fixture

try:
    import lm_eval
except ImportError:  # scripts/test.sh installs it (python/requirements.txt); a missing one fails CI
    if os.environ.get("CI"):
        raise
    lm_eval = pytest.importorskip("lm_eval")

TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"
server = server_fixture()
spec_async = server_fixture("--speculative-method", "ngram", "--async-scheduling")


def encode(server, text: str) -> list[int]:
    import requests  # lm-eval[api] brings it

    r = requests.post(server.base_url + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=60)
    r.raise_for_status()
    return r.json()["tokens"]


def run_lm_eval(server, task: str, monkeypatch) -> dict:
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(TASKS)  # the tasks' data_files paths are relative to it
    monkeypatch.setenv("OPENAI_API_KEY", os.environ.get("OPENAI_API_KEY", "unused"))
    return lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model={server.model_name},base_url={server.base_url}/v1/completions,tokenizer_backend=remote,num_concurrent=1,max_retries=1",
        tasks=[task],
        task_manager=TaskManager(include_path=str(TASKS)),
        batch_size=4,
        log_samples=True,
    )


@pytest.fixture(scope="module")
def plain_mc(server):
    with pytest.MonkeyPatch.context() as mp:
        return run_lm_eval(server, "specula_tiny_mc", mp)


def per_choice_loglikelihoods(out) -> list[tuple[str, str, float, bool]]:
    samples = sorted(out["samples"]["specula_tiny_mc"], key=lambda s: s["doc_id"])
    return [(ctx, cont, resp[0][0], resp[0][1]) for s in samples for (ctx, cont), resp in zip(s["arguments"], s["resps"])]


def test_multiple_choice_loglikelihoods_equal_the_engines_logprobs(server, plain_mc):
    out = plain_mc
    samples = out["samples"]["specula_tiny_mc"]
    assert len(samples) == 4
    checked = 0
    for context, continuation, ll, _greedy in per_choice_loglikelihoods(out):
        # lm-eval's split (TemplateLM._encode_pair): the whole text encoded, the context's tokens cut off
        ids, ctx = encode(server, context + continuation), encode(server, context)
        cont = ids[len(ctx) :]
        assert ids[: len(ctx)] == ctx and cont
        lp = log_softmax(debug_logits([ids])[0])
        want = sum(lp[len(ctx) + j - 1, t] for j, t in enumerate(cont))
        assert abs(ll - want) <= 1e-3, (context, continuation, ll, want)
        checked += 1
    assert checked == 12
    acc = out["results"]["specula_tiny_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0


def test_multiple_choice_is_identical_with_ngram_speculation_and_async_scheduling(plain_mc, spec_async, monkeypatch):
    out = run_lm_eval(spec_async, "specula_tiny_mc", monkeypatch)
    got, want = per_choice_loglikelihoods(out), per_choice_loglikelihoods(plain_mc)
    assert len(got) == 12
    assert got == want  # loglikelihoods (floats) and is-greedy flags, bit for bit
    assert out["results"]["specula_tiny_mc"]["acc,none"] == plain_mc["results"]["specula_tiny_mc"]["acc,none"]


def test_generate_until_generations_are_the_servers_own(server, monkeypatch):
    import requests

    out = run_lm_eval(server, "specula_tiny_gen", monkeypatch)
    samples = sorted(out["samples"]["specula_tiny_gen"], key=lambda s: s["doc_id"])
    assert len(samples) == 4
    eos = requests.get(server.base_url + "/tokenizer_info", timeout=60).json().get("eos_token")
    reasons = []
    for s in samples:
        (context, gen_kwargs), = s["arguments"]
        generation = s["resps"][0][0]
        stop = list(gen_kwargs["until"]) + ([eos] if eos and eos not in gen_kwargs["until"] else [])
        # what lm-eval sends: the context's token ids (remote tokenizer, no special tokens), greedy
        r = requests.post(server.base_url + "/v1/completions", timeout=120, json={
            "model": server.model_name, "prompt": encode(server, context), "max_tokens": gen_kwargs["max_gen_toks"],
            "temperature": 0, "stop": stop, "seed": 1234})
        r.raise_for_status()
        direct = r.json()["choices"][0]["text"]
        reasons.append(r.json()["choices"][0]["finish_reason"])
        assert generation == direct, (context, generation, direct)
        assert generation.strip() and "\n" not in generation  # an answer, cut at the `until` stop string
        want = "".join(s["target"].split()) == "".join(generation.split())
        assert s["exact_match"] == float(want), (s["target"], generation)
    assert "stop" in reasons, reasons  # a stop (the `until` string or EOS) ended a generation, not the 6-token cap
    em = out["results"]["specula_tiny_gen"]["exact_match,none"]
    assert em == sum(s["exact_match"] for s in samples) / len(samples)
