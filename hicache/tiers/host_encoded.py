"""L2 pages held encoded (``fp8`` / ``int8``, :mod:`hicache.tiers.kv_codec`): :class:`EncodedHostPool`."""

from __future__ import annotations

import torch

from hicache.tiers.device import KVLayout
from hicache.tiers.host_base import HostKVPool
from hicache.tiers.kv_codec import get_encoding


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

    _read_rows = read_pages  # every layer in ``buffer`` (an encoded pool has no host window pool)
    _write_rows = write_pages
