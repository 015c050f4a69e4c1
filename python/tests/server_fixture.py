"""Starts the real `specula serve` binary for the OpenAI-client tests, plus the oracles they compare with.

Configuration (environment):
    SPECULA_BIN    the binary (default: <repo>/target/release/specula; build it with
                   `cargo build --release -p specula`)
    SPECULA_MODEL  the GGUF to serve (default: SmolLM2-135M-Instruct.Q4_1.gguf looked up in
                   $SPECULA_CACHE, ~/.cache/specula, /tmp/specula-cache)
    CI             when set, a missing binary or model fails the tests instead of skipping them

Each test module builds the servers it needs with `server_fixture(...)`: one process per
configuration, module-scoped, bound to 127.0.0.1 on a free port, waited for on GET /health and
always stopped (SIGTERM, then SIGKILL) in teardown.

Oracles:
    tokenize(texts)           token ids from python/tokenizer_oracle.py (an independent tokenizer
                              built from the GGUF; its packages missing is an error, not a fallback)
    chat_prompt(messages)     the GGUF's chat template rendered with jinja2 the way transformers'
                              apply_chat_template does (add_generation_prompt=True)
    debug_logits(prompts)     the engine's own logits at every position (`specula debug logits`)
    log_softmax(x)            float64 log-softmax over the last axis
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:  # the `openai` package depends on httpx (or, in its newest releases, on its successor httpx2)
    import httpx
except ImportError:  # pragma: no cover - depends on the installed openai
    import httpx2 as httpx
import numpy as np
import pytest

from conftest import missing

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
HOST = "127.0.0.1"


# ---------------------------------------------------------------------------------------------
# Where the binary and the model are
# ---------------------------------------------------------------------------------------------


def binary_path() -> Path:
    return Path(os.environ.get("SPECULA_BIN") or REPO / "target" / "release" / "specula")


def model_path() -> Path | None:
    env = os.environ.get("SPECULA_MODEL")
    if env:
        return Path(env)
    dirs = [os.environ.get("SPECULA_CACHE"), Path.home() / ".cache" / "specula", "/tmp/specula-cache"]
    for d in dirs:
        if d and (Path(d) / DEFAULT_MODEL_FILE).is_file():
            return Path(d) / DEFAULT_MODEL_FILE
    return None


def require_binary_and_model() -> tuple[Path, Path]:
    binary = binary_path()
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        missing(f"specula binary not found at {binary}: build it with `cargo build --release -p specula` or set SPECULA_BIN")
    model = model_path()
    if model is None or not model.is_file():
        missing(
            f"model not found ({model or DEFAULT_MODEL_FILE + ' in the caches'}): run `specula fetch-model` or set SPECULA_MODEL"
        )
    return binary, model


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# The server process
# ---------------------------------------------------------------------------------------------


class SpeculaServer:
    """One `specula serve` process. `args` are extra flags (e.g. "--max-model-len", "64")."""

    def __init__(self, *args: str, api_key: str | None = None, threads: int = 2):
        self.binary, self.model = require_binary_and_model()
        self.args = list(args)
        self.api_key = api_key
        self.threads = threads
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self._log = None
        self.model_name: str | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def command(self) -> list[str]:
        cmd = [str(self.binary), "serve", "--model", str(self.model), "--host", HOST, "--port", str(self.port),
               "--threads", str(self.threads), *self.args]
        if not any(a.startswith("--speculative-method") for a in self.args):
            # the server speculates (n-gram) by default; a test's baseline is the plain engine
            cmd += ["--speculative-method", "none"]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        return cmd

    def start(self, timeout: float = 90.0) -> "SpeculaServer":
        last_err = None
        for _attempt in range(3):  # a free port can be taken between probe and bind; retry then
            self.port = free_port()
            self._log = tempfile.NamedTemporaryFile(prefix="specula-serve-", suffix=".log", delete=False)
            env = dict(os.environ)
            env.pop("SPECULA_API_KEY", None)  # only --api-key decides auth here
            self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env)
            try:
                self._wait_healthy(timeout)
                self.model_name = self.http().get("/v1/models").json()["data"][0]["id"]
                return self
            except RuntimeError as e:
                last_err = e
                self.stop()
                if "cannot listen" not in self.log_tail():
                    break
        raise RuntimeError(f"specula serve did not come up: {last_err}\n--- server log ---\n{self.log_tail()}")

    def _wait_healthy(self, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited early with code {self.proc.returncode}")
            try:
                if httpx.get(self.url("/health"), timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"no 200 from /health within {timeout:.0f}s")

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, wait, then SIGKILL; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._log is not None:
            self._log.close()
        return self.proc.returncode

    def log_tail(self, n: int = 4000) -> str:
        if self._log is None:
            return ""
        try:
            return Path(self._log.name).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    # -- clients -------------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw):
        """The official OpenAI client, no retries (a retry would hide a 5xx)."""
        import openai

        kw.setdefault("timeout", 120.0)
        kw.setdefault("max_retries", 0)
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=self.api_key or "unused", **kw)

    def async_client(self, **kw):
        import openai

        kw.setdefault("timeout", 120.0)
        kw.setdefault("max_retries", 0)
        return openai.AsyncOpenAI(base_url=self.base_url + "/v1", api_key=self.api_key or "unused", **kw)

    def http(self, **kw) -> httpx.Client:
        kw.setdefault("timeout", 120.0)
        return httpx.Client(base_url=self.base_url, headers=self.headers(), **kw)

    # -- metrics -------------------------------------------------------------------------------

    def metrics_text(self) -> str:
        r = httpx.get(self.url("/metrics"), timeout=10.0)
        r.raise_for_status()
        return r.text

    def metrics(self) -> dict[str, float]:
        return parse_prometheus(self.metrics_text())

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Polls /metrics until nothing runs or waits and the KV pool is whole again; returns the
        last sample (the caller asserts on it, so a timeout shows the numbers)."""
        deadline = time.monotonic() + timeout
        m = self.metrics()
        while time.monotonic() < deadline:
            if (m.get("specula:kv_cache_usage_perc") == 0 and m.get("specula:num_requests_running") == 0
                    and m.get("specula:num_requests_waiting") == 0):
                return m
            time.sleep(0.1)
            m = self.metrics()
        return m


