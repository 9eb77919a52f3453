"""Grammar budgets through the server (tiny random model with SmolLM2's tokenizer): a grammar
that compiles for minutes never holds up other requests and ends in a 400 naming the time
budget; an over-size one is a 400 naming the size budget; a constrained request is accepted
only once its grammar compiled, so an invalid grammar is a 400 even for a stream; a client
that leaves while its grammar compiles cancels the compile."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from harness.server_utils import ServerProcess, running_server

pytestmark = pytest.mark.slow
BUDGET_S = 4.0  # generous: the other requests must finish well within it on a loaded machine
MAX_BYTES = 8192


def _pathological(repeats: int) -> str:
    return "(a|b)*" * repeats  # compiles for minutes at 1000 repeats; each test its own count


# This model's EOS is an ordinary token of the tokenizer, so its text may follow the match.


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path) -> ServerProcess:
    args = ["--model-path", str(tiny_chat_model), "--max-total-tokens", "2048", "--context-length", "256",
            "--grammar-compile-timeout-s", str(BUDGET_S), "--grammar-max-bytes", str(MAX_BYTES),
            "--grammar-compile-workers", "1"]
    with running_server(args) as s:
        yield s
        body = s.check_integrity()
        assert body["ok"] and body["running"] == body["waiting"] == 0, body


def _generate(server: ServerProcess, params: dict, text: str = "Hi", timeout: float = 120) -> httpx.Response:
    return httpx.post(server.url + "/generate", timeout=timeout,
                      json={"text": text, "sampling_params": {"temperature": 0, **params}})


def test_pathological_regex_is_a_400_and_others_run_meanwhile(server: ServerProcess) -> None:
    assert _generate(server, {"max_new_tokens": 4, "regex": "[0-9]{3}"}).status_code == 200  # worker up
    with ThreadPoolExecutor(1) as pool:
        bad = pool.submit(_generate, server, {"max_new_tokens": 2, "regex": _pathological(1000)})
        time.sleep(0.5)  # its trial compile is running
        for i in range(2):  # plain and constrained requests with ready grammars run meanwhile
            r = _generate(server, {"max_new_tokens": 8}, f"plain {i}")
            assert r.status_code == 200, r.text
            r = _generate(server, {"max_new_tokens": 3, "regex": "[0-9]{3}"}, f"digits {i}")
            assert r.status_code == 200 and re.match("[0-9]{3}", r.json()["text"]), r.text
            assert not bad.done()
        r = bad.result()
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "grammar_compile_timeout_s" in msg and f"{BUDGET_S:g} s" in msg, msg


def test_oversize_and_invalid_grammars_are_400(server: ServerProcess) -> None:
    r = _generate(server, {"regex": "a" * (MAX_BYTES + 1)})
    assert r.status_code == 400 and f"limit of {MAX_BYTES} bytes (grammar_max_bytes)" in r.json()["error"]["message"]
    body = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"p" * MAX_BYTES: {"type": "string"}}}}}}
    models = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
    body["model"] = models[0]["id"]
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "grammar_max_bytes" in r.json()["error"]["message"], r.text
    # accepted only once compiled: an invalid grammar is a 400 before a stream starts
    r = httpx.post(server.url + "/generate", timeout=60, json={
        "text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 4, "regex": "(unclosed"}})
    assert r.status_code == 400 and "invalid regex" in r.json()["error"]["message"], r.text


def test_client_leaving_cancels_the_compile(server: ServerProcess) -> None:
    assert _generate(server, {"max_new_tokens": 2, "regex": "[0-9]"}).status_code == 200  # worker up
    with pytest.raises(httpx.ReadTimeout):
        _generate(server, {"max_new_tokens": 2, "regex": _pathological(1100)}, timeout=0.8)
    deadline = time.monotonic() + 10
    while not (m := re.search(r"was cancelled after ([0-9.]+) s", server.log())):
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.1)
    assert float(m.group(1)) < BUDGET_S  # killed because the client left, not by the budget
    r = _generate(server, {"max_new_tokens": 3, "regex": "[a-c]{3}"})  # the slot is free again
    assert r.status_code == 200 and re.match("[a-c]{3}", r.json()["text"]), r.text
    body = server.check_integrity()
    assert body["ok"] and body["running"] == body["waiting"] == 0, body
