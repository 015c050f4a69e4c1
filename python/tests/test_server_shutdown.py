"""SIGTERM: the server stops accepting connections at once, gives in-flight streams the grace period
(--shutdown-grace-secs 2) to finish, ends what is left with an error event and [DONE], and exits 0."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

from server_fixture import HOST, SpeculaServer, httpx, sse_events

GRACE = 2
STORY = "Once upon a time, in a small village at the edge of a great forest, there lived"


def connection_refused(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=1.0):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def wait_refused(srv: SpeculaServer, timeout: float = 1.5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if connection_refused(srv.port):
            return True
        time.sleep(0.02)
    return False


class StreamReader(threading.Thread):
    """Reads one SSE stream to its end in the background, recording events and when they came."""

    def __init__(self, srv: SpeculaServer, body: dict):
        super().__init__(daemon=True)
        self.srv, self.body = srv, body
        self.events: list[str] = []
        self.first = threading.Event()
        self.ended_at: float | None = None
        self.error: BaseException | None = None

    def run(self):
        try:
            with httpx.Client(timeout=60) as http, http.stream("POST", self.srv.url("/v1/completions"), json=self.body) as r:
                assert r.status_code == 200, r.read()
                for e in sse_events(r):
                    self.events.append(e)
                    self.first.set()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.ended_at = time.monotonic()
            self.first.set()


def test_sigterm_aborts_a_long_stream_within_grace_and_exits_0():
    srv = SpeculaServer("--shutdown-grace-secs", str(GRACE)).start()
    try:
        reader = StreamReader(srv, {"prompt": STORY, "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True})
        reader.start()
        assert reader.first.wait(30), "no first chunk"
        time.sleep(0.3)
        assert reader.ended_at is None and reader.error is None
        signalled = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)

        # New connections are refused while the old stream is still being served.
        assert wait_refused(srv), "the server still accepts connections after SIGTERM"
        assert srv.proc.poll() is None or reader.ended_at is not None

        reader.join(GRACE + 8)
        assert not reader.is_alive(), "the stream did not end after the grace period"
        assert reader.error is None, repr(reader.error)
        took = reader.ended_at - signalled
        assert took < GRACE + 3.0, f"the stream ended {took:.1f}s after SIGTERM (grace {GRACE}s)"
        assert reader.events[-1] == "[DONE]"
        payloads = [json.loads(e) for e in reader.events[:-1]]
        # 4000 tokens cannot finish in the grace period: the stream ends with an error event.
        last = payloads[-1]
        assert "error" in last, last
        assert set(last["error"]) == {"message", "type", "param", "code"}
        assert "shutting down" in last["error"]["message"], last
        assert len(payloads) > 5, "tokens kept streaming during the grace period"

        code = srv.proc.wait(GRACE + 10)
        assert code == 0, f"exit code {code}\n{srv.log_tail()}"
        assert time.monotonic() - signalled < GRACE + 6
    finally:
        srv.stop()


def test_sigterm_lets_a_short_stream_finish():
    srv = SpeculaServer("--shutdown-grace-secs", str(GRACE)).start()
    try:
        reader = StreamReader(srv, {"prompt": STORY, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True})
        reader.start()
        assert reader.first.wait(30), "no first chunk"
        srv.proc.send_signal(signal.SIGTERM)
        reader.join(GRACE + 8)
        assert reader.error is None and reader.events[-1] == "[DONE]"
        payloads = [json.loads(e) for e in reader.events[:-1]]
        assert all("error" not in p for p in payloads), payloads[-1]
        assert [p["choices"][0]["finish_reason"] for p in payloads if p["choices"][0]["finish_reason"]] == ["length"]
        assert srv.proc.wait(GRACE + 10) == 0, srv.log_tail()
    finally:
        srv.stop()


def test_sigterm_when_idle_exits_0_quickly():
    srv = SpeculaServer("--shutdown-grace-secs", str(GRACE)).start()
    try:
        c = srv.client()
        assert c.completions.create(model=srv.model_name, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(GRACE + 10) == 0, srv.log_tail()
        assert time.monotonic() - t0 < GRACE, "an idle server should not wait out the grace period"
        assert connection_refused(srv.port)
    finally:
        srv.stop()
