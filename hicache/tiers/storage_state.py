"""Recurrent-state snapshots on the storage tier (L3): one value per snapshot, verified on read.

A model with state layers (linear attention, Mamba2) keeps, besides each page's KV, snapshots of its
state at page boundaries (hicache/hiradix/state_snapshots.py). The snapshot after page ``k`` of a
sequence is stored under :func:`hicache.keys.state_key` of page ``k``'s key (a function of the prefix and
the namespace, like the page keys). Value format (version 1), as a page value's (hicache/tiers/page_codec.py):
payload first, then a 64-byte trailer, little-endian::

    payload (bytes_per_slot)                      trailer (64 bytes)
    every tensor of every state layer, in         magic "HCST" | version u16 | 0 u16 | layout digest u64 |
    StateLayout order (HostStatePool.slot_bytes)  payload_nbytes u64 | xxh3_64 u64 | key digest 16 bytes |
                                                  zero padding

Under tensor parallelism (``parts`` > 1) each rank holds its own heads' share of a snapshot and stores it
as its own value, as it stores its part of each page (per-rank entries): part ``r`` of ``parts`` under
:func:`part_key` (a hash of the state key and ``r/parts``, for every part, rank 0's too, so a TP=1 value
and a TP=2 part never share a key even where the pages' keys coincide). A snapshot is on L3 only when
every part is: :meth:`StateStore.find_deepest` of a ``parts`` > 1 store answers every part's payload.

The layout digest names the tensors' shapes and dtypes, so a value of another model shape is never
served. A value is served only if its size, every trailer field, the key digest (the key it was read
under) and the payload's XXH3-64 match; anything else is counted ``state_corrupt``, deleted (so a later
write can replace it) and is a miss: the prefix is recomputed, never resumed from a wrong state.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
from collections.abc import Sequence

import numpy as np

from hicache.keys import state_key
from hicache.ratelimited_log import RateLimitedLog
from hicache.tiers.base import StorageBackend
from hicache.tiers.native_hash import xxh3_64
from hicache.tiers.page_codec import TRAILER_SIZE, key_digest
from hicache.tiers.state_layout import StateLayout

MAGIC = b"HCST"
FORMAT_VERSION = 1
_TRAILER = struct.Struct("<4sHHQQQ16s")  # 48 bytes of fields, zero-padded to TRAILER_SIZE
log = logging.getLogger("hicache.storage")


def part_key(page_key: str, part: int = 0, parts: int = 1) -> str:
    """The L3 key of part ``part`` of ``parts`` of the snapshot after the page whose key is ``page_key``:
    ``state_key(page_key)`` when whole (``parts`` == 1), else a hash of it and ``"<part>/<parts>"``."""
    if not 0 <= part < parts:
        raise ValueError(f"part {part} of {parts}")
    key = state_key(page_key)
    if parts == 1:
        return key
    h = hashlib.blake2b(bytes.fromhex(key), digest_size=16, person=b"hicache-tpstate")
    h.update(f"{part}/{parts}".encode())
    return h.hexdigest()


class StateParts(tuple):
    """Every tensor-parallel rank's payload of one snapshot, rank order (what a ``parts`` > 1 store finds)."""


def layout_digest(layout: StateLayout) -> int:
    """XXH3-64 of the layout's description (per layer: each tensor's name, shape, dtype)."""
    desc = ";".join(",".join(f"{t.name}{list(t.shape)}{t.dtype}" for t in layer) for layer in layout.layers)
    return xxh3_64(desc.encode())


class StateCodec:
    """Trailer encoding / verification of snapshot values of one :class:`StateLayout`."""

    def __init__(self, layout: StateLayout) -> None:
        self.payload_nbytes = layout.bytes_per_slot()
        self.value_nbytes = self.payload_nbytes + TRAILER_SIZE
        self._fields = (MAGIC, FORMAT_VERSION, 0, layout_digest(layout), self.payload_nbytes)

    def encode(self, key: str, payload) -> np.ndarray:  # noqa: ANN001 - any bytes-like object
        """The value of ``payload`` (``payload_nbytes``) under ``key``: payload + trailer, one new array."""
        src = np.frombuffer(payload, dtype=np.uint8)
        if src.size != self.payload_nbytes:
            raise ValueError(f"a state payload of {src.size} bytes, expected {self.payload_nbytes}")
        value = np.empty(self.value_nbytes, dtype=np.uint8)
        np.copyto(value[: self.payload_nbytes], src)
        self.seal(key, value)
        return value

    def seal(self, key: str, value: np.ndarray) -> None:
        """Write the trailer of ``value`` (``value_nbytes``: its payload filled in, then room for the trailer)
        under ``key`` in place. The payload's hash runs with the GIL released; nothing is copied."""
        payload = value[: self.payload_nbytes]
        _TRAILER.pack_into(value, self.payload_nbytes, *self._fields, xxh3_64(payload), key_digest(key))
        value[self.payload_nbytes + _TRAILER.size :] = 0

    def decode(self, key: str, value) -> np.ndarray | None:  # noqa: ANN001 - bytes-like or None
        """The payload of ``value`` read under ``key`` (a view of it, no copy), or None unless it is a good
        snapshot value."""
        if value is None:
            return None
        arr = np.frombuffer(value, dtype=np.uint8)
        if arr.size != self.value_nbytes:
            return None
        payload = arr[: self.payload_nbytes]
        fields = _TRAILER.unpack_from(arr, self.payload_nbytes)
        if fields[:5] != self._fields or fields[6] != key_digest(key) or xxh3_64(payload) != fields[5]:
            return None
        return payload


