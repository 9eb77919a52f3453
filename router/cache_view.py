"""The exact cache view (``cache_view: events``): which pages each worker holds on L1 / L2.

Each worker started with ``--enable-cache-events`` publishes its page adds and evictions per
tier (serving/engine/cache_events.py) under ``GET /cache_events?since=SEQ&epoch=E``; this module
polls every worker, applies the events (or a snapshot, after a restart or a gap) and keeps per
worker ``page key -> tiers`` (bit 1: L1, bit 2: L2).

A request's page keys are :func:`hicache.keys.page_keys` of the ids the worker will see (the
router tokenizes like the worker), under the namespace the worker announces; since the pages a
worker holds form a prefix-closed set, the prefix it holds is found by binary search.

Scoring prefers L1 over L2 (``l2_weight``): a worker that would have to load the prefix back
from L2 loses against one that holds it on L1. With a shared L3 (Mooncake Store), a page some
worker announced on L2 has been written there, so every worker can fetch it: the view remembers
those page keys (an LRU set of ``max_l3_pages``, since the store keeps pages after the workers
evict them) and ``shared_l3_weight`` credits each worker with the prefix found there beyond what
it holds itself (a partial hit everywhere; 0 turns it off).

Memory is bounded: each worker keeps at most ``max_pages`` page keys; past it the oldest are
dropped (``dropped`` counts them), which can only make the view underestimate a worker.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from hicache.keys import page_keys
from router.tenancy import BoundedMap

log = logging.getLogger("hicache.router")
L1, L2 = 1, 2
TIER_BITS = {"L1": L1, "L2": L2}
TIER_WEIGHT = {L1: 1.0, L2: 0.6}  # defaults: a page on L2 only counts this much


@dataclass
class WorkerCache:
    epoch: str | None = None
    seq: int = 0
    namespace: str = ""
    page_size: int = 0
    pages: dict[str, int] = field(default_factory=dict)
    max_pages: int = 2_000_000
    dropped: int = 0
    l3: dict[str, int] | None = None  # the view's shared-L3 set: L2 pages are added to it

    def apply(self, op: str, tier: str | None, keys: list[str]) -> None:
        if op == "clear":
            self.pages.clear()
            return
        bit = TIER_BITS[tier or "L1"]
        pages = self.pages
        if op == "add":
            for k in keys:
                pages[k] = pages.get(k, 0) | bit
            if bit == L2 and self.l3 is not None:
                for k in keys:
                    self.l3[k] = 1
            over = len(pages) - self.max_pages
            if over > 0:
                for k in list(itertools.islice(pages, over)):
                    del pages[k]
                self.dropped += over
        elif op == "remove":
            for k in keys:
                left = pages.get(k, 0) & ~bit
                if left:
                    pages[k] = left
                else:
                    pages.pop(k, None)

    def held(self, keys: list[str]) -> tuple[int, int]:
        """``(pages of the prefix held anywhere, of those on L1)`` (both prefix-closed; a set that
        dropped pages past ``max_pages`` may not be: the answer is then an estimate)."""
        pages = self.pages
        lo = prefix_in(keys, pages)
        on_l1 = 0
        while on_l1 < lo and pages.get(keys[on_l1], 0) & L1:  # a capped set may have lost a page
            on_l1 += 1
        return lo, on_l1


def prefix_in(keys: list[str], pages: Mapping[str, int]) -> int:
    """How many leading ``keys`` are in ``pages`` (binary search: the set is prefix-closed)."""
    if not keys or keys[0] not in pages:  # most workers do not hold a given prompt at all
        return 0
    lo, hi = 1, len(keys)  # keys[:lo] are held
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if keys[mid - 1] in pages:
            lo = mid
        else:
            hi = mid - 1
    return lo


class CacheView:
    def __init__(self, client: httpx.AsyncClient, headers: dict[str, str], interval_s: float,
                 l2_weight: float = TIER_WEIGHT[L2], shared_l3_weight: float = 0.0,
                 max_pages: int = 2_000_000, max_l3_pages: int = 4_000_000) -> None:
        self.client = client
        self.headers = headers
        self.interval_s = interval_s
        self.l2_weight = l2_weight
        self.shared_l3_weight = shared_l3_weight
        self.max_pages = max_pages
        self.l3: BoundedMap = BoundedMap(max_l3_pages)  # page keys written to the shared L3 (if any)
        self.caches: dict[str, WorkerCache] = {}
        self.urls: Callable[[], list[str]] = lambda: list(self.caches)
        self._task: asyncio.Task[None] | None = None

    def forget(self, url: str) -> None:
        self.caches.pop(url, None)

    # -- scoring -----------------------------------------------------------------------------
    def scores(self, token_ids: list[int], urls: Mapping[str, Any]) -> dict[str, float]:
        """Tokens of ``token_ids`` each worker holds, L2 pages weighted down, plus the shared-L3
        credit (``shared_l3_weight``) for the longest prefix any worker holds beyond its own."""
        keys_by_ns: dict[tuple[str, int], list[str]] = {}
        held: dict[str, tuple[int, int, int]] = {}
        shared = 0
        for url in urls:
            c = self.caches.get(url)
            if c is None or not c.page_size:
                continue
            ns = (c.namespace, c.page_size)
            keys = keys_by_ns.get(ns)
            if keys is None:
                keys = keys_by_ns[ns] = page_keys(token_ids, c.page_size, c.namespace)
                if self.shared_l3_weight and self.l3:
                    shared = max(shared, prefix_in(keys, self.l3) * c.page_size)
            anywhere, on_l1 = c.held(keys) if c.pages else (0, 0)
            held[url] = (anywhere, on_l1, c.page_size)
        out: dict[str, float] = {}
        for url in urls:
            anywhere, on_l1, ps = held.get(url, (0, 0, 1))
            score = (on_l1 + (anywhere - on_l1) * self.l2_weight) * ps
            if self.shared_l3_weight:
                score += max(0, shared - anywhere * ps) * self.shared_l3_weight
            if score > 0:
                out[url] = score
        return out

    def stats(self) -> dict[str, int]:
        return {"pages": sum(len(c.pages) for c in self.caches.values()),
                "pages_dropped": sum(c.dropped for c in self.caches.values()),
                "l3_pages": len(self.l3), "l3_pages_dropped": self.l3.evicted}

    def best(self, token_ids: list[int], urls: Mapping[str, Any], threshold: float) -> str | None:
        """The worker holding the most of the prompt, if that is at least ``threshold`` of it."""
        scores = self.scores(token_ids, urls)
        if not scores or not token_ids:
            return None
        url = max(scores, key=lambda u: (scores[u], -getattr(urls[u], "load", 0)))
        return url if scores[url] / len(token_ids) >= threshold and scores[url] > 0 else None

    # -- polling -----------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await asyncio.gather(*(self.poll(u) for u in self.urls()), return_exceptions=True)
            await asyncio.sleep(self.interval_s)

    async def poll(self, url: str) -> None:
        c = self.caches.get(url)
        if c is None:
            c = self.caches[url] = WorkerCache(max_pages=self.max_pages, l3=self.l3 if self.shared_l3_weight else None)
        for _ in range(64):  # bounded catch-up per round
            try:
                r = await self.client.get(
                    url + "/cache_events",
                    params={"since": c.seq, **({"epoch": c.epoch} if c.epoch else {})},
                    headers=self.headers,
                    timeout=5.0,
                )
            except httpx.HTTPError:
                return
            if r.status_code != 200:
                return
            more = self.apply(c, r.json())
            if not more:
                return

    @staticmethod
    def apply(c: WorkerCache, body: dict[str, Any]) -> bool:
        """Apply one answer of ``/cache_events``; returns whether more events are waiting."""
        if "snapshot" in body:
            c.pages = {}
            for tier, keys in body["snapshot"].items():
                c.apply("add", tier, keys)
            if c.epoch is not None and c.epoch != body["epoch"]:
                log.info("cache view: worker restarted (new epoch); resynced from a snapshot")
        c.epoch, c.namespace, c.page_size = body["epoch"], body["namespace"], int(body["page_size"])
        for _seq, op, tier, keys in body["events"]:
            c.apply(op, tier, keys)
        c.seq = int(body["last_seq"])
        return bool(body.get("more"))
