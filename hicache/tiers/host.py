"""L2: the host-memory KV pool (pinned when CUDA is present), in one of two layouts."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from hicache.tiers.allocator import PageAllocator
from hicache.tiers.device import KVLayout


class HostKVPool(ABC):
    """Host pages holding copies of device pages.

    Contract:
    - Page ids come from ``self.allocator`` (owned by the tree's L2 bookkeeping).
    - ``page_view(ids)`` / ``write_pages(ids, kv)`` exchange pages in the device pool's
      order ``[2, layers, n, page_size, kv_heads, head_dim]``; the layout only changes
      how bytes sit in host memory.
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

    @property
    def bytes_per_page(self) -> int:
        return self.layout.bytes_per_token() * self.page_size

    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @abstractmethod
    def _shape(self) -> tuple[int, ...]: ...

    @abstractmethod
    def read_pages(self, ids: torch.Tensor) -> torch.Tensor:
        """Gather pages ``ids`` as ``[2, layers, n, page_size, kv_heads, head_dim]``."""

    @abstractmethod
    def write_pages(self, ids: torch.Tensor, kv: torch.Tensor) -> None:
        """Scatter ``kv`` (device order, see above) into pages ``ids``."""

    def page_bytes(self, page: int) -> bytes:
        """One page as bytes, layers included (what goes to L3 as one value)."""
        return self.read_pages(torch.tensor([page])).contiguous().numpy().tobytes()


class LayerFirstHostPool(HostKVPool):
    """``[2, layers, pages, page_size, heads, dim]``: the device pool's own layout."""

    layout_name = "layer_first"

    def _shape(self) -> tuple[int, ...]:
        lay = self.layout
        return (2, lay.num_layers, self.num_pages, self.page_size, lay.num_kv_heads, lay.head_dim)

    def read_pages(self, ids: torch.Tensor) -> torch.Tensor:
        return self.buffer.index_select(2, ids)

    def write_pages(self, ids: torch.Tensor, kv: torch.Tensor) -> None:
        self.buffer.index_copy_(2, ids, kv)


class PageFirstHostPool(HostKVPool):
    """``[pages, 2, layers, page_size, heads, dim]``: a whole page (all layers, K and V)
    is contiguous, ready to be stored in L3 as one value."""

    layout_name = "page_first"

    def _shape(self) -> tuple[int, ...]:
        lay = self.layout
        return (self.num_pages, 2, lay.num_layers, self.page_size, lay.num_kv_heads, lay.head_dim)

    def read_pages(self, ids: torch.Tensor) -> torch.Tensor:
        # [n, 2, L, ps, H, D] -> [2, L, n, ps, H, D]
        return self.buffer.index_select(0, ids).permute(1, 2, 0, 3, 4, 5)

    def write_pages(self, ids: torch.Tensor, kv: torch.Tensor) -> None:
        # [2, L, n, ps, H, D] -> [n, 2, L, ps, H, D]
        self.buffer.index_copy_(0, ids, kv.permute(2, 0, 1, 3, 4, 5).contiguous())


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
