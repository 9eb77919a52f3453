"""LMDB backend of the storage tier: the embedded default (one directory, survives restarts).

Layout of the environment (four named databases):
- ``data``:  key -> value (the page values, header included)
- ``kseq``:  key -> sequence number (u64 big-endian) of its last write or read
- ``order``: sequence number -> key (ascending = least recently used first)
- ``meta``:  ``used`` -> logical bytes held (u64), the basis of eviction

Capacity and growth: the memory map starts at ``initial_map_mb`` and doubles (``set_mapsize``)
whenever a write needs more room, never beyond ``capacity_gb``; the data file can therefore
never exceed the capacity. Eviction keeps the logical size (values plus an estimate of
LMDB's per-entry overhead) under ``high_watermark * capacity``: when a write would cross it,
the least recently used entries are deleted (in their own committed transaction, so
LMDB can reuse their pages) down to ``low_watermark * capacity``. Should LMDB still
report a full map (fragmentation), more entries are evicted and the write is retried;
``MapFullError`` never reaches a caller.

Recency ("LRU-ish"): writes stamp a key with a fresh sequence number. Reads do not open
write transactions; they remember the keys they hit (up to ``touch_buffer`` of them), and
the next write transaction re-stamps them. So eviction order is by last write or read,
with reads taking effect at the next write.

A full disk: without ``writemap`` a commit fails (a write counted in ``errors``, its cause named
by :meth:`LMDBStore.write_error`: ENOSPC and where) and the store serves on. With ``writemap``
the map never reaches past the data file's allocated blocks (hicache.tiers.lmdb.disk): the map is
allocated when the store opens (writemap is off, with a warning saying why, where it cannot be)
and before it grows; a growth the disk has no room for is refused (logged) and the store evicts
instead. Either way a full disk costs writes, never the process.

Opening: a store that exists but cannot be opened (a damaged header, another LMDB version) is a
:class:`~hicache.tiers.base.StorageOpenError`: one line naming the file, what is wrong and what
to do (nothing is deleted: the directory may hold something else than a cache).

Crash safety: plain LMDB transactions (no ``writemap``; ``sync`` on by default). A process
killed mid-write loses at most the uncommitted transaction; committed values survive and
the store reopens cleanly. ``sync=False`` keeps that for process crashes but may lose the
last transactions on an OS crash or power loss.

Threads: any number of readers and writers (writes are serialised by a lock, map resizes
wait for readers to leave). Processes: several may share the directory (LMDB's lock file;
``MapResizedError`` from a resize by another process is handled).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import lmdb
import numpy as np

from hicache.tiers.base import (
    ERROR,
    MISSING,
    TOO_LARGE,
    Buffer,
    PageCopy,
    StagingBuffer,
    StorageBackend,
    StorageOpenError,
    copy_each,
    same_len,
)
from hicache.tiers.lmdb.accounting import LMDBAccounting
from hicache.tiers.lmdb.config import LMDBConfig, MapGeometry
from hicache.tiers.lmdb.disk import mib, write_failure
from hicache.tiers.lmdb.handles import LMDBHandles, open_failure


class LMDBStore(StorageBackend):
    """The LMDB backend (rules in the module docstring). Values up to the capacity; keys up to
    500 bytes (UTF-8).

    Parts: ``handles`` (:class:`LMDBHandles`: the environment, its databases and the
    :class:`~hicache.tiers.lmdb.rwlock.RWLock`), ``acct`` (:class:`LMDBAccounting`: size,
    recency stamps, the touch buffer, counters, map growth, eviction).

    Threads: any number of callers at once (the storage tier's readers and writers). What each
    lock protects:
    - ``_wlock``: one writer at a time (``batch_set``, ``delete``, ``clear``, ``close``): the
      write transaction and everything ``acct`` changes with it (``used``, stamps, eviction,
      map growth). LMDB would serialise write transactions anyway; holding it first keeps the
      eviction and growth decisions in step with the write that needs them.
    - the handles' ``RWLock``: every transaction (read or write) holds it shared; a map resize
      (``acct.grow_map``, or ``set_mapsize(0)`` after another process resized) holds it alone,
      as LMDB requires that no transaction of this process be open then. Readers never take
      ``_wlock``: a read waits only for a resize.
    - ``acct``'s ``_touch_lock``: the touch buffer readers fill and counters (dict updates only).
    - ``_cause``: thread-local, why this thread's latest write failed (:meth:`write_error`).
    """

    name = "lmdb"
    direct_reads = True  # values are read as views into the map and copied once, GIL released

    def __init__(self, config: LMDBConfig) -> None:
        self.config = config
        geometry = MapGeometry.of(config)
        self.handles = LMDBHandles.open(config, geometry.initial)
        try:
            self.acct = LMDBAccounting(self.handles, config, geometry)
        except lmdb.Error as e:  # the header was fine, the pages behind it are not
            self.handles.env.close()
            raise StorageOpenError(open_failure(e, self.handles.path)) from None
        self._wlock = threading.Lock()  # one writer at a time (LMDB would block anyway)
        self._cause = threading.local()

    @property
    def capacity(self) -> int:
        return self.acct.capacity

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | LMDBConfig) -> LMDBStore:
        return cls(config if isinstance(config, LMDBConfig) else LMDBConfig.from_mapping(config))

    # ------------------------------------------------------------------ reads
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str) -> bytes | None:
        return self.batch_get([key])[0]

    def batch_exists(self, keys: Sequence[str]) -> int:
        def run(txn):
            cur = txn.cursor(db=self.handles.data)
            n = 0
            for k in keys:
                if not cur.set_key(k.encode()):
                    break
                n += 1
            return n

        n = self._read(run)
        return 0 if n is None else n

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        def run(txn):
            return [txn.get(k.encode(), db=self.handles.data) for k in keys]

        out = self._read(run)
        if out is None:
            return [None] * len(keys)
        self.acct.touch(k for k, v in zip(keys, out, strict=True) if v is not None)
        return out

    def batch_get_into(
        self, keys: Sequence[str], buf: StagingBuffer, spans: Sequence[tuple[int, int]]
    ) -> list[int]:
        same_len(keys, spans)

        def run(txn):
            res = []
            for k, (off, size) in zip(keys, spans, strict=True):
                val = txn.get(k.encode(), db=self.handles.data)  # a view into the map, valid in txn
                if val is None:
                    res.append(MISSING)
                elif len(val) > size:
                    res.append(TOO_LARGE)
                else:
                    buf.view(off, len(val))[:] = val
                    res.append(len(val))
            return res

        out = self._read(run, buffers=True)
        if out is None:
            return [ERROR] * len(keys)
        self.acct.touch(k for k, r in zip(keys, out, strict=True) if r >= 0)
        return out

    def batch_get_pages(self, keys: Sequence[str], dsts: Sequence[Any], trailers: Any,
                        copy: PageCopy | None = None) -> list[int]:
        same_len(keys, dsts)
        t = trailers.shape[1]

        def run(txn):
            res, srcs, idx = [], [], []
            for i, k in enumerate(keys):
                val = txn.get(k.encode(), db=self.handles.data)  # a view into the map, valid in txn
                if val is None:
                    res.append(MISSING)
                    continue
                n = len(dsts[i])
                if len(val) == n + t:
                    src = np.frombuffer(val, dtype=np.uint8)
                    trailers[i] = src[n:]
                    srcs.append(src[:n])
                    idx.append(i)
                res.append(len(val))
            if copy is not None:  # one copy, map -> L2 page, for all of them at once (GIL released)
                copy(srcs, idx)
            else:
                copy_each(srcs, [dsts[i] for i in idx])
            return res

        out = self._read(run, buffers=True)
        if out is None:
            return [ERROR] * len(keys)
        self.acct.touch(k for k, r in zip(keys, out, strict=True) if r >= 0)
        return out

    # ------------------------------------------------------------------ writes
    def set(self, key: str, value: Buffer) -> bool:
        return self.batch_set([key], [value])[0]

    def write_error(self) -> str | None:
        return getattr(self._cause, "text", None)

    def batch_set(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        same_len(keys, values)
        self._cause.text = None
        items = []
        ok = []
        for k, v in zip(keys, values, strict=True):
            kb = k.encode()
            fits = 0 < len(kb) <= 500 and self.acct.cost(len(kb), len(v)) <= self.capacity * self.config.low_watermark
            ok.append(fits)
            if fits:
                items.append((kb, v))
            elif self._cause.text is None:
                self._cause.text = "an empty key, a key over 500 bytes or a value over the low watermark is not stored"
        if not items:
            return ok
        incoming = sum(self.acct.cost(len(k), len(v)) for k, v in items)
        with self._wlock:
            if not self._store_items(items, incoming):
                self.acct.count("errors")
                return [False] * len(keys)
        return ok

    def delete(self, key: str) -> bool:
        kb = key.encode()
        with self._wlock:
            found = []

            def run(txn):
                found.append(self.acct.delete_key(txn, kb))
                self.acct.put_used(txn)

            if not self._write(run):
                self.acct.count("errors")
                return False
        if found and found[0]:
            self.acct.count("deleted")
            return True
        return False

    def clear(self) -> None:
        with self._wlock:
            if not self._write(self.acct.drop_all):
                self.acct.count("errors")
            self.acct.clear_touched()

    def stats(self) -> dict[str, float]:
        try:
            with self.handles.rw.shared(), self.handles.env.begin() as txn:
                entries = txn.stat(self.handles.data)["entries"]
            file_bytes = os.path.getsize(os.path.join(self.config.path, "data.mdb"))
        except (lmdb.Error, OSError):
            entries = file_bytes = -1
        out = self.acct.counts()
        out.update(
            entries=entries,
            used_bytes=self.acct.used,
            capacity_bytes=self.capacity,
            map_size=self.handles.env.info()["map_size"],
            file_bytes=file_bytes,
        )
        return out

    def close(self) -> None:
        with self._wlock, self.handles.rw.exclusive():
            self.handles.env.close()

    # ------------------------------------------------------------------ internals
    def _read(self, fn, buffers: bool = False):
        """Run ``fn(txn)`` in a read transaction; None (error counted) on an LMDB failure."""
        for _ in range(2):
            try:
                with self.handles.rw.shared(), self.handles.env.begin(buffers=buffers) as txn:
                    return fn(txn)
            except lmdb.MapResizedError:  # another process grew the map
                with self.handles.rw.exclusive():
                    self.handles.env.set_mapsize(0)
            except lmdb.Error:
                break
        self.acct.count("errors")
        return None

    def _write(self, fn, needed: int = 0) -> bool:
        """Run ``fn(txn)`` in a write transaction (caller holds ``_wlock``), growing the map
        or evicting on ``MapFullError``. False when it could not commit (the cause in
        ``_cause``: ``needed``, about the bytes the write adds, tells a full disk from others)."""
        stalls = 0
        for _ in range(12):
            used_before = self.acct.used
            try:
                # buffers: values read inside writes (sizes of old values) are views, never copies
                with self.handles.rw.shared(), self.handles.env.begin(write=True, buffers=True) as txn:
                    fn(txn)
                return True
            except lmdb.MapFullError:
                self.acct.used = used_before  # the transaction was aborted
                if not self.acct.grow_map() and not self.acct.evict(self.capacity // 10):
                    # nothing left to evict: the free pages are still pinned by readers'
                    # snapshots; give them a moment to end their transactions
                    if stalls >= 5:
                        return self._failed(self._map_full())
                    time.sleep(0.005 * 2**stalls)
                    stalls += 1
            except lmdb.MapResizedError:
                self.acct.used = used_before
                with self.handles.rw.exclusive():
                    self.handles.env.set_mapsize(0)
            except lmdb.Error as e:
                self.acct.used = used_before
                return self._failed(write_failure(e, self.handles.path, needed))
        return self._failed(self._map_full())

    def _failed(self, cause: str) -> bool:
        self._cause.text = cause
        return False

    def _map_full(self) -> str:
        if self.acct.grow_error is not None:  # writemap: the disk had no room for a larger map
            return self.acct.grow_error
        return (f"the LMDB map ({mib(self.handles.env.info()['map_size'])}) has no room left and nothing more could be "
                f"evicted (readers still hold its free pages) ({self.handles.path})")

    def _store_items(self, items: list[tuple[bytes, Buffer]], incoming: int) -> bool:
        self.acct.make_room(incoming)
        touched = self.acct.take_touched()

        def run(txn):
            self.acct.restamp(txn, touched)
            for kb, v in items:
                self.acct.put(txn, kb, v)
            self.acct.put_used(txn)

        return self._write(run, incoming)
