"""The engine watchdog through a real server (tiny model): the engine process is stopped with
SIGSTOP while a request streams; control calls fail with a clear 504 after
--engine-call-timeout-s, /health turns 503 once --watchdog-timeout has passed (and calls then
fail at once with 503); after SIGCONT /health is 200 again and the request completes."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.server_utils import ServerProcess, running_server

pytestmark = pytest.mark.slow
WATCHDOG_S = 4.0  # --watchdog-timeout
CALL_TIMEOUT_S = 1.0  # --engine-call-timeout-s
TOKENS = 300


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path) -> ServerProcess:
    args = ["--model-path", str(tiny_chat_model), "--max-total-tokens", "4096",
            "--watchdog-timeout", str(WATCHDOG_S), "--engine-call-timeout-s", str(CALL_TIMEOUT_S)]
    with running_server(args) as s:
        yield s


def engine_pid(server: ServerProcess) -> int:
    return int(httpx.get(server.url + "/get_server_info", timeout=30).json()["engine"]["pid"])


def wait_health(server: ServerProcess, status: int, within: float) -> tuple[float, httpx.Response]:
    t0 = time.monotonic()
    while True:
        r = httpx.get(server.url + "/health", timeout=10)
        if r.status_code == status:
            return time.monotonic(), r
        assert time.monotonic() - t0 < within, f"/health stayed {r.status_code}, wanted {status}"
        time.sleep(0.1)


def wait_log(server: ServerProcess, text: str, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while text not in server.log():
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.1)


def error_of(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    return r.json()["error"]["message"]


def test_sigstop_turns_health_503_and_sigcont_recovers(server: ServerProcess) -> None:
    pid = engine_pid(server)
    first, chunks, failure = threading.Event(), [], []

    def stream() -> None:
        body = {"text": "once upon a time", "stream": True,
                "sampling_params": {"max_new_tokens": TOKENS, "ignore_eos": True, "temperature": 0}}
        try:
            with httpx.stream("POST", server.url + "/generate", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[len("data: "):]))
                        first.set()
        except Exception as e:  # noqa: BLE001 - reported below
            failure.append(e)
            first.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert first.wait(60) and not failure, failure
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        # a control call fails with a clear 504 after engine_call_timeout_s (the watchdog has not tripped yet)
        msg = error_of(httpx.get(server.url + "/get_load", timeout=30), 504)
        assert "did not answer" in msg and "engine_call_timeout_s" in msg, msg
        assert time.monotonic() - stopped < WATCHDOG_S
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        tripped, r = wait_health(server, 503, within=WATCHDOG_S + 20)
        assert tripped - stopped >= WATCHDOG_S - 0.5
        assert "no progress" in error_of(r, 503) and "watchdog_timeout" in error_of(r, 503)
        t0 = time.monotonic()
        msg = error_of(httpx.post(server.url + "/flush_cache", timeout=30), 503)  # at once, not after a timeout
        assert "no progress" in msg and time.monotonic() - t0 < CALL_TIMEOUT_S, msg
        metrics = httpx.get(server.url + "/metrics", timeout=30)
        assert metrics.status_code == 200
        stall = [ln for ln in metrics.text.splitlines() if ln.startswith("hicache_engine_stall_seconds ")]
        assert stall and float(stall[0].split()[1]) > WATCHDOG_S, stall
        assert reader.is_alive() and len(chunks) < TOKENS  # the request is still pending
        wait_log(server, "engine watchdog: the engine has made no progress")
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_health(server, 200, within=30)
    reader.join(120)
    assert not failure, failure
    last = chunks[-1]
    assert len(last["output_ids"]) == TOKENS
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": TOKENS}
    assert httpx.get(server.url + "/get_load", timeout=30).status_code == 200
    assert server.check_integrity()["ok"]
    wait_log(server, "engine watchdog: the engine makes progress again")


def test_control_calls_time_out_with_504_while_the_engine_is_stopped(server: ServerProcess) -> None:
    pid = engine_pid(server)
    calls: list[tuple[str, str, Any]] = [("POST", "/flush_cache", None), ("GET", "/get_server_info", None),
                                         ("POST", "/debug/check_integrity", None), ("GET", "/get_load", None),
                                         ("POST", "/open_session", {})]
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with ThreadPoolExecutor(len(calls)) as pool:
            answers = list(pool.map(lambda c: httpx.request(c[0], server.url + c[1], json=c[2], timeout=30), calls))
        took = time.monotonic() - t0
        for (_, path, _), r in zip(calls, answers, strict=True):
            msg = error_of(r, 504)
            assert "did not answer" in msg and "engine_call_timeout_s" in msg, (path, msg)
            assert r.json()["error"]["type"] == "timeout_error"
        assert CALL_TIMEOUT_S - 0.2 <= took < WATCHDOG_S, took
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_health(server, 200, within=30)
    # the engine dropped the calls whose callers gave up: the 504'd flush never ran later
    wait_log(server, "FlushCache not run: its caller stopped waiting")
    assert httpx.get(server.url + "/get_load", timeout=30).status_code == 200
