"""Forwarding: pick a worker, send, retry elsewhere, stream back chunk by chunk.

A request is retried on another worker (exponential backoff with full jitter, at most
``max_retries`` more attempts) when the attempt failed before anything reached the client:
a transport error (connection refused or reset, the worker died, a timeout), or a 5xx / 429
answer. A streamed response is committed once the worker answered 200: a later failure ends
the stream with its API's error event and terminator (its tokens cannot be taken back;
router/relay.py), counts against the worker and checks its health at once. Workers tried
once are avoided while others are available. Errors are in the shape of the route's API
(router/errors.py).

Admission: at most ``max_concurrent_requests`` forwarded at once (a streamed response holds
its slot until it ends); up to ``max_queued_requests`` more wait for a slot; beyond that, 429.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi.responses import Response, StreamingResponse

from router.config import RouterConfig
from router.errors import error, shape_for
from router.policies import Policy, RouteRequest
from router.relay import StreamRelay
from router.tenancy import BoundedMap
from router.workers import Worker, WorkerPool

log = logging.getLogger("hicache.router")
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
PASS_HEADERS = ("content-type", "x-request-id")
WORKER_HEADER = "x-hicache-worker"


class Busy(Exception):
    pass


class Admission:
    def __init__(self, cfg: RouterConfig) -> None:
        self.sem = asyncio.Semaphore(cfg.max_concurrent_requests)
        self.max_waiting = cfg.max_queued_requests
        self.timeout = cfg.queue_timeout_s
        self.waiting = 0

    async def acquire(self) -> None:
        if self.sem.locked() and self.waiting >= self.max_waiting:
            raise Busy("the router's queue is full")
        self.waiting += 1
        try:
            await asyncio.wait_for(self.sem.acquire(), self.timeout)
        except TimeoutError:
            raise Busy("timed out waiting in the router's queue") from None
        finally:
            self.waiting -= 1

    def release(self) -> None:
        self.sem.release()


class Sessions:
    """session_id (scoped by tenant, router/tenancy.py) -> worker url (affinity while that worker
    is available); the ``cap`` most recently used are kept (``owner.evicted`` counts the rest)."""

    def __init__(self, cap: int = 100_000) -> None:
        self.owner: BoundedMap = BoundedMap(cap)

    def forget_worker(self, url: str) -> None:
        for sid in [s for s, u in self.owner.items() if u == url]:
            del self.owner[sid]


class Forwarder:
    def __init__(
        self,
        cfg: RouterConfig,
        pool: WorkerPool,
        policy: Policy,
        client: httpx.AsyncClient,
        worker_headers: dict[str, str],
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.policy = policy
        self.client = client
        self.worker_headers = worker_headers  # {"authorization": ...} when the router has a worker key
        self.sessions = Sessions(cfg.max_sessions)
        self.admission = Admission(cfg)

    # -- choosing ------------------------------------------------------------------------------
    def pick(self, route: RouteRequest, tried: set[str]) -> tuple[Worker, bool]:
        """The worker for this attempt, and whether it is a new home for the request's session."""
        avail = self.pool.available()
        if not avail:
            raise LookupError("no worker is available")
        fresh = [w for w in avail if w.url not in tried] or avail
        sid = route.session_id if self.cfg.session_affinity else None
        if sid is not None:
            owner = self.sessions.owner.get(sid)
            for w in fresh:
                if w.url == owner:
                    return w, False
        w = self.policy.select(route, fresh)
        moved = sid is not None and sid in self.sessions.owner and self.sessions.owner[sid] != w.url
        if sid is not None:
            self.sessions.owner[sid] = w.url
        return w, moved

    def headers_for(self, incoming: Any) -> dict[str, str]:
        h = {"content-type": incoming.get("content-type", "application/json")}
        auth = self.worker_headers.get("authorization") or incoming.get("authorization")
        if auth:
            h["authorization"] = auth
        return h

    async def backoff(self, attempt: int) -> None:
        cap = min(self.cfg.retry_backoff_max_s, self.cfg.retry_backoff_s * 2**attempt)
        await asyncio.sleep(random.uniform(0, cap))

    # -- forwarding ----------------------------------------------------------------------------
    async def forward(
        self, path: str, body: bytes, headers: dict[str, str], route: RouteRequest, stream: bool
    ) -> Response:
        try:
            await self.admission.acquire()
        except Busy as e:
            return error(429, str(e), path)
        handed_off = False
        try:
            resp = await self._attempts(path, body, headers, route, stream)
            handed_off = isinstance(resp, StreamingResponse)
            return resp
        finally:
            if not handed_off:
                self.admission.release()

    async def _attempts(
        self, path: str, body: bytes, headers: dict[str, str], route: RouteRequest, stream: bool
    ) -> Response:
        tried: set[str] = set()
        last: Response = error(503, "no worker is available", path)
        for attempt in range(self.cfg.max_retries + 1):
            if attempt:
                await self.backoff(attempt - 1)
            try:
                w, moved = self.pick(route, tried)
            except LookupError as e:
                last = error(503, str(e), path)
                continue
            tried.add(w.url)
            if moved and route.session_id is not None:
                await self._reopen_session(w, route.wire_session_id, headers)
            self.pool.begin(w)
            self.policy.on_sent(route, w)  # at once, so concurrent requests of this prefix follow it
            try:
                up = await self.client.send(
                    self.client.build_request("POST", w.url + path, content=body, headers=headers), stream=True
                )
            except httpx.HTTPError as e:
                log.warning("attempt %d on %s failed: %r", attempt + 1, w.url, e)
                self.policy.on_failed(route, w)  # no KV was left there: the routing tree forgets it
                self.pool.end(w, ok=False)
                last = error(502, f"worker {w.url} failed: {type(e).__name__}", path)
                continue
            if up.status_code in RETRY_STATUS:
                content = await self._read(up)
                self.policy.on_failed(route, w)
                self.pool.end(w, ok=up.status_code == 429)
                last = self._response(up, content or b"", w)
                log.info("attempt %d on %s answered %d", attempt + 1, w.url, up.status_code)
                continue
            if stream and up.status_code == 200:
                return StreamingResponse(
                    self._relay(up, w, path),
                    status_code=200,
                    headers=self.headers(up, w),
                    media_type=up.headers.get("content-type"),
                )
            content = await self._read(up)
            if content is None:  # died while answering
                self.policy.on_failed(route, w)
                self.pool.end(w, ok=False)
                last = error(502, f"worker {w.url} failed while answering", path)
                continue
            self.pool.end(w, ok=True)
            if up.status_code != 200:  # refused (bad input): it computed nothing
                self.policy.on_failed(route, w)
            return self._response(up, content, w)
        return last

    @staticmethod
    async def _read(up: httpx.Response) -> bytes | None:
        try:
            return await up.aread()
        except httpx.HTTPError:
            return None
        finally:
            await up.aclose()

    @staticmethod
    def headers(up: httpx.Response, w: Worker) -> dict[str, str]:
        """The response headers a client sees: the worker's passed-through ones and which worker answered."""
        h = {k: up.headers[k] for k in PASS_HEADERS if k in up.headers}
        h[WORKER_HEADER] = w.url
        return h

    def _response(self, up: httpx.Response, content: bytes, w: Worker) -> Response:
        return Response(content, status_code=up.status_code, headers=self.headers(up, w))

    async def _relay(self, up: httpx.Response, w: Worker, path: str) -> AsyncIterator[bytes]:
        """The worker's stream; if it breaks, the API's error event and terminator
        (router/relay.py), the worker counted as failed and its health checked at once."""
        relay = StreamRelay(shape_for(path), w.url)
        try:
            async for chunk in relay.events(up.aiter_raw()):
                yield chunk
        finally:
            await up.aclose()
            self.pool.end(w, ok=not relay.broken)
            if relay.broken:
                self.pool.suspect(w)
            self.admission.release()

    # -- sessions and plain calls --------------------------------------------------------------
    async def _reopen_session(self, w: Worker, sid: str, headers: dict[str, str]) -> None:
        """The session's worker is gone: open the same session id on its new worker."""
        try:
            await self.client.post(w.url + "/open_session", json={"session_id": sid}, headers=headers)
        except httpx.HTTPError:
            pass

    async def call(self, w: Worker, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> Response:
        try:
            up = await self.client.request(method, w.url + path, content=body, headers=headers)
        except httpx.HTTPError as e:
            self.pool.record(w, False)
            return error(502, f"worker {w.url} failed: {type(e).__name__}", path)
        return self._response(up, up.content, w)
