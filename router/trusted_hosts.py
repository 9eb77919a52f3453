"""The router's browser guards: the ``Host`` check that stops DNS rebinding (common/host_policy.py,
the rules the workers use too), and the cross-origin check.

The router needs both guards itself: it passes on neither the client's ``Host`` nor its
``Origin`` (its calls to a worker name the worker URL's host, e.g. ``127.0.0.1``, and carry no
``Origin``), so the workers' own checks never see what the browser sent. A ``Host`` the router
does not answer to gets a 403 naming the header. Cross-origin: a state-changing request (any
method but GET / HEAD / OPTIONS) whose ``Origin`` names another host than ``Host`` is a 403 (the
router sends no CORS headers, and forwards bodies of any content type, so a form or a text/plain
``fetch`` could otherwise flush the workers' caches or start generations). Clients that are not
browsers send no ``Origin``. Refusals answer in the shape of the path's API (router/errors.py).
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Receive, Scope, Send

from common.host_policy import OPEN_PATHS, HostPolicy, parse_allowed_hosts, same_origin
from router.errors import shape_for

__all__ = ["BrowserGuardMiddleware", "HostPolicy", "parse_allowed_hosts"]
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


async def _refuse(send: Send, path: str, message: str) -> None:
    body = json.dumps(shape_for(path).body(403, message)).encode()
    await send({"type": "http.response.start", "status": 403, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


class BrowserGuardMiddleware:
    """403 for a ``Host`` the router does not answer to, then for a cross-origin state-changing
    request (see the module docstring); runs before the routes and the API-key check."""

    def __init__(self, app: ASGIApp, policy: HostPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        host = headers.get(b"host")
        if host is not None and not self.policy.allows(host.decode("latin-1")):
            shown = host.decode("latin-1")[:200]
            return await _refuse(send, scope["path"], f"the Host header {shown!r} names a host this router does not "
                                                      "answer to (DNS rebinding guard); start it with --allowed-hosts "
                                                      "to add names")
        origin = headers.get(b"origin")
        if scope["method"] not in SAFE_METHODS and origin is not None and not same_origin(origin, host or b""):
            return await _refuse(send, scope["path"],
                                 f"cross-origin request refused (Origin: {origin.decode('latin-1')[:200]})")
        await self.app(scope, receive, send)
