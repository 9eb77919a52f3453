"""DeepSeek-V2 (and V2-Lite): Llama's pre-norm block with multi-head latent attention
(serving/models/mla.py: the cache holds the latent once per token) and DeepSeek's mixture of experts.

The MLP of layer ``i`` is a mixture of experts when the model has routed experts, ``i >=
first_k_dense_replace`` and ``i % moe_layer_freq == 0`` (DeepSeek's rule; HF's port reads the first
only, the same for every released checkpoint), else the dense SwiGLU of ``intermediate_size``. The
mixture (serving/models/moe.py, scoring ``deepseek``): a float32 softmax router over
``n_routed_experts``, the top ``num_experts_per_tok`` of every expert (``topk_method`` ``greedy``) or
of the ``topk_group`` best of ``n_group`` groups (``group_limited_greedy``), weighted by their scores
times ``routed_scaling_factor``, plus ``n_shared_experts`` always-on experts: one SwiGLU of
``n_shared_experts * moe_intermediate_size`` added to the routed sum.

``norm_topk_prob`` (off in every released V2 checkpoint): as DeepSeek's own code, the top-k weights
rescaled to sum to 1 and not scaled (HF transformers 5 ignores the flag). ``topk_method`` ``noaux_tc``
is DeepSeek-V3's sigmoid router with a bias (serving/models/deepseek_v3.py).

HF names: attention as mla.py's; ``mlp.gate.weight`` (the router), ``mlp.experts.<e>.{gate,up,down}_proj``
(per expert), ``mlp.shared_experts.{gate,up,down}_proj``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from serving.models.arch_config import ModelArchConfig
from serving.models.llama import MLP, LlamaForCausalLM, load_hf_weights
from serving.models.mla import MLAttention
from serving.models.moe import MoEOptions, SparseMoE
from serving.models.registry import register_model
from serving.models.rope import RotaryEmbedding
from serving.parallel.group import TPGroup
from serving.parallel.shard import TPShapeError, narrow

_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_SHARED = re.compile(r"model\.layers\.(\d+)\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight$")
_ATTN = re.compile(r"model\.layers\.(\d+)\.self_attn\.(\w+)\.(weight|bias)$")
TOPK_METHODS = ("greedy", "group_limited_greedy")


class DeepseekMoE(SparseMoE):
    """The routed experts (SparseMoE) plus the shared experts' dense SwiGLU, summed."""

    def __init__(self, hidden: int, opts: MoEOptions, shared: MLP | None, tp: TPGroup) -> None:
        super().__init__(hidden, opts, tp)
        self.shared_experts = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = super().forward(x)
        return routed if self.shared_experts is None else routed + self.shared_experts(x)


