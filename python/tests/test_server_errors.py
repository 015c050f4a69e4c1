"""Bad requests against the real server (started with --max-model-len 64 and --api-key): each gets
an OpenAI error object {"error": {"message", "type", "param", "code"}} with the right 4xx status,
and the server keeps answering normal requests."""

from __future__ import annotations

import json

import openai
import pytest

from server_fixture import httpx, server_fixture

API_KEY = "sk-specula-test-key"
MAX_MODEL_LEN = 64

server = server_fixture("--max-model-len", str(MAX_MODEL_LEN), api_key=API_KEY)

LONG = " ".join(["The quick brown fox jumps over the lazy dog."] * 12)  # ~120 tokens
MSG = [{"role": "user", "content": "Hi"}]

# (id, path, json body or raw bytes, status, param, code)
CASES = [
    ("malformed_json", "/v1/completions", b'{"prompt": "hi", "max_tokens": ', 400, None, None),
    ("trailing_garbage", "/v1/completions", b'{"prompt": "hi"} {}', 400, None, None),
    ("not_an_object", "/v1/chat/completions", b"[1, 2, 3]", 400, None, None),
    ("positional_array", "/v1/completions", b'[null, "hi"]', 400, None, None),
    ("empty_body", "/v1/completions", b"", 400, None, None),
    ("wrong_type_temperature", "/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature", None),
    ("wrong_type_max_tokens", "/v1/chat/completions", {"messages": MSG, "max_tokens": "ten"}, 400, "max_tokens", None),
    ("wrong_type_messages", "/v1/chat/completions", {"messages": "Hi"}, 400, "messages", None),
    ("wrong_type_prompt", "/v1/completions", {"prompt": 3}, 400, "prompt", None),
    ("unknown_model_completions", "/v1/completions", {"model": "gpt-4o", "prompt": "hi"}, 404, "model", "model_not_found"),
    ("unknown_model_chat", "/v1/chat/completions", {"model": "gpt-4o", "messages": MSG}, 404, "model", "model_not_found"),
    ("missing_prompt", "/v1/completions", {"max_tokens": 2}, 400, "prompt", None),
    ("empty_prompt", "/v1/completions", {"prompt": ""}, 400, "prompt", None),
    ("empty_prompt_list", "/v1/completions", {"prompt": []}, 400, "prompt", None),
    ("empty_messages", "/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("prompt_over_max_model_len", "/v1/completions", {"prompt": LONG, "max_tokens": 1}, 400, "prompt", None),
    ("chat_over_max_model_len", "/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}], "max_tokens": 1},
     400, "messages", None),
    ("token_prompt_over_max_model_len", "/v1/completions", {"prompt": [1] * (MAX_MODEL_LEN + 1), "max_tokens": 1},
     400, "prompt", None),
    ("token_out_of_vocab", "/v1/completions", {"prompt": [10_000_000], "max_tokens": 1}, 400, "prompt", None),
    ("max_tokens_0", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    ("max_tokens_negative", "/v1/chat/completions", {"messages": MSG, "max_tokens": -5}, 400, "max_tokens", None),
    ("max_tokens_too_large", "/v1/completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens", None),
    ("max_completion_tokens_too_large", "/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 10_000},
     400, "max_completion_tokens", None),
    ("temperature_negative", "/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", None),
    ("top_p_zero", "/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", None),
    ("top_p_above_one", "/v1/chat/completions", {"messages": MSG, "top_p": 1.5}, 400, "top_p", None),
    ("top_logprobs_21", "/v1/chat/completions", {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
    ("top_logprobs_without_logprobs", "/v1/chat/completions", {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs", None),
    ("logprobs_21", "/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs", None),
    ("n_too_large", "/v1/completions", {"prompt": "hi", "n": 1000}, 400, "n", None),
    ("n_zero", "/v1/chat/completions", {"messages": MSG, "n": 0}, 400, "n", None),
    ("image_content", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
     400, "messages[0].content[0].type", None),
    ("body_over_limit", "/v1/completions", {"prompt": "x" * (5 * 1024 * 1024)}, 413, None, "payload_too_large"),
]


def assert_error_object(r, status: int, param=..., code=...):
    assert r.status_code == status, f"{r.status_code}: {r.text[:500]}"
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and len(err["message"]) > 10, err
    assert isinstance(err["type"], str) and err["type"], err
    if status < 500:
        assert err["type"] == "invalid_request_error", err
    if param is not ...:
        assert err["param"] == param, err
    if code is not ...:
        assert err["code"] == code, err
    return err


def assert_still_serving(server):
    c = server.client()
    r = c.completions.create(model=server.model_name, prompt="Hello", max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2


@pytest.mark.parametrize("name,path,body,status,param,code", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_openai_error(server, name, path, body, status, param, code):
    with server.http() as http:
        if isinstance(body, bytes):
            r = http.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            r = http.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    err = assert_error_object(r, status, param, code if code is not None else ...)
    if name == "prompt_over_max_model_len":
        assert str(MAX_MODEL_LEN) in err["message"]
    assert_still_serving(server)


def test_openai_client_sees_typed_errors(server):
    c = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=server.model_name, prompt="hi", temperature=-1)
    assert e.value.status_code == 400 and e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=server.model_name, messages=MSG, top_p=1.5)
    assert e.value.param == "top_p"
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="no-such-model", messages=MSG)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=server.model_name, prompt=LONG, max_tokens=1, stream=True)
    assert e.value.param == "prompt"
    assert_still_serving(server)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key"}, {"Authorization": API_KEY},
                                     {"Authorization": f"Basic {API_KEY}"}], ids=["missing", "wrong", "no_scheme", "basic"])
@pytest.mark.parametrize("method,path", [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")])
def test_api_key_required(server, headers, method, path):
    body = {"prompt": "hi", "max_tokens": 1} if "completions" in path else None
    r = httpx.request(method, server.url(path), json=body, headers=headers, timeout=30)
    err = assert_error_object(r, 401, None, "invalid_api_key")
    assert API_KEY not in err["message"]
    assert r.headers.get("www-authenticate", "").lower().startswith("bearer")


def test_openai_client_with_wrong_key(server):
    import openai as oa

    bad = oa.OpenAI(base_url=server.base_url + "/v1", api_key="nope", max_retries=0, timeout=30)
    with pytest.raises(oa.AuthenticationError):
        bad.completions.create(model=server.model_name, prompt="hi", max_tokens=1)
    assert_still_serving(server)


def test_health_and_metrics_need_no_key(server):
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200
    assert httpx.get(server.url("/metrics"), timeout=10).status_code == 200


def test_unknown_route_and_method(server):
    with server.http() as http:
        assert_error_object(http.get("/v1/nothing-here"), 404, None, "not_found")
        assert_error_object(http.get("/v1/completions"), 405, None, "method_not_allowed")
        assert_error_object(http.get(f"/v1/models/not-{server.model_name}"), 404, "model", "model_not_found")


def test_max_tokens_up_to_the_limit_is_accepted(server):
    """The boundary: prompt + max_tokens == --max-model-len is fine."""
    c = server.client()
    r = c.completions.create(model=server.model_name, prompt="Hello", max_tokens=1, temperature=0)
    room = MAX_MODEL_LEN - r.usage.prompt_tokens
    r = c.completions.create(model=server.model_name, prompt="Hello", max_tokens=room, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == room and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=server.model_name, prompt="Hello", max_tokens=room + 1)


def test_errors_leave_no_blocks_behind(server):
    m = server.wait_idle()
    assert m["specula:kv_cache_usage_perc"] == 0
    assert m["specula:num_requests_running"] == 0
