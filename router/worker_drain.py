"""Warm drains through the router: ``POST /remove_worker?drain=true`` (or the worker's own drain,
seen by the health check: ``/health`` 503 with ``{"draining": true}``) takes a worker out without
losing its cache (the worker's side is serving/server/drain_api.py).

1. The worker stops getting requests at once (``WorkerPool.draining``).
2. Its ``POST /drain`` is called: it finishes its running requests, writes every L1/L2 page its
   (shared) L3 lacks, and lists its open sessions and pin leases.
3. Each session is re-homed: opened with the same id on the worker the policy picks among the
   others (its retention hints too), and its affinity moves there; each lease is re-pinned on
   the worker its prefix routes to (a prefetch to L2 from the shared L3, then a pin for the time
   it had left); ``DELETE /cache/pin/{old id}`` reaches the new lease (``RouterState.lease_alias``).
   The next turns of those sessions find their KV in the shared L3 there.
4. The worker leaves the pool. The answer: ``{"drained", "worker": <its drain report, without the
   lists>, "sessions_moved", "leases_moved", "not_moved": [{"kind", "id", "reason"}]}``.

A tenant's sessions and leases are re-homed as that tenant: the router calls the target with its
worker key (``worker_api_key`` or ``api_key``, the workers' ``--api-key``) and
``x-hicache-tenant: <name>``, which a worker honours with that key only (serving/server/app.py).
A salted lease is re-pinned with the request's own ``cache_salt`` (the report's ``request_salt``),
which the target combines with the tenant's seed into the same effective salt (``cache_salt``,
the scope it is routed in). A cache_control breakpoint's lease (``breakpoint`` in the report) is
re-pinned with ``"breakpoint": true``: the target adopts it as the tenant's breakpoint of that
prefix. What could not be re-homed is listed in ``not_moved`` with a reason.

Concurrency contract: the router's event loop; one drain per worker at a time (``_running``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any

import httpx

from common.tenants import effective_salt
from router.policies import RouteRequest
from router.tenancy import salted_ids, scope_prefix, session_key

if TYPE_CHECKING:
    from router.state import RouterState

log = logging.getLogger("hicache.router")
_running: dict[int, set[str]] = {}  # id(state) -> urls being drained
_tasks: set[asyncio.Task[None]] = set()  # drains the health check started (kept until done)


class DrainError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


TENANT_HEADER = "x-hicache-tenant"  # the workers honour it with their --api-key only


async def _post(state: RouterState, url: str, path: str, body: dict[str, Any] | None,
                tenant: str | None = None) -> httpx.Response:
    headers = state.worker_headers if tenant is None else {**state.worker_headers, TENANT_HEADER: tenant}
    return await state.client.post(url + path, json=body, headers=headers, timeout=state.cfg.request_timeout_s)


def _scope(state: RouterState, tenant: str | None, request_salt: str | None = None) -> str | None:
    """The scope a tenant's requests were routed in (RouterState.route): its seed (the router loads
    the same keys file) combined with the request's own ``cache_salt``; None for the default tenant
    unsalted (or a tenant the router does not know). The drain report never carries a seed."""
    table = state.tenancy.table
    t = None if tenant is None or table is None else table.tenants.get(tenant)
    return effective_salt(t, request_salt)


async def drain_worker(state: RouterState, url: str) -> dict[str, Any]:
    url = url.rstrip("/")
    if url not in state.pool.workers:
        raise DrainError(404, f"no worker {url!r}")
    running = _running.setdefault(id(state), set())
    if url in running:
        raise DrainError(409, f"worker {url!r} is being drained already")
    running.add(url)
    state.pool.draining.add(url)
    try:
        try:
            r = await _post(state, url, "/drain", None)
        except httpx.HTTPError as e:
            raise DrainError(502, f"worker {url} failed its drain: {type(e).__name__}") from None
        if r.status_code != 200:
            raise DrainError(502, f"worker {url} answered its drain with {r.status_code}: {r.text[:300]}")
        report = r.json()
        others = [w for w in state.pool.available() if w.url != url]
        if not others:
            raise DrainError(503, "no other worker is available to take this worker's sessions and leases")
        not_moved: list[dict[str, Any]] = []
        sessions = await _move_sessions(state, url, report.get("sessions", []), others, not_moved)
        leases = await _move_leases(state, report.get("leases", []), others, not_moved)
        state.pool.remove(url)
        log.info("worker %s drained: %s pages written to L3, %d sessions and %d leases re-homed", url,
                 report.get("written_pages"), sessions, leases)
        summary = {k: v for k, v in report.items() if k not in ("sessions", "leases")}
        return {"drained": url, "worker": summary, "sessions_moved": sessions, "leases_moved": leases,
                "not_moved": not_moved}
    finally:
        running.discard(url)
        state.pool.draining.discard(url)


async def _move_sessions(state: RouterState, url: str, sessions: list[dict[str, Any]], others: list[Any],
                         not_moved: list[dict[str, Any]]) -> int:
    owner = state.forwarder.sessions.owner
    moved = 0
    for s in sessions:
        sid, tenant = s["session_id"], s.get("tenant")
        # the router's affinity keys of this session (one per scope it was used in: session_key)
        keys = [k for k, u in owner.items() if u == url and (k == sid or k.endswith("|" + sid))]
        key = keys[0] if keys else session_key(_scope(state, tenant), sid)
        w = state.policy.select(RouteRequest("", None, key), others)
        body: dict[str, Any] = {"session_id": sid, **({"retention": s["retention"]} if s.get("retention") else {})}
        try:
            r = await _post(state, w.url, "/open_session", body, tenant)
        except httpx.HTTPError as e:
            r = None
            reason = f"{w.url}: {type(e).__name__}"
        if r is not None and r.status_code not in (200, 409):  # 409: open there already
            reason = f"{w.url} answered {r.status_code}: {r.text[:200]}"
            r = None
        if r is None:
            not_moved.append({"kind": "session", "id": sid, "reason": reason})
            for k in keys:
                owner.pop(k, None)
            continue
        for k in keys or [key]:
            owner[k] = w.url
        moved += 1
    return moved


async def _move_leases(state: RouterState, leases: list[dict[str, Any]], others: list[Any],
                       not_moved: list[dict[str, Any]]) -> int:
    moved = 0
    for x in leases:
        tenant, own = x.get("tenant"), x.get("request_salt")
        scope = _scope(state, tenant, own)  # the report holds no seed: the router derives the scope
        route = await state.keys.for_body("/generate", {"input_ids": x["input_ids"]})
        if scope is not None:  # routed in its scope, as its requests were (RouterState.route)
            route = RouteRequest(scope_prefix(scope) + route.key, salted_ids(route.token_ids, scope), None)
        w = state.policy.select(route, others)
        ids = {"input_ids": x["input_ids"], **({"cache_salt": own} if own is not None else {})}
        try:
            pre = await _post(state, w.url, "/cache/prefetch", {**ids, "level": "L2"}, tenant)
            mark = {"breakpoint": True} if x.get("breakpoint") else {}  # the target adopts it (kv_breakpoints)
            pin = await _post(state, w.url, "/cache/pin", {**ids, "ttl_s": x["ttl_s"], **mark}, tenant) \
                if pre.status_code == 200 else pre
        except httpx.HTTPError as e:
            not_moved.append({"kind": "lease", "id": x["lease_id"], "reason": f"{w.url}: {type(e).__name__}"})
            continue
        if pin.status_code != 200:
            not_moved.append({"kind": "lease", "id": x["lease_id"],
                              "reason": f"{w.url} answered {pin.status_code}: {pin.text[:200]}"})
            continue
        state.policy.on_sent(route, w)  # it holds the prefix now
        new_id = json.loads(pin.content)["lease_id"]
        state.leases[new_id] = w.url
        state.leases[x["lease_id"]] = w.url
        state.lease_alias[x["lease_id"]] = new_id
        moved += 1
    return moved


def on_worker_draining(state: RouterState, url: str) -> None:
    """The health check saw ``url`` draining on its own (its /drain or a SIGTERM): re-home now."""
    if url in _running.get(id(state), set()):
        return

    async def run() -> None:
        try:
            await drain_worker(state, url)
        except DrainError as e:
            log.warning("re-homing the draining worker %s failed: %s", url, e)

    task = asyncio.get_running_loop().create_task(run())
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)
