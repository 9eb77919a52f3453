"""Bookkeeping of the LMDB storage backend: counters, recency stamps, the logical size,
map growth and LRU eviction (the rules are in :mod:`hicache.tiers.lmdb.store`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

import lmdb

from hicache.ratelimited_log import RateLimitedLog
from hicache.tiers.base import Buffer, join
from hicache.tiers.lmdb.config import U64, LMDBConfig, MapGeometry
from hicache.tiers.lmdb.disk import allocate, mib, write_failure
from hicache.tiers.lmdb.handles import LMDBHandles
from hicache.tiers.lmdb.value_files import MIN_BYTES, SLOT, Value, ValueFiles, next_key, value_len

_warn = RateLimitedLog(logging.getLogger("hicache.storage"))
FREE_SCAN = 64  # slots given back looked at per allocation before a new one is taken


class LMDBAccounting:
    """What one :class:`hicache.tiers.lmdb.store.LMDBStore` knows about its contents besides
    the values: the logical size ``used`` (values plus an estimate of LMDB's per-entry
    overhead, persisted in ``meta``), the next recency stamp, the keys reads hit since the last
    write (re-stamped by the next write), counters, and the capacity; and where each value is: inline in
    ``data``, or in a slot of a value file (``files``; ``slots`` and ``free`` index them, allocated and given
    back inside the write transactions: hicache.tiers.lmdb.value_files).

    Contract (the store's threads: any number of readers and writers):
    - ``used`` and the stamp sequence change only inside write transactions, and every write
      path (the ``txn`` methods, :meth:`make_room`, :meth:`evict`, :meth:`grow_map`) runs with
      the store's ``_wlock`` held, so they have one writer at a time; ``grow_error`` (why the
      latest growth failed, None after one that did not) is theirs too. A write whose transaction
      aborted puts ``used`` back (the store's ``_write``); :meth:`evict` does so itself.
      ``stats`` reads ``used`` without a lock (an int: at worst one write stale).
    - ``_touch_lock`` guards the touch buffer ``_touched`` (filled by readers, taken by the
      next writer) and ``_counts``; it is held only for dict updates, never across I/O.
    - :meth:`grow_map` takes the handles' :class:`RWLock` exclusively (waits until every
      transaction of this process ended); :meth:`evict` opens its own write transaction under
      the shared side. Neither may be called inside a transaction.
    """

    def __init__(self, handles: LMDBHandles, config: LMDBConfig, geometry: MapGeometry) -> None:
        self.h = handles
        self.config = config
        self.capacity = geometry.capacity
        self._psize = geometry.page
        self._touch_lock = threading.Lock()
        self._touched: dict[bytes, None] = {}
        self._counts = {"errors": 0, "evicted": 0, "map_grows": 0, "deleted": 0}
        self.grow_error: str | None = None
        self.files = ValueFiles(handles.path, geometry.capacity)
        # new values of MIN_BYTES and more go to value files (not with writemap: the map's blocks are allocated
        # up front so that a full disk never meets a write, and values written into it take one copy already)
        self._to_files = config.value_files and not handles.writemap
        self._oldest: tuple[int, int] | None = None  # (write txn id, the oldest open reader then)
        with handles.env.begin() as txn:
            raw = txn.get(b"used", db=handles.meta)
            self.used = U64.unpack(raw)[0] if raw else 0
            cur = txn.cursor(db=handles.order)
            self._seq = U64.unpack(cur.key())[0] + 1 if cur.last() else 1

    # ------------------------------------------------------------------ counters, recency
    def count(self, name: str, n: int = 1) -> None:
        with self._touch_lock:
            self._counts[name] += n

    def counts(self) -> dict[str, float]:
        with self._touch_lock:
            return dict(self._counts)

    def cost(self, klen: int, vlen: int) -> int:
        """Estimated bytes an entry takes: its value (overflow pages when large) plus the
        key in three databases and node headers."""
        ps = self._psize
        vbytes = (vlen + 16 + ps - 1) // ps * ps if vlen > ps // 2 else vlen + 16
        return vbytes + 3 * klen + 96

    def touch(self, keys: Iterable[str]) -> None:
        """Remember keys a read hit (up to ``touch_buffer``), for the next write to re-stamp."""
        with self._touch_lock:
            for k in keys:
                if len(self._touched) >= self.config.touch_buffer:
                    break
                self._touched[k.encode()] = None

    def take_touched(self) -> list[bytes]:
        with self._touch_lock:
            touched, self._touched = list(self._touched), {}
        return touched

    def clear_touched(self) -> None:
        with self._touch_lock:
            self._touched.clear()

    # ------------------------------------------------------------------ size, map, eviction
    def make_room(self, incoming: int) -> None:
        """Before a write of ``incoming`` bytes: evict down to the low watermark when it would
        cross the high one, and grow the map to what the write needs."""
        high = self.capacity * self.config.high_watermark
        if self.used + incoming > high:
            self.evict(int(self.used + incoming - self.capacity * self.config.low_watermark))
        need = int((self.used + incoming) / self.config.high_watermark)
        if need > self.h.env.info()["map_size"]:
            self.grow_map(need)

    def grow_map(self, need: int = 0) -> bool:
        """Double the map (at least to ``need``, at most to the capacity); False when it cannot.
        With writemap the new part's blocks are allocated first (the map never reaches past
        them: hicache.tiers.lmdb.disk); a disk without room leaves the map as it is."""
        cur = self.h.env.info()["map_size"]
        if cur >= self.capacity:
            return False
        new = min(self.capacity, max(2 * cur, need) // self._psize * self._psize + self._psize)
        if self.h.writemap:
            err = allocate(self.h.data_file, new)
            if err is not None:
                self.grow_error = write_failure(err, self.h.path, new - cur)
                _warn.warning("lmdb_grow", "L3: the LMDB map cannot grow from %s to %s: %s; the store evicts to "
                              "make room instead", mib(cur), mib(new), self.grow_error)
                return False
        self.grow_error = None
        with self.h.rw.exclusive():
            self.h.env.set_mapsize(new)
        self.count("map_grows")
        return True

    def evict(self, nbytes: int) -> bool:
        """Delete least recently used entries worth at least ``nbytes`` (own transaction)."""
        if nbytes <= 0:
            return True
        evicted = []

        def run(txn):
            freed = 0
            cur = txn.cursor(db=self.h.order)
            victims = []
            for seq, kb in cur:
                if freed >= nbytes:
                    break
                victims.append((bytes(seq), bytes(kb)))
                vlen = self.value_len(txn, kb)
                freed += self.cost(len(kb), vlen) if vlen is not None else 0
            for seq, kb in victims:
                self.delete_key(txn, kb)
                txn.delete(seq, db=self.h.order)  # already gone unless data/kseq were missing
            self.put_used(txn)
            evicted.append(len(victims))

        used_before = self.used
        try:
            with self.h.rw.shared(), self.h.env.begin(write=True, buffers=True) as txn:
                run(txn)
        except lmdb.Error:
            self.used = used_before
            return False
        self.count("evicted", evicted[0])
        return evicted[0] > 0

    # ------------------------------------------------------------------ inside a write txn
    def restamp(self, txn, keys: Iterable[bytes]) -> None:
        """Give the keys that still exist a fresh stamp (reads' recency, applied by a write)."""
        for kb in keys:
            old = txn.get(kb, db=self.h.kseq)
            if old is not None:
                txn.delete(bytes(old), db=self.h.order)
                self._stamp(txn, kb)

    def value_len(self, txn, kb: bytes) -> int | None:
        """The length of ``kb``'s value, inline or in a value file; None: no such key."""
        val = txn.get(kb, db=self.h.data)  # a view (buffers): only its length is read
        if val is not None:
            return len(val)
        rec = txn.get(kb, db=self.h.slots)
        return None if rec is None else SLOT.unpack(rec)[0]

    def put(self, txn, kb: bytes, value: Buffer | Value) -> None:
        """Write (or overwrite) one value with a fresh stamp, keeping ``used`` in step; a value of
        ``MIN_BYTES`` or more goes to a value file's slot when ``value_files`` is on and one is free."""
        h = self.h
        n = value_len(value)
        slot = self._take_slot(txn, n) if self._to_files and n >= MIN_BYTES else None  # before the old one is freed
        old = self.value_len(txn, kb)
        if old is not None:
            self.used -= self.cost(len(kb), old)
            txn.delete(bytes(txn.get(kb, db=h.kseq)), db=h.order)
            self._unslot(txn, kb)
        if slot is None:
            txn.put(kb, join(value) if isinstance(value, tuple) else value, db=h.data)
        else:
            self.files.write(n, slot, value)
            txn.delete(kb, db=h.data)  # an inline value it replaces
            txn.put(kb, SLOT.pack(n, slot), db=h.slots)
        self._stamp(txn, kb)
        self.used += self.cost(len(kb), n)

    def delete_key(self, txn, kb: bytes) -> bool:
        vlen = self.value_len(txn, kb)
        if vlen is None:
            return False
        self.used -= self.cost(len(kb), vlen)
        if not self._unslot(txn, kb):
            txn.delete(kb, db=self.h.data)
        seq = txn.pop(kb, db=self.h.kseq)
        if seq is not None:
            txn.delete(bytes(seq), db=self.h.order)
        return True

    def drop_all(self, txn) -> None:
        for db in (self.h.data, self.h.kseq, self.h.order, self.h.slots, self.h.free):
            txn.drop(db, delete=False)
        with txn.cursor(db=self.h.meta) as cur:  # the classes' next slots
            nexts = [bytes(k) for k in cur.iternext(values=False) if bytes(k).startswith(b"next:")]
        for k in nexts:
            txn.delete(k, db=self.h.meta)
        self.used = 0
        self.put_used(txn)

    def _take_slot(self, txn, size: int) -> int | None:
        """A slot of class ``size``: one given back that no open read transaction (of any process) can still
        find under its old key, else the next never handed out; None: none now (the value stays inline)."""
        h = self.h
        oldest = self._oldest_reader(txn)
        with txn.cursor(db=h.free) as cur:
            found = cur.set_range(SLOT.pack(size, 0))
            for _ in range(FREE_SCAN):
                if not found:
                    break
                got, slot = SLOT.unpack(cur.key())
                if got != size:
                    break
                if U64.unpack(cur.value())[0] <= oldest:  # freed by a write every open reader sees
                    cur.delete()
                    return slot
                found = cur.next()
        raw = txn.get(next_key(size), db=h.meta)
        nxt = U64.unpack(raw)[0] if raw else 0
        if nxt >= self.files.slots(size):
            return None
        txn.put(next_key(size), U64.pack(nxt + 1), db=h.meta)
        return nxt

    def _unslot(self, txn, kb: bytes) -> bool:
        """Give ``kb``'s slot back (False: its value is not in a value file)."""
        rec = txn.pop(kb, db=self.h.slots)
        if rec is None:
            return False
        txn.put(bytes(rec), U64.pack(txn.id()), db=self.h.free)  # readers older than this txn may still read it
        return True

    def _oldest_reader(self, txn) -> int:
        """The oldest snapshot a read transaction may hold: the oldest open one of any process (LMDB's reader
        table), at most the last committed (a reader beginning now gets that one, from before this write's
        frees); cached per write transaction."""
        tid = txn.id()
        if self._oldest is not None and self._oldest[0] == tid:
            return self._oldest[1]
        ids = [int(f[2]) for f in (line.split() for line in self.h.env.readers().splitlines()[1:])
               if len(f) == 3 and f[2].isdigit()]
        oldest = min([*ids, tid - 1])
        self._oldest = (tid, oldest)
        return oldest

    def put_used(self, txn) -> None:
        txn.put(b"used", U64.pack(max(0, self.used)), db=self.h.meta)

    def check(self, txn, owns: Callable[[bytes], bool]) -> dict[str, int]:
        """Raise AssertionError unless (in ``txn``, with the store's ``_wlock`` held) every value has
        one stamp and the order database maps it back, nothing else is stamped, ``used`` equals the
        sum of the entries' costs and what ``meta`` holds, and ``owns`` accepts every key (the
        shard's keys). Returns entries and bytes."""
        h, used, n = self.h, 0, 0
        taken: set[tuple[int, int]] = set()
        entries = [(bytes(k), len(v)) for k, v in txn.cursor(db=h.data)]
        for key, rec in txn.cursor(db=h.slots):
            kb, (size, slot) = bytes(key), SLOT.unpack(rec)
            assert txn.get(kb, db=h.data) is None, f"LMDB {h.path}: key {kb[:40]!r} is inline and in a value file"
            assert (size, slot) not in taken, f"LMDB {h.path}: slot {slot} of class {size} holds two keys"
            taken.add((size, slot))
            entries.append((kb, size))
        for kb, vlen in entries:
            assert owns(kb), f"LMDB {h.path}: key {kb[:40]!r} belongs to another shard"
            seq = txn.get(kb, db=h.kseq)
            assert seq is not None, f"LMDB {h.path}: key {kb[:40]!r} has no recency stamp"
            back = txn.get(bytes(seq), db=h.order)
            assert back is not None and bytes(back) == kb, f"LMDB {h.path}: the stamp of {kb[:40]!r} is not in order"
            used += self.cost(len(kb), vlen)
            n += 1
        self._check_slots(txn, taken)
        kseq, order = txn.stat(h.kseq)["entries"], txn.stat(h.order)["entries"]
        assert kseq == order == n, f"LMDB {h.path}: {n} values, {kseq} stamps, {order} order entries"
        raw = txn.get(b"used", db=h.meta)
        meta = U64.unpack(raw)[0] if raw else 0
        assert self.used == used == meta, f"LMDB {h.path}: used {self.used}, meta {meta}, entries' cost {used}"
        assert used <= self.capacity, f"LMDB {h.path}: {used} bytes held, the capacity is {self.capacity}"
        return {"entries": n, "used_bytes": used}

    def _check_slots(self, txn, taken: set[tuple[int, int]]) -> None:
        """Every slot below its class's next is held by one key or free, never both; none past the file."""
        h = self.h
        free = {SLOT.unpack(k) for k in txn.cursor(db=h.free).iternext(values=False)}
        assert not taken & free, f"LMDB {h.path}: slots both held and free: {sorted(taken & free)[:4]}"
        classes = {int.from_bytes(bytes(k)[5:], "big") for k in txn.cursor(db=h.meta).iternext(values=False)
                   if bytes(k).startswith(b"next:")}
        for size in classes | {s for s, _ in taken | free}:
            raw = txn.get(next_key(size), db=h.meta)
            nxt = U64.unpack(raw)[0] if raw else 0
            mine = {i for s, i in taken | free if s == size}
            assert nxt <= self.files.slots(size) and mine == set(range(nxt)), \
                f"LMDB {h.path}: class {size}: next slot {nxt}, {len(mine)} slots held or free"

    def _stamp(self, txn, kb: bytes) -> None:
        seq = U64.pack(self._seq)
        self._seq += 1
        txn.put(kb, seq, db=self.h.kseq)
        txn.put(seq, kb, db=self.h.order)
