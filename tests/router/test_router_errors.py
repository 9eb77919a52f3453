"""The router's own errors in each API's shape, as its workers answer them (issue 25, finding 12):
OpenAI ``{"error": {"message", "type", "param", "code"}}`` on /v1/* and /generate, Anthropic's
``{"type": "error", "error": {...}}`` on /v1/messages, Ollama's ``{"error": "..."}`` on /api/*;
unknown routes are 404s in the same shapes, on the PD router too (which names why it does not
serve /v1/messages and /api/*). Real routers on real HTTP, real clients; the workers are absent
(connection refused: nothing is available) or stand-ins (harness/fake_pd_worker.py)."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import ollama
import openai
import pytest

from harness.fake_pd_worker import FakeWorker
from router.config import RouterConfig
from router.embedded import RouterThread, free_port

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
GONE = "no worker is available"


def openai_shape(status: int, kind: str, message: str | None = None) -> dict:
    return {"error": {"message": message or GONE, "type": kind, "param": None, "code": str(status)}}


@pytest.fixture(scope="module")
def lonely() -> Iterator[RouterThread]:
    """A router whose only worker does not exist: everything it routes is a 503."""
    cfg = RouterConfig(worker_urls=(f"http://127.0.0.1:{free_port()}",), tokenizer_workers=0, max_retries=0,
                       health_check_interval_s=60.0)
    with RouterThread(cfg) as r:
        yield r


def test_errors_in_each_apis_shape(lonely: RouterThread) -> None:
    url = lonely.url
    with httpx.Client(base_url=url, timeout=30) as c:
        for path in ("/v1/chat/completions", "/v1/completions", "/generate"):
            r = c.post(path, json=CHAT)
            assert r.status_code == 503 and r.json() == openai_shape(503, "service_unavailable"), r.text
            r = c.post(path, content=b"{nope", headers={"content-type": "application/json"})
            assert r.status_code == 400
            assert r.json() == openai_shape(400, "invalid_request_error", "the body is not valid JSON"), r.text
        r = c.post("/v1/messages", json=CHAT)
        assert r.status_code == 503
        assert r.json() == {"type": "error", "error": {"type": "overloaded_error", "message": GONE}}, r.text
        r = c.post("/v1/messages", json=[1])
        assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                       "message": "the body must be a JSON object"}}, r.text
        for path in ("/api/chat", "/api/generate"):
            r = c.post(path, json={"model": "m", "prompt": "hi"})
            assert r.status_code == 503 and r.json() == {"error": GONE}, r.text
        r = c.get("/api/tags")  # forwarded to any worker: none
        assert r.status_code == 503 and r.json() == {"error": GONE}, r.text
        # unknown routes and methods: 404 / 405 in the path's shape, never FastAPI's {"detail": ...}
        r = c.get("/v1/nope")
        assert r.status_code == 404 and r.json() == openai_shape(404, "not_found_error", "no such route: /v1/nope")
        r = c.post("/v1/messages/nope", json={})
        assert r.status_code == 404 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "not_found_error", r.text
        r = c.get("/api/nope")
        assert r.status_code == 404 and r.json() == {"error": "no such route: /api/nope"}, r.text
        r = c.get("/v1/chat/completions")
        assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error", r.text
    # what the clients make of them
    with pytest.raises(openai.InternalServerError) as e:
        openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).chat.completions.create(**CHAT)
    assert e.value.code == "503" and e.value.type == "service_unavailable" and e.value.message.endswith(GONE)
    with pytest.raises(anthropic.APIStatusError) as ea:
        anthropic.Anthropic(base_url=url, api_key="x", max_retries=0).messages.create(**CHAT)
    assert ea.value.status_code == 503 and ea.value.body["error"]["type"] == "overloaded_error"
    with pytest.raises(ollama.ResponseError) as eo:
        ollama.Client(host=url).chat(model="m", messages=CHAT["messages"], stream=False)
    assert eo.value.status_code == 503 and eo.value.error == GONE


def test_a_missing_key_is_a_401_in_each_apis_shape() -> None:
    cfg = RouterConfig(worker_urls=(f"http://127.0.0.1:{free_port()}",), tokenizer_workers=0, api_key="k",
                       health_check_interval_s=60.0)
    with RouterThread(cfg) as r, httpx.Client(base_url=r.url, timeout=30) as c:
        body = c.post("/v1/chat/completions", json=CHAT).json()
        assert body["error"]["type"] == "authentication_error" and body["error"]["code"] == "401", body
        body = c.post("/v1/messages", json=CHAT).json()
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error", body
        assert "API key" in c.post("/api/chat", json=CHAT).json()["error"]
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=r.url, api_key="wrong", max_retries=0).messages.create(**CHAT)


def test_pd_router_unknown_routes_answer_in_their_apis_shape() -> None:
    prefill, decode = FakeWorker("prefill", "p0").start(), FakeWorker("decode", "d0").start()
    try:
        cfg = RouterConfig(pd_disaggregation=True, prefill_urls=((prefill.url, None),), decode_urls=(decode.url,),
                           tokenizer_workers=0, health_check_interval_s=60.0)
        with RouterThread(cfg) as r, httpx.Client(base_url=r.url, timeout=30) as c:
            got = c.post("/v1/messages", json=CHAT)
            assert got.status_code == 404 and got.json()["type"] == "error", got.text
            assert got.json()["error"]["type"] == "not_found_error"
            assert "--pd-disaggregation" in got.json()["error"]["message"]
            for path in ("/api/chat", "/api/generate"):
                got = c.post(path, json={"model": "m", "prompt": "hi"})
                assert got.status_code == 404 and list(got.json()) == ["error"], got.text
                assert "--pd-disaggregation" in got.json()["error"]
            got = c.get("/api/nope")
            assert got.status_code == 404 and got.json() == {"error": "no such route: /api/nope"}, got.text
            got = c.get("/nope")
            assert got.status_code == 404 and got.json()["error"]["code"] == "404", got.text
            with pytest.raises(ollama.ResponseError) as eo:
                ollama.Client(host=r.url).chat(model="m", messages=CHAT["messages"], stream=False)
            assert eo.value.status_code == 404 and "--pd-disaggregation" in eo.value.error
            assert c.post("/generate", json={"text": "x"}).status_code == 200  # what it serves still works
    finally:
        prefill.stop()
        decode.stop()
