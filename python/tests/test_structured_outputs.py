"""Structured outputs of the real `specula serve`, through the official `openai` client:
`response_format` (json_object, json_schema, pydantic models with `chat.completions.parse`) and
vLLM's `structured_outputs` / `guided_*` on both endpoints, answers checked with independent
validators (`jsonschema`, Python's `re`), 400s for invalid constraints, and greedy outputs
identical with and without n-gram speculation and async scheduling. On the default model and on
Qwen2.5-Coder-0.5B-Instruct (SPECULA_MODEL_QWEN05, default ~/.cache/specula/...)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel

from conftest import missing
from server_fixture import SpeculaServer

QWEN05_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"

CONFIGS = {
    "plain": [],
    "ngram": ["--speculative-method", "ngram", "--num-speculative-tokens", "3"],
    "async": ["--async-scheduling"],
    "ngram+async": ["--speculative-method", "ngram", "--num-speculative-tokens", "3", "--async-scheduling"],
    "no-jump-forward": ["--structured-jump-forward=false"],
}


def qwen05_path() -> Path | None:
    env = os.environ.get("SPECULA_MODEL_QWEN05")
    if env:
        return Path(env)
    for d in [os.environ.get("SPECULA_CACHE"), Path.home() / ".cache" / "specula", Path.home() / ".cache" / "specula" / "models"]:
        if d and (Path(d) / QWEN05_FILE).is_file():
            return Path(d) / QWEN05_FILE
    return None


_servers: dict[tuple[str, str], SpeculaServer] = {}


def get_server(model: str, config: str) -> SpeculaServer:
    """One server per (model, config), started on first use and stopped at the end of the module."""
    key = (model, config)
    if key not in _servers:
        srv = SpeculaServer(*CONFIGS[config])
        if model == "qwen05":
            p = qwen05_path()
            if p is None or not p.is_file():
                missing("Qwen2.5-Coder-0.5B not found: set SPECULA_MODEL_QWEN05")
            srv.model = p
        _servers[key] = srv.start()
    return _servers[key]


@pytest.fixture(scope="module", autouse=True)
def _stop_servers():
    yield
    for srv in _servers.values():
        srv.stop()
    _servers.clear()


MODELS = ["default", "qwen05"]


class Person(BaseModel):
    name: str
    age: int
    city: Literal["Paris", "Rome", "Oslo"]


PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}

PHONE = r"\(\d{3}\) \d{3}-\d{4}"


def chat(srv, messages, **kw):
    return srv.client().chat.completions.create(model=srv.model_name, messages=messages, temperature=0, **kw)


@pytest.mark.parametrize("model", MODELS)
def test_parse_with_a_pydantic_model(model):
    srv = get_server(model, "plain")
    client = srv.client()
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    r = parse(
        model=srv.model_name,
        messages=[{"role": "user", "content": "Describe Alice, 31 years old, who lives in Rome."}],
        response_format=Person,
        temperature=0,
        max_tokens=80,
    )
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop", msg.content
    assert isinstance(msg.parsed, Person), msg.content
    jsonschema.validate(json.loads(msg.content), Person.model_json_schema())


@pytest.mark.parametrize("model", MODELS)
def test_json_schema_and_json_object_answers_validate(model):
    srv = get_server(model, "plain")
    r = chat(
        srv,
        [{"role": "user", "content": "Give a person with a name, an age and hobbies as JSON."}],
        max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}},
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON_SCHEMA)
    r = chat(srv, [{"role": "user", "content": "Describe a cat as a JSON object."}], max_tokens=120, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert r.choices[0].message.content.startswith("{")
    # text: no constraint at all
    r = chat(srv, [{"role": "user", "content": "Hi"}], max_tokens=4, response_format={"type": "text"})
    assert r.choices[0].message.content


@pytest.mark.parametrize("model", MODELS)
def test_vllm_structured_outputs_on_both_endpoints(model):
    srv = get_server(model, "plain")
    client = srv.client()
    r = chat(srv, [{"role": "user", "content": "Give me a phone number."}], max_tokens=30, extra_body={"structured_outputs": {"regex": PHONE}})
    assert re.fullmatch(PHONE, r.choices[0].message.content), r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    r = chat(srv, [{"role": "user", "content": "Is water wet?"}], max_tokens=10, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.completions.create(
        model=srv.model_name, prompt="My favourite colour is", max_tokens=10, temperature=0, extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}}
    )
    assert r.choices[0].text in ("red", "green", "blue") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(
        model=srv.model_name, prompt="Call me at", max_tokens=30, temperature=0, extra_body={"guided_regex": PHONE}
    )
    assert re.fullmatch(PHONE, r.choices[0].text), r.choices[0].text
    grammar = 'start: "x = " NUM " + " NUM\nNUM: /[0-9]{1,3}/'
    r = client.completions.create(model=srv.model_name, prompt="Some arithmetic:", max_tokens=20, temperature=0, extra_body={"structured_outputs": {"grammar": grammar}})
    assert re.fullmatch(r"x = [0-9]{1,3} \+ [0-9]{1,3}", r.choices[0].text), r.choices[0].text
    r = client.completions.create(
        model=srv.model_name, prompt="A person as JSON:", max_tokens=120, temperature=0, extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON_SCHEMA}}}
    )
    if r.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(r.choices[0].text), PERSON_SCHEMA)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, None),
    ],
)
def test_invalid_constraints_are_400_naming_the_field(body, param):
    srv = get_server("default", "plain")
    for path, base in [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}), ("/v1/completions", {"prompt": "hi"})]:
        r = srv.http().post(path, json={"model": srv.model_name, "max_tokens": 5, **base, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"], err
        if param is not None:
            assert err["param"] == param, err
    if "uniqueItems" in json.dumps(body):
        assert "uniqueItems" in err["message"], err


REQUESTS = [
    ("chat", {"messages": [{"role": "user", "content": "Give a person with a name, an age and hobbies as JSON."}], "max_tokens": 100,
              "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON_SCHEMA}}}),
    ("chat", {"messages": [{"role": "user", "content": "Repeat: 1, 2, 3, 1, 2, 3, 1, 2, 3 as a JSON object with key n."}], "max_tokens": 80,
              "response_format": {"type": "json_object"}}),
    ("chat", {"messages": [{"role": "user", "content": "Phone number please."}], "max_tokens": 30, "structured_outputs": {"regex": PHONE}}),
    ("completion", {"prompt": "The list: a, b, c, a, b, c, a, b,", "max_tokens": 30, "structured_outputs": {"regex": "( [abc],){1,12}"}}),
    ("completion", {"prompt": "Answer yes or no: is fire hot?", "max_tokens": 8, "guided_choice": ["yes", "no"]}),
]


def run_all(srv):
    out = []
    for kind, body in REQUESTS:
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        r = srv.http().post(path, json={"model": srv.model_name, "temperature": 0, **body}, timeout=300)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        out.append((c["message"]["content"] if kind == "chat" else c["text"], c["finish_reason"]))
    return out


@pytest.mark.parametrize("model", MODELS)
def test_greedy_outputs_are_the_same_with_speculation_and_async_scheduling(model):
    base = run_all(get_server(model, "plain"))
    assert re.fullmatch(PHONE, base[2][0]), base[2]
    jsonschema.validate(json.loads(base[0][0]), PERSON_SCHEMA)
    # jump-forward (on by default) drafted the grammar's forced tokens, and every one was accepted
    m = get_server(model, "plain").metrics()
    forced, accepted = m.get("specula:spec_forced_tokens_total", 0), m.get("specula:spec_forced_accepted_tokens_total", 0)
    assert forced > 0 and accepted == forced, (forced, accepted)
    configs = ["no-jump-forward", "ngram", "async", "ngram+async"] if model == "default" else ["no-jump-forward", "ngram+async"]
    for config in configs:
        assert run_all(get_server(model, config)) == base, config
    assert "specula:spec_forced_tokens_total" not in get_server(model, "no-jump-forward").metrics_text()
