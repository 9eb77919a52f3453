"""Workers: health checks, a circuit breaker per worker, and load.

Load is what the worker reports (``GET /get_load``: running + waiting requests, polled every
``load_poll_interval_s``) or the requests this router has in flight to it, whichever is larger:
the poll sees other routers' requests, the in-flight count sees this router's latest ones
between polls.

Circuit breaker: ``closed`` until ``circuit_failure_threshold`` consecutive failures (requests
that failed at the transport level or with a 5xx, or failed health checks), then ``open`` (no
requests) for ``circuit_cooldown_s``, then ``half_open``: one trial request, or a successful
health check, closes it; a failure opens it again. A worker that is open is assumed to have
lost its cache: ``on_reset`` listeners (the policies' trees) forget it when it comes back.
A worker whose stream broke mid-answer is checked at once (:meth:`WorkerPool.suspect`).
A "worker" whose ``/health`` answers with this router's id (router/urls.py) is this router
under another name: it is removed at its first health check, and ``/add_worker`` refuses it
(:meth:`WorkerPool.is_this_router`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from router.urls import ROUTER_ID_HEADER

if TYPE_CHECKING:
    from router.config import RouterConfig

log = logging.getLogger("hicache.router")

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass
class Worker:
    url: str
    healthy: bool = True
    state: str = CLOSED
    failures: int = 0  # consecutive
    opened_at: float = 0.0
    trial_in_flight: bool = False
    in_flight: int = 0
    polled_load: int = 0
    sent: int = 0
    failed: int = 0
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def load(self) -> int:
        return max(self.polled_load, self.in_flight)

    def view(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "circuit": self.state,
            "load": self.load,
            "in_flight": self.in_flight,
            "polled_load": self.polled_load,
            "requests_sent": self.sent,
            "requests_failed": self.failed,
        }


class WorkerPool:
    def __init__(self, cfg: RouterConfig, client: httpx.AsyncClient, headers: dict[str, str],
                 router_id: str = "") -> None:
        self.cfg = cfg
        self.client = client
        self.headers = headers  # auth for load polls
        self.router_id = router_id  # what this router's /health answers in ROUTER_ID_HEADER
        self.workers: dict[str, Worker] = {}
        self.on_reset: list[Callable[[str], None]] = []  # a worker's cache is gone (removed / restarted)
        self.draining: set[str] = set()  # workers being drained (router/worker_drain.py): no new requests
        self.on_draining: list[Callable[[str], None]] = []  # a worker's /health says it is draining
        self._tasks: list[asyncio.Task[None]] = []
        self._checks: dict[str, asyncio.Task[None]] = {}  # url -> a health check started by suspect()

    # -- membership ----------------------------------------------------------------------------
    def add(self, url: str) -> Worker:
        url = url.rstrip("/")
        if url not in self.workers:
            self.workers[url] = Worker(url)
            log.info("worker added: %s", url)
        return self.workers[url]

    def remove(self, url: str) -> bool:
        w = self.workers.pop(url.rstrip("/"), None)
        if w is not None:
            log.info("worker removed: %s", url)
            self._reset(w.url)
        return w is not None

    def _reset(self, url: str) -> None:
        for fn in self.on_reset:
            fn(url)

    # -- selection -----------------------------------------------------------------------------
    def available(self, now: float | None = None) -> list[Worker]:
        """Workers that may take a request now (healthy and circuit closed, or a half-open trial)."""
        now = time.monotonic() if now is None else now
        out = []
        for w in self.workers.values():
            if w.url in self.draining:
                continue
            if w.state == CLOSED:
                if w.healthy:
                    out.append(w)
                continue
            if w.state == OPEN and now - w.opened_at >= self.cfg.circuit_cooldown_s:
                w.state = HALF_OPEN
                w.trial_in_flight = False
                log.info("worker %s: circuit half-open", w.url)
            if w.state == HALF_OPEN and not w.trial_in_flight:
                out.append(w)
        return out

    def begin(self, w: Worker) -> None:
        w.in_flight += 1
        w.sent += 1
        if w.state == HALF_OPEN:
            w.trial_in_flight = True

    def end(self, w: Worker, ok: bool) -> None:
        w.in_flight = max(0, w.in_flight - 1)
        self.record(w, ok)

    def record(self, w: Worker, ok: bool) -> None:
        if ok:
            w.failures = 0
            if w.state != CLOSED:
                log.info("worker %s: circuit closed", w.url)
                w.state = CLOSED
                w.trial_in_flight = False
            return
        w.failures += 1
        w.failed += 1
        if w.state == HALF_OPEN or (w.state == CLOSED and w.failures >= self.cfg.circuit_failure_threshold):
            log.warning("worker %s: circuit open after %d consecutive failures", w.url, w.failures)
            w.state = OPEN
            w.opened_at = time.monotonic()
            w.trial_in_flight = False
            self._reset(w.url)  # its cache is unknown from now on
        elif w.state == OPEN:
            w.opened_at = time.monotonic()

    def suspect(self, w: Worker) -> None:
        """``w`` failed mid-answer (its stream broke): check its health now, not at the next
        interval, so a dead worker is taken out at once (one check per worker at a time)."""
        if w.url in self._checks:
            return
        task = asyncio.create_task(self.check_one(w))
        self._checks[w.url] = task
        task.add_done_callback(lambda _: self._checks.pop(w.url, None))

    # -- background ----------------------------------------------------------------------------
    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._every(self.cfg.health_check_interval_s, self.check_health)),
            asyncio.create_task(self._every(self.cfg.load_poll_interval_s, self.poll_load)),
        ]

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._checks.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @staticmethod
    async def _every(interval: float, fn: Callable[[], Any]) -> None:
        while True:
            try:
                await fn()
            except Exception:  # never let a background loop die
                log.exception("background task failed")
            await asyncio.sleep(interval)

    async def check_health(self) -> None:
        await asyncio.gather(*(self.check_one(w) for w in list(self.workers.values())))

    async def is_this_router(self, url: str) -> bool:
        """Whether ``url``'s /health answers with this router's id (no worker: an error is no)."""
        try:
            r = await self.client.get(url + "/health", timeout=self.cfg.health_check_timeout_s)
        except httpx.HTTPError:
            return False
        return self._is_me(r)

    def _is_me(self, r: httpx.Response) -> bool:
        return bool(self.router_id) and r.headers.get(ROUTER_ID_HEADER) == self.router_id

    async def check_one(self, w: Worker) -> None:
        try:
            r = await self.client.get(w.url + "/health", timeout=self.cfg.health_check_timeout_s)
            if self._is_me(r):
                log.error("worker %s is this router itself (its /health answered with this router's id): removed",
                          w.url)
                self.remove(w.url)
                return
            ok = r.status_code == 200
            if r.status_code == 503 and b'"draining":true' in r.content.replace(b" ", b""):
                for fn in self.on_draining:  # it drains on its own: re-home its sessions and leases
                    fn(w.url)
        except httpx.HTTPError:
            ok = False
        if ok != w.healthy:
            log.info("worker %s: %s", w.url, "healthy" if ok else "unhealthy")
        w.healthy = ok
        if not ok:
            self.record(w, False)
        elif w.state == CLOSED:
            w.failures = 0
        elif time.monotonic() - w.opened_at >= self.cfg.circuit_cooldown_s:
            self.record(w, True)  # it is back (e.g. restarted): close the circuit

    async def poll_load(self) -> None:
        await asyncio.gather(*(self._poll(w) for w in list(self.workers.values()) if w.healthy))

    async def _poll(self, w: Worker) -> None:
        try:
            r = await self.client.get(
                w.url + "/get_load", headers=self.headers, timeout=self.cfg.health_check_timeout_s
            )
            if r.status_code == 200:
                w.polled_load = int(r.json()["load"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            pass  # health checks decide about failures
