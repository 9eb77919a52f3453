"""Mamba2 mixer (Nemotron-H's ``M`` blocks; Falcon-H1 and Granite-4 use the same SSD layer): a token
mixer with a recurrent state.

``in_proj`` gives the gate z, ``xBC`` and ``dt``; ``xBC`` goes through a causal short conv (with bias)
and SiLU, then splits into x ``[heads, head_dim]`` and B, C ``[n_groups, state_size]`` (head ``h``
reads group ``h // (heads / n_groups)``). Per token and head, with ``dt = max(softplus(dt +
dt_bias), time_step_min)`` and ``A = -exp(A_log)``:

    S = exp(dt * A) * S + dt * x B^T;   y = S C + D * x

and the output is ``out_proj(w * rmsnorm_groups(y * silu(z)))``. A sequence's state is its slot in
the state pool: the conv's last ``conv_kernel - 1`` inputs ``[conv_dim, K - 1]`` and ``S``
``[heads, head_dim, state_size]`` (float32). Parameter names are HF's (``NemotronHMamba2Mixer``).
Under tensor parallelism (``tp``) the mixer holds its rank's heads and groups
(serving/parallel/state_shard.py: the sizes above are then the rank's, and so is its state) and
out_proj sums the ranks' parts.

HF clamps dt at ``time_step_min`` in its chunked prefill but not in its one-token decode step; we
clamp every token (the same state whatever the chunking; the two differ only when softplus gives
less than ``time_step_min``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hicache.tiers.state_layout import StateTensor
from serving.models.hybrid_parts import GatedRMSNorm, activation
from serving.models.state_kernels import backend_for, ssd
from serving.models.state_scan import StatePlan, causal_conv
from serving.parallel.group import TPGroup
from serving.parallel.layers import RowParallelLinear
from serving.parallel.state_shard import Blocks, Mamba2Shard


class Mamba2Mixer(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, state_size: int, n_groups: int,
                 conv_kernel: int, eps: float, conv_bias: bool = True, proj_bias: bool = False,
                 time_step_min: float = 0.0, act: str = "silu", tp: TPGroup | None = None) -> None:
        super().__init__()
        if num_heads % n_groups:
            raise ValueError(f"mamba_num_heads {num_heads} is not a multiple of n_groups {n_groups}")
        tp = tp or TPGroup()
        self.shard = Mamba2Shard.make(num_heads, n_groups, head_dim, state_size, tp.rank, tp.size)
        num_heads, n_groups = self.shard.heads, self.shard.groups  # this rank's
        self.num_heads, self.head_dim, self.state_size, self.n_groups = num_heads, head_dim, state_size, n_groups
        self.intermediate = num_heads * head_dim
        self.conv_dim = self.intermediate + 2 * n_groups * state_size
        self.conv_kernel = conv_kernel
        self.time_step_min = time_step_min
        self.act = activation(act, "Mamba2 conv")
        self.in_proj = nn.Linear(hidden_size, self.intermediate + self.conv_dim + num_heads, bias=proj_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=conv_bias,
                                padding=conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(num_heads))
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.D = nn.Parameter(torch.ones(num_heads))
        self.norm = GatedRMSNorm(self.intermediate, eps, group_size=self.intermediate // n_groups,
                                 norm_before_gate=False)
        self.out_proj = RowParallelLinear(self.intermediate, hidden_size, proj_bias, tp)

    def tp_source(self, leaf: str) -> Blocks | None:
        """This rank's blocks of the HF tensor ``leaf`` (e.g. ``in_proj.weight``); None: whole."""
        return self.shard.source(leaf)

    def state_tensors(self, dtype: torch.dtype) -> tuple[StateTensor, ...]:
        return (StateTensor("conv", (self.conv_dim, self.conv_kernel - 1), dtype),
                StateTensor("recurrent", (self.num_heads, self.head_dim, self.state_size), torch.float32))

    def forward(self, x: torch.Tensor, plan: StatePlan, conv_state: torch.Tensor,
                recurrent: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` (the batch's new tokens) -> ``[T, hidden]``; the pool's state tensors of
        this layer are read at ``plan.slots`` and updated there (and at the snapshot slots)."""
        t = x.shape[0]
        gate, xbc, dt = self.in_proj(x).split([self.intermediate, self.conv_dim, self.num_heads], dim=-1)
        xbc = self.act(causal_conv(xbc, conv_state, self.conv1d.weight.squeeze(1), self.conv1d.bias, plan))
        gs = self.n_groups * self.state_size
        xs, b, c = xbc.float().split([self.intermediate, gs, gs], dim=-1)
        xs = xs.view(t, self.num_heads, self.head_dim)
        b = b.view(t, self.n_groups, self.state_size)
        c = c.view(t, self.n_groups, self.state_size)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(min=self.time_step_min)  # [T, H]
        y = ssd(xs, dt, -self.A_log.float().exp(), b, c, recurrent, plan, backend_for(x), x.dtype)
        y = y + self.D.float()[:, None] * xs
        return self.out_proj(self.norm(y.reshape(t, self.intermediate), gate).to(x.dtype))  # HF: norm in float32
