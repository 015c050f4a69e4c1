"""Prompt logprobs through the real server with the official openai client: the loglikelihood
requests lm-evaluation-harness sends (token-id prompts, `echo: true`, `logprobs: 1`,
`max_tokens: 0` or 1), vLLM's `prompt_logprobs` (completions and chat), and all of them streamed.

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
- chat's prompt logprobs against completions' for the token ids /tokenize gives for the same
  messages, and a stream's pieces against the whole response: identical (the same prompt through
  the same engine at temperature 0).
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


def test_chat_prompt_logprobs_equal_the_completions_ones_for_the_rendered_prompt(plain):
    """Chat's top-level `prompt_logprobs` are those of the conversation as rendered: the same as
    completions' for the token ids /tokenize gives for the same messages (bit for bit: the same
    prompt through the same engine)."""
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime number."}]
    ids = plain.http().post("/tokenize", json={"messages": messages}).json()["tokens"]
    client = plain.client()
    chat = client.chat.completions.create(model=plain.model_name, messages=messages, max_tokens=1, temperature=0,
                                          extra_body={"prompt_logprobs": 2})
    assert chat.usage.prompt_tokens == len(ids)
    got = chat.model_extra["prompt_logprobs"]
    cmpl = client.completions.create(model=plain.model_name, prompt=ids, max_tokens=1, temperature=0,
                                     extra_body={"prompt_logprobs": 2})
    want = cmpl.choices[0].model_extra["prompt_logprobs"]
    assert got == want
    assert got[0] is None and len(got) == len(ids)
    assert all(str(ids[i]) in got[i] and len(got[i]) <= 3 for i in range(1, len(ids)))
    # and they are the engine's: the log-softmax of its logits at the next prompt token
    want_lp = expected(ids, debug_logits([ids])[0])
    for i in range(1, len(ids)):
        assert abs(got[i][str(ids[i])]["logprob"] - want_lp[i - 1]) <= 1e-4


def streamed_pieces(stream):
    """Per choice index: text, the legacy logprob lists and vLLM's prompt_logprobs, concatenated
    over the chunks; the finish reason; and the usage chunk's usage."""
    out, usage = {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            o = out.setdefault(c.index, {"text": "", "logprobs": None, "prompt_logprobs": None, "finish_reason": None})
            assert o["finish_reason"] is None, "nothing after the finish reason"
            o["text"] += c.text
            if c.logprobs is not None:
                lp = o["logprobs"] = o["logprobs"] or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                for key in lp:
                    lp[key] += getattr(c.logprobs, key)
            plp = (c.model_extra or {}).get("prompt_logprobs")
            if plp is not None:
                assert o["prompt_logprobs"] is None, "prompt_logprobs sent twice"
                o["prompt_logprobs"] = plp
            o["finish_reason"] = c.finish_reason or o["finish_reason"]
    return out, usage


@pytest.mark.parametrize("kw", [
    dict(echo=True, logprobs=1, max_tokens=0),
    dict(echo=True, logprobs=2, max_tokens=4),
    dict(echo=True, max_tokens=0),
    dict(echo=True, logprobs=0, max_tokens=3, extra_body={"prompt_logprobs": 2}),
    dict(logprobs=1, max_tokens=3, extra_body={"prompt_logprobs": 1}),
], ids=["echo-logprobs-max0", "echo-logprobs-gen", "echo-max0", "echo-prompt-logprobs", "prompt-logprobs"])
def test_streamed_echo_and_prompt_logprobs_concatenate_to_the_whole_response(plain, prompts, kw):
    """stream=True with echo + logprobs, prompt_logprobs and max_tokens 0 (the official client):
    each choice opens with the echoed prompt and its logprobs (null first), then the generated
    deltas; put together they are the non-streamed response, to the bit (temperature 0)."""
    client = plain.client()
    whole = client.completions.create(model=plain.model_name, prompt=prompts, temperature=0, **kw)
    stream = client.completions.create(model=plain.model_name, prompt=prompts, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, **kw)
    pieces, usage = streamed_pieces(stream)
    assert sorted(pieces) == [c.index for c in sorted(whole.choices, key=lambda c: c.index)]
    for c in whole.choices:
        got = pieces[c.index]
        assert got["text"] == c.text
        assert got["finish_reason"] == c.finish_reason
        if c.logprobs is None:
            assert got["logprobs"] is None
        else:
            for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"]:
                assert got["logprobs"][key] == getattr(c.logprobs, key), key
            if kw.get("echo"):
                assert got["logprobs"]["token_logprobs"][0] is None
        assert got["prompt_logprobs"] == (c.model_extra or {}).get("prompt_logprobs")
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens
    if kw.get("max_tokens") == 0:
        assert usage.completion_tokens == 0
        assert all(pieces[c.index]["text"] == c.text for c in whole.choices)


def test_bad_values_are_400(plain):
    import openai

    client = plain.client()
    for extra in [{"prompt_logprobs": -1}, {"prompt_logprobs": 10_000}]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=plain.model_name, prompt=[1, 2, 3], max_tokens=1, extra_body=extra)
        assert "prompt_logprobs" in str(e.value.body), e.value.body
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=plain.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                           extra_body=extra)
        assert "prompt_logprobs" in str(e.value.body), e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=plain.model_name, prompt=[1, 2, 3], max_tokens=0)
    assert "max_tokens" in str(e.value.body), e.value.body
