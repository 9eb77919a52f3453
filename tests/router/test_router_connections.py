"""How the router treats a connection (issue 42, finding 11 against the router), with real sockets
to a real router (RouterThread, no worker: its own routes answer) whose read timeouts are set
small: header_timeout_s 2, body_timeout_s 6, body_idle_timeout_s 2 (router/connections.py).

- Slowloris: 50 connections sending their heads a byte every second are each answered 408 and
  closed within a bound of 20 s, while other clients' requests through the router keep getting
  their answers; a connection that sends nothing is closed the same way.
- A body that stops short (a Content-Length larger than the body, a chunked body without its
  last chunk) is a 408 in the shape of the path's API and the connection is closed; so is a
  body sent a byte at a time past body_timeout_s.
- A request with both Transfer-Encoding and Content-Length is a 400 and its connection closed.

The bounds are upper bounds on a behaviour (the connection is closed at all), not speed targets.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from harness.raw_http import RawHttp, answer_of, assert_openai_408, get_after_idle
from router.config import RouterConfig
from router.embedded import RouterThread

pytestmark = pytest.mark.slow
HEADER_S, BODY_S, IDLE_S = 2.0, 6.0, 2.0
BOUND_S = 20.0  # a closed connection is seen within this (10 x the 2 s timeouts, 3 x the 6 s one)
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()


@pytest.fixture(scope="module")
def router() -> Iterator[RouterThread]:
    cfg = RouterConfig(header_timeout_s=HEADER_S, body_timeout_s=BODY_S, body_idle_timeout_s=IDLE_S)
    with RouterThread(cfg) as r:
        yield r


@pytest.fixture(scope="module")
def raw(router: RouterThread) -> RawHttp:
    return RawHttp(router.cfg.host, router.cfg.port, BOUND_S)


def list_workers(router: RouterThread) -> int:
    return httpx.get(router.url + "/list_workers", timeout=30).status_code


def test_slowloris_heads_are_closed_while_other_requests_flow(router: RouterThread, raw: RawHttp) -> None:
    before = router.connections_closed["header_timeout"]
    out: dict[str, list[bytes]] = {}
    head = raw.request_line("GET", "/list_workers") + b"X-Slow: "
    t = threading.Thread(target=lambda: out.update(r=raw.trickle(50, b"", head + b"a" * 10_000, every=1.0)))
    t.start()
    codes = []
    while t.is_alive():  # other clients meanwhile, through the router's own route
        codes.append(list_workers(router))
        time.sleep(0.1)
    t.join()
    assert "r" in out, "the slowloris connections were not all closed (see the thread's failure above)"
    assert codes and set(codes) == {200}, codes
    for a in out["r"]:
        if a:  # empty: the close raced a byte of ours (a reset); the counter below still counts it
            assert_openai_408(a, "header_timeout_s")
    assert router.connections_closed["header_timeout"] - before == 50
    assert list_workers(router) == 200


def test_a_silent_connection_is_closed(raw: RawHttp) -> None:
    with raw.connect() as sock:
        assert_openai_408(raw.until_closed(sock, time.monotonic()), "header_timeout_s")


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length-larger-than-the-body", "no-last-chunk"])
def test_a_body_that_stops_short_is_a_408(router: RouterThread, raw: RawHttp, chunked: bool) -> None:
    before = router.connections_closed["body_idle_timeout"]
    with raw.connect() as sock:
        t0 = time.monotonic()
        if chunked:  # Anthropic's route: the 408 in Anthropic's shape
            sock.sendall(raw.post_head("/v1/messages", chunked=True) + b"%x\r\n" % 10 + BODY[:10] + b"\r\n")
            err = answer_of(raw.until_closed(sock, t0), 408)
            assert err["type"] == "error" and "body_idle_timeout_s" in err["error"]["message"], err
        else:
            sock.sendall(raw.post_head("/v1/chat/completions", len(BODY) + 100) + BODY)
            assert_openai_408(raw.until_closed(sock, t0), "body_idle_timeout_s")
    assert router.connections_closed["body_idle_timeout"] - before == 1
    assert list_workers(router) == 200


def test_a_body_sent_a_byte_at_a_time_is_closed(router: RouterThread, raw: RawHttp) -> None:
    before = router.connections_closed["body_timeout"]
    answers = raw.trickle(5, raw.post_head("/generate", 10_000), b" ", every=0.5)  # never idle 2 s
    for a in answers:
        if a:
            assert_openai_408(a, "body_timeout_s")
    assert router.connections_closed["body_timeout"] - before == 5


def test_transfer_encoding_with_content_length_is_refused_and_closed(router: RouterThread, raw: RawHttp) -> None:
    before = router.connections_closed["ambiguous_framing"]
    request = raw.post_head("/v1/messages", 5, chunked=True)  # Content-Length: 5 and Transfer-Encoding
    with raw.connect() as sock:
        t0 = time.monotonic()
        sock.sendall(request + b"%x\r\n" % len(BODY) + BODY + b"\r\n0\r\n\r\n")
        err = answer_of(raw.until_closed(sock, t0), 400)
    assert err["type"] == "error" and "Transfer-Encoding and Content-Length" in err["error"]["message"], err
    assert router.connections_closed["ambiguous_framing"] - before == 1


def test_an_idle_kept_alive_connection_outlives_the_clients_reuse(raw: RawHttp) -> None:
    """httpx (and the OpenAI SDK on it) reuses an idle connection for up to 5 s; a server that
    closes one after the same 5 s (uvicorn's default) races the client's next request on it, which
    then fails with a ReadError (the soak's abuser saw one in CI at 32f6c83)."""
    idle_s = httpx.Limits().keepalive_expiry + 1.0
    for answer in get_after_idle(raw, "/list_workers", idle_s):
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
