"""Wall time of work that runs on several threads at once: :class:`BusyClock`."""

from __future__ import annotations

import threading
import time


class BusyClock:
    """Seconds during which at least one caller was inside (``enter`` / ``leave``): the wall time
    of work that runs on several threads at once. Summing each call's own time counts the
    overlap once per thread (four L3 writers that take turns on LMDB's one write lock summed 4x
    the wall time). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside = 0
        self._since = 0.0
        self._total = 0.0

    def enter(self) -> None:
        with self._lock:
            if not self._inside:
                self._since = time.perf_counter()
            self._inside += 1

    def leave(self) -> None:
        with self._lock:
            self._inside -= 1
            if not self._inside:
                self._total += time.perf_counter() - self._since

    def seconds(self) -> float:
        with self._lock:
            return self._total + (time.perf_counter() - self._since if self._inside else 0.0)
