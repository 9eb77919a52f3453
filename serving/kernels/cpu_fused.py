"""The model's fused steps on CPU (float32), where the C++ ops build (serving.kernels.cpu_ext):
``rope_qk`` -- the rotary embedding of q and k straight out of the fused qkv projection, reading
the cos/sin tables at each token's position, one call per layer instead of ~16 torch ops. Same
signature as ``serving.kernels.triton_fused.rope_qk``, and the same bits as the torch path
(``serving.models.rope.apply_rope``): tests/kernels/test_attention_cpu.py."""

from __future__ import annotations

import torch

from serving.kernels.cpu_ext import extension


def available(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and extension() is not None


def rope_qk(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
            num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated ``q [T, H, D]`` and ``k [T, KH, D]`` (views of one new tensor)."""
    qk = extension().rope_qk(qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim)
    return qk[:, :num_heads], qk[:, num_heads:]
