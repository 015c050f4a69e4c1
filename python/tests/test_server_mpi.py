"""Serving over MPI processes: `mpirun --allow-run-as-root --oversubscribe -np 2 specula serve
--data-parallel-backend mpi` (a binary built with the cargo feature `mpi`), driven with the
official openai client. Rank 0 serves HTTP and routes; rank 1 gets its requests, aborts and the
shutdown as MPI messages and sends its events back the same way.

Checked: concurrent completions (streaming and not) give each request the same greedy text as a
single-engine server (the oracle: one engine, no MPI); both ranks did work and /metrics shows
both; a stream aborted mid-way on the remote rank frees its KV blocks there; SIGTERM to mpirun
stops every process.

Needs mpirun (Open MPI) and the MPI-enabled binary: $SPECULA_MPI_BIN, default
<repo>/target/release/specula-mpi (scripts/test.sh builds it). Skips without them, fails
when CI is set.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import missing
from server_fixture import REPO, SpeculaServer, httpx, running_server, sse_events

RANKS = 2
MAX_TOKENS = 24
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village at the edge of a great forest,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "My favourite recipe for a rainy day is",
    "In 1969, the first humans",
    "A haiku about the sea:",
]


def mpi_binary() -> Path:
    return Path(os.environ.get("SPECULA_MPI_BIN") or REPO / "target" / "release" / "specula-mpi")


class MpiServer(SpeculaServer):
    """`specula serve` as RANKS MPI processes under mpirun (one compute thread each)."""

    def __init__(self, *args: str):
        super().__init__("--data-parallel-backend", "mpi", *args, threads=1)
        if shutil.which("mpirun") is None:
            missing("mpirun not found (apt-get install openmpi-bin libopenmpi-dev)")
        binary = mpi_binary()
        if not (binary.is_file() and os.access(binary, os.X_OK)):
            missing(f"MPI-enabled specula not found at {binary}: `cargo build --release -p specula --features mpi`, "
                     "copy target/release/specula there (or set SPECULA_MPI_BIN)")
        self.binary = binary

    def command(self) -> list[str]:
        return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(RANKS), *super().command()]

    def rank_pids(self) -> list[int]:
        """The processes mpirun started (its children running our binary)."""
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                cmdline = (stat.parent / "cmdline").read_bytes()
            except OSError:
                continue
            if int(fields[1]) == self.proc.pid and str(self.binary).encode() in cmdline:
                pids.append(int(stat.parent.name))
        return pids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def by_rank(metrics: dict[str, float], name: str) -> dict[int, float]:
    return {r: metrics[f'{name}{{rank="{r}"}}'] for r in range(RANKS) if f'{name}{{rank="{r}"}}' in metrics}


@pytest.fixture(scope="module")
def single_outputs() -> list[str]:
    """The oracle: each prompt's greedy completion from one engine, no data parallelism."""
    with running_server() as srv:
        client = srv.client()
        return [client.completions.create(model=srv.model_name, prompt=p, max_tokens=MAX_TOKENS, temperature=0).choices[0].text
                for p in PROMPTS]


@pytest.fixture(scope="module")
def mpi_server():
    srv = MpiServer("--shutdown-grace-secs", "5")
    srv.start(timeout=120)
    try:
        yield srv
    finally:
        srv.stop()


def complete(srv: MpiServer, i: int) -> str:
    client = srv.client()
    if i % 2 == 0:
        return client.completions.create(model=srv.model_name, prompt=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0).choices[0].text
    stream = client.completions.create(model=srv.model_name, prompt=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0, stream=True)
    return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)


def test_concurrent_completions_equal_a_single_engine_and_use_both_ranks(mpi_server, single_outputs):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda i: complete(mpi_server, i), range(len(PROMPTS))))
    for prompt, want, have in zip(PROMPTS, single_outputs, got):
        assert have == want, f"{prompt!r}: MPI server gave {have!r}, a single engine {want!r}"
    tokens = by_rank(mpi_server.metrics(), "specula:dp_tokens_total")
    assert set(tokens) == set(range(RANKS)), tokens
    assert all(t > 0 for t in tokens.values()), f"every rank should have run tokens: {tokens}"


def test_metrics_show_every_rank(mpi_server):
    m = mpi_server.metrics()
    for name in ["specula:num_requests_running", "specula:num_requests_waiting", "specula:kv_cache_usage_perc",
                 "specula:dp_steps_total", "specula:dp_dummy_steps_total", "specula:dp_collective_seconds_total"]:
        assert set(by_rank(m, name)) == set(range(RANKS)), f"{name} per rank: {by_rank(m, name)}"
        if "total" not in name:
            assert name in m, f"the unlabeled aggregate {name} is missing"


def wait_for(srv: MpiServer, what: str, cond, timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    m = srv.metrics()
    while not cond(m):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}: " + repr({k: v for k, v in m.items() if "rank" in k and "dp_" not in k}))
        time.sleep(0.05)
        m = srv.metrics()
    return m


