"""Moving scattered pages between the L1 pool and the L2 host pool.

Every move covers all layers, K and V, of a whole list of pages in one gather and one
scatter (never one copy call per page). On CPU this is torch indexing; on CUDA the
gather runs on the device, one bulk copy crosses PCIe into pinned memory, and the
scatter runs on the other side.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hicache.tiers.host import HostKVPool


def _ids(pages: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(pages), dtype=torch.int64, device=device)


def device_to_host(
    kv_buffer: torch.Tensor,  # [2, L, P, ps, H, D] on the device
    host: HostKVPool,
    device_pages: Sequence[int],
    host_pages: Sequence[int],
    non_blocking: bool = False,
) -> None:
    src = kv_buffer.index_select(2, _ids(device_pages, kv_buffer.device))  # [2, L, n, ps, H, D]
    if src.device.type != "cpu":
        staging = torch.empty(src.shape, dtype=src.dtype, pin_memory=host.pin)
        staging.copy_(src, non_blocking=non_blocking)
        if non_blocking:
            torch.cuda.current_stream(src.device).synchronize()
        src = staging
    host.write_pages(_ids(host_pages, torch.device("cpu")), src)


def host_to_device(
    host: HostKVPool,
    kv_buffer: torch.Tensor,  # [2, L, P, ps, H, D] on the device
    host_pages: Sequence[int],
    device_pages: Sequence[int],
    non_blocking: bool = False,
) -> None:
    src = host.read_pages(_ids(host_pages, torch.device("cpu")))  # [2, L, n, ps, H, D]
    if kv_buffer.device.type != "cpu":
        if host.pin:
            src = src.contiguous().pin_memory() if not src.is_pinned() else src.contiguous()
        src = src.to(kv_buffer.device, non_blocking=non_blocking)
    kv_buffer.index_copy_(2, _ids(device_pages, kv_buffer.device), src)
