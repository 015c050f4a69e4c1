"""gpt-oss through the whole stack on a tiny random gpt-oss file (`specula debug write-tiny-moe
--arch gpt-oss`: attention sinks, biases, alternating sliding layers, YaRN, clamped-SwiGLU
experts, the harmony vocabulary and a harmony chat template).

- The harmony template renders as Python's jinja2 (transformers' environment) renders it, tools
  and a past tool call included, and generation stops at `<|return|>` and `<|call|>`, not at
  `<|end|>` (which ends the analysis message before the final one), as llama.cpp decides.
- Served, greedy outputs are token for token the same with and without n-gram speculation and
  async scheduling, and with the experts read in place from the file's map (`--expert-weights
  mapped`) (the random model's output is noise, so only exactness is asserted).
The forward pass itself is checked against the NumPy reference in test_moe_oracle.py.
"""

import json

import pytest

import tokenizer_oracle as to
from conftest import run_specula, write_json
from server_fixture import SpeculaServer, assert_drafted, chat_outputs
from test_chat_template_oracle import compare, engine_render

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CASES = [
    {"messages": [{"role": "user", "content": "Hi there"}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS},
    {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "thinking": "Need the tool.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "{\"t\": 21}"},
    ], "tools": TOOLS},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "thinking": "A greeting."},
                  {"role": "user", "content": "Again"}]},
]


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory, specula_bin):
    path = tmp_path_factory.mktemp("gpt-oss") / "tiny-gpt-oss.gguf"
    run_specula(specula_bin, ["debug", "write-tiny-moe", "--arch", "gpt-oss", "--format", "q8_0", "--experts", "8",
                              "--experts-used", "4", "--layers", "3", "--seed", "3", "--output", str(path)])
    return path


def test_harmony_template_renders_as_jinja2_and_stops_at_return_and_call(tiny_gpt_oss, specula_bin, tmp_path):
    reader = to._reader(str(tiny_gpt_oss))
    template = to._scalar(reader, "tokenizer.chat_template")
    tokens = to._strings(reader, "tokenizer.ggml.tokens")
    res = engine_render(specula_bin, str(tiny_gpt_oss), CASES, tmp_path)
    compare(res["renders"], CASES, template, "", "")
    assert res["renders"][2]["text"].endswith(
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Paris\"}<|call|>"
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>\"{\\\"t\\\": 21}\"<|end|><|start|>assistant")
    eos = {tokens[i] for i in res["eos"]}
    assert {"<|return|>", "<|call|>"} <= eos and "<|end|>" not in eos, eos


PROMPTS = ["Count: one two three one two three one two three", "abc abc abc abc abc", "Say something."]


def test_served_gpt_oss_is_exact_under_ngram_async_scheduling_and_mapped_experts(tiny_gpt_oss):
    runs = []
    # adaptive k off: it drafts only where its measured costs say drafts pay, and on a loaded
    # machine it may draft nothing, which would leave the exactness check testing nothing
    ngram = ("--speculative-method", "ngram", "--no-speculative-adaptive")
    for flags in [(), (*ngram, "--async-scheduling"), ("--expert-weights", "mapped", *ngram)]:
        server = SpeculaServer(*flags, "--max-model-len", "512")
        server.model = tiny_gpt_oss
        server.start()
        try:
            runs.append(chat_outputs(server, PROMPTS))
            if "mapped" in flags:
                assert "expert weights read in place" in server.log_tail(100000), server.log_tail()
            if flags:
                assert_drafted(server)
        finally:
            server.stop()
    assert runs[0] == runs[1], json.dumps(runs, indent=1)[:2000]
    assert runs[0] == runs[2], "experts read in place from the map changed the output"
    assert any(len(toks) > 5 for toks, *_ in runs[0])
