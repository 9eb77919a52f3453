"""L2: the host-memory KV pool (pinned when CUDA is present), in one of two layouts."""

from __future__ import annotations

import os
import threading
import weakref
from abc import ABC, abstractmethod

import torch

from hicache.tiers.allocator import PageAllocator
from hicache.tiers.device import KVLayout
from hicache.tiers.host_pinning import (
    HOLD_ENV,
    HostPinner,
    aligned_empty,
    cuda_register,
    cuda_unregister,
    no_register,
)
from hicache.tiers.kv_codec import get_encoding, storage_dtype


class GrowingPageAllocator(PageAllocator):
    """A PageAllocator of ``num_pages`` ids of which only the first ``available`` exist yet (an
    L2 still being pinned); :meth:`grow` adds the next ones. Same contract otherwise (one owner:
    the scheduler thread)."""

    def __init__(self, num_pages: int, available: int) -> None:
        super().__init__(num_pages)
        self.available = max(0, min(available, num_pages))
        self._free = list(range(self.available - 1, -1, -1))

    @property
    def num_used(self) -> int:
        return self.available - len(self._free)

    def grow(self, available: int) -> int:
        """Ids up to ``available`` join the free list (handed out after the older free ones); returns how many."""
        available = min(available, self.num_pages)
        if available <= self.available:
            return 0
        added = list(range(available - 1, self.available - 1, -1))
        self._free[:0] = added
        self.available = available
        return len(added)

    def check_integrity(self) -> None:
        assert len(self._free) == len(set(self._free)), "duplicate ids in free list"
        assert sum(self._allocated) + len(self._free) == self.available, "allocated + free != available"
        assert not any(self._allocated[self.available:]), "a page not yet available is allocated"
        for i in self._free:
            assert i < self.available and not self._allocated[i], f"page {i} free but allocated or not available"


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
    """

    layout_name: str
    encoding = "raw"
    page_dim = 0  # the buffer's dimension of pages

    def __init__(self, layout: KVLayout, num_pages: int, page_size: int, pin_memory: bool | None = None,
                 background: bool = False) -> None:
        """``background``: pin all but the first chunk on background threads while the pool is in
        use (hicache.tiers.host_pinning); its pages join the allocator in :meth:`take_pinned`."""
        self.layout = layout
        self.num_pages = num_pages
        self.page_size = page_size
        self.pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        hold = None if self.pin else os.environ.get(HOLD_ENV) or None  # CPU tests: the same growth, held
        self.pinner: HostPinner | None = None
        self.allocator: PageAllocator
        if self.pin or hold:  # pageable, pinned in place chunk by chunk
            # its own whole OS pages (registering it pins nothing else); each chunk zeroed as pinned
            self.buffer = aligned_empty(self._shape(), self._buffer_dtype())
            rows = self.buffer.shape[0] if self.page_dim == 1 else 1
            self.pinner = HostPinner(self.buffer, rows, num_pages, cuda_register if self.pin else no_register,
                                     cuda_unregister if self.pin else (lambda ptr: None), hold=hold)
            # a pool dropped without release() still unpins before its buffer is freed: freed memory that
            # stays registered would make the next registration (or cudaHostAlloc) there fail
            self._unpin = weakref.finalize(self, self.pinner.close)
            self.pinner.start(background or hold is not None)
            self.allocator = GrowingPageAllocator(num_pages, self.pinner.ready_pages())
        else:
            self.buffer = torch.zeros(self._shape(), dtype=self._buffer_dtype())
            self.allocator = PageAllocator(num_pages)
        # CUDA event of the last GPU-side write into ``buffer`` (a backup kernel writing pinned
        # memory directly); host-side accessors wait for it first. The scheduler thread sets
        # it, any thread (the L3 writer, the loader) waits for it: ``_pending_lock`` makes the
        # clear-after-wait atomic with respect to a newer event being set meanwhile.
        self.pending_write: torch.cuda.Event | None = None
        self._pending_lock = threading.Lock()
        # A hybrid SWA L1 (hicache/tiers/window_pages.py): 1 where a page's sliding layers hold good KV (0: its
        # backup found no window page: the full layers only). Written by its backups and L3 reads; all 1 else.
        self.sliding_valid = bytearray(b"\x01") * num_pages

    @property
    def growing(self) -> bool:
        """Pages are still being pinned (and will join the allocator)."""
        return isinstance(self.allocator, GrowingPageAllocator) and self.allocator.available < self.num_pages \
            and self.pinner is not None and self.pinner.error is None

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
        return get_encoding(self.encoding).page_nbytes(self.layout, self.page_size)

    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @property
    def rows(self) -> int:
        """K and V of every layer: ``2 * layers`` rows of one page each."""
        return 2 * self.layout.num_layers

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

    @abstractmethod
    def _shape(self) -> tuple[int, ...]: ...

    @abstractmethod
    def read_pages(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Gather pages ``ids`` as ``[2 * layers, n, row_elems]`` (into ``out`` when given)."""

    @abstractmethod
    def write_pages(self, ids: torch.Tensor, kv: torch.Tensor) -> None:
        """Scatter ``kv`` of ``[2 * layers, n, row_elems]`` into pages ``ids``."""

    def page_bytes(self, page: int) -> bytes:
        """One page as bytes, layers included (what goes to L3 as one value)."""
        self.wait_pending_writes()
        return self.read_pages(torch.tensor([page])).contiguous().view(torch.uint8).numpy().tobytes()


