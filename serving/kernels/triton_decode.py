"""Triton paged decode attention (one new token per sequence), split over the KV length.

Stage 1, grid ``(batch, kv_heads, splits)``: each program takes the ``GROUP`` query heads of one
kv head (padded to ``BLOCK_H`` rows so ``tl.dot`` has >= 16 rows) and one contiguous chunk of
the sequence's KV, read page by page, and writes a normalized partial output and its
log-sum-exp. Stage 2, grid ``(batch, q_heads)``: merges the splits, and adds a head's attention
sink (GPT-OSS) to the denominator once there. Splitting keeps the GPU busy when the batch is
small and the context long (flash-decoding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from serving.kernels.triton_common import attend_block, check_sinks, next_pow2, window_lo
from serving.structs.forward_batch import ForwardBatch

MAX_SPLITS = 16
MIN_CHUNK = 256  # keys per split at least
BUSY_PROGRAMS = 264  # ~2 waves on an H200 (132 SMs): more programs than this need no split


@triton.jit
def decode_partial_kernel(
    q_ptr,
    part_o,  # [B, H, SPLITS, BLOCK_D] float32
    part_lse,  # [B, H, SPLITS] float32
    k_cache,
    v_cache,
    page_table,
    seq_lens,
    extend_start,
    scale,
    window,  # a sliding window's keys (0: none)
    stride_qt,
    stride_qh,
    stride_pt,
    stride_slot,
    stride_head,
    NUM_HEADS: tl.constexpr,
    SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + seq)
    wlo = window_lo(seq_len - 1, window)  # the window's first key (0: none); the splits share the rest
    chunk = tl.cdiv(tl.cdiv(seq_len - wlo, SPLITS), BLOCK_N) * BLOCK_N
    lo = wlo + split * chunk
    hi = tl.minimum(lo + chunk, seq_len)
    hh = tl.arange(0, BLOCK_H)
    row_ok = hh < GROUP
    head = kv_head * GROUP + hh
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    tok = tl.load(extend_start + seq).to(tl.int64)
    q = tl.load(
        q_ptr + tok * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]
    page_row = page_table + seq.to(tl.int64) * stride_pt
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    q_pos = tl.zeros([BLOCK_H], dtype=tl.int32)  # unused: no causal mask in decode
    k_lo = tl.zeros([BLOCK_H], dtype=tl.int32)  # the loop starts inside the window
    for kstart in range(lo, hi, BLOCK_N):
        acc, m_i, l_i = attend_block(
            q, acc, m_i, l_i, k_cache, v_cache, page_row, kv_head, kstart, hi, q_pos, k_lo, scale,
            stride_slot, stride_head, False, PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N,
        )  # fmt: skip
    empty = l_i == 0.0  # this split had no keys
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    base = (seq.to(tl.int64) * NUM_HEADS + head) * SPLITS + split  # [BLOCK_H]
    tl.store(part_o + base[:, None] * BLOCK_D + d[None, :], out, mask=row_ok[:, None])
    tl.store(part_lse + base, lse, mask=row_ok)


@triton.jit
def _decode_merge_kernel(
    part_o,
    part_lse,
    o_ptr,
    extend_start,
    sinks,  # [NUM_HEADS] float32, read when HAS_SINKS
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    sp_ok = sp < SPLITS
    base = (seq.to(tl.int64) * NUM_HEADS + head) * SPLITS
    lse = tl.load(part_lse + base + sp, mask=sp_ok, other=float("-inf"))  # [S]
    m = tl.max(lse, 0)  # split 0 is never empty
    if HAS_SINKS:
        sink = tl.load(sinks + head).to(tl.float32)
        m = tl.maximum(m, sink)
    w = tl.exp(lse - m)  # empty splits weigh 0
    denom = tl.sum(w, 0)
    if HAS_SINKS:
        denom += tl.exp(sink - m)  # the sink's weight, no value
    d = tl.arange(0, BLOCK_D)
    parts = tl.load(part_o + (base + sp)[:, None] * BLOCK_D + d[None, :], mask=sp_ok[:, None], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / denom  # [BLOCK_D]
    tok = tl.load(extend_start + seq).to(tl.int64)
    tl.store(
        o_ptr + tok * stride_ot + head * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d < HEAD_DIM
    )


def num_splits(batch: ForwardBatch, kv_heads: int) -> int:
    """Host-side heuristic (no device sync): split long contexts of small batches."""
    if batch.batch_size * kv_heads >= BUSY_PROGRAMS:
        return 1
    return max(1, min(MAX_SPLITS, batch.max_seq_len // MIN_CHUNK))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    block_n: int = 64,
    splits: int | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [T=B, H, D]`` (one new token per sequence) -> ``o [B, H, D]``; with ``window``, each over its
    sequence's last ``window`` keys (the splits share those); ``sinks [H]`` float32: attention sinks."""
    b, num_heads, head_dim = q.shape[0], q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[-2]
    group = num_heads // kv_heads
    splits = splits or num_splits(batch, kv_heads)
    block_d = next_pow2(head_dim, 16)
    o = torch.empty_like(q)
    sinks_arg = check_sinks(sinks, q)
    if b == 0:
        return o
    nb = batch.batch_size
    part_o = torch.empty((nb, num_heads, splits, block_d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((nb, num_heads, splits), dtype=torch.float32, device=q.device)
    decode_partial_kernel[(nb, kv_heads, splits)](
        q, part_o, part_lse, k_cache, v_cache, batch.page_table, batch.seq_lens, batch.extend_start, scale,
        window or 0, q.stride(0), q.stride(1), batch.page_table.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, SPLITS=splits, GROUP=group, PAGE_SIZE=batch.page_size, HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_H=next_pow2(group, 16), BLOCK_N=block_n,
    )  # fmt: skip
    _decode_merge_kernel[(nb, num_heads)](
        part_o, part_lse, o, batch.extend_start, sinks_arg, o.stride(0), o.stride(1),
        NUM_HEADS=num_heads, SPLITS=splits, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=next_pow2(splits),
        HAS_SINKS=sinks is not None,
    )  # fmt: skip
    return o
