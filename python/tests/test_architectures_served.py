"""qwen3moe, qwen2moe, phi3, smollm3 and the qwen35 / qwen35moe / qwen3next hybrids through the whole stack on tiny random files (`specula debug
write-tiny` / `write-tiny-moe`), as test_gpt_oss.py does for gpt-oss:

- Each file's chat template (Qwen3's, Phi-4-mini's and SmolLM3's formats, written by the tiny
  writer; qwen2moe files carry none and get ChatML, as Qwen1.5-MoE's template is) renders as
  Python's jinja2 renders it (transformers' environment), with and without tools.
- Generation stops where the format ends a turn. Phi-4-mini's files name `<|endoftext|>` as EOS
  while every turn ends with `<|end|>` (its generation config stops at both; llama.cpp's
  end-of-generation set has both): forcing that token with `logit_bias` must end the answer with
  finish_reason "stop", not run on to max_tokens.
- Served, greedy outputs (tokens, content, reasoning, finish reason) are the same with and
  without n-gram speculation and async scheduling (the random model's text is noise, so only
  exactness is asserted, and that the n-gram drafted); for the hybrid that means rejected drafts
  rolled back out of its recurrent state, and the same again drafting with the file's own
  prediction layer (`--speculative-method mtp` without a head file).
The forward passes themselves are checked against the NumPy reference (test_real_models.py,
test_moe_oracle.py) and llama.cpp (scripts/llama_compare.sh).
"""

import json

import pytest

import tokenizer_oracle as to
from conftest import run_specula
from server_fixture import SpeculaServer, assert_drafted, chat_outputs, greedy_chat
from test_chat_template_oracle import CALL, RESULT, WEATHER_TOOL, A, S, U, compare, engine_render

# name: (writer, flags, the token that ends an assistant turn)
ARCHS = {
    "qwen3moe": ("write-tiny-moe", ["--arch", "qwen3moe", "--experts", "8", "--experts-used", "3", "--head-dim", "32"], "<|im_end|>"),
    "qwen2moe": ("write-tiny-moe", ["--arch", "qwen2moe", "--experts", "8", "--experts-used", "2", "--shared-ffn", "32"], "<|im_end|>"),
    "phi3": ("write-tiny", ["--arch", "phi3", "--rope-dims", "8"], "<|end|>"),
    "smollm3": ("write-tiny", ["--arch", "smollm3", "--layers", "4"], "<|im_end|>"),
    # the hybrids with their own prediction layer (nextn), as Qwen3.5 files ship
    "qwen35": ("write-tiny", ["--arch", "qwen35", "--layers", "4", "--nextn"], "<|im_end|>"),
    "qwen35moe": ("write-tiny-moe", ["--arch", "qwen35moe", "--layers", "4", "--experts", "8", "--experts-used", "2", "--shared-ffn", "32", "--nextn"], "<|im_end|>"),
    # Qwen3-Next's layout: beta/alpha fused per key head, key heads repeated in runs, no RoPE sections
    "qwen3next": ("write-tiny-moe", ["--arch", "qwen3next", "--layers", "4", "--experts", "8", "--experts-used", "2", "--shared-ffn", "32", "--nextn"], "<|im_end|>"),
}
CASES = [
    {"messages": [U]},
    {"messages": [U], "add_generation_prompt": False},
    {"messages": [S, U, A, U]},
    {"messages": [S, U], "tools": [WEATHER_TOOL]},
]
# Qwen3's format also carries past calls and their results
QWEN3_CASES = CASES + [{"messages": [U, CALL, RESULT], "tools": [WEATHER_TOOL]}]
SMOLLM3_CASES = CASES + [{"messages": [{"role": "system", "content": "Be brief. /no_think"}, U]}]


@pytest.fixture(scope="module", params=list(ARCHS))
def tiny(request, tmp_path_factory, specula_bin):
    name = request.param
    writer, flags, _ = ARCHS[name]
    path = tmp_path_factory.mktemp(name) / f"tiny-{name}.gguf"
    run_specula(specula_bin, ["debug", writer, "--format", "q8_0", "--seed", "5", "--output", str(path), *flags])
    return name, path


def vocabulary(path):
    reader = to._reader(str(path))
    return reader, to._strings(reader, "tokenizer.ggml.tokens")


