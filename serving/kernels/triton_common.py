"""Shared Triton pieces: one online-softmax step over a block of paged KV, a sliding window's
first visible key, attention sinks' check."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def next_pow2(n: int, floor: int = 1) -> int:
    """Smallest power of two >= max(n, floor) (tl.arange sizes must be powers of two)."""
    return max(triton.next_power_of_2(max(n, 1)), floor)


@triton.jit
def attend_block(
    q,  # [R, BLOCK_D] queries (R rows = tokens x grouped heads), scaled not yet
    acc,  # [R, BLOCK_D] float32 running sum of p @ v
    m_i,  # [R] float32 running max
    l_i,  # [R] float32 running normalizer
    k_cache,
    v_cache,
    page_row,  # pointer to this sequence's page-table row
    kv_head,
    kstart,
    kv_end,  # keys at positions >= kv_end are masked out
    q_pos,  # [R] absolute position of each query row (for the causal mask)
    k_lo,  # [R] each row's first visible key (a sliding window's lower bound; 0: none)
    scale,
    stride_slot,
    stride_head,
    CAUSAL: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Fold keys ``kstart .. kstart + BLOCK_N`` into (acc, m_i, l_i); returns the new triple."""
    kpos = kstart + tl.arange(0, BLOCK_N)
    k_ok = kpos < kv_end
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    page = tl.load(page_row + kpos // PAGE_SIZE, mask=k_ok, other=0).to(tl.int64)
    slot = page * PAGE_SIZE + kpos % PAGE_SIZE  # [N] flat slot in the layer's cache
    kv_off = slot[:, None] * stride_slot + kv_head * stride_head + d[None, :]
    kv_mask = k_ok[:, None] & d_ok[None, :]
    k = tl.load(k_cache + kv_off, mask=kv_mask, other=0.0)  # [N, BLOCK_D]
    s = tl.dot(q, tl.trans(k).to(q.dtype), input_precision="ieee") * scale  # [R, N] float32
    mask = k_ok[None, :] & (kpos[None, :] >= k_lo[:, None])
    if CAUSAL:
        mask = mask & (kpos[None, :] <= q_pos[:, None])
    s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    p = tl.exp(s - m_use[:, None])
    alpha = tl.exp(m_i - m_use)
    v = tl.load(v_cache + kv_off, mask=kv_mask, other=0.0)  # [N, BLOCK_D]
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")  # fp8 KV: upcast
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc, m_new, l_i


def check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The sinks tensor a kernel reads (``q`` when None: a pointer it never loads, HAS_SINKS off);
    checked on the host from its metadata only (no copy, no sync: graph-safe)."""
    if sinks is None:
        return q
    if sinks.shape != (q.shape[1],) or sinks.dtype != torch.float32 or sinks.device != q.device:
        raise ValueError(f"sinks must be float32 [{q.shape[1]}] on {q.device}, got {sinks.dtype} "
                         f"{list(sinks.shape)} on {sinks.device}")
    return sinks


@triton.jit
def window_lo(pos, WINDOW):
    """The first key a query at ``pos`` sees with a sliding window of ``WINDOW`` keys (0: none)."""
    return tl.where(WINDOW > 0, tl.maximum(pos - WINDOW + 1, 0), 0)
