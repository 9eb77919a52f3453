"""LMDB backend of the storage tier: the embedded default (one directory, survives restarts).

Shards: the store is ``shards`` LMDB environments (hicache.tiers.lmdb.layout: the directory
layout, which shard a key belongs to, a store opened with another count), each with its own
writer thread, so writes to different shards commit in parallel (LMDB has one writer per
environment). A key's reads, writes and deletes go to its shard; a batch is split by shard and
each part runs in its shard (writes: on its writer thread, all parts at once; reads: one read
transaction per shard touched, all open together). Each shard holds an equal share of
``capacity_gb`` and keeps every rule below on its own (its own ``used``, recency order and
eviction); the store's stats are the sums.

Layout of each environment (six named databases):
- ``data``:  key -> value (the page values, header included)
- ``kseq``:  key -> sequence number (u64 big-endian) of its last write or read
- ``order``: sequence number -> key (ascending = least recently used first)
- ``meta``:  ``used`` -> logical bytes held (u64), the basis of eviction
- ``slots`` / ``free``: with ``value_files``, values written into slot files beside the environment
  instead of ``data`` (hicache.tiers.lmdb.value_files: one copy less per byte); read either way

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
last transactions on an OS crash or power loss. A batch over several shards commits one
transaction per shard: a crash between them keeps the parts committed (each page is its own
value; a prefix lookup stops at the first page missing).

Threads: any number of readers and writers (a shard's writes are serialised, map resizes
wait for that shard's readers to leave). Processes: several may share the directory (LMDB's lock file;
``MapResizedError`` from a resize by another process is handled).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
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
    copy_each,
    same_len,
)
from hicache.tiers.lmdb.config import LMDBConfig
from hicache.tiers.lmdb.handles import LMDBHandles
from hicache.tiers.lmdb.layout import shard_configs, shard_of
from hicache.tiers.lmdb.malloc import keep_freed_memory
from hicache.tiers.lmdb.shard import LMDBShard
from hicache.tiers.lmdb.value_files import Value, value_len


class LMDBStore(StorageBackend):
    """The LMDB backend (rules in the module docstring). Values up to a shard's capacity; keys up
    to 500 bytes (UTF-8).

    Parts: ``shards`` (:class:`LMDBShard`: an environment, its bookkeeping and its write lock,
    one per shard), ``_writers`` (one single-thread executor per shard when there are several:
    the shard's writer thread).

    Threads: any number of callers at once (the storage tier's readers and writers). A write
    batch is split by shard and each part handed to its shard's writer thread; the caller waits
    for all of them (the values may be views of its staging buffer). Each shard's own locks are
    in :class:`LMDBShard`. A read takes the read transactions of the shards it touches in shard
    order (a map resize holds one shard's lock alone and nothing else: no cycle). ``_cause``:
    thread-local, why this thread's latest write failed (:meth:`write_error`).
    """

    name = "lmdb"
    direct_reads = True  # values are read as views into the map and copied once, GIL released

    @property
    def writes_parts(self) -> bool:  # (StorageBackend.writes_parts) value files pwritev a value's parts
        return self.config.value_files and not any(s.handles.writemap for s in self.shards)

    def __init__(self, config: LMDBConfig) -> None:
        self.config = config
        keep_freed_memory(config.malloc_keep_mb)  # process-wide, once (hicache.tiers.lmdb.malloc)
        self.shards: list[LMDBShard] = []
        try:
            for cfg in shard_configs(config):
                self.shards.append(LMDBShard(cfg))
        except BaseException:
            for shard in self.shards:
                shard.close()
            raise
        n = len(self.shards)
        self._writers = [ThreadPoolExecutor(1, thread_name_prefix=f"hicache-lmdb-shard{i}") for i in range(n)] \
            if n > 1 else []
        self._cause = threading.local()
        self.shared = config.shared  # (StorageBackend.shared) a private directory unless configured so

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | LMDBConfig) -> LMDBStore:
        return cls(config if isinstance(config, LMDBConfig) else LMDBConfig.from_mapping(config))

    @property
    def capacity(self) -> int:
        return sum(s.capacity for s in self.shards)

    @property
    def handles(self) -> LMDBHandles:
        """The environment of a one-shard store (tests and benches that reach LMDB itself)."""
        if len(self.shards) != 1:
            raise AttributeError(f"a store of {len(self.shards)} shards has one environment per shard: "
                                 "use shard_for(key).handles")
        return self.shards[0].handles

    def shard_index(self, key: str) -> int:
        return shard_of(key.encode(), len(self.shards))

    def shard_for(self, key: str) -> LMDBShard:
        return self.shards[self.shard_index(key)]

    # ------------------------------------------------------------------ reads
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str) -> bytes | None:
        return self.batch_get([key])[0]

    def get_array(self, key: str) -> np.ndarray | None:
        def run(get):
            val = get(0)  # a view into the map, valid in txn
            if val is None:
                return None
            out = np.empty(len(val), dtype=np.uint8)
            np.copyto(out, np.frombuffer(val, dtype=np.uint8))  # the GIL released for the copy
            return out

        out = self._read([key], run, buffers=True)
        if out is not None:
            self._touch([key])
        return out

    def batch_exists(self, keys: Sequence[str]) -> int:
        def run(get):
            n = 0
            for i in range(len(keys)):
                if get(i) is None:
                    break
                n += 1
            return n

        n = self._read(keys, run, buffers=True)
        return 0 if n is None else n

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        out = self._read(keys, lambda get: [get(i) for i in range(len(keys))])
        if out is None:
            return [None] * len(keys)
        self._touch([k for k, v in zip(keys, out, strict=True) if v is not None])
        return out

    def batch_get_into(
        self, keys: Sequence[str], buf: StagingBuffer, spans: Sequence[tuple[int, int]]
    ) -> list[int]:
        same_len(keys, spans)

        def run(get):
            res = []
            for i, (off, size) in enumerate(spans):
                val = get(i)  # a view into the map, valid in txn
                if val is None:
                    res.append(MISSING)
                elif len(val) > size:
                    res.append(TOO_LARGE)
                else:
                    buf.view(off, len(val))[:] = val
                    res.append(len(val))
            return res

        out = self._read(keys, run, buffers=True)
        if out is None:
            return [ERROR] * len(keys)
        self._touch([k for k, r in zip(keys, out, strict=True) if r >= 0])
        return out

    def batch_get_pages(self, keys: Sequence[str], dsts: Sequence[Any], trailers: Any,
                        copy: PageCopy | None = None, other: PageCopy | None = None) -> list[int]:
        same_len(keys, dsts)
        t = trailers.shape[1]

        def run(get):
            res, srcs, idx, vals, odd = [], [], [], [], []
            for i in range(len(keys)):
                val = get(i)  # a view into the map, valid in txn
                if val is None:
                    res.append(MISSING)
                    continue
                n = len(dsts[i])
                if len(val) == n + t:
                    src = np.frombuffer(val, dtype=np.uint8)
                    trailers[i] = src[n:]
                    srcs.append(src[:n])
                    idx.append(i)
                elif other is not None:
                    vals.append(np.frombuffer(val, dtype=np.uint8))
                    odd.append(i)
                res.append(len(val))
            if copy is not None:  # one copy, map -> L2 page, for all of them at once (GIL released)
                copy(srcs, idx)
            else:
                copy_each(srcs, [dsts[i] for i in idx])
            if vals:  # (other) while the views are valid
                other(vals, odd)
            return res

        out = self._read(keys, run, buffers=True)
        if out is None:
            return [ERROR] * len(keys)
        self._touch([k for k, r in zip(keys, out, strict=True) if r >= 0])
        return out

    # ------------------------------------------------------------------ writes
    def set(self, key: str, value: Buffer) -> bool:
        return self.batch_set([key], [value])[0]

    def write_error(self) -> str | None:
        return getattr(self._cause, "text", None)

    def batch_set_parts(self, keys: Sequence[str], parts: Sequence[Sequence[Buffer]]) -> list[bool]:
        """As :meth:`batch_set`, each value given as its parts: with ``value_files`` written as they are
        (``pwritev``), else joined into LMDB's value."""
        return self.batch_set(keys, [tuple(p) for p in parts])

    def batch_set(self, keys: Sequence[str], values: Sequence[Buffer | Value]) -> list[bool]:
        same_len(keys, values)
        self._cause.text = None
        ok = [False] * len(keys)
        parts: dict[int, tuple[list[int], list[tuple[bytes, Buffer | Value]]]] = {}
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            kb = k.encode()
            s = shard_of(kb, len(self.shards))
            if self.shards[s].fits(kb, value_len(v)):
                idx, items = parts.setdefault(s, ([], []))
                idx.append(i)
                items.append((kb, v))
            elif self._cause.text is None:
                self._cause.text = "an empty key, a key over 500 bytes or a value over the low watermark is not stored"
        if len(self.shards) == 1:
            causes = {s: self.shards[s].store(items) for s, (_, items) in parts.items()}
        else:  # every part on its shard's writer thread, all at once
            futures = {s: self._writers[s].submit(self.shards[s].store, items) for s, (_, items) in parts.items()}
            causes = {s: f.result() for s, f in futures.items()}
        for s, (idx, _) in sorted(parts.items()):
            if causes[s] is None:
                for i in idx:
                    ok[i] = True
            elif self._cause.text is None:
                self._cause.text = causes[s]
        return ok

    def delete(self, key: str) -> bool:
        kb = key.encode()
        return self.shards[shard_of(kb, len(self.shards))].delete(kb)

    def batch_delete(self, keys: Sequence[str]) -> int:
        """One write transaction per shard touched, each on its shard's writer thread (behind the
        writes handed to it before)."""
        parts: dict[int, list[bytes]] = {}
        for k in keys:
            kb = k.encode()
            parts.setdefault(shard_of(kb, len(self.shards)), []).append(kb)
        if len(self.shards) == 1:
            return sum(self.shards[s].delete_many(kbs) for s, kbs in parts.items())
        futures = [self._writers[s].submit(self.shards[s].delete_many, kbs) for s, kbs in parts.items()]
        return sum(f.result() for f in futures)

    def clear(self) -> None:
        for shard in self.shards:
            shard.clear()

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for st in (s.stats() for s in self.shards):
            for k, v in st.items():
                out[k] = -1 if v < 0 or out.get(k, 0) < 0 else out.get(k, 0) + v
        out["shards"] = len(self.shards)
        return out

    def check_integrity(self) -> dict[str, int]:
        """Raise AssertionError unless every shard's databases agree with each other and its
        ``used`` (:meth:`LMDBShard.check`) and hold only keys of that shard; returns the totals
        (entries, used_bytes), which equal what :meth:`stats` reports."""
        total = {"entries": 0, "used_bytes": 0}
        n = len(self.shards)
        for i, shard in enumerate(self.shards):
            got = shard.check(lambda kb, i=i: shard_of(kb, n) == i)
            for k in total:
                total[k] += got[k]
        assert total["used_bytes"] <= self.capacity, f"LMDB: {total['used_bytes']} bytes held over {self.capacity}"
        return total

    def close(self) -> None:
        for w in self._writers:
            w.shutdown(wait=True)
        for shard in self.shards:
            shard.close()

    # ------------------------------------------------------------------ internals
    def _touch(self, keys: list[str]) -> None:
        """Remember the keys a read hit, in their shards (the next write there re-stamps them)."""
        if len(self.shards) == 1:
            self.shards[0].acct.touch(keys)
            return
        parts: dict[int, list[str]] = {}
        for k in keys:
            parts.setdefault(self.shard_index(k), []).append(k)
        for s, ks in parts.items():
            self.shards[s].acct.touch(ks)

    def _read(self, keys: Sequence[str], fn: Callable[[Callable[[int], Any]], Any], buffers: bool = False):
        """Run ``fn(get)`` with a read transaction open in every shard ``keys`` touch (``get(i)``:
        key ``i``'s value, a view with ``buffers``, or None); None (an error counted) on an LMDB
        failure."""
        n = len(self.shards)
        idx = [shard_of(k.encode(), n) for k in keys]
        touched = sorted(set(idx)) or [0]
        try:
            with ExitStack() as stack:
                txns = {s: stack.enter_context(self.shards[s].txn(buffers)) for s in touched}
                enc = [k.encode() for k in keys]
                return fn(lambda i: self.shards[idx[i]].value(txns[idx[i]], enc[i], buffers))
        except lmdb.Error:
            self.shards[touched[0]].acct.count("errors")
            return None
