"""A reader/writer lock: LMDB transactions share it, ``set_mapsize`` takes it alone."""

from __future__ import annotations

import threading
from contextlib import contextmanager


class RWLock:
    """Shared (transactions) / exclusive (``set_mapsize``) lock.

    Any thread may take either side. ``exclusive`` waits for a running exclusive holder to
    leave, then blocks new shared holders and waits for the current ones to leave (so a map
    resize is never starved by a stream of readers); ``shared`` waits only while an exclusive
    holder is in or waiting. ``_cond`` guards ``_readers`` and ``_writer``. Not re-entrant: a
    thread holding ``shared`` must not ask for ``exclusive``.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False

    @contextmanager
    def shared(self):
        with self._cond:
            while self._writer:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self):
        with self._cond:
            while self._writer:
                self._cond.wait()
            self._writer = True
            while self._readers:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()
