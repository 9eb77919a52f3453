"""L1 for sliding-window layers: which logical pages have their window layers' KV in the window pool.

A model with sliding-window layers (Gemma-3, Mistral's ``sliding_window``) keeps, with the hybrid
SWA pool (SGLang's ``--swa-full-tokens-ratio``; ``--disable-hybrid-swa-memory`` turns it off), two
L1 KV pools: the full layers' pages, indexed by the *logical* page ids the tree and requests hold,
and a smaller window pool for the sliding layers, indexed by *window* page ids. A token at position
``p`` of a sliding layer of window ``w`` reads positions ``p - w + 1 .. p`` only, so the sliding
layers' KV of a page nobody will read again need not stay: :class:`WindowPages` is the one owner of
the map ``logical page -> window page or -1`` and of the window pool's free list.

Contract (one owner, the scheduler thread; no locking):
- ``assign(pages)`` gives each of ``pages`` that has none a window page (all or nothing: False when
  the window pool has too few free); ``drop(pages)`` frees the window pages of ``pages`` (those
  without one are skipped).
- The logical pages' allocator is a :class:`WindowedPageAllocator`: freeing a logical page frees
  its window page too. Its map entry stays readable until the logical page is handed out again
  (``alloc`` resets it to -1): a tree operation frees pages *before* the transfers it emitted run
  (a backup of an evicted page reads its window page then), and nothing is allocated in between.
- ``check_integrity(allocated)``: every window page is free or mapped from exactly one allocated
  logical page, and every allocated logical page maps to an allocated window page or to -1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from hicache.tiers.allocator import PageAllocator


def pages_per_window(window: int, page_size: int) -> int:
    """Pages a window of ``window`` tokens can overlap (it may start inside a page)."""
    return -(-(window - 1) // page_size) + 1


def min_window_pages(window: int, page_size: int) -> int:
    """The smallest window pool one request can run in: the two windows it keeps once it decodes past its
    prompt (before its position and before its prompt's end) and the page it computes into."""
    return 2 * pages_per_window(window, page_size) + 1


class WindowPages:
    """The map logical page -> window page (-1: its sliding layers' KV is not on L1)."""

    def __init__(self, num_logical: int, num_window: int) -> None:
        self.map = [-1] * num_logical  # read by ForwardBatch.build and the page mover (by index)
        self.allocator = PageAllocator(num_window)

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def has(self, page: int) -> bool:
        return self.map[page] >= 0

    def missing(self, pages: Iterable[int]) -> list[int]:
        """The pages of ``pages`` without a window page."""
        return [p for p in pages if self.map[p] < 0]

    def assign(self, pages: Iterable[int]) -> bool:
        """A window page for each of ``pages`` without one; False (nothing taken) when too few are free."""
        need = self.missing(pages)
        if not self.allocator.can_alloc(len(need)):
            return False
        for p, w in zip(need, self.allocator.alloc(len(need)), strict=True):
            self.map[p] = w
        return True

    def drop(self, pages: Iterable[int]) -> int:
        """Free the window pages of ``pages`` (their full layers' KV stays); returns how many."""
        freed = []
        for p in pages:
            w = self.map[p]
            if w >= 0:
                freed.append(w)
                self.map[p] = -1
        if freed:
            self.allocator.free(freed)
        return len(freed)

    def move(self, src: int, dst: int) -> bool:
        """Hand ``src``'s window page to ``dst`` (which has none): the same positions' window KV, computed
        into ``src``, now serves ``dst`` (a request's page that duplicated a tree page). False: nothing moved."""
        if self.map[src] < 0 or self.map[dst] >= 0:
            return False
        self.map[dst], self.map[src] = self.map[src], -1
        return True

    def table(self, pages: Iterable[int]) -> list[int]:
        """``pages``' window pages (0 where a page has none: a kernel never reads a page outside its window)."""
        m = self.map
        return [max(m[p], 0) for p in pages]

    def held(self, pages: Iterable[int]) -> int:
        """How many of ``pages`` hold a window page."""
        return sum(1 for p in pages if self.map[p] >= 0)

    def check_integrity(self, allocated: Callable[[int], bool]) -> None:
        self.allocator.check_integrity()
        owners: dict[int, int] = {}
        for p, w in enumerate(self.map):
            if w < 0 or not allocated(p):
                continue
            assert self.allocator.is_allocated(w), f"logical page {p} maps to free window page {w}"
            assert w not in owners, f"window page {w} mapped from logical pages {owners[w]} and {p}"
            owners[w] = p
        assert len(owners) == self.allocator.num_used, \
            f"{self.allocator.num_used} window pages allocated, {len(owners)} mapped from allocated logical pages"


class WindowedPageAllocator(PageAllocator):
    """The logical pages' allocator of a hybrid SWA pool: a freed page's window page is freed with it
    (its map entry stays readable until the page is handed out again: see the module docstring)."""

    def __init__(self, num_pages: int, windows: WindowPages) -> None:
        super().__init__(num_pages)
        self.windows = windows

    def alloc(self, n: int) -> list[int]:
        ids = super().alloc(n)
        m = self.windows.map
        for p in ids:
            m[p] = -1  # a stale entry of its previous life (its window page was freed with it)
        return ids

    def free(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        super().free(ids)
        m, wins = self.windows.map, []
        for p in ids:
            if m[p] >= 0:
                wins.append(m[p])
        if wins:
            self.windows.allocator.free(wins)
        # the entries stay: transfers emitted before the free read them (see the module docstring)
