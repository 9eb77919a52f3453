"""fp8 W8A8 matrix-vector product for decode at batch 1, one Triton launch per projection.

``torch._scaled_mm`` (cuBLASLt) is built for large M: at M = 1 it read the 8B model's fp8 weights
at 1.0-2.5 TB/s (bench/gpu.py section 5, in a CUDA graph), decode ran at 0.94x bf16, and the activations need a
quantization kernel of their own first. Here each program owns ``BLOCK_N`` output channels:

1. the token's absolute maximum over K, the whole row in one load (a few KB, from L2);
2. over K: quantize the activation chunk to e4m3 exactly as ``serving.kernels.fp8_quant`` does,
   load the weight tile (e4m3 codes), multiply in float32 (products of e4m3 values are exact)
   and accumulate;
3. ``sum * x_scale * w_scale[n]`` in the output dtype -- what ``_scaled_mm`` computes with
   row-wise scales, up to the order of the float32 sums.

On the 8B shape this reads fp8 weights at 2.4-4.3 TB/s against cuBLASLt's 1.0-2.5 (bench/gpu.py).

So it is the same W8A8 model as the ``_scaled_mm`` path that serves larger batches, not a
different approximation. ``config_for`` picks the tile sizes (bench/gpu_fp8.py sweeps them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, ws_ptr, y_ptr, N, K, QMAX: tl.constexpr, EPS: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, DOT: tl.constexpr,
                     ONE_SHOT: tl.constexpr, K_POW2: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    ok_n = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * K
    if ONE_SHOT:  # BLOCK_K >= K: both loads issued at once, one memory round trip (small weights)
        ok_k = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=ok_n[:, None] & ok_k[None, :], other=0.0)
        x = tl.load(x_ptr + offs_k, mask=ok_k, other=0.0).to(tl.float32)
        xs = tl.maximum(tl.max(tl.abs(x), 0), EPS) / QMAX
        xq = tl.minimum(tl.maximum(tl.math.div_rn(x, xs), -QMAX), QMAX).to(tl.float8e4nv)
        dot = tl.sum(w.to(tl.float32) * xq.to(tl.float32)[None, :], 1)
    else:
        offs_a = tl.arange(0, K_POW2)  # the whole row in one load: no chain of L2 round trips
        row = tl.load(x_ptr + offs_a, mask=offs_a < K, other=0.0)
        xs = tl.maximum(tl.max(tl.abs(row.to(tl.float32)), 0), EPS) / QMAX
        if DOT:  # tensor cores: the token is row 0 of a 16-row tile, e4m3 x e4m3 -> float32
            acc2 = tl.zeros([16, BLOCK_N], dtype=tl.float32)
            row0 = tl.arange(0, 16)[:, None] == 0
        else:
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            ok_k = k + offs_k < K
            x = tl.load(x_ptr + k + offs_k, mask=ok_k, other=0.0)
            xq = tl.minimum(tl.maximum(tl.math.div_rn(x.to(tl.float32), xs), -QMAX), QMAX).to(tl.float8e4nv)
            w = tl.load(w_rows + (k + offs_k)[None, :], mask=ok_n[:, None] & ok_k[None, :], other=0.0)
            if DOT:
                xt = tl.where(row0, xq.to(tl.float32)[None, :], 0.0).to(tl.float8e4nv)
                acc2 = tl.dot(xt, tl.trans(w), acc2)
            else:
                acc += w.to(tl.float32) * xq.to(tl.float32)[None, :]
        if DOT:
            dot = tl.sum(tl.where(row0, acc2, 0.0), 0)
        else:
            dot = tl.sum(acc, 1)
    ws = tl.load(ws_ptr + offs_n, mask=ok_n, other=0.0)
    tl.store(y_ptr + offs_n, (dot * xs * ws).to(y_ptr.dtype.element_ty), mask=ok_n)


# (block_n, block_k, num_warps, stages, dot); block_k 0: all of K in one tile (one shot).
Config = tuple[int, int, int, int, bool]
CONFIGS: dict[tuple[int, int], Config] = {}  # per weight shape (N, K); bench/gpu_fp8.py's sweep fills it


def config_for(n: int, k: int) -> Config:
    """The sweep's choice for this shape, else what it chose on the 8B shape (bench/results/
    gpu-fp8-2026-12-01.json): one shot up to K = 8192, 16 x 1024 tiles beyond, tensor cores for an
    LM-head-sized N."""
    if (n, k) in CONFIGS:
        return CONFIGS[(n, k)]
    if n >= 65536:
        return (64, 256, 4, 3, True)
    return (8, 0, 4, 1, False) if k <= 8192 else (16, 1024, 8, 1, False)


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype,
             config: Config | None = None) -> torch.Tensor:
    """``x [1, K]`` (bf16/fp16/fp32) times e4m3 ``w [N, K]`` with float32 ``w_scale`` (N values)
    -> ``[1, N]`` in ``out_dtype``; the activation row quantized per token inside."""
    k = x.shape[-1]
    n = w.shape[0]
    x = x.reshape(k)
    if x.stride(0) != 1:
        x = x.contiguous()
    y = torch.empty((1, n), dtype=out_dtype, device=x.device)
    block_n, block_k, warps, stages, dot = config or config_for(n, k)
    one_shot = block_k == 0
    if one_shot:
        block_k = triton.next_power_of_2(k)
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](x, w, w_scale, y, n, k, QMAX=FP8_MAX, EPS=1e-12,
                                                 BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, DOT=dot,
                                                 ONE_SHOT=one_shot, K_POW2=triton.next_power_of_2(k),
                                                 num_warps=warps)
    return y
