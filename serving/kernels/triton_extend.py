"""Triton paged extend (prefill) attention: new tokens' queries over prefix + new KV in pages.

:func:`extend_attention` picks the kernel: batches of a captured extend graph and eager
batches of up to ``SPLIT_MAX_TOKENS`` new tokens take the split-KV kernel
(``triton_extend_split``: its launch does not depend on the lengths, and a small extend over
a long prefix fills the GPU; the same kernel eagerly and in a graph, so both give the same
bits); larger batches the one-pass kernel here, whose tiles alone fill the GPU.

One-pass kernel, grid ``(batch, kv_heads, query blocks)``. A program holds ``BLOCK_M`` new
tokens x the ``GROUP`` query heads sharing one kv head, flattened into ``R = BLOCK_M * BLOCK_H``
rows, so every K/V block loaded from the pages serves the whole group. Keys of the cached
prefix are visible to every query (no mask); keys among the new tokens take the causal mask. A
sliding window adds a lower bound per row (``window_lo``), and the loops start at the tile's.
Attention sinks (GPT-OSS): each row's sink joins its max and denominator after the last block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from serving.kernels.triton_common import attend_block, check_sinks, next_pow2, window_lo
from serving.kernels.triton_extend_split import extend_blocks, key_block, split_extend_attention
from serving.structs.forward_batch import ForwardBatch

SPLIT_MAX_TOKENS = 512  # eager batches up to this many new tokens take the split-KV kernel


@triton.jit
def _extend_kernel(
    q_ptr,
    o_ptr,
    k_cache,
    v_cache,
    page_table,
    prefix_lens,
    extend_lens,
    extend_start,
    scale,
    window,  # a sliding window's keys (0: none)
    sinks,  # [heads] float32, read when HAS_SINKS
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_pt,
    stride_slot,
    stride_head,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    mblock = tl.program_id(2)
    prefix = tl.load(prefix_lens + seq)
    n_new = tl.load(extend_lens + seq)
    start = tl.load(extend_start + seq).to(tl.int64)
    if mblock * BLOCK_M < n_new:
        rows = tl.arange(0, BLOCK_M * BLOCK_H)
        tok = mblock * BLOCK_M + rows // BLOCK_H  # [R] index among the new tokens
        hh = rows % BLOCK_H
        row_ok = (tok < n_new) & (hh < GROUP)
        head = kv_head * GROUP + hh
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q_off = (start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [R, BLOCK_D]
        q_pos = prefix + tok
        k_lo = window_lo(q_pos, window)  # [R] each row's first visible key
        tile_lo = window_lo(prefix + mblock * BLOCK_M, window)  # the tile's first row's: no row sees before
        page_row = page_table + seq.to(tl.int64) * stride_pt

        acc = tl.zeros([BLOCK_M * BLOCK_H, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_M * BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M * BLOCK_H], dtype=tl.float32)
        # cached prefix: visible to every query (inside its window)
        for kstart in range(tile_lo, prefix, BLOCK_N):
            acc, m_i, l_i = attend_block(
                q, acc, m_i, l_i, k_cache, v_cache, page_row, kv_head, kstart, prefix, q_pos, k_lo, scale,
                stride_slot, stride_head, False, PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N,
            )  # fmt: skip
        # new tokens (already stored in the pages): causal
        kv_end = prefix + tl.minimum(n_new, (mblock + 1) * BLOCK_M)
        for kstart in range(tl.maximum(prefix, tile_lo), kv_end, BLOCK_N):
            acc, m_i, l_i = attend_block(
                q, acc, m_i, l_i, k_cache, v_cache, page_row, kv_head, kstart, kv_end, q_pos, k_lo, scale,
                stride_slot, stride_head, True, PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N,
            )  # fmt: skip
        if HAS_SINKS:  # every real row saw its own key: m_i is finite there
            sink = tl.load(sinks + head, mask=row_ok, other=0.0).to(tl.float32)
            m_f = tl.maximum(m_i, sink)
            alpha = tl.exp(m_i - m_f)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha + tl.exp(sink - m_f)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_off = (start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [T, H, D]`` -> ``o [T, H, D]`` for a ragged extend batch (any extend lengths >= 0); with
    ``window``, each query over the last ``window`` positions up to its own; ``sinks [H]``: attention sinks."""
    if batch.extend_bucket is not None or q.shape[0] <= SPLIT_MAX_TOKENS:
        return split_extend_attention(q, k_cache, v_cache, batch, scale, window=window, sinks=sinks)
    return one_pass_extend_attention(q, k_cache, v_cache, batch, scale, window=window, sinks=sinks)


def one_pass_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    block_n: int | None = None,
    rows: int = 64,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The one-pass kernel: a program per (sequence, kv head, block of new tokens); ``block_n`` None:
    ``key_block(head_dim)``."""
    t, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[-2]
    group = num_heads // kv_heads
    block_h, block_m = extend_blocks(group, rows)
    block_n = block_n or key_block(head_dim)
    o = torch.empty_like(q)
    sinks_arg = check_sinks(sinks, q)
    if t == 0:
        return o
    max_new = max(batch.extend_lens_list)
    grid = (batch.batch_size, kv_heads, triton.cdiv(max_new, block_m))
    _extend_kernel[grid](
        q, o, k_cache, v_cache, batch.page_table, batch.prefix_lens, batch.extend_lens, batch.extend_start,
        scale, window or 0, sinks_arg, q.stride(0), q.stride(1), o.stride(0), o.stride(1),
        batch.page_table.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, PAGE_SIZE=batch.page_size, HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim, 16),
        BLOCK_H=block_h, BLOCK_M=block_m, BLOCK_N=block_n, HAS_SINKS=sinks is not None,
    )  # fmt: skip
    return o
