"""One Triton kernel per page move between the L1 pool (GPU) and pinned L2 memory.

The kernel runs on the GPU and reads or writes the pinned host buffer directly through
its unified (UVA) address: pinned memory from ``cudaHostAlloc`` is mapped into the GPU's
address space, so a plain load/store from a kernel crosses PCIe. One launch moves every
layer, K and V, of a whole list of scattered pages, in either host layout, with no
staging buffer and no host-side scatter:

- device pool, flattened: ``[2L, P, X]`` (row ``r`` = K/V of one layer, ``X`` elements a page)
- host ``layer_first``: ``[2L, Ph, X]``; host ``page_first``: ``[Ph, 2L, X]``

Program ``(i, r, c)`` copies chunk ``c`` (``BLOCK`` elements) of row ``r`` of page pair ``i``.
Each program reads and writes ``BLOCK * itemsize`` contiguous bytes (16-byte vectors), so
enough requests are in flight to fill the PCIe link in both directions.

Runs on CUDA; on CPU tensors it runs only under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DEFAULT_BLOCK = 8192  # elements per program (16 KiB of bf16); best of a sweep on an H200 (bench/gpu.py)
DEFAULT_WARPS = 8


@triton.jit
def _move_pages_kernel(
    src,
    dst,
    src_ids,  # [n] int64 page ids in src
    dst_ids,  # [n] int64 page ids in dst
    n_rows,  # 2 * layers
    src_page_stride,
    src_row_stride,
    dst_page_stride,
    dst_row_stride,
    X: tl.constexpr,  # elements of one row of one page
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    i = pid // n_rows
    r = (pid % n_rows).to(tl.int64)
    sp = tl.load(src_ids + i).to(tl.int64)
    dp = tl.load(dst_ids + i).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    s_off = sp * src_page_stride + r * src_row_stride + offs
    d_off = dp * dst_page_stride + r * dst_row_stride + offs
    if X % BLOCK == 0:
        tl.store(dst + d_off, tl.load(src + s_off))
    else:
        ok = offs < X
        tl.store(dst + d_off, tl.load(src + s_off, mask=ok), mask=ok)


@triton.jit(do_not_specialize=["n_rows", "total", "n_chunks", "programs", "per_program"])  # one build for all sizes
def _move_pages_persistent_kernel(
    src, dst, src_ids, dst_ids, n_rows, total, n_chunks, programs, per_program,
    src_page_stride, src_row_stride, dst_page_stride, dst_row_stride,
    X: tl.constexpr, BLOCK: tl.constexpr,
):
    """The same copies as ``_move_pages_kernel`` from ``programs`` programs: program ``p`` does
    work items ``p, p + programs, ...`` (``per_program`` of them, the last ones masked past
    ``total``; item ``w`` = chunk ``w % n_chunks`` of row-page ``w // n_chunks``), so the copy
    holds only that many SM slots while a forward pass runs."""
    pid = tl.program_id(0)
    for k in range(0, per_program):
        w = pid + k * programs
        valid = w < total
        w = tl.where(valid, w, 0)
        chunk = w % n_chunks
        pr = w // n_chunks
        i = pr // n_rows
        r = (pr % n_rows).to(tl.int64)
        sp = tl.load(src_ids + i).to(tl.int64)
        dp = tl.load(dst_ids + i).to(tl.int64)
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        s_off = sp * src_page_stride + r * src_row_stride + offs
        d_off = dp * dst_page_stride + r * dst_row_stride + offs
        ok = offs < tl.where(valid, X, 0)  # an item past total copies nothing
        tl.store(dst + d_off, tl.load(src + s_off, mask=ok), mask=ok)


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """Copy raw bits: view 2-byte floats as int16 and 4-byte as int32 (no float handling)."""
    size = t.element_size()
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    return t.view(bits) if t.dtype != bits else t


def move_pages(
    src: torch.Tensor,
    src_page_dim: int,
    src_ids: torch.Tensor,
    dst: torch.Tensor,
    dst_page_dim: int,
    dst_ids: torch.Tensor,
    block: int | None = None,
    num_warps: int | None = None,
    max_programs: int | None = None,
) -> None:
    """Copy pages ``src_ids`` of ``src`` into pages ``dst_ids`` of ``dst`` in one launch.

    ``src`` and ``dst`` are 3-D ``[2L, pages, X]`` (page dim 1) or ``[pages, 2L, X]`` (page
    dim 0), contiguous in their last dimension; either may be pinned host memory. The id
    tensors must live where the kernel runs (the GPU, or the CPU under the interpreter).
    The launch goes on the current stream. ``max_programs``: at most that many programs, each
    looping over its share of the chunks (a copy that shares the GPU with a forward pass).
    """
    n = int(src_ids.numel())
    if n == 0:
        return
    if src.dtype != dst.dtype or src.shape[2] != dst.shape[2]:
        raise ValueError("src and dst must have the same dtype and row size")
    if src.stride(2) != 1 or dst.stride(2) != 1:
        raise ValueError("rows must be contiguous")
    rows = src.shape[1 - src_page_dim]
    x = src.shape[2]
    block = min(block or DEFAULT_BLOCK, triton.next_power_of_2(x))
    num_warps = num_warps or DEFAULT_WARPS
    grid = (n * rows, triton.cdiv(x, block))
    if grid[1] > 65535:
        raise ValueError("row too long for one grid axis; raise block")
    if max_programs is not None and grid[0] * grid[1] > max_programs:
        total = grid[0] * grid[1]
        _move_pages_persistent_kernel[(max_programs,)](
            _as_bits(src), _as_bits(dst), src_ids, dst_ids, rows, total, grid[1], max_programs,
            triton.cdiv(total, max_programs),
            src.stride(src_page_dim), src.stride(1 - src_page_dim),
            dst.stride(dst_page_dim), dst.stride(1 - dst_page_dim),
            X=x, BLOCK=block, num_warps=num_warps,
        )  # fmt: skip
        return
    _move_pages_kernel[grid](
        _as_bits(src), _as_bits(dst), src_ids, dst_ids, rows,
        src.stride(src_page_dim), src.stride(1 - src_page_dim),
        dst.stride(dst_page_dim), dst.stride(1 - dst_page_dim),
        X=x, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip
