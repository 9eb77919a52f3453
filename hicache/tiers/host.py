"""L2: the host-memory KV pool (pinned when CUDA is present), in one of two layouts."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod

import torch

from hicache.tiers.allocator import PageAllocator
from hicache.tiers.device import KVLayout


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
    """

    layout_name: str

    def __init__(self, layout: KVLayout, num_pages: int, page_size: int, pin_memory: bool | None = None) -> None:
        self.layout = layout
        self.num_pages = num_pages
        self.page_size = page_size
        self.pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.allocator = PageAllocator(num_pages)
        self.buffer = torch.zeros(self._shape(), dtype=layout.dtype, pin_memory=self.pin)
        # CUDA event of the last GPU-side write into ``buffer`` (a backup kernel writing pinned
        # memory directly); host-side accessors wait for it first. The scheduler thread sets
        # it, any thread (the L3 writer, the loader) waits for it: ``_pending_lock`` makes the
        # clear-after-wait atomic with respect to a newer event being set meanwhile.
        self.pending_write: torch.cuda.Event | None = None
        self._pending_lock = threading.Lock()

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

    @property
    def bytes_per_page(self) -> int:
        return self.layout.bytes_per_token() * self.page_size

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
            buf = self._local.buf = torch.empty(need, dtype=self.layout.dtype)
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


HOST_LAYOUTS: dict[str, type[HostKVPool]] = {
    LayerFirstHostPool.layout_name: LayerFirstHostPool,
    PageFirstHostPool.layout_name: PageFirstHostPool,
}


def host_num_pages(device_pages: int, bytes_per_page: int, ratio: float, size_gb: float) -> int:
    """L2 size in pages: ``hicache_size`` GiB when given, else ``hicache_ratio`` x L1."""
    if size_gb > 0:
        return max(1, int(size_gb * 2**30) // bytes_per_page)
    return max(1, int(device_pages * ratio))


def make_host_pool(name: str, layout: KVLayout, num_pages: int, page_size: int) -> HostKVPool:
    try:
        cls = HOST_LAYOUTS[name]
    except KeyError:
        raise ValueError(f"unknown hicache_mem_layout {name!r}; choose from {sorted(HOST_LAYOUTS)}") from None
    return cls(layout, num_pages, page_size)
