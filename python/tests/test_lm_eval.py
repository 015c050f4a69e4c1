"""lm-evaluation-harness (`pip install "lm-eval[api]==0.4.13"`, in python/requirements.txt; skipped without it
locally, a failure under CI) against the real
server: a tiny multiple-choice task of our own (lm_eval_tasks/) run through `local-completions`
with the server's remote tokenizer (/tokenize, /detokenize, /tokenizer_info). lm-eval scores each
choice with an echo + logprobs request; the loglikelihood it reports must be the sum, over the
choice's tokens, of the log-softmax of the engine's own logits (`specula debug logits`) at those
positions (1e-3: a sum of float32 logprobs).
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


def encode(server, text: str) -> list[int]:
    import requests  # lm-eval[api] brings it

    r = requests.post(server.base_url + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=60)
    r.raise_for_status()
    return r.json()["tokens"]


def test_multiple_choice_loglikelihoods_equal_the_engines_logprobs(server, monkeypatch):
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(TASKS)  # the task's data_files path is relative to it
    os.environ.setdefault("OPENAI_API_KEY", "unused")
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model={server.model_name},base_url={server.base_url}/v1/completions,tokenizer_backend=remote,num_concurrent=1,max_retries=1",
        tasks=["specula_tiny_mc"],
        task_manager=TaskManager(include_path=str(TASKS)),
        batch_size=4,
        log_samples=True,
    )
    samples = out["samples"]["specula_tiny_mc"]
    assert len(samples) == 4
    checked = 0
    for s in samples:
        for (context, continuation), resp in zip(s["arguments"], s["resps"]):
            ll = resp[0][0]
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
