"""How the router reads a connection: the worker's HTTP edge (edge/http_protocol.py) with the
router's read timeouts (``header_timeout_s``, ``body_timeout_s``, ``body_idle_timeout_s``, the
workers' defaults) and error shapes.

A head or body a client sends too slowly (slowloris, a ``Content-Length`` larger than the body,
a chunked body without its last chunk) gets a 408 and its connection is closed; a request with
both ``Transfer-Encoding`` and ``Content-Length`` a 400, closed too (request smuggling). The
bodies are in the shape of the path's API (router/errors.py: OpenAI's before the head has
arrived). The router has no ``/metrics``: each close is logged (``hicache.router``, at most once
per 10 s per reason, with how many were held back) and counted by ``count(reason)``, which the
uvicorn event loop calls (``RouterThread.connections_closed``).

Both ways of running a router serve with :func:`protocol_class`: ``hicache router``
(router/cli.py) and ``RouterThread`` (router/embedded.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from edge.http_protocol import ReadTimeouts, TimedH11Protocol
from edge.http_protocol import protocol_class as edge_protocol_class
from router.config import RouterConfig
from router.errors import shape_for

log = logging.getLogger("hicache.router")


def error_body(status: int, message: str, path: str) -> dict[str, Any]:
    """The router's error body for ``path`` (OpenAI's when the path is not known yet)."""
    return shape_for(path).body(status, message)


def protocol_class(cfg: RouterConfig, count: Callable[[str], None] | None = None) -> type[TimedH11Protocol]:
    """The uvicorn ``http=`` class for a router with config ``cfg``; ``count(reason)`` per close
    (edge.http_protocol.REASONS), on the event loop."""
    timeouts = ReadTimeouts(cfg.header_timeout_s, cfg.body_timeout_s, cfg.body_idle_timeout_s)
    return edge_protocol_class(timeouts, count or (lambda reason: None), error_body, log)
