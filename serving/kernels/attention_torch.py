"""Plain PyTorch paged attention: the reference implementation and the CPU default (a sliding
window: the keys before it are neither gathered nor seen; attention sinks: the masked scores and a
sink column in one softmax, SDPA having no sinks)."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    seq_lens: torch.Tensor | None = None  # [B] int64 on the slots' device, decode batches only
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # decode: window -> its mask

    def decode_mask_for(self, window: int | None) -> torch.Tensor:
        """The decode mask, narrowed to the last ``window`` keys of each sequence."""
        assert self.decode_mask is not None and self.seq_lens is not None
        if window is None:
            return self.decode_mask
        mask = self.window_masks.get(window)
        if mask is None:
            key_pos = torch.arange(self.max_len, device=self.seq_lens.device)
            inside = key_pos[None, :] >= (self.seq_lens - window)[:, None]
            mask = self.window_masks[window] = self.decode_mask & inside[:, None, None, :]
        return mask


class TorchAttentionBackend(AttentionBackend):
    """Gathers each sequence's KV from its pages and runs SDPA with a causal offset mask.

    Decode batches run as one padded SDPA call; extend batches loop over sequences.
    """

    name = "torch"

    def __init__(self) -> None:
        self._batch: ForwardBatch | None = None
        self._meta: _TorchMeta | None = None
        self._win_meta: _TorchMeta | None = None  # the sliding layers' view (batch.win) of a hybrid SWA pool

    def init_forward(self, batch: ForwardBatch) -> None:
        self._batch = batch
        self._meta = self._build_meta(batch)
        self._win_meta = None if batch.win is None else self._build_meta(batch.win)

    @staticmethod
    def _build_meta(batch: ForwardBatch) -> _TorchMeta:
        ps = batch.page_size
        table = batch.page_table.to(torch.int64)  # [B, P]
        offsets = torch.arange(ps, dtype=torch.int64, device=table.device)
        slots = (table[:, :, None] * ps + offsets).reshape(table.shape[0], -1)  # [B, P * ps]
        starts, acc = [], 0
        for n in batch.extend_lens_list:
            starts.append(acc)
            acc += n
        max_len = batch.max_seq_len
        decode_mask = seq_lens = None
        if batch.is_decode:
            key_pos = torch.arange(max_len, device=table.device)
            seq_lens = batch.seq_lens.to(device=table.device, dtype=torch.int64)
            decode_mask = (key_pos[None, :] < seq_lens[:, None])[:, None, None, :]
        return _TorchMeta(slots=slots, starts=starts, decode_mask=decode_mask, max_len=max_len, seq_lens=seq_lens)

    def _meta_for(self, batch: ForwardBatch) -> _TorchMeta:
        if self._batch is not None and batch is self._batch.win and self._win_meta is not None:
            return self._win_meta
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
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        meta = self._meta_for(batch)
        kh, d = k_cache.shape[-2:]
        k_flat = k_cache.view(-1, kh, d)  # [S, KH, D]
        v_flat = v_cache.view(-1, kh, d)
        if meta.decode_mask is not None:
            return self._decode(q, k_flat, v_flat, meta, scale, window, sinks)
        out = torch.empty_like(q)
        for i, (prefix, n) in enumerate(zip(batch.prefix_lens_list, batch.extend_lens_list, strict=True)):
            if n == 0:
                continue
            total = prefix + n
            lo = 0 if window is None else max(0, prefix - window + 1)  # no new token sees a key before lo
            slots = meta.slots[i, lo:total]
            k = k_flat[slots].transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, KH, L, D]
            v = v_flat[slots].transpose(0, 1).unsqueeze(0).to(q.dtype)
            s = meta.starts[i]
            qi = q[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            q_pos = torch.arange(prefix, total, device=q.device)
            key_pos = torch.arange(lo, total, device=q.device)[None, :]
            mask = key_pos <= q_pos[:, None]  # [n, L]
            if window is not None:
                mask &= key_pos > q_pos[:, None] - window
            o = _attend(qi, k, v, mask, scale, sinks)
            out[s : s + n] = o[0].transpose(0, 1)  # [n, H, D]
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, meta: _TorchMeta, scale: float,
        window: int | None, sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        slots = meta.slots[:, : meta.max_len]  # [B, L]; padding slots are masked out
        k = k_flat[slots].permute(0, 2, 1, 3).to(q.dtype)  # [B, KH, L, D]
        v = v_flat[slots].permute(0, 2, 1, 3).to(q.dtype)
        qb = q.unsqueeze(2)  # [B, H, 1, D]
        mask = meta.decode_mask_for(window)
        return _attend(qb, k, v, mask, scale, sinks).squeeze(2)  # [B, H, D]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            sinks: torch.Tensor | None) -> torch.Tensor:
    """SDPA of ``q [B, H, n, D]`` over ``k``, ``v [B, KH, L, D]`` with ``mask`` (``[.., n, L]`` bool);
    with ``sinks [H]``, one softmax over the masked scores and a sink column (its weight dropped)."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).float(), v.repeat_interleave(group, dim=1).float()
    scores = (q.float() @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))  # [B, H, n, L]
    sink = sinks.to(torch.float32)[None, :, None, None].expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return (probs @ v).to(q.dtype)
