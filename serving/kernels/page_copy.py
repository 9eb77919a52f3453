"""Moving scattered pages between the L1 pool and the L2 host pool.

Every move covers all layers, K and V, of a whole list of pages in one gather and one
scatter (never one copy call per page), through staging buffers that are reused, so
no call pays for fresh memory. On CPU this is torch indexing; on CUDA the gather runs
on the device, one bulk copy crosses PCIe through pinned memory, and the scatter
runs on the other side.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hicache.tiers.host import HostKVPool


def _flat(kv_buffer: torch.Tensor) -> torch.Tensor:
    # [2, L, P, ps, H, D] -> [2L, P, ps*H*D]
    two, layers, pages = kv_buffer.shape[:3]
    return kv_buffer.view(two * layers, pages, -1)


class PageMover:
    """Copies pages between one device pool buffer and one host pool. One user at a time
    per direction (the controller serializes loads on one thread; backups run on the
    scheduler thread)."""

    def __init__(self, kv_buffer: torch.Tensor, host: HostKVPool) -> None:
        self.dev = _flat(kv_buffer)  # [2L, P, X]
        self.host = host
        self._bufs: dict[str, torch.Tensor] = {}

    def _staging(self, name: str, n: int, device: torch.device, pin: bool = False) -> torch.Tensor:
        rows, x = self.dev.shape[0], self.dev.shape[2]
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < rows * n * x:
            buf = torch.empty(rows * n * x, dtype=self.dev.dtype, device=device, pin_memory=pin)
            self._bufs[name] = buf
        return buf[: rows * n * x].view(rows, n, x)

    def _ids(self, pages: Sequence[int], device: torch.device) -> torch.Tensor:
        return torch.tensor(list(pages), dtype=torch.int64, device=device)

    def device_to_host(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        n, dev = len(device_pages), self.dev.device
        gathered = torch.index_select(self.dev, 1, self._ids(device_pages, dev),
                                      out=self._staging("out_dev", n, dev))  # [2L, n, X]
        if dev.type != "cpu":
            pinned = self._staging("out_host", n, torch.device("cpu"), pin=self.host.pin)
            pinned.copy_(gathered)
            gathered = pinned
        self.host.write_pages(self._ids(host_pages, torch.device("cpu")), gathered)

    def host_to_device(self, host_pages: Sequence[int], device_pages: Sequence[int],
                       non_blocking: bool = False) -> None:
        n, dev = len(host_pages), self.dev.device
        cpu = torch.device("cpu")
        src = self.host.read_pages(self._ids(host_pages, cpu),
                                   out=self._staging("in_host", n, cpu, pin=self.host.pin and dev.type != "cpu"))
        if dev.type != "cpu":
            staged = self._staging("in_dev", n, dev)
            staged.copy_(src, non_blocking=non_blocking)
            src = staged
        self.dev.index_copy_(1, self._ids(device_pages, dev), src)


def device_to_host(kv_buffer: torch.Tensor, host: HostKVPool, device_pages: Sequence[int],
                   host_pages: Sequence[int]) -> None:
    """One-off move (tests, tools); hot paths keep a :class:`PageMover`."""
    PageMover(kv_buffer, host).device_to_host(device_pages, host_pages)


def host_to_device(host: HostKVPool, kv_buffer: torch.Tensor, host_pages: Sequence[int],
                   device_pages: Sequence[int]) -> None:
    PageMover(kv_buffer, host).host_to_device(host_pages, device_pages)
