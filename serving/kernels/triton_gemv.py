"""A dense projection of a few tokens on CUDA: ``y = x @ W^T (+ b)`` for ``x [T, K]``, ``T <= MAX_TOKENS``.

At decode batch 1 a projection is a matrix-vector product bound by reading ``W`` once. cuBLAS reads the
large ones near the HBM rate (Llama-3.1-8B's, 33-235 MB: 83 % of 4.1 TB/s on the H200) but not the
small ones: Qwen3-30B-A3B's attention projections (17-21 MB, 96 of them a step) took ~10 us each, about
45 % (bench/results/diag/moe-decode-prof-h200-2026-12-05.json). Here each program reads ``BLOCK_N`` rows of
``W`` in ``BLOCK_K`` chunks, once for all ``T`` tokens (float32 accumulation, rounded once to ``x``'s dtype),
so ``N / BLOCK_N`` programs stream ``W`` with no split-K reduction. The result equals ``F.linear`` to rounding
(another summation order).

Off unless ``HICACHE_GEMV=1`` (``ENABLED``): it replaces cuBLAS only once a model run on the GPU shows it
faster (``bench/models.py``). ``fits`` says where it applies.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("HICACHE_GEMV", "0") == "1"
MAX_TOKENS = 4
BLOCK_N, BLOCK_K, WARPS = 8, 256, 8


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`gemv` takes ``x @ weight^T`` (a CUDA tensor's, the caller checks): when enabled, at most
    ``MAX_TOKENS`` rows, a plain 2-D weight of ``x``'s dtype."""
    return (ENABLED and x.dim() == 2 and 0 < x.shape[0] <= MAX_TOKENS and weight.dim() == 2
            and weight.dtype == x.dtype and weight.stride(-1) == 1)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, o_ptr, N, K, stride_x, stride_w, stride_o,
                 T: tl.constexpr, T_P2: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.arange(0, T_P2)
    row_ok = rows < T
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((T_P2, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        k_ok = k < K
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_w + k[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # [N, K]
        a = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)  # [T, K]
        acc += tl.sum(a[:, None, :] * w[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(o_ptr + rows[:, None] * stride_o + cols[None, :], acc.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [T, K]`` (``T <= MAX_TOKENS``), ``weight [N, K]``: ``[T, N]`` in
    ``x``'s dtype. ``tiles``: ``(BLOCK_N, BLOCK_K, warps)``, for sweeps."""
    t, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or not 0 < t <= MAX_TOKENS:
        raise ValueError(f"gemv of x {tuple(x.shape)} and weight {tuple(weight.shape)} (at most {MAX_TOKENS} rows)")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    bn, bk, warps = tiles or (BLOCK_N, BLOCK_K, WARPS)
    _gemv_kernel[(triton.cdiv(n, bn),)](
        x, weight, weight if bias is None else bias, out, n, k, x.stride(0), weight.stride(0), out.stride(0),
        T=t, T_P2=triton.next_power_of_2(t), HAS_BIAS=bias is not None, BLOCK_N=bn,
        BLOCK_K=min(bk, max(16, triton.next_power_of_2(k))), num_warps=warps,
    )  # fmt: skip
    return out
