"""Issue 25, findings 7, 10 and 12a against a real server with no API key (the default):
a DNS-rebinding page (``Host`` and ``Origin`` both naming the attacker's name) is refused while
the names a client or a router uses pass; Ollama's clients, which send no JSON content type
(litellm's ``ollama_chat/``, ``curl -d``), are served while cross-origin POSTs to those routes
stay refused; ``GET /v1/models/{model}`` is OpenAI's retrieve-model."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from harness.server_utils import ServerProcess, running_server
from serving.server.config import ServerConfig
from serving.server.trusted_hosts import HostPolicy

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm: no download at import
NAME = "m"
ALLOWED = "proxy.example,*.svc.example"  # --allowed-hosts


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path) -> ServerProcess:
    args = ["--model-path", str(tiny_chat_model), "--served-model-name", NAME, "--context-length", "256",
            "--max-total-tokens", "2048", "--allowed-hosts", ALLOWED]
    with running_server(args) as s:
        yield s


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


def ollama_chat() -> dict[str, Any]:
    return {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "stream": False,
            "options": {"num_predict": 2, "temperature": 0}}


# -- 7: the Host check -------------------------------------------------------------------------
@pytest.mark.slow
def test_dns_rebinding_is_refused(server: ServerProcess) -> None:
    evil = f"evil.example:{server.port}"
    hdrs = {"Host": evil, "Origin": f"http://{evil}"}  # what a rebinding page sends: the same origin
    for method, path, body in (("POST", "/v1/chat/completions", chat()), ("GET", "/v1/models", None),
                               ("POST", "/flush_cache", None), ("POST", "/api/chat", ollama_chat()),
                               ("GET", "/get_server_info", None)):
        r = httpx.request(method, server.url + path, json=body, headers=hdrs, timeout=30)
        assert r.status_code == 403, (path, r.text)
        err = r.json()["error"]
        assert "Host header" in err["message"] and evil in err["message"] and "--allowed-hosts" in err["message"]
        assert err["type"] == "permission_error"
    assert httpx.get(server.url + "/v1/models", headers={"Host": "evil.example"}).status_code == 403  # no port
    assert httpx.get(server.url + "/health", headers=hdrs).status_code == 200  # liveness stays open


@pytest.mark.slow
@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "LOCALHOST", "[::1]:{port}", "127.0.0.2",
                                  "proxy.example", "proxy.example:8080", "a.svc.example", "b.a.svc.example:1"])
def test_local_names_and_allowed_hosts_are_served(server: ServerProcess, host: str) -> None:
    host = host.format(port=server.port)
    hdrs = {"Host": host, "Origin": f"http://{host}"}  # a page served from that name is same-origin
    r = httpx.post(server.url + "/v1/chat/completions", json=chat(), headers=hdrs, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.get(server.url + "/v1/models", headers={"Host": host}).status_code == 200


@pytest.mark.slow
@pytest.mark.parametrize("host", ["svc.example", "evil.example", "proxy.example.evil.example", "localhost.evil",
                                  "127.0.0.1.evil.example", "a b", "[::1"])
def test_other_names_are_refused(server: ServerProcess, host: str) -> None:
    r = httpx.get(server.url + "/v1/models", headers={"Host": host}, timeout=30)
    assert r.status_code == 403 or (r.status_code == 400 and " " in host), r.text  # uvicorn refuses "a b" itself


def test_host_policy_beyond_loopback() -> None:
    """Listening on 0.0.0.0 or a name (a worker behind a router): IP literals, localhost, the
    machine's host name and the --host name pass; nothing else does unless allowed."""
    me = socket.gethostname()
    wide = HostPolicy("0.0.0.0")
    for ok in (f"{me}:30000", "10.1.2.3:30000", "[fe80::1]:30000", "localhost", "127.0.0.1"):
        assert wide.allows(ok), ok
    for bad in ("evil.example:30000", f"{me}.evil.example", ""):
        assert not wide.allows(bad), bad
    named = HostPolicy("worker-3.cluster.example", "router.example")
    assert named.allows("worker-3.cluster.example:30000") and named.allows("router.example")
    assert not named.allows("worker-4.cluster.example")
    local = HostPolicy("127.0.0.1")
    assert local.allows("localhost:1") and local.allows("[::1]") and not local.allows("evil.example")
    assert HostPolicy("127.0.0.1", "*").allows("anything.example")
    with pytest.raises(ValueError, match="allowed_hosts"):
        ServerConfig(allowed_hosts="http://proxy.example")


