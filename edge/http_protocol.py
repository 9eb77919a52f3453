"""The HTTP/1.1 connection: uvicorn's h11 protocol with the read timeouts uvicorn lacks, and
the framing RFC 9112 says to refuse; the worker's HTTP process and the router both serve with it.

uvicorn closes a kept-alive connection that stays silent (``timeout_keep_alive``, 5 s) but puts
no bound on how long a client may take to send a request: a head or body sent a byte at a time
(slowloris), a ``Content-Length`` larger than the body, a chunked body without its last chunk
each hold a connection, and a task waiting on the body, until the client gives up. Here
(the worker's ``ServerConfig`` and the router's ``RouterConfig`` fields of these names, nginx's
``client_header_timeout`` / ``client_body_timeout`` in spirit):

- ``header_timeout_s``: a request's head (request line and headers) is complete within this
  long of the connection opening, or of the first byte of the next request on a kept-alive one;
- ``body_timeout_s``: its whole body within this long of the head;
- ``body_idle_timeout_s``: no gap between two reads of the body longer than this (a gap while
  the server itself is not reading, its flow control, does not count).

Past one, the client gets ``408 Request Timeout`` (when no answer has started yet; the app
waiting on the body sees its connection close, and why in ``scope["state"][TIMED_OUT]``: the
worker's http_io.read_json counts a 408) and the connection is closed; each is counted
(``protocol_class``'s ``count``: the worker's ``hicache_http_connections_closed_total{reason}``)
and logged at most every 10 s per reason. A request with both ``Transfer-Encoding`` and
``Content-Length`` is answered 400 and its connection closed (RFC 9112 6.3: the two framings
disagree, a proxy in front may have read the other one: request smuggling), counted with reason
``ambiguous_framing``. Both answers' JSON bodies are the caller's (``error_body``: the worker's
OpenAI shape, the router's shape of the path's API), so this package imports neither.

All of it runs on the event loop: a connection's timers are its own protocol object's, armed
and cancelled only from the loop's callbacks (``connection_made``, ``data_received``, the
timers), so nothing here is shared between threads.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from hicache.ratelimited_log import RateLimitedLog

TIMED_OUT = "hicache.timed_out"  # scope["state"] key: why the protocol closed the connection (http_io)
REASONS = ("header_timeout", "body_timeout", "body_idle_timeout", "ambiguous_framing")
# (status, message, the request's path: "" before its head arrived) -> the JSON body of the answer
ErrorBody = Callable[[int, str, str], dict[str, Any]]


@dataclass(frozen=True)
class ReadTimeouts:
    header_s: float  # the request head, from the connection's (or the next request's) first byte
    body_s: float  # the whole body, from the end of the head
    body_idle_s: float  # between two reads of the body


def raw_response(status: int, reason: str, body_json: dict[str, Any]) -> bytes:
    """A whole HTTP/1.1 answer with this JSON body that closes the connection."""
    body = json.dumps(body_json).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body


class FramingGuard:
    """ASGI: 400 and close for a request that gives both Transfer-Encoding and Content-Length."""

    def __init__(self, app: ASGIApp, on_refused: Callable[[str, Any], None], error_body: ErrorBody) -> None:
        self.app, self.on_refused, self.error_body = app, on_refused, error_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            names = {name.lower() for name, _ in scope["headers"]}
            if b"transfer-encoding" in names and b"content-length" in names:
                self.on_refused("ambiguous_framing", scope.get("client"))
                body = json.dumps(self.error_body(400, "the request has both Transfer-Encoding and Content-Length "
                                                       "(RFC 9112 6.3): send one of them", scope["path"])).encode()
                await send({"type": "http.response.start", "status": 400,
                            "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


class TimedH11Protocol(H11Protocol):
    """One connection (uvicorn makes one per connection). ``protocol_class`` binds the class
    attributes; the timers below belong to this connection and run on the event loop only."""

    timeouts: ClassVar[ReadTimeouts]
    on_closed: ClassVar[Callable[[str, Any], None]]  # (reason of REASONS, client address): counts and logs
    guard: ClassVar[Callable[[ASGIApp], ASGIApp]]
    error_body: ClassVar[ErrorBody]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.app = type(self).guard(self.app)
        self.head_timer: asyncio.TimerHandle | None = None
        self.body_timer: asyncio.TimerHandle | None = None
        self.idle_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.head_timer = self.loop.call_later(self.timeouts.header_s, self.head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self.cancel_timers(head=True, body=True)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self.head_timer is None:  # a new request begins
            self.head_timer = self.loop.call_later(self.timeouts.header_s, self.head_timed_out)
        super().data_received(data)
        if self.conn.their_state is h11.SEND_BODY and self.idle_timer is not None:  # body bytes came
            self.idle_timer.cancel()
            self.idle_timer = self.loop.call_later(self.timeouts.body_idle_s, self.body_timed_out, True)

    def handle_events(self) -> None:
        super().handle_events()
        state = self.conn.their_state
        if state is not h11.IDLE:
            self.cancel_timers(head=True)
        if state is h11.SEND_BODY:
            if self.body_timer is None:
                self.body_timer = self.loop.call_later(self.timeouts.body_s, self.body_timed_out, False)
                self.idle_timer = self.loop.call_later(self.timeouts.body_idle_s, self.body_timed_out, True)
        else:
            self.cancel_timers(body=True)

    def cancel_timers(self, head: bool = False, body: bool = False) -> None:
        for name in (("head_timer",) if head else ()) + (("body_timer", "idle_timer") if body else ()):
            timer = getattr(self, name)
            if timer is not None:
                timer.cancel()
                setattr(self, name, None)

    def head_timed_out(self) -> None:
        self.head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self.close_for("header_timeout", f"the request head (request line and headers) did not arrive within "
                                         f"{self.timeouts.header_s:g} s (header_timeout_s)")

    def body_timed_out(self, idle: bool) -> None:
        if idle:
            self.idle_timer = None
        else:
            self.body_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        if idle and self.flow.read_paused:  # the server is not reading (flow control): not the client's gap
            self.idle_timer = self.loop.call_later(self.timeouts.body_idle_s, self.body_timed_out, True)
            return
        if idle:
            self.close_for("body_idle_timeout", f"no byte of the request body arrived for "
                                                f"{self.timeouts.body_idle_s:g} s (body_idle_timeout_s)")
        else:
            self.close_for("body_timeout", f"the request body did not arrive within {self.timeouts.body_s:g} s "
                                           "(body_timeout_s)")

    def close_for(self, reason: str, message: str) -> None:
        """Answer 408 unless an answer has started, and close the connection."""
        self.cancel_timers(head=True, body=True)
        type(self).on_closed(reason, self.client)
        cycle = self.cycle if self.conn.their_state is h11.SEND_BODY else None
        if cycle is None or not cycle.response_started:
            path = cycle.scope.get("path", "") if cycle is not None else ""
            self.transport.write(raw_response(408, "Request Timeout", type(self).error_body(408, message, path)))
        if cycle is not None and not cycle.response_complete:  # the app sees a disconnect, and why
            state = cycle.scope.get("state")
            if isinstance(state, dict):
                state[TIMED_OUT] = message
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()


def protocol_class(timeouts: ReadTimeouts, count: Callable[[str], None], error_body: ErrorBody,
                   log: logging.Logger, counted_in: str | None = None) -> type[TimedH11Protocol]:
    """The protocol class to give uvicorn (``http=``): these timeouts; ``count(reason)`` for each
    connection closed (or request refused) for a reason of ``REASONS`` (on the event loop);
    ``error_body`` builds the 408's and 400's JSON; the closes are logged on ``log``, at most once
    per 10 s per reason, naming ``counted_in`` (where they are counted) when given."""
    warn = RateLimitedLog(log)
    where_counted = f" ({counted_in})".replace("%", "%%") if counted_in else ""

    def on_closed(reason: str, client: Any) -> None:
        count(reason)
        where = f"{client[0]}:{client[1]}" if client else "a client"
        warn.warning(reason, "closed the connection of %s: %s" + where_counted, where, reason)

    def guard(app: ASGIApp) -> ASGIApp:
        return FramingGuard(app, on_closed, error_body)

    return type("TimedH11Protocol", (TimedH11Protocol,), {
        "timeouts": timeouts, "on_closed": staticmethod(on_closed), "guard": staticmethod(guard),
        "error_body": staticmethod(error_body)})
