"""Speculative decoding on a real model (Qwen2.5-Coder-0.5B-Instruct, a Q4_K_M GGUF): n-gram and
draft-model speculation, with and without async scheduling, give exactly the output of plain
decoding on code-edit prompts (bench/code_edit.jsonl): greedy text and its logprobs bit for bit,
and seeded sampling token for token. The draft model is the target itself (the real 0.5B/1.5B
pair is measured by scripts/bench_spec_real.sh, too slow for the test suite), so every greedy draft
is accepted and verification, rollback and the draft's own KV run on real shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server_fixture import SpeculaServer
from test_real_models import model_file

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [json.loads(line)["prompt"] for line in (ROOT / "bench" / "code_edit.jsonl").read_text().splitlines()[:2]]
MAX_TOKENS = 40

CONFIGS = {
    "plain": [],
    "ngram": ["--speculative-method", "ngram", "--num-speculative-tokens", "8"],
    "ngram-async": ["--speculative-method", "ngram", "--num-speculative-tokens", "8", "--async-scheduling"],
    # the target drafting for itself costs as much as it saves: given draft and verify costs keep
    # adaptive k drafting (this test is about identical outputs, not speed); a verify curve
    # measured at start-up on a busy machine could make it decide never to draft
    "draft": ["--speculative-method", "draft", "--draft-model", "{model}", "--num-speculative-tokens", "4", "--speculative-draft-cost", "0.1",
              "--speculative-verify-cost", "0.1"],
    "draft-async": ["--speculative-method", "draft", "--draft-model", "{model}", "--num-speculative-tokens", "4", "--speculative-draft-cost", "0.1",
                    "--speculative-verify-cost", "0.1", "--async-scheduling"],
}


def run(config: str) -> dict:
    model = model_file("qwen05")
    args = [a.replace("{model}", model) for a in CONFIGS[config]]
    srv = SpeculaServer("--max-model-len", "2048", *args)
    srv.model = Path(model)
    srv.start(timeout=180)
    try:
        c = srv.client()
        out = {}
        for i, p in enumerate(PROMPTS):
            msgs = [{"role": "user", "content": p}]
            g = c.chat.completions.create(model=srv.model_name, messages=msgs, max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=3)
            lp = [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in g.choices[0].logprobs.content]
            s = c.chat.completions.create(model=srv.model_name, messages=msgs, max_tokens=MAX_TOKENS, temperature=0.8, seed=5 + i)
            out[i] = (g.choices[0].message.content, lp, s.choices[0].message.content)
        drafted = srv.metrics().get("specula:spec_decode_num_draft_tokens", 0)
        return {"out": out, "drafted": drafted}
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def plain():
    return run("plain")


@pytest.mark.parametrize("config", ["ngram", "ngram-async", "draft", "draft-async"])
def test_speculation_on_a_real_model_changes_nothing(plain, config):
    got = run(config)
    assert got["drafted"] > 0, f"{config}: no draft token was verified, the test would prove nothing"
    for i in plain["out"]:
        want_text, want_lp, want_seeded = plain["out"][i]
        text, lp, seeded = got["out"][i]
        assert text == want_text, f"{config}: greedy text differs on prompt {i}"
        assert lp == want_lp, f"{config}: greedy logprobs differ on prompt {i}"
        assert seeded == want_seeded, f"{config}: seeded sampling differs on prompt {i}"
