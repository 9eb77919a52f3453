"""The router's DNS rebinding and cross-origin guards (issue 25, finding 7 for the router): a real
``hicache router`` process with no API key in front of a real worker. A page whose name was
re-pointed at 127.0.0.1 (``Host`` and ``Origin`` both naming it) gets a 403 in the path's API
shape; IP literals, localhost and ``--allowed-hosts`` names pass, and the router's own calls
to the worker pass the worker's Host check (they name the worker URL's host, never the
client's); a cross-origin POST is a 403 too. The PD router has the same guard."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.fake_pd_worker import FakeWorker
from harness.server_utils import ROOT, ServerProcess, free_port, running_server
from router.cli import READY_MESSAGE
from router.config import RouterConfig
from router.embedded import RouterThread

ALLOWED = "proxy.example,*.svc.example"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _router_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "serving.launch.cli", "router", "--tokenizer-workers", "0", *args]


@pytest.fixture(scope="module")
def worker(tiny_chat_model: Path) -> Iterator[ServerProcess]:
    args = ["--model-path", str(tiny_chat_model), "--served-model-name", "m", "--context-length", "256",
            "--max-total-tokens", "2048"]  # no --allowed-hosts: only IP literals and localhost pass
    with running_server(args) as s:
        yield s


@pytest.fixture(scope="module")
def router(worker: ServerProcess) -> Iterator[tuple[str, int]]:
    port = free_port()
    proc = subprocess.Popen(_router_cmd("--worker-urls", worker.url, "--port", str(port), "--allowed-hosts", ALLOWED),
                            cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.strip() == READY_MESSAGE:
                break
        assert proc.poll() is None, "".join(lines)
        yield f"http://127.0.0.1:{port}", port
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, "".join(lines)


@pytest.mark.slow
def test_a_rebinding_page_is_refused_by_the_router(router: tuple[str, int], worker: ServerProcess) -> None:
    url, port = router
    evil = f"evil.example:{port}"
    hdrs = {"Host": evil, "Origin": f"http://{evil}"}  # what a rebinding page sends: the same origin
    with httpx.Client(base_url=url, timeout=60) as c:
        for method, path, body in (("POST", "/v1/chat/completions", CHAT), ("POST", "/generate", {"text": "hi"}),
                                   ("GET", "/v1/models", None), ("POST", "/flush_cache", None),
                                   ("GET", "/list_workers", None), ("POST", "/add_worker", {"url": worker.url}),
                                   ("POST", "/cache/lookup", {"text": "hi"})):
            r = c.request(method, path, json=body, headers=hdrs)
            assert r.status_code == 403, (path, r.text)
            err = r.json()["error"]
            assert err["type"] == "permission_error" and err["code"] == "403", (path, err)
            assert "Host header" in err["message"] and evil in err["message"], err
            assert "--allowed-hosts" in err["message"], err
        r = c.post("/v1/messages", json=CHAT, headers=hdrs)  # Anthropic's shape
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", r.text
        r = c.post("/api/chat", json=CHAT, headers=hdrs)  # Ollama's
        assert r.status_code == 403 and "Host header" in r.json()["error"], r.text
        assert c.get("/v1/models", headers={"Host": "evil.example"}).status_code == 403  # no port
        assert c.get("/health", headers=hdrs).status_code == 200  # liveness stays open
        assert len(c.get("/list_workers").json()["workers"]) == 1  # the refused /add_worker changed nothing


@pytest.mark.slow
@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "[::1]:{port}", "proxy.example",
                                  "proxy.example:{port}", "a.svc.example"])
def test_local_and_allowed_names_pass_through_to_the_worker(router: tuple[str, int], host: str) -> None:
    url, port = router
    host = host.format(port=port)
    hdrs = {"Host": host, "Origin": f"http://{host}"}  # a page served from that name is same-origin
    # the worker allows no extra names: a 200 for proxy.example means the router called it by its own URL's host
    r = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=hdrs, timeout=60)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text
    assert httpx.get(url + "/v1/models", headers={"Host": host}, timeout=60).status_code == 200


@pytest.mark.slow
def test_the_worker_itself_refuses_names_only_the_router_allows(worker: ServerProcess) -> None:
    r = httpx.get(worker.url + "/v1/models", headers={"Host": "proxy.example"}, timeout=30)
    assert r.status_code == 403, r.text  # so the previous test's 200s did not pass the client's Host on


@pytest.mark.slow
def test_cross_origin_posts_are_refused_by_the_router(router: tuple[str, int]) -> None:
    url, port = router
    cross = {"Origin": "http://evil.example"}  # Host: 127.0.0.1:port, from another origin
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/flush_cache", headers=cross)
        assert r.status_code == 403 and "cross-origin" in r.json()["error"]["message"], r.text
        # a form-like POST: text/plain, which the router would forward and Ollama's routes accept
        r = c.post("/api/generate", content=b'{"model": "m", "prompt": "hi", "stream": false}',
                   headers={**cross, "Content-Type": "text/plain"})
        assert r.status_code == 403 and "cross-origin" in r.json()["error"], r.text
        assert c.get("/v1/models", headers=cross).status_code == 200  # reads: the answer is unreadable cross-origin
        assert c.post("/flush_cache", headers={"Origin": f"http://127.0.0.1:{port}"}).status_code == 200


def test_the_pd_router_refuses_a_rebinding_page() -> None:
    prefill, decode = FakeWorker("prefill", "p0").start(), FakeWorker("decode", "d0").start()
    try:
        cfg = RouterConfig(pd_disaggregation=True, prefill_urls=((prefill.url, None),), decode_urls=(decode.url,),
                           tokenizer_workers=0, health_check_interval_s=60.0)
        with RouterThread(cfg) as r, httpx.Client(base_url=r.url, timeout=30) as c:
            evil = f"evil.example:{cfg.port}"
            for method, path in (("POST", "/generate"), ("POST", "/open_session"), ("GET", "/list_workers")):
                got = c.request(method, path, json={"text": "x"}, headers={"Host": evil, "Origin": f"http://{evil}"})
                assert got.status_code == 403 and "Host header" in got.json()["error"]["message"], (path, got.text)
            assert c.get("/health", headers={"Host": evil}).status_code == 200
            assert prefill.generations() == [] and decode.generations() == []  # nothing reached the workers
            assert c.post("/generate", json={"text": "x"}).status_code == 200  # 127.0.0.1 passes
    finally:
        prefill.stop()
        decode.stop()


def test_a_malformed_allowed_hosts_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="allowed_hosts: 'a b'"):
        RouterConfig(allowed_hosts="proxy.example,a b")
    p = subprocess.run(_router_cmd("--allowed-hosts", "http://x", "--port", str(free_port())), cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "allowed_hosts: 'http://x'" in p.stderr, (p.returncode, p.stderr)
