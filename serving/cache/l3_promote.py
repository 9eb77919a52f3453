"""Promotion out of a private L3 (the exclusive tiers): an L3 hit deletes the L3 copy of what it
brought up, once the page's bytes have landed in L2 and been verified (hicache/hiradix/exclusive.py
decides which pages; serving/cache/l3_fetch.py hands their keys here as it commits them).

A page deleted here may be written again soon (it goes cold in L2 and is demoted back), so a delete
and a write of the same key must never overlap: a write that checked "present" before the delete
ran would skip the page and then mark it stored. :class:`KeyGuard` orders them per key:

- a delete is started only for keys no write holds (a write holds its keys from before its
  ``batch_exists`` until the scheduler has marked them stored); keys a write holds keep their L3
  copy (that write marks them stored again: the tree stays right);
- a write whose keys have a delete in flight waits for the delete (on its writer thread, before
  its ``batch_exists``), so it then finds them absent and stores them.

The deletes run on one thread of their own (``StorageBackend.batch_delete``; LMDB commits each
shard's part on that shard's writer). The concurrency contract is :class:`Promotions`'.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from hicache.tiers.base import StorageBackend


class KeyGuard:
    """Per-key order between L3 writes and promotion deletes (see the module docstring).

    Concurrency contract: every method takes ``_cv``'s lock; :meth:`begin_write` is called on a writer
    thread and may wait (for deletes only, which never wait for a write); the rest never wait.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._writing: dict[str, int] = {}  # key -> writes holding it
        self._deleting: set[str] = set()

    def begin_write(self, keys: Sequence[str]) -> None:
        """A writer is about to check and store ``keys``: wait for their deletes, then hold them."""
        with self._cv:
            self._cv.wait_for(lambda: self._deleting.isdisjoint(keys))
            for k in keys:
                self._writing[k] = self._writing.get(k, 0) + 1

    def end_write(self, keys: Sequence[str]) -> None:
        """The write of ``keys`` is settled (marked stored, or given up / handed back to retry)."""
        with self._cv:
            for k in keys:
                n = self._writing.get(k, 0) - 1
                if n > 0:
                    self._writing[k] = n
                else:
                    self._writing.pop(k, None)

    def begin_delete(self, keys: Sequence[str]) -> list[str]:
        """The keys of ``keys`` no write holds and no delete has yet, now held by a delete."""
        with self._cv:
            out = [k for k in dict.fromkeys(keys) if k not in self._writing and k not in self._deleting]
            self._deleting.update(out)
            return out

    def end_delete(self, keys: Sequence[str]) -> None:
        with self._cv:
            self._deleting.difference_update(keys)
            self._cv.notify_all()

    @property
    def idle(self) -> bool:
        with self._cv:
            return not self._writing and not self._deleting


class Promotions:
    """Deletes the L3 copies of promoted pages from a private backend (see the module docstring).

    Concurrency contract: :meth:`delete`, :meth:`poll` and the counters are the scheduler thread's;
    the one delete thread only calls the backend (thread-safe) and the guard.
    """

    def __init__(self, backend: StorageBackend, guard: KeyGuard) -> None:
        self.backend = backend
        self.guard = guard
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicache-l3-promote")
        self._jobs: list[Future] = []
        self.pages_deleted = 0  # L3 copies removed by promotions
        self.pages_kept_writing = 0  # promoted pages a write held: their L3 copy stays (marked again)

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    def delete(self, keys: Sequence[str]) -> None:
        """Delete ``keys`` from L3 in the background (those a write holds are skipped)."""
        ks = self.guard.begin_delete(keys)
        self.pages_kept_writing += len(keys) - len(ks)
        if ks:
            try:
                self._jobs.append(self._pool.submit(self._run, ks))
            except BaseException:  # (a shut-down pool) nothing started: release the keys
                self.guard.end_delete(ks)
                raise

    def _run(self, keys: list[str]) -> int:
        try:
            return self.backend.batch_delete(keys)
        finally:
            self.guard.end_delete(keys)

    def poll(self, wait: bool = False) -> None:
        """Count the deletes that are done (all of them, with ``wait``)."""
        keep = []
        for f in self._jobs:
            if wait or f.done():
                try:
                    self.pages_deleted += f.result()
                except Exception:  # a backend bug: the pages stay on L3 (a store that fails deletes counts it)
                    pass
            else:
                keep.append(f)
        self._jobs = keep

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        self.poll(wait=True)
