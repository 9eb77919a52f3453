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

The layout digest names the tensors' shapes and dtypes, so a value of another model shape is never
served. A value is served only if its size, every trailer field, the key digest (the key it was read
under) and the payload's XXH3-64 match; anything else is counted ``state_corrupt``, deleted (so a later
write can replace it) and is a miss: the prefix is recomputed, never resumed from a wrong state.
"""

from __future__ import annotations

import logging
import struct
import threading
from collections.abc import Sequence

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

    def encode(self, key: str, payload: bytes) -> bytes:
        """The value of ``payload`` (``payload_nbytes``) under ``key``: payload + trailer."""
        if len(payload) != self.payload_nbytes:
            raise ValueError(f"a state payload of {len(payload)} bytes, expected {self.payload_nbytes}")
        trailer = bytearray(TRAILER_SIZE)
        _TRAILER.pack_into(trailer, 0, *self._fields, xxh3_64(payload), key_digest(key))
        return bytes(payload) + bytes(trailer)

    def decode(self, key: str, value) -> bytes | None:
        """The payload of ``value`` read under ``key``, or None unless it is a good snapshot value."""
        if value is None or len(value) != self.value_nbytes:
            return None
        mv = memoryview(value).cast("B")
        payload, trailer = mv[: self.payload_nbytes], mv[self.payload_nbytes :]
        fields = _TRAILER.unpack_from(trailer, 0)
        if fields[:5] != self._fields or fields[6] != key_digest(key) or xxh3_64(payload) != fields[5]:
            return None
        return bytes(payload)


class StateStore:
    """Snapshots on one :class:`StorageBackend` (see the module docstring), under the state keys of
    their page keys.

    Concurrency contract: thread-safe (the backend is; the counters are locked). The write-back's writer
    threads call :meth:`put`, the prefetcher's lookup threads :meth:`find_deepest`; neither touches
    the tree. Never raises because of the store (the backend's misses and failures are misses).
    """

    def __init__(self, backend: StorageBackend, layout: StateLayout) -> None:
        self.backend = backend
        self.codec = StateCodec(layout)
        self._lock = threading.Lock()
        self._warn = RateLimitedLog(log)
        self._stats = dict.fromkeys(("state_hits", "state_misses", "state_corrupt", "state_stored",
                                     "state_store_failed"), 0)

    def put(self, page_key: str, payload: bytes) -> bool:
        """Store the snapshot after the page whose key is ``page_key``; True when L3 holds it (now or
        already: equal keys mean equal values)."""
        key = state_key(page_key)
        if self.backend.exists(key):
            return True
        ok = self.backend.set(key, self.codec.encode(key, payload))
        self._count("state_stored" if ok else "state_store_failed")
        return ok

    def find_deepest(self, page_keys: Sequence[str]) -> tuple[int, bytes] | None:
        """The deepest good snapshot after one of ``page_keys`` (consecutive pages): ``(i + 1,
        payload)`` for the one after ``page_keys[i]``, or None. Deepest first; a corrupt one is a miss
        (deleted) and the search goes on above it."""
        for i in range(len(page_keys) - 1, -1, -1):
            key = state_key(page_keys[i])
            if not self.backend.exists(key):
                continue
            payload = self.codec.decode(key, self.backend.get(key))
            if payload is not None:
                self._count("state_hits")
                return i + 1, payload
            self._count("state_corrupt")
            self._warn.warning("state_corrupt", "L3: the state snapshot %s failed its check (corrupt or short); "
                               "deleted, and its prefix is recomputed", key)
            self.backend.delete(key)
        if page_keys:
            self._count("state_misses")
        return None

    def _count(self, name: str) -> None:
        with self._lock:
            self._stats[name] += 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats)
