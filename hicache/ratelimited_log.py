"""Warnings that may fire per page (a corrupt L3 value, a failed write, a dropped write-back)
are logged, but at most once per interval and kind: the next one that gets through says how
many were held back, so the log shows that it happens and how often without flooding."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any


class RateLimitedLog:
    """``warning(kind, msg, *args)`` logs at most once per ``interval_s`` for each ``kind``
    (thread-safe); what it held back is counted and reported with the next one it logs."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.interval_s, self.clock = logger, interval_s, clock
        self._lock = threading.Lock()
        self._next: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warning(self, kind: str, msg: str, *args: Any) -> bool:
        """Log ``msg % args`` unless one of this ``kind`` was logged less than ``interval_s``
        ago; returns whether it was logged."""
        now = self.clock()
        with self._lock:
            if now < self._next.get(kind, float("-inf")):
                self._held[kind] = self._held.get(kind, 0) + 1
                return False
            self._next[kind] = now + self.interval_s
            held = self._held.pop(kind, 0)
        if held:
            msg += f" ({held} more like it in the last {self.interval_s:g} s not logged)"
        self.logger.warning(msg, *args)
        return True
