"""A sparse mixture-of-experts MLP (Qwen3-MoE's ``Qwen3MoeSparseMoeBlock``): a router picks each
token's top-k of ``num_experts`` SwiGLU experts and sums their outputs weighted by the router's
probabilities (softmax over all experts in float32, the top-k kept and, with ``norm_topk_prob``,
renormalized to sum to 1; then cast to the activations' dtype, as HF does).

The experts' weights are stacked: ``w13 [E, 2 I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]``,
loaded from HF's per-expert names (``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``,
:meth:`SparseMoE.load_expert`). The torch path groups the tokens by expert (one sort) and runs each
expert that has tokens on its rows. Under tensor parallelism every rank holds every expert's share
of the intermediate columns (gate/up rows, down columns: ``I / tp`` each) and the ranks' partial sums
are added by one all-reduce, as a dense MLP's down projection does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from serving.parallel.group import TPGroup


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp or TPGroup()
        if intermediate % self.tp.size:
            raise ValueError(f"--tp-size {self.tp.size} does not divide moe_intermediate_size {intermediate}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in 1..num_experts ({num_experts})")
        self.full_intermediate = intermediate
        self.inter = intermediate // self.tp.size  # this rank's columns of each expert
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # the router (HF's ``mlp.gate``)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, self.inter))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k] in x's dtype, expert ids [T, k])``."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # host: the experts' row counts
        tokens = order // self.top_k
        w = weights.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start:start + n]
            gate, up = F.linear(x[rows], self.w13[e]).split(self.inter, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[e]) * w[start:start + n, None]
            out.index_add_(0, rows, y.to(out.dtype))
            start += n
        return self.tp.all_reduce(out) if self.tp.is_parallel else out

    def load_expert(self, expert: int, proj: str, tensor: torch.Tensor) -> None:
        """HF's ``experts.{expert}.{proj}.weight`` (gate_proj / up_proj ``[I, H]``, down_proj ``[H, I]``),
        this rank's columns of it."""
        lo, n = self.tp.rank * self.inter, self.inter
        with torch.no_grad():
            if proj == "gate_proj":
                self.w13[expert, :n].copy_(tensor[lo:lo + n])
            elif proj == "up_proj":
                self.w13[expert, n:].copy_(tensor[lo:lo + n])
            elif proj == "down_proj":
                self.w2[expert].copy_(tensor[:, lo:lo + n])
            else:
                raise ValueError(f"unknown expert projection {proj!r}")
