"""The worker's ``Host`` check (the rules and why: common/host_policy.py): a request whose ``Host``
names a host this server does not answer to gets a 403 naming the header."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from common.host_policy import OPEN_PATHS, HostPolicy, parse_allowed_hosts
from serving.server.http_io import asgi_refuse

__all__ = ["HostPolicy", "TrustedHostMiddleware", "parse_allowed_hosts"]


class TrustedHostMiddleware:
    """403 for a request whose ``Host`` names a host this server does not answer to."""

    def __init__(self, app: ASGIApp, policy: HostPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        host = dict(scope["headers"]).get(b"host")
        if host is None or self.policy.allows(host.decode("latin-1")):
            return await self.app(scope, receive, send)
        shown = host.decode("latin-1")[:200]
        await asgi_refuse(send, 403, f"the Host header {shown!r} names a host this server does not answer to "
                                     "(DNS rebinding guard); start it with --allowed-hosts to add names")
