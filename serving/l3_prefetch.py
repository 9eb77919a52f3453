"""L3 -> L2 prefetch for waiting requests whose prompt continues past L1/L2 in the store.

A prefetch runs in two background phases, so the scheduler never waits on the store:

1. **lookup** (lookup thread): the prompt's L3 page keys and ``batch_exists`` -- how many
   of the pages after the cached prefix the store holds;
2. **fetch** (fetch thread), started by the scheduler once the lookup is in: host pages
   are allocated for those pages and filled batch by batch, stopping at the first miss.

Concurrency contract (the class owns it):
- Scheduler thread only: :meth:`Prefetcher.advance`, :meth:`ready`, :meth:`finish`,
  :meth:`poll` and every tree call. The threads only compute keys, call the storage tier
  (thread-safe) and write the host pages handed to the op, which belong to nobody else.
- Before the fetch starts, the node where the cached prefix ends is locked and L2 room is
  made (eviction cannot touch the locked path; L2 backups of pages on L1 may go); the page
  count is then capped at what is free, so the allocation cannot fail. When other fetches
  hold the L2 it needs, the op waits (retried each step) while waiting and loading would
  still beat recomputing, instead of giving up at once.
- ``op.loaded`` is written by the fetch thread after a batch has fully landed. The
  scheduler commits landed pages into the tree as they arrive (:meth:`advance`, so the
  read is *pipelined*): each commit moves the op's lock down to the new end, and -- when
  L1 has that many free pages -- loads the committed chain on to L1 at once (an ordinary
  tree ``load_back``, whose lock :meth:`poll` releases once the copy has landed), so the
  L2 -> L1 copy of batch k overlaps the read of batch k+1, and the request finds its
  prefix on L1 (its forward pass waiting per layer for the last copy, on the GPU).
  :meth:`finish` never blocks: it commits what has landed since, and pages of a batch
  still in flight are freed by :meth:`poll` once the fetch thread is done with them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from hicache.hiradix import HiRadixTree
from hicache.hiradix.match import PendingLoad
from hicache.hiradix.node import TreeNode
from hicache.keys import page_keys
from hicache.tiers.host import HostKVPool
from hicache.tiers.storage import StorageTier
from serving.cost_model import EXPLORE, AlwaysLoad, Decision, LoadPolicy
from serving.request import Req


@dataclass
class PrefetchOp:
    start_page: int  # first prompt page looked for in L3 (the cached prefix ends here)
    tokens: list[int]  # the prompt's full pages
    deadline: float
    lookup: Future | None = None  # -> pages present in L3 from start_page on
    keys: list[str] = field(default_factory=list)  # set by the lookup thread
    node: TreeNode | None = None  # locked from the fetch's start until finish
    host_pages: list[int] = field(default_factory=list)
    cancel: threading.Event = field(default_factory=threading.Event)
    loaded: int = 0  # leading host pages filled (written by the fetch thread)
    future: Future | None = None  # the fetch
    read_s: float = 0.0  # time inside the store's reads so far (written by the fetch thread)
    room_wait_since: float = 0.0  # when it first found L2 full (0: never)
    committed: int = 0  # leading host pages handed to the tree (scheduler thread)
    new_pages: int = 0  # of those, pages the tree did not hold already

    @property
    def fetched(self) -> bool:
        return self.future is not None and self.future.done()


class PrefetchPolicy:
    """When a waiting request stops waiting for its prefetch (SGLang's names)."""

    def ready(self, op: PrefetchOp, now: float) -> bool:
        raise NotImplementedError


class BestEffort(PrefetchPolicy):
    """Never wait: take whatever has arrived when the request is scheduled."""

    def ready(self, op: PrefetchOp, now: float) -> bool:
        return True


class WaitComplete(PrefetchPolicy):
    def ready(self, op: PrefetchOp, now: float) -> bool:
        return op.fetched


class Timeout(PrefetchPolicy):
    """Wait until done or ``base + per_1k_tokens * tokens / 1000`` seconds have passed."""

    def ready(self, op: PrefetchOp, now: float) -> bool:
        return op.fetched or now >= op.deadline


PREFETCH_POLICIES: dict[str, type[PrefetchPolicy]] = {
    "best_effort": BestEffort, "wait_complete": WaitComplete, "timeout": Timeout}


class Prefetcher:
    """See the module docstring."""

    def __init__(self, tree: HiRadixTree, host_pool: HostKVPool, tier: StorageTier, namespace: str,
                 policy: str = "best_effort", threshold_tokens: int = 256,
                 timeout_base_s: float = 0.5, timeout_per_1k_tokens_s: float = 0.25,
                 load_policy: LoadPolicy | None = None) -> None:
        if policy not in PREFETCH_POLICIES:
            raise ValueError(f"unknown prefetch policy {policy!r}; choose from {sorted(PREFETCH_POLICIES)}")
        self.tree = tree
        self.host_pool = host_pool
        self.tier = tier
        self.namespace = namespace
        self.page_size = tree.page_size
        self.policy = PREFETCH_POLICIES[policy]()
        self.threshold_tokens = threshold_tokens
        self.timeout_base_s = timeout_base_s
        self.timeout_per_1k_tokens_s = timeout_per_1k_tokens_s
        self.load_policy = load_policy or AlwaysLoad()
        self._lookups = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicache-l3-lookup")
        self._fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicache-l3-fetch")
        self._draining: list[tuple[Future, list[int]]] = []  # host pages a cancelled fetch may still write
        self.pages_prefetched = 0
        self.prefetches_revoked = 0
        self._fetching = 0  # fetches started and not finished: they hold L2 pages
        self.run_transfers: Callable[[], None] | None = None  # executes the tree's moves (ReqCache)
        self._l1_loads: list[tuple[TreeNode, PendingLoad]] = []  # early L2 -> L1 loads to finish
        self.pages_loaded_early = 0

    # -- scheduler side -----------------------------------------------------------------
    def advance(self, req: Req) -> None:
        """Called for every waiting request each step: start its lookup once, start the fetch
        once the lookup is in. Never waits."""
        op: PrefetchOp | None = req.prefetch
        if op is None:
            if not req.prefetch_checked:
                req.prefetch_checked = True
                self._start_lookup(req)
            return
        if op.future is None and op.lookup.done():
            self._start_fetch(req, op)
        elif op.future is not None:
            self._commit(op, op.loaded)

    def _start_lookup(self, req: Req) -> None:
        ps = self.page_size
        prompt = req.fill_ids[: req.seq_len - 1]
        full = len(prompt) // ps
        cached = self.tree.peek_prefix_len(prompt) // ps
        if (full - cached) * ps < self.threshold_tokens:
            return
        d = self.load_policy.decide(full - cached)
        req.l3_decision = self._decision(full - cached, d, looked_up=False)
        if not d.load:  # even if the store held every page, recomputing would be faster: no lookup
            return
        now = time.monotonic()
        op = PrefetchOp(cached, prompt[: full * ps], now + self.timeout_base_s)
        op.lookup = self._lookups.submit(self._lookup, op)
        req.prefetch = op

    def _start_fetch(self, req: Req, op: PrefetchOp) -> None:
        ps, tree = self.page_size, self.tree
        n = op.lookup.result() if op.lookup.exception() is None else 0
        node, matched = tree.lookup(op.tokens[: op.start_page * ps])
        if n * ps < self.threshold_tokens or matched < op.start_page * ps:
            req.prefetch = None  # nothing worth fetching, or the prefix it hangs below is gone
            return
        first = req.l3_decision  # made before the lookup, for every page the prompt could have
        d = self.load_policy.decide(n, explore=False)
        if not d.load and first is not None and first["reason"] == EXPLORE:
            d = Decision(True, d.load_s, d.recompute_s, EXPLORE)  # an exploration stays one
        req.l3_decision = self._decision(n, d, looked_up=True)
        if not d.load:
            req.prefetch = None  # recomputing them is faster than loading them
            return
        tree.lock(node)  # the prefix stays while the fetch runs; L2 eviction cannot touch it
        host = tree.host
        if host.num_free < n:  # pages from L3 are worth more than L2 backups of pages on L1
            tree.evict_host(n - host.num_free, drop_backups=True)
        n = min(n, host.num_free)
        if n * ps < self.threshold_tokens:
            tree.unlock(node)
            if self._worth_waiting(op, d):
                return  # other prefetches hold L2; their pages become evictable once committed: retry
            req.prefetch = None
            return
        pages = host.alloc(n)  # cannot fail: n <= num_free
        try:
            op.node, op.host_pages, op.keys = node, pages, op.keys[:n]
            op.deadline = time.monotonic() + self.timeout_base_s + self.timeout_per_1k_tokens_s * n * ps / 1000
            op.future = self._fetcher.submit(self._fetch, op)
        except BaseException:  # (a shut-down executor) nothing started: give the pages and the lock back
            op.node, op.host_pages = None, []
            host.free(pages)
            tree.unlock(node)
            raise
        self._fetching += 1  # counted once the fetch exists: finish() uncounts it

    def _worth_waiting(self, op: PrefetchOp, d: Decision) -> bool:
        """Wait for L2 room while other fetches hold it, as long as waiting and then loading would
        still beat recomputing (the cost model's estimates; without them, until the op's deadline)."""
        now = time.monotonic()
        if not self._fetching or now >= op.deadline:
            return False
        if not op.room_wait_since:
            op.room_wait_since = now
        if d.load_s is None or d.recompute_s is None:
            return True
        return now - op.room_wait_since < d.recompute_s - d.load_s

    def _decision(self, pages: int, d, looked_up: bool) -> dict:
        return {"pages": pages, "tokens": pages * self.page_size, "looked_up": looked_up, "load": d.load,
                "reason": d.reason, "est_load_s": d.load_s, "est_recompute_s": d.recompute_s}

    def ready(self, req: Req) -> bool:
        return req.prefetch is None or self.policy.ready(req.prefetch, time.monotonic())

    def finish(self, req: Req) -> int:
        """Stop the request's prefetch and commit what has landed into L2; returns pages
        committed. Never waits: host pages of a batch still in flight are freed later."""
        op: PrefetchOp | None = req.prefetch
        if op is None:
            return 0
        req.prefetch = None
        op.cancel.set()
        if op.future is None:  # still looking up (or waiting for L2 room): nothing allocated yet
            return 0
        self._fetching -= 1
        loaded = op.loaded  # pages below this have landed; the thread may still fill the rest
        if loaded:
            self.load_policy.observe_read(loaded * self.tier.codec.value_nbytes, op.read_s)
        self._commit(op, loaded, to_l1=False)  # the request matches right after: it loads the rest
        committed, rest = op.new_pages, op.host_pages[op.committed:]
        if rest:
            if op.future.done():
                self.tree.host.free(rest)
            else:
                self._draining.append((op.future, rest))
        self.prefetches_revoked += int(committed == 0)
        self.tree.unlock(op.node)
        self.pages_prefetched += committed
        return committed

    def _commit(self, op: PrefetchOp, loaded: int, to_l1: bool = True) -> None:
        """Hand host pages ``[op.committed, loaded)`` to the tree, move the op's lock to the
        new end and (``to_l1``, room permitting) start loading the chain on to L1."""
        if loaded <= op.committed or op.node.removed:
            return
        tree, ps = self.tree, self.page_size
        upto = (op.start_page + loaded) * ps
        dup = tree.insert_host(op.tokens[:upto], op.host_pages[op.committed:loaded],
                               start_page=op.start_page + op.committed)
        tree.host.free(list(dup))
        op.new_pages += loaded - op.committed - len(dup)
        fresh, op.committed = loaded - op.committed, loaded
        node, matched = tree.lookup(op.tokens[:upto])
        if matched == upto:
            tree.lock(node)
            tree.unlock(op.node)
            op.node = node
        if to_l1 and self.run_transfers is not None and tree.device.num_free >= fresh:
            m = tree.match_prefix(op.tokens[:upto])
            loaded_m = tree.load_back(m)  # no eviction: L1 has the room
            self.run_transfers()  # backups the match asked for; binds the load's PendingLoad
            if loaded_m is not m:
                self._l1_loads.append((loaded_m.last_device_node, loaded_m.pending_loads[-1]))
                self.pages_loaded_early += m.host_hit_tokens // ps

    def poll(self, wait: bool = False) -> None:
        """Release early L1 loads that have landed; free host pages of cancelled fetches once
        their thread is done with them."""
        loads = []
        for end, pending in self._l1_loads:
            if wait:
                pending.wait()
            if pending.done():
                self.tree.finish_load(end)
            else:
                loads.append((end, pending))
        self._l1_loads = loads
        keep = []
        for fut, pages in self._draining:
            if wait:
                fut.exception()
            if fut.done():
                self.tree.host.free(pages)
            else:
                keep.append((fut, pages))
        self._draining = keep

    def in_flight_host_pages(self, reqs: list[Req]) -> int:
        """Host pages held by uncommitted prefetches (for integrity checks)."""
        held = sum(len(r.prefetch.host_pages) - r.prefetch.committed for r in reqs if r.prefetch is not None)
        return held + sum(len(p) for _, p in self._draining)

    def check_integrity(self, reqs: list[Req]) -> None:
        """Raise AssertionError unless ``reqs`` (every waiting and running request) hold exactly the
        fetches counted as started, each with its node locked and ``committed <= loaded``, and the
        host pages held by fetches and drains are allocated, none held twice."""
        started = [r.prefetch for r in reqs if r.prefetch is not None and r.prefetch.future is not None]
        assert self._fetching == len(started), f"prefetch: {self._fetching} fetches counted, {len(started)} held"
        held: list[int] = []
        for op in started:
            assert op.node is not None and (op.node.parent is None or op.node.lock_ref > 0), (
                f"prefetch: the node of a fetch is not locked ({op.node})")
            assert 0 <= op.committed <= op.loaded <= len(op.host_pages), (
                f"prefetch: committed {op.committed}, loaded {op.loaded} of {len(op.host_pages)} pages")
            held += op.host_pages[op.committed:]
        for _, pages in self._draining:
            held += pages
        assert len(held) == len(set(held)), "prefetch: a host page is held twice"
        assert all(self.tree.host.is_allocated(p) for p in held), "prefetch: a held host page is free"

    def shutdown(self) -> None:
        self.poll(wait=True)
        self._lookups.shutdown(wait=True)
        self._fetcher.shutdown(wait=True)

    # -- background threads ---------------------------------------------------------------
    def _lookup(self, op: PrefetchOp) -> int:
        keys = page_keys(op.tokens, self.page_size, self.namespace)[op.start_page:]
        op.keys = keys
        return 0 if op.cancel.is_set() else self.tier.batch_exists(keys)

    def _fetch(self, op: PrefetchOp) -> None:
        step = self.tier.fetch_batch_pages(self.host_pool)
        for lo in range(0, len(op.keys), step):
            if op.cancel.is_set():
                return
            hi = min(len(op.keys), lo + step)
            t0 = time.perf_counter()
            got = self.tier.batch_get(op.keys[lo:hi], self.host_pool, op.host_pages[lo:hi])
            op.read_s += time.perf_counter() - t0
            op.loaded += got
            if got < hi - lo:
                return