def parse_prometheus(text: str) -> dict[str, float]:
    """`name{labels} value` lines -> {"name{labels}": value}; comments skipped."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^(\S+?(?:\{.*\})?)\s+(\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def greedy_chat(server, prompt: str, max_tokens: int = 40, **extra) -> dict:
    """The first choice of a greedy chat completion of one user message, with logprobs."""
    r = server.http().post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                                                          "temperature": 0, "logprobs": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def chat_outputs(server, prompts: list[str]) -> list:
    """Per prompt, what a speculative run must reproduce: tokens, content, reasoning, finish reason."""
    out = []
    for p in prompts:
        c = greedy_chat(server, p)
        out.append(([t["token"] for t in c["logprobs"]["content"]], c["message"].get("content"),
                    c["message"].get("reasoning_content"), c["finish_reason"]))
    return out


def assert_drafted(server) -> None:
    """Fails unless the server's speculation drafted something: an exactness test whose
    speculation drafted nothing tests nothing."""
    m = parse_prometheus(server.http().get("/metrics").text)
    assert m.get("specula:spec_decode_num_draft_tokens", 0) > 0, "speculation drafted nothing: the test does not test it"


def server_fixture(*args: str, api_key: str | None = None, threads: int = 2):
    """A module-scoped pytest fixture that yields a started SpeculaServer with these flags."""

    @pytest.fixture(scope="module")
    def _server():
        srv = SpeculaServer(*args, api_key=api_key, threads=threads)
        srv.start()
        try:
            yield srv
        finally:
            srv.stop()

    return _server


@contextlib.contextmanager
def running_server(*args: str, api_key: str | None = None, threads: int = 2):
    srv = SpeculaServer(*args, api_key=api_key, threads=threads).start()
    try:
        yield srv
    finally:
        srv.stop()


# ---------------------------------------------------------------------------------------------
# Oracles
# ---------------------------------------------------------------------------------------------


def _oracle_module():
    """python/tokenizer_oracle.py, an independent tokenizer built from the GGUF. Its import
    failing is a broken test setup, never a reason to compare the engine with itself."""
    sys.path.insert(0, str(REPO / "python"))
    try:
        import tokenizer_oracle  # noqa: PLC0415

        return tokenizer_oracle
    finally:
        sys.path.pop(0)


def tokenize(texts: list[str], model: Path | None = None) -> list[list[int]]:
    """Plain encode (no BOS, special-token strings matched) of each text, by the oracle."""
    _, default_model = require_binary_and_model()
    model = model or default_model
    oracle = _oracle_module()
    return [oracle.encode(str(model), t) for t in texts]


@functools.lru_cache(maxsize=2)
def gguf_reader(model: str):
    from gguf import GGUFReader

    return GGUFReader(model)


@functools.lru_cache(maxsize=2)
def _gguf_template(model: str) -> tuple[str, str, str]:
    r = gguf_reader(model)

    def field(key):
        f = r.fields.get(key)
        return None if f is None else f.parts[f.data[0]]

    tmpl = field("tokenizer.chat_template")
    if tmpl is None:
        raise LookupError("the model has no tokenizer.chat_template")
    tokens = r.fields["tokenizer.ggml.tokens"]
    tok = lambda key: (lambda v: "" if v is None else bytes(tokens.parts[tokens.data[int(v[0])]]).decode())(field(key))  # noqa: E731
    return bytes(tmpl).decode(), tok("tokenizer.ggml.bos_token_id"), tok("tokenizer.ggml.eos_token_id")


def chat_prompt(messages: list[dict], model: Path | None = None) -> str:
    """The conversation rendered like transformers' apply_chat_template(add_generation_prompt=True)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    model = model or require_binary_and_model()[1]
    source, bos, eos = _gguf_template(str(model))

    def raise_exception(msg):
        raise jinja2.exceptions.TemplateError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source).render(messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos)


