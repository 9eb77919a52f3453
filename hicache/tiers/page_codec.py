"""The format of L3 page values: payload first, then a verified trailer.

Value format (version 2), one value per page, independent of the host pool's layout (a
``layer_first`` server and a ``page_first`` server share values)::

    payload (page_nbytes)                          trailer (64 bytes, little-endian)
    the page's K and V of every layer in device    magic "HCKV" | version u16 | dtype u16 |
    order: [2 * layers, page_size, kv_heads,       rows u32 (2*layers) | page_size u32 |
    head_dim], in the dtype -- exactly one page    kv_heads u32 | head_dim u32 | payload_nbytes u64 |
    of a ``page_first`` host pool (or the page     xxh3_64 u64 | key digest 16 bytes | encoding u16 |
    encoded by ``hicache.tiers.kv_codec``)         flags u16 | zero padding

``flags`` bit 0 (``SLIDING_INVALID``): the page's sliding-window layers are stale, its full layers good (a
hybrid SWA L1 had dropped that page's window KV before its backup: hicache/tiers/window_pages.py); a
reader sets the L2 page's ``sliding_valid`` from it. Zero (every value before flags existed): all good.
Bit 1 (``SLIDING_OMITTED``, with bit 0): the page was stored without its sliding layers at all (an L2 with
a host window pool: hicache/tiers/storage_windows.py): the value is that of a model of the full layers only
(``rows``, ``payload_nbytes`` and the payload say so), smaller by the sliding layers' share.

``encoding`` is the lower-tier encoding of the payload (0 raw, 1 fp8, 2 int8; it took two
bytes of what was zero padding, so raw values keep the bytes they had before encodings existed);
a value of another encoding than the tier's fails the check: a miss, never garbage.

The payload comes first so that a read lands in its ``page_first`` L2 page with one copy and
no staging (the trailer goes to a side buffer). A value is served only if every trailer field
matches what this tier expects, the key digest is the key it was read under, and the
payload's XXH3-64 matches (XXH3 over CRC-32: measured 45 GB/s against zlib's 2.7 GB/s and
crc32c's 23 GB/s on one core; computed with the GIL released, :mod:`hicache.tiers.native_hash`,
so reader threads verify pages in parallel). Anything else is counted as ``corrupt`` and treated as a
miss; the bad value is deleted so that a later write can replace it. Values of format 1
(header first, CRC-32) fail the check: a miss, never garbage.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import torch

from hicache.tiers.device import KVLayout
from hicache.tiers.kv_codec import get_encoding
from hicache.tiers.native_hash import xxh3_64

FORMAT_VERSION = 2
MAGIC = b"HCKV"
TRAILER_SIZE = 64
_TRAILER = struct.Struct("<4sHHIIIIQQ16sHH4x")  # 60 bytes of fields, zero-padded to TRAILER_SIZE
SLIDING_INVALID = 1  # flags bit: the payload's sliding-window layers are stale (a hybrid SWA L1 had dropped them)
SLIDING_OMITTED = 2  # flags bit: the payload holds the full layers only (hicache/tiers/storage_windows.py)
_DTYPE_CODES = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float8_e4m3fn: 4,
    torch.float8_e5m2: 5,
    torch.float64: 6,
}


def key_digest(key: str) -> bytes:
    """The key's 16 bytes (page and state keys are 32 hex characters), as a value's trailer holds it."""
    try:
        raw = bytes.fromhex(key)
    except ValueError:
        raw = b""
    return raw if len(raw) == 16 else hashlib.blake2b(key.encode(), digest_size=16).digest()


def checksum(payload) -> int:
    return xxh3_64(payload)


class PageCodec:
    """Trailer encoding / verification for pages of one :class:`KVLayout`, page size and
    lower-tier encoding (``raw`` | ``fp8`` | ``int8``)."""

    def __init__(self, layout: KVLayout, page_size: int, encoding: str = "raw") -> None:
        if layout.dtype not in _DTYPE_CODES:
            raise ValueError(f"no storage format for dtype {layout.dtype}")
        self.layout = layout
        self.page_size = page_size
        self.encoding = get_encoding(encoding)
        self.page_nbytes = self.encoding.page_nbytes(layout, page_size)
        self.value_nbytes = self.page_nbytes + TRAILER_SIZE
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

    def pack_trailer_into(self, buf, offset: int, key: str, payload, flags: int = 0) -> None:
        """Write the trailer of ``payload`` (a buffer of ``page_nbytes``) at ``buf[offset:]``."""
        _TRAILER.pack_into(buf, offset, *self._fields, checksum(payload), key_digest(key), self.encoding.code, flags)

    def encode(self, key: str, payload: bytes) -> bytes:
        """A whole value (payload + trailer) as bytes; for tests and tools."""
        if len(payload) != self.page_nbytes:
            raise ValueError(f"payload of {len(payload)} bytes, expected {self.page_nbytes}")
        out = bytearray(self.value_nbytes)
        out[: self.page_nbytes] = payload
        self.pack_trailer_into(out, self.page_nbytes, key, payload)
        return bytes(out)

    def verify_parts(self, trailer, key: str, payload) -> bool:
        """Whether ``payload`` with ``trailer`` (``TRAILER_SIZE`` bytes) is a good page for ``key``."""
        if len(payload) != self.page_nbytes:
            return False
        return self.verify_hashed(trailer, key, checksum(payload))

    def verify_hashed(self, trailer, key: str, payload_hash: int) -> bool:
        """:meth:`verify_parts` for a payload of ``page_nbytes`` whose XXH3-64 is ``payload_hash``
        (computed while it was copied, :func:`~hicache.tiers.native_copy.copy_and_hash`)."""
        if len(trailer) != TRAILER_SIZE:
            return False
        fields = _TRAILER.unpack_from(trailer, 0)
        if fields[:8] != self._fields or fields[9] != key_digest(key) or fields[10] != self.encoding.code:
            return False
        return payload_hash == fields[8]

    def pack_trailer_hashed(self, buf, offset: int, key: str, payload_hash: int, flags: int = 0) -> None:
        """:meth:`pack_trailer_into` for a payload whose XXH3-64 is ``payload_hash``."""
        _TRAILER.pack_into(buf, offset, *self._fields, payload_hash, key_digest(key), self.encoding.code, flags)

    @staticmethod
    def flags_of(trailer) -> int:
        """A (verified) trailer's flags."""
        return _TRAILER.unpack_from(trailer, 0)[11]

    def verify(self, value, key: str) -> bool:
        """Whether ``value`` (payload + trailer, exactly ``value_nbytes``) is a good page for ``key``."""
        if len(value) != self.value_nbytes:
            return False
        mv = memoryview(value).cast("B")
        return self.verify_parts(mv[self.page_nbytes :], key, mv[: self.page_nbytes])


def host_page_bytes(host_pool) -> np.ndarray:
    """``[pages, page_nbytes]`` uint8 view of a ``page_first`` host pool's buffer (no copy)."""
    buf = host_pool.buffer
    return buf.view(torch.uint8).reshape(buf.shape[0], -1).numpy()
