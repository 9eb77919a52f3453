"""Operational routes: health, model/server info, cache flush, sessions, metrics, debug.

``/flush_cache``, ``/get_server_info`` (``/server_info``), ``/metrics``, ``/cache_events`` and
``/debug/*`` are admin routes: they act on the whole server or show every tenant's state, so
wherever keys are configured they need the admin key, the server's ``--api-key`` (a tenant's key
gets a 403; serving/server/app.py's ``ADMIN_PATHS`` declares them). ``/get_load`` (counts only,
what a router balances on), ``/get_model_info``, the health routes and sessions are every key's.
A session id is its tenant's own (serving/scoped_ids.py): two tenants may open the same id.

``GET /health`` is 200 while the engine process runs and makes progress: 503 once it is gone,
or once the watchdog saw no progress for ``watchdog_timeout`` seconds with work pending, or the
engine's loop not turning for that long, pending work or not (see serving.server.watchdog); it
turns 200 again as soon as the engine moves. It never waits on the engine. Routes that change
state (``/flush_cache``, sessions, ``/debug/check_integrity``) are POST only. Every route that
asks the engine something gets a 504 when it does not answer within ``engine_call_timeout_s``,
and a 503 at once while it is stalled; ``/metrics`` waits for the engine at most a couple of
seconds, then serves the HTTP process's own metrics, ``hicache_engine_stall_seconds`` and the
engine's last snapshot marked stale.

``POST /debug/check_integrity`` runs the engine's ``check_integrity()`` (every pool: free +
cached + in use = total) and answers ``{"ok": true, ...stats}`` or ``{"ok": false, "error":
<assertion text>, ...}``. It exists only when the server runs with
``--enable-debug-endpoints`` (server.enable_debug_endpoints), because it walks the whole tree
and exposes internals; otherwise the route is a 404 like any unknown path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from serving import ipc as m
from serving.scoped_ids import session_key
from serving.server.cache_api import Retention
from serving.server.context import DRAINING, get_ctx
from serving.server.drain_api import draining_health
from serving.server.errors import APIError
from serving.server.http_io import parse_body, unless_disconnected
from serving.server.protocol import CloseSessionRequest, OpenSessionRequest
from serving.server.req_handle import run_all
from serving.server.session_ids import check_session_id
from serving.server.tenants import CURRENT
from serving.structs.sampling_params import SamplingParams

router = APIRouter()
VERSION = "0.1.0"
METRICS_ENGINE_WAIT_S = 2.0  # how long a /metrics scrape waits for the engine's snapshot


@router.get("/health")
async def health(request: Request) -> Response:
    ctx = get_ctx(request)
    client = ctx.client
    if not client.alive:
        raise APIError(503, "the engine process is not running")
    if ctx.draining:  # how a router learns of a drain (router/worker_drain.py)
        return draining_health()
    if client.stalled:
        raise APIError(503, client.stall_message())
    return Response(status_code=200)


@router.api_route("/health_generate", methods=["GET", "POST"])
async def health_generate(request: Request) -> Response:
    """Runs a one-token greedy generation through the engine (504 past ``engine_call_timeout_s``)."""
    ctx = get_ctx(request)
    req = m.GenerateReq(
        rid=f"health-{uuid.uuid4().hex}",
        input_ids=[0],
        sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0),
    )
    timeout = ctx.server.engine_call_timeout_s
    try:
        [st] = await unless_disconnected(request, asyncio.wait_for(run_all(ctx.client, [req]), timeout))
    except TimeoutError:
        raise APIError(504, f"the health generation took over {timeout:g} s (engine_call_timeout_s)") from None
    if len(st.output_ids) != 1:
        raise APIError(503, f"health generation produced {len(st.output_ids)} tokens")
    return Response(status_code=200)


@router.get("/get_model_info")
async def get_model_info(request: Request) -> dict[str, Any]:
    info = get_ctx(request).info
    return {
        "model_path": info["model_path"],
        "tokenizer_path": info["tokenizer_path"],
        "is_generation": True,
        "served_model_name": info["served_model_name"],
        "context_length": info["context_len"],
        "vocab_size": info["vocab_size"],
    }


@router.get("/get_server_info")
@router.get("/server_info")
async def get_server_info(request: Request) -> dict[str, Any]:
    ctx = get_ctx(request)
    server = dataclasses.asdict(ctx.server)
    if server.get("api_key"):
        server["api_key"] = "***"
    stats = await ctx.client.call(m.Stats)
    return {
        "version": VERSION,
        **dataclasses.asdict(ctx.engine_config),
        "server": server,
        "engine": ctx.info,
        "disaggregation_mode": ctx.server.disaggregation_mode,
        "disaggregation_bootstrap_port": ctx.server.disaggregation_bootstrap_port,
        "internal_states": [stats],
    }


@router.post("/flush_cache")
async def flush_cache(request: Request, clear_storage: bool = False) -> dict[str, Any]:
    """SGLang's answer plus what the flush kept (pin leases and breakpoints keep their pages:
    ``kept_leases``, ``kept_breakpoints``, ``kept_pinned_pages``, serving/cache/kv_control.py).
    ``?clear_storage=true``: L3 too (every page of this server's store; 400 without L3). As SGLang's,
    a plain flush leaves L3 as it is: another server sharing the store may still read it."""
    return await _flush(request, clear_storage)


@router.post("/hicache/storage-backend/clear")
@router.post("/clear_hicache_storage_backend")
async def clear_hicache_storage(request: Request) -> dict[str, Any]:
    """SGLang's routes that clear the L3 store: here a flush of every tier (the tree must forget the
    pages it had on L3), i.e. ``/flush_cache?clear_storage=true``."""
    return await _flush(request, True)


async def _flush(request: Request, clear_storage: bool) -> dict[str, Any]:
    ctx = get_ctx(request)
    if clear_storage and not ctx.engine_config.cache.storage_enabled:
        raise APIError(400, "this server has no L3 tier to clear (--hicache-storage-backend)", param="clear_storage")
    if clear_storage and ctx.engine_config.model.tp_size > 1:
        raise APIError(400, "clearing L3 is not supported with tensor parallelism", param="clear_storage")
    kept = await ctx.client.call(m.FlushCache, clear_storage=clear_storage)
    if not kept:
        raise APIError(400, "cannot flush the cache while requests are running or waiting")
    return {"success": True, "message": "Cache flushed.", **kept}


@router.post("/open_session")
async def open_session(request: Request) -> JSONResponse:
    """Returns the session id as a JSON string (as SGLang does); takes an optional ``session_id``."""
    ctx = get_ctx(request)
    if ctx.draining:  # a drain's report lists the open sessions: none may open after it
        raise APIError(503, DRAINING)
    empty = request.headers.get("content-length") in (None, "0")
    body = (
        OpenSessionRequest()
        if empty
        else await parse_body(request, OpenSessionRequest, ctx.server.max_request_bytes, ctx.server.max_json_depth)
    )
    if body.session_id is not None:  # 1-256 of [A-Za-z0-9._:-]; 409 when open, 429 at a cap (kv_sessions)
        check_session_id(body.session_id)
    retention = _retention(body.retention)
    tenant = None if CURRENT.get() is None else CURRENT.get().name
    sid = body.session_id or uuid.uuid4().hex  # the engine's key is the tenant's (serving/scoped_ids.py)
    await ctx.client.call(m.OpenSession, session_id=session_key(tenant, sid), retention=retention, tenant=tenant)
    return JSONResponse(sid)


def _retention(hints: Any) -> dict[str, Any] | None:
    """``/open_session``'s ``retention`` hints, validated (serving/server/cache_api.py's Retention)."""
    if hints is None:
        return None
    try:
        return Retention.model_validate(hints).model_dump(exclude_none=True)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in ("retention", *err["loc"]))
        raise APIError(400, f"{where}: {err['msg']}", param="retention") from None


@router.post("/close_session")
async def close_session(request: Request) -> dict[str, Any]:
    ctx = get_ctx(request)
    body = await parse_body(request, CloseSessionRequest, ctx.server.max_request_bytes, ctx.server.max_json_depth)
    check_session_id(body.session_id)
    tenant = None if CURRENT.get() is None else CURRENT.get().name
    await ctx.client.call(m.CloseSession, session_id=session_key(tenant, body.session_id), tenant=tenant)
    return {"success": True}


@router.get("/get_load")
async def get_load(request: Request) -> dict[str, Any]:
    """Running + waiting requests in the engine (what a router balances on)."""
    stats = await get_ctx(request).client.call(m.Stats)
    running, waiting = int(stats["running"]), int(stats["waiting"])
    return {"running": running, "waiting": waiting, "load": running + waiting}


@router.get("/cache_events")
async def cache_events(request: Request, since: int = 0, epoch: str | None = None) -> dict[str, Any]:
    """Pages added to / evicted from L1 and L2 after event ``since`` (see serving/engine/cache_events.py);
    a snapshot instead when ``epoch`` is not the engine's or the log lost events. 404 unless the
    server runs with --enable-cache-events."""
    return await get_ctx(request).client.call(m.CacheEvents, since=since, epoch=epoch)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Answers within METRICS_ENGINE_WAIT_S: the engine's snapshot when it answers by then, else
    (gone, stalled, in a long forward pass) the last one marked stale, with the HTTP side's own."""
    ctx = get_ctx(request)
    client, snapshot = ctx.client, None
    if client.alive and not client.stalled:
        try:
            snapshot = await client.call(m.Stats, timeout=min(METRICS_ENGINE_WAIT_S, ctx.server.engine_call_timeout_s))
        except APIError:
            pass
    return Response(ctx.metrics.render(snapshot, client.stall_s()), media_type=CONTENT_TYPE_LATEST)


@router.post("/debug/check_integrity")
async def check_integrity(request: Request) -> dict[str, Any]:
    ctx = get_ctx(request)
    if not ctx.server.enable_debug_endpoints:
        raise APIError(404, "no such route (start the server with --enable-debug-endpoints)")
    return await ctx.client.call(m.CheckIntegrity)
