"""The KV control API through the router (serving/server/cache_api.py has the worker's side).

``/cache/lookup``, ``/cache/prefetch`` and ``/cache/pin`` go to the worker the request's prefix
would be routed to (its tenant + cache_salt scope, like a generation, so the one that holds it);
a prefetch that succeeded is remembered in the routing tree (that worker now holds the KV). A
pin's lease id is remembered with its worker (an LRU map of ``max_leases``), so
``DELETE /cache/pin/{lease_id}`` reaches it; an unknown lease is a 404.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from router.bodies import json_object
from router.errors import error

if TYPE_CHECKING:
    from router.state import RouterState


def _keying(body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The generation path and body whose routing key equals this control body's prompt."""
    if body.get("messages") is not None:
        return "/v1/chat/completions", {"messages": body["messages"]}
    if body.get("input_ids") is not None:
        return "/generate", {"input_ids": body["input_ids"]}
    return "/generate", {"text": body.get("prompt")}


def add_kv_routes(app: FastAPI, state: RouterState) -> None:
    async def routed(request: Request) -> Response:
        raw = await request.body()
        body = json_object(raw, request.url.path, state.cfg.max_json_depth)
        if not isinstance(body, dict):
            return body
        path, keying = _keying(body)
        route = await state.route(path, {**keying, "cache_salt": body.get("cache_salt")}, request, len(raw))
        try:
            w, _ = state.forwarder.pick(route, set())
        except LookupError as e:
            return error(503, str(e))
        resp = await state.forwarder.call(w, "POST", request.url.path, raw, state.headers(request))
        if resp.status_code == 200:
            if request.url.path == "/cache/prefetch":
                state.policy.on_sent(route, w)
            elif request.url.path == "/cache/pin":
                state.leases[json.loads(resp.body)["lease_id"]] = w.url
        return resp

    for path in ("/cache/lookup", "/cache/prefetch", "/cache/pin"):
        app.add_api_route(path, routed, methods=["POST"])

    @app.delete("/cache/pin/{lease_id}")
    async def unpin(request: Request, lease_id: str) -> Response:
        url = state.leases.get(lease_id)
        w = state.pool.workers.get(url) if url else None
        if w is None:
            return error(404, f"unknown or expired lease {lease_id!r}")
        wire_id = state.lease_alias.get(lease_id, lease_id)  # re-pinned elsewhere by a drain (router/worker_drain.py)
        resp = await state.forwarder.call(w, "DELETE", f"/cache/pin/{wire_id}", None, state.headers(request))
        if resp.status_code == 200:  # a 404 may be another tenant's try: the lease stays known (LRU-bounded)
            state.leases.pop(lease_id, None)
        return resp
