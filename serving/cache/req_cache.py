"""Glue between requests and the cache core: match, lock, page reservation, release.

The tree decides which pages hold what; this class keeps each request's page list
consistent with it and hands tier moves to the cache controller.
"""

from __future__ import annotations

import time

from hicache.hiradix import HiRadixTree, MatchResult
from hicache.tiers.allocator import PageAllocator
from serving.cache.storage_controller import StorageController
from serving.cache.transfers import TransferRunner
from serving.structs.forward_batch import LayerWaits
from serving.structs.request import Req


class ReqCache:
    """Owns the request side of L1 pages.

    Concurrency contract: single-threaded (the scheduler's). A request may compute on its
    matched pages only once :meth:`poll_load` says so: that covers the L2 -> L1 load the
    request started itself *and* every load still filling pages it found as L1 hits
    (``ReqKV.wait_loads``, the match's pending loads). Nothing here blocks on a copy except a
    release, which commits its own load (an in-memory copy, never storage I/O).

    Waiting for L1 room: a new request whose L2 hit (one the tree would load back) cannot be
    loaded because other admitted requests hold L1 is not admitted yet (:meth:`reserve`
    refuses it, so the scheduler puts it back and its L2 prefix is pinned again) rather than
    recomputing its whole prefix, for at most ``L1_WAIT_S`` seconds; it is admitted with its
    load once they give L1 back. Without other holders it never waits (nothing would free L1).
    """

    L1_WAIT_S = 1.0

    def __init__(self, tree: HiRadixTree, allocator: PageAllocator, page_size: int,
                 transfers: TransferRunner, storage: StorageController | None = None) -> None:
        self.tree = tree
        self.allocator = allocator
        self.page_size = page_size
        self.transfers = transfers  # the storage controller's runner when there is L3 (its backups go on to L3)
        self.storage = storage
        self._holders: set[str] = set()  # admitted requests not released yet (they hold L1)
        self._l1_waits: dict[str, float] = {}  # rid -> when it first waited for L1 room
        self._refuse: set[str] = set()  # admitted this step only to be put back (see the class docstring)

    # -- moving data -----------------------------------------------------------------
    def flush_transfers(self) -> None:
        """Execute the tree's pending tier moves (in order) before any freed page is reused;
        loads run on in the background (their PendingLoads say when they have landed)."""
        self.transfers.flush()

    def alloc(self, n: int) -> list[int] | None:
        """``n`` L1 pages, evicting unlocked cached pages if needed; None if impossible."""
        short = n - self.allocator.num_free
        if short > 0:
            self.tree.evict_device(short)
            self.flush_transfers()
        if not self.allocator.can_alloc(n):
            return None
        return self.allocator.alloc(n)

    # -- request life cycle ----------------------------------------------------------
    def _matchable(self, req: Req) -> list[int]:
        """Leave at least one token to compute: its logits give the next token; a request asking
        for prompt logprobs computes every position whose logits they need (serving.model.logprobs)."""
        end = req.seq_len - 1
        limit = req.logprob.cache_limit(self.page_size) if req.logprob is not None else None
        return req.fill_ids[: end if limit is None else min(end, limit)]

    def peek_prefix_len(self, req: Req) -> int:
        """The admission order's key (``lpm``): cached prefix tokens, those on L1 counting twice
        (SGLang's lpm ranks by the L1 prefix: a request that runs on its L1 pages goes before
        one that must load them, whose load would evict them first)."""
        tokens = self._matchable(req)
        node, matched = self.tree.lookup(tokens)
        device = 0
        for nd in reversed(node.path_to_root()):
            if nd.device_pages is None:
                break
            device += len(nd.key)
        return min(device, matched) + matched

    def uncached_len(self, req: Req) -> int:
        """Prompt tokens a forward pass would compute were ``req`` admitted now: those past its prefix
        cached on L1 or L2 (read-only, as :meth:`peek_prefix_len`; the scheduler's short-request test)."""
        return req.seq_len - self.tree.peek_prefix_len(self._matchable(req))

    def match(self, req: Req) -> MatchResult:
        m = self.tree.match_prefix(self._matchable(req))
        self.flush_transfers()  # write-through backups of hit nodes run now, before anyone reads them
        return m

    def admit(self, req: Req, match: MatchResult) -> None:
        """Lock the matched prefix (loading its L2 part back to L1) and take its pages
        as the request's first pages. Loads run in the background: the request waits
        until :meth:`poll_load` sees every load that fills its pages done."""
        m = match
        if match.host_hit_tokens > 0:
            m = self.tree.load_back(match)
            self.flush_transfers()  # the controller binds the load's PendingLoad
            if m is not match:
                req.kv.load_node = m.last_device_node
            elif not req.kv.admitted and self._wait_for_l1(req, match):
                self._refuse.add(req.rid)
        self._holders.add(req.rid)
        req.kv.wait_loads = m.pending_loads
        self.tree.lock(m.last_device_node)
        req.kv.lock_node = m.last_device_node
        if self.storage is not None:
            self.storage.on_hit(m.last_device_node)
        req.kv.pages = list(m.device_pages)
        req.kv.tree_pages = len(req.kv.pages)
        req.kv.kv_len = req.kv.tree_pages * self.page_size
        if not req.kv.admitted:
            req.kv.admitted = True
            req.kv.cached_tokens = req.kv.kv_len
            # pages from L3 end the prefix; the prefetch may already have loaded them on to L1
            storage = min(req.kv.storage_hit_tokens, req.kv.kv_len)
            device = min(match.device_hit_tokens, req.kv.kv_len - storage)
            req.kv.cached_by_tier = {"device": device, "host": req.kv.kv_len - device - storage, "storage": storage}

    def _wait_for_l1(self, req: Req, match: MatchResult) -> bool:
        """Whether ``req`` should wait for L1 room rather than recompute its L2 hit now."""
        pages = match.host_hit_tokens // self.page_size
        if pages < max(1, self.tree.load_back_threshold) or not self._holders - {req.rid}:
            return False
        if pages + len(match.device_pages) > self.allocator.num_pages:
            return False  # it could never fit
        now = time.monotonic()
        since = self._l1_waits.setdefault(req.rid, now)
        return now - since < self.L1_WAIT_S

    def poll_load(self, req: Req, wait: bool = False) -> bool:
        """True when the request may run a forward pass over its pages: every load filling
        them has landed, or is a layered GPU load whose per-layer events the pass will wait
        for (:meth:`layer_waits`; those loads stay in ``req.kv.wait_loads`` until they land).
        The request's own load is committed to the tree only once it has landed. ``wait``
        blocks until every load has landed."""
        if req.kv.wait_loads:
            if wait:
                for p in req.kv.wait_loads:
                    p.wait()
            if not all(p.done() for p in req.kv.wait_loads):
                return all(p.layer_events() is not None for p in req.kv.wait_loads)
            req.kv.wait_loads = ()
        if req.kv.load_node is not None:
            self.tree.finish_load(req.kv.load_node)
            req.kv.load_node = None
        return True

    @staticmethod
    def layer_waits(reqs: list[Req]) -> LayerWaits | None:
        """The per-layer events of loads still landing in pages these requests read (every
        request here passed :meth:`poll_load`, so each such load has them)."""
        loads = [p.layer_events() for r in reqs for p in r.kv.wait_loads if not p.done()]
        return LayerWaits(loads) if loads else None

    # -- L3 prefetch (no-ops without a storage tier) -------------------------------------
    def advance_prefetch(self, req: Req) -> None:
        if self.storage is not None:
            self.storage.advance_prefetch(req)

    def prefetch_ready(self, req: Req) -> bool:
        return self.storage is None or self.storage.prefetch_ready(req)

    def finish_prefetch(self, req: Req) -> None:
        if self.storage is not None and req.kv.prefetch is not None:
            req.kv.storage_hit_tokens += self.storage.finish_prefetch(req) * self.page_size

    def poll(self) -> None:
        if self.storage is not None:
            self.storage.poll()

    def reserve(self, req: Req, upto_len: int) -> bool:
        """Make ``req.kv.pages`` cover positions ``< upto_len``; False (nothing taken) if no room."""
        if req.rid in self._refuse:
            return False  # it waits for L1 room (admit): the scheduler releases it and stops admitting
        need = -(-upto_len // self.page_size) - len(req.kv.pages)
        if need <= 0:
            return True
        pages = self.alloc(need)
        if pages is None:
            return False
        req.kv.pages.extend(pages)
        return True

    def trim(self, req: Req, keep_len: int) -> None:
        """Give back the request's own pages past those positions ``< keep_len`` need (speculative
        decoding: the pages of rejected drafts)."""
        keep = max(req.kv.tree_pages, -(-keep_len // self.page_size))
        if len(req.kv.pages) > keep:
            extra = req.kv.pages[keep:]
            del req.kv.pages[keep:]
            self.allocator.free(extra)

    def advance(self, req: Req, n: int) -> None:
        """A forward pass computed the KV of ``req``'s next ``n`` positions (into its reserved pages)."""
        req.kv.kv_len += n

    def take_prompt(self, req: Req, reuse_prefix: bool) -> bool:
        """Pages for ``req``'s whole prompt, for KV computed elsewhere (a PD decode server): with
        ``reuse_prefix`` its cached prefix first (matched and locked as any admission, so only the rest
        is sent), then fresh pages for the rest. False: no room now (nothing held; retry later)."""
        if reuse_prefix:
            self.admit(req, self.match(req))
        if self.reserve(req, len(req.input_ids)):
            req.kv.admitted = True
            return True
        self.release(req)  # no room yet: give the prefix back
        req.kv.admitted = False
        return False

    def prompt_arrived(self, req: Req, cached_tokens: int, cached_by_tier: dict[str, int]) -> None:
        """The KV of ``req``'s whole prompt has arrived in its pages (:meth:`take_prompt`), with the
        cache hit of the server that computed it (what the user saved)."""
        kv = req.kv
        kv.kv_len = len(req.input_ids)
        kv.cached_tokens = cached_tokens
        kv.cached_by_tier = dict(cached_by_tier)

    def release(self, req: Req) -> None:
        """Give the request's pages back: full computed pages go into the tree (cached,
        unlocked), the rest to the free list. The request keeps its tokens."""
        self.finish_prefetch(req)
        self.poll_load(req, wait=True)
        self._holders.discard(req.rid)
        if req.rid in self._refuse:  # put back to wait for L1 room: its prefix is pinned again
            self._refuse.discard(req.rid)
            req.kv.prefetch_checked = False
        else:
            self._l1_waits.pop(req.rid, None)
        if req.kv.lock_node is None and not req.kv.pages:
            return
        full = req.kv.kv_len // self.page_size
        tokens = req.fill_ids[: full * self.page_size]
        dup = self.tree.insert(tokens, req.kv.pages[:full]) if full else []
        to_free = list(dup) + req.kv.pages[full:]
        if req.kv.lock_node is not None:
            self.tree.unlock(req.kv.lock_node)
        if req.session_id is not None and full and req.session_id in self.tree.sessions:
            node, _ = self.tree.lookup(tokens)  # read-only: no hit counts, no backups
            self.tree.attach_session(req.session_id, node)
        self.flush_transfers()
        if to_free:
            self.allocator.free(to_free)
        req.kv.lock_node = None
        req.kv.pages = []
        req.kv.tree_pages = 0
        req.kv.kv_len = 0
