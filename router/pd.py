"""Prefill-decode disaggregation (``--pd-disaggregation``): one request, two workers.

Each attempt picks a prefill worker (``policy``, cache-aware by default: the prompt is computed
there, so that is where its prefix cache matters) and a decode worker (the least loaded: the
fewest outstanding requests, from its polled load and this router's in-flight count; ties in
turn), adds SGLang's ``bootstrap_host`` (the prefill's host), ``bootstrap_port`` (its bootstrap
port) and ``bootstrap_room`` (a random 63-bit int, fresh per attempt; lists of them for a batch
``/generate``) to the body, and sends the same bytes to both at once.

The decode's answer (JSON, or its SSE stream) is the client's; the prefill's is read fully and
dropped, in the background once the decode has answered. Who answers first decides: a prefill
that fails (an error status, or a transport error) before the decode answered fails the request
with the prefill's error and abandons the decode (its connection is closed: the worker aborts
the request); otherwise the decode's answer, error or not, is the client's. The decode has
answered when its body is read (JSON) or its first chunk has come (a stream: decode tokens need
the prefill's KV, so nothing is committed to the client before the prefill had its chance to
fail). A 429 / 5xx / transport error from either side is retried (as router/proxy.py does) on
a new pair, preferring other workers for the side that failed; circuit breakers, load and
sessions are per side (a session sticks to one prefill and one decode worker). A decode stream
that breaks once committed ends with its API's error event and terminator (router/relay.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import suppress
from typing import Any
from urllib.parse import urlsplit

import httpx
from fastapi.responses import Response, StreamingResponse

from router.config import RouterConfig
from router.errors import error, shape_for
from router.pd_config import DEFAULT_BOOTSTRAP_PORT
from router.policies import Policy, RouteRequest
from router.proxy import RETRY_STATUS, Forwarder, Sessions
from router.relay import StreamRelay
from router.workers import Worker, WorkerPool

log = logging.getLogger("hicache.router")
PREFILL_HEADER = "x-hicache-prefill-worker"  # x-hicache-worker names the decode worker
Opened = tuple[httpx.Response, AsyncIterator[bytes] | None, bytes]  # a decode's answer: headers, rest, first


def new_room() -> int:
    return secrets.randbits(63)


def batch_size(path: str, body: dict[str, Any]) -> int | None:
    """A batch ``/generate`` (``text`` a list, or ``input_ids`` a list of lists): its size."""
    if path != "/generate":
        return None
    text, ids = body.get("text"), body.get("input_ids")
    if isinstance(text, list):
        return len(text)
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return None


def with_bootstrap(path: str, body: dict[str, Any], host: str, port: int) -> dict[str, Any]:
    n = batch_size(path, body)
    if n is None:
        return {**body, "bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": new_room()}
    return {**body, "bootstrap_host": [host] * n, "bootstrap_port": [port] * n,
            "bootstrap_room": [new_room() for _ in range(n)]}


def choose(
    pool: WorkerPool,
    sessions: Sessions,
    select: Callable[[Sequence[Worker]], Worker],
    sid: str | None,
    tried: set[str],
    role: str,
) -> tuple[Worker, bool]:
    """One side's worker (the session's while available), and whether the session moved there."""
    avail = pool.available()
    if not avail:
        raise LookupError(f"no {role} worker is available")
    fresh = [w for w in avail if w.url not in tried] or avail
    owner = sessions.owner.get(sid) if sid is not None else None
    for w in fresh:
        if w.url == owner:
            return w, False
    w = select(fresh)
    if sid is not None:
        sessions.owner[sid] = w.url
    return w, owner is not None and owner != w.url


async def _chain(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    if first:
        yield first
    async for chunk in rest:
        yield chunk


class PDForwarder(Forwarder):
    """``pool`` / ``sessions`` (the base class's) are the prefill side; ``decode`` /
    ``decode_sessions`` the decode side."""

    def __init__(
        self,
        cfg: RouterConfig,
        prefill: WorkerPool,
        decode: WorkerPool,
        policy: Policy,
        client: httpx.AsyncClient,
        worker_headers: dict[str, str],
    ) -> None:
        super().__init__(cfg, prefill, policy, client, worker_headers)
        self.decode = decode
        self.decode_sessions = Sessions()
        decode.on_reset.append(self.decode_sessions.forget_worker)
        self.ports = {url: port for url, port in cfg.prefill_urls}  # configured; None: ask the worker
        self.background: set[asyncio.Task[Any]] = set()  # prefill answers still being read
        self._turn = 0

    def bootstrap_port(self, w: Worker) -> int:
        port = self.ports.get(w.url) or w.info.get("disaggregation_bootstrap_port")
        return port if isinstance(port, int) else DEFAULT_BOOTSTRAP_PORT

    def least_loaded(self, workers: Sequence[Worker]) -> Worker:
        low = min(w.load for w in workers)
        tied = [w for w in workers if w.load == low]
        self._turn += 1
        return tied[self._turn % len(tied)]

    def pick_pair(
        self, route: RouteRequest, tried_p: set[str], tried_d: set[str]
    ) -> tuple[Worker, Worker, list[Worker]]:
        """The prefill and decode workers for an attempt, and those the session moved to."""
        sid = route.session_id if self.cfg.session_affinity else None
        p, p_moved = choose(self.pool, self.sessions, lambda ws: self.policy.select(route, ws), sid, tried_p, "prefill")
        d, d_moved = choose(self.decode, self.decode_sessions, self.least_loaded, sid, tried_d, "decode")
        return p, d, [w for w, moved in ((p, p_moved), (d, d_moved)) if moved]

    # -- forwarding ----------------------------------------------------------------------------
    async def _attempts(
        self, path: str, body: bytes, headers: dict[str, str], route: RouteRequest, stream: bool
    ) -> Response:
        payload = json.loads(body)  # the app checked that it is a JSON object
        tried_p: set[str] = set()
        tried_d: set[str] = set()
        last: Response = error(503, "no worker is available", path)
        for attempt in range(self.cfg.max_retries + 1):
            if attempt:
                await self.backoff(attempt - 1)
            try:
                p, d, moved = self.pick_pair(route, tried_p, tried_d)
            except LookupError as e:
                last = error(503, str(e), path)
                continue
            for w in moved:
                await self._reopen_session(w, route.wire_session_id, headers)  # type: ignore[arg-type]
            host = urlsplit(p.url).hostname or ""
            raw = json.dumps(with_bootstrap(path, payload, host, self.bootstrap_port(p))).encode()
            self.pool.begin(p)
            self.decode.begin(d)
            self.policy.on_sent(route, p)
            resp, failed = await self._pair(p, d, path, raw, headers, stream, route)
            if failed is None:
                return resp
            (tried_p if failed is p else tried_d).add(failed.url)
            log.info("attempt %d on %s + %s: %s answered %d", attempt + 1, p.url, d.url, failed.url, resp.status_code)
            last = resp
        return last

    async def _pair(
        self, p: Worker, d: Worker, path: str, raw: bytes, headers: dict[str, str], stream: bool,
        route: RouteRequest,
    ) -> tuple[Response, Worker | None]:
        """One attempt: the answer, and the worker to avoid on a retry (None: no retry)."""
        pt = asyncio.create_task(self._prefill(p, path, raw, headers))
        dt = asyncio.create_task(self._open_decode(d, path, raw, headers, stream))
        try:
            done, _ = await asyncio.wait({pt, dt}, return_when=asyncio.FIRST_COMPLETED)
            bad = pt.result() if dt not in done else None
            if bad is None:
                await asyncio.wait({dt})
        except BaseException:  # cancelled (the client went away): drop both
            self._drop(pt)
            await self._abandon(dt, d)
            raise
        if bad is not None:  # the prefill failed before the decode answered
            self.policy.on_failed(route, p)  # it left no KV there: the routing tree forgets the attempt
            await self._abandon(dt, d)
            return bad, p if bad.status_code in RETRY_STATUS else None
        try:
            up, rest, first = dt.result()
        except httpx.HTTPError as e:
            self.decode.end(d, ok=False)
            self._drop(pt)
            return error(502, f"decode worker {d.url} failed: {type(e).__name__}", path), d
        if up.status_code != 200 or rest is None:  # the whole answer (JSON, or an error)
            self.decode.end(d, ok=up.status_code not in RETRY_STATUS or up.status_code == 429)
            (self._drop if up.status_code >= 400 else self._keep)(pt)
            resp = Response(first, status_code=up.status_code, headers=self._pd_headers(up, p, d))
            return resp, d if up.status_code in RETRY_STATUS else None
        self._keep(pt)
        return StreamingResponse(
            self._relay_pd(up, rest, first, d, path),
            status_code=200,
            headers=self._pd_headers(up, p, d),
            media_type=up.headers.get("content-type"),
        ), None

    async def _prefill(self, p: Worker, path: str, raw: bytes, headers: dict[str, str]) -> Response | None:
        """Read the prefill's answer to the end: None when it succeeded, else its error."""
        try:
            up = await self.client.send(self.client.build_request("POST", p.url + path, content=raw, headers=headers),
                                        stream=True)
            try:
                content = await up.aread()
            finally:
                await up.aclose()
        except httpx.HTTPError as e:
            log.warning("prefill worker %s failed: %r", p.url, e)
            self.pool.end(p, ok=False)
            return error(502, f"prefill worker {p.url} failed: {type(e).__name__}", path)
        except asyncio.CancelledError:  # abandoned: not the worker's failure
            self.pool.end(p, ok=True)
            raise
        self.pool.end(p, ok=up.status_code not in RETRY_STATUS or up.status_code == 429)
        return None if up.status_code < 400 else self._response(up, content, p)

    async def _open_decode(self, d: Worker, path: str, raw: bytes, headers: dict[str, str], stream: bool) -> Opened:
        """The decode's answer up to its commit point: the whole body, or a stream's first chunk."""
        up = await self.client.send(self.client.build_request("POST", d.url + path, content=raw, headers=headers),
                                    stream=True)
        try:
            if not stream or up.status_code != 200:
                content = await up.aread()
                await up.aclose()
                return up, None, content
            rest = up.aiter_raw()
            return up, rest, await anext(rest, b"")
        except BaseException:
            await up.aclose()
            raise

    async def _abandon(self, dt: asyncio.Task[Opened], d: Worker) -> None:
        """Drop the decode's request: cancel it, or close the answer it has begun."""
        dt.cancel()
        await asyncio.wait({dt})
        if not dt.cancelled() and dt.exception() is None:
            await dt.result()[0].aclose()
        self.decode.end(d, ok=True)

    def _keep(self, pt: asyncio.Task[Response | None]) -> None:
        """The decode has answered: the prefill's answer is read to the end in the background."""
        if not pt.done():
            self.background.add(pt)
            pt.add_done_callback(self.background.discard)

    def _drop(self, pt: asyncio.Task[Response | None]) -> None:
        """The decode failed: the prefill's request is closed (its worker aborts it)."""
        pt.cancel()
        self._keep(pt)

    @staticmethod
    def _pd_headers(up: httpx.Response, p: Worker, d: Worker) -> dict[str, str]:
        h = Forwarder.headers(up, d)
        h[PREFILL_HEADER] = p.url
        return h

    async def _relay_pd(
        self, up: httpx.Response, rest: AsyncIterator[bytes], first: bytes, d: Worker, path: str
    ) -> AsyncIterator[bytes]:
        """The decode's stream (its first chunk already read); a break ends it with the API's
        error event and terminator, as router/proxy.py's relay does."""
        relay = StreamRelay(shape_for(path), d.url)
        try:
            async for chunk in relay.events(_chain(first, rest)):
                yield chunk
        finally:
            await up.aclose()
            self.decode.end(d, ok=not relay.broken)
            if relay.broken:
                self.decode.suspect(d)
            self.admission.release()

    async def stop(self) -> None:
        for t in list(self.background):
            t.cancel()
        with suppress(Exception):
            await asyncio.gather(*self.background, return_exceptions=True)
