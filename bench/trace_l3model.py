"""The policy replay's L3 (bench/trace_policy.py): an LRU of page keys, and the keys themselves."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class L3Model:
    """An LRU of page keys holding at most ``capacity`` pages (LMDB's order: last write or read);
    once over it, the least recent keys leave until ``evict_to * capacity`` remain."""

    def __init__(self, capacity_pages: int, evict_to: float = 1.0) -> None:
        self.capacity = capacity_pages
        self.evict_to = evict_to
        self._keys: OrderedDict[int, None] = OrderedDict()
        self.pages_written = 0
        self.pages_read = 0
        self.pages_deleted = 0

    def __len__(self) -> int:
        return len(self._keys)

    def present(self, keys: Sequence[int]) -> int:
        """Leading keys held (a lookup: no stamp)."""
        n = 0
        for k in keys:
            if k not in self._keys:
                break
            n += 1
        return n

    def read(self, keys: Iterable[int]) -> None:
        for k in keys:
            self._keys.move_to_end(k)
            self.pages_read += 1

    def delete(self, keys: Iterable[int]) -> None:
        for k in keys:
            if self._keys.pop(k, False) is None:
                self.pages_deleted += 1

    def write(self, keys: Iterable[int]) -> None:
        d = self._keys
        for k in keys:
            d[k] = None
            d.move_to_end(k)
            self.pages_written += 1
        if len(d) > self.capacity:
            keep = int(self.capacity * self.evict_to)
            while len(d) > keep:
                d.popitem(last=False)


def chain_keys(tokens: Sequence[int], page_size: int, upto: int | None = None, prev: int = 0) -> list[int]:
    """One key per full page of ``tokens`` (the first ``upto`` pages): the page's tokens hashed
    with the key before it (``prev``: the key of the page before ``tokens[0]``, 0 at the start),
    so equal keys mean equal prefixes (hicache.keys.page_keys, with Python's tuple hash in place
    of BLAKE2b for speed)."""
    n = len(tokens) // page_size if upto is None else upto
    out = []
    for i in range(n):
        prev = hash((prev, tuple(tokens[i * page_size : (i + 1) * page_size])))
        out.append(prev)
    return out
