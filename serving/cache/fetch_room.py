"""L2 room between the waiting requests and their L3 fetches (serving/cache/l3_prefetch.py).

- **Holds and pins** (:meth:`FetchRoom.keep`): a waiting request holds its cached prefix (``tree.hold``): L2
  eviction for a fetch, or for an L1 demotion of pages L3 holds, passes it over (the fetches of the
  requests behind it, and the demotions of the requests run before it, evicted LRU, and that was what had
  landed for the requests about to run: read from L3 again, the Gemma-3 probe's pages about twice). It
  also pins that prefix's L2 pages (all or none, within ``PIN_SHARE`` of L2), except those L3 holds: a
  prefix L3 holds comes back from there if it leaves L2 (the prefetcher's recheck), and pinning it would
  keep from L2 the L1 demotions that L3 lacks (an L1 eviction without L2 room loses those), which a hold
  does not. Without pins, a turn of many returning requests thrashes: each one run demotes its pages into
  L2 and evicts (LRU) the prefixes of requests still waiting for L1.
- **Room for a fetch** (:meth:`FetchRoom.make`): L2 pages are evicted for it, L2 backups of pages on L1
  among them, but never the held prefixes.
- **The wait** (:meth:`FetchRoom.worth_waiting`): while others hold the L2 a fetch needs (fetches, pins,
  holds, writes to L3 in flight) or L2 is still being pinned after a start, the fetch waits as long as
  waiting and then loading would still beat recomputing, instead of fetching part of its prefix.
"""

from __future__ import annotations

import time

from hicache.hiradix import HiRadixTree
from hicache.tiers.host import HostKVPool
from serving.cache.cost_model import Decision
from serving.cache.prefetch_op import PrefetchOp

PIN_SHARE = 0.5  # share of L2 that waiting requests may pin for their cached prefixes


class FetchRoom:
    """See the module docstring. Concurrency contract: the scheduler thread only (the prefetcher's caller);
    every tree call is made there. Every hold and pin is ``op``'s until :meth:`release`."""

    def __init__(self, tree: HiRadixTree, host_pool: HostKVPool) -> None:
        self.tree = tree
        self.host_pool = host_pool
        self.page_size = tree.page_size
        self.pin_budget = int(PIN_SHARE * host_pool.num_pages)
        self.pinned = 0  # L2 pages pinned by waiting requests (a page pinned twice counts twice)
        self.holds = 0  # prefixes held by waiting requests

    def keep(self, op: PrefetchOp, tokens: list[int]) -> None:
        """``op`` holds the path that ``tokens`` match and pins its L2 pages L3 lacks, all or none (within
        the budget)."""
        if not tokens:
            return
        node, _ = self.tree.lookup(tokens)
        if node is self.tree.root:
            return
        self.tree.hold(node)
        op.held = node
        self.holds += 1
        on_l3 = self.tree.on_l3
        pages = [p for nd in node.path_to_root() if nd.host_pages is not None and not on_l3(nd)
                 for p in nd.host_pages]
        if not pages or self.pinned + len(pages) > self.pin_budget:
            return
        self.tree.pin_host(pages)
        self.pinned += len(pages)
        op.pinned = pages

    def release(self, op: PrefetchOp) -> None:
        """End ``op``'s hold and pins."""
        if op.pinned:
            self.tree.unpin_host(op.pinned)
            self.pinned -= len(op.pinned)
            op.pinned = []
        if op.held is not None:
            self.tree.hold(op.held, -1)
            self.holds -= 1
            op.held = None

    def make(self, n: int) -> None:
        """Evict ``n`` L2 pages for a fetch if possible, sparing the prefixes waiting requests hold."""
        self.tree.evict_host(n, drop_backups=True, spare_held=True)

    def worth_waiting(self, op: PrefetchOp, d: Decision, n: int, fetching: bool, busy: bool) -> bool:
        """Whether a fetch that found too little L2 room after :meth:`make` waits for ``n`` pages (retried
        each step): while others hold L2 (``fetching``: fetches in flight) or it is still being pinned, as
        long as waiting and then loading would still beat recomputing (the cost model's estimates; without
        them, until the op's deadline). A fetch of part of the prefix would recompute the rest (after a
        start: 1.85x recompute for 32k tokens on an H100, gpu-tiers-h100-2026-12-05-s21.json). Room held by
        waiting requests that all wait for room (``busy`` False: no fetch, no admitted request, no L3 write
        landing, no other waiting request that can move) never comes back: then only L2 still being pinned is
        waited for."""
        now = time.monotonic()
        host = self.host_pool
        growing = host.growing and host.free_once_pinned() >= n
        held = busy and (fetching or self.tree.host_pinned > len(op.pinned) or self.holds > (op.held is not None))
        if not (held or growing) or now >= op.deadline:
            return False
        if not op.room_wait_since:
            op.room_wait_since = now
        if d.load_s is None or d.recompute_s is None:
            return True
        return now - op.room_wait_since < d.recompute_s - d.load_s
