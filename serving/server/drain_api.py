"""A warm drain: ``POST /drain`` (and SIGTERM with ``--drain-on-shutdown``) takes this worker out of
service without losing its cache (engine side: serving/cache/kv_drain.py); ``POST /undrain`` puts
it back. Both are admin routes: wherever keys are configured they need the admin key, the server's
``--api-key`` (serving/server/app.py's ``ADMIN_PATHS``), since a drain stops every tenant's traffic
and its report lists every tenant's sessions and leases.

1. It stops admitting: every new generation (and /cache/prefetch, /open_session) answers 503 "this
   server is draining", and ``GET /health`` answers 503 with ``{"draining": true}``, which is how a
   router learns of it (router/worker_drain.py re-homes what the report lists).
2. It waits, up to ``timeout_s`` (body field, in [0, 3600]; default ``--drain-timeout-s``; an empty
   body takes the default), for the running and waiting requests to finish; those still running
   then are aborted (their computed pages go into the tree) and counted in ``aborted``.
3. The engine writes every cached L1/L2 page that L3 lacks on to L3 and the answer reports it:
   ``{"draining": true, "l3", "written_pages", "l3_pages", "not_written", "tree_pages", "aborted",
   "sessions": [...], "leases": [...]}`` (sessions and pin leases for another worker to take over:
   what a router needs to re-home them, kv_drain.py).

The body is read as every JSON route's (serving/server/http_io.py: 415 unless JSON, 413 over
``--max-request-bytes``, 400 past ``--max-json-depth``). The server keeps running (draining) until
it is stopped or undrained; a second /drain reports again.

``POST /undrain`` ends a drain: the server admits again and ``/health`` is 200 again; it answers
``{"draining": false}`` (also when it was not draining). While a drain is still running (waiting for
its requests, or persisting) it is a 409: undrain once the drain's report is out. What a router
re-homed stays where it went (the sessions also stay open here until they idle out), and a router
that removed this worker adds it back only when told to (``/add_worker``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from serving import ipc as m
from serving.server.context import DRAINING, ServerContext, get_ctx
from serving.server.errors import APIError
from serving.server.http_io import parse_body
from serving.server.protocol import StrictModel

router = APIRouter()
POLL_S = 0.05


async def _idle(ctx: ServerContext, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        s = await ctx.client.call(m.Stats)
        if s["running"] == 0 and s["waiting"] == 0:
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(POLL_S)


def _hand_back(ctx: ServerContext) -> int:
    """Requests still running at the drain's timeout are answered 503 (a router retries them on
    another worker) and aborted in the engine (their computed pages go into the tree)."""
    handles = list(ctx.client.handles.values())
    for h in handles:
        h.queue.put_nowait(m.Error(503, f"{DRAINING}: this request was still running at the drain's timeout"))
    return len(handles)


async def drain(ctx: ServerContext, timeout_s: float) -> dict[str, Any]:
    """Stop admitting, let the running requests finish (abort what is left at ``timeout_s``),
    persist to L3; the engine's report."""
    ctx.draining = True
    ctx.drains_running += 1
    try:
        aborted = 0
        if not await _idle(ctx, timeout_s):
            aborted = _hand_back(ctx)
            await _idle(ctx, 30.0)
        for _ in range(100):  # an abort lands a loop turn later: the engine answers 409 until then
            try:
                report = await ctx.client.call(m.KVControlCall, op="drain", args={}, tenant=None)
                break
            except APIError as e:
                if e.status != 409:
                    raise
                await asyncio.sleep(POLL_S)
        else:
            raise APIError(503, "the drain could not persist: requests kept running")
    finally:
        ctx.drains_running -= 1
    return {"draining": True, "aborted": aborted, **report}


class DrainRequest(StrictModel):
    timeout_s: float | None = Field(default=None, ge=0, le=3600)


@router.post("/drain")
async def drain_route(request: Request) -> Any:
    ctx = get_ctx(request)
    timeout_s = ctx.server.drain_timeout_s
    empty = request.headers.get("content-length") in (None, "0") and "transfer-encoding" not in request.headers
    if not empty:
        body = await parse_body(request, DrainRequest, ctx.server.max_request_bytes, ctx.server.max_json_depth)
        if body.timeout_s is not None:
            timeout_s = body.timeout_s
    return await drain(ctx, timeout_s)


@router.post("/undrain")
async def undrain_route(request: Request) -> Any:
    ctx = get_ctx(request)
    if ctx.drains_running:
        raise APIError(409, "a drain is still running (waiting for its requests, or persisting): undrain once "
                            "its report is out")
    ctx.draining = False
    return {"draining": False}


def draining_health() -> JSONResponse:
    return JSONResponse({"draining": True, "error": {"message": DRAINING}}, status_code=503)
