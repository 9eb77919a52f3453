"""Qwen3.5 text (dense; ``model_type`` qwen3_5_text): Gated DeltaNet layers and gated full-attention
layers (``layer_types``: linear_attention / full_attention), each followed by a SwiGLU MLP.

As HF's ``Qwen3_5ForCausalLM``: every RMSNorm but the DeltaNet's output norm scales by ``1 + w``
(serving/models/hybrid_parts.py OffsetRMSNorm); a full-attention layer's ``q_proj`` gives the queries
and an output gate per head (``o_proj(attn * sigmoid(gate))``), q and k are RMS-normed per head, and
rope turns the first ``partial_rotary_factor * head_dim`` dims (text positions: the three mrope
sections share them, so it is plain rope). KV goes to the KV pool's layer ``layer_stack.kv_index(i)``
(full-attention layers only), DeltaNet state to the state pool's layer ``state_index(i)``. Under tensor
parallelism each rank holds its heads of both kinds of layer (the attention's as Llama's, ShardPlan; the
DeltaNet's by head, serving/parallel/state_shard.py), the MLP's columns, its vocab rows.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from hicache.tiers.device import DeviceKVPool
from hicache.tiers.state_pool import DeviceStatePool
from serving.kernels.attention_base import AttentionBackend
from serving.models.arch_config import ModelArchConfig
from serving.models.gated_deltanet import GatedDeltaNet
from serving.models.hybrid_parts import HybridCausalLM, OffsetRMSNorm, activation
from serving.models.layer_spec import LayerKind, LayerStack
from serving.models.registry import register_model
from serving.models.rope import RotaryEmbedding, apply_rope
from serving.parallel.group import TPGroup
from serving.parallel.layers import RowParallelLinear, VocabParallelEmbedding
from serving.parallel.shard import ShardPlan
from serving.parallel.state_shard import Blocks, DeltaNetShard
from serving.structs.forward_batch import ForwardBatch


def partial_rotary_factor(cfg: ModelArchConfig) -> float:
    params = cfg.raw.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor", cfg.raw.get("partial_rotary_factor", 1.0)))


class GatedAttention(nn.Module):
    """Qwen3.5's full attention (HF ``Qwen3_5Attention``): this rank's heads (``plan``)."""

    def __init__(self, cfg: ModelArchConfig, rotary_dim: int, plan: ShardPlan, tp: TPGroup) -> None:
        super().__init__()
        h, kh, d, bias = plan.num_heads, plan.num_kv_heads, cfg.head_dim, cfg.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim, self.rotary_dim = h, kh, d, rotary_dim
        self.plan = plan
        self.q_proj = nn.Linear(cfg.hidden_size, 2 * h * d, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kh * d, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kh * d, bias=bias)
        self.o_proj = RowParallelLinear(h * d, cfg.hidden_size, bias, tp)
        self.q_norm = OffsetRMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(d, cfg.rms_norm_eps)

    def tp_source(self, leaf: str) -> Blocks | None:
        """q_proj's rows are per head ``[query, gate]``: the rank's heads' rows (the rest as Llama's)."""
        if leaf.startswith("q_proj.") and self.plan.size > 1:
            n = 2 * self.plan.q_size
            return 0, [(self.plan.rank * n, n)]
        return None

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        if r == self.head_dim:
            return apply_rope(x, cos, sin)
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        q, gate = self.q_proj(x).view(t, h, 2 * d).chunk(2, dim=-1)
        q = self._rope(self.q_norm(q), cos, sin)
        k = self._rope(self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, d)), cos, sin)
        v = self.v_proj(x).view(t, self.num_kv_heads, d)
        attn.store_kv(k_cache, v_cache, batch.out_cache_loc, k, v)
        o = attn.forward(q.contiguous(), k_cache, v_cache, batch, d**-0.5).reshape(t, h * d)
        return self.o_proj(o * torch.sigmoid(gate.reshape(t, h * d)))


class MLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` (HF ``Qwen3_5MLP``)."""

    def __init__(self, cfg: ModelArchConfig, plan: ShardPlan, tp: TPGroup) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, plan.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, plan.intermediate, bias=False)
        self.down_proj = RowParallelLinear(plan.intermediate, cfg.hidden_size, False, tp)
        self.act = activation(str(cfg.raw.get("hidden_act", "silu")), "MLP")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, kind: LayerKind, rotary_dim: int, plan: ShardPlan, tp: TPGroup) -> None:
        super().__init__()
        raw = cfg.raw
        if kind is LayerKind.LINEAR:
            self.linear_attn = GatedDeltaNet(
                cfg.hidden_size, int(raw["linear_num_key_heads"]), int(raw["linear_num_value_heads"]),
                int(raw["linear_key_head_dim"]), int(raw["linear_value_head_dim"]),
                int(raw.get("linear_conv_kernel_dim", 4)), cfg.rms_norm_eps, str(raw.get("hidden_act", "silu")), tp)
        else:
            self.self_attn = GatedAttention(cfg, rotary_dim, plan, tp)
        self.mlp = MLP(cfg, plan, tp)
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelArchConfig, stack: LayerStack, rotary_dim: int, plan: ShardPlan, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(plan, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, s.kind, rotary_dim, plan, tp) for s in stack.specs)
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def qwen3_5_stack(cfg: ModelArchConfig) -> LayerStack:
    types = cfg.raw.get("layer_types")
    if types is None:  # HF's default: every full_attention_interval-th layer is full attention
        every = int(cfg.raw.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                 for i in range(cfg.num_hidden_layers)]
    if len(types) != cfg.num_hidden_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {cfg.num_hidden_layers} layers")
    bad = sorted(set(types) - {"linear_attention", "full_attention"})
    if bad:
        raise ValueError(f"Qwen3.5 layer types {bad} are not supported (linear_attention, full_attention)")
    return LayerStack.from_kinds(list(types))


