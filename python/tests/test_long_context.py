"""Agent-scale context through the official SDKs, on Qwen2.5-Coder-0.5B-Instruct (trained context
32768; SPECULA_MODEL_QWEN05), served with no context flag at all:

- the server serves the model's own context (the start-up line says so) instead of the old
  8192-token default;
- a coding-agent conversation of about 9k tokens (an agent system prompt, real Python standard
  library sources as file reads; just past the old limit, as its prefill is most of this test's
  time) goes through the `openai` SDK's chat completions, then its next
  turn through the `anthropic` SDK's Messages, which finds the first turn in the prefix cache;
- on a server with n-gram speculation and async scheduling, the live audit replays both greedy
  answers (logprobs included) without speculation from that depth and finds them identical;
- a prompt past the model's context gets the API's 400 with both numbers.
"""

from __future__ import annotations

import sysconfig
import time
from pathlib import Path

import anthropic
import openai
import pytest

from server_fixture import SpeculaServer
from test_tokenizer_oracle import extra_model_path

CONTEXT = 32768
SYSTEM = (
    "You are a coding agent working in a Python repository. You read files, run commands and edit code "
    "with the tools you are given. Keep answers short; quote file paths exactly."
)


def _files(chars: int) -> list[tuple[str, str]]:
    """Real source files of this machine's Python standard library, in a fixed order."""
    out, total = [], 0
    for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = p.read_text(errors="replace")
        if not 2000 < len(text) < 12000:
            continue
        out.append((p.name, text))
        total += len(text)
        if total >= chars:
            break
    return out


def _conversation() -> list[dict]:
    msgs = []
    for name, text in _files(34000):
        msgs.append({"role": "user", "content": f"Read {name}."})
        msgs.append({"role": "assistant", "content": f"Contents of {name}:\n```python\n{text}\n```"})
    msgs.append({"role": "user", "content": "Which of these files defines the most classes? Answer with the file name."})
    return msgs


@pytest.fixture(scope="module")
def server():
    srv = SpeculaServer("--speculative-method", "ngram", "--async-scheduling", "--speculative-audit", "1", threads=2)
    srv.model = Path(extra_model_path("qwen05"))
    srv.start(timeout=180)
    yield srv
    srv.stop()


def _audits(srv) -> dict[str, float]:
    m = srv.metrics()
    return {r: m.get(f'specula:spec_audit_requests_total{{result="{r}"}}', 0.0) for r in ("identical", "diverged", "skipped")}


def test_the_models_context_is_served_by_default(server):
    log = server.log_tail(20000)
    assert f"context: {CONTEXT} tokens a sequence (the model's: {CONTEXT})" in log, log[-3000:]
    assert "KV cache:" in log and "as f16" in log, log[-3000:]


def test_a_conversation_past_8192_tokens_through_both_sdks(server):
    msgs = _conversation()
    oa = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=900)
    t = time.monotonic()
    r = oa.chat.completions.create(model=server.model_name, messages=[{"role": "system", "content": SYSTEM}, *msgs],
                                   max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    first = time.monotonic() - t
    assert r.usage.prompt_tokens > 8192, r.usage
    assert r.choices[0].message.content, r
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    # the next turn, as an Anthropic-SDK agent sends it: the whole conversation again
    msgs2 = [*msgs, {"role": "assistant", "content": r.choices[0].message.content},
             {"role": "user", "content": "Now name the largest of them."}]
    an = anthropic.Anthropic(base_url=server.base_url, api_key="unused", timeout=900)
    t = time.monotonic()
    m = an.messages.create(model=server.model_name, system=SYSTEM, messages=msgs2, max_tokens=12, extra_body={"temperature": 0})
    second = time.monotonic() - t
    total = m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    assert total > r.usage.prompt_tokens, m.usage
    # the first turn's prompt, less at most a block and the turn's closing markup, came from the cache
    assert (m.usage.cache_read_input_tokens or 0) >= r.usage.prompt_tokens - 32, m.usage
    assert m.content and m.content[0].text, m
    assert second < first, f"the cached turn took {second:.1f}s, the first {first:.1f}s"
    # both greedy answers replayed without speculation from that depth: identical
    deadline = time.monotonic() + 600
    while sum(_audits(server).values()) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _audits(server) == {"identical": 2, "diverged": 0, "skipped": 0}, _audits(server)


def test_a_prompt_past_the_models_context_is_a_400_with_the_numbers(server):
    oa = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=300)
    words = " ".join(["token"] * (CONTEXT + 500))
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model=server.model_name, messages=[{"role": "user", "content": words}], max_tokens=4)
    msg = str(e.value)
    assert str(CONTEXT) in msg and "prompt" in msg, msg
