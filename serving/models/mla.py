"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of the latent.

Per token a layer caches one row, ``[c | k_pe]``: ``c`` the ``kv_lora_rank`` latent (``kv_a_proj_with_mqa``
then ``kv_a_layernorm``) and ``k_pe`` the ``qk_rope_head_dim`` key part, rotated, shared by every head.
The pool's layout is ``KVLayout.latent`` (hicache/tiers/device.py): one "kv head" whose K plane holds the
row's first half and whose V plane its second, so L1, L2 and L3 hold the latent once and nothing else.

Attention, exact against HF's (which expands the latent through ``kv_b_proj`` for every key):

- **extend** (prefill, a prefix's continuation): as HF, each sequence's cached rows expanded to per-head
  keys ``[k_nope | k_pe]`` and values through ``kv_b_proj``, then causal SDPA;
- **decode**: absorbed: ``W_UK`` (``kv_b_proj``'s key rows) folded into the query, ``q_lat = q_nope W_UK``,
  scores ``q_lat . c + q_pe . k_pe`` over the cached rows as they are (an MQA of width ``kv_lora_rank +
  rope``), the probabilities summed over ``c`` and ``W_UV`` (its value rows) applied after: no per-head key
  or value is built for the past tokens.

RoPE is DeepSeek's: over consecutive pairs of ``q_pe`` / ``k_pe`` (HF's complex rotation), with the
tables of ``serving/models/rope.py`` (YaRN's cos / sin factor in them); the softmax scale is
``qk_head_dim ** -0.5`` times YaRN's ``mscale(factor, mscale_all_dim) ** 2`` when the RoPE is scaled.

Tensor parallelism: each rank holds its q heads (``q_proj`` / ``q_b_proj`` and ``kv_b_proj`` rows,
``o_proj`` columns); the latent's projection and norm are replicated, so every rank caches the same rows.
The attention is this module's torch code; the backend only stores the rows (``store_kv``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from serving.kernels.attention_base import AttentionBackend
from serving.models.arch_config import ModelArchConfig
from serving.models.llama import RMSNorm
from serving.parallel.group import TPGroup
from serving.parallel.layers import RowParallelLinear
from serving.parallel.shard import ShardPlan, narrow
from serving.structs.forward_batch import ForwardBatch

LATENT_NORM_EPS = 1e-6  # HF's DeepseekV2RMSNorm default: q_a_layernorm and kv_a_layernorm ignore rms_norm_eps


def softmax_scale(cfg: ModelArchConfig) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale ** 2`` for a scaled RoPE with ``mscale_all_dim`` (HF's)."""
    raw = cfg.raw
    scale = (int(raw["qk_nope_head_dim"]) + int(raw["qk_rope_head_dim"])) ** -0.5
    s = cfg.rope_scaling
    if s is not None and s.mscale_all_dim:
        m = 1.0 if s.factor <= 1 else 0.1 * float(s.mscale_all_dim) * math.log(s.factor) + 1.0
        scale *= m * m
    return scale


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, D]`` pair by pair (``x[2i], x[2i+1]`` by frequency ``i``) with the
    ``[T, 1, D]`` rotate-half tables (their first half holds each frequency once); float32 inside."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    xf = x.float()
    x0, x1 = xf[..., 0::2], xf[..., 1::2]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2).to(x.dtype)


class MLAttention(nn.Module):
    """DeepSeek's attention, this rank's heads; HF's parameter names."""

    unquantized = ("kv_b_proj",)  # decode absorbs its weight into the query and the output (--quantization keeps it)

    def __init__(self, cfg: ModelArchConfig, plan: ShardPlan, tp: TPGroup) -> None:
        super().__init__()
        raw, hidden, bias = cfg.raw, cfg.hidden_size, cfg.attention_bias
        self.tp = tp
        self.num_heads = plan.num_heads
        self.nope, self.rope = int(raw["qk_nope_head_dim"]), int(raw["qk_rope_head_dim"])
        self.v_dim, self.rank = int(raw["v_head_dim"]), int(raw["kv_lora_rank"])
        self.qk_dim = self.nope + self.rope
        self.width = self.rank + self.rope  # a cached row
        q_lora = raw.get("q_lora_rank")
        h = self.num_heads
        if q_lora is None:  # V2-Lite
            self.q_proj = nn.Linear(hidden, h * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, int(q_lora), bias=bias)
            self.q_a_layernorm = RMSNorm(int(q_lora), LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(int(q_lora), h * self.qk_dim, bias=False)
        self.q_lora = q_lora
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.width, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, h * (self.nope + self.v_dim), bias=False)
        self.o_proj = RowParallelLinear(h * self.v_dim, hidden, bias, tp)
        self.scale = softmax_scale(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionBackend,
                window: int | None = None) -> torch.Tensor:
        t, h = x.shape[0], self.num_heads
        q = self.q_proj(x) if self.q_lora is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, h, self.qk_dim).split([self.nope, self.rope], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        if cos.dim() == 2:  # whole tables: this token's rows
            cos, sin = cos[batch.positions].unsqueeze(1), sin[batch.positions].unsqueeze(1)
        q_pe = rope_pairs(q_pe, cos, sin)
        k_pe = rope_pairs(k_pe.unsqueeze(1), cos, sin).squeeze(1)
        self._store(torch.cat([self.kv_a_layernorm(c), k_pe], dim=-1), batch, k_cache, v_cache, attn)
        slots = _slots(batch)
        if batch.is_decode:
            o = self._decode(q_nope, q_pe, slots, batch, k_cache, v_cache)
        else:
            o = self._extend(q_nope, q_pe, slots, batch, k_cache, v_cache)
        return self.o_proj(o.reshape(t, h * self.v_dim))

    def _store(self, rows: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
               attn: AttentionBackend) -> None:
        half = k_cache.shape[-1]
        attn.store_kv(k_cache, v_cache, batch.out_cache_loc, rows[:, None, :half], rows[:, None, half:])

    def _rows(self, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
              dtype: torch.dtype) -> torch.Tensor:
        """The cached rows ``[..., width]`` at flat ``slots``, in ``dtype``."""
        half = k_cache.shape[-1]
        rows = torch.cat([k_cache.view(-1, half)[slots], v_cache.view(-1, half)[slots]], dim=-1)
        return rows.to(dtype)

    def _extend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, slots: torch.Tensor, batch: ForwardBatch,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        h = self.num_heads
        out = q_nope.new_empty(q_nope.shape[0], h, self.v_dim)
        q = torch.cat([q_nope, q_pe], dim=-1)
        start = 0
        for i, (prefix, n) in enumerate(zip(batch.prefix_lens_list, batch.extend_lens_list, strict=True)):
            if n == 0:
                continue
            total = prefix + n
            rows = self._rows(k_cache, v_cache, slots[i, :total], q.dtype)  # [L, width]
            kv = self.kv_b_proj(rows[:, : self.rank]).view(total, h, self.nope + self.v_dim)
            k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
            k = torch.cat([k_nope, rows[:, None, self.rank:].expand(total, h, self.rope)], dim=-1)
            q_pos = torch.arange(prefix, total, device=q.device)
            mask = torch.arange(total, device=q.device)[None, :] <= q_pos[:, None]  # [n, L]
            o = F.scaled_dot_product_attention(q[start:start + n].transpose(0, 1), k.transpose(0, 1),
                                               v.transpose(0, 1), attn_mask=mask, scale=self.scale)
            out[start:start + n] = o.transpose(0, 1)
            start += n
        return out

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, slots: torch.Tensor, batch: ForwardBatch,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        h, length = self.num_heads, batch.max_seq_len
        w = self.kv_b_proj.weight.view(h, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope:]  # [H, nope, rank], [H, v, rank]
        q = torch.cat([torch.einsum("bhn,hnr->bhr", q_nope, w_uk), q_pe], dim=-1)  # [B, H, width]
        rows = self._rows(k_cache, v_cache, slots[:, :length], q.dtype)  # [B, L, width]
        scores = torch.einsum("bhw,blw->bhl", q, rows) * self.scale
        seq_lens = batch.seq_lens.to(device=q.device, dtype=torch.int64)
        visible = torch.arange(length, device=q.device)[None, :] < seq_lens[:, None]  # [B, L]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
        o_lat = torch.einsum("bhl,blr->bhr", probs, rows[..., : self.rank])
        return torch.einsum("bhr,hvr->bhv", o_lat, w_uv)

    def load(self, piece: str, param: str, tensor: Any) -> None:
        """HF's ``self_attn.<piece>.<param>``, this rank's part (heads split; the latent's parts whole)."""
        h, r = self.num_heads, self.tp.rank
        rng = None
        if self.tp.is_parallel:
            if piece in ("q_proj", "q_b_proj"):
                rng = (0, r * h * self.qk_dim, h * self.qk_dim)
            elif piece == "kv_b_proj":
                rng = (0, r * h * (self.nope + self.v_dim), h * (self.nope + self.v_dim))
            elif piece == "o_proj" and param == "weight":
                rng = (1, r * h * self.v_dim, h * self.v_dim)
        target = getattr(getattr(self, piece), param)
        with torch.no_grad():
            target.copy_(narrow(tensor, rng))


def _slots(batch: ForwardBatch) -> torch.Tensor:
    """``[B, pages * page_size]`` flat slot of every position of each sequence."""
    ps = batch.page_size
    table = batch.page_table.to(torch.int64)
    return (table[:, :, None] * ps + torch.arange(ps, dtype=torch.int64, device=table.device)).reshape(
        table.shape[0], -1)
