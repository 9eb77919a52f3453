"""A direct L3 read in flight: :class:`ReadJob`, started by ``StorageTier.start_read``, and how one of its
groups lands in an L2 of whole pages (:func:`read_direct_pages`).

The job's pages are cut into groups of a few pages, each one task for the tier's reader
threads (one read transaction, each value copied straight into its L2 page and verified
right after: :func:`read_direct_pages`; a hybrid SWA model's L2: ``storage_windows.read_direct``).
Every group of a job is queued at once, behind the groups of jobs started earlier (first come,
first served: an earlier request's prefix lands first), so N readers stream a job with no
barrier between batches, and several jobs are in flight at once without a thread of their own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future

import numpy as np

from hicache.tiers.base import TOO_LARGE, StorageBackend
from hicache.tiers.host import HostKVPool
from hicache.tiers.native_copy import copy_and_hash
from hicache.tiers.page_codec import SLIDING_INVALID, TRAILER_SIZE, PageCodec
from hicache.tiers.storage_windows import is_short_page


class ReadJob:
    """One read of ``n`` pages in groups of ``group``; ``run_group(lo, hi)`` reads pages
    ``[lo, hi)`` and returns how many leading ones landed verified (on a reader thread).

    Contract:
    - ``loaded``: leading pages that have landed and been verified. It only grows; any
      thread may read it (an int). Pages below it are never written again by this job.
    - ``reading``: pages of the groups a reader has started (landed or not: the most ``loaded``
      can reach without another group starting). It only grows; any thread may read it.
    - A group that comes back short (a miss, a corrupt value) ends the job there: groups
      after it that have not started are skipped, and ``loaded`` never passes it.
      :meth:`cancel` skips every group not started yet.
    - ``future`` resolves to the final ``loaded`` once every group has ended: only then may
      the caller reuse the pages past ``loaded`` (a group may still be writing them before).
      ``on_done(job)`` runs just before, on the last reader thread.
    - ``read_s``: seconds from the first group's start to the last one's end (the job's
      own read time, not the queueing behind earlier jobs).
    - ``nbytes``: bytes of the values that landed (trailers included), as the groups report them
      (:meth:`add_bytes`, on the reader threads); final once ``future`` has resolved.
    """

    def __init__(self, n: int, group: int, run_group: Callable[[int, int], int],
                 on_done: Callable[[ReadJob], None] | None = None) -> None:
        self.n = n
        self.group = max(1, group)
        self.loaded = 0
        self.reading = 0
        self.read_s = 0.0
        self.nbytes = 0
        self.cancelled = False
        self.future: Future = Future()
        self._run_group = run_group
        self._on_done = on_done
        self._lock = threading.Lock()
        self._ngroups = -(-n // self.group)
        self._got: list[int | None] = [None] * self._ngroups
        self._next = 0  # first group not yet counted into ``loaded``
        self._end = n  # pages past this are not read (a short group, or cancel)
        self._pending = self._ngroups
        self._t0 = 0.0

    def submit(self, pool: Executor) -> ReadJob:
        """Queue every group on ``pool``. A pool that refuses (shut down) ends the groups it
        did not take as read nothing, so the job still finishes."""
        if not self._ngroups:
            self._finish()
            return self
        for g in range(self._ngroups):
            try:
                pool.submit(self._task, g)
            except RuntimeError:
                self.cancel()
                for h in range(g, self._ngroups):
                    lo = h * self.group
                    self._landed(h, lo, min(self.n, lo + self.group), 0)
                break
        return self

    def cancel(self) -> None:
        """Groups not started yet are skipped (``loaded`` stops where it is then)."""
        self.cancelled = True
        with self._lock:
            self._end = min(self._end, self.loaded)

    def add_bytes(self, n: int) -> None:
        """A group landed values of ``n`` bytes (any reader thread)."""
        with self._lock:
            self.nbytes += n

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> int:
        return self.future.result()

    # -- reader threads ---------------------------------------------------------------
    def _task(self, g: int) -> None:
        lo = g * self.group
        hi = min(self.n, lo + self.group)
        got = 0
        try:
            with self._lock:
                run = lo < self._end
                if run and not self._t0:
                    self._t0 = time.perf_counter()
                if run:
                    self.reading = max(self.reading, hi)
            if run:
                got = self._run_group(lo, hi)
        finally:
            self._landed(g, lo, hi, got)

    def _landed(self, g: int, lo: int, hi: int, got: int) -> None:
        with self._lock:
            self._got[g] = got
            if got < hi - lo:
                self._end = min(self._end, lo + got)
            while self._next < self._ngroups and self._got[self._next] is not None:
                a = self._next * self.group
                b = min(self.n, a + self.group)
                if self.loaded != a:
                    break  # an earlier group was short: nothing after it counts
                self.loaded = min(a + self._got[self._next], self._end)
                if self.loaded < b:
                    break
                self._next += 1
            self._pending -= 1
            last = self._pending == 0
            if last and self._t0:
                self.read_s = time.perf_counter() - self._t0
        if last:
            self._finish()

    def _finish(self) -> None:
        try:
            if self._on_done is not None:
                self._on_done(self)
        finally:
            self.future.set_result(self.loaded)


def read_direct_pages(backend: StorageBackend, codec: PageCodec, keys: list[str], view: np.ndarray, pages: list[int],
                      pool: HostKVPool, corrupt: Callable[[str], None]) -> int:
    """Read ``keys`` into L2 rows ``pages`` of ``view`` (the pool's ``[pages, bytes]`` view); returns the leading
    verified count (on a reader thread). The group's payloads are copied and hashed in one GIL-free call
    (:func:`~hicache.tiers.native_copy.copy_and_hash`, each chunk hashed right after its copy), then every page
    is checked against its trailer; ``corrupt(key)`` for a bad value, where the read ends."""
    trailers = np.empty((len(keys), TRAILER_SIZE), dtype=np.uint8)
    dsts = [view[p] for p in pages]
    hashes: dict[int, int] = {}

    def copy(srcs: list[np.ndarray], idx: list[int]) -> None:
        hashes.update(zip(idx, copy_and_hash(srcs, [dsts[i] for i in idx]), strict=True))

    sizes = backend.batch_get_pages(keys, dsts, trailers, copy=copy)
    ok = 0
    for i, size in enumerate(sizes):
        if size < 0 and size != TOO_LARGE or is_short_page(codec, size):  # missing / error / another
            break  # server's page stored without its sliding part (storage_windows): a plain miss
        if size != codec.value_nbytes or i not in hashes or \
                not codec.verify_hashed(trailers[i], keys[i], hashes[i]):  # wrong size, or corrupt
            corrupt(keys[i])
            break
        set_valid(pool, pages[i], codec.flags_of(trailers[i]))
        ok += 1
    return ok


def set_valid(pool: HostKVPool, page: int, flags: int) -> None:
    """A page read from L3: its sliding layers are good unless its trailer says otherwise."""
    pool.sliding_valid[page] = 0 if flags & SLIDING_INVALID else 1
