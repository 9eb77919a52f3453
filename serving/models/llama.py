"""Llama-family decoder (Llama, Mistral; Qwen2 and Qwen3 subclass it) over the paged KV cache.

Parameter names follow HF (``model.layers.N.self_attn...``) except that q/k/v and gate/up
are fused into ``qkv_proj`` and ``gate_up_proj``; ``load_weights`` maps HF names onto them.
Under tensor parallelism (``tp``, serving.parallel) every rank holds its shard: QKV and
gate/up column-split, o_proj and down_proj row-split (one all-reduce per block half),
embedding and LM head vocab-split (serving.parallel.shard says which rows).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hicache.tiers.device import DeviceKVPool
from serving.kernels import cpu_decoder, cpu_fused
from serving.kernels.attention_base import AttentionBackend
from serving.models.arch_config import ModelArchConfig
from serving.models.layer_spec import LayerKind, LayerStack
from serving.models.registry import register_model
from serving.models.rope import RotaryEmbedding, apply_rope
from serving.parallel.group import TPGroup
from serving.parallel.layers import RowParallelLinear, VocabParallelEmbedding, parallel_logits
from serving.parallel.shard import ShardPlan, narrow
from serving.structs.forward_batch import ForwardBatch

log = logging.getLogger(__name__)

_FUSED = None  # serving.kernels.triton_fused, imported on first CUDA use (CPU never imports Triton here)


def _rope_kernel(device: torch.device, dtype: torch.dtype):  # noqa: ANN202 - the module or None
    """A module whose ``rope_qk`` rotates q and k out of the fused qkv at each token's position
    (Triton on CUDA, C++ on CPU in float32), or None: the torch path."""
    if device.type == "cuda":
        return _triton_fused()
    return cpu_fused if cpu_fused.available(dtype) else None


def _fused_for(x: torch.Tensor):  # noqa: ANN202 - the module or None
    """The fused Triton kernels when ``x`` is on CUDA and they are enabled, else None."""
    return _triton_fused() if x.is_cuda else None


def _triton_fused():  # noqa: ANN202 - the module or None
    global _FUSED
    if _FUSED is None:
        from serving.kernels import triton_fused

        _FUSED = triton_fused
    return _FUSED if _FUSED.ENABLED else None


class RMSNorm(nn.Module):
    """HF's LlamaRMSNorm: normalize in float32, cast back, then scale."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = _fused_for(x)
        if fused is not None:
            return fused.rmsnorm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(``norm(residual + x)``, ``residual + x``): the residual add and this norm, one launch on CUDA."""
        fused = _fused_for(x)
        if fused is not None:
            return fused.add_rmsnorm(x, residual, self.weight, self.eps)
        h = residual + x
        return self(h), h


@dataclass(frozen=True)
class AttentionOptions:
    """What a family's attention adds to Llama's: biases on q/k/v and on o_proj, an RMSNorm over
    each head of q and k before RoPE (Qwen3's ``q_norm`` / ``k_norm``), attention sinks (GPT-OSS)."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sinks: bool = False  # a learned logit per q head in the softmax's denominator (GPT-OSS's ``sinks``)


class Attention(nn.Module):
    """GQA self-attention with fused qkv projection; KV goes through the paged pool."""

    def __init__(self, cfg: ModelArchConfig, opts: AttentionOptions, plan: ShardPlan, tp: TPGroup) -> None:
        super().__init__()
        qkv_bias, o_bias = opts.qkv_bias, opts.o_bias
        self.num_heads = plan.num_heads  # this rank's heads
        self.num_kv_heads = plan.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = plan.q_size, plan.kv_size
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, o_bias, tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if opts.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if opts.qk_norm else None
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if opts.sinks else None  # this rank's heads'

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn: AttentionBackend,
        window: int | None = None,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        fused = _fused_for(x) if cos.dim() == 2 else None
        qk_norm = self.q_norm is not None and self.k_norm is not None
        if qk_norm and fused is not None and self.q_norm.weight.dtype == self.k_norm.weight.dtype == qkv.dtype:
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)  # the norms and RoPE in one launch
            q, k = fused.rope_qk(qkv, batch.positions, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim,
                                 norms=norms)
            v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        elif qk_norm:  # per-head norms of q and k, then RoPE
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(t, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(t, self.num_kv_heads, self.head_dim)
            if cos.dim() == 2:  # whole tables: this token's rows
                cos, sin = cos[batch.positions].unsqueeze(1), sin[batch.positions].unsqueeze(1)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            v = v.reshape(t, self.num_kv_heads, self.head_dim)
        elif cos.dim() == 2:  # whole cos/sin tables: the fused path reads them at batch.positions
            rope = _rope_kernel(x.device, x.dtype)
            q, k = rope.rope_qk(qkv, batch.positions, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)
            v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = apply_rope(q.view(t, self.num_heads, self.head_dim), cos, sin)  # [T, H, D]
            k = apply_rope(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)  # [T, KH, D]
            v = v.view(t, self.num_kv_heads, self.head_dim)
        attn.store_kv(k_cache, v_cache, batch.out_cache_loc, k, v)
        sinks = None if self.sinks is None else self.sinks.float()
        o = attn.forward(q, k_cache, v_cache, batch, self.scale, window=window, sinks=sinks)  # [T, H, D]
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with gate and up fused."""

    def __init__(self, cfg: ModelArchConfig, plan: ShardPlan, tp: TPGroup) -> None:
        super().__init__()
        self.inter = plan.intermediate  # this rank's columns
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(self.inter, cfg.hidden_size, cfg.mlp_bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        fused = _fused_for(x)
        if fused is not None:
            return self.down_proj(fused.silu_mul(gate_up, self.inter))
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: ModelArchConfig, opts: AttentionOptions, plan: ShardPlan, tp: TPGroup,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, opts, plan, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp if mlp is not None else MLP(cfg, plan, tp)


class Backbone(nn.Module):
    """Embeddings, layers and final norm (HF's ``model.`` prefix)."""

    def __init__(self, cfg: ModelArchConfig, opts: AttentionOptions, plan: ShardPlan, tp: TPGroup,
                 mlp_for: Callable[[int], nn.Module | None] = lambda layer: None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(plan, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, opts, plan, tp, mlp_for(i)) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# HF name piece -> (our fused name piece, shard index within the fused output rows)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


@register_model("LlamaForCausalLM", "MistralForCausalLM")
class LlamaForCausalLM(nn.Module):
    """Causal LM returning float32 logits of each sequence's last new token."""

    fused_cpu_layers = True  # its layers are what serving.kernels.cpu_decoder computes

    def __init__(self, cfg: ModelArchConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp or TPGroup()
        self.plan = ShardPlan.for_model(cfg, self.tp.rank, self.tp.size)
        self.model = Backbone(cfg, self.attention_options(cfg), self.plan, self.tp, self.sparse_mlp)
        self.lm_head = (
            None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, self.plan.vocab_per_rank, bias=False)
        )
        self.layer_stack = self.build_layer_stack(cfg)
        self._kv_of = {i: j for j, i in enumerate(self.layer_stack.kv_layers)}  # model layer -> KV pool layer
        self.rotary = RotaryEmbedding(cfg)
        self.logits_matmul = None  # a quantized LM head's matmul (serving.models.quant); None: float
        self._fused: cpu_decoder.FusedDecoder | None | bool = False  # False: not decided yet

    def fused_decoder(self) -> cpu_decoder.FusedDecoder | None:
        """The layers as one C++ call on CPU (serving.kernels.cpu_decoder), decided at the first
        forward (after quantization); ``HICACHE_CPU_FUSED=0`` keeps the modules."""
        if self._fused is False:
            import os

            fused, why = (None, "HICACHE_CPU_FUSED=0") if os.environ.get("HICACHE_CPU_FUSED", "1") == "0" \
                else cpu_decoder.FusedDecoder.build(self)
            if self.lm_head_weight.device.type == "cpu":
                log.info("CPU decoder: %s", "fused C++ layers" if fused else f"torch modules ({why})")
            self._fused = fused
        return self._fused

    @classmethod
    def build_layer_stack(cls, cfg: ModelArchConfig) -> LayerStack:
        """Every layer full attention, or sliding-window layers as HF runs them: Mistral with a
        non-null ``sliding_window`` (every layer); Qwen2 with ``use_sliding_window`` (the layers
        ``layer_types`` names, else those from ``max_window_layers`` on)."""
        raw, n = cfg.raw, cfg.num_hidden_layers
        window = raw.get("sliding_window")
        if window is None or (cfg.model_type != "mistral" and not raw.get("use_sliding_window")):
            return LayerStack.all_full(n)
        if cfg.model_type == "mistral":
            return LayerStack.from_kinds([LayerKind.SLIDING.value] * n, int(window))
        first = int(raw.get("max_window_layers", n))
        kinds = raw.get("layer_types") or [
            (LayerKind.SLIDING if i >= first else LayerKind.FULL).value for i in range(n)]
        if len(kinds) != n or not set(kinds) <= {LayerKind.FULL.value, LayerKind.SLIDING.value}:
            raise ValueError(f"layer_types {list(kinds)}: expected {n} of full_attention / sliding_attention")
        return LayerStack.from_kinds(list(kinds), int(window))

    def sparse_mlp(self, layer: int) -> nn.Module | None:
        """Layer ``layer``'s MLP when it is not the dense SwiGLU (a mixture of experts); None: dense."""
        return None

    @classmethod
    def attention_options(cls, cfg: ModelArchConfig) -> AttentionOptions:
        """Llama's ``attention_bias`` sets both biases; no q/k norms."""
        return AttentionOptions(cfg.attention_bias, cfg.attention_bias)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: DeviceKVPool, attn: AttentionBackend) -> torch.Tensor:
        """Run the new tokens of ``batch``; return ``[B, vocab]`` float32 last-token logits
        (``[B + R, vocab]`` with R ``batch.logit_rows``)."""
        fused = self.fused_decoder() if batch.positions.device.type == "cpu" else None
        if fused is not None and cpu_decoder.usable(attn, kv.k_buffers[0].dtype, batch) and (
                batch.win is None or not kv.full_layers):  # a hybrid SWA pool: fused when every layer slides
            return self._forward_fused(fused, batch if batch.win is None else batch.win, kv)
        attn.init_forward(batch)
        if _rope_kernel(batch.positions.device, self.lm_head_weight.dtype) is not None:  # [L, D] tables
            cos, sin = self.rotary.tables(batch.positions.device, batch.max_seq_len)
        else:
            cos, sin = self.rotary.cos_sin(batch.positions, batch.max_seq_len)  # [T, 1, D]
        h = self.model.embed_tokens(batch.input_ids)  # [T, hidden], the residual stream
        waits = batch.layer_waits
        delta = None  # the last block half's output, not yet added to h (added with the next norm)
        stack = self.layer_stack
        for i, layer in enumerate(self.model.layers):
            j = self._kv_of[i]  # its layer in the KV pool
            if waits is not None:
                waits.before_layer(j)  # this layer's KV loaded back from L2 has landed (GPU-side wait)
            if delta is None:
                x = layer.input_layernorm(h)
            else:
                x, h = layer.input_layernorm.add_forward(delta, h)
            window = stack.specs[i].window
            lb = batch.win if window is not None and batch.win is not None else batch  # a hybrid SWA pool's view
            delta = layer.self_attn(x, cos, sin, lb, kv.k_buffers[j], kv.v_buffers[j], attn, window)
            x, h = layer.post_attention_layernorm.add_forward(delta, h)
            delta = layer.mlp(x)
        h = h + delta
        last = batch.extend_start.to(torch.int64) + batch.extend_lens.to(torch.int64) - 1  # [B]
        if batch.logit_rows is not None:  # prompt logprobs: these rows' logits too, after the B last ones
            last = torch.cat([last, batch.logit_rows])
        h = self.model.norm(h[last])  # [B, hidden]
        return parallel_logits(h, self.lm_head_weight, self.plan, self.tp, self.logits_matmul)

    def _forward_fused(self, fused: cpu_decoder.FusedDecoder, batch: ForwardBatch, kv: DeviceKVPool) -> torch.Tensor:
        cos, sin = self.rotary.tables(batch.positions.device, batch.max_seq_len)
        h = self.model.embed_tokens(batch.input_ids).contiguous()
        h = h + fused.forward(h, batch, kv.k_buffers, kv.v_buffers, cos, sin, self.model.layers[0].self_attn.scale)
        last = batch.extend_start.to(torch.int64) + batch.extend_lens.to(torch.int64) - 1  # [B]
        if batch.logit_rows is not None:
            last = torch.cat([last, batch.logit_rows])
        h = fused.norm(h[last], self.model.norm.weight)
        return parallel_logits(h, self.lm_head_weight, self.plan, self.tp, self.logits_matmul)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Copy HF-named tensors into the (fused) parameters, this rank's shard only (load_hf_weights)."""
        return load_hf_weights(self, self.plan, weights)


def load_hf_weights(model: nn.Module, plan: ShardPlan, weights: Iterable[tuple[str, Any]]) -> set[str]:
    """Copy HF-named tensors (or lazy safetensors slices) into ``model``'s parameters, q/k/v into
    ``qkv_proj`` and gate/up into ``gate_up_proj`` (fused), this rank's shard only (``plan``);
    return the parameter names set. Unknown names (rotary ``inv_freq``, a tied ``lm_head.weight``)
    are skipped."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        target, shard = name, None
        for piece, (fused, idx) in _STACKED.items():
            if f".{piece}." in name:
                target, shard = name.replace(f".{piece}.", f".{fused}."), idx
                break
        param = params.get(target)
        if param is None:
            continue
        parts = name.split(".")
        hf_piece = parts[-2] if len(parts) >= 2 else ""
        src = narrow(tensor, plan.source_range(hf_piece, parts[-1]))
        with torch.no_grad():
            if shard is not None:
                param.narrow(0, *_shard_range(plan, target, shard)).copy_(src)
            elif src.shape[0] < param.shape[0] and hf_piece in ("embed_tokens", "lm_head"):
                param[src.shape[0]:].zero_()  # vocab padding of the last rank
                param[: src.shape[0]].copy_(src)
            else:
                param.copy_(src)
        loaded.add(target)
    return loaded


def _shard_range(plan: ShardPlan, fused_name: str, shard: int) -> tuple[int, int]:
    """(start, length) of a shard's output rows in a fused weight or bias (this rank's sizes)."""
    if ".qkv_proj." in fused_name:
        sizes = [plan.q_size, plan.kv_size, plan.kv_size]
    else:
        sizes = [plan.intermediate, plan.intermediate]
    return sum(sizes[:shard]), sizes[shard]
