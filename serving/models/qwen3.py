"""Qwen3 (dense): the Llama block with an RMSNorm over each head of q and k before RoPE (HF's
``q_norm`` / ``k_norm``), explicit ``head_dim``, biases on q/k/v and o_proj only with
``attention_bias``; sliding windows as Qwen2 reads them (``use_sliding_window``)."""

from __future__ import annotations

from serving.models.arch_config import ModelArchConfig
from serving.models.llama import AttentionOptions, LlamaForCausalLM
from serving.models.registry import register_model


@register_model("Qwen3ForCausalLM")
class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 causal LM (Llama's forward with per-head q/k norms)."""

    fused_cpu_layers = False  # serving.kernels.cpu_decoder computes Llama blocks, without q/k norms

    @classmethod
    def attention_options(cls, cfg: ModelArchConfig) -> AttentionOptions:
        return AttentionOptions(cfg.attention_bias, cfg.attention_bias, qk_norm=True)
