"""Gemma-3 text (HF ``Gemma3ForCausalLM``, ``model_type`` gemma3_text) over the paged KV cache.

A stack of typed layers (``layer_stack``): ``sliding_attention`` layers read the last
``sliding_window`` positions, ``full_attention`` layers all of them (``layer_types`` from
config.json, else HF's default of every ``sliding_window_pattern``-th layer full). Each layer type
has its own rotary embedding (transformers 5's ``rope_parameters`` per layer type, or the older
``rope_theta`` + ``rope_scaling`` for the full layers and ``rope_local_base_freq`` for the sliding
ones). Per block, as HF computes it: Gemma RMSNorm (``x * (1 + w)`` in float32, then cast), q/k
RMSNorm over each head before RoPE, attention scaled by ``query_pre_attn_scalar ** -0.5``, the
attention and MLP outputs normed again before the residual adds (post-attention, pre- and
post-feedforward norms), a GELU-tanh gated MLP, token embeddings scaled by ``sqrt(hidden_size)``
in the model's dtype, tied embeddings, ``final_logit_softcapping`` on the logits when set.
HF's Gemma-3 does not apply ``attn_logit_softcapping`` (its attention never passes it), so
neither do we; ``use_bidirectional_attention`` (EmbeddingGemma) is refused.

Parameter names follow HF with q/k/v and gate/up fused (``llama.load_hf_weights``). With a hybrid
SWA pool (hicache/tiers/window_pages.py) the sliding layers read and store their KV through the
batch's window view (``batch.win``): their pool keeps only the pages a window can still read.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hicache.tiers.device import DeviceKVPool
from serving.kernels.attention_base import AttentionBackend
from serving.models.arch_config import ModelArchConfig
from serving.models.hybrid_parts import OffsetRMSNorm  # HF's Gemma3RMSNorm: norm(x) * (1 + w) in float32
from serving.models.layer_spec import LayerKind, LayerStack
from serving.models.llama import load_hf_weights
from serving.models.registry import register_model
from serving.models.rope import RotaryEmbedding, apply_rope
from serving.parallel.group import TPGroup
from serving.parallel.layers import RowParallelLinear, VocabParallelEmbedding, parallel_logits
from serving.parallel.shard import ShardPlan
from serving.structs.forward_batch import ForwardBatch

ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}  # HF hidden_activation -> F.gelu approximate
DEFAULT_SLIDING_PATTERN = 6  # HF's: every 6th layer full when config.json lists no layer_types
LOCAL_ROPE_THETA = 10_000.0  # HF's default base of the sliding layers


class Gemma3Attention(nn.Module):
    """GQA attention with fused qkv, q/k norms per head, a window on sliding layers."""

    def __init__(self, cfg: ModelArchConfig, plan: ShardPlan, tp: TPGroup) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = plan.num_heads, plan.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = plan.q_size, plan.kv_size
        self.scale = float(cfg.raw.get("query_pre_attn_scalar", cfg.head_dim)) ** -0.5
        bias = cfg.attention_bias
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, bias, tp)
        self.q_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionBackend,
                window: int | None) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(self.q_norm(q.reshape(t, self.num_heads, self.head_dim)), cos, sin)  # [T, H, D]
        k = apply_rope(self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)), cos, sin)  # [T, KH, D]
        attn.store_kv(k_cache, v_cache, batch.out_cache_loc, k, v.reshape(t, self.num_kv_heads, self.head_dim))
        o = attn.forward(q, k_cache, v_cache, batch, self.scale, window=window)
        return self.o_proj(o.reshape(t, self.q_size))


class Gemma3MLP(nn.Module):
    """``down(gelu(gate(x)) * up(x))`` with gate and up fused."""

    def __init__(self, cfg: ModelArchConfig, plan: ShardPlan, tp: TPGroup) -> None:
        super().__init__()
        act = str(cfg.raw.get("hidden_activation") or cfg.raw.get("hidden_act") or "gelu_pytorch_tanh")
        if act not in ACTIVATIONS:
            raise ValueError(f"Gemma-3 hidden_activation {act!r} is not supported: {sorted(ACTIVATIONS)}")
        self.approximate = ACTIVATIONS[act]
        self.inter = plan.intermediate
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = RowParallelLinear(self.inter, cfg.hidden_size, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.gelu(gate, approximate=self.approximate) * up)


class Gemma3DecoderLayer(nn.Module):
    """``h + post_attn_norm(attn(input_norm(h)))`` then ``h + post_ff_norm(mlp(pre_ff_norm(h)))``."""

    def __init__(self, cfg: ModelArchConfig, plan: ShardPlan, tp: TPGroup) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Gemma3Attention(cfg, plan, tp)
        self.mlp = Gemma3MLP(cfg, plan, tp)
        self.input_layernorm = OffsetRMSNorm(hidden, eps)
        self.post_attention_layernorm = OffsetRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(hidden, eps)


class Gemma3Backbone(nn.Module):
    """Embeddings, layers and final norm (HF's ``model.`` prefix)."""

    def __init__(self, cfg: ModelArchConfig, plan: ShardPlan, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(plan, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, plan, tp) for _ in range(cfg.num_hidden_layers))
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def gemma3_layer_stack(cfg: ModelArchConfig) -> LayerStack:
    """Sliding and full layers from ``layer_types`` (else HF's default pattern) and ``sliding_window``."""
    raw, n = cfg.raw, cfg.num_hidden_layers
    if raw.get("use_bidirectional_attention"):
        raise ValueError("Gemma-3 with use_bidirectional_attention (an embedding model) is not supported")
    kinds = raw.get("layer_types")
    if kinds is None:
        pattern = int(raw.get("sliding_window_pattern") or DEFAULT_SLIDING_PATTERN)
        kinds = [LayerKind.FULL.value if (i + 1) % pattern == 0 else LayerKind.SLIDING.value for i in range(n)]
    if len(kinds) != n or not set(kinds) <= {LayerKind.FULL.value, LayerKind.SLIDING.value}:
        raise ValueError(f"Gemma-3 layer_types {list(kinds)}: expected {n} of full_attention / sliding_attention")
    window = raw.get("sliding_window")
    if window is None and LayerKind.SLIDING.value in kinds:
        raise ValueError("Gemma-3 has sliding_attention layers but no sliding_window")
    return LayerStack.from_kinds(list(kinds), None if window is None else int(window))


def gemma3_rope(cfg: ModelArchConfig, kind: LayerKind) -> ModelArchConfig:
    """``cfg`` with the rope parameters of ``kind``'s layers: per layer type (transformers 5), or the
    model-wide ones for full layers and ``rope_local_base_freq`` for sliding ones (older configs)."""
    if cfg.rope_by_layer_type:
        return cfg.for_layer_type(kind.value)
    if kind is LayerKind.FULL:
        return cfg
    return replace(cfg, rope_theta=float(cfg.raw.get("rope_local_base_freq") or LOCAL_ROPE_THETA), rope_scaling=None)


class Rotaries(dict):
    """The rotary embedding of each layer kind (``RotaryEmbedding`` by ``LayerKind``)."""

    def built_tables(self) -> dict:
        """Every kind's tables built so far (what a captured CUDA graph reads: kept alive with it)."""
        return {(kind, dev): t for kind, r in self.items() for dev, t in r.built_tables().items()}


@register_model("Gemma3ForCausalLM")
class Gemma3ForCausalLM(nn.Module):
    """Causal LM returning float32 logits of each sequence's last new token."""

    fused_cpu_layers = False  # serving.kernels.cpu_decoder runs Llama blocks only
    dummy_norm_weight = 0.0  # a Gemma norm scales by 1 + w: a dummy load sets w = 0

    def __init__(self, cfg: ModelArchConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp or TPGroup()
        self.plan = ShardPlan.for_model(cfg, self.tp.rank, self.tp.size)
        self.layer_stack = gemma3_layer_stack(cfg)
        self._kv_of = {i: j for j, i in enumerate(self.layer_stack.kv_layers)}
        self.model = Gemma3Backbone(cfg, self.plan, self.tp)
        self.lm_head = (
            None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, self.plan.vocab_per_rank, bias=False)
        )
        kinds = {s.kind for s in self.layer_stack.specs}
        self.rotary = Rotaries({kind: RotaryEmbedding(gemma3_rope(cfg, kind)) for kind in kinds})
        self.embed_scale = cfg.hidden_size**0.5
        softcap = cfg.raw.get("final_logit_softcapping")
        self.final_softcap = None if softcap is None else float(softcap)
        self.logits_matmul = None  # a quantized LM head's matmul (serving.models.quant); None: float

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: DeviceKVPool, attn: AttentionBackend) -> torch.Tensor:
        """Run the new tokens of ``batch``; return ``[B, vocab]`` float32 last-token logits
        (``[B + R, vocab]`` with R ``batch.logit_rows``)."""
        attn.init_forward(batch)
        rope = {kind: r.cos_sin(batch.positions, batch.max_seq_len) for kind, r in self.rotary.items()}
        h = self.model.embed_tokens(batch.input_ids)  # [T, hidden], the residual stream
        h = h * float(torch.tensor(self.embed_scale, dtype=h.dtype))  # HF rounds the scale to the model's dtype
        waits = batch.layer_waits
        for i, layer in enumerate(self.model.layers):
            spec, j = self.layer_stack.specs[i], self._kv_of[i]
            if waits is not None:
                waits.before_layer(j)  # this layer's KV loaded back from L2 has landed (GPU-side wait)
            cos, sin = rope[spec.kind]
            lb = batch.win if spec.window is not None and batch.win is not None else batch  # a hybrid SWA pool's view
            x = layer.self_attn(layer.input_layernorm(h), cos, sin, lb, kv.k_buffers[j], kv.v_buffers[j], attn,
                                spec.window)
            h = h + layer.post_attention_layernorm(x)
            h = h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
        last = batch.extend_start.to(torch.int64) + batch.extend_lens.to(torch.int64) - 1  # [B]
        if batch.logit_rows is not None:  # prompt logprobs: these rows' logits too, after the B last ones
            last = torch.cat([last, batch.logit_rows])
        logits = parallel_logits(self.model.norm(h[last]), self.lm_head_weight, self.plan, self.tp, self.logits_matmul)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Copy HF-named tensors into the (fused) parameters, this rank's shard only."""
        return load_hf_weights(self, self.plan, weights)
