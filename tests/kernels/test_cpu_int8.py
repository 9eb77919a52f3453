"""The int8 W8A8 CPU kernel (serving/kernels/csrc/int8_linear.cpp), every variant this CPU runs: the
same bits as its torch-op reference on awkward shapes and activations, each row independent of its
batch; and the math it claims (dequantized codes times dequantized weights) within float rounding."""

from __future__ import annotations

import pytest
import torch

from harness.cpu_variants import ext  # noqa: F401 - the fixture
from serving.kernels import cpu_int8


def case(m: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    x[0] += 40  # a row far from zero: a large zero point
    if m > 1:
        x[1] = 0.0  # a constant row: hi == lo
    if m > 2:
        x[2, : k // 2] = 1e-30
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    return x, w, w.sum(dim=1, dtype=torch.int64), torch.rand(n, generator=g) * 0.01 + 1e-4


@pytest.mark.parametrize("m,n,k", [(1, 3072, 576), (1, 576, 1536), (3, 5, 100), (7, 1001, 576), (40, 260, 1536),
                                   (2, 4, 64), (5, 9, 17), (67, 8, 40), (63, 20, 33), (300, 37, 17),
                                   (130, 96, 576)])
def test_kernel_equals_reference_bit_for_bit(ext, m, n, k):  # noqa: F811 - the fixture
    for seed in range(3):
        x, w, wsum, ws = case(m, n, k, seed)
        y = ext.int8_linear(x, w, wsum, ws)
        assert torch.equal(y, cpu_int8.int8_linear_ref(x, w, wsum, ws))
        # a row alone gives the bits it gave in the batch; from 64 rows (AVX2) the batch takes csrc/many_rows.h
        # (16-bit products on widened blocks of 16 outputs, 240-row items; odd K and N padded)
        for r in range(m):
            assert torch.equal(ext.int8_linear(x[r:r + 1], w, wsum, ws), y[r:r + 1])


def test_reference_is_the_dequantized_product():
    x, w, wsum, ws = case(4, 64, 256, 0)
    lo, hi = torch.aminmax(x.double(), dim=-1, keepdim=True)
    xs = ((hi - lo).clamp(min=1e-12) / 255).float().double()
    y = cpu_int8.int8_linear_ref(x, w, wsum, ws).double()
    exact = (x.double() @ (w.double() * ws.double()[:, None]).t())  # unquantized activations
    err = ((y - exact).norm() / exact.norm()).item()
    assert 1e-5 < err < 2e-2, err  # quantized, and close
    bound = (xs * 0.5 * (w.double().abs() * ws.double()[:, None]).sum(1)[None, :])  # half a step per element
    assert ((y - exact).abs() <= bound + 1e-6).all()
