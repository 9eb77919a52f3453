"""One line and one count per HTTP request, and a warning per kind of server error.

- ``hicache_http_requests_total{route,method,status}`` and
  ``hicache_http_request_duration_seconds{route,method}`` (serving.server.metrics): ``route`` is
  the route's template (``/v1/chat/completions``, ``/cache/pin``), never the raw path, and
  ``unmatched`` for paths no route serves; ``method`` is one of HTTP's own or ``other``: both
  label sets stay bounded whatever clients send;
- an access line per request on the ``hicache.access`` logger, at INFO (as uvicorn's access
  log, which the server turns off; ``--no-access-log`` turns this one off too):
  ``127.0.0.1:50312 "POST /v1/chat/completions" 200 0.412s``; the route template again, so a
  hostile path never reaches the log. Probes and scrapes (/health, /metrics) log at DEBUG;
- every 5xx logged at WARNING with its reason (the error body's message), at most once per
  10 s per method, route and status (hicache.ratelimited_log: the next one says how many were
  held back), whether or not the access log is on.

A request that ends without an answer (the client left before the server answered) counts
as status 499 (nginx's "client closed request"); one whose handler raised, as 500.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hicache.ratelimited_log import RateLimitedLog
from serving.server.metrics import ServerMetrics

log = logging.getLogger("hicache.access")
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
QUIET_ROUTES = frozenset({"/health", "/metrics"})  # probes and scrapes: DEBUG
UNMATCHED = "unmatched"
CLIENT_GONE = 499
ERROR_BODY_BYTES = 4096  # of a 5xx answer, kept to read its reason
ERROR_LOG_INTERVAL_S = 10.0


def route_template(scope: Scope, routes: Sequence[BaseRoute]) -> str:
    """The template of the route that served (or would serve) this request."""
    route = scope.get("route")
    if route is None:  # refused before routing (API key, cross-origin): find the route it asked for
        for candidate in routes:
            match, _ = candidate.matches(scope)
            if match is not Match.NONE:
                route = candidate
                if match is Match.FULL:
                    break
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else UNMATCHED


def error_reason(body: bytes) -> str:
    """The message of an error body (OpenAI's ``{"error": {"message"}}``, FastAPI's ``detail``)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body[:200].decode("utf-8", "replace") or "(no body)"
    if isinstance(data, dict):
        err = data.get("error")
        msg = err.get("message") if isinstance(err, dict) else data.get("detail", err)
        if msg is not None:
            return str(msg)[:500]
    return str(data)[:200]


class AccessLogMiddleware:
    """Pure ASGI (streams pass through unbuffered; of a 5xx only its first ERROR_BODY_BYTES
    are kept). Added last in create_app, so it runs first: refusals by the other middlewares
    are counted too. Each request's state lives in its own ``__call__``; the only shared state
    is the metrics and the rate limiter, both safe on the event loop."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, routes: Sequence[BaseRoute], enabled: bool = True) -> None:
        self.app, self.metrics, self.routes, self.enabled = app, metrics, routes, enabled
        self.errors = RateLimitedLog(log, ERROR_LOG_INTERVAL_S)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.monotonic()
        status = CLIENT_GONE
        error_body = bytearray()

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body" and status >= 500 and len(error_body) < ERROR_BODY_BYTES:
                error_body.extend(message.get("body", b"")[: ERROR_BODY_BYTES - len(error_body)])
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        except BaseException as e:
            if status == CLIENT_GONE:
                status = 500
                error_body.extend(f"the handler raised {type(e).__name__}".encode())
            raise
        finally:
            self._record(scope, status, time.monotonic() - start, bytes(error_body))

    def _record(self, scope: Scope, status: int, duration_s: float, error_body: bytes) -> None:
        route = route_template(scope, self.routes)
        method = scope.get("method", "")
        method = method if method in METHODS else "other"
        self.metrics.on_request(route, method, status, duration_s)
        if self.enabled:
            client = scope.get("client")
            where = f"{client[0]}:{client[1]}" if client else "-"
            level = logging.DEBUG if route in QUIET_ROUTES and status < 500 else logging.INFO
            log.log(level, '%s "%s %s" %d %.3fs', where, method, route, status, duration_s)
        if status >= 500:
            self.errors.warning(f"{method} {route} {status}", '"%s %s" answered %d: %s', method, route, status,
                                error_reason(error_body))
