"""Chat templates: `specula debug render-chat` (minijinja) vs Python jinja2 set up as transformers'
`apply_chat_template` does (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks,
loopcontrols, `raise_exception`, transformers' `tojson`), on the same template string.

Models (as in test_tokenizer_oracle.py): SPECULA_MODEL_QWEN05 (Qwen2.5 with its ChatML + tools
template), SPECULA_MODEL_GEMMA (Gemma 3 270m base: no template in the file, so Gemma 3's
instruction-tuned template is rendered from GEMMA3_TEMPLATE below). Missing models skip, or
fail when CI is set.

Maps keep their insertion order on both sides (minijinja is built with `preserve_order`), so
`tojson` of a tool definition writes its keys as the request gave them, as Python does; the tool
dicts below are deliberately not in sorted order.
"""

import json

import jinja2
import pytest
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from conftest import run_specula, write_json
from test_tokenizer_oracle import extra_model_path

# Gemma 3's template (google/gemma-3-*-it tokenizer_config.json "chat_template").
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n'
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)

# written in the order OpenAI documents them (not sorted): `tojson` must keep insertion order
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city — °C",
        "parameters": {"type": "object", "properties": {"days": {"type": "integer"}, "city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK_TOOL = {"type": "function", "function": {"name": "now", "description": "The time", "parameters": {"type": "object", "properties": {}}}}

U = {"role": "user", "content": "What's the weather in Paris?"}
A = {"role": "assistant", "content": "  It is sunny.  "}
S = {"role": "system", "content": "You are terse."}
CALL = {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"days": 2, "city": "Paris"}}}]}
CALL2 = {"role": "assistant", "content": "Checking.", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Köln"}}}, {"function": {"name": "now", "arguments": {}}}]}
RESULT = {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_0"}
RESULT2 = {"role": "tool", "content": "12:00", "tool_call_id": "call_1"}

QWEN_CASES = [
    {"messages": [U]},
    {"messages": [U], "add_generation_prompt": False},
    {"messages": [S, U, A, U]},
    {"messages": [U], "tools": [WEATHER_TOOL]},
    {"messages": [S, U], "tools": [WEATHER_TOOL, CLOCK_TOOL]},
    {"messages": [U, CALL, RESULT], "tools": [WEATHER_TOOL]},
    {"messages": [U, CALL2, RESULT, RESULT2, {"role": "assistant", "content": "21 °C at 12:00."}, U], "tools": [WEATHER_TOOL, CLOCK_TOOL]},
    {"messages": [{"role": "user", "content": "<|im_start|> in text, ünïcödé, emoji 🙂\n\nnewlines"}]},
]

GEMMA_CASES = [
    {"messages": [U]},
    {"messages": [U], "add_generation_prompt": False},
    {"messages": [S, U, A, U]},
    {"messages": [U, A]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "  parts  "}, {"type": "text", "text": "two"}]}]},
    {"messages": [S, {"role": "user", "content": "multi\nline\n"}]},
    # raise_exception: roles must alternate
    {"messages": [U, U]},
    {"messages": [A]},
]


def hf_environment() -> jinja2.Environment:
    """transformers' chat-template environment (utils/chat_template_utils.py)."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


def python_render(template: str, case: dict, bos: str, eos: str):
    try:
        return {"text": hf_environment().from_string(template).render(
            messages=case["messages"], tools=case.get("tools"), add_generation_prompt=case.get("add_generation_prompt", True),
            bos_token=bos, eos_token=eos)}
    except jinja2.exceptions.TemplateError as e:
        return {"error": str(e)}


def engine_render(specula_bin, model, cases, tmp_path, template_file=None):
    inp = write_json(tmp_path / "in.json", cases)
    out = tmp_path / "out.json"
    args = ["debug", "render-chat", "--model", model, "--input", str(inp), "--output", str(out)]
    if template_file:
        args += ["--template", str(template_file)]
    run_specula(specula_bin, args)
    return json.loads(out.read_text(encoding="utf-8"))


def compare(results, cases, template, bos, eos):
    assert len(results) == len(cases)
    for case, got in zip(cases, results):
        want = python_render(template, case, bos, eos)
        if "error" in want:
            assert "error" in got, f"jinja2 raised {want['error']!r}; engine rendered {got.get('text')!r}"
            assert want["error"] in got["error"], (want, got)
        else:
            assert got == want, f"case {json.dumps(case)[:200]}"


def test_qwen_template_with_and_without_tools(specula_bin, tmp_path):
    import tokenizer_oracle as to

    path = extra_model_path("qwen05")
    reader = to._reader(path)
    template = to._scalar(reader, "tokenizer.chat_template")
    tokens = to._strings(reader, "tokenizer.ggml.tokens")
    bos = tokens[to._scalar(reader, "tokenizer.ggml.bos_token_id")]
    eos = tokens[to._scalar(reader, "tokenizer.ggml.eos_token_id")]
    res = engine_render(specula_bin, path, QWEN_CASES, tmp_path)
    compare(res["renders"], QWEN_CASES, template, bos, eos)
    assert "# Tools" in res["renders"][3]["text"] and "# Tools" not in res["renders"][0]["text"]
    assert '"name": "get_weather", "arguments": {"days": 2, "city": "Paris"}' in res["renders"][5]["text"]  # the request's key order
    # Generation stops at <|im_end|> (151645, also the file's EOS); <|endoftext|> is BOS/pad, not EOS.
    assert res["eos"] == [151645] and res["add_bos"] is False


def test_gemma_base_has_no_template_but_stops_at_end_of_turn(specula_bin, tmp_path):
    path = extra_model_path("gemma")
    res = engine_render(specula_bin, path, [{"messages": [U]}], tmp_path)
    assert res["renders"] == [{"error": "no chat template"}]
    assert sorted(res["eos"]) == [1, 106] and res["bos"] == 2 and res["add_bos"] is True  # <eos>, <end_of_turn>


def test_gemma3_template_matches_jinja2(specula_bin, tmp_path):
    path = extra_model_path("gemma")
    tf = tmp_path / "gemma3.jinja"
    tf.write_text(GEMMA3_TEMPLATE, encoding="utf-8")
    res = engine_render(specula_bin, path, GEMMA_CASES, tmp_path, tf)
    compare(res["renders"], GEMMA_CASES, GEMMA3_TEMPLATE, "<bos>", "<eos>")
    assert res["renders"][2]["text"] == (
        "<bos><start_of_turn>user\nYou are terse.\n\nWhat's the weather in Paris?<end_of_turn>\n"
        "<start_of_turn>model\nIt is sunny.<end_of_turn>\n<start_of_turn>user\nWhat's the weather in Paris?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


def test_default_model_template_matches_jinja2(model_path, specula_bin, tmp_path):
    """SmolLM2 (SPECULA_MODEL): its own template, now rendered with trim/lstrip_blocks."""
    import tokenizer_oracle as to

    reader = to._reader(model_path)
    template = to._scalar(reader, "tokenizer.chat_template")
    tokens = to._strings(reader, "tokenizer.ggml.tokens")
    bos = tokens[to._scalar(reader, "tokenizer.ggml.bos_token_id")]
    eos = tokens[to._scalar(reader, "tokenizer.ggml.eos_token_id")]
    cases = [{"messages": [U]}, {"messages": [S, U, A, U]}, {"messages": [U, A], "add_generation_prompt": False}]
    res = engine_render(specula_bin, model_path, cases, tmp_path)
    compare(res["renders"], cases, template, bos, eos)