def debug_logits(prompts: list[list[int]], model: Path | None = None) -> list[np.ndarray]:
    """The engine's logits at every position of each prompt: one [len, vocab] float32 array each."""
    binary, default_model = require_binary_and_model()
    model = model or default_model
    with tempfile.TemporaryDirectory() as d:
        inp, out = Path(d) / "in.json", Path(d) / "out.bin"
        inp.write_text(json.dumps({"prompts": prompts}))
        subprocess.run([str(binary), "debug", "logits", "--model", str(model), "--input", str(inp), "--output", str(out),
                        "--threads", "2"], check=True, capture_output=True, timeout=300)
        flat = np.fromfile(out, dtype="<f4")
    total = sum(len(p) for p in prompts)
    assert flat.size % total == 0, f"{flat.size} floats for {total} positions"
    vocab = flat.size // total
    arrays, at = [], 0
    for p in prompts:
        arrays.append(flat[at * vocab:(at + len(p)) * vocab].reshape(len(p), vocab))
        at += len(p)
    return arrays


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


# ---------------------------------------------------------------------------------------------
# SSE by hand (for tests that need the raw stream: framing, disconnects, shutdown)
# ---------------------------------------------------------------------------------------------


def sse_events(response: httpx.Response):
    """Yields each `data:` payload of an SSE response as a string, in order."""
    data = []
    for line in response.iter_lines():
        if line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
        elif line == "" and data:
            yield "\n".join(data)
            data = []
    if data:
        yield "\n".join(data)
