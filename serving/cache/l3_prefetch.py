"""L3 -> L2 prefetch for waiting requests whose prompt continues past L1/L2 in the store.

A prefetch runs in two background phases, so the scheduler never waits on the store:

1. **lookup** (lookup threads): the prompt's L3 page keys and ``batch_exists`` -- how many
   of the pages after the cached prefix the store holds;
2. **fetch**, started by the scheduler once the lookup is in: host pages are allocated for
   those pages and read by the storage tier's reader threads (serving/cache/l3_fetch.py), stopping
   at the first miss. Many fetches are in flight at once (first come, first served). A
   request whose pages another request's fetch is already reading *follows* that fetch
   (the same keys are never read twice at once); once it has what that fetch had of its
   prefix, it looks up the rest, if any, from there.

A model with state layers (``states``): pages are fetched only up to the deepest page boundary whose
state snapshot L3 holds; the snapshot is read and verified on a lookup thread while those pages are
fetched (one that fails its check: the deepest good one above it), and joins the tree once both are in
(serving/cache/l3_state.py).

The concurrency contract is :class:`Prefetcher`'.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from hicache.hiradix import HiRadixTree
from hicache.keys import page_keys
from hicache.tiers.host import HostKVPool
from hicache.tiers.host_state import HostStatePool
from hicache.tiers.storage import StorageTier
from hicache.tiers.storage_state import StateStore
from serving.cache.cost_model import EXPLORE, AlwaysLoad, Decision, LoadPolicy
from serving.cache.fetch_room import FetchRoom
from serving.cache.l3_fetch import Fetches, FetchOp
from serving.cache.l3_state import attach_when_in, resume_point, start_read
from serving.cache.prefetch_op import PrefetchOp
from serving.cache.prefetch_policy import PREFETCH_POLICIES, LoadBudget
from serving.cache.transfers import TransferRunner
from serving.structs.request import Req


def _no_backlog(req: Req) -> int:
    return 0


class Prefetcher:
    """Prefetches for waiting requests (see the module docstring for the two phases).

    Concurrency contract:
    - Scheduler thread only: :meth:`advance_all` (each step) and :meth:`advance`, :meth:`ready`,
      :meth:`finish`, :meth:`poll` and every tree call. The threads only compute keys, call the storage tier
      (thread-safe) and write the host pages of a fetch, which belong to nobody else.
    - Before a fetch starts, the node where the cached prefix ends is locked and L2 room is
      made (eviction cannot touch the locked path, nor the cached prefixes the waiting requests hold;
      L2 backups of pages on L1 may go, those L3 holds first: serving/cache/fetch_room.py). When
      others hold the L2 it needs, or L2 is still being pinned after a start, the request waits (retried
      each step) while waiting and loading would still beat recomputing, instead of fetching part of its
      prefix; otherwise the page count is capped at what is free, so the allocation cannot fail. A wait
      for room (L2, host window pages) needs something that can give it back: fetches in flight, admitted
      requests, L3 writes landing (``room_coming``), a waiting request not itself waiting for room (or L2
      still being pinned after a start); when every waiting request waits for room the others hold, none
      would come before the deadline, and the fetch starts at once with the room there is.
    - A waiting request watches its cached prefix (each step and when it is scheduled): if
      the prefix left L2 meanwhile (held, not pinned, when L3 holds it: an L1 demotion of pages L3 lacks
      may take its room), it is looked up again.
    - Landed, verified pages are committed into the tree as they arrive (:meth:`advance`, so
      the read is *pipelined*): each commit moves the fetch's lock down to the new end, and --
      when L1 has that many free pages -- loads the committed chain on to L1 at once (an
      ordinary tree ``load_back``, whose lock :meth:`poll` releases once the copy has landed),
      so the L2 -> L1 copy of chunk k overlaps the read of chunk k+1, and the request finds its
      prefix on L1 (its forward pass waiting per layer for the last copy, on the GPU).
      :meth:`finish` never blocks: it commits what has landed; a fetch no request holds any more
      stops, and its pages still in flight are freed by :meth:`poll` once its readers are done.
    - A fetch's lock pins the L1 pages on its path (its early loads' among them), so the fetches of
      requests that still wait could hold all of L1: when a reservation finds no room and nothing
      running can free any, the scheduler has the waiting requests give them back
      (``ReqCache.give_back_fetches``, through :meth:`finish`) and they look their prefixes up again.
    - A state model's snapshot is read on a lookup thread while its pages are fetched (``op.state``'s
      future, serving/cache/l3_state.py); only the scheduler thread looks at the result and the tree.
    """

    def __init__(self, tree: HiRadixTree, host_pool: HostKVPool, tier: StorageTier, namespace: str,
                 transfers: TransferRunner, policy: str = "best_effort", threshold_tokens: int = 256,
                 timeout_base_s: float = 0.5, timeout_per_1k_tokens_s: float = 0.25,
                 load_policy: LoadPolicy | None = None,
                 states: tuple[HostStatePool, StateStore] | None = None,
                 backlog: Callable[[Req], int] | None = None) -> None:
        """``backlog(req)``: prefill tokens queued ahead of ``req`` (serving/cache/cost_model.py; none by default)."""
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
        self.backlog = backlog or _no_backlog
        self._lookups = ThreadPoolExecutor(max_workers=2, thread_name_prefix="hicache-l3-lookup")
        self.fetches = Fetches(tree, host_pool, tier, transfers, self.load_policy.observe_read)
        self.states = states  # (L2 state pool, its L3 store) of a model with state layers
        # a hybrid SWA L1 (serving/cache/l3_windows.py): where a lookup starts (tokens cached above L3,
        # after dropping a stale tail L3 holds whole); None: the tree's cached prefix
        self.window_cut: Callable[[list[int]], int] | None = None
        # ... and whether a fetch (start page, pages) may start now (host window room for its last window)
        self.window_room: Callable[[int, int], bool] | None = None
        # whether admitted requests or L3 writes landing give room back by themselves (the owner, ReqCache, sets
        # it); one of the things a fetch's wait for room needs (see _busy)
        self.room_coming: Callable[[], bool] = lambda: True
        self._movable: set[str] = set()  # waiting requests not waiting for room (advance_all; see _busy)
        self.snapshots_fetched = 0  # state snapshots from L3 the tree took
        self.pages_prefetched = 0
        self.prefetches_revoked = 0
        self.fetches_cut = 0  # fetches that fell behind recompute (LoadBudget): their requests recomputed the rest
        self.pages_cut = 0  # the pages those fetches had not read when they were cut
        self._fetching = 0  # requests holding a fetch (their own or one they follow)
        self.room = FetchRoom(tree, host_pool)  # L2 pins of waiting requests, room for fetches

    @property
    def pages_loaded_early(self) -> int:
        return self.fetches.pages_loaded_early

    @property
    def _draining(self) -> list:
        return self.fetches.draining

    # -- scheduler side -----------------------------------------------------------------
    def advance_all(self, waiting: list[Req]) -> None:
        """:meth:`advance` for each of the ``waiting`` requests, their new lookups first: a request whose
        prefetch ended (admitted short of room, a fetch given back) holds its cached prefix again before
        any fetch makes room (serving/cache/fetch_room.py)."""
        for r in waiting:
            if r.kv.prefetch is None and not r.kv.prefetch_checked:
                self.advance(r)
        # the waiting requests that can move without room being given back (admitted once ready, looking up,
        # fetching, watching; one its prefetch policy no longer holds back): while one can, what it holds may come
        # free; see _busy
        now = time.monotonic()
        self._movable = {r.rid for r in waiting if r.kv.prefetch is None or not r.kv.prefetch.waits_for_room
                         or self.policy.ready(r.kv.prefetch, now)}
        for r in waiting:
            self.advance(r)

    def advance(self, req: Req) -> None:
        """Called for every waiting request each step: start its lookup once, start (or
        follow) the fetch once the lookup is in, commit what has landed. Never waits."""
        op: PrefetchOp | None = req.kv.prefetch
        if op is None:
            if not req.kv.prefetch_checked:
                req.kv.prefetch_checked = True
                self._start_lookup(req)
            return
        if op.watching:
            if not op.pinned:  # (a pinned prefix keeps its L2 pages; ready() checks it once more)
                self._recheck(req, op)
            return
        if op.fetch is None:
            if op.lookup.done():
                self._start_fetch(req, op)
            return
        f = op.fetch
        self.fetches.advance(f, self._commit_pages(f))
        self._attach_state(op)
        if op.need < len(op.keys) and f.loaded >= op.offset + op.need:
            # it followed a fetch that has all it had in common, and the store holds more of its
            # prompt: those pages come with a lookup from the new end of its cached prefix
            req.kv.storage_hit_tokens += self._drop(op) * self.page_size
            self.room.release(op)
            req.kv.prefetch = None
            self._start_lookup(req)

    def _commit_pages(self, f: FetchOp) -> int:
        """Commit in chunks of an eighth of the fetch (at least a reader task's pages): each
        commit is tree work and an L1 copy launch on the scheduler thread."""
        return max(self.tier.fetch_batch_pages(self.host_pool), len(f.keys) // 8)

    def _start_lookup(self, req: Req) -> None:
        """Pin the L2 part of the request's cached prefix (within the budget) and, when its prompt
        continues past it by enough, look the rest up in L3."""
        ps = self.page_size
        prompt = req.fill_ids[: req.seq_len - 1]
        full = len(prompt) // ps
        if self.states is not None:
            cached = resume_point(self.tree, prompt) // ps
        else:
            cached = (self.tree.peek_prefix_len if self.window_cut is None else self.window_cut)(prompt) // ps
        lookup = (full - cached) * ps >= self.threshold_tokens
        if lookup:
            d = self.load_policy.decide(full - cached, backlog_tokens=self.backlog(req))
            req.kv.l3_decision = self._decision(full - cached, d, looked_up=False)
            lookup = d.load  # else even if the store held every page, recomputing would be faster: no lookup
        if not lookup and cached * ps < self.threshold_tokens:
            return
        op = PrefetchOp(cached, prompt[: full * ps], time.monotonic() + self.timeout_base_s)
        self.room.keep(op, prompt[: cached * ps])
        if lookup:
            op.lookup = self._lookups.submit(self._lookup, op)
        req.kv.prefetch = op

    def _attach_state(self, op: PrefetchOp) -> None:
        if op.state is not None:  # (a state model's)
            self.snapshots_fetched += attach_when_in(self.tree, self.states[0], op, self.page_size)

    def _busy(self, req: Req) -> bool:
        """Whether room a fetch of ``req`` waits for can come free without it: fetches in flight or draining,
        admitted requests or L3 writes landing (``room_coming``), or another waiting request that can move (not
        itself waiting for room). Otherwise every waiting request waits for room the others hold, and nothing would
        give any back before the prefetch deadline: the fetch starts with the room there is."""
        return bool(self.fetches.active or self.fetches.draining) or len(self._movable) > (req.rid in self._movable) \
            or self.room_coming()

    def _start_fetch(self, req: Req, op: PrefetchOp) -> None:
        ps, tree = self.page_size, self.tree
        op.waits_for_room = False  # (set again below if it still waits)
        n = op.lookup.result() if op.lookup.exception() is None else 0
        node, matched = tree.lookup(op.tokens[: op.start_page * ps])
        if n * ps < self.threshold_tokens or matched < op.start_page * ps:
            self._watch(req, op)  # nothing worth fetching, or the prefix it hangs below is gone
            return
        first = req.kv.l3_decision  # made before the lookup, for every page the prompt could have
        d = self.load_policy.decide(n, explore=False, backlog_tokens=self.backlog(req))
        looked = n  # the pages d is about
        if not d.load and first is not None and first["reason"] == EXPLORE:
            d = Decision(True, d.load_s, d.recompute_s, EXPLORE)  # an exploration stays one
        req.kv.l3_decision = self._decision(n, d, looked_up=True)
        if not d.load:
            self._watch(req, op)  # recomputing them is faster than loading them
            return
        op.keys = op.keys[:n]
        followed = self.fetches.follow(op.keys)
        if followed is not None:  # another request's fetch reads these pages already: wait for it
            op.fetch, op.offset, op.need = followed
            op.deadline = time.monotonic() + self.timeout_base_s + self.timeout_per_1k_tokens_s * op.need * ps / 1000
            op.budget = LoadBudget.of(d.load_s, d.recompute_s, looked, op.need, time.monotonic())
            self._fetching += 1
            return
        tree.lock(node)  # the prefix stays while the fetch runs; L2 eviction cannot touch it
        host = tree.host
        if host.num_free < n:  # pages from L3 are worth more than L2 backups of pages on L1
            self.room.make(n - host.num_free)
        if host.num_free < n and self.room.worth_waiting(op, d, n, bool(self.fetches.active), self._busy(req)):
            tree.unlock(node)
            op.waits_for_room = True
            return  # others hold L2 (fetches, pins, writes to L3): their pages free up soon, retry
        n = min(n, host.num_free)  # all of it, or as much as L2 can ever give it now
        if n * ps < self.threshold_tokens or (op.state is not None and n < op.state[0]):  # (a state model's
            op.state = None  # pages without the snapshot after them are of no use)
            tree.unlock(node)
            self._watch(req, op)
            return
        if self.window_room is not None and not self.window_room(op.start_page, n) and \
                time.monotonic() < op.deadline and self._busy(req):
            tree.unlock(node)
            op.waits_for_room = True
            return  # the host window pool is held (fetches, locked nodes): retry once some is given back
        # (past its deadline, or with nothing else running, it starts without that room: waiting requests could
        # hold, pinned, the host window pages each other's fetch waits for; what lands without its window is cut
        # and recomputed)
        pages = host.alloc(n)  # cannot fail: n <= num_free
        try:
            op.fetch = self.fetches.start(op.start_page, op.tokens, op.keys[:n], node, pages)
        except BaseException:  # (a shut-down pool) nothing started: give the pages and the lock back
            host.free(pages)
            tree.unlock(node)
            raise
        op.keys, op.need = op.keys[:n], n
        op.deadline = time.monotonic() + self.timeout_base_s + self.timeout_per_1k_tokens_s * n * ps / 1000
        op.budget = LoadBudget.of(d.load_s, d.recompute_s, looked, n, time.monotonic())
        self._fetching += 1  # counted once the fetch exists: finish() uncounts it

    def _watch(self, req: Req, op: PrefetchOp) -> None:
        """Nothing to fetch now: the request keeps its pins (if any) and watches its cached prefix
        while it waits -- a prefix that was not pinned (the budget was spent) can be evicted from
        L2 by the requests that run first, and is then looked up in L3 (:meth:`_recheck`) instead
        of being recomputed."""
        op.lookup = None

    def _decision(self, pages: int, d, looked_up: bool) -> dict:
        return {"pages": pages, "tokens": pages * self.page_size, "looked_up": looked_up, "load": d.load,
                "reason": d.reason, "est_load_s": d.load_s, "est_recompute_s": d.recompute_s}

    def ready(self, req: Req) -> bool:
        op = req.kv.prefetch
        if op is not None and op.watching:  # (the requests admitted before it may have evicted pages)
            op = self._recheck(req, op)
        if op is None or op.watching:
            return True
        now = time.monotonic()
        if self.policy.ready(op, now):
            return True
        if op.budget is not None and op.fetch is not None and not op.fetched and \
                op.budget.exceeded(op.reading, now):  # landed or being read (a group starts before it lands)
            op.cut = True  # (LoadBudget) the rest is recomputed
            return True
        return False

    def _recheck(self, req: Req, op: PrefetchOp) -> PrefetchOp | None:
        """A watching request whose cached prefix lost pages (not pinned, or on L1 only), or, with a hybrid
        SWA cache, the window KV of its last window (``window_cut``), looks them up in L3; returns its
        prefetch now."""
        cached = self.tree.peek_prefix_len if self.window_cut is None else self.window_cut
        if cached(op.tokens) < op.start_page * self.page_size:
            self.room.release(op)
            req.kv.prefetch = None
            self._start_lookup(req)
        return req.kv.prefetch

    def finish(self, req: Req) -> int:
        """Stop the request's prefetch and commit what has landed into L2; returns the pages
        of its prefix that came from L3 with it. Never waits: host pages of a read still in
        flight are freed later."""
        op: PrefetchOp | None = req.kv.prefetch
        if op is None:
            return 0
        req.kv.prefetch = None
        op.cancel.set()
        self.room.release(op)  # the request matches right after: its prefix is locked from then on
        if op.fetch is None:  # watching, looking up or waiting for L2 room: nothing allocated
            return 0
        unread = op.need - op.loaded
        got = self._drop(op)
        if op.cut:
            self.fetches_cut += 1
            self.pages_cut += unread
            if req.kv.l3_decision is not None:  # (meta_info's l3_decision)
                req.kv.l3_decision = {**req.kv.l3_decision, "cut": True, "pages_recomputed": unread}
        return got

    def _drop(self, op: PrefetchOp) -> int:
        """Commit what has landed, release the request's hold; its pages that came from L3."""
        f = op.fetch
        self._fetching -= 1
        self.fetches.commit(f, f.loaded, to_l1=False)  # the request matches right after: it loads the rest
        self._attach_state(op)
        got = f.new_pages(op.offset, op.offset + op.need)
        self.fetches.release(f)
        op.fetch = None
        self.prefetches_revoked += int(got == 0)
        self.pages_prefetched += got
        return got

    def poll(self, wait: bool = False) -> None:
        """Commit landed pages of every fetch, release early L1 loads that have landed, free
        host pages of released fetches once their readers are done with them."""
        for f in self.fetches.active:
            self.fetches.advance(f, self._commit_pages(f))
        self.fetches.poll(wait)

    def in_flight_host_pages(self, reqs: list[Req]) -> int:
        """Host pages held by uncommitted fetches and drains (for integrity checks)."""
        return len(self.fetches.held_host_pages())

    def check_integrity(self, reqs: list[Req]) -> None:
        """Raise AssertionError unless ``reqs`` (every waiting and running request) hold exactly the
        fetches counted as held, each fetch's users match, its node is locked and ``committed <=
        loaded``, and the host pages held by fetches and drains are allocated, none held twice."""
        started = [r.kv.prefetch for r in reqs if r.kv.prefetch is not None and r.kv.prefetch.fetch is not None]
        assert self._fetching == len(started), f"prefetch: {self._fetching} fetches counted, {len(started)} held"
        pinned = [p for r in reqs if r.kv.prefetch is not None for p in r.kv.prefetch.pinned]
        assert self.room.pinned == len(pinned), f"prefetch: {self.room.pinned} L2 pins counted, {len(pinned)} held"
        assert all(self.tree.host.is_allocated(p) for p in pinned), "prefetch: a pinned L2 page is free"
        held = [r.kv.prefetch.held for r in reqs if r.kv.prefetch is not None and r.kv.prefetch.held is not None]
        assert self.room.holds == len(held), f"prefetch: {self.room.holds} holds counted, {len(held)} held"
        assert all(nd.wait_ref > 0 for nd in held), "prefetch: a held prefix has no wait_ref"
        holds: dict[int, int] = {}
        for op in started:
            holds[id(op.fetch)] = holds.get(id(op.fetch), 0) + 1
            assert 0 <= op.offset and op.offset + op.need <= len(op.fetch.keys), (
                f"prefetch: a request holds pages {op.offset}..{op.offset + op.need} of a "
                f"{len(op.fetch.keys)}-page fetch")
        self.fetches.check_integrity(holds)

    def stats(self) -> dict[str, int]:
        f = self.fetches
        return {"pages_loaded_early": f.pages_loaded_early, "fetches_in_flight": len(f.active),
                "state_snapshots_fetched": self.snapshots_fetched, "fetches_cut": self.fetches_cut,
                "pages_cut": self.pages_cut,
                "fetches_followed": f.fetches_followed, "pages_deduplicated": f.pages_deduplicated}

    def shutdown(self) -> None:
        self._lookups.shutdown(wait=True)
        self.fetches.shutdown()

    # -- background threads ---------------------------------------------------------------
    def _lookup(self, op: PrefetchOp) -> int:
        keys = page_keys(op.tokens, self.page_size, self.namespace)[op.start_page:]
        op.keys = keys
        n = 0 if op.cancel.is_set() else self.tier.batch_exists(keys)
        if self.states is None or n == 0 or op.cancel.is_set():
            return n
        op.state = start_read(self.states[1], keys[:n], self._lookups.submit)  # pages past it are of no use
        return 0 if op.state is None else op.state[0]
