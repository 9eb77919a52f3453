"""L2's page allocators: one that grows while L2 is pinned, and one that frees host window pages too.

:class:`GrowingPageAllocator` hands out only the pages of an L2 pinned so far (hicache/tiers/host_pinning.py);
:class:`WindowedHostAllocator` (an L2 with a host window pool, hicache/tiers/host_windows.py) frees a host
page's host window page with it and resets a handed-out page's map entry, as L1's WindowedPageAllocator does.
"""

from __future__ import annotations

from collections.abc import Iterable

from hicache.tiers.allocator import PageAllocator
from hicache.tiers.host_windows import HostWindows


class GrowingPageAllocator(PageAllocator):
    """A PageAllocator of ``num_pages`` ids of which only the first ``available`` exist yet (an
    L2 still being pinned); :meth:`grow` adds the next ones. Same contract otherwise (one owner:
    the scheduler thread)."""

    def __init__(self, num_pages: int, available: int) -> None:
        super().__init__(num_pages)
        self.available = max(0, min(available, num_pages))
        self._free = list(range(self.available - 1, -1, -1))

    @property
    def num_used(self) -> int:
        return self.available - len(self._free)

    def grow(self, available: int) -> int:
        """Ids up to ``available`` join the free list (handed out after the older free ones); returns how many."""
        available = min(available, self.num_pages)
        if available <= self.available:
            return 0
        added = list(range(available - 1, self.available - 1, -1))
        self._free[:0] = added
        self.available = available
        return len(added)

    def check_integrity(self) -> None:
        assert len(self._free) == len(set(self._free)), "duplicate ids in free list"
        assert sum(self._allocated) + len(self._free) == self.available, "allocated + free != available"
        assert not any(self._allocated[self.available:]), "a page not yet available is allocated"
        for i in self._free:
            assert i < self.available and not self._allocated[i], f"page {i} free but allocated or not available"


class WindowedHostAllocator(GrowingPageAllocator):
    """The host pages' allocator of an L2 with a host window pool (see the module docstring); grows as a
    GrowingPageAllocator (all of it available at once where nothing is pinned in the background)."""

    def __init__(self, num_pages: int, available: int, windows: HostWindows) -> None:
        super().__init__(num_pages, available)
        self.windows = windows

    def alloc(self, n: int) -> list[int]:
        ids = super().alloc(n)
        self.windows.on_alloc(ids)
        return ids

    def free(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        super().free(ids)
        self.windows.on_free(ids)
