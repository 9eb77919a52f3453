"""A warm drain: ``POST /drain`` (and SIGTERM with ``--drain-on-shutdown``) takes this worker out of
service without losing its cache (engine side: serving/cache/kv_drain.py).

1. It stops admitting: every new generation (and /cache/prefetch) answers 503 "this server is
   draining", and ``GET /health`` answers 503 with ``{"draining": true}``, which is how a router
   learns of it (router/drain.py re-homes what the report lists).
2. It waits, up to ``timeout_s`` (body field; default ``--drain-timeout-s``), for the running and
   waiting requests to finish; those still running then are aborted (their computed pages go into
   the tree) and counted in ``aborted``.
3. The engine writes every cached L1/L2 page that L3 lacks on to L3 and the answer reports it:
   ``{"draining": true, "l3", "written_pages", "l3_pages", "not_written", "tree_pages", "aborted",
   "sessions": [...], "leases": [...]}`` (sessions and pin leases for another worker to take over).

The server keeps running (draining) until it is stopped; a second /drain reports again.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from serving import ipc as m
from serving.server.context import DRAINING, ServerContext, get_ctx
from serving.server.errors import APIError

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
    return {"draining": True, "aborted": aborted, **report}


@router.post("/drain")
async def drain_route(request: Request) -> Any:
    ctx = get_ctx(request)
    raw = await request.body()
    timeout_s = ctx.server.drain_timeout_s
    if raw.strip():
        try:
            body = await request.json()
            timeout_s = float(body.get("timeout_s", timeout_s))
        except (ValueError, AttributeError, TypeError):
            raise APIError(400, 'the body must be a JSON object, e.g. {"timeout_s": 30}', param="timeout_s") from None
        if not 0 <= timeout_s <= 3600:
            raise APIError(400, "timeout_s must be in [0, 3600]", param="timeout_s")
    return await drain(ctx, timeout_s)


def draining_health() -> JSONResponse:
    return JSONResponse({"draining": True, "error": {"message": DRAINING}}, status_code=503)
