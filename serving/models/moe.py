"""A sparse mixture-of-experts MLP: a router picks each token's top-k of ``num_experts`` gated experts
and sums their outputs weighted by the router's scores. The families differ in two small strategies
(:class:`MoEOptions`):

- **scoring** (``SCORINGS``): ``softmax_topk`` (Qwen3-MoE: softmax over every expert in float32, the
  top-k kept and, with ``renormalize``, rescaled to sum to 1) or ``topk_softmax`` (GPT-OSS: the top-k
  logits, a softmax over those k), then cast to the activations' dtype, as HF does; ``deepseek``
  (DeepSeek-V2: float32 router logits, softmax over every expert, the top-k of all (``n_group`` 1, HF's
  ``greedy``) or of the ``topk_group`` groups with the highest best expert (``group_limited_greedy``),
  then rescaled to sum to 1 with ``renormalize`` (DeepSeek's ``norm_topk_prob``), else multiplied by
  ``routed_scaling``; float32 weights, as HF's); ``noaux_tc`` (DeepSeek-V3: a float32 sigmoid per
  expert, the choice made on the scores plus the router's ``e_score_correction_bias``, groups ranked
  by the sum of their two best, the top-k of the ``topk_group`` best groups, weighted by the scores
  without the bias, rescaled to sum to 1 with ``renormalize``, then times ``routed_scaling``).
  ``router_bias``: the router has a bias (GPT-OSS);
- **activation** (``ACTIVATIONS``): ``silu`` (SwiGLU: ``silu(gate) * up``) or ``gpt_oss``
  (``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=l)``); experts may
  have biases (``expert_bias``: GPT-OSS).

The experts' weights are stacked: ``w13 [E, 2 I, H]`` (gate rows, then up rows), ``w2 [E, H, I]`` and,
with biases, ``b13 [E, 2 I]`` / ``b2 [E, H]``; the families' loaders fill them (:meth:`SparseMoE.load`).
The torch path groups the tokens by expert (one sort) and runs each expert that has tokens on its
rows. Under tensor parallelism every rank holds every expert's share of the intermediate columns
(``I / tp``) and the ranks' partial sums are added by one all-reduce, as a dense MLP's down projection
does (the down bias is added on rank 0 only, before the sum).

On CUDA the experts run in the fused Triton kernels of serving/kernels/triton_moe.py (tokens aligned
into expert blocks on the GPU, grouped GEMMs, the routing weights applied in the kernel): nothing is
read back to the host, so ``syncs_host`` is False there and the model's decode and extend steps are
captured in CUDA graphs. ``FUSED_KERNEL`` picks the path (None: on CUDA; True / False: always / never,
for A/B runs and the interpreter tests on a CPU).

``--quantization`` (serving/models/quant/apply.py) quantizes each expert's two projections on the torch
path (the CPU's int8 / int4 methods: the C++ ops, one call per expert that has tokens), with the
method's per-output-channel scales per expert; the router stays in the model's dtype (its top-k is
a choice between experts, which a rounding would change), as SGLang's and vLLM's quantized MoE keep
it. The fused CUDA kernels take float experts: there the experts keep the model's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from serving.models.quant.base import QuantMethod
from serving.parallel.group import TPGroup


@dataclass(frozen=True)
class MoEOptions:
    num_experts: int
    top_k: int
    intermediate: int  # each expert's (all ranks)
    scoring: str = "softmax_topk"  # a key of SCORINGS
    renormalize: bool = False  # softmax_topk, deepseek: the kept top-k rescaled to sum to 1
    n_group: int = 1  # deepseek, noaux_tc: the experts in n_group groups, the top-k from the best topk_group
    topk_group: int = 1
    routed_scaling: float = 1.0  # deepseek: the weights' factor (when not renormalized); noaux_tc: always
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"  # a key of ACTIVATIONS
    swiglu_alpha: float = 1.702  # gpt_oss
    swiglu_limit: float = 7.0  # gpt_oss

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be in 1..num_experts ({self.num_experts})")
        if self.scoring not in SCORINGS:
            raise ValueError(f"unknown MoE scoring {self.scoring!r}; supported: {sorted(SCORINGS)}")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group or \
                self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(f"MoE groups: {self.num_experts} experts in n_group {self.n_group}, top "
                             f"{self.top_k} of topk_group {self.topk_group} groups cannot be routed")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unsupported MoE expert activation {self.activation!r}; supported: {sorted(ACTIVATIONS)}")


def _silu_glu(gate: torch.Tensor, up: torch.Tensor, opts: MoEOptions) -> torch.Tensor:
    return F.silu(gate) * up


def _gpt_oss_glu(gate: torch.Tensor, up: torch.Tensor, opts: MoEOptions) -> torch.Tensor:
    gate = gate.clamp(max=opts.swiglu_limit)
    up = up.clamp(min=-opts.swiglu_limit, max=opts.swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * opts.swiglu_alpha))


ACTIVATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, MoEOptions], torch.Tensor]] = {
    "silu": _silu_glu, "gpt_oss": _gpt_oss_glu}

Routed = tuple[torch.Tensor, torch.Tensor]  # (weights [T, k], expert ids [T, k])


def _softmax_topk(gate: nn.Linear, x: torch.Tensor, opts: MoEOptions) -> Routed:
    top, ids = torch.topk(F.softmax(gate(x), dim=-1, dtype=torch.float32), opts.top_k, dim=-1)
    if opts.renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(x.dtype), ids


def _topk_softmax(gate: nn.Linear, x: torch.Tensor, opts: MoEOptions) -> Routed:
    top, ids = torch.topk(gate(x), opts.top_k, dim=-1)
    return F.softmax(top, dim=-1, dtype=top.dtype).to(x.dtype), ids


def _deepseek(gate: nn.Linear, x: torch.Tensor, opts: MoEOptions) -> Routed:
    scores = F.linear(x.float(), gate.weight.float()).softmax(dim=-1)  # [T, E] float32
    if opts.n_group > 1:  # group-limited: only the topk_group groups with the best single expert
        groups = scores.view(scores.shape[0], opts.n_group, -1)
        best = torch.topk(groups.amax(dim=-1), opts.topk_group, dim=-1).indices  # [T, topk_group]
        keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, best, True)
        scores = groups.masked_fill(~keep[..., None], 0.0).view_as(scores)
    top, ids = torch.topk(scores, opts.top_k, dim=-1)
    if opts.renormalize and opts.top_k > 1:
        return top / (top.sum(dim=-1, keepdim=True) + 1e-20), ids
    return top * opts.routed_scaling, ids


def _noaux_tc(gate: nn.Linear, x: torch.Tensor, opts: MoEOptions) -> Routed:
    scores = F.linear(x.float(), gate.weight.float()).sigmoid()  # [T, E] float32
    choice = scores + gate.e_score_correction_bias.float()
    groups = choice.view(choice.shape[0], opts.n_group, -1)
    if opts.n_group > 1:  # a group's rank: the sum of its two best experts
        rank = torch.topk(groups, min(2, groups.shape[-1]), dim=-1).values.sum(dim=-1)
        best = torch.topk(rank, opts.topk_group, dim=-1).indices
        keep = torch.zeros_like(rank, dtype=torch.bool).scatter_(1, best, True)
        choice = groups.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
    ids = torch.topk(choice, opts.top_k, dim=-1).indices
    top = scores.gather(1, ids)
    if opts.renormalize:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    return top * opts.routed_scaling, ids


SCORINGS: dict[str, Callable[[nn.Linear, torch.Tensor, MoEOptions], Routed]] = {
    "softmax_topk": _softmax_topk, "topk_softmax": _topk_softmax, "deepseek": _deepseek, "noaux_tc": _noaux_tc}


@dataclass(frozen=True)
class ExpertWeights:
    """Every expert's quantized projections: ``q13[e]`` (gate rows, then up rows) and ``q2[e]`` (down),
    each ``method.quantize``'s tensors of that expert's ``[out, in]`` weight."""

    method: QuantMethod
    q13: list[dict[str, torch.Tensor]]
    q2: list[dict[str, torch.Tensor]]


FUSED_KERNEL: bool | None = None  # None: the fused Triton kernels on CUDA, the torch path elsewhere


class SparseMoE(nn.Module):
    unquantized = ("gate",)  # the router: --quantization keeps it in the model's dtype (quant/apply.py)

    @property
    def syncs_host(self) -> bool:
        """The torch path reads the experts' token counts on the host: no CUDA graph can hold it
        (serving/runner/model_runner.py runs such models eagerly); the fused kernels read nothing back."""
        return self.quant is not None or not self._fused(self.w13)

    def _fused(self, t: torch.Tensor) -> bool:
        return self.fused_on(t.device)

    def fused_on(self, device: torch.device) -> bool:
        """Whether the experts run in the fused kernels on ``device`` (then they stay float under --quantization)."""
        from_kernel = device.type == "cuda" if FUSED_KERNEL is None else FUSED_KERNEL
        return from_kernel and self.opts.activation in ("silu", "gpt_oss")  # the kernel's activations

    def expert_shapes(self) -> dict[str, tuple[int, int]]:
        """One expert's projections, ``[out, in]`` (this rank's): what a quantization method must take."""
        return {"w13": (2 * self.inter, self.hidden), "w2": (self.hidden, self.inter)}

    def quantize_experts(self, method: QuantMethod) -> bool:
        """Replace the experts' float weights with ``method``'s tensors, expert by expert (the module
        docstring); False (nothing changed) where the fused kernels run them. The router is left as it is."""
        if self.quant is not None or self._fused(self.w13):
            return False
        for part, (out_f, in_f) in self.expert_shapes().items():  # QuantizationError naming them, before any change
            method.check_shape(f"experts.{part}", out_f, in_f)
        with torch.no_grad():
            q13 = [method.quantize(self.w13[e]) for e in range(self.num_experts)]
            q2 = [method.quantize(self.w2[e]) for e in range(self.num_experts)]
        self.quant = ExpertWeights(method, q13, q2)
        self.w13 = self.w2 = None  # the float copies go
        return True

    def __init__(self, hidden: int, opts: MoEOptions, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp or TPGroup()
        if opts.intermediate % self.tp.size:
            raise ValueError(f"--tp-size {self.tp.size} does not divide the experts' intermediate size "
                             f"{opts.intermediate}")
        self.opts = opts
        self.hidden = hidden
        self.inter = opts.intermediate // self.tp.size  # this rank's columns of each expert
        self.num_experts, self.top_k = opts.num_experts, opts.top_k
        self.gate = nn.Linear(hidden, opts.num_experts, bias=opts.router_bias)  # the router
        if opts.scoring == "noaux_tc":  # the choice's per-expert bias (a checkpoint tensor, not trained)
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(opts.num_experts))
        e = opts.num_experts
        self.w13 = nn.Parameter(torch.empty(e, 2 * self.inter, hidden))
        self.w2 = nn.Parameter(torch.empty(e, hidden, self.inter))
        self.b13 = nn.Parameter(torch.empty(e, 2 * self.inter)) if opts.expert_bias else None
        self.b2 = nn.Parameter(torch.empty(e, hidden)) if opts.expert_bias else None
        self.quant: ExpertWeights | None = None  # quantized experts (quantize_experts), the floats gone

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k], expert ids [T, k])`` by the options' scoring (``SCORINGS``); a few tokens on
        the fused path through the routing kernel where it computes that scoring (one launch after the
        router's GEMM instead of four)."""
        if self._decode_sized(x):
            from serving.kernels import triton_moe_decode as dec  # triton: a GPU-side import

            if self.opts.scoring in dec.SCORINGS:
                return dec.route_topk(self.gate(x), self.top_k, self.opts.scoring, self.opts.renormalize, x.dtype)
        return SCORINGS[self.opts.scoring](self.gate, x, self.opts)

    def _decode_sized(self, x: torch.Tensor) -> bool:
        """Whether ``x``'s tokens take the fused matrix-vector kernels (serving/kernels/triton_moe_decode.py)."""
        if not self._fused(x):
            return False
        from serving.kernels.triton_moe_decode import use_decode_path

        return use_decode_path(x.shape[0], self.top_k, self.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is None and self._fused(x):
            out = self._forward_fused(x)
            return self.tp.all_reduce(out) if self.tp.is_parallel else out
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # host: the experts' row counts
        tokens = order // self.top_k
        w = weights.reshape(-1)[order]
        act = ACTIVATIONS[self.opts.activation]
        down_bias = self.b2 is not None and self.tp.rank == 0
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start:start + n]
            h = self.project(x[rows], e, 0, None if self.b13 is None else self.b13[e])
            gate, up = h.split(self.inter, dim=-1)
            y = self.project(act(gate, up, self.opts), e, 1, self.b2[e] if down_bias else None)
            out.index_add_(0, rows, (y * w[start:start + n, None]).to(out.dtype))
            start += n
        return self.tp.all_reduce(out) if self.tp.is_parallel else out

    def _forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """The Triton kernels (GPU-side imports): a few tokens through the matrix-vector kernels
        (serving/kernels/triton_moe_decode.py), more through the blocked ones (serving/kernels/triton_moe.py)."""
        from serving.kernels import triton_moe
        from serving.kernels import triton_moe_decode as dec

        o = self.opts
        b2 = self.b2 if self.tp.rank == 0 else None
        weights, ids = self.route(x)
        if self._decode_sized(x):
            return dec.moe_decode(x, weights, ids, self.w13, self.w2, self.b13, b2, o.activation,
                                  o.swiglu_alpha, o.swiglu_limit)
        return triton_moe.fused_moe(x, weights, ids, self.w13, self.w2, self.b13, b2, o.activation,
                                    o.swiglu_alpha, o.swiglu_limit)

    def project(self, x: torch.Tensor, expert: int, which: int, bias: torch.Tensor | None) -> torch.Tensor:
        """Expert ``expert``'s gate/up (``which`` 0) or down (1) projection of ``x``, float or quantized."""
        if self.quant is None:
            return F.linear(x, (self.w13, self.w2)[which][expert], bias)
        y = self.quant.method.matmul(x, (self.quant.q13, self.quant.q2)[which][expert])
        return y if bias is None else y + bias

    def load(self, expert: int, part: str, tensor: torch.Tensor) -> None:
        """Expert ``expert``'s ``part`` in HF's orientation (``[out, in]``): ``gate`` / ``up`` ``[I, H]``,
        ``down`` ``[H, I]``, ``gate_bias`` / ``up_bias`` ``[I]``, ``down_bias`` ``[H]``; this rank's
        columns of it."""
        lo, n = self.tp.rank * self.inter, self.inter
        with torch.no_grad():
            if part in ("gate", "up"):
                self.w13[expert, (0 if part == "gate" else n):][:n].copy_(tensor[lo:lo + n])
            elif part == "down":
                self.w2[expert].copy_(tensor[:, lo:lo + n])
            elif part in ("gate_bias", "up_bias") and self.b13 is not None:
                self.b13[expert, (0 if part == "gate_bias" else n):][:n].copy_(tensor[lo:lo + n])
            elif part == "down_bias" and self.b2 is not None:
                self.b2[expert].copy_(tensor)
            else:
                raise ValueError(f"an expert has no {part!r} here")