class StateStore:
    """Snapshots on one :class:`StorageBackend` (see the module docstring), under the state keys of
    their page keys: this store writes part ``part`` of ``parts`` (a tensor-parallel rank's share; every
    part has the same layout) and finds snapshots whose every part is stored.

    Concurrency contract: thread-safe (the backend is; the counters are locked). The write-back's writer
    threads call :meth:`put`, the prefetcher's lookup threads :meth:`find_deepest`; neither touches
    the tree. Never raises because of the store (the backend's misses and failures are misses).
    """

    def __init__(self, backend: StorageBackend, layout: StateLayout, part: int = 0, parts: int = 1) -> None:
        part_key("00" * 16, part, parts)  # checks the part
        self.backend = backend
        self.part, self.parts = part, parts
        self.codec = StateCodec(layout)
        self._lock = threading.Lock()
        self._warn = RateLimitedLog(log)
        self._stats = dict.fromkeys(("state_hits", "state_misses", "state_corrupt", "state_stored",
                                     "state_store_failed"), 0)

    def put(self, page_key: str, payload) -> bool:  # noqa: ANN001 - any bytes-like object
        """Store the snapshot after the page whose key is ``page_key``; True when L3 holds it (now or
        already: equal keys mean equal values). This store's part."""
        key = part_key(page_key, self.part, self.parts)
        return self.backend.exists(key) or self._set(key, self.codec.encode(key, payload))

    def put_slot(self, page_key: str, pool, slot: int) -> bool:  # noqa: ANN001 (a HostStatePool)
        """:meth:`put` of L2 state slot ``slot`` of ``pool``: its bytes copied once, into the value itself
        (the trailer sealed in place), all with the GIL released -- writer threads run beside the
        scheduler's loop."""
        key = part_key(page_key, self.part, self.parts)
        if self.backend.exists(key):
            return True
        value = pool.slot_bytes(slot, tail=TRAILER_SIZE)
        self.codec.seal(key, value)
        return self._set(key, value)

    def _set(self, key: str, value: np.ndarray) -> bool:
        ok = self.backend.set(key, value)
        self._count("state_stored" if ok else "state_store_failed")
        return ok

    def find_deepest(self, page_keys: Sequence[str]) -> tuple[int, np.ndarray | StateParts] | None:
        """The deepest good snapshot after one of ``page_keys`` (consecutive pages): ``(i + 1,
        payload)`` for the one after ``page_keys[i]``, or None; the payload is a :class:`StateParts` of
        every part's when ``parts`` > 1. Deepest first; a snapshot with a corrupt part is a miss (the
        corrupt parts deleted) and the search goes on above it; one with a part missing is absent."""
        end = len(page_keys)
        while (depth := self.deepest_stored(page_keys[:end], count_miss=False)) is not None:
            payload = self.read(page_keys[depth - 1])
            if payload is not None:
                return depth, payload
            end = depth - 1
        if page_keys:
            self._count("state_misses")
        return None

    def deepest_stored(self, page_keys: Sequence[str], count_miss: bool = True) -> int | None:
        """``i + 1`` for the deepest of ``page_keys`` whose snapshot has every part stored (existence only:
        nothing read or verified; :meth:`read` does that), or None (a ``state_misses`` when ``count_miss``)."""
        for i in range(len(page_keys) - 1, -1, -1):
            if all(self.backend.exists(part_key(page_keys[i], r, self.parts)) for r in range(self.parts)):
                return i + 1
        if page_keys and count_miss:
            self._count("state_misses")
        return None

    def read(self, page_key: str) -> np.ndarray | StateParts | None:
        """The verified payload of the snapshot after the page whose key is ``page_key`` (every part's, a
        :class:`StateParts`, when ``parts`` > 1), or None: a part missing (gone since it was seen), or corrupt
        (counted, deleted)."""
        keys = [part_key(page_key, r, self.parts) for r in range(self.parts)]
        values = [self.backend.get_array(k) for k in keys]
        if any(v is None for v in values):
            return None
        payloads = [self.codec.decode(k, v) for k, v in zip(keys, values, strict=True)]
        if all(p is not None for p in payloads):
            self._count("state_hits")
            return payloads[0] if self.parts == 1 else StateParts(payloads)
        self._count("state_corrupt")
        for k, p in zip(keys, payloads, strict=True):
            if p is None:
                self._warn.warning("state_corrupt", "L3: the state snapshot %s failed its check (corrupt or "
                                   "short); deleted, and its prefix is recomputed", k)
                self.backend.delete(k)
        return None

    def _count(self, name: str) -> None:
        with self._lock:
            self._stats[name] += 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats)
