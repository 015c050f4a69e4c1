"""Prompt logprobs through the real server with the official openai client: the loglikelihood
requests lm-evaluation-harness sends (token-id prompts, `echo: true`, `logprobs: 1`,
`max_tokens: 0` or 1) and vLLM's `prompt_logprobs`.

Oracles and tolerances:
- the engine's own logits (`specula debug logits`): the server's prompt logprobs are the
  log-softmax of those rows, so they agree to float32 rounding (1e-4; the engine reduces in f64 then
  rounds to f32, the oracle computes in f64);
- the NumPy reference forward (python/reference_forward.py): the engine's logits differ from it by
  8-bit activation rounding, max|d| <= 3.5 and mean|d| <= 0.35 per logit (test_logits_oracle.py
  measures and justifies those bounds). A logprob is a logit minus the log-sum-exp, which moves by
  at most the largest logit change, so each prompt logprob is within 2 * 3.5 and their mean within
  2 * 0.35 of the reference's;
- a second server with n-gram speculation and async scheduling: identical numbers (the engine is
  batch-invariant and logprobs come from the raw distribution).
"""

from __future__ import annotations

import numpy as np
import pytest

from server_fixture import debug_logits, log_softmax, model_path, server_fixture, tokenize

plain = server_fixture()
spec_async = server_fixture("--speculative-method", "ngram", "--async-scheduling")

TEXTS = ["The capital of France is Paris, and the capital of Italy is Rome.", "def add(a, b):\n    return a + b\n"]
MAX_ABS = 3.5
MEAN_ABS = 0.35


@pytest.fixture(scope="module")
def prompts():
    ids = tokenize(TEXTS)
    assert all(len(p) > 5 for p in ids), ids
    return ids


def loglikelihood_request(server, prompts, max_tokens=0, **kw):
    client = server.client()
    return client.completions.create(model=server.model_name, prompt=prompts, echo=True, logprobs=1, max_tokens=max_tokens,
                                     temperature=0, **kw)


def expected(prompt, logits):
    """Log-softmax of each row's logits at the next prompt token (None for the first token)."""
    lp = log_softmax(logits)
    return [lp[i - 1, prompt[i]] for i in range(1, len(prompt))]


def test_echo_logprobs_are_the_log_softmax_of_the_engines_logits(plain, prompts):
    r = loglikelihood_request(plain, prompts)
    engine = debug_logits(prompts)
    assert len(r.choices) == len(prompts)
    for c, p, lg in zip(sorted(r.choices, key=lambda c: c.index), prompts, engine):
        assert c.finish_reason == "length"
        lp = c.logprobs
        assert len(lp.tokens) == len(p), "max_tokens 0: the prompt's tokens only"
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        got = np.array(lp.token_logprobs[1:], dtype=np.float64)
        want = np.array(expected(p, lg))
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        assert "".join(lp.tokens) == c.text
        # the best entry is the row's argmax (the top-1 alternative beside the prompt token)
        rows = log_softmax(lg)
        for i in range(1, len(p)):
            assert abs(max(lp.top_logprobs[i].values()) - float(rows[i - 1].max())) <= 1e-4
    assert r.usage.completion_tokens == 0


def test_echo_logprobs_are_near_the_numpy_reference(plain, prompts):
    import reference_forward as rf

    r = loglikelihood_request(plain, prompts[:1])
    p = prompts[0]
    ref = rf.forward(str(model_path()), list(p))
    got = np.array(r.choices[0].logprobs.token_logprobs[1:], dtype=np.float64)
    want = np.array(expected(p, ref))
    d = np.abs(got - want)
    assert d.max() <= 2 * MAX_ABS and d.mean() <= 2 * MEAN_ABS, (d.max(), d.mean())
    # a check that can fail: shifting the targets by one position is far outside the bounds
    wrong = np.array([log_softmax(ref)[i - 1, p[i - 1]] for i in range(1, len(p))])
    assert np.abs(got - wrong).mean() > 2 * MEAN_ABS


def test_max_tokens_1_appends_the_generated_token(plain, prompts):
    r = loglikelihood_request(plain, prompts[:1], max_tokens=1)
    c = r.choices[0]
    assert len(c.logprobs.tokens) == len(prompts[0]) + 1
    assert c.logprobs.token_logprobs[-1] is not None
    assert r.usage.completion_tokens == 1


def test_identical_with_ngram_speculation_and_async_scheduling(plain, spec_async, prompts):
    a = loglikelihood_request(plain, prompts, max_tokens=1)
    b = loglikelihood_request(spec_async, prompts, max_tokens=1)
    for x, y in zip(sorted(a.choices, key=lambda c: c.index), sorted(b.choices, key=lambda c: c.index)):
        assert x.logprobs.token_logprobs == y.logprobs.token_logprobs
        assert x.logprobs.top_logprobs == y.logprobs.top_logprobs
        assert x.text == y.text


def test_vllm_prompt_logprobs_field(plain, prompts):
    p = prompts[0]
    r = plain.client().completions.create(model=plain.model_name, prompt=p, max_tokens=1, temperature=0,
                                           extra_body={"prompt_logprobs": 3})
    plp = r.model_extra.get("prompt_logprobs") if r.model_extra else None
    plp = plp or r.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(p)
    lg = debug_logits([p])[0]
    want = expected(p, lg)
    for i in range(1, len(p)):
        e = plp[i][str(p[i])]
        assert abs(e["logprob"] - want[i - 1]) <= 1e-4
        assert e["rank"] >= 1
        assert len(plp[i]) <= 4


def test_bad_values_are_400(plain):
    import openai

    client = plain.client()
    for extra in [{"prompt_logprobs": -1}, {"prompt_logprobs": 10_000}]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=plain.model_name, prompt=[1, 2, 3], max_tokens=1, extra_body=extra)
        assert "prompt_logprobs" in str(e.value.body), e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=plain.model_name, prompt=[1, 2, 3], max_tokens=0)
    assert "max_tokens" in str(e.value.body), e.value.body
