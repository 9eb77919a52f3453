"""Issue 13's input findings against a real server (tiny model, API key from the environment):
each test failed before the fix. Deep JSON is a 400, not a 500; a client leaving mid-body is
not logged as an error; ``model`` must name the served model; /flush_cache is POST only; JSON
routes need a JSON content type and cross-origin POSTs are refused (no web page can drive the
server); the bearer scheme is case-insensitive; the key comes from HICACHE_API_KEY and is not
in ``ps``; a busy port fails before the model loads and the L3 directory is never touched."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from harness.server_utils import ROOT, ServerProcess, running_server

pytestmark = pytest.mark.slow
KEY = "hardening-key"
NAME = "tiny"  # --served-model-name


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path) -> ServerProcess:
    args = ["--model-path", str(tiny_chat_model), "--served-model-name", NAME, "--max-total-tokens", "2048",
            "--context-length", "256"]
    with running_server(args, api_key=KEY, api_key_env=True) as s:
        yield s


def post(server: ServerProcess, path: str, body: Any = None, headers: dict[str, str] | None = None,
         content_type: str | None = "application/json") -> httpx.Response:
    hdrs = {**server.headers, **({"content-type": content_type} if content_type else {}), **(headers or {})}
    content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers=hdrs, timeout=30)


def chat(model: str = NAME, **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


def assert_error(r: httpx.Response, status: int, word: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert word.lower() in err["message"].lower(), err["message"]
    return err


def test_deeply_nested_json_is_a_400(server: ServerProcess) -> None:
    deep = b'{"text": "hi", "sampling_params": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    assert_error(post(server, "/generate", deep), 400, "deeper than the limit of 128")
    moderate = chat(stop=json.loads("[" * 200 + "]" * 200))  # under Python's recursion limit, over ours
    assert_error(post(server, "/v1/chat/completions", moderate), 400, "max_json_depth")
    brackets_in_strings = chat(messages=[{"role": "user", "content": "[" * 150 + "{" * 150}])
    assert post(server, "/v1/chat/completions", brackets_in_strings).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200


def test_client_leaving_mid_body_is_not_an_error(server: ServerProcess) -> None:
    before = len(server.log())
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 5000\r\n"
                     + f"Authorization: Bearer {KEY}\r\n\r\n".encode() + b'{"model": "tiny", "mess')
        time.sleep(0.5)  # the server is reading the body when the client goes away
    time.sleep(1.0)
    assert post(server, "/v1/chat/completions", chat()).status_code == 200
    new = server.log()[before:]
    for word in ("Traceback", "internal error", "ClientDisconnect"):
        assert word not in new, new


def test_model_must_name_the_served_model(server: ServerProcess) -> None:
    for path, body in (("/v1/chat/completions", chat("gpt-4")),
                       ("/v1/completions", {"model": "gpt-4", "prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions", chat(""))):
        err = assert_error(post(server, path, body), 404, "does not exist")
        assert err["code"] == "model_not_found" and err["param"] == "model"
        assert err["type"] == "invalid_request_error"
    stream = post(server, "/v1/chat/completions", chat("gpt-4", stream=True))
    assert_error(stream, 404, "does not exist")
    info = httpx.get(server.url + "/get_model_info", headers=server.headers).json()
    for name in (NAME, Path(info["model_path"]).name, info["model_path"]):  # served name, basename, path
        r = post(server, "/v1/chat/completions", chat(name))
        assert r.status_code == 200, r.text
        assert r.json()["model"] == NAME  # the served name, not what the client sent
    models = httpx.get(server.url + "/v1/models", headers=server.headers).json()
    assert [m["id"] for m in models["data"]] == [NAME]


def test_flush_cache_is_post_only(server: ServerProcess) -> None:
    r = httpx.get(server.url + "/flush_cache", headers=server.headers)
    assert r.status_code == 405, r.text
    assert post(server, "/flush_cache", content_type=None).status_code == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          None])
def test_json_routes_need_a_json_content_type(server: ServerProcess, content_type: str | None) -> None:
    for path, body in (("/v1/chat/completions", chat()),
                       ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 2}),
                       ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
                       ("/open_session", {}),
                       ("/close_session", {"session_id": "x"})):
        assert_error(post(server, path, body, content_type=content_type), 415, "application/json")
    r = post(server, "/v1/chat/completions", chat(), content_type="application/json; charset=utf-8")
    assert r.status_code == 200, r.text


def test_cross_origin_posts_are_refused(server: ServerProcess) -> None:
    evil = {"Origin": "http://evil.example"}
    for path in ("/flush_cache", "/open_session", "/health_generate"):
        assert_error(post(server, path, headers=evil, content_type=None), 403, "cross-origin")
    assert_error(post(server, "/v1/chat/completions", chat(), headers=evil), 403, "cross-origin")
    same = {"Origin": server.url}
    assert post(server, "/v1/chat/completions", chat(), headers=same).status_code == 200
    assert httpx.get(server.url + "/get_load", headers={**server.headers, **evil}).status_code == 200  # reads


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "beAReR"])
def test_bearer_scheme_is_case_insensitive(server: ServerProcess, scheme: str) -> None:
    r = httpx.get(server.url + "/get_load", headers={"Authorization": f"{scheme} {KEY}"})
    assert r.status_code == 200, r.text
    for bad in (f"Basic {KEY}", f"{scheme} wrong", scheme, KEY):
        assert_error(httpx.get(server.url + "/get_load", headers={"Authorization": bad}), 401, "API key")


def test_api_key_from_the_environment_and_not_in_ps(server: ServerProcess) -> None:
    assert_error(httpx.get(server.url + "/get_load"), 401, "API key")
    assert httpx.get(server.url + "/get_load", headers=server.headers).status_code == 200
    assert server.proc is not None
    procs = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(recursive=True)]
    for p in procs:
        assert KEY not in " ".join(p.cmdline())
    info = httpx.get(server.url + "/get_server_info", headers=server.headers).json()
    assert info["server"]["api_key"] == "***"


def test_busy_port_fails_before_the_model_loads(server: ServerProcess, tmp_path: Path,
                                               tiny_chat_model: Path) -> None:
    l3 = tmp_path / "l3"
    cfg = tmp_path / "l3.yaml"
    cfg.write_text("cache:\n  hicache_storage_backend: lmdb\n  hicache_storage_backend_extra_config:\n"
                   f"    path: {l3}\n    capacity_gb: 0.05\n")
    env = {k: v for k, v in os.environ.items() if k != "HICACHE_API_KEY"}
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "serving.launch.cli", "serve", "--config", str(cfg),
         "--model-path", str(tiny_chat_model), "--host", "127.0.0.1", "--port", str(server.port)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert f"cannot listen on 127.0.0.1:{server.port}" in out and "in use" in out, out
    assert "engine ready" not in out and "Loading" not in out, out
    assert not l3.exists(), "the second server touched the L3 directory"
    assert took < 60, took
    assert httpx.get(server.url + "/health").status_code == 200  # the live server is unaffected


@pytest.mark.parametrize("route", ["/generate", "/v1/chat/completions"])
def test_tokenizing_a_huge_prompt_does_not_block_other_requests(server: ServerProcess, route: str) -> None:
    """A 6 MB prompt is a 400 (far over the context) once the tokenizer, which runs off the event
    loop, has counted about the context's worth of it (issue 25: it no longer tokenizes it all);
    /health keeps answering meanwhile."""
    import threading

    text = "word " * 1_200_000
    body = {"text": text, "sampling_params": {"max_new_tokens": 2}} if route == "/generate" else \
        {"model": NAME, "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    out: dict[str, Any] = {}

    def huge() -> None:
        t0 = time.monotonic()
        out["r"] = post(server, route, body)
        out["s"] = time.monotonic() - t0

    t = threading.Thread(target=huge)
    t.start()
    worst = 0.0
    while t.is_alive():
        t0 = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.05)
    t.join()
    assert out["r"].status_code == 400, out["r"].text
    assert "context length is 256" in out["r"].text, out["r"].text
    assert worst < 1.0, f"/health waited {worst:.2f} s while a huge prompt was tokenized"
