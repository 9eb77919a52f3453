"""HostPins: the L2 pages that readers outside the tree are reading, and the pages the tree
dropped while they were pinned.

A reader outside the tree (an L3 write-back, a prefetch holding a waiting request's prefix, a
KV-control lease) pins L2 pages with :meth:`HostPins.pin` until :meth:`HostPins.unpin`. A pinned
page is never handed out again while pinned: L2 eviction skips the node that holds it, and if
the tree drops the node anyway (a flush, or L1 eviction without room), :meth:`HostPins.release`
puts its pinned pages in a deferred set instead of the free list; the last unpin frees them.
Pins do not lock: a pinned node may still lose its L1 copy.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType

from hicache.tiers.allocator import PageAllocator


class HostPins:
    """Pin counts of L2 pages and the deferred frees.

    Concurrency contract: not thread-safe; the thread that owns the tree (the scheduler thread)
    makes every call, readers on other threads included (they pin before handing pages to their
    threads and unpin after those threads are done).
    """

    def __init__(self, host: PageAllocator | None) -> None:
        self._host = host
        self._pins: dict[int, int] = {}  # page id -> readers
        self._deferred: set[int] = set()  # pages the tree dropped while pinned

    def pin(self, pages: Sequence[int]) -> None:
        """One more reader of each of ``pages`` until :meth:`unpin`."""
        pins = self._pins
        for p in pages:
            pins[p] = pins.get(p, 0) + 1

    def unpin(self, pages: Sequence[int]) -> None:
        """End one pin of each page; frees the pages the tree dropped meanwhile."""
        pins, freed = self._pins, []
        for p in pages:
            k = pins[p] - 1
            if k:
                pins[p] = k
                continue
            del pins[p]
            if p in self._deferred:
                self._deferred.discard(p)
                freed.append(p)
        if freed:
            self._host.free(freed)

    def any_pinned(self, pages: Iterable[int]) -> bool:
        """Whether one of ``pages`` is pinned (a node holding it keeps its L2 copy)."""
        pins = self._pins
        return bool(pins) and any(p in pins for p in pages)

    def release(self, pages: Sequence[int]) -> None:
        """``pages`` left the tree: free the unpinned ones now, defer the pinned ones."""
        pins = self._pins
        self._host.free([p for p in pages if p not in pins])
        self._deferred.update(p for p in pages if p in pins)

    def count(self, page: int) -> int:
        """Readers of ``page`` now (0 when unpinned)."""
        return self._pins.get(page, 0)

    def held(self) -> Mapping[int, int]:
        """Page id -> readers, for every pinned page (a read-only view)."""
        return MappingProxyType(self._pins)

    def __len__(self) -> int:
        """Distinct L2 pages pinned now."""
        return len(self._pins)

    def check_integrity(self, tree_pages: set[int]) -> frozenset[int]:
        """Raise AssertionError unless every pinned page is in the tree (``tree_pages``) or
        deferred, and every deferred page is pinned and out of the tree; returns the deferred
        pages (allocated in the host pool, held by no node)."""
        deferred = self._deferred
        assert not deferred & tree_pages, (
            f"deferred L2 pages still in the tree: {sorted(deferred & tree_pages)[:8]}"
        )
        stray = [p for p in self._pins if p not in tree_pages and p not in deferred]
        assert not stray, f"pinned L2 pages neither in the tree nor deferred: {stray[:8]}"
        assert all(p in self._pins for p in deferred), "a deferred L2 page is not pinned"
        return frozenset(deferred)
