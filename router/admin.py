"""Who may administer the router: add, remove and flush workers, and see them.

The admin routes (:data:`ADMIN_ROUTES`: ``/add_worker``, ``/remove_worker``, ``/flush_cache``,
``/list_workers`` and ``/get_load``, which name the workers' URLs; the PD versions in
router/pd_app.py alike) need, where the router has keys (``api_key`` or ``api_keys_file``),
the router's ``api_key``, the admin key: a tenant's key gets a 403 naming that, and with
tenants but no ``api_key`` nobody may (403: this router has no admin key). A router with no key
at all takes no workers over HTTP unless it was started with ``--enable-worker-registration``
(``/add_worker`` and ``/remove_worker`` answer 403 saying so); its workers come from
``--worker-urls`` or the config, and its ``/flush_cache`` and lists stay open, as a keyless
worker's routes are.

So the workers' key (``worker_api_key``, else ``api_key``) only ever goes to workers the admin
configured: the config's and flags', and those an admin-authenticated ``/add_worker`` added. A
worker registered through ``--enable-worker-registration`` gets no key either, since such a
router has none (router/config.py refuses that flag beside a ``worker_api_key`` without an
``api_key``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from router.errors import error

if TYPE_CHECKING:
    from router.config import RouterConfig
    from router.tenancy import Tenancy

REGISTRATION_ROUTES = frozenset({"/add_worker", "/remove_worker"})
ADMIN_ROUTES = REGISTRATION_ROUTES | {"/flush_cache", "/list_workers", "/get_load"}
OPEN_PATHS = frozenset({"/health"})  # no key needed


def refusal(cfg: RouterConfig, tenancy: Tenancy, path: str, admin: bool) -> JSONResponse | None:
    """None when a caller (``admin``: it sent the router's api_key) may use the admin route
    ``path``; else the 403 naming why."""
    if tenancy.enforced:
        if admin:
            return None
        if tenancy.expected is None:
            return error(403, f"{path} needs the router's admin key, and this router has no admin key (it has "
                              "tenants only: start it with --api-key to administer it over HTTP)", path)
        return error(403, f"{path} needs the router's admin key (its --api-key); a tenant's key may not "
                          "administer the router", path)
    if path in REGISTRATION_ROUTES and not cfg.enable_worker_registration:
        return error(403, f"{path}: this router takes no workers over HTTP (it has no --api-key, so anyone could "
                          "add one): give the workers with --worker-urls, start it with --api-key (then "
                          f"{path} takes that key), or with --enable-worker-registration to let any client "
                          "that reaches it add and remove workers", path)
    return None


class KeyMiddleware:
    """The key check of every route but ``/health`` (where the router has keys: ``Authorization:
    Bearer <key>``, the scheme in any case (RFC 7235), or Anthropic's ``x-api-key: <key>``; the
    router's key or a tenant's, compared in constant time, router/tenancy.py), then the admin
    routes' rule (:func:`refusal`). Sets ``request.state.tenant`` and ``request.state.admin``."""

    def __init__(self, app: ASGIApp, cfg: RouterConfig, tenancy: Tenancy) -> None:
        self.app = app
        self.cfg = cfg
        self.tenancy = tenancy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        state: dict[str, Any] = scope.setdefault("state", {})
        admin = False
        if self.tenancy.enforced:
            headers = Headers(scope=scope)
            caller = self.tenancy.identify(headers.get("authorization", ""), headers.get("x-api-key", ""))
            if not caller.allowed:
                answer = error(401, "missing or invalid API key (send Authorization: Bearer <key>)", path)
                await answer(scope, receive, send)
                return
            state["tenant"], state["admin"] = caller.tenant, caller.admin
            admin = caller.admin
        if path in ADMIN_ROUTES and (answer := refusal(self.cfg, self.tenancy, path, admin)) is not None:
            await answer(scope, receive, send)
            return
        await self.app(scope, receive, send)
