"""L2's base: :class:`HostKVPool`, host pages holding copies of device pages (its layouts: hicache/tiers/host.py)."""

from __future__ import annotations

import os
import threading
import weakref
from abc import ABC, abstractmethod

import torch

from hicache.tiers.allocator import PageAllocator
from hicache.tiers.device import KVLayout
from hicache.tiers.host_pages import GrowingPageAllocator, WindowedHostAllocator
from hicache.tiers.host_pinning import (
    HOLD_ENV,
    HostPinner,
    aligned_empty,
    cuda_register,
    cuda_unregister,
    no_register,
)
from hicache.tiers.host_windows import HostWindows
from hicache.tiers.kv_codec import get_encoding, storage_dtype


class HostKVPool(ABC):
    """Host pages holding copies of device pages.

    Contract:
    - Page ids come from ``self.allocator`` (owned by the tree's L2 bookkeeping).
    - GPU writes into the buffer (backups by the page-move kernel) are announced with
      :meth:`add_pending_write` (scheduler thread); every host-side reader, on any thread,
      calls :meth:`wait_pending_writes` first, which never forgets an event it did not wait for.
    - ``read_pages(ids)`` / ``write_pages(ids, kv)`` exchange pages in the device pool's
      order, flattened: ``[2 * layers, n, page_size * kv_heads * head_dim]``; the layout
      only changes how bytes sit in host memory.
    - Not thread-safe for overlapping page ids: the cache controller never copies into a
      page that another copy is reading (the tree hands out disjoint pages).
    - Pinned (CUDA) in place by a :class:`HostPinner`; with ``background`` the pool is used while
      it is still being pinned (``growing``): its allocator then hands out only pinned pages, and
      the allocator's owner (the scheduler thread) adds the ones pinned since with
      :meth:`take_pinned`. :meth:`release` (or the pool's collection) unpins before the buffer goes.
    - ``encoding``: how pages sit in ``buffer``; ``raw`` pools hold L1's values in
      :func:`~hicache.tiers.kv_codec.storage_dtype` (uint8 bytes for an fp8 L1), an
      :class:`EncodedHostPool` holds encoded pages (``read_pages`` decodes, ``write_pages`` encodes).
    - ``window_layers`` (an L2 for a hybrid SWA L1, raw encodings only): ``buffer`` holds the other (full)
      layers' rows only and ``windows`` (hicache/tiers/host_windows.py) the sliding layers' part of the pages
      that keep one; ``read_pages`` / ``write_pages`` still exchange every layer (a page without a host window
      page reads zeros in its sliding rows and writes none). ``sliding_valid[p]`` says whether page ``p``'s
      sliding part is good: a bytearray written by backups and L3 reads, or, with ``windows``, whether it has a
      host window page.
    """

    layout_name: str
    encoding = "raw"
    page_dim = 0  # the buffer's dimension of pages

    def __init__(self, layout: KVLayout, num_pages: int, page_size: int, pin_memory: bool | None = None,
                 background: bool = False, window_layers: tuple[int, ...] = (), window_pages: int = 0) -> None:
        """``background``: pin all but the first chunk on background threads while the pool is in
        use (hicache.tiers.host_pinning); its pages join the allocator in :meth:`take_pinned`.
        ``window_layers`` / ``window_pages``: a host window pool of that many pages for those KV layers."""
        self.layout = layout
        self.num_pages = num_pages
        self.page_size = page_size
        self.window_layers = tuple(window_layers)
        self.full_layers = tuple(i for i in range(layout.num_layers) if i not in self.window_layers)
        nl = layout.num_layers
        self.full_rows = torch.tensor([kv * nl + i for kv in (0, 1) for i in self.full_layers], dtype=torch.long)
        self.window_rows = torch.tensor([kv * nl + i for kv in (0, 1) for i in self.window_layers], dtype=torch.long)
        self.pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        hold = None if self.pin else os.environ.get(HOLD_ENV) or None  # CPU tests: the same growth, held
        self.pinner: HostPinner | None = None
        self.allocator: PageAllocator
        self.windows: HostWindows | None = None
        if self.window_layers:
            self.windows = HostWindows(num_pages, window_pages, 2 * len(self.window_layers), self.row_elems,
                                       self._buffer_dtype(), self.page_dim == 0, self.pin)
        # every layer sliding (the window pool holds all the KV): the main buffer is empty, nothing to pin
        full_bytes = torch.Size(self._shape()).numel() > 0
        if (self.pin or hold) and full_bytes:  # pageable, pinned in place chunk by chunk
            # its own whole OS pages (registering it pins nothing else); each chunk zeroed as pinned
            self.buffer = aligned_empty(self._shape(), self._buffer_dtype())
            rows = self.buffer.shape[0] if self.page_dim == 1 else 1
            self.pinner = HostPinner(self.buffer, rows, num_pages, cuda_register if self.pin else no_register,
                                     cuda_unregister if self.pin else (lambda ptr: None), hold=hold)
            # a pool dropped without release() still unpins before its buffer is freed: freed memory that
            # stays registered would make the next registration (or cudaHostAlloc) there fail
            self._unpin = weakref.finalize(self, self.pinner.close)
            self.pinner.start(background or hold is not None)
            ready = self.pinner.ready_pages()
            self.allocator = GrowingPageAllocator(num_pages, ready) if self.windows is None else \
                WindowedHostAllocator(num_pages, ready, self.windows)
        else:
            self.buffer = torch.zeros(self._shape(), dtype=self._buffer_dtype())
            self.allocator = PageAllocator(num_pages) if self.windows is None else \
                WindowedHostAllocator(num_pages, num_pages, self.windows)
        # CUDA event of the last GPU-side write into ``buffer`` (a backup kernel writing pinned
        # memory directly); host-side accessors wait for it first. The scheduler thread sets
        # it, any thread (the L3 writer, the loader) waits for it: ``_pending_lock`` makes the
        # clear-after-wait atomic with respect to a newer event being set meanwhile.
        self.pending_write: torch.cuda.Event | None = None
        self._pending_lock = threading.Lock()
        # A hybrid SWA L1 (hicache/tiers/window_pages.py): 1 where a page's sliding layers hold good KV (0: its
        # backup found no window page: the full layers only). Written by its backups and L3 reads; all 1 else.
        # With a host window pool: whether the page has a host window page (read-only).
        self.sliding_valid = bytearray(b"\x01") * num_pages if self.windows is None else self.windows.valid

    @property
    def growing(self) -> bool:
        """Pages are still being pinned (and will join the allocator)."""
        return isinstance(self.allocator, GrowingPageAllocator) and self.allocator.available < self.num_pages \
            and self.pinner is not None and self.pinner.error is None

    def free_once_pinned(self) -> int:
        """Pages free now plus those still to be pinned (all of them join the allocator once pinned)."""
        a = self.allocator
        return a.num_free + a.num_pages - a.available if isinstance(a, GrowingPageAllocator) else a.num_free

    def take_pinned(self) -> int:
        """Hand the pages pinned since the last call to the allocator; returns how many joined.
        The allocator's owner (the scheduler thread) calls it."""
        if not isinstance(self.allocator, GrowingPageAllocator) or self.pinner is None:
            return 0
        return self.allocator.grow(self.pinner.ready_pages())

    def release(self) -> None:
        """Unpin and drop the buffer (the pool is unusable afterwards); waits for the pinning threads."""
        if self.pinner is not None:
            self._unpin()  # pinner.close(), once
            self.pinner = None
        if self.windows is not None:
            self.windows.release()
        self.buffer = torch.empty(0, dtype=self.buffer.dtype)

    def add_pending_write(self, event: torch.cuda.Event) -> None:
        with self._pending_lock:
            self.pending_write = event  # backups run in order on one stream: the last covers all

    def wait_pending_writes(self) -> None:
        """Block until every GPU write into ``buffer`` queued so far has landed."""
        ev = self.pending_write
        if ev is None:
            return
        ev.synchronize()
        with self._pending_lock:  # clear only if no newer write was queued while we waited
            if self.pending_write is ev:
                self.pending_write = None

    def _buffer_dtype(self) -> torch.dtype:
        return storage_dtype(self.layout.dtype)

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page of ``buffer`` (every layer; the full layers' part with a host window pool)."""
        return get_encoding(self.encoding).page_nbytes(self.layout, self.page_size) - self.window_bytes_per_page

    @property
    def window_bytes_per_page(self) -> int:
        """Bytes of one page's sliding layers (a host window page); 0 without a host window pool."""
        if self.windows is None:
            return 0
        return 2 * len(self.window_layers) * self.row_elems * torch.empty((), dtype=self._buffer_dtype()).element_size()

    def nbytes(self) -> int:
        """Bytes held: the pages' buffer and, with one, the host window pool's."""
        return self.buffer.numel() * self.buffer.element_size() + (0 if self.windows is None else self.windows.nbytes())

    @property
    def rows(self) -> int:
        """Rows of one page in ``buffer``: ``2 * layers`` (K and V of every layer; of the full layers only
        with a host window pool)."""
        return 2 * len(self.full_layers)

    @property
    def row_elems(self) -> int:
        """Elements in one layer's K (or V) of one page: ``page_size * kv_heads * head_dim``."""
        return self.page_size * self.layout.num_kv_heads * self.layout.head_dim

    def check_integrity(self) -> None:
        """The allocator's invariants, and the buffer holds ``num_pages`` pages of this encoding."""
        self.allocator.check_integrity()
        assert self.buffer.shape == self._shape() and self.buffer.dtype == self._buffer_dtype(), \
            f"host buffer {tuple(self.buffer.shape)} {self.buffer.dtype} is not {self._shape()} {self._buffer_dtype()}"
        assert self.buffer.numel() * self.buffer.element_size() == self.num_pages * self.bytes_per_page
        if self.windows is not None:  # every host window page free or mapped from one allocated host page
            self.windows.check_integrity(self.allocator.is_allocated)

    @abstractmethod
    def _shape(self) -> tuple[int, ...]: ...

    @abstractmethod
    def _read_rows(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Gather ``buffer``'s rows of pages ``ids`` as ``[rows, n, row_elems]``."""

    @abstractmethod
    def _write_rows(self, ids: torch.Tensor, kv: torch.Tensor) -> None:
        """Scatter ``kv`` of ``[rows, n, row_elems]`` into ``buffer``'s pages ``ids``."""

    def read_pages(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Gather pages ``ids`` as ``[2 * layers, n, row_elems]`` (into ``out`` when given); with a host
        window pool a page without a host window page reads zeros in its sliding rows."""
        if self.windows is None:
            return self._read_rows(ids, out)
        self.wait_pending_writes()
        n = len(ids)
        kv = out if out is not None else torch.empty((2 * self.layout.num_layers, n, self.row_elems),
                                                     dtype=self.buffer.dtype)
        kv[self.full_rows] = self._read_rows(ids)
        wins = [self.windows.map[p] for p in ids.tolist()]
        have = [i for i, w in enumerate(wins) if w >= 0]
        sliding = torch.zeros((len(self.window_rows), n, self.row_elems), dtype=kv.dtype)
        if have:
            sliding[:, have] = self.windows.read(torch.tensor([wins[i] for i in have], dtype=torch.long))
        kv[self.window_rows] = sliding
        return kv

    def write_pages(self, ids: torch.Tensor, kv: torch.Tensor) -> None:
        """Scatter ``kv`` of ``[2 * layers, n, row_elems]`` into pages ``ids``; with a host window pool the
        sliding rows go to the pages' host window pages (none where a page has none)."""
        if self.windows is None:
            self._write_rows(ids, kv)
            return
        self.wait_pending_writes()
        self._write_rows(ids, kv.index_select(0, self.full_rows))
        wins = [self.windows.map[p] for p in ids.tolist()]
        have = [i for i, w in enumerate(wins) if w >= 0]
        if have:
            rows = kv.index_select(0, self.window_rows)[:, have]
            self.windows.write(torch.tensor([wins[i] for i in have], dtype=torch.long), rows)

    def page_rows(self, page: int) -> torch.Tensor:
        """Page ``page``'s rows in ``buffer`` (the full layers' only, with a host window pool) as a
        ``[rows, row_elems]`` view, for one-copy writes (an L3 read landing a page)."""
        return self.buffer.select(self.page_dim, page)

    def page_bytes(self, page: int) -> bytes:
        """One page as bytes, layers included (what goes to L3 as one value)."""
        self.wait_pending_writes()
        return self.read_pages(torch.tensor([page])).contiguous().view(torch.uint8).numpy().tobytes()
