"""The router's state: the workers, the policy, the cache view, the forwarder and the HTTP client
that every route uses (router/app.py's routes, router/kv_routes.py, and router/pd_app.py's
PDRouterState, which subclasses it). Built in the app's lifespan: it needs the event loop."""

from __future__ import annotations

import asyncio
import gc
import logging
import secrets
from contextlib import suppress
from typing import Any

import httpx
from fastapi import Request

from router.cache_view import CacheView
from router.config import RouterConfig
from router.keypool import DEFAULT_ROUTING_TOKENS, KeyPool
from router.policies import RouteRequest, make_policy
from router.proxy import Forwarder
from router.tenancy import BoundedMap, Tenancy, salted_ids, scope_of, scope_prefix, session_key
from router.worker_drain import on_worker_draining
from router.workers import WorkerPool

log = logging.getLogger("hicache.router")


class RouterState:
    """Everything the routes use; built in the app's lifespan (it needs the event loop)."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.router_id = secrets.token_hex(8)  # its /health says it: the router never takes itself as a worker
        key = cfg.worker_api_key or cfg.api_key
        self.worker_headers = {"authorization": f"Bearer {key}"} if key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        timeout = httpx.Timeout(cfg.request_timeout_s, connect=5.0)
        self.client = httpx.AsyncClient(limits=limits, timeout=timeout)
        self.view = (
            CacheView(self.client, self.worker_headers, cfg.events_poll_interval_s, cfg.l2_weight,
                      cfg.shared_l3_weight, cfg.max_worker_pages)
            if cfg.cache_view == "events"
            else None
        )
        self.tenancy = Tenancy(cfg.api_key, cfg.api_keys_file)
        self.leases: BoundedMap = BoundedMap(cfg.max_leases)  # pin lease id -> worker url
        self.lease_alias: BoundedMap = BoundedMap(cfg.max_leases)  # a drained worker's lease id -> its new id
        self.policy = make_policy(cfg, self.view)
        self.pool = WorkerPool(cfg, self.client, self.worker_headers, self.router_id)
        self.pool.on_reset.append(self.policy.forget)
        if self.view is not None:
            self.view.urls = lambda: [w.url for w in self.pool.workers.values() if w.healthy]
            self.pool.on_reset.append(self.view.forget)
        self.forwarder = self.make_forwarder()
        self.pool.on_reset.append(self.forwarder.sessions.forget_worker)
        self.pool.on_draining.append(lambda url: on_worker_draining(self, url))
        self.keys = KeyPool(None, 0, DEFAULT_ROUTING_TOKENS)
        self._maint: asyncio.Task[None] | None = None

    def make_forwarder(self) -> Forwarder:
        return Forwarder(self.cfg, self.pool, self.policy, self.client, self.worker_headers)

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        for url in self.cfg.worker_urls:
            self.pool.add(url)
        await self.pool.check_health()
        info = await self._worker_model_info()
        budget = self.cfg.max_routing_tokens or info.get("context_length") or DEFAULT_ROUTING_TOKENS
        self.keys = KeyPool(self.cfg.tokenizer_path or info.get("tokenizer_path"), self.cfg.tokenizer_workers,
                            int(budget))
        await self.keys.warm()
        log.info("routing on %s (at most %d of a prompt's)", "token ids" if self.keys.tok is not None else "text",
                 self.keys.max_tokens)
        self.pool.start()
        if self.view is not None:
            self.view.start()
        self._maint = asyncio.create_task(self._maintain())

    async def stop(self) -> None:
        self.keys.shutdown()
        await self.pool.stop()
        if self.view is not None:
            await self.view.stop()
        if self._maint is not None:
            self._maint.cancel()
            with suppress(asyncio.CancelledError):
                await self._maint
        await self.client.aclose()

    async def _maintain(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.eviction_interval_s)
            self.policy.maintain()
            # what survived is long-lived (trees, page sets, sessions): keep it out of the cyclic GC's
            # full scans, which would otherwise stall a routing decision for milliseconds at fleet scale
            gc.freeze()

    async def route(self, path: str, body: dict[str, Any], request: Request, size: int = 0) -> RouteRequest:
        """The request's routing key, ids and session, in its tenant + cache_salt scope (``size``:
        the body's bytes, which pick the key processes' lane, router/keypool.py)."""
        route = await self.keys.for_body(path, body, size)
        scope = scope_of(getattr(request.state, "tenant", None), body)
        if scope is None:
            return route
        return RouteRequest(scope_prefix(scope) + route.key, salted_ids(route.token_ids, scope),
                            session_key(scope, route.session_id), worker_session_id=route.session_id)

    def headers(self, request: Request) -> dict[str, str]:
        """Headers for a worker: a tenant's key is passed on as it came (the worker needs it)."""
        h = self.forwarder.headers_for(request.headers)
        if getattr(request.state, "tenant", None) is not None:
            if "authorization" in request.headers:
                h["authorization"] = request.headers["authorization"]
            else:  # Anthropic's clients send the key as x-api-key
                h.pop("authorization", None)
                h["x-api-key"] = request.headers["x-api-key"]
        return h

    def fleet_stats(self) -> dict[str, Any]:
        owner = self.forwarder.sessions.owner
        return {"sessions": len(owner), "sessions_evicted": owner.evicted, "leases": len(self.leases),
                "leases_evicted": self.leases.evicted, "keyed_off_loop": self.keys.offloaded,
                "keyed_large": self.keys.offloaded_large,
                **(self.view.stats() if self.view is not None else {})}

    async def _worker_model_info(self) -> dict[str, Any]:
        """The first available worker's /get_model_info ({} when none answers)."""
        for w in self.pool.available():
            try:
                r = await self.client.get(w.url + "/get_model_info", headers=self.worker_headers, timeout=5)
                info = r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                continue
            if isinstance(info, dict):
                return {"tokenizer_path": info.get("tokenizer_path") if isinstance(info.get("tokenizer_path"), str)
                        else None, "context_length": info.get("context_length")
                        if type(info.get("context_length")) is int and info["context_length"] > 0 else None}
        return {}
