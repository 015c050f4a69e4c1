"""The APIs coding agents speak, through the REAL official clients against the real `specula serve`
on Qwen2.5-Coder-0.5B-Instruct (SPECULA_MODEL_QWEN05): the `anthropic` SDK on `/v1/messages`
(create, stream, a tool round trip whose call is forced by grammar with `tool_choice: any`,
count_tokens against `/tokenize`, errors raised as the SDK's exception classes), the `openai` SDK's
`responses` (create, stream, a function call answered with `function_call_output`, `text.format`
json_schema checked with jsonschema, `previous_response_id`, GET by id, 404), the OpenAI Agents SDK
(`agents`: an Agent with a function tool run end to end by Runner.run_sync), and the same greedy
conversation through chat/completions, messages and responses giving the same text, on a plain
server and on one with n-gram speculation and async scheduling.

`SPECULA_AGENT_TRANSCRIPT=path` writes a short transcript of the Agents-SDK run and the anthropic
tool round trip there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import anthropic
import jsonschema
import openai
import pytest

from server_fixture import SpeculaServer
from test_tokenizer_oracle import extra_model_path

API_KEY = "sk-agent-apis"
KV = ("--kv-cache-tokens", "8192", "--max-model-len", "2048")
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
    "additionalProperties": False,
}
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "Get the current weather in a city", "input_schema": WEATHER_SCHEMA}
RESPONSES_WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
                     "parameters": WEATHER_SCHEMA, "strict": True}
TRANSCRIPT: list[str] = []
# the anthropic SDK has no sampling arguments any more; the server still reads `temperature`
GREEDY = {"temperature": 0}


def _start(*args: str) -> SpeculaServer:
    srv = SpeculaServer(*KV, *args, api_key=API_KEY)
    srv.model = Path(extra_model_path("qwen05"))
    return srv.start()


@pytest.fixture(scope="module")
def qwen():
    srv = _start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def qwen_spec_async():
    srv = _start("--speculative-method", "ngram", "--async-scheduling")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module", autouse=True)
def transcript():
    yield
    path = os.environ.get("SPECULA_AGENT_TRANSCRIPT")
    if path and TRANSCRIPT:
        Path(path).write_text("\n".join(TRANSCRIPT) + "\n")


def claude(srv, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.base_url, api_key=kw.pop("api_key", API_KEY), max_retries=0, timeout=120.0, **kw)


def gpt(srv) -> openai.OpenAI:
    return srv.client()


# ---------------------------------------------------------------------------------------------
# Anthropic Messages
# ---------------------------------------------------------------------------------------------

HELLO = [{"role": "user", "content": "Write a Python function that adds two numbers."}]


def test_anthropic_create_and_stream_agree(qwen):
    c = claude(qwen)
    msg = c.messages.create(model=qwen.model_name, max_tokens=40, extra_body=GREEDY, system="You are a terse coder.", messages=HELLO)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text.strip()
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.output_tokens <= 40 and msg.usage.input_tokens > 0
    with c.messages.stream(model=qwen.model_name, max_tokens=40, extra_body=GREEDY, system="You are a terse coder.", messages=HELLO) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == msg.content[0].text
    assert final.content[0].text == streamed and final.stop_reason == msg.stop_reason
    assert final.usage.output_tokens == msg.usage.output_tokens


def test_anthropic_stop_sequence_is_reported(qwen):
    c = claude(qwen)
    free = c.messages.create(model=qwen.model_name, max_tokens=30, extra_body=GREEDY, messages=HELLO).content[0].text
    stop = free.strip().split()[1]  # a word the greedy answer contains
    msg = c.messages.create(model=qwen.model_name, max_tokens=30, extra_body=GREEDY, messages=HELLO, stop_sequences=[stop])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop, (free, msg)
    assert free.startswith(msg.content[0].text if msg.content else "")


def test_anthropic_tool_round_trip(qwen):
    c = claude(qwen)
    question = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    first = c.messages.create(model=qwen.model_name, max_tokens=128, extra_body=GREEDY, messages=question,
                              tools=[ANTHROPIC_WEATHER], tool_choice={"type": "any"})
    assert first.stop_reason == "tool_use", first
    uses = [b for b in first.content if b.type == "tool_use"]
    assert len(uses) >= 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER_SCHEMA)
    result = f"It is 18 degrees celsius and sunny in {uses[0].input['city']}."
    follow = question + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": result}]},
    ]
    # the tiny model answers in text once the result is in (without tools offered, it cannot call again)
    second = c.messages.create(model=qwen.model_name, max_tokens=64, extra_body=GREEDY, messages=follow)
    answer = "".join(b.text for b in second.content if b.type == "text")
    assert second.stop_reason in ("end_turn", "max_tokens") and answer.strip(), second
    TRANSCRIPT.extend([
        "== anthropic SDK tool round trip (POST /v1/messages) ==",
        f"user: {question[0]['content']}",
        f"assistant: tool_use {uses[0].name}({json.dumps(uses[0].input)}) id={uses[0].id} stop_reason={first.stop_reason}",
        f"user: tool_result -> {result}",
        f"assistant: {answer.strip()} (stop_reason={second.stop_reason}, usage={second.usage.input_tokens}+{second.usage.output_tokens})",
        "",
    ])


def test_anthropic_streamed_tool_use_reassembles(qwen):
    c = claude(qwen)
    kw = dict(model=qwen.model_name, max_tokens=128, extra_body=GREEDY, tools=[ANTHROPIC_WEATHER], tool_choice={"type": "any"},
              messages=[{"role": "user", "content": "Weather in Tokyo, in fahrenheit?"}])
    whole = c.messages.create(**kw)
    with c.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in final.content] == \
        [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in whole.content]
    assert final.stop_reason == "tool_use"


def test_anthropic_count_tokens_matches_tokenize(qwen):
    c = claude(qwen)
    counted = c.messages.count_tokens(model=qwen.model_name, system="Be brief.", messages=HELLO)
    with qwen.http() as h:
        r = h.post("/tokenize", json={"model": qwen.model_name, "messages": [{"role": "system", "content": "Be brief."}, *HELLO]})
        r.raise_for_status()
    assert counted.input_tokens == r.json()["count"]
    msg = c.messages.create(model=qwen.model_name, max_tokens=1, system="Be brief.", messages=HELLO)
    # Anthropic counts the prompt tokens read from a cache apart from input_tokens
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == counted.input_tokens


def test_usage_counts_the_prompt_tokens_served_from_the_prefix_cache(qwen):
    """Each API's usage says how much of the prompt the prefix cache served, as each SDK reads it
    (OpenAI `prompt_tokens_details.cached_tokens`, Responses `input_tokens_details.cached_tokens`,
    Anthropic `cache_read_input_tokens` beside `input_tokens`), streamed or not; checked against
    the server's own prefix-cache hit counter at `/metrics`."""
    system = f"Session {os.urandom(8).hex()}. You review Python code in a large repository. " + " ".join(
        f"Rule {i}: keep function number {i} short, typed and tested." for i in range(12))
    msgs = [{"role": "system", "content": system}, *HELLO]
    g, c = gpt(qwen), claude(qwen)

    def hits() -> float:
        return qwen.wait_idle()["specula:prefix_cache_hits"]

    before = hits()
    first = g.chat.completions.create(model=qwen.model_name, messages=msgs, max_tokens=2, temperature=0)
    prompt = first.usage.prompt_tokens
    assert prompt > 100 and first.usage.prompt_tokens_details.cached_tokens == 0, first.usage
    assert hits() == before, "a prompt that starts with a fresh nonce found nothing in the cache"
    # the whole prompt but its last token (computed for the logits), in full blocks of 16
    expect = (prompt - 1) // 16 * 16
    seen = []
    before = hits()
    seen.append(("chat", g.chat.completions.create(model=qwen.model_name, messages=msgs, max_tokens=2, temperature=0)
                 .usage.prompt_tokens_details.cached_tokens))
    assert hits() - before == seen[-1][1], "usage and /metrics disagree on the cache hit"
    chunks = list(g.chat.completions.create(model=qwen.model_name, messages=msgs, max_tokens=2, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    seen.append(("chat stream", chunks[-1].usage.prompt_tokens_details.cached_tokens))
    r = g.responses.create(model=qwen.model_name, instructions=system, input=HELLO[0]["content"], max_output_tokens=2, temperature=0)
    assert r.usage.input_tokens == prompt
    seen.append(("responses", r.usage.input_tokens_details.cached_tokens))
    done = [e for e in g.responses.create(model=qwen.model_name, instructions=system, input=HELLO[0]["content"],
                                          max_output_tokens=2, temperature=0, stream=True) if e.type in ("response.completed", "response.incomplete")]
    seen.append(("responses stream", done[-1].response.usage.input_tokens_details.cached_tokens))
    m = c.messages.create(model=qwen.model_name, max_tokens=2, extra_body=GREEDY, system=system, messages=HELLO)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == prompt, m.usage
    seen.append(("messages", m.usage.cache_read_input_tokens))
    with c.messages.stream(model=qwen.model_name, max_tokens=2, extra_body=GREEDY, system=system, messages=HELLO) as st:
        final = st.get_final_message()
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == prompt, final.usage
    seen.append(("messages stream", final.usage.cache_read_input_tokens))
    assert all(cached == expect for _, cached in seen), (expect, seen)


def test_anthropic_errors_raise_the_sdks_exceptions(qwen):
    with pytest.raises(anthropic.AuthenticationError) as e:
        claude(qwen, api_key="sk-wrong").messages.create(model=qwen.model_name, max_tokens=4, messages=HELLO)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    c = claude(qwen)
    # an agent's own model name (Claude Code sends claude-* names) is served by the loaded model
    served = c.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=HELLO)
    assert served.model == qwen.model_name and served.content
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=qwen.model_name, max_tokens=4, messages=HELLO, extra_body={"temperature": -1})
    assert e.value.body["error"]["type"] == "invalid_request_error" and "temperature" in e.value.message
    with pytest.raises(anthropic.BadRequestError):
        c.messages.create(model=qwen.model_name, max_tokens=4, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}])


