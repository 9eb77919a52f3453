"""Qwen2: the Llama block with a bias on q/k/v (never on o_proj)."""

from __future__ import annotations

from serving.models.arch_config import ModelArchConfig
from serving.models.llama import AttentionOptions, LlamaForCausalLM
from serving.models.registry import register_model


@register_model("Qwen2ForCausalLM")
class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 causal LM (same forward as Llama)."""

    @classmethod
    def attention_options(cls, cfg: ModelArchConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, o_bias=False)
