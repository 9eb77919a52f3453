"""Contracts of the storage tier (L3): the raw-bytes :class:`StorageBackend` and its staging memory.

A backend stores opaque byte values under string keys (page keys from
:mod:`hicache.keys`). It knows nothing about pages, headers or pools: that is the job of
:class:`hicache.tiers.storage.StorageTier`, which frames every value with a verified
header and moves pages between a host pool and a backend.

Contract of every backend (the cache controller calls it from a background thread):

- **Never raises on the data path** because of the store: an unreachable, slow, full or
  failing store turns into misses / ``False`` and is counted in ``stats()["errors"]``
  (or ``"unavailable"`` for calls refused while a backend knows it is down). Only
  programming errors raise (``ValueError`` for mismatched argument lengths, bad spans).
- **Bounded time**: a backend that talks to a remote store bounds every call with a
  timeout; an abandoned call never writes into memory the caller may reuse (see
  :class:`StagingBuffer`).
- **Thread-safety**: any number of reader and writer threads may call concurrently
  (backends serialise internally where they must: LMDB commits one write at a time).
- **Mutation**: ``set``/``batch_set*``/``delete``/``clear`` mutate the store; every other
  method only reads it (a backend may update its own bookkeeping, e.g. recency).
- **Opening**: the constructor raises :class:`StorageOpenError` (one line: the file, what is
  wrong, what to do) for a store that exists but cannot be opened (a damaged header).
- **Failed writes say why**: after a ``batch_set*`` that stored less than asked,
  :meth:`StorageBackend.write_error` gives the cause in words, for the log.
- ``set`` on an existing key may keep the old value (Mooncake does): equal keys mean
  equal values, so callers never rely on overwriting; a value found corrupt is deleted
  (``delete``) before it is written again.
- **Shared or private**: :attr:`StorageBackend.shared` says whether other servers may read this
  store's pages (True by default: a backend that does not say is treated as shared). Only a
  private store's pages are deleted by the exclusive tiers when a hit moves them up to L2
  (hicache/hiradix/exclusive.py); a shared one (Mooncake, an LMDB directory several servers use)
  keeps every page it holds.
- **Deletes are ordered with writes per key by the caller**: a ``batch_delete`` and a write of
  the same key are never in flight at once (serving/cache/l3_promote.py's key guard), so a
  backend needs no ordering of its own between them.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

Buffer = Any  # bytes-like: bytes, bytearray, memoryview, a contiguous numpy uint8 array

# Per-key status codes of StorageBackend.batch_get_into (a size >= 0 means "read").
MISSING = -1  # no such key
ERROR = -2  # the store failed / timed out / is unavailable (counted in stats["errors"])
TOO_LARGE = -3  # the value does not fit its span (the caller treats it as corrupt)
# ``copy(srcs, idx)`` of :meth:`StorageBackend.batch_get_pages`: copy ``srcs[k]`` into the
# caller's ``dsts[idx[k]]``, all in one call (the storage tier copies and hashes them at once).
PageCopy = Callable[[list[Any], list[int]], None]


class StorageOpenError(RuntimeError):
    """A backend's store exists but cannot be opened (e.g. a damaged LMDB header). The message
    is one line naming the file, what is wrong and what to do; a server prints it and exits."""


class StagingBuffer:
    """Host memory owned by a :class:`~hicache.tiers.storage.StorageTier` that backends
    read from / write into directly (Mooncake registers it for zero-copy transfers).

    ``in_flight`` counts backend operations still using the memory. A backend that
    gives up waiting on an operation (timeout) leaves it counted until the operation
    really ends; the owner must not reuse a buffer while ``busy`` (it takes a fresh one),
    so a late transfer can never land in memory that holds something else by then.
    """

    def __init__(self, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        self.tensor = torch.empty(nbytes, dtype=torch.uint8)  # 64-byte aligned
        self.array = self.tensor.numpy()  # same memory, for the buffer protocol
        self.ptr = self.tensor.data_ptr()
        self.nbytes = nbytes
        self._lock = threading.Lock()
        self._in_flight = 0

    def acquire(self) -> None:
        with self._lock:
            self._in_flight += 1

    def release(self) -> None:
        with self._lock:
            self._in_flight -= 1

    @property
    def busy(self) -> bool:
        return self._in_flight > 0

    def view(self, offset: int, size: int):
        """A writable numpy view of ``[offset, offset + size)``."""
        if offset < 0 or size < 0 or offset + size > self.nbytes:
            raise ValueError(f"span ({offset}, {size}) outside a buffer of {self.nbytes} bytes")
        return self.array[offset : offset + size]


class StorageBackend(ABC):
    """Raw-bytes key/value store of the L3 tier. See the module docstring for the contract.

    Subclasses implement the single-key methods, ``clear`` and ``stats``; the batch forms
    default to loops over them and should be overridden where the store has real batch
    calls (one transaction, one round trip).
    """

    name: str = "abstract"
    # Whether other servers may read this store's pages (see the module docstring): a shared
    # store's pages are never deleted because this server moved them up to L2.
    shared: bool = True
    # Whether :meth:`batch_set_parts` writes a value from its parts without joining them first
    # (the storage tier then hands it each L2 page and its trailer: hicache.tiers.storage_write).
    writes_parts: bool = False

    # ------------------------------------------------------------------ single key
    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether ``key`` holds a value (False when the store is unreachable)."""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value of ``key``, or None when missing or on a store failure."""

    @abstractmethod
    def set(self, key: str, value: Buffer) -> bool:
        """Store ``value`` under ``key``; False when it could not be stored."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``; True when a value was removed."""

    @abstractmethod
    def clear(self) -> None:
        """Remove every value this backend owns (its whole store / key prefix)."""

    @abstractmethod
    def stats(self) -> dict[str, float]:
        """Counters and gauges: at least ``errors``; plain numbers only (JSON-able)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources; the backend must not be used afterwards."""

    def write_error(self) -> str | None:
        """Why this thread's latest ``batch_set*`` stored less than asked, in words (e.g. "no
        space left on device (ENOSPC) on the file system of /data/l3"); None when unknown."""
        return None

    # ------------------------------------------------------------------ batches
    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many leading keys of ``keys`` hold a value (stops at the first absent one)."""
        n = 0
        for k in keys:
            if not self.exists(k):
                break
            n += 1
        return n

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self.get(k) for k in keys]

    def get_array(self, key: str) -> np.ndarray | None:
        """The value of ``key`` as a uint8 array (one copy out of the store), or None. A backend that can
        copies it with the GIL released: a large value read beside the scheduler's loop (a state snapshot)
        must not hold the GIL for the copy as ``bytes`` does."""
        val = self.get(key)
        return None if val is None else np.frombuffer(val, dtype=np.uint8)

    def batch_set(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        same_len(keys, values)
        return [self.set(k, v) for k, v in zip(keys, values, strict=True)]

    def batch_delete(self, keys: Sequence[str]) -> int:
        """Remove ``keys`` (absent ones are skipped); returns how many values were removed."""
        return sum(bool(self.delete(k)) for k in keys)

    # ------------------------------------------------------------------ zero-copy batches
    def batch_get_into(
        self, keys: Sequence[str], buf: StagingBuffer, spans: Sequence[tuple[int, int]]
    ) -> list[int]:
        """Read each key's value into ``buf`` at its ``(offset, max_size)`` span.

        Returns per key the value's size (>= 0, bytes written at the span's start) or
        :data:`MISSING`, :data:`ERROR`, :data:`TOO_LARGE`. Bytes of a span past the
        value (or of a failed key) are undefined.
        """
        same_len(keys, spans)
        out = []
        for (off, size), val in zip(spans, self.batch_get(keys), strict=True):
            if val is None:
                out.append(MISSING)
            elif len(val) > size:
                out.append(TOO_LARGE)
            else:
                buf.view(off, len(val))[:] = memoryview(val).cast("B")
                out.append(len(val))
        return out

    # Backends that can copy a value straight out of their own memory (no staging) say so:
    # the storage tier then reads ``page_first`` pools through :meth:`batch_get_pages` on
    # several threads at once.
    direct_reads = False

    def batch_get_pages(self, keys: Sequence[str], dsts: Sequence[Any], trailers: Any,
                        copy: PageCopy | None = None, other: PageCopy | None = None) -> list[int]:
        """Copy each key's value into two places: its first ``len(dsts[i])`` bytes into the
        writable uint8 array ``dsts[i]``, the rest into row ``i`` of the uint8 array
        ``trailers`` (``[n, t]``). The payloads are copied by one call ``copy(srcs, idx)``
        (``srcs[k]``, a uint8 view of a payload, into ``dsts[idx[k]]``), made once per call
        while the views are valid; by default numpy copies them one by one. Returns per key
        the value's size, or :data:`MISSING` / :data:`ERROR`; a value whose size is not
        ``len(dsts[i]) + t`` is left uncopied and reported by its size, after one call
        ``other(vals, idx)`` (``vals[k]``: a uint8 view of key ``idx[k]``'s whole value, valid
        during the call) where given: the caller may take it otherwise."""
        same_len(keys, dsts)
        out: list[int] = []
        srcs, idx, vals, odd = [], [], [], []
        t = trailers.shape[1]
        for i, val in enumerate(self.batch_get(keys)):
            if val is None:
                out.append(MISSING)
                continue
            src = np.frombuffer(val, dtype=np.uint8)
            n = len(dsts[i])
            if len(src) == n + t:
                trailers[i][:] = src[n:]
                srcs.append(src[:n])
                idx.append(i)
            else:
                vals.append(src)
                odd.append(i)
            out.append(len(src))
        if copy is not None:
            copy(srcs, idx)
        else:
            copy_each(srcs, [dsts[i] for i in idx])
        if other is not None and vals:
            other(vals, odd)
        return out

    def batch_set_from(
        self, keys: Sequence[str], buf: StagingBuffer, spans: Sequence[tuple[int, int]]
    ) -> list[bool]:
        """Store each key's value, the bytes of ``buf`` at its ``(offset, size)`` span."""
        same_len(keys, spans)
        return self.batch_set(keys, [buf.view(off, size) for off, size in spans])

    def batch_set_parts(self, keys: Sequence[str], parts: Sequence[Sequence[Buffer]]) -> list[bool]:
        """Store each key's value, the concatenation of its parts (here joined, one copy; a backend with
        ``writes_parts`` writes them as they are)."""
        same_len(keys, parts)
        return self.batch_set(keys, [join(p) for p in parts])


def join(parts: Sequence[Buffer]) -> np.ndarray:
    """The parts of a value as one contiguous uint8 array (one copy)."""
    return np.concatenate([np.frombuffer(memoryview(p).cast("B"), dtype=np.uint8) for p in parts])


def copy_each(srcs: Sequence[Any], dsts: Sequence[Any]) -> None:
    """Numpy copies, one per page: what :meth:`StorageBackend.batch_get_pages` does without a ``copy``."""
    for s, d in zip(srcs, dsts, strict=True):
        np.copyto(d, s)


def same_len(a: Sequence, b: Sequence) -> None:
    if len(a) != len(b):
        raise ValueError(f"{len(a)} keys but {len(b)} values/spans")
