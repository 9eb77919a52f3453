"""Qwen2: the Llama block with a bias on q/k/v (never on o_proj)."""

from __future__ import annotations

from serving.models.config import ModelArchConfig
from serving.models.llama import LlamaForCausalLM
from serving.models.registry import register_model


@register_model("Qwen2ForCausalLM")
class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 causal LM (same forward as Llama)."""

    @classmethod
    def attention_biases(cls, cfg: ModelArchConfig) -> tuple[bool, bool]:
        return True, False
