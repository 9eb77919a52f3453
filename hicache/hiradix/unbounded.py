"""An allocator without a pool: page ids from a counter, for the bookkeeping-only tree.

Same interface as :class:`hicache.tiers.allocator.PageAllocator` (``alloc``, ``free``,
``num_free``, ``can_alloc``, ``is_allocated``, ``num_used``), but it never runs out:
``num_free`` is ``sys.maxsize`` and ``num_pages`` is ``None``. Ids are never reused.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable


class UnboundedAllocator:
    num_pages = None

    def __init__(self) -> None:
        self._next = 0
        self._allocated: set[int] = set()

    @property
    def num_free(self) -> int:
        return sys.maxsize

    @property
    def num_used(self) -> int:
        return len(self._allocated)

    def can_alloc(self, n: int) -> bool:
        return n >= 0

    def alloc(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        ids = list(range(self._next, self._next + n))
        self._next += n
        self._allocated.update(ids)
        return ids

    def free(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        for i in ids:
            if i not in self._allocated:
                raise ValueError(f"page {i} freed but not allocated")
            self._allocated.discard(i)

    def is_allocated(self, page: int) -> bool:
        return page in self._allocated

    def check_integrity(self) -> None:
        assert all(0 <= i < self._next for i in self._allocated), "allocated id out of range"
