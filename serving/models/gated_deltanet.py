"""Gated DeltaNet (Qwen3.5, Qwen3-Next's linear attention): a token mixer with a recurrent state.

Per token: the input projections give q, k, v (through a causal short conv with SiLU), the gate z,
beta = sigmoid(b) and the decay g = -exp(A_log) * softplus(a + dt_bias). q and k are L2-normalized
(q also scaled by ``head_k_dim ** -0.5``); each of the ``num_v_heads`` heads keeps a state
``S [head_k_dim, head_v_dim]`` updated by the gated delta rule

    S = exp(g) * S;   S = S + k (beta * (v - S^T k))^T;   o = S^T q

and the output is ``out_proj(gated_rmsnorm(o, z))`` (the rule runs in serving/models/state_kernels.py:
the torch scan, or fla-core on CUDA). Key heads are shared by
``num_v_heads // num_k_heads`` consecutive value heads. A sequence's state is its slot in the state
pool: the conv's last ``conv_kernel - 1`` inputs ``[conv_dim, K - 1]`` and ``S`` per head
``[num_v_heads, head_k_dim, head_v_dim]`` (float32). Parameter names are HF's
(``Qwen3_5GatedDeltaNet``). Under tensor parallelism (``tp``) the layer holds its rank's heads
(serving/parallel/state_shard.py: the sizes above are then the rank's, and so is its state) and
out_proj sums the ranks' parts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hicache.tiers.state_layout import StateTensor
from serving.models.hybrid_parts import GatedRMSNorm, activation
from serving.models.state_kernels import backend_for, gated_delta_rule
from serving.models.state_scan import StatePlan, causal_conv
from serving.parallel.group import TPGroup
from serving.parallel.layers import RowParallelLinear
from serving.parallel.state_shard import Blocks, DeltaNetShard


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (FLA's and HF's form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int, eps: float, act: str = "silu", tp: TPGroup | None = None) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads {num_v_heads} is not a multiple of linear_num_key_heads "
                             f"{num_k_heads}")
        tp = tp or TPGroup()
        self.shard = DeltaNetShard.make(num_k_heads, num_v_heads, head_k_dim, head_v_dim, tp.rank, tp.size)
        num_k_heads, num_v_heads = self.shard.k_heads, self.shard.v_heads  # this rank's
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        self.act = activation(act, "Gated DeltaNet conv")
        self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False,
                                padding=conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps, norm_before_gate=True)
        self.out_proj = RowParallelLinear(self.value_dim, hidden_size, False, tp)

    def tp_source(self, leaf: str) -> Blocks | None:
        """This rank's blocks of the HF tensor ``leaf`` (e.g. ``conv1d.weight``); None: whole."""
        return self.shard.source(leaf)

    def state_tensors(self, dtype: torch.dtype) -> tuple[StateTensor, ...]:
        return (StateTensor("conv", (self.conv_dim, self.conv_kernel - 1), dtype),
                StateTensor("recurrent", (self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32))

    def forward(self, x: torch.Tensor, plan: StatePlan, conv_state: torch.Tensor,
                recurrent: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` (the batch's new tokens) -> ``[T, hidden]``; the pool's state tensors of
        this layer are read at ``plan.slots`` and updated there (and at the snapshot slots)."""
        t = x.shape[0]
        mixed = self.act(causal_conv(self.in_proj_qkv(x), conv_state, self.conv1d.weight.squeeze(1), None, plan))
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2norm(q.float().view(t, self.num_k_heads, self.head_k_dim))
        k = l2norm(k.float().view(t, self.num_k_heads, self.head_k_dim))
        v = v.view(t, self.num_v_heads, self.head_v_dim)
        beta = self.in_proj_b(x).float().sigmoid()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())  # log decay
        o = gated_delta_rule(q, k, v, g, beta, self.head_k_dim**-0.5, recurrent, plan, backend_for(x))
        z = self.in_proj_z(x).view(t, self.num_v_heads, self.head_v_dim)
        o = self.norm(o.to(x.dtype), z).reshape(t, self.value_dim)
        return self.out_proj(o)
