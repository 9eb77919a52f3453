"""Window pages of a hybrid SWA L1 on the request side (hicache/tiers/window_pages.py): which of a
request's pages keep their sliding layers' KV, where a match may resume, and eviction of window pages.

A sliding layer of window ``w`` reads, for a token at position ``p``, positions ``p - w + 1 .. p``. So:

- A running request needs window pages for the pages it computes into (``ensure``, from ``reserve``),
  and after each forward pass frees those of its own pages that no later token of it reads
  (``trim``): every position below ``floor(kv_len / ps) * ps - w + 1`` (whole pages only; the floor
  keeps the window before the end of its last full page, where the next turn resumes). It keeps the
  window before its prompt's matchable end too (``prompt_end``: the same prompt asked again resumes
  there). Pages it took from the tree are not its to free.
- A match may resume at a page boundary ``e`` only if every page overlapping ``[e - w + 1, e)`` has its
  window KV: an L1 page its window page or an L2 copy with a valid sliding part, an L2-only page a valid
  sliding part (``host.sliding_valid``). ``usable_prefix`` finds the deepest such ``e``; the admission cuts
  its match there (the rest is recomputed). A loaded-back L2 run gets window pages for the pages in that last
  window only (``for_load``); the match's L1 pages in it that have none get window pages and a window-only
  load of their sliding layers' KV from their L2 copies (``to_restore``, ``restore``: a ``window_load``
  Transfer run behind the tree's moves, its L2 pages pinned until it has landed). A request reading those
  window pages waits for that load (``restore`` returns the loads in flight in its last window, whoever
  started them).
- At release, a request page that duplicated a tree page hands its window page to the tree page when
  that has none (``adopt``): the same positions' window KV.
- Under window-pool pressure (``make_room``) unlocked tree nodes lose their window pages alone (their full KV
  stays, matches on L1 then stop higher): first those whose L2 copy keeps the window KV, then those without an
  L2 copy, then those whose L2 copy lost it, least recently used first within each; only then are whole
  pages evicted. Demote before drop: a victim without an L2 copy is backed up first (full and window KV, the
  tree making L2 room as for any backup), so a match from L2 still resumes at its end; one that finds no L2
  room goes last, and an admission waits for L2 instead while L3 writes in flight pin it (``wait_for_l2``).
- An L2 with a host window pool (hicache/tiers/host_windows.py) is reclaimed the same way
  (``make_host_room``, installed as its ``reclaim``: a backup short of host window pages calls it):
  unlocked, unpinned, not loading tree nodes lose their host window pages alone, those on L3 first (L3 holds
  their window KV), least recently used first within each; never those on the path the last match looked at
  (it may be loading them next). L2 pages are never evicted for host window room (a backup that still finds
  none keeps no sliding part).

Concurrency contract: the scheduler thread only (as ReqCache, its owner). A window-only load runs on the
cache controller's loader thread or CUDA stream; its ``PendingLoad`` is polled here (``settle``), never waited
on except by a release (ReqCache.poll_load).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hicache.hiradix import HiRadixTree, MatchResult, PendingLoad, Transfer, TreeNode
from hicache.tiers.host import HostKVPool
from hicache.tiers.window_pages import WindowPages, pages_per_window
from serving.cache.transfers import TransferRunner
from serving.structs.request import Req


class RequestWindows:
    """The window pages' policy for requests and the tree (see the module docstring)."""

    def __init__(self, windows: WindowPages, tree: HiRadixTree, page_size: int, window: int,
                 host: HostKVPool | None, runner: TransferRunner | None = None) -> None:
        """``runner``: runs the tree's queued moves and the window-only loads; None: window pages are dropped
        without demoting them first, and never restored."""
        self.windows = windows
        self._runner = runner
        self._loading: dict[int, PendingLoad] = {}  # L1 page -> the window-only load filling its window page
        self._pinned: list[tuple[PendingLoad, list[int]]] = []  # window-only loads in flight, their L2 pages
        self.restored_pages = 0  # window pages filled by window-only loads (scheduler thread)
        self.tree = tree
        self.page_size = page_size
        self.window = window  # the largest window of the model's sliding layers
        self.host = host
        # the end of the path the last usable_prefix walked: make_host_room spares that path as it is when it
        # runs (a match splits a node of it: the new upper part is on it too), so a match keeps the sliding
        # parts it was found usable for while room is made for its load
        self._matched: TreeNode | None = None
        # whether L2 room will come back by itself soon (L3Windows.attach: L3 writes in flight that have
        # not failed, whose pinned L2 pages become evictable when they land); an admission then waits rather
        # than drop windows
        self.l2_room_coming: Callable[[], bool] = lambda: False
        if host is not None and host.windows is not None:
            host.windows.reclaim = self.make_host_room

    # -- running requests ---------------------------------------------------------------
    def first_needed(self, end: int) -> int:
        """The first page a token resuming at position ``end`` reads (sliding layers)."""
        return max(0, end - self.window + 1) // self.page_size

    def ensure(self, pages: Sequence[int], wait_for_l2: bool = False) -> bool:
        """Window pages for ``pages`` (a request computes into them), evicting for room (``wait_for_l2``: an
        admission, see :meth:`_drop_windows`); False: none."""
        short = len(self.windows.missing(pages)) - self.windows.num_free
        if short > 0:
            self.make_room(short, wait_for_l2)
        return self.windows.assign(pages)

    def chunk_limit(self, req: Req) -> int:
        """The most new tokens a pass of ``req`` may compute: window pages for all of them, beside the two
        windows it keeps (before its position and before its prompt's end), must fit the window pool
        even when nothing else holds it; a longer chunk would never find room (it would wait forever)."""
        ps = self.page_size
        pages = max(1, self.windows.num_pages - 2 * pages_per_window(self.window, ps) - 1)
        return max(1, pages * ps - req.kv.kv_len % ps)

    def free_behind(self, req: Req) -> int:
        """Window pages of ``req``'s prefix pages from the tree that no token of it reads any more (below the
        window before its position), demoted to L2 first as under pressure (their nodes stay on L1); for a
        request alone on L1, whom no other holder of that prefix needs them for. Its own locked prefix could
        hold the window pool it needed: a lone request's decode was ended for a pool too small (7 window pages,
        5 of them on its prefix). Returns how many were freed."""
        kv, ps, m = req.kv, self.page_size, self.windows.map
        upto = min(kv.tree_pages, self.first_needed(kv.kv_len // ps * ps))
        pages = {p for p in kv.pages[:upto] if m[p] >= 0}
        if not pages:
            return 0
        node, _ = self.tree.lookup(req.fill_ids[: upto * ps])
        bare = [nd for nd in node.path_to_root() if nd.device_pages is not None and nd.host_pages is None
                and not pages.isdisjoint(nd.device_pages)]
        if self._runner is not None and self.host is not None and self.tree.demote(bare):
            self._runner.flush()  # the backups read the window pages: copied before they are freed
        return self.windows.drop(sorted(pages))

    def prompt_end(self, req: Req) -> int:
        """Where the same prompt asked again would resume (its matchable end, whole pages)."""
        return (len(req.input_ids) - 1) // self.page_size * self.page_size

    def trim(self, req: Req) -> int:
        """Free the window pages of ``req``'s own pages no later token of it reads (see the module
        docstring); returns how many."""
        kv, ps = req.kv, self.page_size
        upto = self.first_needed(kv.kv_len // ps * ps)  # pages before this one: out of every window it keeps
        keep_lo, keep_hi = self.first_needed(self.prompt_end(req)), self.prompt_end(req) // ps
        drop = [kv.pages[i] for i in range(kv.tree_pages, min(upto, len(kv.pages)))
                if not keep_lo <= i < keep_hi]
        return self.windows.drop(drop)

    # -- matches ------------------------------------------------------------------------
    def usable_prefix(self, tokens: Sequence[int]) -> int:
        """The longest prefix of ``tokens`` (whole pages) the tree holds whose last window has its
        window KV on L1 or on L2 (see the module docstring); read-only."""
        valid = self.valid_pages(tokens)
        bad = -1  # the last invalid page below the candidate end
        best = 0
        for e in range(1, len(valid) + 1):  # candidate end: e pages
            if not valid[e - 1]:
                bad = e - 1
            if bad < self.first_needed(e * self.page_size):
                best = e
        return best * self.page_size

    def valid_pages(self, tokens: Sequence[int]) -> list[bool]:
        """Per page of the cached path of ``tokens`` (L1 or L2): whether its window KV is at hand (an L1
        window page, or a valid sliding part on L2)."""
        node, matched = self.tree.lookup(tokens)
        ps = self.page_size
        n = matched // ps
        valid: list[bool] = []
        m, flags = self.windows.map, self.host.sliding_valid if self.host is not None else None
        path = node.path_to_root()
        self._matched = node
        for nd in reversed(path):
            if nd.parent is None:
                continue  # the root
            k = len(nd.key) // ps
            if nd.device_pages is not None:
                hp = nd.host_pages if flags is not None and self._runner is not None else None
                valid += [m[p] >= 0 or (hp is not None and bool(flags[hp[i]]))  # restorable from L2
                          for i, p in enumerate(nd.device_pages[:k])]
            elif nd.host_pages is not None and flags is not None:
                valid += [bool(flags[p]) for p in nd.host_pages[:k]]
            else:
                valid += [False] * k
            if len(valid) >= n:
                break
        return valid[:n]

    def for_load(self, prefix_pages: int, loaded: Sequence[int]) -> list[int]:
        """Of the pages an L2 -> L1 load fills (the match's pages ``prefix_pages ..``), those in the last
        window before the match's end: they get window pages (their L2 sliding parts are valid: the cut)."""
        end = prefix_pages + len(loaded)
        lo = max(prefix_pages, self.first_needed(end * self.page_size))
        return list(loaded[lo - prefix_pages:])

    def to_restore(self, match: MatchResult, end: int) -> list[tuple[int, int]]:
        """(L1 page, its L2 copy) of the match's L1 pages in the last window before page ``end`` that have no
        window page: a window-only load restores them (``usable_prefix`` let the match end there because
        their L2 sliding parts are valid)."""
        flags = self.host.sliding_valid if self.host is not None else None
        n = len(match.device_pages)
        lo = self.first_needed(end * self.page_size)
        if flags is None or self._runner is None or lo >= n:
            return []
        m, pairs = self.windows.map, []
        nd, pos = match.last_device_node, n
        while nd is not None and nd.parent is not None and pos > lo:
            k = len(nd.device_pages) if nd.device_pages is not None else 0
            pos -= k
            for i in range(max(0, lo - pos), k):
                p = nd.device_pages[i]
                if m[p] < 0:
                    if nd.host_pages is None or not flags[nd.host_pages[i]]:
                        raise RuntimeError("a match ends where a window cannot be restored (usable_prefix)")
                    pairs.append((p, nd.host_pages[i]))
            nd = nd.parent
        return pairs

    def room_for_match(self, match: MatchResult) -> bool:
        """Window room for what resuming at ``match``'s end needs (its L2 part's load, the window-only loads of
        its L1 pages in the last window: ``room_for_load``); False: not now (NO_ROOM)."""
        loaded = match.host_hit_tokens // self.page_size
        restore = len(self.to_restore(match, match.cached_tokens // self.page_size))
        if not loaded and not restore:
            return True
        protect = match.last_host_node if loaded else match.last_device_node
        return self.room_for_load(match.device_pages, loaded, protect, restore)

    def restore(self, match: MatchResult) -> tuple[PendingLoad, ...] | None:
        """For a request resuming at the end of ``match``'s L1 pages (locked): window pages for those of its
        last window that have none (``to_restore``; room made before by ``room_for_match``) and one
        window-only load of their sliding layers' KV from their L2 copies, pinned until it lands. Returns the
        loads the request waits for: this one and any still filling window pages of that window; None: no
        window pages now (every one locked)."""
        n = len(match.device_pages)
        pairs = self.to_restore(match, n)
        if pairs:
            pages = [p for p, _ in pairs]
            hosts = [h for _, h in pairs]
            if not self.ensure(pages):
                return None
            pending = PendingLoad()
            self.tree.pin_host(hosts)  # until it has landed (settle): never reused meanwhile
            self._runner.run([Transfer("window_load", hosts, pages, pending=pending)])
            self._pinned.append((pending, hosts))
            self._loading.update(dict.fromkeys(pages, pending))
            self.restored_pages += len(pages)
        last = match.device_pages[self.first_needed(n * self.page_size):]
        return tuple({id(w): w for p in last if (w := self._loading.get(p)) is not None}.values())

    def settle(self) -> None:
        """Unpin the L2 pages of the window-only loads that have landed."""
        if not self._pinned:
            return
        landed: set[int] = set()
        flying = []
        for w, hosts in self._pinned:  # done() read once per load: it may land meanwhile
            if w.done():
                self.tree.unpin_host(hosts)
                landed.add(id(w))
            else:
                flying.append((w, hosts))
        self._pinned = flying
        self._loading = {p: w for p, w in self._loading.items() if id(w) not in landed}

    def adopt(self, tokens: Sequence[int], own: Sequence[int], dup: Sequence[int]) -> None:
        """After ``tree.insert(tokens, own)``: each page of ``own`` that duplicated a tree page (``dup``)
        hands its window page to that tree page when it has none."""
        if not dup:
            return
        dups = set(dup)
        node, _ = self.tree.lookup(tokens)
        path: list[int | None] = []
        for nd in reversed(node.path_to_root()):
            if nd.parent is None:
                continue
            k = len(nd.key) // self.page_size
            path += list(nd.device_pages[:k]) if nd.device_pages is not None else [None] * k
        for p, t in zip(own, path, strict=False):
            if p in dups and t is not None and t != p:
                self.windows.move(p, t)

    # -- eviction -----------------------------------------------------------------------
    def room_for_load(self, device_pages: Sequence[int], loaded_pages: int, protect: TreeNode | None = None,
                      restore: int = 0) -> bool:
        """Before an L2 -> L1 load of ``loaded_pages`` pages after a match's L1 pages ``device_pages`` is
        started, and a window-only load of ``restore`` of those L1 pages: free window pages for its last
        window (``for_load`` takes at most one window's), dropping unlocked tree nodes' window pages but never
        whole pages (the match must stay as it is) nor those of the match's own L1 pages in that last window
        (``protect``: the match's last node, whose path a demotion's L2 room never comes from); False: not now
        (the admission answers NO_ROOM)."""
        need = min(loaded_pages, pages_per_window(self.window, self.page_size)) + restore
        short = need - self.windows.num_free
        if short > 0:
            first = self.first_needed((len(device_pages) + loaded_pages) * self.page_size)
            self._drop_windows(short, set(device_pages[first:]), protect, wait_for_l2=True)
        return self.windows.num_free >= need

    def _drop_windows(self, n: int, keep: set[int], protect: TreeNode | None = None, wait_for_l2: bool = False) -> int:
        """Unlocked tree nodes lose their window pages (all but the pages in ``keep``) until ``n`` are freed:
        first those whose L2 copy keeps their sliding part, then those without an L2 copy, then those whose
        L2 copy lost it (their window KV is then on L3 at most), each LRU. Demoted first: those without an
        L2 copy get one (their window KV with it; the tree may evict L2-only leaves for the room, never on
        ``protect``'s path), copied before the drop. One that finds no L2 room keeps its window pages while
        others can be had; after them it loses them (a running request must get its pages), unless
        ``wait_for_l2`` (an admission, which may wait) and L2 room is coming (``l2_room_coming``: L3 writes in
        flight, whose pinned L2 pages are evictable once they land). Those windows were a whole conversation's
        end, on L1 only: dropped anyway, its next turn recomputed everything (a burst whose L3 writes pinned
        L2)."""
        m = self.windows.map
        cands = [nd for nd in self.tree.nodes()
                 if nd.device_pages is not None and not nd.lock_ref and not nd.loading
                 and any(m[p] >= 0 and p not in keep for p in nd.device_pages)]
        cands.sort(key=lambda nd: (self._window_loss(nd), nd.last_access))
        demote = self._runner is not None and self.host is not None
        victims, bare, count = [], [], 0

        def held(nd: TreeNode) -> int:
            return sum(1 for p in nd.device_pages if m[p] >= 0 and p not in keep)

        for nd in cands:
            if count >= n:
                break
            if demote and nd.host_pages is None and self.tree.demote([nd], protect):
                self._runner.flush()  # the backup reads the window pages: copied before they are freed
            if demote and nd.host_pages is None:
                bare.append(nd)  # no L2 room for it: its window KV would be lost
                continue
            victims.append(nd)
            count += held(nd)
        if count < n and not (wait_for_l2 and self.l2_room_coming()):
            for nd in bare:
                if count >= n:
                    break
                victims.append(nd)
                count += held(nd)
        for nd in victims:  # an L2 copy keeping the window KV the L1 copy loses stays beside it (exclusive tiers)
            if nd.device_pages is not None and self._window_loss(nd) == 0:
                self.tree.exclusive.keep_window_copy(nd)
        return sum(self.windows.drop([p for p in nd.device_pages if p not in keep])
                   for nd in victims if nd.device_pages is not None)

    def _window_loss(self, nd: TreeNode) -> int:
        """What dropping ``nd``'s L1 window pages risks: 0 its L2 copy keeps their sliding part, 1 it has no
        L2 copy (a demotion backs them up, if host window pages can be had), 2 its L2 copy lost it."""
        if nd.host_pages is None:
            return 1
        flags, m = (self.host.sliding_valid if self.host is not None else None), self.windows.map
        if flags is None:
            return 2
        return 0 if all(flags[h] for d, h in zip(nd.device_pages, nd.host_pages, strict=True) if m[d] >= 0) else 2

    def make_room(self, n: int, wait_for_l2: bool = False) -> int:
        """Free at least ``n`` window pages: unlocked tree nodes' first (LRU, demoted to L2 before, their full
        KV stays on L1; ``wait_for_l2``: see :meth:`_drop_windows`), then whole L1 pages (tree eviction);
        returns how many were freed."""
        freed = self._drop_windows(n, set(), wait_for_l2=wait_for_l2)
        if freed < n and not (wait_for_l2 and self.l2_room_coming()):  # (evicting would drop what it kept)
            before = self.windows.num_free
            self.tree.evict_device(n - freed)
            freed += self.windows.num_free - before
        return freed

    def make_host_room(self, n: int) -> int:
        """Free at least ``n`` host window pages if possible: unlocked tree nodes' (their L2 full layers stay;
        see the module docstring), those waiting requests hold last, those on L3 first, each LRU, but never
        those on the path the last ``usable_prefix`` walked (a match being admitted; or a waiting
        request's ``cut_stale_tail``, mostly the queue's head, the next admitted: sparing it keeps that request's
        windows; sparing an admission's match alone cached less of test_engine_swa_l3_windows' later turns
        under load). Returns how many were freed."""
        hw = self.host.windows if self.host is not None else None
        if hw is None:
            return 0
        m, pins = hw.map, self.tree.pins
        spared = set() if self._matched is None else {id(nd) for nd in self._matched.path_to_root()}
        cands = [nd for nd in self.tree.nodes()
                 if nd.host_pages is not None and not nd.lock_ref and not nd.loading and id(nd) not in spared
                 and any(m[p] >= 0 for p in nd.host_pages) and not pins.any_pinned(nd.host_pages)]
        # the prefixes waiting requests hold (tree.hold: mostly what their fetches landed) last; their window KV
        # safe elsewhere first: on L3 (a host window page on a page L3 holds was there when it was written, or
        # came with it from L3); LRU within each
        cands.sort(key=lambda nd: (nd.wait_ref > 0, not self.tree.on_l3(nd), nd.last_access))
        freed = 0
        for nd in cands:
            if freed >= n:
                break
            freed += hw.drop(nd.host_pages)
        return freed
