"""Triton KV store: write the new tokens' K and V rows into their page slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from serving.kernels.triton_common import next_pow2

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}  # the torch backend's saturation


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache,
    v_cache,
    loc_ptr,
    stride_kt,
    stride_vt,
    ROW: tl.constexpr,  # kv_heads * head_dim
    BLOCK: tl.constexpr,
    CLAMP: tl.constexpr,  # > 0: saturate to +-CLAMP first (an fp8 cache; scale 1.0, as vLLM's default)
):
    t = tl.program_id(0)
    chunk = tl.program_id(1)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    # slot -1: a padding row of a CUDA-graph batch, not stored
    ok = (offs < ROW) & ((tl.zeros([BLOCK], dtype=tl.int64) + slot) >= 0)
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + offs, mask=ok)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + offs, mask=ok)
    if CLAMP > 0:
        k = tl.minimum(tl.maximum(k.to(tl.float32), -CLAMP), CLAMP)
        v = tl.minimum(tl.maximum(v.to(tl.float32), -CLAMP), CLAMP)
    tl.store(k_cache + slot * ROW + offs, k.to(k_cache.dtype.element_ty), mask=ok)
    tl.store(v_cache + slot * ROW + offs, v.to(v_cache.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[T, KH, D]`` with each token's ``KH * D`` values contiguous (a row stride is allowed)."""
    if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]:
        return x
    return x.contiguous()


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block: int = 1024,
) -> None:
    """Write ``k``/``v [T, KH, D]`` at flat slots ``loc [T]`` of ``[pages, page_size, KH, D]`` caches.

    Tokens whose slot is negative are skipped (padding rows of a CUDA-graph batch)."""
    t = k.shape[0]
    if t == 0:
        return
    row = k.shape[1] * k.shape[2]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("KV caches must be contiguous per layer")
    k, v = _rows(k), _rows(v)
    block = min(block, next_pow2(row))
    _store_kv_kernel[(t, triton.cdiv(row, block))](
        k, v, k_cache, v_cache, loc, k.stride(0), v.stride(0), ROW=row, BLOCK=block,
        CLAMP=FP8_MAX.get(k_cache.dtype, 0.0),
    )
