"""L3 values of an L2 with a host window pool (hicache/tiers/host_windows.py): a page whose sliding part is
stale is stored without it.

A page with a host window page goes to L3 as every page does (every KV layer, flags 0). A page without one
(its sliding layers' KV was not kept) is stored as the value of a model of its full layers only: the payload
holds the full layers' K then V rows (in the device order of those layers), the trailer says ``rows`` 2 x
full layers and ``payload_nbytes`` that smaller size, and its flags ``SLIDING_INVALID | SLIDING_OMITTED``
(hicache/tiers/page_codec.py). Read back into such an L2, a whole value's page takes a host window page if
one is free (``HostWindows.take_free``: the reader threads never reclaim), else its sliding part is not
kept; a short value's page keeps none. An L2 without a host window pool reads a short value as a miss (not
corrupt: it is another server's good page), which :func:`is_short_page` recognises by its size.

These helpers run on the tier's reader / framing threads; the pages they name are the caller's (pinned).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from hicache.tiers.device import KVLayout
from hicache.tiers.host import HostKVPool
from hicache.tiers.page_codec import SLIDING_INVALID, SLIDING_OMITTED, TRAILER_SIZE, PageCodec


def windowed(pool: HostKVPool, codec: PageCodec) -> bool:
    """Whether values between ``pool`` and a tier of ``codec`` go through these helpers."""
    return pool.windows is not None and codec.encoding.name == "raw" and pool.encoding == "raw"


@lru_cache(maxsize=8)
def short_codec(layout: KVLayout, page_size: int, full_layers: int) -> PageCodec:
    """The codec of a page stored without its sliding part (a model of ``full_layers`` layers)."""
    return PageCodec(KVLayout(full_layers, layout.num_kv_heads, layout.head_dim, layout.dtype), page_size)


def is_short_page(codec: PageCodec, size: int) -> bool:
    """Whether a value of ``size`` bytes can be a page of this model stored without some layers (raw)."""
    row = codec.page_nbytes // (2 * codec.layout.num_layers)
    payload = size - TRAILER_SIZE
    return codec.encoding.name == "raw" and 0 <= payload < codec.page_nbytes and payload % (2 * row) == 0


def frame(codec: PageCodec, keys: list[str], pages: list[int], pool: HostKVPool, rows: np.ndarray,
          raw: torch.Tensor) -> list[int]:
    """Lay out ``pages`` as values in ``rows`` (``[n, slot]`` bytes; ``raw`` the same memory as a tensor);
    returns each value's size."""
    short = short_codec(codec.layout, codec.page_size, len(pool.full_layers))
    kv = pool.read_pages(torch.tensor(pages, dtype=torch.long))  # [2L, n, X]
    sizes = []
    for i, (key, page) in enumerate(zip(keys, pages, strict=True)):
        whole = pool.windows.has(page)
        c = codec if whole else short
        part = kv[:, i] if whole else kv[pool.full_rows, i]
        nb = c.page_nbytes
        raw[i, :nb].view(kv.dtype).view(part.shape).copy_(part)
        c.pack_trailer_into(rows[i], nb, key, rows[i, :nb], 0 if whole else SLIDING_INVALID | SLIDING_OMITTED)
        sizes.append(c.value_nbytes)
    return sizes


def land(codec: PageCodec, key: str, row: np.ndarray, size: int, pool: HostKVPool, page: int) -> bool:
    """Verify the value of ``size`` bytes at ``row`` and write it into host page ``page`` (see the module
    docstring); False: not a good value for ``key``."""
    short = short_codec(codec.layout, codec.page_size, len(pool.full_layers))
    c = codec if size == codec.value_nbytes else short if size == short.value_nbytes else None
    if c is None:
        return False
    nb = c.page_nbytes
    trailer = row[nb: nb + TRAILER_SIZE]
    if not c.verify_parts(trailer, key, row[:nb]):
        return False
    data = torch.from_numpy(row[:nb]).view(pool.buffer.dtype).view(-1, pool.row_elems)
    keep = c is codec and not c.flags_of(trailer) & SLIDING_INVALID
    windows = pool.windows
    assert windows is not None
    win = windows.take_free(page) if keep else -1
    if not keep:
        windows.drop([page])
    pool.wait_pending_writes()
    # one copy per part, straight into the page's rows (a whole value holds every layer in device order)
    if c is codec:
        pool.page_rows(page).copy_(data.index_select(0, pool.full_rows))
        if win >= 0:
            windows.page_rows(win).copy_(data.index_select(0, pool.window_rows))
    else:
        pool.page_rows(page).copy_(data)
    return True
