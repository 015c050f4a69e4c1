"""The OpenAI API of the real `specula serve`, driven by the official `openai` client: response
shapes, finish reasons, usage against the tokenizer oracle and the chat template, streaming equal to
non-streaming, logprobs equal to the engine's own log-softmax, n > 1 and concurrency."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from server_fixture import chat_prompt, debug_logits, gguf_reader, log_softmax, server_fixture, sse_events, tokenize

server = server_fixture()

PROMPT = "The capital of France is"
STORY = "Once upon a time, in a small village at the edge of a great forest, there lived"
MESSAGES = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def client(server):
    return server.client()


# ---------------------------------------------------------------------------------------------
# Non-streaming
# ---------------------------------------------------------------------------------------------


def test_models_lists_the_served_model(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model_name]
    assert client.models.retrieve(server.model_name).id == server.model_name


def test_completion_shape_length_and_usage(server, client):
    r = client.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=6, temperature=0)
    assert r.object == "text_completion"
    assert r.id.startswith("cmpl-")
    assert r.model == server.model_name
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0 and isinstance(c.text, str) and c.text
    assert c.finish_reason == "length"
    assert c.logprobs is None
    (ids,) = tokenize([PROMPT])
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_completion_token_id_prompt_matches_text_prompt(server, client):
    (ids,) = tokenize([PROMPT])
    a = client.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=6, temperature=0)
    b = client.completions.create(model=server.model_name, prompt=ids, max_tokens=6, temperature=0)
    assert a.choices[0].text == b.choices[0].text
    assert b.usage.prompt_tokens == len(ids)


def _stop_from(text: str) -> tuple[str, str]:
    """A stop string taken from the middle of `text`, and the text expected before it."""
    words = text.split()
    assert len(words) >= 3, f"need a longer greedy continuation to pick a stop string from: {text!r}"
    stop = words[1]
    return stop, text[: text.index(stop)]


def test_completion_stop_string(server, client):
    full = client.completions.create(model=server.model_name, prompt=STORY, max_tokens=16, temperature=0)
    stop, expected = _stop_from(full.choices[0].text)
    r = client.completions.create(model=server.model_name, prompt=STORY, max_tokens=16, temperature=0, stop=[stop, "@@@"])
    c = r.choices[0]
    assert c.finish_reason == "stop"
    assert stop not in c.text
    assert c.text == expected
    assert r.usage.completion_tokens < 16


def test_chat_shape_length_and_prompt_is_the_template(server, client):
    r = client.chat.completions.create(model=server.model_name, messages=MESSAGES, max_tokens=4, temperature=0)
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    assert r.model == server.model_name
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0
    assert c.message.role == "assistant"
    assert isinstance(c.message.content, str) and c.message.content
    assert c.finish_reason == "length"
    assert r.usage.completion_tokens == 4
    rendered = chat_prompt(MESSAGES)
    assert "Name three colors." in rendered and rendered.endswith("assistant\n")
    (templated, content) = tokenize([rendered, MESSAGES[0]["content"]])
    assert r.usage.prompt_tokens == len(templated)
    assert r.usage.prompt_tokens > len(content)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_system_and_multi_turn_prompt_tokens(server, client):
    messages = [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "What color is the sky?"},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And grass?"},
    ]
    r = client.chat.completions.create(model=server.model_name, messages=messages, max_tokens=2, temperature=0)
    (templated,) = tokenize([chat_prompt(messages)])
    assert r.usage.prompt_tokens == len(templated)


def test_chat_stop_string(server, client):
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    full = client.chat.completions.create(model=server.model_name, messages=messages, max_tokens=16, temperature=0)
    stop, expected = _stop_from(full.choices[0].message.content)
    r = client.chat.completions.create(model=server.model_name, messages=messages, max_tokens=16, temperature=0, stop=stop)
    c = r.choices[0]
    assert c.finish_reason == "stop"
    assert stop not in c.message.content
    assert c.message.content == expected


# ---------------------------------------------------------------------------------------------
# Streaming
# ---------------------------------------------------------------------------------------------

SAMPLINGS = [pytest.param(dict(temperature=0), id="greedy"), pytest.param(dict(temperature=0.8, seed=1234), id="seeded")]


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_completion_stream_equals_non_stream(server, client, sampling):
    kw = dict(model=server.model_name, prompt=STORY, max_tokens=16, **sampling)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == whole.choices[0].text
    assert reasons == [whole.choices[0].finish_reason]
    assert all(c.id == chunks[0].id for c in chunks)


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_chat_stream_equals_non_stream(server, client, sampling):
    kw = dict(model=server.model_name, messages=MESSAGES, max_tokens=16, **sampling)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == whole.choices[0].message.content
    assert reasons == [whole.choices[0].finish_reason]


def test_stream_include_usage(server, client):
    kw = dict(model=server.model_name, prompt=PROMPT, max_tokens=5, temperature=0)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (
        whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens)
    assert all(c.usage is None for c in chunks[:-1])

    chat = list(client.chat.completions.create(model=server.model_name, messages=MESSAGES, max_tokens=3, temperature=0,
                                               stream=True, stream_options={"include_usage": True}))
    assert chat[-1].choices == [] and chat[-1].usage.completion_tokens == 3
    (templated,) = tokenize([chat_prompt(MESSAGES)])
    assert chat[-1].usage.prompt_tokens == len(templated)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "stream": True}),
])
def test_sse_framing_ends_with_done(server, path, body):
    with server.http() as http, http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r))
    assert events[-1] == "[DONE]"
    assert events.count("[DONE]") == 1
    payloads = [json.loads(e) for e in events[:-1]]
    assert payloads, "no chunks before [DONE]"
    assert all("error" not in p for p in payloads)
    finals = [ch["finish_reason"] for p in payloads for ch in p["choices"] if ch["finish_reason"]]
    assert finals == ["length"]


# ---------------------------------------------------------------------------------------------
# Logprobs: shape, and equal to the engine's own log-softmax (`specula debug logits`)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vocab_bytes(server):
    """id -> the token's bytes, from the GGUF vocabulary (GPT-2 byte-level alphabet undone)."""
    from tokenizer_oracle import byte_chars

    byte_of = {c: b for b, c in enumerate(byte_chars())}
    r = gguf_reader(str(server.model))
    f = r.fields["tokenizer.ggml.tokens"]
    types = r.fields["tokenizer.ggml.token_type"]
    out = []
    for k, i in enumerate(f.data):
        s = bytes(f.parts[i]).decode("utf-8")
        special = int(types.parts[types.data[k]][0]) in (3, 4)
        out.append(s.encode() if special or not all(ch in byte_of for ch in s) else bytes(byte_of[ch] for ch in s))
    return out