@register_model("DeepseekV2ForCausalLM")
class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2 causal LM (every layer full attention over the cached latent)."""

    fused_cpu_layers = False  # serving.kernels.cpu_decoder computes Llama blocks, not MLA

    def __init__(self, cfg: ModelArchConfig, tp: TPGroup | None = None) -> None:
        self.check_config(cfg)
        super().__init__(cfg, tp)
        for layer in self.model.layers:  # Llama's GQA attention built by the backbone, replaced
            layer.self_attn = MLAttention(cfg, self.plan, self.tp)
        # the rotation covers the rope part only (config.json's head_dim is absent in DeepSeek's own)
        self.rotary = RotaryEmbedding(dataclasses.replace(cfg, head_dim=int(cfg.raw["qk_rope_head_dim"])))

    @classmethod
    def check_tp(cls, cfg: ModelArchConfig, size: int) -> None:
        """The experts' intermediate size splits over the ranks (the heads: ShardPlan)."""
        inter = int(cfg.raw.get("moe_intermediate_size") or 0)
        if inter % size:
            raise TPShapeError(f"--tp-size {size} does not divide the model's moe_intermediate_size {inter}")

    @staticmethod
    def check_config(cfg: ModelArchConfig) -> None:
        check_deepseek_config(cfg)

    def moe_options(self, experts: int, inter: int) -> MoEOptions:
        """The routed experts' options: softmax scoring, greedy or group-limited (``topk_method``)."""
        raw = self.config.raw
        grouped = (raw.get("topk_method") or "greedy") == "group_limited_greedy"
        return MoEOptions(experts, int(raw["num_experts_per_tok"]), inter, scoring="deepseek",
                          renormalize=bool(raw.get("norm_topk_prob", False)),
                          n_group=int(raw.get("n_group") or 1) if grouped else 1,
                          topk_group=int(raw.get("topk_group") or 1) if grouped else 1,
                          routed_scaling=float(raw.get("routed_scaling_factor") or 1.0),
                          activation=str(raw.get("hidden_act", "silu")))

    def sparse_mlp(self, layer: int) -> nn.Module | None:
        raw = self.config.raw
        experts = int(raw.get("n_routed_experts") or 0)
        if experts <= 0 or layer < int(raw.get("first_k_dense_replace") or 0) or \
                layer % int(raw.get("moe_layer_freq") or 1):
            return None
        inter = int(raw["moe_intermediate_size"])
        opts = self.moe_options(experts, inter)
        n_shared = int(raw.get("n_shared_experts") or 0)
        shared = None
        if n_shared:
            plan = dataclasses.replace(self.plan, intermediate=n_shared * inter // self.tp.size)
            shared = MLP(self.config, plan, self.tp)
        return DeepseekMoE(self.config.hidden_size, opts, shared, self.tp)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Attention (this rank's heads), experts and shared experts here; the rest as Llama's."""
        loaded: set[str] = set()
        layers = self.model.layers

        def rest() -> Iterable[tuple[str, Any]]:
            for name, tensor in weights:
                if m := _ATTN.match(name):
                    layers[int(m[1])].self_attn.load(*name.split(".")[-2:], tensor)
                    loaded.add(name)
                elif m := _EXPERT.match(name):
                    moe = layers[int(m[1])].mlp
                    if not isinstance(moe, DeepseekMoE) or int(m[2]) >= moe.num_experts:
                        raise ValueError(f"checkpoint tensor {name}: layer {m[1]} has no expert {m[2]}")
                    moe.load(int(m[2]), m[3].removesuffix("_proj"), tensor)
                    loaded.add(f"model.layers.{m[1]}.mlp.{'w2' if m[3] == 'down_proj' else 'w13'}")
                elif m := _SHARED.match(name):
                    loaded.add(_load_shared(layers[int(m[1])].mlp, m[2], tensor, self.tp, name))
                else:
                    yield name, tensor
        return load_hf_weights(self, self.plan, rest()) | loaded


def _load_shared(moe: nn.Module, proj: str, tensor: Any, tp: TPGroup, name: str) -> str:
    """A shared expert's projection into the shared SwiGLU (gate / up fused), this rank's columns."""
    shared = getattr(moe, "shared_experts", None)
    if shared is None:
        raise ValueError(f"checkpoint tensor {name}: the layer has no shared experts")
    n, lo = shared.inter, tp.rank * shared.inter
    with torch.no_grad():
        if proj == "down_proj":
            shared.down_proj.weight.copy_(narrow(tensor, (1, lo, n) if tp.is_parallel else None))
            return name
        rows = shared.gate_up_proj.weight[(0 if proj == "gate_proj" else n):][:n]
        rows.copy_(narrow(tensor, (0, lo, n) if tp.is_parallel else None))
    return name.rsplit(".", 2)[0] + ".gate_up_proj.weight"


def check_deepseek_config(cfg: ModelArchConfig, topk_methods: tuple[str, ...] = TOPK_METHODS) -> None:
    raw = cfg.raw
    if not cfg.is_mla:
        raise ValueError("a DeepSeek config.json needs kv_lora_rank and qk_rope_head_dim")
    method = raw.get("topk_method") or "greedy"
    if int(raw.get("n_routed_experts") or 0) and topk_methods and method not in topk_methods:
        raise ValueError(f"DeepSeek topk_method {method!r} is not supported by {raw.get('architectures')}; "
                         f"supported: {list(topk_methods)}")
    rank, rope = int(raw["kv_lora_rank"]), int(raw["qk_rope_head_dim"])
    if rope % 2 or rank % 2:
        raise ValueError(f"kv_lora_rank {rank} and qk_rope_head_dim {rope} must be even (RoPE rotates pairs; "
                         "the cache holds the latent in two halves)")
