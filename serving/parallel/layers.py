"""Layers whose forward needs the TP group: row-parallel linear, vocab-parallel embedding and
LM head. Column-parallel layers are plain ``nn.Linear`` with the rank's output rows (no
communication). Each is the plain single-GPU layer when the group has one rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from serving.parallel.group import TPGroup
from serving.parallel.shard import ShardPlan


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ W_local^T) + b``: the weight holds this rank's input columns;
    the bias (full) is added once, after the sum."""

    def __init__(self, in_local: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tp.is_parallel:
            return F.linear(x, self.weight, self.bias)
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows ``[vocab_start, vocab_start + vocab_per_rank)`` of the table on each rank; ids
    outside a rank's range give zeros there, and an all-reduce assembles the rows."""

    def __init__(self, plan: ShardPlan, hidden: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp, self.plan = tp, plan
        self.weight = nn.Parameter(torch.empty(plan.vocab_per_rank, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.is_parallel:
            return F.embedding(ids, self.weight)
        start = self.plan.vocab_start
        inside = (ids >= start) & (ids < start + self.plan.vocab_valid)
        out = F.embedding(torch.where(inside, ids - start, 0), self.weight)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)


def parallel_logits(h: torch.Tensor, weight: torch.Tensor, plan: ShardPlan, tp: TPGroup,
                    matmul: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """``[B, vocab]`` float32 logits from this rank's vocab rows of the LM head: each rank
    computes its slice, an all-gather concatenates them (padding rows cut off). ``matmul``
    (a quantized head, serving.models.quant) replaces ``h @ weight^T`` when given."""
    local = (F.linear(h, weight) if matmul is None else matmul(h)).float()
    if not tp.is_parallel:
        return local
    return tp.all_gather_last(local)[:, : plan.vocab]