def _ids_from_texts(texts: list[str], vocab_bytes: list[bytes]) -> list[int]:
    index: dict[bytes, list[int]] = {}
    for i, b in enumerate(vocab_bytes):
        index.setdefault(b, []).append(i)
    ids = []
    for t in texts:
        cands = index.get(t.encode())
        assert cands, f"token text {t!r} is not a whole vocabulary entry"
        ids.append(cands[0])
    return ids


def _oracle_rows(prompt_ids: list[int], gen_ids: list[int]) -> np.ndarray:
    """log-softmax rows that predicted each generated token."""
    (logits,) = debug_logits([prompt_ids + gen_ids])
    p = len(prompt_ids)
    return log_softmax(logits[p - 1: p - 1 + len(gen_ids)])


def _check_top_list(values: list[float]):
    assert values == sorted(values, reverse=True), values
    assert all(v <= 0 for v in values), values
    assert sum(math.exp(v) for v in values) <= 1 + 1e-4


def _check_against_oracle(rows: np.ndarray, gen_ids: list[int], chosen: list[float], tops: list[list[float]], greedy: bool):
    for i, (row, tok) in enumerate(zip(rows, gen_ids)):
        if greedy:
            assert int(np.argmax(row)) == tok, f"position {i}: greedy token {tok} is not the oracle's argmax {int(np.argmax(row))}"
        assert chosen[i] == pytest.approx(row[tok], abs=1e-3), f"position {i}"
        want = np.sort(row)[::-1][: len(tops[i])]
        np.testing.assert_allclose(tops[i], want, atol=1e-3, err_msg=f"top logprobs at position {i}")


def test_completion_logprobs_greedy_match_the_engine(server, client, vocab_bytes):
    (prompt_ids,) = tokenize([PROMPT])
    r = client.completions.create(model=server.model_name, prompt=prompt_ids, max_tokens=8, temperature=0, logprobs=5)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    tops = []
    for i, top in enumerate(lp.top_logprobs):
        assert len(top) == 5, top
        values = list(top.values())  # most likely first, like OpenAI and vLLM
        _check_top_list(values)
        assert lp.token_logprobs[i] == values[0], "the greedy token must be the top-1"
        assert top[lp.tokens[i]] == lp.token_logprobs[i]
        tops.append(values)
    gen_ids = _ids_from_texts(lp.tokens, vocab_bytes)
    _check_against_oracle(_oracle_rows(prompt_ids, gen_ids), gen_ids, lp.token_logprobs, tops, greedy=True)


def test_completion_logprobs_are_raw_when_sampling(server, client, vocab_bytes):
    """Logprobs are those of the raw distribution, not the temperature-scaled one (as in vLLM)."""
    (prompt_ids,) = tokenize([STORY])
    # The completions format keys top_logprobs by token text, so two byte-fallback tokens (both
    # shown as U+FFFD) collide and cannot be identified: use the first seed whose sample has none.
    for seed in range(3, 13):
        r = client.completions.create(model=server.model_name, prompt=prompt_ids, max_tokens=10, temperature=1.5, seed=seed, logprobs=3)
        lp = r.choices[0].logprobs
        if not any("\ufffd" in t for top in lp.top_logprobs for t in top):
            break
    else:
        pytest.fail("every seed sampled a token that is not whole UTF-8")
    tops = []
    for i, top in enumerate(lp.top_logprobs):
        assert lp.tokens[i] in top and top[lp.tokens[i]] == lp.token_logprobs[i]
        assert len(top) in (3, 4)  # the sampled token is added when it is not among the top 3
        values = list(top.values())
        _check_top_list(values)
        tops.append(values[:3])
    gen_ids = _ids_from_texts(lp.tokens, vocab_bytes)
    _check_against_oracle(_oracle_rows(prompt_ids, gen_ids), gen_ids, lp.token_logprobs, tops, greedy=False)


