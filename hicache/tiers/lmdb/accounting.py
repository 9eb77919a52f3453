"""Support of the LMDB storage backend (split out of lmdb_store.py to keep files small):
its config, the reader/writer lock around map resizes, and the bookkeeping mixin
(counters, recency stamps, logical size accounting, map growth, LRU eviction).

See lmdb_store.py for the layout, capacity, eviction and crash-safety rules.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any

import lmdb

_U64 = struct.Struct(">Q")
_MIB = 1 << 20


@dataclass(frozen=True)
class LMDBConfig:
    """Options of :class:`LMDBStore` (the keys of its config mapping)."""

    path: str
    capacity_gb: float = 64.0
    initial_map_mb: float = 0.0  # 0: map the whole capacity up front (sparse; no resize under load)
    sync: bool = True
    high_watermark: float = 0.85
    low_watermark: float = 0.75
    max_readers: int = 126
    touch_buffer: int = 65536

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("lmdb storage needs a path")
        if self.capacity_gb <= 0 or self.initial_map_mb < 0:
            raise ValueError("capacity_gb must be positive and initial_map_mb >= 0")
        if not 0 < self.low_watermark <= self.high_watermark < 1:
            raise ValueError("need 0 < low_watermark <= high_watermark < 1")

    @classmethod
    def from_mapping(cls, config: Mapping[str, Any]) -> LMDBConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(config) - known
        if unknown:
            raise ValueError(f"unknown lmdb storage options {sorted(unknown)}; known: {sorted(known)}")
        if "path" not in config:
            raise ValueError("lmdb storage needs a path")
        return cls(**config)


class _RWLock:
    """Shared (transactions) / exclusive (``set_mapsize``) lock."""

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


class _LMDBBookkeeping:
    """Internals of :class:`hicache.tiers.lmdb_store.LMDBStore`; the attributes below are set
    by ``LMDBStore.__init__``."""

    config: LMDBConfig
    capacity: int
    _psize: int
    _env: Any
    _data: Any
    _kseq: Any
    _order: Any
    _meta: Any
    _rw: _RWLock
    _touch_lock: threading.Lock
    _touched: dict[bytes, None]
    _counts: dict[str, int]
    _used: int
    _seq: int

    def _count(self, name: str, n: int = 1) -> None:
        with self._touch_lock:
            self._counts[name] += n

    def _cost(self, klen: int, vlen: int) -> int:
        """Estimated bytes an entry takes: its value (overflow pages when large) plus the
        key in three databases and node headers."""
        ps = self._psize
        vbytes = (vlen + 16 + ps - 1) // ps * ps if vlen > ps // 2 else vlen + 16
        return vbytes + 3 * klen + 96

    def _touch(self, keys) -> None:
        with self._touch_lock:
            for k in keys:
                if len(self._touched) >= self.config.touch_buffer:
                    break
                self._touched[k.encode()] = None

    def _grow_map(self, need: int = 0) -> bool:
        cur = self._env.info()["map_size"]
        if cur >= self.capacity:
            return False
        new = min(self.capacity, max(2 * cur, need) // self._psize * self._psize + self._psize)
        with self._rw.exclusive():
            self._env.set_mapsize(new)
        self._count("map_grows")
        return True

    def _stamp(self, txn, kb: bytes) -> None:
        seq = _U64.pack(self._seq)
        self._seq += 1
        txn.put(kb, seq, db=self._kseq)
        txn.put(seq, kb, db=self._order)

    def _put_used(self, txn) -> None:
        txn.put(b"used", _U64.pack(max(0, self._used)), db=self._meta)

    def _delete_key(self, txn, kb: bytes) -> bool:
        with txn.cursor(db=self._data) as cur:
            if not cur.set_key(kb):
                return False
            self._used -= self._cost(len(kb), len(cur.value()))
            cur.delete()
        seq = txn.pop(kb, db=self._kseq)
        if seq is not None:
            txn.delete(bytes(seq), db=self._order)
        return True

    def _evict(self, nbytes: int) -> bool:
        """Delete least recently used entries worth at least ``nbytes`` (own transaction)."""
        if nbytes <= 0:
            return True
        evicted = []

        def run(txn):
            freed = 0
            cur = txn.cursor(db=self._order)
            victims = []
            for seq, kb in cur:
                if freed >= nbytes:
                    break
                victims.append((bytes(seq), bytes(kb)))
                val = txn.get(kb, db=self._data)  # a view (buffers): only its length is read
                freed += self._cost(len(kb), len(val)) if val is not None else 0
            for seq, kb in victims:
                self._delete_key(txn, kb)
                txn.delete(seq, db=self._order)  # already gone unless data/kseq were missing
            self._put_used(txn)
            evicted.append(len(victims))

        used_before = self._used
        try:
            with self._rw.shared(), self._env.begin(write=True, buffers=True) as txn:
                run(txn)
        except lmdb.Error:
            self._used = used_before
            return False
        self._count("evicted", evicted[0])
        return evicted[0] > 0
