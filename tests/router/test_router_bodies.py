"""Request bodies at the router (router/bodies.py, router/keypool.py, router/routing_key.py), with
``hicache router`` (the CLI, as users run it) in front of a real worker:

- a body over ``max_request_bytes`` is a 413 from the router itself, as soon as its declared
  length or its bytes pass the limit, and nothing reaches a worker;
- 100k-deep JSON is a 400 naming the depth limit on every route that parses a body;
- a long prompt costs the router a bounded prefix of tokenization: after several 7.5 MB prompts
  the router and its key processes stay within a few hundred MB, and a short request is not held
  up behind their keying (it is answered before the second of them).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.server_utils import ROOT, ServerProcess, free_port
from router.cli import READY_MESSAGE

pytestmark = pytest.mark.slow
KEY = "admin-key-0001"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 8 * 2**20  # max_request_bytes' default (the workers' default too)
BIG = 7_500_000  # characters of one long prompt (under the limit)
# bounds on resident memory after the long prompts (measured on the 2-vCPU Xeon: docs/router.md)
ROUTER_RSS_MB, KEY_PROCESS_RSS_MB = 400, 300


@pytest.fixture(scope="module")
def worker(tiny_chat_model: Path) -> Iterator[ServerProcess]:
    w = ServerProcess(["--model-path", str(tiny_chat_model), "--served-model-name", "tiny", "--max-total-tokens",
                       "2048"])
    w.start()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def router(worker: ServerProcess) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """The CLI router; routing keys of up to 262144 tokens (2M characters tokenized), so keying a
    long prompt takes long enough to see who waits for it."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "serving.launch.cli", "router", "--worker-urls", worker.url, "--port", str(port),
         "--api-key", KEY, "--max-routing-tokens", "262144", "--tokenizer-workers", "2"],
        cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.strip() == READY_MESSAGE:
            break
    assert proc.poll() is None, "".join(lines)
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(x) for x in (task / "children").read_text().split()]
    return out


def test_deep_json_is_a_400_on_every_route_that_parses_a_body(router: tuple[str, subprocess.Popen[str]]) -> None:
    url, _ = router
    deep = b'{"url": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    ollama = {"/api/chat", "/api/generate"}  # Ollama's errors are {"error": message}
    for path in ("/generate", "/v1/chat/completions", "/v1/completions", "/v1/messages", "/api/chat", "/api/generate",
                 "/open_session", "/close_session", "/add_worker", "/remove_worker", "/cache/lookup", "/cache/pin",
                 "/cache/prefetch"):
        r = httpx.post(url + path, content=deep, headers={**AUTH, "content-type": "application/json"}, timeout=60)
        assert r.status_code == 400, (path, r.status_code, r.text[:300])
        msg = r.json()["error"] if path in ollama else r.json()["error"]["message"]
        assert "deeper than the limit of 128 (max_json_depth)" in msg, (path, msg)


def test_a_body_over_the_limit_is_refused_by_the_router_at_once(router: tuple[str, subprocess.Popen[str]]) -> None:
    url, _ = router
    port = int(url.rsplit(":", 1)[1])
    # declared 60 MB, sent 1 KB: the 413 comes without the rest (nothing waits for 60 MB)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 60000000\r\n\r\n" + b"x" * 1024)
        answer = b""
        while chunk := s.recv(65536):  # the router closes the connection after its answer
            answer += chunk
    head = answer.decode("latin-1")
    assert head.startswith("HTTP/1.1 413"), head
    assert "max_request_bytes" in head and "x-hicache-worker" not in head.lower(), head

    # chunked, no length: refused once the bytes pass the limit, by the router (no worker named)
    def chunks() -> Iterator[bytes]:
        for _ in range(LIMIT // 2**20 + 2):
            yield b"y" * 2**20

    r = httpx.post(url + "/v1/chat/completions", content=chunks(), headers={**AUTH, "content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413 and "x-hicache-worker" not in r.headers, (r.status_code, r.headers)
    assert "over the limit of 8388608 bytes (max_request_bytes)" in r.json()["error"]["message"]


def test_long_prompts_cost_bounded_memory_and_hold_up_no_short_request(
        router: tuple[str, subprocess.Popen[str]], worker: ServerProcess) -> None:
    url, proc = router
    words = "cache page token prefix router worker radix tree load balance session tier host device ".split()
    text = " ".join(words[i % len(words)] + str(i % 97) for i in range(BIG // 8))[:BIG]
    done: list[str] = []
    codes: list[int] = []

    def big(i: int) -> None:
        body = {"model": "tiny", "messages": [{"role": "user", "content": f"{i} {text}"}], "max_tokens": 1}
        r = httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=300)
        codes.append(r.status_code)
        done.append(f"big{i}")

    threads = [threading.Thread(target=big, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60  # every big body has reached the keying stage (the router counts them)
    while time.monotonic() < deadline:
        fleet = httpx.get(url + "/list_workers", headers=AUTH, timeout=30).json()["fleet"]
        if fleet.get("keyed_large", 0) >= 4:
            break
        time.sleep(0.05)
    short = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    r = httpx.post(url + "/v1/chat/completions", json=short, headers=AUTH, timeout=300)
    assert r.status_code == 200, r.text
    done.append("short")
    for t in threads:
        t.join()
    assert codes == [400] * 4  # the worker refuses prompts over its context length
    assert done.index("short") < 2, done  # answered while the long prompts were still being keyed
    router_mb = rss_mb(proc.pid)
    key_mb = {pid: rss_mb(pid) for pid in children(proc.pid)}
    print(f"after 4 prompts of {BIG} characters: router {router_mb:.0f} MB, its processes "
          f"{', '.join(f'{m:.0f}' for m in key_mb.values())} MB")
    assert router_mb < ROUTER_RSS_MB and len(key_mb) >= 2, (router_mb, key_mb)
    assert max(key_mb.values()) < KEY_PROCESS_RSS_MB, key_mb