def test_chat_logprobs_greedy_match_the_engine(server, client, vocab_bytes):
    r = client.chat.completions.create(model=server.model_name, messages=MESSAGES, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    text = "".join(e.token for e in content)
    if r.choices[0].finish_reason == "stop":  # the EOS token has a logprob but no text
        text = text[: len(r.choices[0].message.content)]
    assert text == r.choices[0].message.content
    tops = []
    for e in content:
        assert bytes(e.bytes) == e.token.encode()
        assert len(e.top_logprobs) == 5
        values = [t.logprob for t in e.top_logprobs]
        _check_top_list(values)
        assert e.logprob == values[0] and e.token == e.top_logprobs[0].token
        tops.append(values)
    (prompt_ids,) = tokenize([chat_prompt(MESSAGES)])
    assert len(prompt_ids) == r.usage.prompt_tokens
    gen_ids = _ids_from_texts([e.token for e in content], vocab_bytes)
    _check_against_oracle(_oracle_rows(prompt_ids, gen_ids), gen_ids, [e.logprob for e in content], tops, greedy=True)


def test_streamed_logprobs_equal_non_streamed(server, client):
    kw = dict(model=server.model_name, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [e for c in client.chat.completions.create(stream=True, **kw) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob, [t.logprob for t in e.top_logprobs]) for e in streamed] == \
        [(e.token, e.logprob, [t.logprob for t in e.top_logprobs]) for e in whole]


# ---------------------------------------------------------------------------------------------
# n > 1, seeds, concurrency
# ---------------------------------------------------------------------------------------------


def test_n2_with_seed(server, client):
    kw = dict(model=server.model_name, prompt=STORY, max_tokens=12, temperature=1.0, seed=42, n=2)
    a = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert all(c.finish_reason in ("length", "stop") for c in a.choices)
    # Choice i uses seed + i: deterministic, so this is not flaky; they must not be one stream twice.
    assert a.choices[0].text != a.choices[1].text
    b = client.completions.create(**kw)
    assert [c.text for c in sorted(b.choices, key=lambda c: c.index)] == [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    chat = client.chat.completions.create(model=server.model_name, messages=MESSAGES, max_tokens=6, temperature=1.0, seed=7, n=2)
    assert sorted(c.index for c in chat.choices) == [0, 1]
    # each choice ran to max_tokens (length: exactly 6 tokens) or stopped early (stop: 1 to 6)
    reasons = [c.finish_reason for c in chat.choices]
    assert all(r in ("length", "stop") for r in reasons), reasons
    n_length = reasons.count("length")
    assert 6 * n_length + (2 - n_length) <= chat.usage.completion_tokens <= 12, (reasons, chat.usage)


def test_sixteen_concurrent_requests_and_batch_invariance(server, client):
    probe = dict(model=server.model_name, prompt=STORY, max_tokens=16, temperature=0)
    alone = client.completions.create(**probe).choices[0].text

    others = [
        dict(model=server.model_name, prompt=f"Request number {i}: the quick brown fox", max_tokens=12 + i % 5,
             temperature=0.9, seed=i, extra_body={"ignore_eos": True})
        for i in range(15)
    ]

    def run(kw):
        return client.completions.create(**kw)

    with ThreadPoolExecutor(max_workers=16) as pool:
        futures = [pool.submit(run, kw) for kw in others[:8]] + [pool.submit(run, probe)] + [pool.submit(run, kw) for kw in others[8:]]
        results = [f.result(timeout=180) for f in futures]
    probe_result = results[8]
    assert probe_result.choices[0].text == alone
    for kw, r in zip(others[:8] + others[8:], results[:8] + results[9:]):
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == kw["max_tokens"]
    assert server.wait_idle()["specula:kv_cache_usage_perc"] == 0


def test_async_concurrent_streams(server):
    import asyncio

    async def main():
        async with server.async_client() as aclient:
            async def one(i):
                stream = await aclient.chat.completions.create(
                    model=server.model_name, messages=[{"role": "user", "content": f"Count to {i + 3}."}],
                    max_tokens=8, temperature=0, stream=True)
                text, reason = "", None
                async for c in stream:
                    if c.choices:
                        text += c.choices[0].delta.content or ""
                        reason = c.choices[0].finish_reason or reason
                return text, reason

            return await asyncio.gather(*(one(i) for i in range(8)))

    results = asyncio.run(main())
    assert len(results) == 8
    assert all(reason in ("length", "stop") and text for text, reason in results)
