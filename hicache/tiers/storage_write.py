"""The storage tier's write side: a batch of host pages laid out as L3 values (payload + trailer,
:mod:`hicache.tiers.page_codec`), in one of two forms (``StorageTier._batch_set`` picks per batch):

- **framed**: each value contiguous in a slot of a staging buffer (the backend stores those bytes): the
  direct layout (a ``page_first`` pool in the tier's encoding) copies and hashes each page in one GIL-free
  call; other pools are read (decoded, transcoded) and laid out; an L2 with a host window pool goes through
  :func:`hicache.tiers.storage_windows.frame` (a page without its sliding part is a smaller value).
- **parts**: a backend that stores a value from its parts (``StorageBackend.writes_parts``: LMDB with
  ``value_files``, whose ``pwritev`` is the one copy) gets, for a direct-layout pool, each L2 page itself
  (hashed where it lies, never copied) and its trailer. The pages are the write-back's, pinned until the
  store confirms, so they do not change meanwhile.

These run on the tier's framing threads (one per writer), each into its own staging buffer.
"""

from __future__ import annotations

import numpy as np
import torch

from hicache.tiers.device import KVLayout
from hicache.tiers.host import HostKVPool
from hicache.tiers.kv_codec import KVEncoding
from hicache.tiers.native_copy import copy_and_hash
from hicache.tiers.native_hash import xxh3_64
from hicache.tiers.page_codec import SLIDING_INVALID, TRAILER_SIZE, PageCodec
from hicache.tiers.storage_windows import frame, windowed


def page_flags(pool: HostKVPool, page: int) -> int:
    """The trailer flags of host page ``page``: its sliding layers stale or not (hicache/tiers/window_pages.py)."""
    return 0 if pool.sliding_valid[page] else SLIDING_INVALID


def frame_values(codec: PageCodec, layout: KVLayout, page_size: int, keys: list[str], pages: list[int],
                 pool: HostKVPool, rows: np.ndarray, raw: torch.Tensor, view: np.ndarray | None) -> list[int]:
    """Lay out ``pages`` as values in ``rows`` (``[n, slot]`` bytes; ``raw`` the same memory as a tensor;
    ``view`` the pool's ``[pages, bytes]`` view where its bytes are the payloads); returns their sizes."""
    n, nb = len(keys), codec.page_nbytes
    enc: KVEncoding = codec.encoding
    if windowed(pool, codec):  # a page without its sliding part: a smaller value
        return frame(codec, keys, pages, pool, rows, raw)
    if view is not None:
        hashes = copy_and_hash([view[p] for p in pages], [rows[i, :nb] for i in range(n)])
        for i in range(n):
            codec.pack_trailer_hashed(rows[i], nb, keys[i], hashes[i], page_flags(pool, pages[i]))
        return [codec.value_nbytes] * n
    kv = pool.read_pages(torch.tensor(pages, dtype=torch.long))  # [2L, n, X], decoded
    dst = raw[:, :nb]
    if enc.lossy or pool.encoding != enc.name:  # transcode into this tier's encoding
        dst.copy_(enc.encode_pages(kv, layout, page_size))
    else:
        dst.view(kv.dtype).view(n, 2 * layout.num_layers, -1).copy_(kv.transpose(0, 1))
    for i in range(n):
        codec.pack_trailer_into(rows[i], nb, keys[i], rows[i, :nb], page_flags(pool, pages[i]))
    return [codec.value_nbytes] * n


def value_parts(codec: PageCodec, keys: list[str], pages: list[int], pool: HostKVPool,
                view: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """(the L2 page, its trailer) of each of ``pages``: the parts form (see the module docstring)."""
    trailers = np.empty((len(keys), TRAILER_SIZE), dtype=np.uint8)
    out = []
    for i, (key, page) in enumerate(zip(keys, pages, strict=True)):
        payload = view[page]
        codec.pack_trailer_hashed(trailers[i], 0, key, xxh3_64(payload), page_flags(pool, page))
        out.append((payload, trailers[i]))
    return out
