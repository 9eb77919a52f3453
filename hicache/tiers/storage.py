"""The storage tier (L3): page values with a verified header, moved between a host pool and a
raw-bytes :class:`~hicache.tiers.base.StorageBackend`; and the registry of backends.

Value format (version 1), one value per page, independent of the host pool's layout (a
``layer_first`` server and a ``page_first`` server share values)::

    header (64 bytes, little-endian)                       payload (page_nbytes)
    magic "HCKV" | version u16 | dtype u16 |               the page's K and V of every layer in
    rows u32 (2*layers) | page_size u32 | kv_heads u32 |   device order: [2 * layers, page_size,
    head_dim u32 | payload_nbytes u64 | crc32 u32 |        kv_heads, head_dim], in the dtype
    key digest 16 bytes | zero padding

A value is served only if every header field matches what this tier expects, the key
digest is the key it was read under, and the payload's CRC-32 matches. Anything else is
counted as ``corrupt`` and treated as a miss; the bad value is deleted so that a later
write can replace it.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from hicache.tiers.base import TOO_LARGE, StagingBuffer, StorageBackend
from hicache.tiers.device import KVLayout
from hicache.tiers.host import HostKVPool
from hicache.tiers.lmdb_store import LMDBStore
from hicache.tiers.mooncake_store import MooncakeStore

FORMAT_VERSION = 1
MAGIC = b"HCKV"
HEADER_SIZE = 64
_HEADER = struct.Struct("<4sHHIIIIQI16s12x")  # 52 bytes of fields, zero-padded to HEADER_SIZE
_DTYPE_CODES = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float8_e4m3fn: 4,
    torch.float8_e5m2: 5,
    torch.float64: 6,
}


def _key_digest(key: str) -> bytes:
    try:
        raw = bytes.fromhex(key)
    except ValueError:
        raw = b""
    return raw if len(raw) == 16 else hashlib.blake2b(key.encode(), digest_size=16).digest()


class PageCodec:
    """Header encoding / verification for pages of one :class:`KVLayout` and page size."""

    def __init__(self, layout: KVLayout, page_size: int) -> None:
        if layout.dtype not in _DTYPE_CODES:
            raise ValueError(f"no storage format for dtype {layout.dtype}")
        self.layout = layout
        self.page_size = page_size
        self.page_nbytes = layout.bytes_per_token() * page_size
        self.value_nbytes = HEADER_SIZE + self.page_nbytes
        self._fields = (
            MAGIC,
            FORMAT_VERSION,
            _DTYPE_CODES[layout.dtype],
            2 * layout.num_layers,
            page_size,
            layout.num_kv_heads,
            layout.head_dim,
            self.page_nbytes,
        )

    def pack_into(self, buf, offset: int, key: str, payload) -> None:
        """Write the header of ``payload`` (a buffer of ``page_nbytes``) at ``buf[offset:]``."""
        _HEADER.pack_into(buf, offset, *self._fields, zlib.crc32(payload), _key_digest(key))

    def encode(self, key: str, payload: bytes) -> bytes:
        """A whole value (header + payload) as bytes; for tests and tools."""
        if len(payload) != self.page_nbytes:
            raise ValueError(f"payload of {len(payload)} bytes, expected {self.page_nbytes}")
        out = bytearray(self.value_nbytes)
        out[HEADER_SIZE:] = payload
        self.pack_into(out, 0, key, payload)
        return bytes(out)

    def verify(self, value, key: str) -> bool:
        """Whether ``value`` (header + payload, exactly ``value_nbytes``) is a good page for ``key``."""
        if len(value) != self.value_nbytes:
            return False
        fields = _HEADER.unpack_from(value, 0)
        if fields[:8] != self._fields or fields[9] != _key_digest(key):
            return False
        return zlib.crc32(value[HEADER_SIZE:]) == fields[8]


class StorageTier:
    """Moves pages between a :class:`HostKVPool` and a :class:`StorageBackend`, framing
    each page with a verified header (see the module docstring).

    Contract:
    - Thread-safe: the controller's background threads may call concurrently (each
      thread has its own staging buffer; counters are locked). The host pages named in a
      call must not be written by anyone else during it (the tree hands out disjoint pages).
    - Never raises because of the store (backends turn failures into misses); raises
      ``ValueError`` for a pool of another layout / page size, or mismatched lengths.
    - ``batch_get`` writes host pages ``host_pages[:n]`` only (``n`` the returned count);
      pages past ``n`` are left untouched for the caller to free.
    - Stats (pages): ``hits`` loaded and verified, ``misses`` asked for and not loaded,
      ``corrupt`` rejected by the header check, ``stored`` / ``store_failed`` by batch_set,
      ``bytes_read`` / ``bytes_written`` (values, headers included); plus the backend's
      own stats under ``backend.*`` (``errors`` among them).
    """

    def __init__(
        self,
        backend: StorageBackend,
        layout: KVLayout,
        page_size: int,
        max_batch_pages: int = 64,
        staging_bytes: int = 64 << 20,
    ) -> None:
        self.backend = backend
        self.codec = PageCodec(layout, page_size)
        self.layout = layout
        self.page_size = page_size
        # Slots are 64-byte aligned so that payloads view cleanly as the KV dtype.
        self.slot = (self.codec.value_nbytes + 63) // 64 * 64
        self.batch_pages = max(1, min(max_batch_pages, staging_bytes // self.slot))
        self._local = threading.local()
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(
            ("hits", "misses", "corrupt", "stored", "store_failed", "bytes_read", "bytes_written"), 0
        )

    # ------------------------------------------------------------------ API
    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many leading keys are in the store (not verified: a later get may still reject)."""
        return self.backend.batch_exists(list(keys)) if keys else 0

    def batch_get(self, keys: Sequence[str], host_pool: HostKVPool, host_pages: Sequence[int]) -> int:
        """Load the values of ``keys`` into host pages ``host_pages`` (same length), in order.

        Returns how many leading pages were loaded and verified; stops at the first miss or
        corrupt value.
        """
        self._check(keys, host_pool, host_pages)
        codec, slot, done = self.codec, self.slot, 0
        H, nb = HEADER_SIZE, codec.page_nbytes
        for lo in range(0, len(keys), self.batch_pages):
            ck = list(keys[lo : lo + self.batch_pages])
            n = len(ck)
            buf = self._staging()
            sizes = self.backend.batch_get_into(ck, buf, [(i * slot, slot) for i in range(n)])
            ok, corrupt = 0, None
            for i, size in enumerate(sizes):
                if size < 0 and size != TOO_LARGE:  # missing / error: a plain miss
                    break
                if size != codec.value_nbytes or not codec.verify(buf.view(i * slot, size), ck[i]):
                    corrupt = ck[i]
                    break
                ok += 1
            if ok:
                rows = buf.tensor[: ok * slot].view(ok, slot)[:, H : H + nb]
                kv = rows.view(self.layout.dtype).view(ok, 2 * self.layout.num_layers, -1)
                ids = torch.tensor(list(host_pages[lo : lo + ok]), dtype=torch.long)
                host_pool.write_pages(ids, kv.transpose(0, 1))
            done += ok
            with self._lock:
                self._stats["bytes_read"] += ok * codec.value_nbytes
                if corrupt is not None:
                    self._stats["corrupt"] += 1
            if corrupt is not None:
                self.backend.delete(corrupt)
            if ok < n:
                break
        with self._lock:
            self._stats["hits"] += done
            self._stats["misses"] += len(keys) - done
        return done

    def batch_set(self, keys: Sequence[str], host_pool: HostKVPool, host_pages: Sequence[int]) -> int:
        """Store host pages ``host_pages`` under ``keys`` (same length), in order.

        Returns how many leading pages were stored; stops at the first failure (later
        pages would be unreachable for a prefix lookup anyway).
        """
        self._check(keys, host_pool, host_pages)
        codec, slot, done = self.codec, self.slot, 0
        H, nb = HEADER_SIZE, codec.page_nbytes
        rows = 2 * self.layout.num_layers
        for lo in range(0, len(keys), self.batch_pages):
            ck = list(keys[lo : lo + self.batch_pages])
            n = len(ck)
            buf = self._staging()
            ids = torch.tensor(list(host_pages[lo : lo + n]), dtype=torch.long)
            kv = host_pool.read_pages(ids)  # [2L, n, X]
            dst = buf.tensor[: n * slot].view(n, slot)[:, H : H + nb].view(self.layout.dtype)
            dst.view(n, rows, -1).copy_(kv.transpose(0, 1))
            for i in range(n):
                off = i * slot
                codec.pack_into(buf.array, off, ck[i], buf.view(off + H, nb))
            res = self.backend.batch_set_from(ck, buf, [(i * slot, codec.value_nbytes) for i in range(n)])
            ok = 0
            for r in res:
                if not r:
                    break
                ok += 1
            done += ok
            with self._lock:
                self._stats["bytes_written"] += ok * codec.value_nbytes
            if ok < n:
                break
        with self._lock:
            self._stats["stored"] += done
            self._stats["store_failed"] += len(keys) - done
        return done

    def stats(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = dict(self._stats)
        out.update({f"backend.{k}": v for k, v in self.backend.stats().items()})
        return out

    def close(self) -> None:
        self.backend.close()

    # ------------------------------------------------------------------ internals
    def _check(self, keys: Sequence[str], pool: HostKVPool, pages: Sequence[int]) -> None:
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys but {len(pages)} host pages")
        if pool.layout != self.layout or pool.page_size != self.page_size:
            raise ValueError(
                f"host pool of {pool.layout} / page size {pool.page_size} does not match the "
                f"storage tier's {self.layout} / {self.page_size}"
            )

    def _staging(self) -> StagingBuffer:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.busy:  # busy: an abandoned transfer may still write into it
            buf = self._local.buf = StagingBuffer(self.batch_pages * self.slot)
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
