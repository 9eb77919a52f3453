"""Inputs for the CPU quantized-GEMM tests."""

from __future__ import annotations

import torch

from harness.cpu_variants import ext  # noqa: F401 - the fixture


def acts(mm: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(mm, k, generator=g) * 3
    x[0, :32] += 40  # a group far from zero
    if mm > 1:
        x[1, 32:64] = 0.0  # an all-zero group: dx = 0
    if mm > 2:
        x[2, : k // 2] = 1e-30
    if mm > 3 and k >= 64:
        x[3, 32:64] = 0.0
        x[3, 40] = 3e-37  # amax / 127 is subnormal: 1 / dx would be inf, and 0 * inf NaN
    return x
