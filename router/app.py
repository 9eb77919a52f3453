"""The router's FastAPI app: the workers' routes, proxied, plus worker administration.

Proxied with routing: POST /v1/chat/completions, /v1/completions, /generate, Anthropic's
/v1/messages and Ollama's /api/chat and /api/generate (streamed unless ``"stream": false``,
Ollama's default). Sessions: /open_session (a worker chosen by the policy; the returned id
sticks to it), /close_session (to the session's worker). Forwarded to any available worker:
/v1/models, /get_model_info, /health_generate, /v1/messages/count_tokens, /api/tags, /api/show,
/api/version. Broadcast: /flush_cache. Router-own: /health (200 while any worker is available;
it names the router in ``x-hicache-router-id``), /get_load, /add_worker and /remove_worker
(``?url=`` or ``{"url": ...}``; ``&drain=true``: a warm drain, router/worker_drain.py), /list_workers.
Those five are the admin routes: the admin key where the router has keys, and no registration
without keys unless ``enable_worker_registration`` (router/admin.py). Bodies are read at most
``max_request_bytes`` (413) and parsed at most ``max_json_depth`` deep (400; router/bodies.py).
Every answer that came from a worker names it in ``x-hicache-worker``. The router's own errors
(and unknown routes) answer in the shape of the path's API, as the workers do (router/errors.py).
The KV control API (/cache/lookup, /cache/prefetch, /cache/pin) goes to the worker that holds
the prefix (router/kv_routes.py). With ``api_keys_file``, tenant keys are accepted and routing
keys on each request's tenant + cache_salt scope (router/tenancy.py). A ``Host`` the router
does not answer to (DNS rebinding) and a cross-origin state-changing request are 403s, as on
the workers (router/trusted_hosts.py; ``allowed_hosts`` adds names).
With ``pd_disaggregation``, router/pd.py forwards and router/pd_app.py has the admin routes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from router.admin import KeyMiddleware
from router.bodies import BodyLimitMiddleware, json_object
from router.config import RouterConfig
from router.errors import error, install
from router.kv_routes import add_kv_routes
from router.pd_app import PDRouterState, add_pd_routes
from router.policies import RouteRequest
from router.state import RouterState
from router.tenancy import scope_of, session_key
from router.trusted_hosts import BrowserGuardMiddleware, HostPolicy
from router.urls import ROUTER_ID_HEADER, check_not_self, check_url, normal_url
from router.worker_drain import DrainError, drain_worker

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/generate", "/v1/messages", "/api/chat",
                    "/api/generate")
PD_GENERATION_PATHS = GENERATION_PATHS[:3]  # the prefill/decode pair speaks OpenAI and SGLang only
STREAM_BY_DEFAULT = ("/api/chat", "/api/generate")  # Ollama streams unless told not to
ANY_WORKER_ROUTES = {"/v1/models": ["GET"], "/get_model_info": ["GET"], "/health_generate": ["GET", "POST"],
                     "/v1/messages/count_tokens": ["POST"], "/api/tags": ["GET"], "/api/show": ["POST"],
                     "/api/version": ["GET"]}


def create_app(cfg: RouterConfig) -> FastAPI:
    if cfg.pd_disaggregation:
        state: RouterState = PDRouterState(cfg)
    else:
        state = RouterState(cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        yield
        await state.stop()

    app = FastAPI(title="HiCache router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = state
    install(app, {path: f"{path} is not served with --pd-disaggregation (the prefill/decode pair speaks OpenAI's and "
                        f"SGLang's generation routes: {', '.join(PD_GENERATION_PATHS)})"
                  for path in GENERATION_PATHS if path not in PD_GENERATION_PATHS} if cfg.pd_disaggregation else None)

    # middleware added last runs first: a rebinding page or a cross-origin POST never reaches the key
    # check, and a request without a valid key (or a tenant's on an admin route) never has its body read
    app.add_middleware(BodyLimitMiddleware, limit=cfg.max_request_bytes)
    app.add_middleware(KeyMiddleware, cfg=cfg, tenancy=state.tenancy)
    app.add_middleware(BrowserGuardMiddleware, policy=HostPolicy(cfg.host, cfg.allowed_hosts))

    async def generation(request: Request) -> Response:
        raw = await request.body()
        path = request.url.path
        body = json_object(raw, path, cfg.max_json_depth)
        if not isinstance(body, dict):
            return body
        route = await state.route(path, body, request, len(raw))
        stream = body.get("stream", path in STREAM_BY_DEFAULT) is True
        return await state.forwarder.forward(path, raw, state.headers(request), route, stream)

    for path in PD_GENERATION_PATHS if cfg.pd_disaggregation else GENERATION_PATHS:
        app.add_api_route(path, generation, methods=["POST"])

    async def to_any(request: Request) -> Response:
        avail = state.pool.available()
        if not avail:
            return error(503, "no worker is available", request.url.path)
        w = min(avail, key=lambda w: w.load)
        body = await request.body() if request.method == "POST" else None
        return await state.forwarder.call(w, request.method, request.url.path, body, state.headers(request))

    for path, methods in ANY_WORKER_ROUTES.items():
        app.add_api_route(path, to_any, methods=methods)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.pool.available() else 503,
                        headers={ROUTER_ID_HEADER: state.router_id})  # so it never takes itself as a worker

    @app.get("/get_load")
    async def get_load() -> dict[str, Any]:
        return {"workers": {w.url: w.load for w in state.pool.workers.values()}}

    @app.post("/open_session")
    async def open_session(request: Request) -> Response:
        raw = await request.body()
        body = json_object(raw, "/open_session", cfg.max_json_depth) if raw.strip() else {}
        if not isinstance(body, dict):
            return body
        sid = body.get("session_id")
        avail = state.pool.available()
        if not avail:
            return error(503, "no worker is available")
        scope = scope_of(getattr(request.state, "tenant", None), {})
        w = state.policy.select(RouteRequest("", None, session_key(scope, sid)), avail)
        resp = await state.forwarder.call(w, "POST", "/open_session", raw or None, state.headers(request))
        if resp.status_code == 200:
            state.forwarder.sessions.owner[session_key(scope, json.loads(resp.body))] = w.url
        return resp

    @app.post("/close_session")
    async def close_session(request: Request) -> Response:
        raw = await request.body()
        body = json_object(raw, "/close_session", cfg.max_json_depth)
        if not isinstance(body, dict):
            return body
        sid = body.get("session_id")
        scope = scope_of(getattr(request.state, "tenant", None), {})
        url = state.forwarder.sessions.owner.pop(session_key(scope, sid), None) if isinstance(sid, str) else None
        w = state.pool.workers.get(url) if url else None
        if w is None:
            return error(404, f"unknown session {sid!r}")
        return await state.forwarder.call(w, "POST", "/close_session", raw, state.headers(request))

    @app.post("/flush_cache")  # state-changing: POST only (a GET is a 405), like the workers
    async def flush_cache(request: Request) -> Response:
        headers = state.forwarder.headers_for(request.headers)
        workers = state.pool.available()
        answers = await asyncio.gather(
            *(state.forwarder.call(w, "POST", "/flush_cache", None, headers) for w in workers)
        )
        for w in workers:
            state.policy.forget(w.url)
        ok = all(a.status_code == 200 for a in answers)
        return JSONResponse(
            {"success": ok, "workers": {w.url: a.status_code for w, a in zip(workers, answers, strict=True)}},
            status_code=200 if ok else 502,
        )

    async def _url(request: Request) -> str | Response:
        """The worker URL of an admin call: ``?url=``, else the JSON body's ``url``."""
        url = request.query_params.get("url")
        raw = await request.body()
        if url is None and raw.strip():
            body = json_object(raw, request.url.path, cfg.max_json_depth)
            if not isinstance(body, dict):
                return body
            url = body.get("url")
        return url if isinstance(url, str) else ""

    @app.post("/add_worker")
    async def add_worker(request: Request) -> Response:
        url = await _url(request)
        if isinstance(url, Response):
            return url
        try:
            url = check_not_self(check_url(url), cfg.host, cfg.port)
        except ValueError as e:
            return error(400, str(e))
        if await state.pool.is_this_router(url):
            return error(400, f"worker url {url} is this router itself (its /health answered with this router's "
                              "id): a router cannot be its own worker")
        w = state.pool.add(url)
        await state.pool.check_one(w)
        return JSONResponse({"success": True, "worker": w.view()})

    @app.post("/remove_worker")
    async def remove_worker(request: Request) -> Response:
        url = await _url(request)
        if isinstance(url, Response):
            return url
        url = normal_url(url)
        if request.query_params.get("drain", "").lower() in ("1", "true", "yes"):  # warm drain: router/worker_drain.py
            try:
                return JSONResponse(await drain_worker(state, url))
            except DrainError as e:
                return error(e.status, str(e))
        if not state.pool.remove(url):
            return error(404, f"no worker {url[:300]!r}")
        return JSONResponse({"success": True})

    @app.get("/list_workers")
    async def list_workers() -> dict[str, Any]:
        return {
            "policy": cfg.policy,
            "cache_view": cfg.cache_view,
            "workers": [w.view() for w in state.pool.workers.values()],
            "sessions": len(state.forwarder.sessions.owner),
            "policy_stats": state.policy.stats(),
            "fleet": state.fleet_stats(),
        }

    add_kv_routes(app, state)

    if cfg.pd_disaggregation:
        add_pd_routes(app, state)  # type: ignore[arg-type]  # PD's versions of the admin routes
    return app
