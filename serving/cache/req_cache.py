"""Glue between requests and the cache core: admission, page reservation, release.

The tree decides which pages hold what; this class keeps each request's KV record
(``Req.kv``, :class:`serving.structs.req_kv.ReqKV`) consistent with it, hands tier moves to the
cache controller and drives the L3 prefetch of waiting requests. It is the record's writer: the
scheduler, speculative decoding and PD ask it for every change (``tests/layout/test_req_kv_writers.py``).
"""

from __future__ import annotations

import time

from hicache.hiradix import HiRadixTree, MatchResult
from hicache.tiers.allocator import PageAllocator
from hicache.tiers.state_pool import DeviceStatePool
from serving.cache.admission import Admission, Answer, lpm_key
from serving.cache.request_states import RequestStates
from serving.cache.request_windows import RequestWindows
from serving.cache.storage_controller import StorageController
from serving.cache.transfers import TransferRunner
from serving.structs.forward_batch import LayerWaits
from serving.structs.request import Req


class ReqCache:
    """Owns the request side of L1 pages and every request's KV record.

    Concurrency contract: single-threaded (the scheduler's). A request may compute on its
    matched pages only once :meth:`poll_load` says so: that covers the L2 -> L1 load the
    request started itself *and* every load still filling pages it found as L1 hits
    (``ReqKV.wait_loads``, the match's pending loads). Nothing here blocks on a copy except a
    release, which commits its own load (an in-memory copy, never storage I/O).

    Admission (:meth:`try_admit`) is one call: the L3 prefetch's policy, the match, the lock (and
    the L2 -> L1 load), the first chunk's pages; it answers what the scheduler does with the request
    (:class:`serving.cache.admission.Answer`).

    Waiting for L1 room: a new request whose L2 hit (one the tree would load back) cannot be
    loaded because other admitted requests hold L1 is not admitted yet (:meth:`try_admit`
    answers NO_ROOM, having given its prefix back, so its L2 prefix is pinned again) rather than
    recomputing its whole prefix, for at most ``L1_WAIT_S`` seconds; it is admitted with its
    load once they give L1 back. Without other holders it never waits (nothing would free L1).

    A model with state layers (``state_pool``): the tree's matches stop at its deepest state snapshot,
    which is loaded with the prefix and copied into the request's working slot; a match whose snapshot
    cannot come to L1 now starts from nothing (:class:`~serving.cache.request_states.RequestStates`
    holds the requests' slots and hands their captures to the tree at release).
    """

    L1_WAIT_S = 1.0

    def __init__(self, tree: HiRadixTree, allocator: PageAllocator, page_size: int,
                 transfers: TransferRunner, storage: StorageController | None = None,
                 state_pool: DeviceStatePool | None = None, windows: RequestWindows | None = None) -> None:
        self.tree = tree
        self.windows = windows  # a hybrid SWA L1's window pages (serving/cache/request_windows.py); None: none
        self.state_pool = state_pool  # L1 state slots of a model with state layers (None: none)
        self.states = RequestStates(tree, state_pool, page_size) if state_pool is not None else None
        self.allocator = allocator
        self.page_size = page_size
        self.transfers = transfers  # the storage controller's runner when there is L3 (its backups go on to L3)
        self.storage = storage
        self.prefetcher = storage.prefetcher if storage is not None else None  # L3 -> L2 for waiting requests
        if self.prefetcher is not None:  # a fetch waits for room only while something can give it back
            self.prefetcher.room_coming = lambda: bool(self._holders) or storage.writeback.landing
        self._holders: set[str] = set()  # admitted requests not released yet (they hold L1)
        self._l1_waits: dict[str, float] = {}  # rid -> when it first waited for L1 room
        self._refuse: set[str] = set()  # admitted this step only to be put back (see the class docstring)
        self._state_start: dict[str, int] = {}  # rid -> the L1 snapshot its working slot starts from
        self.reuse_prefixes = True  # False: --disable-radix-cache (no request matches a cached prefix)

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

    def poll(self) -> None:
        """The storage tier's background work: finished writes and fetches (no-op without L3)."""
        if self.storage is not None:
            self.storage.poll()
        if self.windows is not None:
            self.windows.settle()

    # -- waiting requests: read-only probes and the L3 prefetch ----------------------------
    def _matchable(self, req: Req) -> list[int]:
        """Leave at least one token to compute: its logits give the next token; a request asking
        for prompt logprobs computes every position whose logits they need (serving.runner.logprobs)."""
        end = req.seq_len - 1
        limit = req.logprob.cache_limit(self.page_size) if req.logprob is not None else None
        return req.fill_ids[: end if limit is None else min(end, limit)]

    def admission_key(self, req: Req) -> int:
        """The admission order's key (``lpm``: serving.cache.admission.lpm_key)."""
        return lpm_key(self.tree, self._matchable(req))

    def uncached_len(self, req: Req) -> int:
        """Prompt tokens a forward pass would compute were ``req`` admitted now: those past its prefix
        cached on L1 or L2 (read-only, as :meth:`admission_key`; the scheduler's short-request test)."""
        return req.seq_len - self.tree.peek_prefix_len(self._matchable(req))

    def advance_prefetches(self, waiting: list[Req]) -> None:
        """Each waiting request's L3 prefetch: start its lookup, then its fetch, commit what has landed
        (serving.cache.l3_prefetch; never waits). No-op without L3."""
        if self.prefetcher is not None:
            self.prefetcher.advance_all(waiting)

    def prefetch_ready(self, req: Req) -> bool:
        """Whether ``req``'s L3 prefetch lets it be admitted now (its prefetch policy); no L3: True."""
        return self.prefetcher is None or self.prefetcher.ready(req)

    def _finish_prefetch(self, req: Req) -> None:
        if self.prefetcher is not None and req.kv.prefetch is not None:
            req.kv.storage_hit_tokens += self.prefetcher.finish(req) * self.page_size

    def give_back_fetches(self, waiting: list[Req]) -> bool:
        """The ``waiting`` requests give back the L3 fetches they hold: each one's lock pins the L1 pages
        on its path (its early loads' among them), so fetches of requests that still wait can hold every
        L1 page. The scheduler calls this when a reservation finds no room and nothing running can free
        any. What landed stays on L2, unlocked; each request looks its prefix up again next step. Only the
        fetches whose locked path holds L1 pages give theirs back: giving back one that holds none frees
        no L1 and leaves what it landed unlocked on L2, where the fetches of the requests behind it evict
        it before its request runs (read from L3 again: the Gemma-3 probe's turns read each page up to
        five times). True when any was given back."""
        held = [r for r in waiting if r.kv.prefetch is not None and r.kv.prefetch.fetch is not None
                and any(nd.device_pages is not None for nd in r.kv.prefetch.fetch.node.path_to_root())]
        for r in held:
            self._finish_prefetch(r)
            r.kv.prefetch_checked = False
        return bool(held)

    # -- admission ---------------------------------------------------------------------
    def try_admit(self, req: Req, budget: int) -> Admission:
        """Admit the waiting ``req`` with a first chunk of at most ``budget`` prompt tokens: stop its L3
        prefetch (unless its policy still waits for it: WAIT), match and lock its cached prefix (loading
        its L2 part back to L1), reserve the chunk's pages (none: its prefix is given back, NO_ROOM).
        Admitted, it answers READY, or LOADING while a load it reads is still landing (CPU)."""
        if not self.prefetch_ready(req):
            return Admission(Answer.WAIT)  # its L3 prefetch is still worth waiting for (prefetch policy)
        self._finish_prefetch(req)
        kv, first = req.kv, not req.kv.admitted
        locked = self._lock_prefix(req, self._match(req))
        n = self.chunk(req, min(req.seq_len - kv.kv_len, budget)) if locked else 0
        if not locked or not self._take_state_slots(req) or not self.reserve(req, kv.kv_len + n, admission=True):
            self.release(req)
            if first:
                kv.admitted = False
            # its prefetch is over (what landed is on L2, unlocked): it waits on, so its prefix is watched
            # again (a new lookup next step: pins, L3 if the prefix or its last window leaves L2 meanwhile)
            kv.prefetch_checked = False
            return Admission(Answer.NO_ROOM)
        return Admission(Answer.READY if self.poll_load(req) else Answer.LOADING, n, first)

    def chunk(self, req: Req, n: int) -> int:
        """The prompt tokens of ``req`` a pass computes when ``n`` would fit: ``n``, or fewer for a
        state model whose captures need the pass to end earlier (RequestStates.chunk)."""
        if self.windows is not None and n > 0:  # a hybrid SWA L1: the chunk's window pages must fit its pool
            n = min(n, self.windows.chunk_limit(req))
        return n if self.states is None or n <= 0 else self.states.chunk(req, n)

    def _take_state_slots(self, req: Req) -> bool:
        """A state model's request gets its working slot (its match's snapshot, or zeros) and capture
        slot; False: no room now."""
        if self.states is None:
            return True
        start = self._state_start.pop(req.rid, None)
        return self.states.take(req, start)

    @property
    def win_map(self) -> list[int] | None:
        """A hybrid SWA L1's map of logical to window pages (what a forward batch's sliding layers read)."""
        return None if self.windows is None else self.windows.windows.map

    def _match(self, req: Req) -> MatchResult:
        tokens = self._matchable(req) if self.reuse_prefixes else []
        if self.windows is not None:  # resume only where the window before has its window KV
            tokens = tokens[: self.windows.usable_prefix(tokens)]
        m = self.tree.match_prefix(tokens)
        self.flush_transfers()  # write-through backups of hit nodes run now, before anyone reads them
        return m

    def _lock_prefix(self, req: Req, match: MatchResult) -> bool:
        """Lock the matched prefix (loading its L2 part back to L1) and take its pages
        as the request's first pages. Loads run in the background: the request waits
        until :meth:`poll_load` sees every load that fills its pages done. False (nothing
        locked): a hybrid SWA L1 has no window pages for the match's last window now (an L2
        load's, a window-only load's: serving/cache/request_windows.py)."""
        kv, m, win = req.kv, match, self.windows
        state = match.state
        if win is not None and not win.room_for_match(match):
            return False
        if match.host_hit_tokens > 0 or (state is not None and state.device_slot is None):
            m = self.tree.load_back(match)
            if m is not match and win is not None:  # the loaded run's last window: window pages
                done = len(match.device_pages)
                if not win.ensure(win.for_load(done, m.device_pages[done:])):
                    raise RuntimeError("no window pages for a load-back: every window page is locked")
            self.flush_transfers()  # the controller binds the load's PendingLoad
            if m is not match:
                kv.load_node = m.last_device_node
            elif not kv.admitted and self._wait_for_l1(req, match):
                self._refuse.add(req.rid)
        if win is not None and m.host_hit_tokens > 0:  # not loaded: it resumes where its L1 part has windows
            tokens = self._matchable(req)[: len(m.device_pages) * self.page_size]
            m = self.tree.match_prefix(tokens[: win.usable_prefix(tokens)])
        if self.states is not None:
            if not m.resumable:  # its snapshot (or the KV before it) is not on L1: start from nothing
                m = self.tree.match_prefix([])
            elif m.state is not None:
                self._state_start[req.rid] = m.state.device_slot
        self._holders.add(req.rid)
        self.tree.lock(m.last_device_node)
        kv.lock_node = m.last_device_node
        restoring = win.restore(m) if win is not None else ()  # its last window's window-only loads
        if restoring is None:  # no window pages for them now: nothing locked
            self.tree.unlock(m.last_device_node)
            kv.lock_node = None
            kv.wait_loads = tuple(m.pending_loads)  # a load it started: release waits for it to land
            return False
        kv.wait_loads = (*m.pending_loads, *restoring)
        if self.storage is not None:
            self.storage.on_hit(m.last_device_node)
        kv.pages = list(m.device_pages)
        kv.tree_pages = len(kv.pages)
        kv.kv_len = kv.tree_pages * self.page_size
        if not kv.admitted:
            kv.admitted = True
            kv.cached_tokens = kv.kv_len
            # pages from L3 end the prefix; the prefetch may already have loaded them on to L1
            storage = min(kv.storage_hit_tokens, kv.kv_len)
            device = min(match.device_hit_tokens, kv.kv_len - storage)
            kv.cached_by_tier = {"device": device, "host": kv.kv_len - device - storage, "storage": storage}
        return True

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

    def take_prompt(self, req: Req, reuse_prefix: bool) -> bool:
        """Pages for ``req``'s whole prompt, for KV computed elsewhere (a PD decode server): with
        ``reuse_prefix`` its cached prefix first (matched and locked as any admission, so only the rest
        is sent), then fresh pages for the rest, and a state model's slots (the sender writes its state
        after the prompt into the working one). False: no room now (nothing held; retry later)."""
        if reuse_prefix:
            self._lock_prefix(req, self._match(req))
        # a hybrid SWA L1: window pages only for the prompt's last window (what the next tokens read and where
        # the same prompt resumes; the sender fills them), so a prompt longer than the window pool fits
        first = 0 if self.windows is None else self.windows.first_needed(self.windows.prompt_end(req))
        if self._take_state_slots(req) and self.reserve(req, len(req.input_ids), first):
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

    # -- running requests ----------------------------------------------------------------
    def poll_load(self, req: Req, wait: bool = False) -> bool:
        """True when the request may run a forward pass over its pages: every load filling
        them has landed, or is a layered GPU load whose per-layer events the pass will wait
        for (:meth:`layer_waits`; those loads stay in ``req.kv.wait_loads`` until they land).
        The request's own load is committed to the tree only once it has landed. ``wait``
        blocks until every load has landed."""
        kv = req.kv
        if kv.wait_loads:
            if wait:
                for p in kv.wait_loads:
                    p.wait()
            if not all(p.done() for p in kv.wait_loads):
                return all(p.layer_events() is not None for p in kv.wait_loads)
            kv.wait_loads = ()
            if self.windows is not None:
                self.windows.settle()  # unpin what landed
        if kv.load_node is not None:
            self.tree.finish_load(kv.load_node)
            kv.load_node = None
        return True

    @staticmethod
    def layer_waits(reqs: list[Req]) -> LayerWaits | None:
        """The per-layer events of loads still landing in pages these requests read (every
        request here passed :meth:`poll_load`, so each such load has them)."""
        loads = [p.layer_events() for r in reqs for p in r.kv.wait_loads if not p.done()]
        return LayerWaits(loads) if loads else None

    def reserve(self, req: Req, upto_len: int, windows_from: int = 0, admission: bool = False) -> bool:
        """Make ``req.kv.pages`` cover positions ``< upto_len``; False (nothing taken) if no room. A hybrid
        SWA L1: the new pages from page index ``windows_from`` on get window pages (``admission``: a waiting
        request's first pages, which may wait for L2 room rather than drop windows: RequestWindows.ensure)."""
        if req.rid in self._refuse:
            return False  # it waits for L1 room (_lock_prefix): try_admit releases it, admission stops
        need = -(-upto_len // self.page_size) - len(req.kv.pages)
        if need <= 0:
            return True
        pages = self.alloc(need)
        if pages is None:
            return False
        if self.windows is not None:  # the sliding layers' KV of these pages: window pages
            want = pages[max(0, windows_from - len(req.kv.pages)):]
            ok = self.windows.ensure(want, wait_for_l2=admission)
            if not ok and self._holders == {req.rid} and self.windows.free_behind(req):
                ok = self.windows.ensure(want)  # alone: its own prefix behind its window held them
            self.flush_transfers()
            if not ok:
                self.allocator.free(pages)
                return False
        req.kv.pages.extend(pages)
        return True

    def advance(self, req: Req, n: int) -> None:
        """A forward pass computed the KV of ``req``'s next ``n`` positions (into its reserved pages)."""
        req.kv.kv_len += n
        if self.windows is not None:
            self.windows.trim(req)  # window pages no later token of it reads

    def trim(self, req: Req, keep_len: int) -> None:
        """Give back the request's own pages past those positions ``< keep_len`` need (speculative
        decoding: the pages of rejected drafts)."""
        kv = req.kv
        keep = max(kv.tree_pages, -(-keep_len // self.page_size))
        if len(kv.pages) > keep:
            extra = kv.pages[keep:]
            del kv.pages[keep:]
            self.allocator.free(extra)

    def release(self, req: Req) -> None:
        """Give the request's pages back: full computed pages go into the tree (cached,
        unlocked), the rest to the free list. The request keeps its tokens."""
        self._finish_prefetch(req)
        self.poll_load(req, wait=True)
        kv = req.kv
        self._holders.discard(req.rid)
        if req.rid in self._refuse:  # put back to wait for L1 room: its prefix is pinned again
            self._refuse.discard(req.rid)
            kv.prefetch_checked = False
        else:
            self._l1_waits.pop(req.rid, None)
        self._state_start.pop(req.rid, None)
        if kv.lock_node is None and not kv.pages:
            if self.states is not None:
                self.states.give_back(req, [])
            return
        full = kv.kv_len // self.page_size
        tokens = req.fill_ids[: full * self.page_size]
        dup = self.tree.insert(tokens, kv.pages[:full]) if full else []
        if self.windows is not None:
            self.windows.adopt(tokens, kv.pages[:full], dup)
        if self.states is not None:
            self.states.give_back(req, tokens)
        to_free = list(dup) + kv.pages[full:]
        if kv.lock_node is not None:
            self.tree.unlock(kv.lock_node)
        if req.session_id is not None and full and req.session_id in self.tree.sessions:
            node, _ = self.tree.lookup(tokens)  # read-only: no hit counts, no backups
            self.tree.attach_session(req.session_id, node)
        self.flush_transfers()
        if to_free:
            self.allocator.free(to_free)
        kv.lock_node = None
        kv.pages = []
        kv.tree_pages = 0
        kv.kv_len = 0

    def release_and_back_up(self, req: Req) -> None:
        """:meth:`release`, then the full pages of the request's sequence get an L2 copy at once (their
        L3 write-back queued behind it): a PD decode server's finished turn, which the next turn's
        prefill server reads from the shared L3."""
        tokens = req.fill_ids[: req.kv.kv_len - req.kv.kv_len % self.page_size]
        self.release(req)
        if tokens:
            self.tree.backup_prefix(tokens)
            self.flush_transfers()
