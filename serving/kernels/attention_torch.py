"""Plain PyTorch paged attention: the reference implementation and the CPU default."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from serving.kernels.attention_base import AttentionBackend
from serving.structs.forward_batch import ForwardBatch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@dataclass
class _TorchMeta:
    """Per-batch index tensors shared by every layer."""

    slots: torch.Tensor  # [B, max_pages * page_size] int64 flat slot of every position
    starts: list[int]  # host offsets of each sequence's new tokens in T
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_len] bool, decode batches only
    max_len: int


class TorchAttentionBackend(AttentionBackend):
    """Gathers each sequence's KV from its pages and runs SDPA with a causal offset mask.

    Decode batches run as one padded SDPA call; extend batches loop over sequences.
    """

    name = "torch"

    def __init__(self) -> None:
        self._batch: ForwardBatch | None = None
        self._meta: _TorchMeta | None = None

    def init_forward(self, batch: ForwardBatch) -> None:
        ps = batch.page_size
        table = batch.page_table.to(torch.int64)  # [B, P]
        offsets = torch.arange(ps, dtype=torch.int64, device=table.device)
        slots = (table[:, :, None] * ps + offsets).reshape(table.shape[0], -1)  # [B, P * ps]
        starts, acc = [], 0
        for n in batch.extend_lens_list:
            starts.append(acc)
            acc += n
        max_len = batch.max_seq_len
        decode_mask = None
        if batch.is_decode:
            key_pos = torch.arange(max_len, device=table.device)
            decode_mask = (key_pos[None, :] < batch.seq_lens.to(table.device)[:, None])[:, None, None, :]
        self._batch = batch
        self._meta = _TorchMeta(slots=slots, starts=starts, decode_mask=decode_mask, max_len=max_len)

    def _meta_for(self, batch: ForwardBatch) -> _TorchMeta:
        if self._batch is not batch or self._meta is None:
            self.init_forward(batch)
        assert self._meta is not None
        return self._meta

    def store_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        loc: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        kh, d = k_cache.shape[-2:]
        if self.kv_round_trip is not None:  # a lossy lower tier: L1 keeps what it would give back
            k, v = self.kv_round_trip(k), self.kv_round_trip(v)
        fmax = FP8_MAX.get(k_cache.dtype)
        if fmax is not None:  # --kv-cache-dtype fp8_e4m3: scale 1.0 (vLLM's default), saturating
            k, v = k.clamp(-fmax, fmax), v.clamp(-fmax, fmax)
        k_cache.view(-1, kh, d)[loc] = k.to(k_cache.dtype)  # [num_pages * page_size, kv_heads, head_dim]
        v_cache.view(-1, kh, d)[loc] = v.to(v_cache.dtype)

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:
        meta = self._meta_for(batch)
        kh, d = k_cache.shape[-2:]
        k_flat = k_cache.view(-1, kh, d)  # [S, KH, D]
        v_flat = v_cache.view(-1, kh, d)
        if meta.decode_mask is not None:
            return self._decode(q, k_flat, v_flat, meta, scale)
        out = torch.empty_like(q)
        for i, (prefix, n) in enumerate(zip(batch.prefix_lens_list, batch.extend_lens_list, strict=True)):
            if n == 0:
                continue
            total = prefix + n
            slots = meta.slots[i, :total]
            k = k_flat[slots].transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, KH, L, D]
            v = v_flat[slots].transpose(0, 1).unsqueeze(0).to(q.dtype)
            s = meta.starts[i]
            qi = q[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            q_pos = torch.arange(prefix, total, device=q.device)
            mask = torch.arange(total, device=q.device)[None, :] <= q_pos[:, None]  # [n, L]
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            out[s : s + n] = o[0].transpose(0, 1)  # [n, H, D]
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, meta: _TorchMeta, scale: float
    ) -> torch.Tensor:
        slots = meta.slots[:, : meta.max_len]  # [B, L]; padding slots are masked out
        k = k_flat[slots].permute(0, 2, 1, 3).to(q.dtype)  # [B, KH, L, D]
        v = v_flat[slots].permute(0, 2, 1, 3).to(q.dtype)
        qb = q.unsqueeze(2)  # [B, H, 1, D]
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True)
        return o.squeeze(2)  # [B, H, D]
