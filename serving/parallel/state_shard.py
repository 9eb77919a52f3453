"""How the recurrent-state layers split over tensor-parallel ranks: by head, as the attention heads do.

- Gated DeltaNet (serving/models/gated_deltanet.py): key heads and value heads evenly (value head
  ``h`` reads key head ``h // (Hv / Hk)``, so a rank's value heads read exactly its key heads). The
  q/k/v projection and the short conv over its channels are cut per block (the rank's q rows, its k
  rows, its v rows), z / b / a / A_log / dt_bias per value head; the gated norm is per head (its
  weight, ``head_v_dim`` long, whole on every rank); out_proj is row-parallel (one all-reduce).
- Mamba2 (serving/models/mamba2.py): heads and groups evenly (head ``h`` reads group ``h // (H /
  G)``). in_proj's rows are cut per block (gate, x, B, C, dt), the conv over x / B / C likewise,
  A_log / dt_bias / D per head, the group norm's weight per group; out_proj is row-parallel.

Each rank's state (its slot in the state pool) then holds its own heads only: the conv's channels
of its blocks and the recurrent state of its heads. :class:`TPShapeError` names a model that
cannot be split so. ``source`` answers (dim, [(start, length), ...]) of an HF tensor: the rank's
blocks, concatenated along ``dim`` (:func:`narrow_blocks`); None for a tensor held whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from serving.parallel.shard import TPShapeError, narrow

Blocks = tuple[int, list[tuple[int, int]]]


def _check(what: str, n: int, size: int) -> None:
    if n % size:
        raise TPShapeError(f"--tp-size {size} does not divide the model's {n} {what}")


@dataclass(frozen=True)
class DeltaNetShard:
    """One rank's part of a Gated DeltaNet layer (global sizes ``*_all``, local ones without)."""

    rank: int
    size: int
    k_heads: int
    v_heads: int
    head_k_dim: int
    head_v_dim: int
    k_heads_all: int
    v_heads_all: int

    @staticmethod
    def make(k_heads: int, v_heads: int, head_k_dim: int, head_v_dim: int, rank: int = 0,
             size: int = 1) -> DeltaNetShard:
        _check("Gated DeltaNet key heads (linear_num_key_heads)", k_heads, size)
        _check("Gated DeltaNet value heads (linear_num_value_heads)", v_heads, size)
        return DeltaNetShard(rank, size, k_heads // size, v_heads // size, head_k_dim, head_v_dim, k_heads, v_heads)

    def source(self, leaf: str) -> Blocks | None:
        if self.size == 1:
            return None
        kd, vd = self.k_heads * self.head_k_dim, self.v_heads * self.head_v_dim
        k_all = self.k_heads_all * self.head_k_dim
        r = self.rank
        if leaf in ("in_proj_qkv.weight", "conv1d.weight", "conv1d.bias"):
            return 0, [(r * kd, kd), (k_all + r * kd, kd), (2 * k_all + r * vd, vd)]
        if leaf in ("in_proj_z.weight", "in_proj_z.bias"):
            return 0, [(r * vd, vd)]
        if leaf.split(".")[0] in ("in_proj_b", "in_proj_a", "dt_bias", "A_log"):
            return 0, [(r * self.v_heads, self.v_heads)]
        if leaf == "out_proj.weight":
            return 1, [(r * vd, vd)]
        return None  # the per-head norm's weight, out_proj's bias (added once)


@dataclass(frozen=True)
class Mamba2Shard:
    """One rank's part of a Mamba2 mixer (global sizes ``*_all``, local ones without)."""

    rank: int
    size: int
    heads: int
    groups: int
    head_dim: int
    state_size: int
    heads_all: int
    groups_all: int

    @staticmethod
    def make(heads: int, groups: int, head_dim: int, state_size: int, rank: int = 0, size: int = 1) -> Mamba2Shard:
        _check("Mamba2 heads (mamba_num_heads)", heads, size)
        _check("Mamba2 groups (n_groups)", groups, size)
        return Mamba2Shard(rank, size, heads // size, groups // size, head_dim, state_size, heads, groups)

    def source(self, leaf: str) -> Blocks | None:
        if self.size == 1:
            return None
        r = self.rank
        inter, inter_all = self.heads * self.head_dim, self.heads_all * self.head_dim
        gs, gs_all = self.groups * self.state_size, self.groups_all * self.state_size
        xbc = [(r * inter, inter), (inter_all + r * gs, gs), (inter_all + gs_all + r * gs, gs)]
        if leaf.startswith("in_proj."):  # [gate, x, B, C, dt]
            conv_all = inter_all + 2 * gs_all
            return 0, [(r * inter, inter), *((inter_all + s, n) for s, n in xbc),
                       (inter_all + conv_all + r * self.heads, self.heads)]
        if leaf.startswith("conv1d."):
            return 0, xbc
        if leaf in ("dt_bias", "A_log", "D"):
            return 0, [(r * self.heads, self.heads)]
        if leaf == "norm.weight":
            return 0, [(r * inter, inter)]
        if leaf == "out_proj.weight":
            return 1, [(r * inter, inter)]
        return None  # out_proj's bias (added once)


def narrow_blocks(src: Any, blocks: Blocks | None) -> torch.Tensor:
    """``src`` (a tensor or a lazy safetensors slice) cut to ``blocks``, concatenated along their dim."""
    if blocks is None:
        return narrow(src, None)
    dim, parts = blocks
    pieces = [narrow(src, (dim, start, length)) for start, length in parts]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)
