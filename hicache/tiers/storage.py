"""The storage tier (L3): pages moved between a host pool and a raw-bytes
:class:`~hicache.tiers.base.StorageBackend`, each value verified on read (format:
:mod:`hicache.tiers.page_codec`); and the registry of backends.

Reads run on the tier's ``read_threads`` reader threads as read jobs (:class:`ReadJob`)
(:meth:`StorageTier.start_read`; :meth:`StorageTier.batch_get` starts one and waits): a job's
pages are cut into groups, queued in order behind earlier jobs, and its landed, verified
prefix grows while it runs. Two data paths, chosen per call:
- **direct** (a ``page_first`` host pool and a backend with ``direct_reads``, i.e. LMDB):
  a group copies each value's payload straight from the store into its L2 page (one copy)
  and its trailer into a side buffer, in its own read transaction; the group's payloads are
  copied and hashed in one GIL-free call (:mod:`hicache.tiers.native_copy`: a reader needs
  the GIL once per group, not twice per page) and each page is checked against its trailer
  before the group counts as landed. A write copies (and hashes) the page once into staging
  (payload + trailer, one contiguous value) and hands that to the backend, or, to a backend that
  writes values from parts (LMDB with ``value_files``), hands it the page itself and its trailer
  (:mod:`hicache.tiers.storage_write`).
- **staged** (any other pool or backend, e.g. Mooncake with its registered buffers): values
  land in a staging buffer of the reader thread and are scattered into the pool's layout.
An L2 with a host window pool always takes the staged path: a page whose sliding part it did not keep is
stored without it, a smaller value (:mod:`hicache.tiers.storage_windows`); over LMDB its reads still run on
every reader thread in the direct path's small groups, each value landed with one copy per part.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from hicache.ratelimited_log import RateLimitedLog
from hicache.tiers.base import TOO_LARGE, StagingBuffer, StorageBackend
from hicache.tiers.busy_clock import BusyClock
from hicache.tiers.device import KVLayout
from hicache.tiers.host import HostKVPool
from hicache.tiers.lmdb.store import LMDBStore
from hicache.tiers.mooncake.store import MooncakeStore
from hicache.tiers.page_codec import TRAILER_SIZE, PageCodec, host_page_bytes
from hicache.tiers.storage_read import ReadJob, read_direct_pages, set_valid
from hicache.tiers.storage_windows import is_short_page, land, read_direct, reads_direct, short_codec, windowed
from hicache.tiers.storage_write import frame_values, value_parts

__all__ = ["TRAILER_SIZE", "PageCodec", "ReadJob", "StorageTier", "STORAGE_BACKENDS", "make_storage",
           "default_read_threads"]
log = logging.getLogger("hicache.storage")
READ_GROUP_BYTES = 16 << 20  # a direct read's group: about this many bytes (at most 8 pages), one task
# (16 MiB: 8 pages of the 8B shape; on the H200 host, 16 readers, 1-page groups read 8 GB/s, 2: 13, 4: 18, 8: 21)


def default_read_threads() -> int:
    """Reader threads when none are configured: one per CPU, at most 16 (LMDB's page-cache
    reads scale to about that many; measured 33-38 GB/s with 16 on the H200 host)."""
    return max(1, min(16, os.cpu_count() or 1))


class StorageTier:
    """Moves pages between a :class:`HostKVPool` and a :class:`StorageBackend` (see the
    module docstring).

    Contract:
    - Thread-safe: the controller's background threads may call concurrently, several
      writers included (each thread has its own staging buffers; counters are locked). The host pages named in a
      call must not be written by anyone else during it (the tree hands out disjoint pages).
    - Never raises because of the store (backends turn failures into misses); raises
      ``ValueError`` for a pool of another layout / page size, or mismatched lengths.
    - ``batch_get`` returns ``n``: host pages ``host_pages[:n]`` hold verified pages; pages
      past ``n`` may have been written (reads run ahead in parallel) and hold nothing
      usable: the caller frees them. :meth:`start_read` never blocks: its job's contract
      (:class:`ReadJob`) says when which pages may be used or reused.
    - Stats (pages): ``hits`` loaded and verified, ``misses`` asked for and not loaded,
      ``corrupt`` rejected by the trailer check, ``stored`` / ``store_failed`` by batch_set,
      ``bytes_read`` / ``bytes_written`` (values, trailers included), ``read_s`` / ``write_s``
      (wall time during which some reader group / some batch_set ran: :class:`BusyClock`); plus
      the backend's own stats under ``backend.*`` (``errors`` among them).
    """

    def __init__(
        self,
        backend: StorageBackend,
        layout: KVLayout,
        page_size: int,
        max_batch_pages: int = 64,
        staging_bytes: int = 64 << 20,
        read_threads: int = 0,
        encoding: str = "raw",
        write_threads: int = 4,
    ) -> None:
        self.backend = backend
        self.codec = PageCodec(layout, page_size, encoding)  # values in this encoding (kv_codec)
        self.encoding = self.codec.encoding
        self.layout = layout
        self.page_size = page_size
        # Slots are 64-byte aligned so that payloads view cleanly as the KV dtype.
        self.slot = (self.codec.value_nbytes + 63) // 64 * 64
        self.batch_pages = max(1, min(max_batch_pages, staging_bytes // self.slot))
        self.read_threads = read_threads if read_threads > 0 else default_read_threads()
        self._readers = ThreadPoolExecutor(self.read_threads, thread_name_prefix="hicache-l3-read")
        # staged reads: a 64 MiB staging buffer per thread (registered with Mooncake, whose read lane
        # serialises them anyway), so two threads, not one per reader
        self._staged_readers = ThreadPoolExecutor(min(2, self.read_threads), thread_name_prefix="hicache-l3-sread")
        self.read_group = max(1, min(8, READ_GROUP_BYTES // self.codec.page_nbytes))
        self._local = threading.local()
        # Writers (serving.cache.l3_writeback) that may call batch_set at once; each frames its next batch
        # on a helper thread of its own while the backend stores the current one.
        self.write_threads = max(1, write_threads)
        self._preparer = ThreadPoolExecutor(self.write_threads, thread_name_prefix="hicache-l3-frame")
        self._lock = threading.Lock()
        self._warn = RateLimitedLog(log)  # corrupt values and failed writes are logged, not only counted
        self._views: dict[int, np.ndarray] = {}
        self._stats: dict[str, float] = dict.fromkeys(
            ("hits", "misses", "corrupt", "stored", "store_failed", "bytes_read", "bytes_written"), 0)
        self._read_clock = BusyClock()
        self._write_clock = BusyClock()

    # ------------------------------------------------------------------ API
    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many leading keys are in the store (not verified: a later get may still reject)."""
        return self.backend.batch_exists(list(keys)) if keys else 0

    def batch_get(self, keys: Sequence[str], host_pool: HostKVPool, host_pages: Sequence[int]) -> int:
        """Load the values of ``keys`` into host pages ``host_pages`` (same length), in order.
        Returns how many leading pages were loaded and verified (stops at the first miss or
        corrupt value). Waits for :meth:`start_read`'s job."""
        return self.start_read(keys, host_pool, host_pages).result()

    def start_read(self, keys: Sequence[str], host_pool: HostKVPool, host_pages: Sequence[int],
                   on_done: Callable[[ReadJob], None] | None = None) -> ReadJob:
        """Queue the read of ``keys`` into ``host_pages`` on the reader threads; returns at once.
        ``on_done(job)`` runs on a reader thread once every group has ended (see :class:`ReadJob`)."""
        self._check(keys, host_pool, host_pages)
        keys, pages = list(keys), list(host_pages)
        direct = self._direct(host_pool)
        short_direct = not direct and reads_direct(host_pool, self.codec, self.backend)
        view = self._pool_view(host_pool) if direct or short_direct else None

        def run_group(lo: int, hi: int) -> int:
            self._read_clock.enter()
            sizes: list[int] = []  # the landed values' sizes (a hybrid SWA model's short ones are smaller)
            try:
                host_pool.wait_pending_writes()  # a GPU backup may still be writing a recycled page
                if direct:
                    got = read_direct_pages(self.backend, self.codec, keys[lo:hi], view, pages[lo:hi], host_pool,
                                            self._corrupt)
                    sizes = [self.codec.value_nbytes] * got
                elif short_direct:  # short and whole values of a hybrid SWA model (storage_windows)
                    got = read_direct(self.backend, self.codec, keys[lo:hi], pages[lo:hi], host_pool, view,
                                      self._corrupt, sizes)
                else:
                    got = self._get_staged(keys[lo:hi], host_pool, pages[lo:hi], sizes)
                job.add_bytes(sum(sizes))
                return got
            finally:
                self._read_clock.leave()

        def finished(job: ReadJob) -> None:
            with self._lock:
                self._stats["hits"] += job.loaded
                self._stats["misses"] += 0 if job.cancelled else job.n - job.loaded
                self._stats["bytes_read"] += job.nbytes
            if on_done is not None:
                on_done(job)

        job = ReadJob(len(keys), self.fetch_batch_pages(host_pool), run_group, finished)
        return job.submit(self._readers if direct or self._windowed_direct(host_pool) else self._staged_readers)

    def batch_set(self, keys: Sequence[str], host_pool: HostKVPool, host_pages: Sequence[int]) -> int:
        """Store host pages ``host_pages`` under ``keys`` (same length), in order. Returns how
        many leading pages were stored; stops at the first failure (later pages would be
        unreachable for a prefix lookup anyway)."""
        self._check(keys, host_pool, host_pages)
        self._write_clock.enter()
        try:
            return self._batch_set(keys, host_pool, host_pages)
        finally:
            self._write_clock.leave()

    def _batch_set(self, keys: Sequence[str], host_pool: HostKVPool, host_pages: Sequence[int]) -> int:
        host_pool.wait_pending_writes()  # the pages' GPU backups must have landed
        slot, done, nbytes = self.slot, 0, 0
        batches = [(list(keys[lo : lo + self.batch_pages]), list(host_pages[lo : lo + self.batch_pages]))
                   for lo in range(0, len(keys), self.batch_pages)]
        # Double buffering: batch k+1 is framed (copy + checksum) on a helper thread while the
        # backend stores batch k (both drop the GIL for the bulk of their work).
        bufs = (self._staging(0), self._staging(1))
        prep = self._preparer.submit(self._frame, *batches[0], host_pool, bufs[0]) if batches else None
        parts = self._parts(host_pool)
        for k, (ck, _) in enumerate(batches):
            buf = bufs[k % 2]
            got = prep.result()
            if k + 1 < len(batches):
                prep = self._preparer.submit(self._frame, *batches[k + 1], host_pool, bufs[(k + 1) % 2])
            n = len(ck)
            if parts:
                sizes = [self.codec.value_nbytes] * n
                res = self.backend.batch_set_parts(ck, got)
            else:
                sizes = got
                res = self.backend.batch_set_from(ck, buf, [(i * slot, sizes[i]) for i in range(n)])
            ok = 0
            for r in res:
                if not r:
                    break
                ok += 1
            done += ok
            nbytes += sum(sizes[:ok])
            if ok < n:
                break
        if prep is not None:
            prep.result()  # never leave a framing job writing into a staging buffer
        with self._lock:
            self._stats["bytes_written"] += nbytes
            self._stats["stored"] += done
            self._stats["store_failed"] += len(keys) - done
        if done < len(keys):  # the cause (e.g. ENOSPC and where) comes from the backend, on this thread
            why = self.backend.write_error()
            self._warn.warning("store_failed", "L3: %d of %d pages could not be written (%s%s); they are not marked "
                               "stored", len(keys) - done, len(keys), type(self.backend).__name__,
                               f": {why}" if why else "")
        return done

    def _frame(self, keys: list[str], pages: list[int], pool: HostKVPool, buf: StagingBuffer) -> list:
        """Lay out ``pages`` as values (payload + trailer) in ``buf``, one slot each, and return their sizes;
        or, for a backend that writes parts (:meth:`_parts`), return each value's parts
        (hicache.tiers.storage_write)."""
        if self._parts(pool):
            return value_parts(self.codec, keys, pages, pool, self._pool_view(pool))
        n, slot = len(keys), self.slot
        return frame_values(self.codec, self.layout, self.page_size, keys, pages, pool,
                            buf.array[: n * slot].reshape(n, slot), buf.tensor[: n * slot].view(n, slot),
                            self._pool_view(pool) if self._payloads(pool) else None)

    def _parts(self, pool: HostKVPool) -> bool:
        """Whether values go to the backend as parts (the L2 page and its trailer: no framing copy)."""
        return getattr(self.backend, "writes_parts", False) and self._direct(pool)

    def stats(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = dict(self._stats)
        out["read_s"], out["write_s"] = self._read_clock.seconds(), self._write_clock.seconds()
        out.update({f"backend.{k}": v for k, v in self.backend.stats().items()})
        return out

    def close(self) -> None:
        self._readers.shutdown(wait=True)
        self._staged_readers.shutdown(wait=True)
        self._preparer.shutdown(wait=True)
        self.backend.close()

    def fetch_batch_pages(self, pool: HostKVPool) -> int:
        """Pages of one reader task into ``pool`` (a read job's group): on the direct path
        about ``READ_GROUP_BYTES`` (at most 8 pages); staged, one staging buffer."""
        if self._direct(pool):
            return self.read_group
        if reads_direct(pool, self.codec, self.backend):  # most values short: groups of about as many bytes
            short = short_codec(self.codec.layout, self.page_size, len(pool.full_layers)).page_nbytes
            return max(1, min(32, READ_GROUP_BYTES // short))
        return self.read_group if self._windowed_direct(pool) else self.batch_pages

    # ------------------------------------------------------------------ direct path
    def _payloads(self, pool: HostKVPool) -> bool:
        """A page's L2 bytes are its L3 payload: same layout order and same encoding, every layer in the page."""
        return pool.layout_name == "page_first" and pool.encoding == self.encoding.name and \
            not windowed(pool, self.codec)

    def _direct(self, pool: HostKVPool) -> bool:
        """Reads copy values straight into L2 pages (:meth:`_payloads`, over a backend with direct reads)."""
        return self._payloads(pool) and getattr(self.backend, "direct_reads", False)

    def _windowed_direct(self, pool: HostKVPool) -> bool:
        """An L2 with a host window pool over a backend whose reads are plain copies (LMDB): on every reader
        thread in small groups as the direct path reads (a staged backend such as Mooncake keeps its two
        staged readers); short values straight into their pages where :func:`reads_direct` says so."""
        return getattr(self.backend, "direct_reads", False) and windowed(pool, self.codec)

    def _pool_view(self, pool: HostKVPool) -> np.ndarray:
        view = self._views.get(id(pool))
        if view is None:
            view = self._views[id(pool)] = host_page_bytes(pool)
        return view

    # ------------------------------------------------------------------ staged path
    def _get_staged(self, keys: list[str], pool: HostKVPool, pages: list[int], landed: list[int]) -> int:
        """Read ``keys`` into L2 pages ``pages`` through the staging buffer; returns how many leading pages
        landed, their values' sizes appended to ``landed``."""
        codec, slot, done = self.codec, self.slot, 0
        nb = codec.page_nbytes
        for lo in range(0, len(keys), self.batch_pages):
            ck = keys[lo : lo + self.batch_pages]
            n = len(ck)
            buf = self._staging()
            sizes = self.backend.batch_get_into(ck, buf, [(i * slot, slot) for i in range(n)])
            rows = buf.array[: n * slot].reshape(n, slot)
            ok = 0
            if windowed(pool, codec):  # whole or short values, page by page (storage_windows)
                for i, size in enumerate(sizes):
                    if size < 0 and size != TOO_LARGE:
                        break
                    if not land(codec, ck[i], rows[i], size, pool, pages[lo + i]):
                        self._corrupt(ck[i])
                        break
                    landed.append(size)
                    ok += 1
                done += ok
                if ok < n:
                    break
                continue
            for i, size in enumerate(sizes):
                if size < 0 and size != TOO_LARGE or is_short_page(codec, size):
                    break
                if size != codec.value_nbytes or not codec.verify_parts(rows[i, nb : nb + TRAILER_SIZE], ck[i],
                                                                        rows[i, :nb]):
                    self._corrupt(ck[i])
                    break
                set_valid(pool, pages[lo + i], codec.flags_of(rows[i, nb: nb + TRAILER_SIZE]))
                landed.append(size)
                ok += 1
            if ok:  # decoded (raw: a view of the staged bytes), then the pool encodes in its own encoding
                kv = self.encoding.decode_pages(buf.tensor[: ok * slot].view(ok, slot)[:, :nb], self.layout,
                                                self.page_size)
                pool.write_pages(torch.tensor(pages[lo : lo + ok], dtype=torch.long), kv)
            done += ok
            if ok < n:
                break
        return done

    # ------------------------------------------------------------------ internals
    def _corrupt(self, key: str) -> None:
        with self._lock:
            self._stats["corrupt"] += 1
        self._warn.warning("corrupt", "L3: the value of page %s failed its check (corrupt); deleted, and the page "
                           "is recomputed", key)
        self.backend.delete(key)

    def _check(self, keys: Sequence[str], pool: HostKVPool, pages: Sequence[int]) -> None:
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys but {len(pages)} host pages")
        if pool.layout != self.layout or pool.page_size != self.page_size:
            raise ValueError(
                f"host pool of {pool.layout} / page size {pool.page_size} does not match the "
                f"storage tier's {self.layout} / {self.page_size}"
            )

    def _staging(self, i: int = 0) -> StagingBuffer:
        """This thread's staging buffer number ``i`` (reads use 0; writes alternate 0 and 1)."""
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = [None, None]
        buf = bufs[i]
        if buf is None or buf.busy:  # busy: an abandoned transfer may still write into it
            buf = bufs[i] = StagingBuffer(self.batch_pages * self.slot)
        return buf


# ---------------------------------------------------------------------- registry
STORAGE_BACKENDS: dict[str, Callable[[Mapping[str, Any]], StorageBackend]] = {
    "lmdb": LMDBStore.from_config,
    "mooncake": MooncakeStore.from_config,
}


def make_storage(name: str, config: Mapping[str, Any] | None = None) -> StorageBackend:
    """Build the backend registered as ``name`` from ``config`` (a mapping of its options;
    see ``LMDBConfig`` / ``MooncakeConfig``). Raises ``ValueError`` for an unknown name or
    unknown / invalid options."""
    try:
        factory = STORAGE_BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown storage backend {name!r}; choose from {sorted(STORAGE_BACKENDS)}") from None
    return factory(dict(config or {}))
