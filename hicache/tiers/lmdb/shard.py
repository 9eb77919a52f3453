"""One LMDB environment of a store: its transactions, writes, map growth and eviction.

:class:`hicache.tiers.lmdb.store.LMDBStore` holds one :class:`LMDBShard` per shard
(hicache.tiers.lmdb.layout) and sends each key to its shard; the rules a shard keeps (layout of
its databases, capacity, eviction, crash safety) are in the store's module docstring, and hold
per shard: each has its own map, ``used``, recency order and share of the capacity.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lmdb

from hicache.tiers.base import Buffer, StorageOpenError
from hicache.tiers.lmdb.accounting import LMDBAccounting
from hicache.tiers.lmdb.config import LMDBConfig, MapGeometry
from hicache.tiers.lmdb.disk import mib, write_failure
from hicache.tiers.lmdb.handles import LMDBHandles, open_failure
from hicache.tiers.lmdb.value_files import SLOT, Value, value_len


class LMDBShard:
    """One environment (``handles``: :class:`LMDBHandles`) and its bookkeeping (``acct``:
    :class:`LMDBAccounting`), opened from a shard's config (its own directory and capacity share).

    Threads: any number of readers and writers at once. What each lock protects:
    - ``_wlock``: one writer at a time (:meth:`store`, :meth:`delete`, :meth:`clear`,
      :meth:`close`, :meth:`check`): the write transaction and everything ``acct`` changes with it
      (``used``, stamps, eviction, map growth). LMDB would serialise write transactions anyway;
      holding it first keeps the eviction and growth decisions in step with the write that needs
      them. The store calls :meth:`store` from this shard's own writer thread.
    - the handles' ``RWLock``: every transaction (read or write) holds it shared; a map resize
      (``acct.grow_map``, or ``set_mapsize(0)`` after another process resized) holds it alone,
      as LMDB requires that no transaction of this process be open then. Readers never take
      ``_wlock``: a read waits only for a resize.
    - ``acct``'s ``_touch_lock``: the touch buffer readers fill and counters (dict updates only).
    """

    def __init__(self, config: LMDBConfig) -> None:
        self.config = config
        geometry = MapGeometry.of(config)
        self.handles = LMDBHandles.open(config, geometry.initial)
        try:
            self.acct = LMDBAccounting(self.handles, config, geometry)
        except lmdb.Error as e:  # the header was fine, the pages behind it are not
            self.handles.env.close()
            raise StorageOpenError(open_failure(e, self.handles.path)) from None
        self._wlock = threading.Lock()

    @property
    def capacity(self) -> int:
        return self.acct.capacity

    def fits(self, kb: bytes, nbytes: int) -> bool:
        """Whether a value of ``nbytes`` under ``kb`` can be stored here at all."""
        return 0 < len(kb) <= 500 and self.acct.cost(len(kb), nbytes) <= self.capacity * self.config.low_watermark

    # ------------------------------------------------------------------ reads
    def value(self, txn, kb: bytes, buffers: bool) -> Any:
        """``kb``'s value in ``txn`` (a view with ``buffers``, valid while it is open), inline or in a value
        file (hicache.tiers.lmdb.value_files); None: no such key."""
        h = self.handles
        val = txn.get(kb, db=h.data)
        if val is not None:
            return val
        rec = txn.get(kb, db=h.slots)
        if rec is None:
            return None
        view = self.acct.files.view(*SLOT.unpack(rec))
        return view if buffers else view.tobytes()

    @contextmanager
    def txn(self, buffers: bool = False) -> Iterator[Any]:
        """A read transaction, under the RWLock's shared side; a map another process grew is
        adopted first (``MapResizedError`` at the start of a transaction)."""
        for attempt in range(2):
            with self.handles.rw.shared():
                try:
                    txn = self.handles.env.begin(buffers=buffers)
                except lmdb.MapResizedError:
                    if attempt:
                        raise
                    txn = None
                if txn is not None:
                    with txn:
                        yield txn
                    return
            with self.handles.rw.exclusive():
                self.handles.env.set_mapsize(0)

    # ------------------------------------------------------------------ writes
    def store(self, items: list[tuple[bytes, Buffer | Value]]) -> str | None:
        """Write ``items`` (keys that :meth:`fits`) in one transaction, evicting first where they
        would cross the high watermark. None when committed, else why not (counted in ``errors``)."""
        incoming = sum(self.acct.cost(len(k), value_len(v)) for k, v in items)
        with self._wlock:
            self.acct.make_room(incoming)
            touched = self.acct.take_touched()

            def run(txn):
                self.acct.restamp(txn, touched)
                for kb, v in items:
                    self.acct.put(txn, kb, v)
                self.acct.put_used(txn)
                if self.config.sync:  # the value files' bytes are on disk before the index names them
                    self.acct.files.sync()
                else:
                    self.acct.files.discard()

            cause = self._write(run, incoming)
        if cause is not None:
            self.acct.count("errors")
        return cause

    def delete(self, kb: bytes) -> bool:
        return self.delete_many([kb]) == 1

    def delete_many(self, kbs: list[bytes]) -> int:
        """Remove ``kbs`` (absent ones skipped) in one write transaction; how many were removed
        (0 on a failed commit, counted in ``errors``)."""
        with self._wlock:
            found = []

            def run(txn):
                found.clear()
                found.extend(kb for kb in kbs if self.acct.delete_key(txn, kb))
                self.acct.put_used(txn)

            if self._write(run) is not None:
                self.acct.count("errors")
                return 0
        if found:
            self.acct.count("deleted", len(found))
        return len(found)

    def clear(self) -> None:
        with self._wlock:
            if self._write(self.acct.drop_all) is not None:
                self.acct.count("errors")
            else:
                self.acct.files.reset()
            self.acct.clear_touched()

    # ------------------------------------------------------------------ state
    def stats(self) -> dict[str, float]:
        try:
            with self.txn() as txn:
                entries = txn.stat(self.handles.data)["entries"] + txn.stat(self.handles.slots)["entries"]
            file_bytes = os.path.getsize(self.handles.data_file)
        except (lmdb.Error, OSError):
            entries = file_bytes = -1
        out = self.acct.counts()
        out.update(entries=entries, used_bytes=self.acct.used, capacity_bytes=self.capacity,
                   map_size=self.handles.env.info()["map_size"], file_bytes=file_bytes,
                   value_file_bytes=self.acct.files.allocated_bytes())
        return out

    def check(self, owns) -> dict[str, int]:  # noqa: ANN001 - owns: Callable[[bytes], bool]
        """Raise AssertionError unless this shard's databases agree with each other and with
        ``used`` (see :meth:`LMDBAccounting.check`) and every key is one ``owns`` gives this shard;
        returns the shard's entries and bytes."""
        with self._wlock, self.txn(buffers=True) as txn:
            return self.acct.check(txn, owns)

    def close(self) -> None:
        with self._wlock, self.handles.rw.exclusive():
            self.handles.env.close()
            self.acct.files.close()

    # ------------------------------------------------------------------ internals
    def _write(self, fn, needed: int = 0) -> str | None:
        """Run ``fn(txn)`` in a write transaction (caller holds ``_wlock``), growing the map
        or evicting on ``MapFullError``. None when committed, else why not (``needed``, about
        the bytes the write adds, tells a full disk from others)."""
        stalls = 0
        for _ in range(12):
            used_before = self.acct.used
            try:
                # buffers: values read inside writes (sizes of old values) are views, never copies
                with self.handles.rw.shared(), self.handles.env.begin(write=True, buffers=True) as txn:
                    fn(txn)
                return None
            except lmdb.MapFullError:
                self.acct.used = used_before  # the transaction was aborted
                if not self.acct.grow_map() and not self.acct.evict(self.capacity // 10):
                    # nothing left to evict: the free pages are still pinned by readers'
                    # snapshots; give them a moment to end their transactions
                    if stalls >= 5:
                        return self._map_full()
                    time.sleep(0.005 * 2**stalls)
                    stalls += 1
            except lmdb.MapResizedError:
                self.acct.used = used_before
                with self.handles.rw.exclusive():
                    self.handles.env.set_mapsize(0)
            except (lmdb.Error, OSError) as e:  # OSError: a value file's pwrite / fdatasync
                self.acct.used = used_before
                self.acct.files.discard()
                return write_failure(e, self.handles.path, needed)
        return self._map_full()

    def _map_full(self) -> str:
        if self.acct.grow_error is not None:  # writemap: the disk had no room for a larger map
            return self.acct.grow_error
        return (f"the LMDB map ({mib(self.handles.env.info()['map_size'])}) has no room left and nothing more could be "
                f"evicted (readers still hold its free pages) ({self.handles.path})")
