"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with a sparse mixture-of-experts MLP
(serving/models/moe.py) in the layers HF makes sparse: every ``decoder_sparse_step``-th layer not in
``mlp_only_layers`` (those keep the dense SwiGLU of ``intermediate_size``)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from torch import nn

from serving.models.llama import load_hf_weights
from serving.models.moe import MoEOptions, SparseMoE
from serving.models.qwen3 import Qwen3ForCausalLM
from serving.models.registry import register_model

_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


@register_model("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE causal LM."""

    def sparse_mlp(self, layer: int) -> nn.Module | None:
        raw = self.config.raw
        experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)  # transformers 5 writes the latter
        if experts <= 0 or layer in (raw.get("mlp_only_layers") or []) or \
                (layer + 1) % int(raw.get("decoder_sparse_step") or 1):
            return None
        opts = MoEOptions(experts, int(raw["num_experts_per_tok"]), int(raw["moe_intermediate_size"]),
                          renormalize=bool(raw.get("norm_topk_prob", False)),
                          activation=str(raw.get("hidden_act", "silu")))
        return SparseMoE(self.config.hidden_size, opts, self.tp)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """HF's per-expert tensors into each sparse layer's stacked weights; the rest as Qwen3's."""
        loaded: set[str] = set()

        def dense() -> Iterable[tuple[str, Any]]:
            for name, tensor in weights:
                m = _EXPERT.match(name)
                if m is None:
                    yield name, tensor
                    continue
                layer, expert, proj = int(m[1]), int(m[2]), m[3]
                mlp = self.model.layers[layer].mlp
                if not isinstance(mlp, SparseMoE) or expert >= mlp.num_experts:
                    raise ValueError(f"checkpoint tensor {name}: layer {layer} has no expert {expert}")
                mlp.load(expert, proj.removesuffix("_proj"), tensor)
                loaded.add(f"model.layers.{layer}.mlp.{'w2' if proj == 'down_proj' else 'w13'}")
        return load_hf_weights(self, self.plan, dense()) | loaded
