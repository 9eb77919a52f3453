"""Streams and lifetimes (tiny model): dropped clients are aborted and their pages released;
several prompts in one stream; idle sessions expire; a dead engine stops the server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from harness.server_utils import ServerProcess, running_server

pytestmark = pytest.mark.slow
KEEP_TOKENS = 24
DROP_TOKENS = 400  # far more than a dropped stream reads before it goes away


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path) -> ServerProcess:
    args = [
        "--model-path",
        str(tiny_chat_model),
        "--max-total-tokens",
        "16384",
        "--max-running-requests",
        "32",
        "--session-idle-timeout-s",
        "1",
        "--served-model-name",
        "m",
    ]
    with running_server(args) as s:
        yield s


async def _stream(client: httpx.AsyncClient, i: int, drop: bool) -> dict | None:
    body = {
        "text": f"stream number {i}: tell me a long story",
        "sampling_params": {
            "max_new_tokens": DROP_TOKENS if drop else KEEP_TOKENS,
            "ignore_eos": True,
            "temperature": 0.8,
            "seed": i,
        },
        "stream": True,
    }
    last = None
    async with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            last = json.loads(line[len("data: ") :])
            if drop and len(last["output_ids"]) >= 3:
                return None  # leaving the block closes the connection mid-stream
    return last


def test_twenty_streams_half_dropped(server: ServerProcess) -> None:
    before = server.check_integrity()

    async def main() -> list[dict | None]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.gather(*(_stream(client, i, drop=i % 2 == 1) for i in range(20)))

    results = asyncio.run(main())
    kept = [r for i, r in enumerate(results) if i % 2 == 0]
    for r in kept:
        assert r is not None and len(r["output_ids"]) == KEEP_TOKENS
        assert r["meta_info"]["finish_reason"] == {"type": "length", "length": KEEP_TOKENS}
    after = server.check_integrity()  # waits until nothing runs: the dropped ones were aborted
    assert after["ok"], after
    assert after["running"] == 0 and after["waiting"] == 0
    generated = after["generated_tokens"] - before["generated_tokens"]
    assert generated < 10 * KEEP_TOKENS + 10 * DROP_TOKENS // 2, generated


def test_dropped_chat_stream_and_non_stream_requests(server: ServerProcess) -> None:
    before = server.check_integrity()
    chat = {
        "model": "m",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": DROP_TOKENS,
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for n, _ in enumerate(r.iter_lines()):
            if n >= 6:
                break
    for path, body in (
        ("/v1/chat/completions", chat),
        (
            "/generate",
            {"text": "hello", "sampling_params": {"max_new_tokens": DROP_TOKENS, "ignore_eos": True}},
        ),
    ):
        with pytest.raises(httpx.ReadTimeout):  # the client gives up before the answer
            httpx.post(server.url + path, json=body, timeout=0.3)
    after = server.check_integrity()
    assert after["ok"] and after["running"] == 0 and after["waiting"] == 0, after
    assert after["generated_tokens"] - before["generated_tokens"] < 3 * DROP_TOKENS
    assert httpx.get(server.url + "/health").status_code == 200


def test_idle_session_expires(server: ServerProcess) -> None:
    sid = httpx.post(server.url + "/open_session", json={}).json()
    r = httpx.post(
        server.url + "/generate",
        json={"text": "hi", "session_id": sid, "sampling_params": {"max_new_tokens": 2}},
    )
    assert r.status_code == 200
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/get_server_info").json()["internal_states"][0]["sessions"]:
        assert time.monotonic() < deadline, "the idle session was never closed"
        time.sleep(0.2)
    assert httpx.post(server.url + "/close_session", json={"session_id": sid}).status_code == 404
    assert server.check_integrity()["ok"]


def test_engine_death_stops_the_server(tiny_chat_model: Path) -> None:
    """If the engine process dies, streams end with an error and the server exits non-zero
    (so a supervisor restarts it) instead of answering 503 forever."""
    srv = ServerProcess(["--model-path", str(tiny_chat_model)])
    srv.start()
    try:
        pid = httpx.get(srv.url + "/get_server_info").json()["engine"]["pid"]
        body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
        with httpx.stream("POST", srv.url + "/generate", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            os.kill(pid, signal.SIGKILL)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert any('"error"' in line and "engine" in line for line in rest), rest[-3:]
        assert srv.proc is not None
        assert srv.proc.wait(30) == 1
    finally:
        srv.stop()


def test_completions_stream_several_prompts(server: ServerProcess) -> None:
    body = {
        "model": "m",
        "prompt": ["one", "two two", "three three three"],
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
    }
    full = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    texts, finishes = ["", "", ""], [0, 0, 0]
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
        timeout=60,
    ) as r:
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        texts[choice["index"]] += choice["text"]
        finishes[choice["index"]] += choice["finish_reason"] is not None
    assert finishes == [1, 1, 1]
    assert texts == [c["text"] for c in full["choices"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 15
