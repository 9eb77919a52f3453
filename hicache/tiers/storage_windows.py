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

Over a backend with direct reads (LMDB) and a ``page_first`` L2 (:func:`reads_direct`), a group's short values
(most pages: only each sequence end's last window keeps its sliding part) are copied and hashed straight into
their L2 pages in one GIL-free call (:func:`read_direct`), as the tier's direct path reads whole pages, and its
whole values in another, each value's rows split between its L2 page and its host window page
(``copy_and_hash_segments``); a reader that needs the GIL once per page waits behind a busy scheduler thread
for up to the interpreter's switch interval each time (the H200's Gemma-3 12B L3 hit: 0.26 s for 508 pages on
8 readers), and a whole value read through a staging buffer is copied three times (``bench/l3_read.py --shape
gemma3 --windowed 1`` on a 2-vCPU Xeon: 0.36 of LMDB's raw read that way, 0.57 now).

These helpers run on the tier's reader / framing threads; the pages they name are the caller's (pinned).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import numpy as np
import torch

from hicache.tiers.base import TOO_LARGE, StorageBackend
from hicache.tiers.device import KVLayout
from hicache.tiers.host import HostKVPool
from hicache.tiers.native_copy import copy_and_hash, copy_and_hash_segments
from hicache.tiers.page_codec import SLIDING_INVALID, SLIDING_OMITTED, TRAILER_SIZE, PageCodec, host_page_bytes


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
    returns each value's size. Each page is read where it lies, never through a whole-model staging copy:
    a short value is its page's full rows (in a ``page_first`` L2 exactly the page's bytes, so the group's
    short values are copied and hashed in one GIL-free call), a whole value its full rows and its host
    window page's rows laid out in device order."""
    short = short_codec(codec.layout, codec.page_size, len(pool.full_layers))
    windows = pool.windows
    assert windows is not None
    wins = [windows.map[p] for p in pages]
    pool.wait_pending_writes()
    nbs = short.page_nbytes
    shorts = [i for i, w in enumerate(wins) if w < 0]
    omitted = SLIDING_INVALID | SLIDING_OMITTED
    if shorts and pool.layout_name == "page_first":
        view = host_page_bytes(pool)
        hashes = copy_and_hash([view[pages[i]] for i in shorts], [rows[i, :nbs] for i in shorts])
        for i, h in zip(shorts, hashes, strict=True):
            short.pack_trailer_hashed(rows[i], nbs, keys[i], h, omitted)
    else:
        for i in shorts:
            raw[i, :nbs].view(pool.buffer.dtype).view(-1, pool.row_elems).copy_(pool.page_rows(pages[i]))
            short.pack_trailer_into(rows[i], nbs, keys[i], rows[i, :nbs], omitted)
    nb = codec.page_nbytes
    for i, w in enumerate(wins):
        if w >= 0:
            dst = raw[i, :nb].view(pool.buffer.dtype).view(-1, pool.row_elems)  # [2L, X], device order
            dst.index_copy_(0, pool.full_rows, pool.page_rows(pages[i]))
            dst.index_copy_(0, pool.window_rows, windows.page_rows(w))
            codec.pack_trailer_into(rows[i], nb, keys[i], rows[i, :nb], 0)
    return [codec.value_nbytes if w >= 0 else short.value_nbytes for w in wins]


