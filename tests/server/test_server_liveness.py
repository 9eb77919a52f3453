"""Liveness and observability through real servers (tiny model), issue 25 findings 3, 4 and 11.

- A frozen engine (SIGSTOP) with nothing pending: /health turns 503 within --watchdog-timeout
  (the HTTP side's own view of the heartbeat), the watch task logs the stall as it trips,
  /metrics answers at once with the engine's last snapshot marked stale, a request is a 503 at
  once; after SIGCONT /health is 200 again.
- A forward pass longer than --engine-call-timeout-s (held deterministically by the test hook
  HICACHE_TEST_HOLD_STEP, serving/engine/debug_hooks.py): another client's short request waits
  and gets its 200, not a 504; a control call still 504s, and that 5xx is logged at WARNING;
  /metrics answers within its short wait, marked stale.
- Every request is counted by route template, method and status, and logged in one access line;
  /metrics has no ``_created`` series.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.server_utils import ServerProcess, running_server
from serving.engine.debug_hooks import HOLD_ENV

pytestmark = pytest.mark.slow
WATCHDOG_S = 3.0
CALL_TIMEOUT_S = 1.0


def engine_pid(server: ServerProcess) -> int:
    return int(httpx.get(server.url + "/get_server_info", timeout=30).json()["engine"]["pid"])


def wait_health(server: ServerProcess, status: int, within: float) -> tuple[float, httpx.Response]:
    t0 = time.monotonic()
    while True:
        r = httpx.get(server.url + "/health", timeout=10)
        if r.status_code == status:
            return time.monotonic(), r
        assert time.monotonic() - t0 < within, f"/health stayed {r.status_code}, wanted {status}"
        time.sleep(0.05)


def wait_log(server: ServerProcess, text: str, within: float = 10.0) -> str:
    deadline = time.monotonic() + within
    while text not in server.log():
        assert time.monotonic() < deadline, f"{text!r} not logged:\n{server.log()[-3000:]}"
        time.sleep(0.05)
    return next(line for line in server.log().splitlines() if text in line)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(text: str, name: str, **labels: str) -> float | None:
    return samples(text).get((name, tuple(sorted(labels.items()))))


def generate(server: ServerProcess, text: str, tokens: int = 4) -> httpx.Response:
    return httpx.post(server.url + "/generate", timeout=120, json={
        "text": text, "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0}})


# -- finding 3: a frozen engine with nothing pending -----------------------------------------
@pytest.fixture(scope="module")
def frozen_server(tiny_chat_model: Path) -> Iterator[ServerProcess]:
    # a long call timeout: a /metrics or a request that waited on the frozen engine would take 30 s
    args = ["--model-path", str(tiny_chat_model), "--max-total-tokens", "2048",
            "--watchdog-timeout", str(WATCHDOG_S), "--engine-call-timeout-s", "30"]
    with running_server(args) as s:
        yield s


def test_a_frozen_idle_engine_turns_health_503_within_the_watchdog_timeout(frozen_server: ServerProcess) -> None:
    s = frozen_server
    pid = engine_pid(s)
    assert generate(s, "hello there").status_code == 200
    assert value(httpx.get(s.url + "/metrics", timeout=30).text, "hicache_engine_stats_stale") == 0.0
    assert httpx.get(s.url + "/health", timeout=10).status_code == 200
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        # nothing pending: the HTTP side sees the heartbeat age on its own
        _, r = wait_health(s, 503, within=WATCHDOG_S + 5)
        msg = r.json()["error"]["message"]
        assert "no progress" in msg and "frozen" in msg and "watchdog_timeout" in msg, msg
        line = wait_log(s, "engine watchdog: the engine has made no progress")
        assert "ERROR" in line and "/health answers 503" in line, line
        t0 = time.monotonic()
        metrics = httpx.get(s.url + "/metrics", timeout=10)  # at once, not after the 30 s call timeout
        assert metrics.status_code == 200 and time.monotonic() - t0 < 5
        assert value(metrics.text, "hicache_engine_stall_seconds") >= WATCHDOG_S
        assert value(metrics.text, "hicache_engine_stats_stale") == 1.0  # the last snapshot, marked
        assert value(metrics.text, "hicache_engine_stats_age_seconds") >= time.monotonic() - stopped - 1
        assert value(metrics.text, "hicache_forward_passes_total") > 0
        t0 = time.monotonic()
        r = generate(s, "are you there")
        assert r.status_code == 503 and "no progress" in r.json()["error"]["message"], r.text
        assert time.monotonic() - t0 < 5
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_health(s, 200, within=30)
    wait_log(s, "engine watchdog: the engine makes progress again")
    assert generate(s, "back again").status_code == 200


# -- findings 4 and 11: a forward pass longer than the call timeout --------------------------
@pytest.fixture(scope="module")
def held_server(tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory,
                ) -> Iterator[tuple[ServerProcess, Path]]:
    hold = tmp_path_factory.mktemp("hold") / "hold-step"
    s = ServerProcess(["--model-path", str(tiny_chat_model), "--max-total-tokens", "2048",
                       "--watchdog-timeout", "120", "--engine-call-timeout-s", str(CALL_TIMEOUT_S)])
    s.env[HOLD_ENV] = str(hold)
    s.start()
    try:
        yield s, hold
    finally:
        hold.unlink(missing_ok=True)
        code = s.stop()
    assert code == 0, s.log()[-3000:]
    assert "Traceback" not in s.log(), s.log()[-3000:]


class Client(threading.Thread):
    def __init__(self, server: ServerProcess, text: str) -> None:
        super().__init__(daemon=True)
        self.server, self.text = server, text
        self.response: httpx.Response | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.response = generate(self.server, self.text)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


def test_a_request_queued_behind_a_long_forward_pass_is_not_a_504(held_server: tuple[ServerProcess, Path]) -> None:
    s, hold = held_server
    assert value(httpx.get(s.url + "/metrics", timeout=30).text, "hicache_engine_stats_stale") == 0.0
    hold.touch()
    try:
        long = Client(s, "a long prompt " * 40)
        long.start()
        wait_log(s, f"{HOLD_ENV}: step held")  # its forward pass "runs" until the file goes
        short = Client(s, "hi")
        short.start()
        sent = time.monotonic()
        while time.monotonic() - sent < 3 * CALL_TIMEOUT_S:  # well past --engine-call-timeout-s
            assert short.is_alive(), (short.response and short.response.text, short.error)
            time.sleep(0.05)
        assert long.is_alive()
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200  # busy, not stalled
        t0 = time.monotonic()
        metrics = httpx.get(s.url + "/metrics", timeout=30)  # its short wait, then the last snapshot
        assert metrics.status_code == 200 and time.monotonic() - t0 < 10
        assert value(metrics.text, "hicache_engine_stats_stale") == 1.0
        # a control call is still bounded by the call timeout (and dropped unrun): a 504
        r = httpx.get(s.url + "/get_load", timeout=30)
        assert r.status_code == 504 and "engine_call_timeout_s" in r.json()["error"]["message"], r.text
        line = wait_log(s, '"GET /get_load" answered 504')
        assert "WARNING" in line and "did not answer Stats" in line, line
    finally:
        hold.unlink(missing_ok=True)
    for client in (long, short):
        client.join(60)
        assert client.error is None and client.response is not None, client.error
        assert client.response.status_code == 200, client.response.text
        assert len(client.response.json()["output_ids"]) == 4
    assert s.check_integrity()["ok"]


def test_requests_are_counted_by_route_and_logged(held_server: tuple[ServerProcess, Path]) -> None:
    s, _ = held_server
    before = httpx.get(s.url + "/metrics", timeout=30).text

    def count(text: str, route: str, method: str, status: str) -> float:
        return value(text, "hicache_http_requests_total", route=route, method=method, status=status) or 0.0

    assert generate(s, "count me").status_code == 200
    assert httpx.delete(s.url + "/cache/pin/no-such-lease", timeout=30).status_code == 404
    assert httpx.get(s.url + "/no/such/route/%0d%0aforged", timeout=30).status_code == 404
    assert httpx.request("BREW", s.url + "/generate", timeout=30).status_code == 405
    after = httpx.get(s.url + "/metrics", timeout=30).text
    for route, method, status in (("/generate", "POST", "200"), ("/cache/pin/{lease_id}", "DELETE", "404"),
                                  ("unmatched", "GET", "404"), ("/generate", "other", "405"),
                                  ("/metrics", "GET", "200")):
        assert count(after, route, method, status) == count(before, route, method, status) + 1, (route, status)
    routes = {dict(labels)["route"] for (name, labels) in samples(after) if name == "hicache_http_requests_total"}
    assert not any("no-such-lease" in r or "/no/such" in r for r in routes), routes  # templates, never raw paths
    assert value(after, "hicache_http_request_duration_seconds_count", route="/generate", method="POST") >= 1
    assert "_created" not in after
    line = wait_log(s, '"POST /generate" 200')
    assert "hicache.access INFO 127.0.0.1:" in line and line.rstrip().endswith("s"), line
    wait_log(s, '"DELETE /cache/pin/{lease_id}" 404')
    assert '"GET /health"' not in s.log()  # probes log at DEBUG
