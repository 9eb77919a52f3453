"""The FastAPI application: routers, error handlers, API-key check (admin routes need the admin
key: ``ADMIN_PATHS``), cross-origin and Host checks."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from common.host_policy import same_origin
from common.tenants import TenantTable
from serving.server import (
    admin_api,
    anthropic_api,
    cache_api,
    cache_control,
    drain_api,
    errors,
    native_api,
    ollama_api,
    openai_api,
)
from serving.server.access_log import AccessLogMiddleware
from serving.server.context import ServerContext
from serving.server.http_io import asgi_refuse
from serving.server.tenants import CURRENT
from serving.server.trusted_hosts import HostPolicy, TrustedHostMiddleware

OPEN_PATHS = frozenset({"/health"})
TENANT_HEADER = b"x-hicache-tenant"  # with the admin key: act as that tenant (APIKeyMiddleware)
# Admin routes: they act on the whole server or show every tenant's state. Wherever keys are
# configured they need the admin key, the server's --api-key (APIKeyMiddleware); /get_load stays
# open to every key (a router balances on it; it shows counts only).
ADMIN_PATHS = frozenset({"/drain", "/undrain", "/flush_cache", "/get_server_info", "/server_info", "/metrics",
                         "/cache_events", "/hicache/storage-backend/clear", "/clear_hicache_storage_backend"})
ADMIN_PREFIXES = ("/debug/",)


def is_admin_path(path: str) -> bool:
    return path in ADMIN_PATHS or path.startswith(ADMIN_PREFIXES)


def bearer_token(header: bytes) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header; the scheme is case-insensitive
    (RFC 9110, 11.1). None for another scheme or no token."""
    scheme, _, token = header.strip().partition(b" ")
    token = token.strip()
    return token if scheme.lower() == b"bearer" and token else None


class APIKeyMiddleware:
    """401 unless ``Authorization: Bearer <key>`` (any case of "Bearer"; or Anthropic's
    ``x-api-key: <key>``) names ``api_key`` (the default tenant) or a tenant's key
    (``--api-keys-file``: the request then runs as that tenant, see serving/server/tenants.py);
    /health stays open. Constant-time comparisons.

    ``api_key`` is also the admin key: an admin route (:func:`is_admin_path`) with a tenant's key
    is a 403 naming it, and on a server with tenants but no ``api_key`` every admin route is a 403
    saying so (start it with --api-key). This middleware runs only where a key is configured:
    without keys (a local single user) every route is open.

    ``x-hicache-tenant: <name>`` runs a request made with ``api_key`` (the worker / admin key a
    router holds) as that tenant: how a router re-homes a tenant's sessions and leases on a warm
    drain (router/worker_drain.py). With a tenant's key it is a 403, whatever name it gives (a tenant
    never acts as another); an unknown name is a 400."""

    def __init__(self, app: ASGIApp, api_key: str | None, tenants: TenantTable | None = None) -> None:
        self.app = app
        self.expected = None if api_key is None else api_key.encode()
        self.tenants = tenants

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        token = bearer_token(headers.get(b"authorization", b"")) or headers.get(b"x-api-key", b"").strip() or None
        if token is not None:
            default = self.expected is not None and hmac.compare_digest(token, self.expected)
            tenant = self.tenants.find(token) if self.tenants is not None else None
            if default or tenant is not None:
                if not default and is_admin_path(scope["path"]):
                    return await asgi_refuse(send, 403, self._admin_only(scope["path"]))
                as_tenant = headers.get(TENANT_HEADER)
                if as_tenant is not None:
                    if tenant is not None or self.tenants is None:
                        why = ("needs the server's --api-key" if tenant is not None
                               else "names a tenant, and this server has no --api-keys-file")
                        return await asgi_refuse(send, 403 if tenant is not None else 400,
                                                 f"{TENANT_HEADER.decode()} {why}")
                    tenant = self.tenants.tenants.get(as_tenant.decode("latin-1").strip())
                    if tenant is None:
                        return await asgi_refuse(send, 400, f"{TENANT_HEADER.decode()}: no such tenant")
                reset = CURRENT.set(tenant)
                try:
                    return await self.app(scope, receive, send)
                finally:
                    CURRENT.reset(reset)
        await asgi_refuse(send, 401, "missing or invalid API key (send Authorization: Bearer <key>)",
                      ((b"www-authenticate", b"Bearer"),))

    def _admin_only(self, path: str) -> str:
        if self.expected is None:
            return (f"{path} is an admin route and this server has no admin key: start it with --api-key "
                    "(the admin key) to use it")
        return f"{path} needs the admin key (the server's --api-key); a tenant's key cannot use it"


SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class SameOriginMiddleware:
    """403 for a state-changing request (any method but GET / HEAD / OPTIONS) that a browser
    sent from another origin: its ``Origin`` header names another host than ``Host``.

    The server sends no CORS headers, so no page of another origin can read its answers; but
    a browser sends some POSTs without asking first (a form, or ``fetch`` with no body or a
    text/plain one), and always with ``Origin``: those would flush the cache or start
    generations. JSON routes but Ollama's also require ``Content-Type: application/json``
    (http_io.read_json), which such requests cannot carry. A page whose own name was
    re-pointed at this server (DNS rebinding) is same-origin by this test: TrustedHostMiddleware
    (trusted_hosts.py), which runs before this, refuses its ``Host``. Clients that are not
    browsers (curl, SDKs, the router) send no ``Origin`` and are not affected."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in SAFE_METHODS:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        origin = headers.get(b"origin")
        if origin is None or same_origin(origin, headers.get(b"host", b"")):
            return await self.app(scope, receive, send)
        await asgi_refuse(send, 403, f"cross-origin request refused (Origin: {origin.decode('latin-1')[:200]})")


def create_app(ctx: ServerContext) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx.client.attach(asyncio.get_running_loop())
        watchdog = asyncio.create_task(ctx.client.watch())
        yield
        watchdog.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watchdog

    app = FastAPI(title="HiCache", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = ctx
    errors.install(app)
    for module in (openai_api, native_api, admin_api, cache_api, anthropic_api, ollama_api, cache_control, drain_api):
        app.include_router(module.router)
    if ctx.server.api_key or ctx.tenants is not None:
        app.add_middleware(APIKeyMiddleware, api_key=ctx.server.api_key, tenants=ctx.tenants)
    app.add_middleware(SameOriginMiddleware)  # middleware added later runs earlier: Host before Origin
    app.add_middleware(TrustedHostMiddleware, policy=HostPolicy(ctx.server.host, ctx.server.allowed_hosts))
    app.add_middleware(AccessLogMiddleware, metrics=ctx.metrics, routes=app.routes, enabled=ctx.server.access_log)
    return app