# ---------------------------------------------------------------------------------------------
# OpenAI Responses
# ---------------------------------------------------------------------------------------------


def test_responses_create_and_stream_agree(qwen):
    c = gpt(qwen)
    r = c.responses.create(model=qwen.model_name, input="Write a Python function that adds two numbers.",
                           instructions="You are a terse coder.", max_output_tokens=40, temperature=0)
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.output_text.strip()
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    events = list(c.responses.create(model=qwen.model_name, input="Write a Python function that adds two numbers.",
                                     instructions="You are a terse coder.", max_output_tokens=40, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == ("response.completed" if r.status == "completed" else "response.incomplete")
    for k in ("response.output_item.added", "response.content_part.added", "response.output_text.delta",
              "response.output_text.done", "response.content_part.done", "response.output_item.done"):
        assert k in kinds, (k, kinds)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == events[-1].response.output_text


def test_responses_function_call_round_trip(qwen):
    c = gpt(qwen)
    question = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    r = c.responses.create(model=qwen.model_name, input=question, tools=[RESPONSES_WEATHER], tool_choice="required",
                           max_output_tokens=128, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_SCHEMA)
    outputs = [{"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees celsius, sunny"} for call in calls]
    follow = c.responses.create(model=qwen.model_name, input=question + [o.model_dump(exclude_none=True) for o in r.output] + outputs,
                                tools=[RESPONSES_WEATHER], max_output_tokens=64, temperature=0)
    assert follow.output_text.strip(), follow
    # streamed, the arguments arrive in deltas that add up to the call
    events = list(c.responses.create(model=qwen.model_name, input=question, tools=[RESPONSES_WEATHER], tool_choice="required",
                                     max_output_tokens=128, temperature=0, stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and args.startswith(done[0].arguments) and done[0].arguments == calls[0].arguments


def test_responses_json_schema_format(qwen):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "year": {"type": "integer"}},
              "required": ["name", "year"], "additionalProperties": False}
    r = gpt(qwen).responses.create(model=qwen.model_name, input="Name a programming language and the year it appeared.",
                                   text={"format": {"type": "json_schema", "name": "language", "schema": schema, "strict": True}},
                                   max_output_tokens=64, temperature=0)
    jsonschema.validate(json.loads(r.output_text), schema)


def test_responses_previous_response_id_and_retrieve(qwen):
    c = gpt(qwen)
    first = c.responses.create(model=qwen.model_name, input="My name is Ada. Reply with OK.", max_output_tokens=8, temperature=0)
    got = c.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    second = c.responses.create(model=qwen.model_name, input="What is my name? Answer with the name only.",
                                previous_response_id=first.id, max_output_tokens=8, temperature=0)
    assert "Ada" in second.output_text, second.output_text
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve("resp_does_not_exist")
    with pytest.raises(openai.BadRequestError):
        c.responses.create(model=qwen.model_name, input="x", previous_response_id="resp_does_not_exist")


# ---------------------------------------------------------------------------------------------
# The OpenAI Agents SDK, end to end
# ---------------------------------------------------------------------------------------------


def test_agents_sdk_runs_a_tool_round_trip(qwen):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    seen = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        seen.append(city)
        return f"It is 18 degrees celsius and sunny in {city}."

    model = OpenAIResponsesModel(model=qwen.model_name, openai_client=qwen.async_client())
    agent = Agent(name="weather", instructions="Answer weather questions with the get_weather tool.", tools=[get_weather],
                  model=model, model_settings=ModelSettings(temperature=0, tool_choice="required", parallel_tool_calls=False, max_tokens=200))
    result = Runner.run_sync(agent, "What is the weather like in Paris today?", max_turns=4)
    assert seen, "the agent called the tool"
    assert isinstance(result.final_output, str) and result.final_output.strip()
    kinds = [item.type for item in result.new_items]
    assert "tool_call_item" in kinds and "tool_call_output_item" in kinds and kinds[-1] == "message_output_item", kinds
    TRANSCRIPT.extend(["== OpenAI Agents SDK run (Runner.run_sync, OpenAIResponsesModel -> POST /v1/responses) =="])
    for item in result.new_items:
        raw = item.raw_item
        if item.type == "tool_call_item":
            TRANSCRIPT.append(f"tool call: {raw.name}({raw.arguments}) call_id={raw.call_id}")
        elif item.type == "tool_call_output_item":
            TRANSCRIPT.append(f"tool output: {item.output}")
        elif item.type == "message_output_item":
            TRANSCRIPT.append(f"assistant: {''.join(c.text for c in raw.content if c.type == 'output_text').strip()}")
    TRANSCRIPT.append(f"final_output: {result.final_output.strip()}")
    TRANSCRIPT.append("")


# ---------------------------------------------------------------------------------------------
# One engine, three dialects
# ---------------------------------------------------------------------------------------------

SYSTEM = "You are a careful Python programmer."
TASK = "Rewrite this function to use a list comprehension:\n\ndef squares(xs):\n    out = []\n    for x in xs:\n        out.append(x * x)\n    return out\n"


def three_texts(srv, max_tokens=48):
    chat = gpt(srv).chat.completions.create(model=srv.model_name, max_tokens=max_tokens, temperature=0,
                                           messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}])
    msg = claude(srv).messages.create(model=srv.model_name, max_tokens=max_tokens, extra_body=GREEDY, system=SYSTEM,
                                      messages=[{"role": "user", "content": TASK}])
    resp = gpt(srv).responses.create(model=srv.model_name, max_output_tokens=max_tokens, temperature=0, instructions=SYSTEM, input=TASK)
    return chat.choices[0].message.content, msg.content[0].text, resp.output_text


def test_the_three_dialects_give_the_same_greedy_text(qwen):
    chat, messages, responses = three_texts(qwen)
    assert chat.strip()
    assert messages == chat
    assert responses == chat


def test_the_three_dialects_agree_under_ngram_and_async_scheduling(qwen, qwen_spec_async):
    plain = three_texts(qwen)
    spec = three_texts(qwen_spec_async)
    assert spec[0] == spec[1] == spec[2]
    assert spec == plain, "speculation and async scheduling change no token"
