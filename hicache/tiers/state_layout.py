"""The shape of a recurrent-state snapshot: what one state slot holds (linear-attention and Mamba
layers keep a state per sequence instead of KV per token).

A slot holds, for each state layer in order, a few tensors (Gated DeltaNet and Mamba2: the short
convolution's last inputs and the recurrent state). Every tier stores a snapshot as these tensors
in this order; ``bytes_per_slot`` sizes the pools.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateTensor:
    """One tensor of one layer's state, without the slot dimension."""

    name: str  # "conv" | "recurrent" (what it is, for logs and errors)
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class StateLayout:
    """Per state layer, its tensors. Empty: the model has no state layers."""

    layers: tuple[tuple[StateTensor, ...], ...]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def bytes_per_slot(self) -> int:
        return sum(t.nbytes for layer in self.layers for t in layer)