class Stream(threading.Thread):
    """A long greedy stream read until `stop` is set, then dropped (the client goes away)."""

    def __init__(self, srv: MpiServer, prompt: str):
        super().__init__(daemon=True)
        self.srv, self.prompt = srv, prompt
        self.chunks = 0
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self):
        body = {"prompt": self.prompt, "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with httpx.Client(timeout=60) as http, http.stream("POST", self.srv.url("/v1/completions"), json=body) as r:
                assert r.status_code == 200, r.read()
                for _ in sse_events(r):
                    self.chunks += 1
                    if self.stop.is_set():
                        return  # leaving the block closes the connection mid-stream
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


def test_a_stream_aborted_mid_way_on_the_remote_rank_frees_its_blocks(mpi_server):
    idle = lambda m: all(by_rank(m, "specula:num_requests_running").get(r) == 0 and by_rank(m, "specula:kv_cache_usage_perc").get(r) == 0
                         for r in range(RANKS))  # noqa: E731
    wait_for(mpi_server, "every rank to be idle before the test", idle)
    # two long streams: the router puts the second on the rank the first left idle
    first = Stream(mpi_server, "Abort test, first stream:")
    first.start()
    m = wait_for(mpi_server, "a rank to run the first stream", lambda m: sum(by_rank(m, "specula:num_requests_running").values()) >= 1)
    first_rank = max(range(RANKS), key=lambda r: by_rank(m, "specula:num_requests_running").get(r, 0))
    second = Stream(mpi_server, "Abort test, second stream:")
    second.start()
    m = wait_for(mpi_server, "both ranks to run a stream",
                 lambda m: by_rank(m, "specula:num_requests_running") == {0: 1, 1: 1} and by_rank(m, "specula:kv_cache_usage_perc").get(1, 0) > 0)
    remote, local = (first, second) if first_rank == 1 else (second, first)
    while remote.chunks < 5:
        time.sleep(0.02)
    remote.stop.set()
    remote.join(30)
    assert not remote.is_alive() and remote.error is None, remote.error
    wait_for(mpi_server, "rank 1 to free the aborted stream's blocks",
             lambda m: by_rank(m, "specula:num_requests_running").get(1) == 0 and by_rank(m, "specula:kv_cache_usage_perc").get(1) == 0)
    # rank 0's stream goes on, untouched by the abort on rank 1
    before = local.chunks
    time.sleep(0.5)
    assert local.is_alive() and local.chunks > before, "the other rank's stream stalled"
    local.stop.set()
    local.join(30)
    assert local.error is None, local.error
    m = wait_for(mpi_server, "every rank to be idle with its KV pool whole", idle)
    assert m["specula:num_requests_running"] == 0 and m["specula:kv_cache_usage_perc"] == 0
    # and the group still serves
    assert complete(mpi_server, 0)


def test_a_full_remote_rank_is_a_503_at_the_front_not_a_failed_stream():
    """Each rank runs one request and lets one wait (--max-num-seqs 1 --max-waiting 1). A long request
    takes rank 0; then short ones go to rank 1 (fewer outstanding tokens) until its queue is full:
    the next is refused by rank 0's router with an OpenAI 503 `overloaded`, not forwarded to rank 1
    to be failed there; everything accepted completes in full."""
    srv = MpiServer("--max-num-seqs", "1", "--max-waiting", "1")
    srv.start(timeout=120)
    try:
        def send(max_tokens):
            body = {"prompt": "Once upon a time, in a small village at the edge of a great forest,", "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}
            with srv.http() as http:
                return http.post("/v1/completions", json=body, timeout=120)

        with ThreadPoolExecutor(max_workers=8) as pool:
            long = pool.submit(send, 300)
            wait_for(srv, "rank 0 to run the long request", lambda m: by_rank(m, "specula:num_requests_running").get(0) == 1)
            short = list(pool.map(send, [4] * 6))
            responses = [long.result(), *short]
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 503}, [(r.status_code, r.text[:200]) for r in responses]
        # (rank 0 counts a request forwarded to rank 1 as waiting until its first token comes back)
        assert codes[0] == 200 and codes.count(503) >= 1 and codes.count(200) >= 2, codes
        for r, n in zip(responses, [300] + [4] * 6):
            if r.status_code == 503:
                assert r.json()["error"]["code"] == "overloaded", r.text
            else:
                assert r.json()["usage"]["completion_tokens"] == n
        idle = lambda m: all(by_rank(m, "specula:num_requests_running").get(r) == 0 and by_rank(m, "specula:num_requests_waiting").get(r) == 0
                             for r in range(RANKS))  # noqa: E731
        wait_for(srv, "every rank to be idle", idle)
    finally:
        srv.stop()


def test_sigterm_to_mpirun_stops_every_process(mpi_server):
    ranks = mpi_server.rank_pids()
    assert len(ranks) == RANKS, f"expected {RANKS} rank processes under mpirun, found {ranks}"
    mpi_server.proc.send_signal(signal.SIGTERM)
    try:
        mpi_server.proc.wait(20)
    except subprocess.TimeoutExpired:
        pytest.fail("mpirun did not exit within 20 s of SIGTERM\n" + mpi_server.log_tail())
    deadline = time.monotonic() + 5
    while any(alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in ranks), f"rank processes still running after mpirun exited: {ranks}"
    log = mpi_server.log_tail(20000)
    assert "shutting down" in log, log
    assert "panicked" not in log, log


def run_mpirun(args: list[str], timeout: float = 90) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", *args], capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"mpirun hung (no exit within {timeout:.0f} s): {e.stderr}")


def test_a_rank_that_cannot_start_stops_every_rank_with_the_reason(tmp_path):
    srv = MpiServer()  # only for the skip checks and paths
    serve = [str(srv.binary), "serve", "--data-parallel-backend", "mpi", "--threads", "1", "--port", "0"]
    missing = tmp_path / "no-such-model.gguf"
    # MPMD: rank 0 gets the real model, rank 1 a file that does not exist
    r = run_mpirun(["-np", "1", *serve, "--model", str(srv.model), ":", "-np", "1", *serve, "--model", str(missing)])
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "MPI rank 1 of 2 could not start" in out and "no-such-model" in out, out
    assert "MPI rank 0 of 2: invalid data-parallel configuration: rank(s) [1] could not start" in out, out


def test_a_size_mismatch_and_a_missing_mpirun_are_clear_errors():
    srv = MpiServer()
    serve = [str(srv.binary), "serve", "--model", str(srv.model), "--data-parallel-backend", "mpi", "--port", "0"]
    r = run_mpirun(["-np", "2", *serve, "--data-parallel-size", "3"])
    assert r.returncode != 0
    # each rank checks and exits with the reason; mpirun may kill the second rank before it prints
    # (it aborts the job once one process exits non-zero), so at least one copy is guaranteed
    assert (r.stdout + r.stderr).count("mpirun started 2 processes but --data-parallel-size is 3") >= 1, r.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    r = subprocess.run(serve, capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
    assert r.returncode != 0 and "mpirun -np N" in r.stderr, r.stderr


# ---------------------------------------------------------------------------------------------
# Lockstep ranks with a mixture-of-experts model spread over them (--enable-expert-parallel)
# ---------------------------------------------------------------------------------------------

MOE_PROMPTS = ["hello world", "The quick brown fox jumps over", "MoE", "0123456789 abcdefghij 0123456789 abcdefghij"]


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> Path:
    """A tiny random MoE GGUF (4 experts, 2 used; byte-level vocabulary) written by the binary."""
    srv = MpiServer()
    path = tmp_path_factory.mktemp("moe") / "tiny-moe.gguf"
    subprocess.run([str(srv.binary), "debug", "write-tiny-moe", "--output", str(path), "--experts", "4", "--experts-used", "2"],
                   check=True, capture_output=True, timeout=60)
    return path


def moe_logprobs(srv: SpeculaServer, prompt: str) -> list[float]:
    """The greedy continuation's token logprobs: a fingerprint of the tokens (the byte-level
    vocabulary's text is mostly incomplete UTF-8) and of the numerics behind them."""
    r = srv.client().completions.create(model=srv.model_name, prompt=prompt, max_tokens=16, temperature=0, logprobs=1,
                                        extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16
    return r.choices[0].logprobs.token_logprobs


def test_lockstep_expert_parallel_moe_equals_a_single_engine_and_stops_on_sigterm(tiny_moe):
    single = SpeculaServer(threads=1)
    single.model = tiny_moe
    single.start()
    try:
        want = [moe_logprobs(single, p) for p in MOE_PROMPTS]
    finally:
        single.stop()
    srv = MpiServer("--data-parallel-mode", "lockstep", "--enable-expert-parallel", "--shutdown-grace-secs", "5")
    srv.model = tiny_moe
    srv.start(timeout=120)
    try:
        with ThreadPoolExecutor(len(MOE_PROMPTS)) as pool:
            got = list(pool.map(lambda p: moe_logprobs(srv, p), MOE_PROMPTS))
        for prompt, w, g in zip(MOE_PROMPTS, want, got):
            assert g == pytest.approx(w, abs=1e-4), f"{prompt!r}: expert-parallel logprobs {g} differ from the single engine's {w}"
        m = srv.metrics()
        agreements, tokens = by_rank(m, "specula:dp_agreements_total"), by_rank(m, "specula:dp_tokens_total")
        assert set(agreements) == {0, 1} and all(a > 0 for a in agreements.values()), agreements
        assert sum(tokens.values()) > 0, tokens
        ranks = srv.rank_pids()
        assert len(ranks) == RANKS, ranks
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(20)
        deadline = time.monotonic() + 5
        while any(alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(p) for p in ranks), f"rank processes still running after mpirun exited: {ranks}"
    finally:
        srv.stop()
