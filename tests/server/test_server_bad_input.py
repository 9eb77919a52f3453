"""Bad input never takes the server down: each case gets a 4xx that says what is wrong,
the server stays healthy, and no KV page leaks (tiny random model, API key on)."""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.server_utils import ServerProcess, running_server

pytestmark = pytest.mark.slow
KEY = "test-key"
LIMIT = 200_000  # --max-request-bytes
CONTEXT = 256  # --context-length


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path) -> ServerProcess:
    args = [
        "--model-path",
        str(tiny_chat_model),
        "--context-length",
        str(CONTEXT),
        "--max-total-tokens",
        "2048",
        "--max-request-bytes",
        str(LIMIT),
        "--max-running-requests",
        "1",
        "--max-queued-requests",
        "1",
        "--served-model-name",
        "m",
    ]
    with running_server(args, api_key=KEY) as s:
        yield s


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


def comp(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "hi", "max_tokens": 2, **kw}


def gen(**kw: Any) -> dict[str, Any]:
    return {"text": "hi", "sampling_params": {"max_new_tokens": 2}, **kw}


C, P, G = "/v1/chat/completions", "/v1/completions", "/generate"
# (path, body: dict = JSON / bytes = raw, status, a word the message must contain)
CASES: list[tuple[str, Any, int, str]] = [
    (C, b'{"model": "m", "messages": [', 400, "JSON"),
    (C, b'{"model": "m\xff\xfe", "messages": []}', 400, "UTF-8"),
    (C, b"", 400, "empty"),
    (C, b"[1, 2]", 400, "object"),
    (C, b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "NaN"),
    (C, b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', 400, "unicode"),
    (G, b'{"text": "a\\udfffb"}', 400, "unicode"),
    (C, {"model": "m", "messages": "hello"}, 400, "messages"),
    (C, {"model": "m", "messages": []}, 400, "messages"),
    (C, {"messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
    (C, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "role"),
    (C, chat(messages=[{"role": "user", "content": 42}]), 400, "content"),
    (
        C,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        400,
        "type",
    ),
    (C, chat(max_tokens=-1), 400, "max_tokens"),
    (C, chat(max_tokens=10**9), 400, "max_tokens"),
    (C, chat(max_tokens=10**30), 400, "max_tokens"),
    (C, chat(max_tokens="10"), 400, "max_tokens"),
    (C, chat(max_tokens=True), 400, "max_tokens"),
    (C, chat(max_completion_tokens=CONTEXT), 400, "max_completion_tokens"),
    (C, chat(foo=1), 400, "foo"),
    (C, chat(messages=[{"role": "user", "content": "hi", "foo": 1}]), 400, "foo"),
    (P, comp(foo=1), 400, "foo"),
    (G, gen(foo=1), 400, "foo"),
    (C, chat(n=0), 400, "n"),
    (C, chat(n=500), 400, "n must be"),
    (G, gen(sampling_params={"max_new_tokens": 2, "n": 0}), 400, "sampling_params.n"),
    (C, chat(temperature=-1), 400, "temperature"),
    (C, chat(temperature="hot"), 400, "temperature"),
    (C, chat(top_p=0), 400, "top_p"),
    (C, chat(top_p=1.5), 400, "top_p"),
    (C, chat(stop=5), 400, "stop"),
    (C, chat(stop=["ok", 3]), 400, "stop"),
    (C, chat(seed=1.5), 400, "seed"),
    (C, chat(top_k=0), 400, "top_k"),
    (C, chat(frequency_penalty=3), 400, "frequency_penalty"),
    (C, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    (C, chat(top_logprobs=2), 400, "top_logprobs"),
    (C, chat(return_routed_experts=True), 400, "return_routed_experts"),
    (C, chat(tools=[{"type": "function", "function": {"description": "f"}}]), 400, "tools.0.function.name"),
    (C, chat(stream="yes"), 400, "stream"),
    (C, chat(stream_options={"include_usage": True}), 400, "stream_options"),
    (C, chat(session_id="no-such-session"), 404, "session"),
    (C, chat(session_id="no-such-session", stream=True), 404, "session"),
    (C, chat(messages=[{"role": "user", "content": "hello " * 400}]), 400, "context length"),
    (P, comp(prompt="hello " * 400), 400, "context length"),
    (P, comp(prompt=[]), 400, "prompt"),
    (P, comp(prompt=["a", 1]), 400, "prompt"),
    (P, comp(prompt=[1, 2, 10**6]), 400, "token ids"),
    (P, comp(prompt=[1, 2, 10**30]), 400, "token ids"),
    (P, comp(logprobs=21), 400, "logprobs"),
    (P, comp(store=True), 400, "store"),
    (P, comp(best_of=3), 400, "best_of"),
    (P, comp(prompt=""), 400, "empty"),
    (G, {"text": "hi", "input_ids": [1, 2]}, 400, "exactly one"),
    (G, {"sampling_params": {"max_new_tokens": 2}}, 400, "exactly one"),
    (G, {"input_ids": [1, -5]}, 400, "input_ids"),
    (G, {"input_ids": [1, 49152]}, 400, "input_ids"),
    (G, {"input_ids": "1 2 3"}, 400, "input_ids"),
    (G, gen(sampling_params={"max_new_tokens": 2, "beam_width": 4}), 400, "beam_width"),
    (G, gen(sampling_params={"max_new_tokens": -1}), 400, "max_new_tokens"),
    (G, gen(sampling_params={"max_new_tokens": 2, "stop_token_ids": 5}), 400, "stop_token_ids"),
    (G, gen(sampling_params={"max_new_tokens": 2, "seed": 2**70}), 400, "seed"),
    (G, gen(sampling_params=[1, 2]), 400, "sampling_params"),
    (G, gen(session_id="nope"), 404, "session"),
    (G, gen(text=["a", "b"], rid="r1"), 400, "single prompt"),
    (G, gen(return_logprob=True, top_logprobs_num=99), 400, "top_logprobs_num"),
    (G, gen(return_logprob=True, logprob_start_len=50), 400, "logprob_start_len"),
    (G, gen(return_hidden_states=True), 400, "return_hidden_states"),
    (G, gen(sampling_params={"max_new_tokens": 2, "min_new_tokens": 1}), 400, "min_new_tokens"),
    ("/close_session", {"session_id": "nope"}, 404, "session"),
    ("/close_session", {}, 400, "session_id"),
    ("/open_session", {"session_id": 7}, 400, "session_id"),
    ("/no/such/route", {}, 404, "route"),
]


def post(
    server: ServerProcess, path: str, body: Any, headers: dict[str, str] | None = None
) -> httpx.Response:
    hdrs = {**server.headers, "content-type": "application/json", **(headers or {})}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers=hdrs, timeout=30)


def assert_error(r: httpx.Response, status: int, word: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert word.lower() in err["message"].lower(), err["message"]


@pytest.mark.parametrize("path,body,status,word", CASES, ids=[f"{i}" for i in range(len(CASES))])
def test_bad_input(server: ServerProcess, path: str, body: Any, status: int, word: str) -> None:
    assert_error(post(server, path, body), status, word)
    assert httpx.get(server.url + "/health").status_code == 200


def test_ignored_fields_do_not_change_the_answer(server: ServerProcess) -> None:
    """The few fields accepted and ignored (docs/api.md): a 200 with the same greedy answer."""
    base = chat(messages=[{"role": "user", "content": "Say something."}], max_tokens=6, temperature=0)
    plain = post(server, C, base)
    assert plain.status_code == 200, plain.text
    named = {**base, "messages": [{"role": "user", "content": "Say something.", "name": "ann"}],
             "user": "user-42", "parallel_tool_calls": False}
    r = post(server, C, named)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    with_user, without = post(server, P, comp(user="user-42", temperature=0)), post(server, P, comp(temperature=0))
    assert with_user.status_code == 200, with_user.text
    assert with_user.json()["choices"][0]["text"] == without.json()["choices"][0]["text"]
    greedy = {"max_new_tokens": 2, "temperature": 0}
    with_start, without = post(server, G, gen(sampling_params=greedy, logprob_start_len=0)), post(
        server, G, gen(sampling_params=greedy))
    assert with_start.status_code == 200, with_start.text
    assert with_start.json()["output_ids"] == without.json()["output_ids"]
    sid = post(server, "/open_session", {"capacity_of_str_len": 1000})
    assert sid.status_code == 200, sid.text
    assert post(server, "/close_session", {"session_id": sid.json()}).status_code == 200


def test_oversize_body(server: ServerProcess) -> None:
    big = chat(messages=[{"role": "user", "content": "x" * (LIMIT + 10)}])
    assert_error(post(server, C, big), 413, "limit")


def test_auth(server: ServerProcess) -> None:
    r = httpx.post(server.url + C, json=chat(), timeout=30)
    assert_error(r, 401, "API key")
    assert_error(post(server, C, chat(), headers={"Authorization": "Bearer wrong"}), 401, "API key")
    assert httpx.get(server.url + "/health").status_code == 200  # open without the key


def test_wrong_method(server: ServerProcess) -> None:
    r = httpx.get(server.url + C, headers=server.headers)
    assert r.status_code == 405 and r.json()["error"]["message"]


def test_queue_full_is_429(server: ServerProcess) -> None:
    """One running, one waiting: a third concurrent request finds the queue full."""
    body = gen(sampling_params={"max_new_tokens": 30, "ignore_eos": True})
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        codes = sorted(f.result().status_code for f in [pool.submit(post, server, G, body) for _ in range(4)])
    assert 429 in codes and codes[0] == 200, codes
    r = post(server, G, body)  # all done: accepted again
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 30


def test_still_healthy_and_nothing_leaked(server: ServerProcess) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    ok = post(server, G, gen())
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2
    report = server.check_integrity()
    assert report["ok"], report
    assert report["running"] == 0 and report["waiting"] == 0


# -- issue 42, finding 13 ----------------------------------------------------------------------
LONG = "x" * 150_000  # under --max-request-bytes


@pytest.mark.parametrize("path,body", [
    (C, chat(model=LONG)),
    (P, comp(model=LONG)),
    (C, {**chat(), LONG: 1}),  # an unknown field's name
    (G, gen(sampling_params={"max_new_tokens": 2, LONG: 1})),
    (C, chat(response_format={"type": LONG})),
], ids=["chat-model", "completions-model", "unknown-field", "sampling-param", "response-format"])
def test_client_input_is_not_echoed_whole(server: ServerProcess, path: str, body: Any) -> None:
    r = post(server, path, body)
    assert r.status_code in (400, 404), r.text[:300]
    message = r.json()["error"]["message"]
    assert len(message) < 1100 and "characters)" in message, message[:300]


def test_an_unknown_model_shows_200_characters_of_its_name(server: ServerProcess) -> None:
    for r in (post(server, C, chat(model=LONG)),
              httpx.get(server.url + "/v1/models/" + LONG[:8000], headers=server.headers, timeout=30)):
        err = r.json()["error"]
        assert r.status_code == 404 and err["code"] == "model_not_found", r.text[:300]
        assert "'" + "x" * 200 + "'..." in err["message"] and "x" * 201 not in err["message"], err["message"][:300]
    r = post(server, "/api/chat", {"model": LONG, "messages": [{"role": "user", "content": "hi"}]})  # Ollama's shape
    assert r.status_code == 404 and "x" * 200 + "'..." in r.json()["error"] and "x" * 201 not in r.text, r.text[:300]


@pytest.mark.parametrize("path,raw,field", [
    (C, b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": "a\\ud800"}', "stop"),
    (C, b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": ["ok", "\\udfff"]}', "stop.1"),
    (C, b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "cache_salt": "s\\ud800"}', "cache_salt"),
    (C, b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "regex": "[a-z]\\ud800"}', "regex"),
    (P, b'{"model": "m", "prompt": "hi", "stop": "\\ud83d"}', "stop"),
    (G, b'{"text": "hi", "sampling_params": {"max_new_tokens": 2, "stop": ["\\ud800"]}}', "sampling_params.stop.0"),
    (G, b'{"text": "hi", "sampling_params": {"max_new_tokens": 2, "regex": "\\ud800"}}', "sampling_params.regex"),
    (G, b'{"text": "hi", "cache_salt": "\\udc00x"}', "cache_salt"),
    (G, b'{"text": "hi", "sampling_params": {"st\\ud800op": 1}}', "sampling_params: a field name"),
    ("/api/chat", b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], '
                  b'"options": {"stop": ["\\ud800"]}}', "options.stop.0"),
], ids=["chat-stop", "chat-stop-list", "chat-cache_salt", "chat-regex", "completions-stop", "generate-stop",
        "generate-regex", "generate-cache_salt", "a-field-name", "ollama-stop"])
def test_a_lone_surrogate_is_a_400_naming_its_field(server: ServerProcess, path: str, raw: bytes, field: str) -> None:
    r = post(server, path, raw)
    assert r.status_code == 400, r.text
    message = r.json()["error"] if path.startswith("/api/") else r.json()["error"]["message"]
    assert message.startswith(field) and "not valid Unicode" in message and "codec" not in message, message


def test_a_surrogate_pair_is_text(server: ServerProcess) -> None:
    pair_and_escaped_backslash = b'{"text": "hi \\ud83d\\ude00", "sampling_params": {"stop": ["\\\\ud800"]}}'
    r = post(server, G, pair_and_escaped_backslash)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("encoding", ["gzip", "br", "deflate, gzip"])
def test_an_encoded_body_is_a_415_naming_the_encoding(server: ServerProcess, encoding: str) -> None:
    import gzip

    body = gzip.compress(json.dumps(chat()).encode())
    r = post(server, C, body, headers={"content-encoding": encoding})
    assert_error(r, 415, f"Content-Encoding {encoding!r}")
    r = post(server, "/api/chat", body, headers={"content-encoding": encoding})
    assert r.status_code == 415 and encoding in r.json()["error"], r.text
    assert post(server, C, chat(), headers={"content-encoding": "identity"}).status_code == 200
