"""L1: the paged KV pool on the compute device (a GPU, or the CPU when there is none)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache.tiers.allocator import PageAllocator
from hicache.tiers.window_pages import WindowedPageAllocator, WindowPages


@dataclass(frozen=True)
class KVLayout:
    """Shape of the KV cache of one model: what a page holds.

    ``format``: ``"mha"``, per-head K and V; ``"mla"``, a multi-head latent attention model's latent
    (DeepSeek: the normed ``kv_lora_rank`` vector and the rope'd key part, one row per token), held once:
    one "kv head" whose K plane stores the row's first half and whose V plane its second (:meth:`latent`),
    so the pool, L2 pages and L3 payloads carry the latent and nothing else. The format is part of the
    L3 namespace (hicache.keys), so a latent page never matches another layout's."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    format: str = "mha"

    @staticmethod
    def latent(num_layers: int, width: int, dtype: torch.dtype) -> KVLayout:
        """An MLA layout of ``width`` (even) latent elements per token and layer."""
        if width % 2:
            raise ValueError(f"an MLA latent of {width} elements: the cache splits it in two halves, it must be even")
        return KVLayout(num_layers, 1, width // 2, dtype, "mla")

    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


class DeviceKVPool:
    """Per layer K and V tensors of ``[num_pages, page_size, kv_heads, head_dim]``.

    With ``window_layers`` (a hybrid SWA pool, hicache/tiers/window_pages.py) the KV layers listed
    there (sliding-window layers) live in a second buffer of ``window_pages`` pages, indexed by
    window page ids (``windows.map[logical page]``); ``k_buffers[l]`` / ``v_buffers[l]`` are then
    that buffer's ``[window_pages, page_size, kv_heads, head_dim]`` views. ``kv_buffer`` holds the
    other (full) layers, ``win_buffer`` the window layers; ``full_layers`` / ``window_layers`` say
    which KV layer each row of them is.

    Contract:
    - Page ids come from ``self.allocator`` (window page ids from ``self.windows``); the tensors are
      never resized.
    - Writers: the model's KV-store kernel (new tokens) and the cache controller
      (load-back from L2). Both run on the scheduler's thread / stream order.
    - No locking: one scheduler owns the pool.
    """

    def __init__(self, layout: KVLayout, num_pages: int, page_size: int, device: torch.device | str,
                 window_layers: tuple[int, ...] = (), window_pages: int = 0) -> None:
        self.layout = layout
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = torch.device(device)
        self.window_layers = tuple(window_layers)
        self.full_layers = tuple(i for i in range(layout.num_layers) if i not in self.window_layers)
        # One buffer for all (full) layers, [2 (K/V), layers, pages, page_size, kv_heads, head_dim],
        # so a page move covers every layer in one indexing operation; per-layer views
        # k_buffers[l] / v_buffers[l] are contiguous [pages, page_size, kv_heads, head_dim].
        tail = (page_size, layout.num_kv_heads, layout.head_dim)
        self.kv_buffer = torch.zeros((2, len(self.full_layers), num_pages, *tail), dtype=layout.dtype,
                                     device=self.device)
        self.windows: WindowPages | None = None
        self.win_buffer: torch.Tensor | None = None
        if self.window_layers:
            self.windows = WindowPages(num_pages, window_pages)
            self.win_buffer = torch.zeros((2, len(self.window_layers), window_pages, *tail), dtype=layout.dtype,
                                          device=self.device)
            self.allocator: PageAllocator = WindowedPageAllocator(num_pages, self.windows)
        else:
            self.allocator = PageAllocator(num_pages)
        self.k_buffers: list[torch.Tensor] = [None] * layout.num_layers  # type: ignore[list-item]
        self.v_buffers: list[torch.Tensor] = [None] * layout.num_layers  # type: ignore[list-item]
        for row, i in enumerate(self.full_layers):
            self.k_buffers[i], self.v_buffers[i] = self.kv_buffer[0, row], self.kv_buffer[1, row]
        for row, i in enumerate(self.window_layers):
            self.k_buffers[i], self.v_buffers[i] = self.win_buffer[0, row], self.win_buffer[1, row]

    @property
    def window_pages(self) -> int:
        return 0 if self.windows is None else self.windows.num_pages

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page of every KV layer (what an L2 / L3 page holds)."""
        return self.layout.bytes_per_token() * self.page_size

    def nbytes(self) -> int:
        per_layer = self.bytes_per_page // self.layout.num_layers
        return per_layer * (len(self.full_layers) * self.num_pages + len(self.window_layers) * self.window_pages)
