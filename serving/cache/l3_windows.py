"""Window pages of a hybrid SWA cache against an L3 prefetch (serving/cache/l3_prefetch.py, l3_fetch.py): the
policy of serving/cache/request_windows.py for KV that comes back from storage.

An L3 value of a page holds its full layers and, when it was written with one, its sliding part. A fetch
lands values on L2 pages; a sliding part lands only on a host window page (hicache/tiers/host_windows.py), and
a match resumes only where its last window is whole (``RequestWindows.usable_prefix``). So:

- A fetch starts only once host window pages for the pages of its last window can be had (``fetch_room``, the
  prefetcher's ``window_room``; it retries each step otherwise, as for L2 room) and takes them before its read
  (``for_fetch``, the fetch's ``on_start``). The readers never reclaim: without this, with the host window pool
  full, every value landed without its sliding part.
- A tail whose window KV is nowhere above L3 (L1 window pages dropped, host window pages reclaimed) hides L3's
  whole copy: before a lookup, and again while its request waits, it leaves the tree when L3 holds it and
  nothing holds it (``cut_stale_tail``, the prefetcher's ``window_cut``), and is read again.
- A fetch's early L2 -> L1 load runs only while its last window's window pages can be had beside one
  request's need (``early_load_ok``), and gives them to that window only (``on_early_load``).

Concurrency contract: the scheduler thread only, as RequestWindows (the prefetcher calls these hooks from
its ``step`` and the fetches' ``poll``, both on the scheduler thread).
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache.hiradix import MatchResult
from hicache.tiers.window_pages import min_window_pages, pages_per_window
from serving.cache.l3_prefetch import Prefetcher
from serving.cache.l3_writeback import WriteBack
from serving.cache.request_windows import RequestWindows


class L3Windows:
    """The window pages' policy toward L3 fetches (see the module docstring); ``attach`` installs it."""

    def __init__(self, rw: RequestWindows) -> None:
        self._rw = rw
        self.tails_dropped = 0  # stale L2 tails dropped for an L3 fetch to read again (cut_stale_tail)

    def attach(self, prefetcher: Prefetcher, writeback: WriteBack) -> None:
        """Install the hooks on ``prefetcher`` and its fetches, and tell the window policy when L2 room comes
        back by itself (``writeback``'s writes landing: RequestWindows.l2_room_coming)."""
        self._rw.l2_room_coming = lambda: writeback.landing
        prefetcher.window_cut = self.cut_stale_tail
        prefetcher.window_room = self.fetch_room
        prefetcher.fetches.on_start = self.for_fetch
        prefetcher.fetches.can_load = self.early_load_ok
        prefetcher.fetches.on_load = self.on_early_load

    def fetch_room(self, start_page: int, n: int) -> bool:
        """Whether an L3 fetch of ``n`` pages from ``start_page`` may start now: host window pages for those in
        the last window before its end are free, or made free (``make_host_room``). Without them every whole
        value of that window would land without its sliding part and the match be cut before it: the fetch
        waits instead (the prefetcher retries each step, until the prefetch's deadline), as for L2 room. A
        window larger than the host window pool never waits. A fetch leaves one window's pages free beside
        its own (where the pool holds both): the backup of a sequence end just computed (its window on L1
        only) takes them, and without that reserve the windows of fetched requests waiting for L1 held the
        pool, those backups found none and the ends went to L3 without their windows (their next turns
        recomputed)."""
        hw = self._rw.host.windows if self._rw.host is not None else None
        if hw is None or n <= 0:
            return True
        end = start_page + n
        need = end - max(start_page, self._rw.first_needed(end * self._rw.page_size))
        if need > hw.num_pages:
            return True
        reserve = pages_per_window(self._rw.window, self._rw.page_size)
        if need + reserve > hw.num_pages:
            reserve = 0
        short = need + reserve - hw.num_free
        if short > 0:
            hw.reclaimed += self._rw.make_host_room(short)
        return hw.num_free >= need + reserve

    def for_fetch(self, start_page: int, host_pages: list[int]) -> None:
        """An L3 fetch of pages ``start_page ..`` into ``host_pages`` (serving/cache/l3_fetch.py), before its read
        starts: host window pages for those in the last window before its end, reclaimed from unlocked nodes
        (LRU) if need be, as a backup takes them. The readers only take free ones (a whole value's page keeps
        its sliding part if one is free, ``land``), so with the host window pool full every whole value lost
        its sliding part and every match cut back to where a window was still whole (the H200's Gemma-3 12B
        multi-turn: 0.26 of its prompts cached with L1+L2+L3). A page whose value turns out short gives its
        host window page back."""
        if self._rw.host is None or self._rw.host.windows is None or not host_pages:
            return
        end = start_page + len(host_pages)
        lo = max(start_page, self._rw.first_needed(end * self._rw.page_size))
        self._rw.host.windows.take(host_pages[lo - start_page:])

    def cut_stale_tail(self, tokens: Sequence[int]) -> int:
        """Where an L3 lookup for ``tokens`` should start (tokens cached on L1 / L2), before it is made: when
        the cached path's last window has pages whose window KV is nowhere above L3 (L1 pages whose window
        pages were dropped, L2 copies whose host window pages were reclaimed), those pages and the path's
        tail after them leave the tree if L3 holds them (``HiRadixTree.drop_tail_for_l3``), so the fetch
        reads them again, their sliding parts with them (``for_fetch`` gives them host window pages). A
        windowed L2 keeps about one window per ``swa_full_tokens_ratio`` of its pages' worth of sequence
        ends, and the L1 window pool fewer; L3 keeps every one that was written with its window, and
        without this the copies above it hid them: a match was cut to where a window was whole, mostly 0
        (the H200's Gemma-3 12B multi-turn: 0.26 of its prompts cached; with L2 tails dropped, whole
        conversations still recomputed when a waiting request's L1 windows were dropped)."""
        valid = self._rw.valid_pages(tokens)
        n = len(valid)
        lo = self._rw.first_needed(n * self._rw.page_size)
        stale = next((i for i in range(lo, n) if not valid[i]), None)
        if stale is not None and self._rw.tree.drop_tail_for_l3(tokens, stale):
            self.tails_dropped += 1
            return stale * self._rw.page_size
        return n * self._rw.page_size

    def early_load_ok(self) -> bool:
        """Whether an L3 prefetch may load its landed run on to L1 now (serving/cache/l3_fetch.py): only while
        its last window's window pages can be had beside one request's need (see :meth:`on_early_load`); else
        the run stays on L2 and its request's admission loads it back with its window (``room_for_load``). An
        L1 run without window pages at its end would cut every match there (recomputed)."""
        return self._rw.windows.num_free - min_window_pages(self._rw.window, self._rw.page_size) >= \
            pages_per_window(self._rw.window, self._rw.page_size)

    def on_early_load(self, before: MatchResult, after: MatchResult) -> None:
        """An L3 prefetch's early L2 -> L1 load (``before`` -> ``after``, serving/cache/l3_fetch.py): the
        loaded pages of the last window before the load's end (where the fetch's request resumes) whose L2
        sliding part is valid get window pages, as far as the window pool has free ones (no eviction: the load
        itself evicts nothing), leaving one request's need (``min_window_pages``) free. Only that window, and
        that reserve: a fetch's early-loaded nodes stay locked until its request is admitted, and requests that
        found no window pages to compute into waited for one another for ever (4 restarted prompts, a pool of
        7 window pages)."""
        flags = self._rw.host.sliding_valid if self._rw.host is not None else None
        if flags is None:
            return
        chain: list[tuple[int, int]] = []  # (L1, L2) pages of the loaded run, deepest node first
        nd, top = after.last_device_node, before.last_device_node
        while nd is not None and nd is not top:
            if nd.device_pages is not None and nd.host_pages is not None:
                chain = list(zip(nd.device_pages, nd.host_pages, strict=False)) + chain
            nd = nd.parent
        last = chain[-pages_per_window(self._rw.window, self._rw.page_size):]
        # never below what one request needs to run: early-loaded nodes stay locked by their fetch until its
        # request is admitted, and requests that found no window pages would wait for one another for ever
        spare = self._rw.windows.num_free - min_window_pages(self._rw.window, self._rw.page_size)
        want = [d for d, h in last if flags[h]][: max(0, spare)]
        self._rw.windows.assign(want)
