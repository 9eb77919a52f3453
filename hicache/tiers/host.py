"""L2: the host-memory KV pool (pinned when CUDA is present), in one of two layouts (the pool's base:
hicache/tiers/host_base.py; encoded pages: hicache/tiers/host_encoded.py)."""

from __future__ import annotations

import threading

import torch

from hicache.tiers.device import KVLayout
from hicache.tiers.host_base import HostKVPool
from hicache.tiers.host_encoded import EncodedHostPool
from hicache.tiers.host_pages import GrowingPageAllocator
from hicache.tiers.host_pinning import HOLD_ENV
from hicache.tiers.host_windows import HostWindows
from hicache.tiers.kv_codec import get_encoding

__all__ = ["HOLD_ENV", "EncodedHostPool", "GrowingPageAllocator", "HostKVPool", "HostWindows", "host_num_pages",
           "make_host_pool"]


class LayerFirstHostPool(HostKVPool):
    """``[2 * layers, pages, row_elems]``: the device pool's own layout."""

    layout_name = "layer_first"
    page_dim = 1

    def _shape(self) -> tuple[int, ...]:
        return (self.rows, self.num_pages, self.row_elems)

    def _read_rows(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        self.wait_pending_writes()
        return torch.index_select(self.buffer, 1, ids, out=out) if out is not None else \
            self.buffer.index_select(1, ids)

    def _write_rows(self, ids: torch.Tensor, kv: torch.Tensor) -> None:
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

    def _read_rows(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        self.wait_pending_writes()
        pages = torch.index_select(self.buffer, 0, ids, out=self._stage(len(ids)))  # [n, 2L, X]
        if out is None:
            return pages.transpose(0, 1).contiguous()  # [2L, n, X]
        return out.copy_(pages.transpose(0, 1))

    def _write_rows(self, ids: torch.Tensor, kv: torch.Tensor) -> None:
        self.wait_pending_writes()
        staged = self._stage(len(ids)).copy_(kv.transpose(0, 1))  # [2L, n, X] -> [n, 2L, X]
        self.buffer.index_copy_(0, ids, staged)


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
                   encoding: str = "raw", background: bool = False, pin_memory: bool | None = None,
                   window_layers: tuple[int, ...] = (), window_pages: int = 0) -> HostKVPool:
    """``background``: pin in the background (see HostKVPool); only for a pool whose pages no
    other process follows (tensor-parallel ranks pin theirs whole before serving). ``pin_memory``:
    None pins wherever CUDA is available; an engine on the CPU passes False. ``window_layers`` /
    ``window_pages``: a host window pool (hicache/tiers/host_windows.py) for a raw encoding; an encoded
    pool keeps every layer in its pages (their sliding part flagged by ``sliding_valid``)."""
    try:
        cls = HOST_LAYOUTS[name]
    except KeyError:
        raise ValueError(f"unknown hicache_mem_layout {name!r}; choose from {sorted(HOST_LAYOUTS)}") from None
    if get_encoding(encoding).lossy:
        return EncodedHostPool(layout, num_pages, page_size, encoding, name, pin_memory, background)
    return cls(layout, num_pages, page_size, pin_memory, background, window_layers, window_pages)