def test_chat_template_renders_as_jinja2_and_turns_end_where_the_format_ends_them(tiny, specula_bin, tmp_path):
    name, path = tiny
    reader, tokens = vocabulary(path)
    cases = {"qwen3moe": QWEN3_CASES, "qwen35": QWEN3_CASES, "qwen35moe": QWEN3_CASES, "qwen3next": QWEN3_CASES, "smollm3": SMOLLM3_CASES}.get(name, CASES)
    res = engine_render(specula_bin, str(path), cases, tmp_path)
    if name == "qwen2moe":
        assert "tokenizer.chat_template" not in reader.fields
        assert res["renders"][0]["text"] == "<|im_start|>user\nWhat's the weather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    else:
        template = to._scalar(reader, "tokenizer.chat_template")
        bos = tokens[to._scalar(reader, "tokenizer.ggml.bos_token_id")]
        eos = tokens[to._scalar(reader, "tokenizer.ggml.eos_token_id")]
        compare(res["renders"], cases, template, bos, eos)
    eos_names = {tokens[i] for i in res["eos"]}
    assert ARCHS[name][2] in eos_names, eos_names
    if name == "phi3":
        assert tokens[to._scalar(reader, "tokenizer.ggml.eos_token_id")] == "<|endoftext|>"
        assert res["renders"][3]["text"].startswith("<|system|>You are terse.<|tool|>[{")
        assert res["renders"][2]["text"].endswith("<|user|>What's the weather in Paris?<|end|><|assistant|>")
    if name == "smollm3":
        assert "Reasoning Mode: /no_think" in res["renders"][4]["text"] and res["renders"][4]["text"].endswith("<think>\n\n</think>\n")
        assert "Reasoning Mode: /think" in res["renders"][0]["text"]


PROMPTS = ["Count: one two three one two three one two three", "abc abc abc abc abc", "Say something."]


def test_served_exact_under_ngram_and_async_and_stopping_at_the_turn_end(tiny):
    name, path = tiny
    _, tokens = vocabulary(path)
    turn_end = tokens.index(ARCHS[name][2])
    runs = []
    # adaptive k off: on a loaded machine its measured costs may say no draft pays
    runs_flags = [(), ("--speculative-method", "ngram", "--no-speculative-adaptive", "--async-scheduling")]
    if name.startswith(("qwen35", "qwen3next")):
        runs_flags.append(("--speculative-method", "mtp", "--no-speculative-adaptive", "--async-scheduling"))
    for flags in runs_flags:
        server = SpeculaServer(*flags, "--max-model-len", "512")
        server.model = path
        server.start()
        try:
            runs.append(chat_outputs(server, PROMPTS))
            # the turn-end token, forced, ends the answer there
            c = greedy_chat(server, PROMPTS[0], logit_bias={str(turn_end): 100})
            assert c["finish_reason"] == "stop", (name, c)
            assert not c["message"].get("content") and not c["message"].get("reasoning_content"), c["message"]
            if flags:
                assert_drafted(server)
        finally:
            server.stop()
    for run in runs[1:]:
        assert runs[0] == run, json.dumps(runs, indent=1)[:2000]
    assert any(len(toks) > 5 for toks, *_ in runs[0])


@pytest.mark.parametrize("name", [n for n in ARCHS if n.startswith(("qwen35", "qwen3next"))])
def test_hybrid_resent_conversation_restarts_from_its_state_checkpoint(name, tmp_path, specula_bin):
    """A hybrid's prefix cache: the second turn of a conversation (the first turn, its answer and
    a new user message, resent whole as agents do) finds the first turn's prompt cached up to its
    recurrent-state checkpoint (`usage.prompt_tokens_details.cached_tokens`), and answers with the
    tokens and logprobs of a server that caches nothing."""
    writer, flags, _ = ARCHS[name]
    path = tmp_path / f"tiny-{name}.gguf"
    run_specula(specula_bin, ["debug", writer, "--format", "q8_0", "--seed", "5", "--output", str(path), *flags])
    turn1 = [{"role": "system", "content": "You are a coding agent. " * 5}, {"role": "user", "content": "List the files, then read main.rs."}]

    def ask(server, messages):
        r = server.http().post("/v1/chat/completions", json={"messages": messages, "max_tokens": 24, "temperature": 0, "logprobs": True, "top_logprobs": 2})
        assert r.status_code == 200, r.text
        j = r.json()
        return j["choices"][0], (j["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    runs = []
    for flags in [("--enable-prefix-caching", "false"), ()]:
        server = SpeculaServer(*flags, "--max-model-len", "512")
        server.model = path
        server.start()
        try:
            first, _ = ask(server, turn1)
            turn2 = turn1 + [{"role": "assistant", "content": first["message"].get("content") or "ok"}, {"role": "user", "content": "Now run the tests."}]
            second, cached = ask(server, turn2)
            runs.append((first["logprobs"], second["logprobs"], cached))
        finally:
            server.stop()
    (cold1, cold2, cold_cached), (warm1, warm2, warm_cached) = runs
    assert cold_cached == 0
    assert warm_cached >= 64, f"the second turn found {warm_cached} tokens cached"
    assert (warm1, warm2) == (cold1, cold2)
