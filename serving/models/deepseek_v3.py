"""DeepSeek-V3 (and R1, V3.1: the same architecture): DeepSeek-V2's block (serving/models/deepseek_v2.py:
multi-head latent attention over the cached latent, shared experts, the first layers dense) with V3's
router, ``noaux_tc`` (serving/models/moe.py): a float32 sigmoid per expert; the choice adds the
router's ``e_score_correction_bias``, ranks the ``n_group`` groups by the sum of their two best and
takes the top-k of the ``topk_group`` best groups; the weights are the sigmoid scores of the chosen
(without the bias), rescaled to sum to 1 with ``norm_topk_prob`` and times ``routed_scaling_factor``.
HF transformers' port routes every V3 checkpoint this way whatever its ``topk_method`` says, and so
does this one.

RoPE: V3's ``rope_interleave`` (true, HF's default and the released checkpoints') rotates consecutive
pairs, as V2 does; a config with it false is refused. The multi-token-prediction layers of the released
checkpoints (``model.layers.<num_hidden_layers>...``, ``num_nextn_predict_layers``) are not loaded.

HF names: V2's, plus ``mlp.gate.e_score_correction_bias`` per MoE layer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch

from serving.models.arch_config import ModelArchConfig
from serving.models.deepseek_v2 import DeepseekMoE, DeepseekV2ForCausalLM, check_deepseek_config
from serving.models.moe import MoEOptions
from serving.models.registry import register_model
from serving.parallel.shard import narrow

_BIAS = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias$")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@register_model("DeepseekV3ForCausalLM")
class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 causal LM: V2's with the ``noaux_tc`` router."""

    @staticmethod
    def check_config(cfg: ModelArchConfig) -> None:
        check_deepseek_config(cfg, topk_methods=())  # noaux_tc whatever topk_method says (HF's port)
        if cfg.raw.get("rope_interleave", True) is False:
            raise ValueError("DeepSeek-V3 with rope_interleave false (rotate-half RoPE) is not supported; "
                             "the released checkpoints interleave")

    def moe_options(self, experts: int, inter: int) -> MoEOptions:
        raw = self.config.raw
        return MoEOptions(experts, int(raw["num_experts_per_tok"]), inter, scoring="noaux_tc",
                          renormalize=bool(raw.get("norm_topk_prob", True)),
                          n_group=int(raw.get("n_group") or 1), topk_group=int(raw.get("topk_group") or 1),
                          routed_scaling=float(raw.get("routed_scaling_factor") or 1.0),
                          activation=str(raw.get("hidden_act", "silu")))

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """The routers' correction biases here, the multi-token-prediction layers skipped, the rest as V2's."""
        loaded: set[str] = set()
        layers = self.model.layers

        def rest() -> Iterable[tuple[str, Any]]:
            for name, tensor in weights:
                if (m := _LAYER.match(name)) and int(m[1]) >= len(layers):
                    continue  # a multi-token-prediction layer
                if m := _BIAS.match(name):
                    moe = layers[int(m[1])].mlp
                    if not isinstance(moe, DeepseekMoE):
                        raise ValueError(f"checkpoint tensor {name}: layer {m[1]} has no routed experts")
                    with torch.no_grad():
                        moe.gate.e_score_correction_bias.copy_(narrow(tensor, None))
                    loaded.add(name)
                else:
                    yield name, tensor
        return super().load_weights(rest()) | loaded
