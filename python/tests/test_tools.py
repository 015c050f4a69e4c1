"""Tool calling on /v1/chat/completions of the real `specula serve`, driven by the official `openai`
client: Qwen2.5-Coder-0.5B-Instruct (SPECULA_MODEL_QWEN05; its template renders tools) calls a
weather function on its own (`tool_choice: auto`), answers from a tool result (a full round trip
whose prompt equals jinja2's rendering of the model's template), is forced to call by
`tool_choice: "required"` or a named function (arguments checked with `jsonschema` against the
tool's parameters), streams calls that reassemble into the non-streamed ones, and refuses bad
`tools` / `tool_choice` with 400s naming the field. The default model (SmolLM2, whose template
knows nothing of tools) gets the tools in a Hermes-style system message.

The forced calls need the engine to apply `SamplingParams.constraint` (structured outputs), which
it does: a server answering that constraints are not supported fails them (never a skip).
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest

from server_fixture import SpeculaServer, tokenize
from test_chat_template_oracle import hf_environment
from test_tokenizer_oracle import extra_model_path

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a time zone",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]},
    },
}
TOOLS = [WEATHER, TIME]
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]
SAY_HELLO = [{"role": "user", "content": "Say hello to me."}]


@pytest.fixture(scope="module")
def qwen():
    path = extra_model_path("qwen05")
    srv = SpeculaServer()
    srv.model = Path(path)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(qwen):
    return qwen.client()


def schema_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def check_call(call, names):
    assert call.type == "function"
    assert call.id.startswith("call_")
    assert call.function.name in names
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schema_of(call.function.name))
    return args


def forced(client, qwen, **kw):
    """A request that needs the engine's constraints. The engine applies them, so a server that
    says it has none fails the test (CI must not pass by skipping)."""
    try:
        return client.chat.completions.create(model=qwen.model_name, temperature=0, **{"max_tokens": 80, **kw})
    except (openai.BadRequestError, openai.InternalServerError) as e:
        text = str(e).lower()
        if "constraint" in text and ("not supported" in text or "unsupported" in text):
            pytest.fail(f"the server says constraints are unsupported, but the engine applies them: {e}")
        raise


def qwen_prompt(messages, tools) -> str:
    """The conversation as transformers renders it from the GGUF's template, with tool-call
    arguments as objects (vLLM parses them from their JSON text before rendering)."""
    import tokenizer_oracle as to

    path = extra_model_path("qwen05")
    reader = to._reader(path)
    template = to._scalar(reader, "tokenizer.chat_template")
    rendered = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}} for c in m["tool_calls"]]
        if m.get("content") is None:
            m["content"] = ""
        rendered.append(m)
    return hf_environment().from_string(template).render(messages=rendered, tools=tools,
                                                          add_generation_prompt=True, bos_token="", eos_token="")


# ---------------------------------------------------------------------------------------------
# auto
# ---------------------------------------------------------------------------------------------


def test_auto_calls_the_weather_function(qwen, client):
    r = client.chat.completions.create(model=qwen.model_name, messages=ASK_WEATHER, tools=[WEATHER], temperature=0, max_tokens=80)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    assert c.message.content is None
    assert len(c.message.tool_calls) == 1
    args = check_call(c.message.tool_calls[0], ["get_weather"])
    assert args["city"].lower() == "paris"


def test_round_trip_answers_from_the_tool_result_and_renders_like_jinja2(qwen, client):
    first = client.chat.completions.create(model=qwen.model_name, messages=ASK_WEATHER, tools=[WEATHER], temperature=0, max_tokens=80)
    call = first.choices[0].message.tool_calls[0]
    messages = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "condition": "sunny"}'},
    ]
    # the client sends the response's message object back as it is
    sent = ASK_WEATHER + [first.choices[0].message, messages[-1]]
    r = client.chat.completions.create(model=qwen.model_name, messages=sent, tools=[WEATHER], temperature=0, max_tokens=60)
    c = r.choices[0]
    assert c.finish_reason == "stop"
    assert c.message.tool_calls is None
    # the 0.5B model mostly repeats the result back, but it does read it
    assert "21" in c.message.content
    (want,) = tokenize([qwen_prompt(messages, [WEATHER])], model=qwen.model)
    assert r.usage.prompt_tokens == len(want)
    got = qwen.http().post("/tokenize", json={"messages": messages, "tools": [WEATHER]}).json()
    assert got["tokens"] == want


def test_tokenize_with_tools_matches_jinja2_for_several_calls(qwen):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Köln and the time in Berlin?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Köln", "unit": "celsius"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": '{"timezone": "Europe/Berlin"}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "12 °C"},
        {"role": "tool", "tool_call_id": "call_b", "content": "14:05"},
    ]
    (want,) = tokenize([qwen_prompt(messages, TOOLS)], model=qwen.model)
    got = qwen.http().post("/tokenize", json={"messages": messages, "tools": TOOLS}).json()
    assert got["tokens"] == want


# ---------------------------------------------------------------------------------------------
# required / named
# ---------------------------------------------------------------------------------------------


def test_required_forces_a_call_even_for_a_greeting(qwen, client):
    r = forced(client, qwen, messages=SAY_HELLO, tools=TOOLS, tool_choice="required")
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    assert c.message.tool_calls
    for call in c.message.tool_calls:
        check_call(call, ["get_weather", "get_time"])


def test_named_function_is_the_one_called(qwen, client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    r = forced(client, qwen, messages=ASK_WEATHER, tools=TOOLS, tool_choice=choice)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    assert [t.function.name for t in c.message.tool_calls] == ["get_time"]
    check_call(c.message.tool_calls[0], ["get_time"])


def test_none_returns_text_only(qwen, client):
    r = client.chat.completions.create(model=qwen.model_name, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="none",
                                       temperature=0, max_tokens=40)
    c = r.choices[0]
    assert c.message.tool_calls is None
    assert c.finish_reason in ("stop", "length")
    assert isinstance(c.message.content, str)


# ---------------------------------------------------------------------------------------------
# streaming
# ---------------------------------------------------------------------------------------------


def reassemble(stream, fragments=None):
    """Content, calls and finish reasons of a stream; `fragments` (a dict) gets how many chunks
    carried a non-empty piece of each call's arguments."""
    content, calls, reasons = "", {}, []
    fragments = {} if fragments is None else fragments
    for chunk in stream:
        for c in chunk.choices:
            d = c.delta
            content += d.content or ""
            for t in d.tool_calls or []:
                if t.index not in calls:
                    # OpenAI's first chunk of a call: id, type, name, and empty arguments
                    assert t.id and t.id.startswith("call_") and t.type == "function" and t.function.name, t
                    assert t.function.arguments == "", t
                    calls[t.index] = {"name": t.function.name, "arguments": ""}
                    fragments[t.index] = 0
                else:
                    assert t.id is None and t.function.name is None, t
                fragments[t.index] += bool(t.function.arguments)
                calls[t.index]["arguments"] += t.function.arguments or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    return content, [calls[i] for i in sorted(calls)], reasons


