"""L1: the paged KV pool on the compute device (a GPU, or the CPU when there is none)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache.tiers.allocator import PageAllocator


@dataclass(frozen=True)
class KVLayout:
    """Shape of the KV cache of one model: what a page holds."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


class DeviceKVPool:
    """Per layer K and V tensors of ``[num_pages, page_size, kv_heads, head_dim]``.

    Contract:
    - Page ids come from ``self.allocator``; the tensors are never resized.
    - Writers: the model's KV-store kernel (new tokens) and the cache controller
      (load-back from L2). Both run on the scheduler's thread / stream order.
    - No locking: one scheduler owns the pool.
    """

    def __init__(self, layout: KVLayout, num_pages: int, page_size: int, device: torch.device | str) -> None:
        self.layout = layout
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = torch.device(device)
        # One buffer for all layers, [2 (K/V), layers, pages, page_size, kv_heads, head_dim],
        # so a page move covers every layer in one indexing operation; per-layer views
        # k_buffers[l] / v_buffers[l] are contiguous [pages, page_size, kv_heads, head_dim].
        shape = (2, layout.num_layers, num_pages, page_size, layout.num_kv_heads, layout.head_dim)
        self.kv_buffer = torch.zeros(shape, dtype=layout.dtype, device=self.device)
        self.k_buffers = [self.kv_buffer[0, i] for i in range(layout.num_layers)]
        self.v_buffers = [self.kv_buffer[1, i] for i in range(layout.num_layers)]
        self.allocator = PageAllocator(num_pages)

    @property
    def bytes_per_page(self) -> int:
        return self.layout.bytes_per_token() * self.page_size

    def nbytes(self) -> int:
        return self.bytes_per_page * self.num_pages
