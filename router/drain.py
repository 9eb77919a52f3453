"""Warm drains through the router: ``POST /remove_worker?drain=true`` (or the worker's own drain,
seen by the health check: ``/health`` 503 with ``{"draining": true}``) takes a worker out without
losing its cache (the worker's side is serving/server/drain.py).

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

Only the default tenant's sessions and unsalted leases can be re-homed by the router (a tenant's
needs its key, which the router does not hold; a salted lease's salt is not known in full): the
others are listed in ``not_moved``.

Concurrency contract: the router's event loop; one drain per worker at a time (``_running``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any

import httpx

from router.policies import RouteRequest

if TYPE_CHECKING:
    from router.state import RouterState

log = logging.getLogger("hicache.router")
_running: dict[int, set[str]] = {}  # id(state) -> urls being drained
_tasks: set[asyncio.Task[None]] = set()  # drains the health check started (kept until done)


class DrainError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def _post(state: RouterState, url: str, path: str, body: dict[str, Any] | None) -> httpx.Response:
    return await state.client.post(url + path, json=body, headers=state.worker_headers,
                                   timeout=state.cfg.request_timeout_s)


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
        sid = s["session_id"]
        if s.get("tenant") is not None:
            not_moved.append({"kind": "session", "id": sid, "reason": "a tenant's session (needs its key)"})
            continue
        w = state.policy.select(RouteRequest("", None, sid), others)
        body: dict[str, Any] = {"session_id": sid, **({"retention": s["retention"]} if s.get("retention") else {})}
        try:
            r = await _post(state, w.url, "/open_session", body)
        except httpx.HTTPError as e:
            r = None
            reason = f"{w.url}: {type(e).__name__}"
        if r is not None and r.status_code not in (200, 409):  # 409: open there already
            reason = f"{w.url} answered {r.status_code}: {r.text[:200]}"
            r = None
        if r is None:
            not_moved.append({"kind": "session", "id": sid, "reason": reason})
            if owner.get(sid) == url:
                owner.pop(sid, None)
            continue
        owner[sid] = w.url
        moved += 1
    return moved


async def _move_leases(state: RouterState, leases: list[dict[str, Any]], others: list[Any],
                       not_moved: list[dict[str, Any]]) -> int:
    moved = 0
    for x in leases:
        if x.get("tenant") is not None or x.get("cache_salt") is not None:
            not_moved.append({"kind": "lease", "id": x["lease_id"], "reason": "a tenant's or salted lease"})
            continue
        route = await state.keys.for_body("/generate", {"input_ids": x["input_ids"]})
        w = state.policy.select(route, others)
        ids = {"input_ids": x["input_ids"]}
        try:
            pre = await _post(state, w.url, "/cache/prefetch", {**ids, "level": "L2"})
            pin = await _post(state, w.url, "/cache/pin", {**ids, "ttl_s": x["ttl_s"]}) \
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