def _gather(data: torch.Tensor, rows: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst := data[rows]``, in one copy where ``dst`` is contiguous (a ``page_first`` page)."""
    if dst.is_contiguous():
        torch.index_select(data, 0, rows, out=dst)
    else:
        dst.copy_(data.index_select(0, rows))


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
        _gather(data, pool.full_rows, pool.page_rows(page))
        if win >= 0:
            _gather(data, pool.window_rows, windows.page_rows(win))
    else:
        pool.page_rows(page).copy_(data)
    return True


def reads_direct(pool: HostKVPool, codec: PageCodec, backend: StorageBackend) -> bool:
    """Whether :func:`read_direct` serves reads into ``pool``: a ``page_first`` L2 with a host window pool and
    some full layers (a short value is then exactly its page's bytes) over a direct-reads backend."""
    return windowed(pool, codec) and pool.layout_name == "page_first" and bool(pool.full_layers) and \
        getattr(backend, "direct_reads", False)


@lru_cache(maxsize=8)
def _runs(full_rows: tuple[int, ...], window_rows: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """A whole value's rows (every layer's K then V, device order) as runs ``(0 full / 1 window, first row
    there, rows)``, each landing contiguously in the L2 page's full rows or in the host window page's rows."""
    where = {r: (0, k) for k, r in enumerate(full_rows)}
    where.update({r: (1, k) for k, r in enumerate(window_rows)})
    runs: list[tuple[int, int, int]] = []
    for r in range(len(where)):
        to, k = where[r]
        if runs and runs[-1][0] == to and runs[-1][1] + runs[-1][2] == k:
            runs[-1] = (to, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((to, k, 1))
    return tuple(runs)


def _whole_parts(runs: tuple[tuple[int, int, int], ...], rb: int, page: np.ndarray, win: np.ndarray
                 ) -> list[np.ndarray]:
    """A whole value's payload as parts, in order (``runs``: :func:`_runs` of its pool, rows of ``rb`` bytes):
    slices of the L2 page's bytes ``page`` and of ``win`` (the host window page's bytes, or a scratch buffer
    where its sliding part is not kept)."""
    bufs = (page, win)
    return [bufs[to][k * rb: (k + n) * rb] for to, k, n in runs]


def read_direct(backend: StorageBackend, codec: PageCodec, keys: list[str], pages: list[int], pool: HostKVPool,
                view: np.ndarray, corrupt: Callable[[str], None], landed: list[int] | None = None) -> int:
    """Read ``keys`` into L2 pages ``pages`` (``view``: the pool's ``[pages, bytes]`` view) in one GIL-free call
    for the short values (copied and hashed into their pages) and one for the whole ones (their full rows into
    the page, their sliding rows into a host window page taken with ``HostWindows.take_free``, or a scratch
    buffer where none is free or the value's flags say its sliding part is stale), each checked against its
    trailer; ``corrupt(key)`` for a bad value, where the read ends. Returns how many leading pages landed (their
    values' sizes appended to ``landed``)."""
    short = short_codec(codec.layout, codec.page_size, len(pool.full_layers))
    trailers = np.empty((len(keys), TRAILER_SIZE), dtype=np.uint8)
    dsts = [view[p] for p in pages]
    windows = pool.windows
    assert windows is not None
    hashes: dict[int, int] = {}
    wins: dict[int, int] = {}
    nb = codec.page_nbytes

    def copy(srcs: list[np.ndarray], idx: list[int]) -> None:
        hashes.update(zip(idx, copy_and_hash(srcs, [dsts[i] for i in idx]), strict=True))

    def whole(vals: list[np.ndarray], idx: list[int]) -> None:
        srcs, parts, at = [], [], []
        wbytes = windows.page_rows(0).numel() * windows.buffer.element_size()
        runs = _runs(tuple(pool.full_rows.tolist()), tuple(pool.window_rows.tolist()))
        rb = view.shape[1] // max(1, len(pool.full_rows))  # bytes of one row of a page
        for v, i in zip(vals, idx, strict=True):
            if len(v) != codec.value_nbytes:
                continue
            trailers[i] = v[nb:]
            keep = not codec.flags_of(trailers[i]) & SLIDING_INVALID
            w = windows.take_free(pages[i]) if keep else -1
            wins[i] = w
            wv = windows.page_rows(w).view(torch.uint8).numpy().reshape(-1) if w >= 0 else np.empty(wbytes, np.uint8)
            srcs.append(v[:nb])
            parts.append(_whole_parts(runs, rb, dsts[i], wv))
            at.append(i)
        if srcs:
            hashes.update(zip(at, copy_and_hash_segments(srcs, parts), strict=True))

    pool.wait_pending_writes()
    sizes = backend.batch_get_pages(keys, dsts, trailers, copy=copy, other=whole)
    ok = 0
    for i, size in enumerate(sizes):
        if size < 0 and size != TOO_LARGE:
            break  # missing, or the store failed
        if size == short.value_nbytes and i in hashes and short.verify_hashed(trailers[i], keys[i], hashes[i]):
            windows.drop([pages[i]])
        elif size == codec.value_nbytes and i in hashes and codec.verify_hashed(trailers[i], keys[i], hashes[i]):
            if wins[i] < 0:
                windows.drop([pages[i]])
        else:  # a bad checksum, or no page of this model's size
            corrupt(keys[i])
            break
        if landed is not None:
            landed.append(size)
        ok += 1
    windows.drop([pages[i] for i in wins if i >= ok])  # read, but not landed
    return ok
