"""Page allocator: a free list of page ids, pure Python (no tensors).

Every pool (device L1, host L2) owns one. The tree and the scheduler only ever
handle page ids; the pool's tensors are indexed by them.
"""

from __future__ import annotations

from collections.abc import Iterable


class OutOfPages(RuntimeError):
    """Raised by :meth:`PageAllocator.alloc` when fewer pages are free than asked for."""


class PageAllocator:
    """Hands out page ids ``0 .. num_pages-1``.

    Contract:
    - ``alloc(n)`` returns ``n`` distinct free ids or raises :class:`OutOfPages`
      (nothing is taken in that case).
    - ``free(ids)`` returns ids; freeing an id that is not allocated raises
      ``ValueError`` (a double free is a bug, never silently ignored).
    - Not thread-safe: one owner (the scheduler thread) mutates it.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        # Pop from the end: low ids are handed out first.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._allocated = bytearray(num_pages)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def can_alloc(self, n: int) -> bool:
        return n <= len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free of {self.num_pages}")
        if n == 0:
            return []
        ids = self._free[-n:]
        del self._free[-n:]
        for i in ids:
            self._allocated[i] = 1
        return ids

    def free(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        for i in ids:
            if not self._allocated[i]:
                raise ValueError(f"page {i} freed but not allocated")
            self._allocated[i] = 0
        self._free.extend(ids)

    def is_allocated(self, page: int) -> bool:
        return bool(self._allocated[page])

    def check_integrity(self) -> None:
        assert len(self._free) == len(set(self._free)), "duplicate ids in free list"
        assert sum(self._allocated) + len(self._free) == self.num_pages, "allocated + free != total"
        for i in self._free:
            assert not self._allocated[i], f"page {i} both free and allocated"
