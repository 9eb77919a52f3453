"""L2 for sliding-window layers: which host pages keep their sliding layers' KV, in a host window pool.

With the hybrid SWA L1 (hicache/tiers/window_pages.py) an L2 built for it (``make_host_pool(...,
window_layers=, window_pages=)``) mirrors L1: its :class:`~hicache.tiers.host.HostKVPool` pages hold the
full layers' KV only, and a smaller host window pool (:class:`HostWindows`) holds the sliding layers' part
of the host pages that have a valid one, with a map ``host page -> host window page or -1``. A backup of a
page with an L1 window page takes a host window page (``take``; when none is free the owner's ``reclaim``
frees some: unlocked tree nodes' host window pages, least recently used first; if still none, the page's
sliding part is not kept: stale); an L3 read of a value with its sliding part takes one if one is free
(``take_free``, on a reader thread: no reclaim). A page's sliding part is valid exactly where it has a host
window page (``valid[p]``: what ``HostKVPool.sliding_valid`` is then).

Contract:
- The host pages' allocator is a :class:`WindowedHostAllocator`: freeing a host page frees its host window
  page; its map entry stays readable until the page is handed out again (``alloc`` resets it to -1).
- Thread safety: ``_lock`` guards the map and the window allocator, which the scheduler thread (backups,
  reclaims, frees) and the L3 reader threads (``take_free`` for the pages they fill, which the reading
  prefetch has pinned) both change. The buffer's rows of a host window page are written only by whoever
  took it (the tree never frees or reclaims a host page a reader holds).
- ``check_integrity(allocated)``: every host window page is free or mapped from exactly one allocated host
  page.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Sequence

import torch

from hicache.tiers.allocator import PageAllocator
from hicache.tiers.host_pinning import PinnedTensors
from hicache.tiers.window_pages import WindowPages


class _Valid:
    """``valid[p]``: 1 where host page ``p`` has a host window page (its sliding part kept), else 0."""

    def __init__(self, windows: HostWindows) -> None:
        self._w = windows

    def __getitem__(self, p: int) -> int:
        return 1 if self._w.map[p] >= 0 else 0

    def __len__(self) -> int:
        return len(self._w.map)


class HostWindows:
    """The host window pool of an L2 (see the module docstring): ``buffer`` holds ``2 * len(window_layers)``
    rows (K of each sliding layer, then V of each) of ``num_pages`` pages, ``[rows, pages, X]`` beside a
    ``layer_first`` host pool or ``[pages, rows, X]`` beside a ``page_first`` one (the same order as the host
    pool's buffer, so the page-move kernel treats both alike)."""

    def __init__(self, num_host_pages: int, num_pages: int, rows: int, row_elems: int, dtype: torch.dtype,
                 page_first: bool, pin: bool) -> None:
        self._pages = WindowPages(num_host_pages, max(1, num_pages))
        self.page_first = page_first
        shape = (max(1, num_pages), rows, row_elems) if page_first else (rows, max(1, num_pages), row_elems)
        self._pinned = PinnedTensors(pin)  # exact size, unpinned on release (not torch's pin_memory)
        self._unpin = weakref.finalize(self, self._pinned.close)
        self.buffer = self._pinned.zeros(shape, dtype)
        self.page_dim = 0 if page_first else 1
        self.valid = _Valid(self)
        self._lock = threading.Lock()
        # Frees host window pages under pressure (serving/cache/request_windows.py installs the tree's LRU
        # reclaim); returns how many it freed. Scheduler thread only.
        self.reclaim: Callable[[int], int] | None = None
        self.not_kept = 0  # backed-up pages whose sliding part found no host window page (scheduler thread)
        self.reclaimed = 0  # host window pages ``reclaim`` freed for backups (scheduler thread)

    @property
    def map(self) -> list[int]:
        return self._pages.map

    @property
    def allocator(self) -> PageAllocator:
        return self._pages.allocator

    @property
    def num_pages(self) -> int:
        return self._pages.num_pages

    @property
    def num_free(self) -> int:
        return self._pages.num_free

    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def has(self, page: int) -> bool:
        return self.map[page] >= 0

    def take(self, pages: Sequence[int]) -> list[int]:
        """A host window page for each of ``pages`` (fresh host pages being backed up), reclaiming for the
        shortfall first; as many as can be had, in order. Returns the pages that got one."""
        with self._lock:
            short = len(self._pages.missing(pages)) - self._pages.num_free
        if short > 0 and self.reclaim is not None:
            self.reclaimed += self.reclaim(short)
        with self._lock:
            need = self._pages.missing(pages)
            got = need[: self._pages.num_free]
            self._pages.assign(got)
        self.not_kept += len(need) - len(got)
        return [p for p in pages if self.map[p] >= 0]

    def take_free(self, page: int) -> int:
        """A host window page for ``page`` if one is free (any thread; no reclaim); -1 when none."""
        with self._lock:
            if self.map[page] < 0 and self._pages.num_free:
                self._pages.assign([page])
            return self.map[page]

    def drop(self, pages: Iterable[int]) -> int:
        """Free the host window pages of ``pages`` (their full layers stay); returns how many."""
        with self._lock:
            return self._pages.drop(pages)

    def on_alloc(self, pages: Iterable[int]) -> None:
        m = self.map
        with self._lock:
            for p in pages:
                m[p] = -1  # a stale entry of its previous life (its host window page was freed with it)

    def on_free(self, pages: Iterable[int]) -> None:
        m = self.map
        with self._lock:
            wins = [m[p] for p in pages if m[p] >= 0]
            if wins:
                self._pages.allocator.free(wins)
            # the entries stay until the pages are handed out again (see the module docstring)

    def read(self, wins: torch.Tensor) -> torch.Tensor:
        """Host window pages ``wins`` as ``[rows, n, X]``."""
        return self.buffer.index_select(self.page_dim, wins) if not self.page_first else \
            self.buffer.index_select(0, wins).transpose(0, 1)

    def page_rows(self, win: int) -> torch.Tensor:
        """Host window page ``win``'s rows as a ``[rows, X]`` view (written in place by L3 reads)."""
        return self.buffer[win] if self.page_first else self.buffer[:, win]

    def write(self, wins: torch.Tensor, rows: torch.Tensor) -> None:
        """Host window pages ``wins`` := ``rows`` (``[rows, n, X]``)."""
        if self.page_first:
            self.buffer.index_copy_(0, wins, rows.transpose(0, 1).contiguous())
        else:
            self.buffer.index_copy_(1, wins, rows)

    def release(self) -> None:
        """Unpin and drop the buffer (the owning pool's release: nothing copies any more)."""
        self._unpin()
        self.buffer = torch.empty(0, dtype=self.buffer.dtype)

    def check_integrity(self, allocated: Callable[[int], bool]) -> None:
        with self._lock:
            self._pages.check_integrity(allocated)


def host_window_split(pages: int, nbytes: int, page_bytes: int, sliding_share: float, ratio: float,
                      by_bytes: bool) -> tuple[int, int]:
    """(host pages, host window pages) of an L2 with a host window pool: ``ratio`` (``--swa-full-tokens-ratio``)
    of its pages get a host window page. ``by_bytes`` (L2 sized in GiB): as many pages as ``nbytes`` holds at
    ``page_bytes`` (every layer) less the sliding layers' part (``sliding_share`` of it) of the pages without
    one; else ``pages`` (L2 sized against L1: the same pages as without a host window pool, in fewer bytes)."""
    if by_bytes:
        per_page = page_bytes * (1 - sliding_share * (1 - ratio))
        pages = max(1, int(nbytes // per_page))
    return pages, max(1, round(pages * ratio))