@register_model("Qwen3_5ForCausalLM")
class Qwen3_5ForCausalLM(HybridCausalLM):
    """Causal LM returning float32 logits of each sequence's last new token."""

    state_kind = "Gated DeltaNet"

    def __init__(self, cfg: ModelArchConfig, tp: TPGroup | None = None) -> None:
        super().__init__(cfg, tp, "Qwen3.5")
        self.layer_stack = qwen3_5_stack(cfg)
        rotary_dim = int(cfg.head_dim * partial_rotary_factor(cfg))
        self.model = Backbone(cfg, self.layer_stack, rotary_dim, self.plan, self.tp)
        self.rotary = RotaryEmbedding(dataclasses.replace(cfg, head_dim=rotary_dim))
        self.conv_kernel = int(cfg.raw.get("linear_conv_kernel_dim", 4))

    @staticmethod
    def check_tp(cfg: ModelArchConfig, size: int) -> None:
        """TPShapeError when ``size`` ranks cannot split the Gated DeltaNet heads (before any rank starts)."""
        raw = cfg.raw
        DeltaNetShard.make(int(raw["linear_num_key_heads"]), int(raw["linear_num_value_heads"]),
                           int(raw["linear_key_head_dim"]), int(raw["linear_value_head_dim"]), 0, size)

    def mixer(self, layer: int) -> nn.Module:
        block = self.model.layers[layer]
        return block.linear_attn if hasattr(block, "linear_attn") else block.self_attn

    @property
    def embed(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: DeviceKVPool, attn: AttentionBackend,
                state: DeviceStatePool | None = None) -> torch.Tensor:
        """Each layer: Gated DeltaNet or gated full attention, then the MLP, both pre-norm residuals."""
        stack = self.layer_stack
        plan = self.begin_forward(batch, attn, state)
        cos, sin = self.rotary.cos_sin(batch.positions, batch.max_seq_len)
        h = self.model.embed_tokens(batch.input_ids)
        waits = batch.layer_waits
        kv_i = state_i = 0
        for layer, spec in zip(self.model.layers, stack.specs, strict=True):
            x = layer.input_layernorm(h)
            if spec.kind is LayerKind.LINEAR:
                conv, rec = state.layer(state_i)
                h = h + layer.linear_attn(x, plan, conv, rec)
                state_i += 1
            else:
                if waits is not None:
                    waits.before_layer(kv_i)
                h = h + layer.self_attn(x, cos, sin, batch, kv.k_buffers[kv_i], kv.v_buffers[kv_i], attn)
                kv_i += 1
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.last_logits(h, batch, self.model.norm)