# -- 10: Ollama's clients without a JSON content type ------------------------------------------
@pytest.mark.slow
def test_ollama_curl_d_is_served(server: ServerProcess) -> None:
    """Ollama's documented ``curl .../api/chat -d '{...}'`` (form-urlencoded), run by curl itself."""
    for path, body, key in (("/api/chat", ollama_chat(), "message"),
                            ("/api/generate", {"model": NAME, "prompt": "Why is the sky blue?", "stream": False,
                                               "options": {"num_predict": 2}}, "response")):
        out = subprocess.run(["curl", "-sS", "-w", "\n%{http_code}", server.url + path, "-d", json.dumps(body)],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        text, status = out.rsplit("\n", 1)
        assert status == "200", text
        assert json.loads(text)["done"] is True and key in json.loads(text)
    streamed = subprocess.run(["curl", "-sS", server.url + "/api/generate", "-d",
                               json.dumps({"model": NAME, "prompt": "hi", "options": {"num_predict": 3}})],
                              capture_output=True, text=True, timeout=60, check=True).stdout
    lines = [json.loads(x) for x in streamed.splitlines()]
    assert lines[-1]["done"] is True and lines[-1]["eval_count"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain"])
def test_ollama_routes_take_any_content_type(server: ServerProcess, content_type: str | None) -> None:
    hdrs = {"content-type": content_type} if content_type else {}
    raw = json.dumps(ollama_chat()).encode()
    r = httpx.post(server.url + "/api/chat", content=raw, headers=hdrs, timeout=60)  # httpx sends no type itself
    assert r.status_code == 200, r.text
    assert r.json()["message"]["role"] == "assistant" and r.json()["eval_count"] == 2
    show = httpx.post(server.url + "/api/show", content=json.dumps({"model": NAME}).encode(), headers=hdrs)
    assert show.status_code == 200, show.text
    bad = httpx.post(server.url + "/api/chat", content=b"model=m&prompt=hi", headers=hdrs)
    assert bad.status_code == 400 and "JSON" in bad.json()["error"], bad.text  # Ollama's shape, named
    # the browser guards stay: a cross-origin form POST, a rebinding page
    evil = httpx.post(server.url + "/api/chat", content=raw, headers={**hdrs, "Origin": "http://evil.example"})
    assert evil.status_code == 403 and "cross-origin" in evil.text, evil.text
    rebound = {**hdrs, "Host": "evil.example", "Origin": "http://evil.example"}
    assert httpx.post(server.url + "/api/generate", content=raw, headers=rebound).status_code == 403
    # the other APIs still need a JSON type (their clients all send it)
    r = httpx.post(server.url + "/v1/chat/completions", content=json.dumps(chat()).encode(), headers=hdrs)
    assert r.status_code == 415, r.text


@pytest.mark.slow
def test_litellm_ollama_chat(server: ServerProcess) -> None:
    import litellm

    kw = {"model": f"ollama_chat/{NAME}", "api_base": server.url, "messages": [{"role": "user", "content": "hi"}],
          "max_tokens": 3, "temperature": 0}
    r = litellm.completion(**kw)
    assert r.choices[0].message.content is not None and r.usage.completion_tokens == 3
    text = "".join(c.choices[0].delta.content or "" for c in litellm.completion(**kw, stream=True))
    assert text == r.choices[0].message.content


# -- 12a: retrieve-model -----------------------------------------------------------------------
@pytest.mark.slow
def test_retrieve_model(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    listed = client.models.list().data[0]
    info = httpx.get(server.url + "/get_model_info").json()
    for name in (NAME, info["model_path"], Path(info["model_path"]).name):
        got = client.models.retrieve(name)
        assert got.id == NAME and got.object == "model" and got.model_dump() == listed.model_dump()
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.code == "model_not_found"
    r = httpx.get(server.url + "/v1/models/gpt-4")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["type"] == "invalid_request_error" and "gpt-4" in err["message"]
