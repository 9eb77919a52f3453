"""TPGroup: this process's place in a tensor-parallel group and the collectives the model uses.

``TPGroup()`` is the single-rank group (every collective is the identity), so the model code
has one path. ``init_tp_group`` joins a real group through ``torch.distributed``: NCCL on CUDA,
gloo on CPU, with a timeout on every collective, so a rank that dies makes the others raise
instead of hanging in a collective forever.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class TPGroup:
    """Rank ``rank`` of ``size``; ``group`` is the torch.distributed process group (None: single rank).

    Concurrency: collectives are called only from the thread that runs the forward pass (the
    scheduler's on rank 0, the command loop's on followers), in the same order on every rank.
    """

    rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"bad tensor-parallel rank {self.rank} of {self.size}")

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (the identity on one rank)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dim, rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank, in place."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.group)
        return x

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.group)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_tp_group(rank: int, size: int, init_method: str, device: torch.device,
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> TPGroup:
    """Join the default process group as ``rank`` of ``size`` (``init_method``: e.g.
    ``tcp://127.0.0.1:PORT`` or ``file:///path``) and return its TPGroup."""
    if size == 1:
        return TPGroup()
    backend = backend_for(device)
    if backend == "nccl":  # a collective that outlives the timeout raises instead of hanging
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    kw = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s), **kw)
    return TPGroup(rank, size, dist.group.WORLD)


def destroy_tp_group(tp: TPGroup) -> None:
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
