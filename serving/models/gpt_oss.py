"""GPT-OSS: Llama's block with biases on q/k/v/o, a learned attention sink per q head, sliding-window
and full layers alternating by ``layer_types`` (every attention layer with sinks), YaRN RoPE, and a
mixture of experts in every layer (serving/models/moe.py: the router has a bias and takes a softmax
over its top-k logits; the experts have biases and GPT-OSS's clamped gated activation).

HF's checkpoint keeps the experts stacked and transposed: ``experts.gate_up_proj [E, H, 2I]`` with
gate and up interleaved (even / odd columns), ``gate_up_proj_bias [E, 2I]``, ``down_proj [E, I, H]``,
``down_proj_bias [E, H]``; the router is ``mlp.router``. OpenAI's released checkpoints store the
experts in MXFP4 (``quantization_config``): those are not read here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from serving.models.arch_config import ModelArchConfig
from serving.models.layer_spec import LayerStack
from serving.models.llama import AttentionOptions, LlamaForCausalLM, load_hf_weights
from serving.models.moe import MoEOptions, SparseMoE
from serving.models.registry import register_model
from serving.parallel.shard import narrow


@register_model("GptOssForCausalLM")
class GptOssForCausalLM(LlamaForCausalLM):
    """GPT-OSS causal LM."""

    fused_cpu_layers = False  # serving.kernels.cpu_decoder computes Llama blocks, without sinks or experts

    @classmethod
    def attention_options(cls, cfg: ModelArchConfig) -> AttentionOptions:
        return AttentionOptions(cfg.attention_bias, cfg.attention_bias, sinks=True)

    @classmethod
    def build_layer_stack(cls, cfg: ModelArchConfig) -> LayerStack:
        raw, n = cfg.raw, cfg.num_hidden_layers
        types = raw.get("layer_types") or ["sliding_attention", "full_attention"]  # HF's default alternation
        kinds = [types[i % len(types)] for i in range(n)]  # repeated when an override changes the layer count
        window = raw.get("sliding_window")
        return LayerStack.from_kinds(list(kinds), None if window is None else int(window), sinks=True)

    def sparse_mlp(self, layer: int) -> nn.Module | None:
        raw = self.config.raw
        if raw.get("quantization_config"):
            raise ValueError("GPT-OSS checkpoints with quantized (MXFP4) experts are not supported: "
                             "use one with bf16 / fp32 weights")
        opts = MoEOptions(int(raw["num_local_experts"]), int(raw["num_experts_per_tok"]),
                          int(raw["intermediate_size"]), scoring="topk_softmax", router_bias=True,
                          expert_bias=True, activation="gpt_oss", swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
                          swiglu_limit=float(raw.get("swiglu_limit", 7.0)))
        return SparseMoE(self.config.hidden_size, opts, self.tp)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """The experts (de-interleaved, transposed to ``[out, in]``), the sinks (this rank's heads)
        and the router (as ``mlp.gate``); the rest as Llama's."""
        loaded: set[str] = set()

        def rest() -> Iterable[tuple[str, Any]]:
            for name, tensor in weights:
                if ".mlp.experts." in name:
                    self._load_experts(name, tensor[:])
                    loaded.add(name.replace("experts.gate_up_proj_bias", "b13").replace("experts.down_proj_bias", "b2")
                               .replace("experts.gate_up_proj", "w13").replace("experts.down_proj", "w2"))
                elif name.endswith(".self_attn.sinks"):
                    attn = self.model.layers[int(name.split(".")[2])].self_attn
                    src = narrow(tensor, (0, self.tp.rank * attn.num_heads, attn.num_heads)
                                 if self.tp.is_parallel else None)
                    with torch.no_grad():
                        attn.sinks.copy_(src)
                    loaded.add(name)
                else:
                    yield name.replace(".mlp.router.", ".mlp.gate."), tensor
        return load_hf_weights(self, self.plan, rest()) | loaded

    def _load_experts(self, name: str, t: torch.Tensor) -> None:
        moe = self.model.layers[int(name.split(".")[2])].mlp
        assert isinstance(moe, SparseMoE)
        what = name.rsplit(".", 1)[1]
        for e in range(moe.num_experts):
            if what == "gate_up_proj":  # [H, 2I], gate / up interleaved by column
                moe.load(e, "gate", t[e][:, 0::2].t())
                moe.load(e, "up", t[e][:, 1::2].t())
            elif what == "gate_up_proj_bias":
                moe.load(e, "gate_bias", t[e][0::2])
                moe.load(e, "up_bias", t[e][1::2])
            elif what == "down_proj":  # [I, H]
                moe.load(e, "down", t[e].t())
            elif what == "down_proj_bias":
                moe.load(e, "down_bias", t[e])
            else:
                raise ValueError(f"checkpoint tensor {name}: unknown expert tensor")
