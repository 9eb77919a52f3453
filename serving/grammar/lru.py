"""Compiled grammars by ``(kind, text)``: an LRU of compile futures.

A repeated schema is neither parsed nor compiled again (the future is shared, so requests
that arrive while it is still compiling wait on the same compile). A compile that failed is
dropped, so it is retried next time, unless its error says ``cached`` (a grammar over the
compile time budget: sent again, it fails at once instead of costing another budget). The
backend's own compiler may cache too (xgrammar's does); this cache also saves the parse and
keeps the number of live grammars bounded.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

Key = tuple[str, str]


class CompiledGrammarCache:
    def __init__(self, capacity: int = 256) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._items: OrderedDict[Key, Future[Any]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Key) -> bool:
        return key in self._items

    def get_or_start(self, key: Key, start: Callable[[], Future[Any]]) -> Future[Any]:
        """The cached future of ``key``, or the one ``start()`` returns (cached then).
        ``start`` may raise (an invalid grammar): nothing is cached then."""
        with self._lock:
            fut = self._items.get(key)
            if fut is not None:
                self._items.move_to_end(key)
                self.hits += 1
                return fut
        fut = start()  # outside the lock: parsing may take a moment
        with self._lock:
            self.misses += 1
            self._items[key] = fut
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
        fut.add_done_callback(lambda f: self._drop_failed(key, f))
        return fut

    def discard(self, key: Key, fut: Future[Any]) -> None:
        """Forget ``key`` if it still maps to ``fut`` (a compile being cancelled)."""
        with self._lock:
            if self._items.get(key) is fut:
                del self._items[key]

    def _drop_failed(self, key: Key, fut: Future[Any]) -> None:
        if fut.cancelled() or (fut.exception() is not None and not getattr(fut.exception(), "cached", False)):
            self.discard(key, fut)

    def stats(self) -> dict[str, int]:
        return {"size": len(self._items), "hits": self.hits, "misses": self.misses}
