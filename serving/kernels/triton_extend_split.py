"""Triton split-KV extend attention whose launch depends on a token budget, not on the batch's lengths.

Tiles: sequence ``i``'s new tokens in blocks of ``BLOCK_M`` (``cdiv(extend_lens[i], BLOCK_M)``
tiles), numbered over all sequences in order. Program ``p`` of grid axis 0 finds its
(sequence, block) on the device from ``extend_lens`` (a prefix sum), so the grid has a fixed
number of tile slots: for a CUDA graph the bound of its bucket (tokens, sequences), eagerly
the batch's own tile count; programs past the last tile do nothing. A tile holds ``BLOCK_M``
tokens x the ``GROUP`` query heads of one kv head (rows ``R = BLOCK_M * BLOCK_H``), as in the
one-pass kernel (``triton_extend``).

Stage 1, grid ``(tiles, kv_heads, splits + 1)``: program ``(p, h, s < splits)`` folds chunk
``s`` of the cached prefix (no mask), ``(p, h, splits)`` the new tokens (causal); each writes
a normalized partial output and its log-sum-exp per (token, head). Stage 2, grid
``(tiles, kv_heads)``: merges them in a fixed order (and adds a head's attention sink, GPT-OSS's,
to the denominator once there). A split with no keys (a prefix shorter
than ``splits`` chunks, or none) writes nothing and the merge skips it. Splitting the
prefix is what lets a small extend over a long prefix fill the GPU (flash-decoding): 16 new
tokens over a 4k prefix on 8 kv heads are 8 programs in one pass, 136 here.

Exactness: the split count is a function of the token count rounded up to a power of two
(:func:`extend_splits`), the buckets of the extend graphs are powers of two (or the budget,
which rounds up like every count above the bucket below it), and a chunk's bounds depend only
on the sequence's prefix and the split count. So a batch gives bit-identical attention
whether it runs eagerly or padded in a graph: the same partials, merged in the same order
(padding adds no tile).

Sliding window: the splits share the prefix keys from the tile's first visible key
(``window_lo`` of its first token) on, and each row masks the keys before its own; a function of
the prefix, the tile and the split count, so the exactness above holds per window.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from serving.kernels.triton_common import attend_block, check_sinks, next_pow2, window_lo
from serving.structs.forward_batch import ForwardBatch

MAX_SPLITS = 16
BUSY_PROGRAMS = 264  # ~2 waves on an H200 (132 SMs), as for decode
MIN_SEQ_BLOCK = 64  # tl.arange over the sequences: one compiled variant for batches up to 64
MAX_TILE_SLOTS = 65535  # the tile lookup packs a count of tiles into 16 bits


def key_block(head_dim: int) -> int:
    """Keys per block of the extend kernels: 64, or 32 past head_dim 128 (Gemma-3, Qwen3.5's 256): a
    tile of 64 rows x 64 keys there needs ~295 KB of shared memory, over Hopper's 227 KB, and does not
    launch; 32 keys need ~196 KB."""
    return 64 if head_dim <= 128 else 32


def extend_blocks(group: int, rows: int = 64) -> tuple[int, int]:
    """``(BLOCK_H, BLOCK_M)``: query heads per kv head padded to a power of two, and new tokens
    per tile (``rows`` rows in all, at least 16 for ``tl.dot``)."""
    block_h = next_pow2(group)
    block_m = max(rows // block_h, 1)
    if block_m * block_h < 16:
        block_m = 16 // block_h
    return block_h, block_m


def extend_splits(num_tokens: int, kv_heads: int, block_m: int) -> int:
    """Prefix splits of an extend batch of ``num_tokens`` new tokens: enough programs for ~2 waves
    when the batch is one sequence. A function of ``next_pow2(num_tokens)`` only (see the module doc)."""
    tiles = triton.cdiv(next_pow2(num_tokens, 16), block_m)
    return max(1, min(MAX_SPLITS, BUSY_PROGRAMS // (tiles * kv_heads)))


def max_tiles(num_tokens: int, num_seqs: int, block_m: int) -> int:
    """Most tiles ``num_seqs`` sequences with ``num_tokens`` new tokens in all can have."""
    return max(1, min(num_tokens, (num_tokens + num_seqs * (block_m - 1)) // block_m))


@triton.jit(do_not_specialize=["nseq", "splits", "window"])
def _extend_partial_kernel(
    q_ptr,
    part_o,  # [T, H, splits + 1, BLOCK_D] float32
    part_lse,  # [T, H, splits + 1] float32
    k_cache,
    v_cache,
    page_table,
    prefix_lens,
    extend_lens,
    extend_start,
    nseq,
    splits,
    scale,
    window,  # a sliding window's keys (0: none)
    stride_qt,
    stride_qh,
    stride_pt,
    stride_slot,
    stride_head,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # This program's tile: (sequence, block of BLOCK_M new tokens); sequence >= nseq past the last
    # tile. The sequences before it are those whose tiles end at or before it (a prefix of them):
    # one sum counts them (high bits) and their tiles (low bits). Inline, with no tl.cdiv: the
    # interpreter pays for every nested jit call.
    j = tl.arange(0, BLOCK_B)
    tiles = (tl.load(extend_lens + j, mask=j < nseq, other=0) + BLOCK_M - 1) // BLOCK_M
    before = tl.sum(tl.where(tl.cumsum(tiles, 0) <= tl.program_id(0), tiles + 65536, 0), 0)
    seq = before >> 16
    mblock = tl.program_id(0) - (before & 65535)
    prefix = tl.load(prefix_lens + seq, mask=seq < nseq, other=0)
    tile_lo = window_lo(prefix + mblock * BLOCK_M, window)  # no row of the tile sees a key before it
    wlo = tl.minimum(tile_lo, prefix)  # the splits share the prefix keys wlo .. prefix - 1
    chunk = ((prefix - wlo + splits - 1) // splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N  # prefix keys per split
    lo = wlo + split * chunk
    if (seq < nseq) & ((split == splits) | (lo < prefix)):  # an empty split writes nothing
        n_new = tl.load(extend_lens + seq)
        start = tl.load(extend_start + seq).to(tl.int64)
        rows = tl.arange(0, BLOCK_M * BLOCK_H)
        tok = mblock * BLOCK_M + rows // BLOCK_H  # [R] index among the sequence's new tokens
        hh = rows % BLOCK_H
        row_ok = (tok < n_new) & (hh < GROUP)
        head = kv_head * GROUP + hh
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q_off = (start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [R, BLOCK_D]
        q_pos = prefix + tok
        k_lo = window_lo(q_pos, window)  # [R] each row's first visible key
        page_row = page_table + seq.to(tl.int64) * stride_pt
        acc = tl.zeros([BLOCK_M * BLOCK_H, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_M * BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M * BLOCK_H], dtype=tl.float32)
        if split < splits:  # chunk `split` of the cached prefix: visible to every query
            hi = tl.minimum(lo + chunk, prefix)
            for kstart in range(lo, hi, BLOCK_N):
                acc, m_i, l_i = attend_block(
                    q, acc, m_i, l_i, k_cache, v_cache, page_row, kv_head, kstart, hi, q_pos, k_lo, scale,
                    stride_slot, stride_head, False, PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N,
                )  # fmt: skip
        else:  # the new tokens (already stored in the pages): causal
            kv_end = prefix + tl.minimum(n_new, (mblock + 1) * BLOCK_M)
            for kstart in range(tl.maximum(prefix, tile_lo), kv_end, BLOCK_N):
                acc, m_i, l_i = attend_block(
                    q, acc, m_i, l_i, k_cache, v_cache, page_row, kv_head, kstart, kv_end, q_pos, k_lo, scale,
                    stride_slot, stride_head, True, PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N,
                )  # fmt: skip
        # without a window every key of a written split is visible to every real row (the causal part:
        # its own token); a row that sees none of a split's keys (before its window) writes lse -inf
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        lse = m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i))
        base = ((start + tok) * NUM_HEADS + head) * (splits + 1) + split  # [R]
        tl.store(part_o + base[:, None] * BLOCK_D + d[None, :], out, mask=row_ok[:, None])
        tl.store(part_lse + base, lse, mask=row_ok)


@triton.jit(do_not_specialize=["nseq", "splits", "window"])
def _extend_merge_kernel(
    part_o,
    part_lse,
    o_ptr,
    prefix_lens,
    extend_lens,
    extend_start,
    nseq,
    splits,
    window,
    sinks,  # [NUM_HEADS] float32, read when HAS_SINKS
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    kv_head = tl.program_id(1)
    j = tl.arange(0, BLOCK_B)  # this program's tile, as in the partial kernel
    tiles = (tl.load(extend_lens + j, mask=j < nseq, other=0) + BLOCK_M - 1) // BLOCK_M
    before = tl.sum(tl.where(tl.cumsum(tiles, 0) <= tl.program_id(0), tiles + 65536, 0), 0)
    seq = before >> 16
    mblock = tl.program_id(0) - (before & 65535)
    if seq < nseq:
        prefix = tl.load(prefix_lens + seq)
        wlo = tl.minimum(window_lo(prefix + mblock * BLOCK_M, window), prefix)  # as in the partial kernel
        chunk = ((prefix - wlo + splits - 1) // splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        step = tl.maximum(chunk, 1)  # chunk is 0 without a prefix (or without one inside the window)
        written = (prefix - wlo + step - 1) // step  # prefix splits with keys; then the causal one
        n_new = tl.load(extend_lens + seq)
        start = tl.load(extend_start + seq).to(tl.int64)
        rows = tl.arange(0, BLOCK_M * BLOCK_H)
        tok = mblock * BLOCK_M + rows // BLOCK_H
        hh = rows % BLOCK_H
        row_ok = (tok < n_new) & (hh < GROUP)
        head = kv_head * GROUP + hh
        d = tl.arange(0, BLOCK_D)
        base = ((start + tok) * NUM_HEADS + head) * (splits + 1)  # [R]
        m = tl.full([BLOCK_M * BLOCK_H], float("-inf"), dtype=tl.float32)
        for i in range(0, written + 1):
            s = tl.where(i < written, i, splits)
            m = tl.maximum(m, tl.load(part_lse + base + s, mask=row_ok, other=float("-inf")))
        if HAS_SINKS:  # a real row's m is finite (its causal split sees its own key)
            sink = tl.load(sinks + head, mask=row_ok, other=0.0).to(tl.float32)
            m = tl.maximum(m, sink)
        m = tl.where(row_ok, m, 0.0)
        acc = tl.zeros([BLOCK_M * BLOCK_H, BLOCK_D], dtype=tl.float32)
        w_sum = tl.zeros([BLOCK_M * BLOCK_H], dtype=tl.float32)
        for i in range(0, written + 1):
            s = tl.where(i < written, i, splits)
            w = tl.exp(tl.load(part_lse + base + s, mask=row_ok, other=float("-inf")) - m)
            part = tl.load(part_o + (base + s)[:, None] * BLOCK_D + d[None, :], mask=row_ok[:, None], other=0.0)
            acc += part * w[:, None]
            w_sum += w
        if HAS_SINKS:
            w_sum += tl.exp(sink - m)  # the sink's weight, no value
        out = acc / tl.where(w_sum == 0.0, 1.0, w_sum)[:, None]
        o_off = (start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (d < HEAD_DIM)[None, :])


def split_extend_attention(
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
    """``q [T, H, D]`` -> ``o [T, H, D]`` for a ragged extend batch (``window``: a sliding window;
    ``sinks [H]`` float32: attention sinks; ``block_n`` None: :func:`key_block`).
    With ``batch.extend_bucket`` (a captured graph's ``(tokens, sequences)``) the launch is sized for
    the bucket and rows of no sequence (padding tokens) are left unwritten; otherwise for this batch."""
    t, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[-2]
    group = num_heads // kv_heads
    block_h, block_m = extend_blocks(group, rows)
    block_n = block_n or key_block(head_dim)
    nseq = int(batch.extend_lens.shape[0])
    if batch.extend_bucket is not None:
        tokens, tiles = batch.extend_bucket[0], max_tiles(*batch.extend_bucket, block_m)
    else:
        tokens, tiles = t, sum(triton.cdiv(n, block_m) for n in batch.extend_lens_list)
    o = torch.empty_like(q)
    sinks_arg = check_sinks(sinks, q)
    if t == 0 or tiles == 0:
        return o
    if tiles > MAX_TILE_SLOTS or nseq >= 32768:
        raise ValueError(f"{tiles} tiles of {nseq} sequences: too many for the split-KV extend kernel")
    splits = extend_splits(tokens, kv_heads, block_m)
    block_d = next_pow2(head_dim, 16)
    block_b = next_pow2(nseq, MIN_SEQ_BLOCK)
    part_o = torch.empty((t, num_heads, splits + 1, block_d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((t, num_heads, splits + 1), dtype=torch.float32, device=q.device)
    _extend_partial_kernel[(tiles, kv_heads, splits + 1)](
        q, part_o, part_lse, k_cache, v_cache, batch.page_table, batch.prefix_lens, batch.extend_lens,
        batch.extend_start, nseq, splits, scale, window or 0, q.stride(0), q.stride(1), batch.page_table.stride(0),
        k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, GROUP=group, PAGE_SIZE=batch.page_size, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_H=block_h, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_B=block_b,
    )  # fmt: skip
    _extend_merge_kernel[(tiles, kv_heads)](
        part_o, part_lse, o, batch.prefix_lens, batch.extend_lens, batch.extend_start, nseq, splits, window or 0,
        sinks_arg, o.stride(0), o.stride(1),
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=block_h,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_B=block_b, HAS_SINKS=sinks is not None,
    )  # fmt: skip
    return o
