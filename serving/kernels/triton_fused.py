"""Fused Triton kernels for the model's small per-layer steps on CUDA.

A decode step of an 8B model launches its GEMMs plus dozens of tiny elementwise kernels per
layer (RMSNorm alone is seven in eager PyTorch: cast, square, mean, rsqrt, two muls, cast).
Each costs a few microseconds even inside a CUDA graph, which adds up to milliseconds per
step. These kernels do each step in one launch, with the same arithmetic as the torch path
in ``serving/models`` (float32 inside, the same casts), so outputs agree to rounding:

- ``rmsnorm``: HF's LlamaRMSNorm (normalize in float32, cast back, times the weight);
- ``add_rmsnorm``: the residual add before it too (``h = residual + x``, then the norm of h);
- ``rope_qk``: rotary embedding of q and k straight out of the fused qkv projection, reading
  the cos/sin tables at each token's position (float32, ``rotate_half`` convention), with each
  head's RMSNorm before it where the family has one (Qwen3's ``q_norm`` / ``k_norm``);
- ``silu_mul``: ``silu(gate) * up`` from the fused gate_up projection.

``ENABLED`` switches them off (tests compare both paths).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ENABLED = True


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, o_ptr, stride_x, stride_o, eps, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / N
    y = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    out = (w.to(tl.float32) * y.to(tl.float32)).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + row * stride_o + offs, out, mask=ok)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` over the last dim of ``x [T, N]``."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(n)
        _rmsnorm_kernel[(x2.shape[0],)](
            x2, weight, out, x2.stride(0), out.stride(0), eps, N=n, BLOCK=block,
            num_warps=max(1, min(16, block // 512)),
        )  # fmt: skip
    return out.view(x.shape)


@triton.jit
def _add_rmsnorm_kernel(x_ptr, r_ptr, w_ptr, o_ptr, h_ptr, stride_x, stride_r, stride_o, stride_h, eps,
                        N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
    r = tl.load(r_ptr + row * stride_r + offs, mask=ok, other=0.0)
    h = (r.to(tl.float32) + x.to(tl.float32)).to(h_ptr.dtype.element_ty)  # torch's r + x, rounded
    tl.store(h_ptr + row * stride_h + offs, h, mask=ok)
    hf = h.to(tl.float32)
    var = tl.sum(hf * hf, 0) / N
    y = (hf * tl.rsqrt(var + eps)).to(h.dtype)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    tl.store(o_ptr + row * stride_o + offs, (w.to(tl.float32) * y.to(tl.float32)).to(o_ptr.dtype.element_ty),
             mask=ok)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + x`` and ``rmsnorm(h)`` in one launch: (normed, h), both ``[T, N]``."""
    n = x.shape[-1]
    x = x if x.stride(-1) == 1 else x.contiguous()
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    h = torch.empty(residual.shape, dtype=torch.promote_types(residual.dtype, x.dtype), device=x.device)
    out = torch.empty(h.shape, dtype=torch.promote_types(weight.dtype, h.dtype), device=x.device)
    if h.shape[0]:
        block = triton.next_power_of_2(n)
        _add_rmsnorm_kernel[(h.shape[0],)](
            x, residual, weight, out, h, x.stride(0), residual.stride(0), out.stride(0), h.stride(0), eps,
            N=n, BLOCK=block, num_warps=max(1, min(16, block // 512)),
        )  # fmt: skip
    return out, h


@triton.jit
def _rope_qk_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, o_ptr, qw_ptr, kw_ptr, stride_t, stride_ot, stride_table, eps,
    NUM_Q: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)  # q heads, then k heads: consecutive in both qkv and the output
    d = tl.arange(0, BLOCK)
    ok = d < HALF
    pos = tl.load(pos_ptr + t).to(tl.int64)
    src = qkv_ptr + t * stride_t + h * HEAD_DIM
    x1 = tl.load(src + d, mask=ok, other=0.0)
    x2 = tl.load(src + HALF + d, mask=ok, other=0.0)
    if NORM:  # the head's RMSNorm first (Qwen3's q_norm / k_norm), rounded as rmsnorm rounds
        xf1, xf2 = x1.to(tl.float32), x2.to(tl.float32)
        r = tl.rsqrt((tl.sum(xf1 * xf1, 0) + tl.sum(xf2 * xf2, 0)) / HEAD_DIM + eps)
        is_q = h < NUM_Q
        w1 = tl.where(is_q, tl.load(qw_ptr + d, mask=ok, other=0.0), tl.load(kw_ptr + d, mask=ok, other=0.0))
        w2 = tl.where(is_q, tl.load(qw_ptr + HALF + d, mask=ok, other=0.0),
                      tl.load(kw_ptr + HALF + d, mask=ok, other=0.0))
        x1 = (w1.to(tl.float32) * (xf1 * r).to(x1.dtype).to(tl.float32)).to(o_ptr.dtype.element_ty)
        x2 = (w2.to(tl.float32) * (xf2 * r).to(x2.dtype).to(tl.float32)).to(o_ptr.dtype.element_ty)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    c1 = tl.load(cos_ptr + pos * stride_table + d, mask=ok, other=0.0)
    c2 = tl.load(cos_ptr + pos * stride_table + HALF + d, mask=ok, other=0.0)
    s1 = tl.load(sin_ptr + pos * stride_table + d, mask=ok, other=0.0)
    s2 = tl.load(sin_ptr + pos * stride_table + HALF + d, mask=ok, other=0.0)
    o1 = x1 * c1 + (-x2) * s1  # rotate_half(x) = [-x2, x1]
    o2 = x2 * c2 + x1 * s2
    dst = o_ptr + t * stride_ot + h * HEAD_DIM
    tl.store(dst + d, o1.to(o_ptr.dtype.element_ty), mask=ok)
    tl.store(dst + HALF + d, o2.to(o_ptr.dtype.element_ty), mask=ok)


def rope_qk(
    qkv: torch.Tensor,  # [T, (H + 2 KH) * D], q | k | v
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [L, D] float32 table
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated ``q [T, H, D]`` and ``k [T, KH, D]`` (views of one new tensor; rows strided). ``norms``:
    ``(q_weight, k_weight, eps)``, each head's RMSNorm before the rotation (``rmsnorm``'s arithmetic; the
    weights of ``qkv``'s dtype), one launch for what Qwen3's attention did in about twenty."""
    t = qkv.shape[0]
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    heads = num_heads + num_kv_heads
    qk = torch.empty((t, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    qw, kw, eps = norms if norms is not None else (qk, qk, 0.0)  # unread without norms
    if t:
        half = head_dim // 2
        _rope_qk_kernel[(t, heads)](
            qkv, positions, cos, sin, qk, qw, kw, qkv.stride(0), qk.stride(0), cos.stride(0), eps,
            NUM_Q=num_heads, HEAD_DIM=head_dim, HALF=half, BLOCK=triton.next_power_of_2(half),
            NORM=norms is not None, num_warps=1,
        )  # fmt: skip
    return qk[:, :num_heads], qk[:, num_heads:]


@triton.jit
def _silu_mul_kernel(x_ptr, o_ptr, stride_x, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < INTER
    g = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
    u = tl.load(x_ptr + row * stride_x + INTER + offs, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # F.silu, rounded to the input dtype like torch
    out = (s.to(tl.float32) * u.to(tl.float32)).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + row * stride_o + offs, out, mask=ok)


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gate_up[:, :inter]) * gate_up[:, inter:]``."""
    x = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    out = torch.empty((x.shape[0], inter), dtype=x.dtype, device=x.device)
    if x.shape[0]:
        block = 1024
        _silu_mul_kernel[(x.shape[0], triton.cdiv(inter, block))](
            x, out, x.stride(0), out.stride(0), INTER=inter, BLOCK=block, num_warps=4,
        )  # fmt: skip
    return out