@pytest.mark.parametrize("messages", [ASK_WEATHER, SAY_HELLO], ids=["call", "text"])
def test_stream_reassembles_into_the_non_streamed_message(qwen, client, messages):
    kw = dict(model=qwen.model_name, messages=messages, tools=TOOLS, temperature=0, max_tokens=80)
    whole = client.chat.completions.create(**kw).choices[0]
    content, calls, reasons = reassemble(client.chat.completions.create(stream=True, **kw))
    assert content == (whole.message.content or "")
    assert calls == [{"name": t.function.name, "arguments": t.function.arguments} for t in whole.message.tool_calls or []]
    assert reasons == [whole.finish_reason]
    if messages is ASK_WEATHER:
        assert calls and reasons == ["tool_calls"]


def test_forced_call_streams_like_the_non_streamed_one(qwen, client):
    kw = dict(messages=SAY_HELLO, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    whole = forced(client, qwen, **kw).choices[0]
    content, calls, reasons = reassemble(forced(client, qwen, stream=True, **kw))
    assert content == "" and whole.message.content is None
    assert len(calls) == 1 and reasons == ["tool_calls"]
    assert calls == [{"name": t.function.name, "arguments": t.function.arguments} for t in whole.message.tool_calls]
    jsonschema.validate(json.loads(calls[0]["arguments"]), schema_of(calls[0]["name"]))


NOTE = {
    "type": "function",
    "function": {
        "name": "save_note",
        "description": "Save a note",
        "parameters": {
            "type": "object",
            "properties": {"title": {"type": "string"}, "body": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["title", "body", "tags"],
        },
    },
}


def test_a_long_calls_arguments_stream_in_fragments(qwen, client):
    """As OpenAI streams a call: the name first, then the arguments piece by piece as they are
    generated (not in one piece once the call is complete), adding up to the non-streamed call."""
    kw = dict(messages=[{"role": "user", "content": "Save a note titled Groceries listing milk, eggs, bread, coffee, apples and rice for the week, tagged food and home."}],
              tools=[NOTE], tool_choice={"type": "function", "function": {"name": "save_note"}}, max_tokens=200)
    whole = forced(client, qwen, **kw).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    fragments = {}
    content, calls, reasons = reassemble(forced(client, qwen, stream=True, **kw), fragments)
    assert calls == [{"name": t.function.name, "arguments": t.function.arguments} for t in whole.message.tool_calls]
    assert reasons == ["tool_calls"] and content == ""
    args = json.loads(calls[0]["arguments"])
    jsonschema.validate(args, NOTE["function"]["parameters"])
    assert len(calls[0]["arguments"]) > 40, calls
    assert fragments[0] > 3, f"{fragments[0]} argument fragments for {calls[0]['arguments']!r}"


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "unknown"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_tools_are_400s_naming_the_field(qwen, extra, param):
    r = qwen.http().post("/v1/chat/completions", json={"messages": SAY_HELLO, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def test_openai_client_raises_bad_request_for_an_unknown_tool_choice(qwen, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=qwen.model_name, messages=SAY_HELLO, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice"


# ---------------------------------------------------------------------------------------------
# the default model: no tools in its template
# ---------------------------------------------------------------------------------------------


def test_default_model_gets_the_tools_in_a_system_message():
    srv = SpeculaServer().start()
    try:
        body = {"messages": ASK_WEATHER, "tools": [WEATHER]}
        tokens = srv.http().post("/tokenize", json=body).json()["tokens"]
        prompt = srv.http().post("/detokenize", json={"tokens": tokens}).json()["prompt"]
        assert prompt.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
        assert '<tools>\n{"function": {"description": "Get the current weather in a city", "name": "get_weather"' in prompt
        assert prompt.endswith("<|im_start|>user\nWhat is the weather like in Paris today?<|im_end|>\n<|im_start|>assistant\n")
        r = srv.client().chat.completions.create(model=srv.model_name, messages=ASK_WEATHER, tools=[WEATHER], temperature=0, max_tokens=30)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert r.usage.prompt_tokens == len(tokens)
    finally:
        srv.stop()


# ---------------------------------------------------------------------------------------------
# the same calls with speculation and async scheduling
# ---------------------------------------------------------------------------------------------

SPEC_ASYNC = ("--speculative-method", "ngram", "--async-scheduling")


def calls_of(r, validate):
    """What a greedy answer says, without the random call ids: finish reason, text, and each
    call's name and arguments (with `validate`, checked against the tool's schema: a forced call
    must be valid; a free one, as OpenAI's, may not be, e.g. cut by max_tokens)."""
    c = r.choices[0]
    calls = []
    for call in c.message.tool_calls or []:
        if validate:
            check_call(call, [t["function"]["name"] for t in TOOLS])
        calls.append((call.function.name, call.function.arguments))
    return c.finish_reason, c.message.content, calls


def tool_requests(tools):
    weather, time = tools
    return {
        "auto": dict(messages=ASK_WEATHER, tools=[weather]),
        "required": dict(messages=SAY_HELLO, tools=tools, tool_choice="required"),
        "named": dict(messages=ASK_WEATHER, tools=tools, tool_choice={"type": "function", "function": {"name": "get_time"}}),
        "none": dict(messages=ASK_WEATHER, tools=[weather], tool_choice="none"),
    }


def answers(srv, tools=TOOLS, max_tokens=60):
    client = srv.client()
    return {name: calls_of(forced(client, srv, max_tokens=max_tokens, **kw), name in ("required", "named"))
            for name, kw in tool_requests(tools).items()}


def strict(tool):
    """The tool with no properties beyond its own: a forced call then has a bounded length (SmolLM2
    otherwise goes on adding keys the schema allows until max_tokens cuts the call)."""
    return {**tool, "function": {**tool["function"], "parameters": {**tool["function"]["parameters"], "additionalProperties": False}}}


def test_qwen_tool_calls_are_the_same_with_ngram_speculation_and_async_scheduling(qwen):
    plain = answers(qwen)
    assert plain["auto"][0] == "tool_calls" and plain["required"][0] == "tool_calls", plain
    assert [c[0] for c in plain["named"][2]] == ["get_time"], plain
    spec = SpeculaServer(*SPEC_ASYNC)
    spec.model = qwen.model
    spec.start()
    try:
        assert answers(spec) == plain
    finally:
        spec.stop()


def test_default_model_forced_calls_are_valid_and_the_same_with_ngram_speculation_and_async_scheduling():
    """SmolLM2 (no tools in its template) through the openai client: required and named calls are
    valid JSON for the tool's parameters (the grammar forces them), and every answer is the same
    with n-gram speculation and async scheduling."""
    outs = []
    for args in [(), SPEC_ASYNC]:
        srv = SpeculaServer(*args).start()
        try:
            outs.append(answers(srv, [strict(t) for t in TOOLS], max_tokens=120))
        finally:
            srv.stop()
    plain, spec = outs
    assert plain["required"][0] == "tool_calls" and plain["required"][2], plain
    assert [c[0] for c in plain["named"][2]] == ["get_time"], plain
    assert spec == plain