class LayerFirstHostPool(HostKVPool):
    """``[2 * layers, pages, row_elems]``: the device pool's own layout."""

    layout_name = "layer_first"
    page_dim = 1

    def _shape(self) -> tuple[int, ...]:
        return (self.rows, self.num_pages, self.row_elems)

    def read_pages(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        self.wait_pending_writes()
        return torch.index_select(self.buffer, 1, ids, out=out) if out is not None else \
            self.buffer.index_select(1, ids)

    def write_pages(self, ids: torch.Tensor, kv: torch.Tensor) -> None:
        self.wait_pending_writes()
        self.buffer.index_copy_(1, ids, kv)


class PageFirstHostPool(HostKVPool):
    """``[pages, 2 * layers, row_elems]``: a whole page (all layers, K and V) is
    contiguous, ready to be stored in L3 as one value."""

    layout_name = "page_first"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._local = threading.local()  # one staging buffer per thread (backups and loads overlap)

    def _stage(self, n: int) -> torch.Tensor:
        need = n * self.rows * self.row_elems
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < need:
            buf = self._local.buf = torch.empty(need, dtype=self.buffer.dtype)
        return buf[:need].view(n, self.rows, self.row_elems)

    def _shape(self) -> tuple[int, ...]:
        return (self.num_pages, self.rows, self.row_elems)

    def read_pages(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        self.wait_pending_writes()
        pages = torch.index_select(self.buffer, 0, ids, out=self._stage(len(ids)))  # [n, 2L, X]
        if out is None:
            return pages.transpose(0, 1).contiguous()  # [2L, n, X]
        return out.copy_(pages.transpose(0, 1))

    def write_pages(self, ids: torch.Tensor, kv: torch.Tensor) -> None:
        self.wait_pending_writes()
        staged = self._stage(len(ids)).copy_(kv.transpose(0, 1))  # [2L, n, X] -> [n, 2L, X]
        self.buffer.index_copy_(0, ids, staged)


class EncodedHostPool(HostKVPool):
    """``[pages, page_nbytes]`` uint8: each page encoded (``fp8`` / ``int8``, see
    :mod:`hicache.tiers.kv_codec`) and contiguous -- exactly its L3 payload in that encoding,
    whatever ``hicache_mem_layout`` says (``layout_name`` keeps the configured name; the storage
    tier's direct path needs ``page_first``). Moves go through ``read_pages`` / ``write_pages``
    (decode / encode on the calling thread), never the GPU page-move kernel."""

    def __init__(self, layout: KVLayout, num_pages: int, page_size: int, encoding: str,
                 layout_name: str = "page_first", pin_memory: bool | None = None, background: bool = False) -> None:
        self.encoding = get_encoding(encoding).name
        self.layout_name = layout_name
        super().__init__(layout, num_pages, page_size, pin_memory, background)

    def _buffer_dtype(self) -> torch.dtype:
        return torch.uint8

    def _shape(self) -> tuple[int, ...]:
        return (self.num_pages, self.bytes_per_page)

    def check_integrity(self) -> None:
        """Also: every allocated page's scale exponents are ones the encoder can write (an
        encoder bug or a stray write into the scales would show here)."""
        super().check_integrity()
        used = [p for p in range(self.num_pages) if self.allocator.is_allocated(p)]
        if not used:
            return
        enc = get_encoding(self.encoding)
        split = 2 * self.layout.num_layers * self.page_size * self.layout.num_kv_heads * self.layout.head_dim
        exps = self.buffer[torch.tensor(used), split:].view(torch.int8)
        lo = int(exps.min())  # an int8 is <= 127 anyway
        assert lo >= enc.emin(self.layout.dtype), \
            f"an L2 {enc.name} page holds scale exponent {lo}, below the floor {enc.emin(self.layout.dtype)}"

    def read_pages(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        self.wait_pending_writes()
        kv = get_encoding(self.encoding).decode_pages(self.buffer.index_select(0, ids), self.layout, self.page_size)
        return kv.contiguous() if out is None else out.copy_(kv)

    def page_bytes(self, page: int) -> bytes:
        """The page's encoded bytes: its L3 payload in this encoding."""
        self.wait_pending_writes()
        return self.buffer[page].numpy().tobytes()

    def write_pages(self, ids: torch.Tensor, kv: torch.Tensor) -> None:
        self.wait_pending_writes()
        self.buffer.index_copy_(0, ids, get_encoding(self.encoding).encode_pages(kv, self.layout, self.page_size))


HOST_LAYOUTS: dict[str, type[HostKVPool]] = {
    LayerFirstHostPool.layout_name: LayerFirstHostPool,
    PageFirstHostPool.layout_name: PageFirstHostPool,
}


def host_num_pages(device_pages: int, device_bytes_per_page: int, ratio: float, size_gb: float,
                   host_bytes_per_page: int | None = None) -> int:
    """L2 size in pages, sized in bytes: ``hicache_size`` GiB when given, else ``hicache_ratio``
    x L1's bytes; a compact L2 encoding (fewer ``host_bytes_per_page``) holds more pages."""
    host_bytes = host_bytes_per_page or device_bytes_per_page
    if size_gb > 0:
        return max(1, int(size_gb * 2**30) // host_bytes)
    if host_bytes == device_bytes_per_page:
        return max(1, int(device_pages * ratio))
    return max(1, int(device_pages * ratio * device_bytes_per_page) // host_bytes)


def make_host_pool(name: str, layout: KVLayout, num_pages: int, page_size: int,
                   encoding: str = "raw", background: bool = False, pin_memory: bool | None = None) -> HostKVPool:
    """``background``: pin in the background (see HostKVPool); only for a pool whose pages no
    other process follows (tensor-parallel ranks pin theirs whole before serving). ``pin_memory``:
    None pins wherever CUDA is available; an engine on the CPU passes False."""
    try:
        cls = HOST_LAYOUTS[name]
    except KeyError:
        raise ValueError(f"unknown hicache_mem_layout {name!r}; choose from {sorted(HOST_LAYOUTS)}") from None
    if get_encoding(encoding).lossy:
        return EncodedHostPool(layout, num_pages, page_size, encoding, name, pin_memory, background)
    return cls(layout, num_pages, page_size, pin_memory, background)
