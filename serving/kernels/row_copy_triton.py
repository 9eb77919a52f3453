"""One Triton kernel that copies scattered rows of one buffer into scattered rows of another,
possibly on another GPU: ``dst[dst_rows[i]] = src[src_rows[i]]`` for every ``i``.

Used by the ``cuda_ipc`` KV transport (PD disaggregation): launched on the sender's GPU, it
reads the local KV pool and writes the peer GPU's pool, mapped into this process through CUDA
IPC, directly over NVLink / PCIe peer-to-peer -- one launch, no staging buffer, no kernel on
the peer. Rows are ``W`` machine words (the caller views bytes as int64 when it can).

Program ``(i, c)`` copies chunk ``c`` (``BLOCK`` words) of row pair ``i``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # words per program (8 KiB of int64)


@triton.jit
def _copy_rows_kernel(src, dst, src_rows, dst_rows, W, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1)
    s = tl.load(src_rows + i).to(tl.int64)
    d = tl.load(dst_rows + i).to(tl.int64)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    ok = offs < W
    tl.store(dst + d * W + offs, tl.load(src + s * W + offs, mask=ok), mask=ok)


def copy_rows(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """``src`` / ``dst``: 2-D, contiguous, the same row width and dtype; the row index tensors
    (int64, on the launching GPU) are equally long. Queued on the current stream."""
    n = int(src_rows.numel())
    if n == 0:
        return
    if src.dim() != 2 or dst.dim() != 2 or src.shape[1] != dst.shape[1] or src.dtype != dst.dtype:
        raise ValueError("src and dst must be 2-D with the same row width and dtype")
    if not (src.is_contiguous() and dst.is_contiguous()) or dst_rows.numel() != n:
        raise ValueError("contiguous buffers and equally long row lists required")
    w = int(src.shape[1])
    grid = (n, triton.cdiv(w, BLOCK))
    if grid[1] > 65535:
        raise ValueError("rows too long for one grid axis")
    _copy_rows_kernel[grid](src, dst, src_rows, dst_rows, w, BLOCK=BLOCK)
