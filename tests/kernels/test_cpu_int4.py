"""The int4 W4A8 CPU kernel (serving/kernels/csrc/group_linear.cpp), every variant this CPU runs: the
same bits as its torch-op reference, each row independent of its batch; the packing round-trips;
and the reference is the dequantized weights times the quantized activations, within float rounding."""

from __future__ import annotations

import pytest
import torch

from harness.cpu_cases import acts
from harness.cpu_variants import ext  # noqa: F401 - the fixture
from serving.kernels import cpu_int4
from serving.models.quant.int4 import quantize_int4_groups


def layer(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-4).half().float()
    m = (-8 * d * (1 + 0.2 * torch.randn(n, k // 32, generator=g))).half().float()
    return codes, d, m


def test_pack_round_trips():
    codes, d, m = layer(48, 96, 0)
    w = cpu_int4.pack(codes, d, m)
    assert w.shape == (3, 3, cpu_int4.BLOCK_BYTES) and w.dtype == torch.uint8
    c2, d2, m2 = cpu_int4.unpack(w)
    assert torch.equal(c2, codes) and torch.equal(d2, d) and torch.equal(m2, m)


@pytest.mark.parametrize("mm,n,k", [(1, 3072, 576), (1, 576, 1536), (3, 16, 32), (7, 1008, 576), (40, 256, 1536),
                                    (70, 32, 64), (133, 48, 96), (15, 64, 96), (16, 64, 96), (203, 96, 576)])
def test_kernel_equals_reference_bit_for_bit(ext, mm, n, k):  # noqa: F811 - the fixture
    for seed in range(2):
        w = cpu_int4.pack(*layer(n, k, seed))
        x = acts(mm, k, seed)
        y = ext.int4_linear(x, w)
        assert torch.isfinite(y).all()
        assert torch.equal(y, cpu_int4.int4_linear_ref(x, w))  # 70 rows: the twin's row chunks too
        # a row alone (the few-row path) gives the bits it gave in the batch: from 16 rows the batch takes
        # csrc/many_rows.h (16-bit products, 3 (AVX2) or 8 rows a pass, 96-row items, the rest in smaller passes)
        for r in range(mm):
            assert torch.equal(ext.int4_linear(x[r:r + 1].clone(), w), y[r:r + 1])


def test_reference_is_the_dequantized_product():
    codes, d, m = layer(64, 256, 1)
    x = acts(4, 256, 1)
    y = cpu_int4.int4_linear_ref(x, cpu_int4.pack(codes, d, m)).double()
    wdq = (codes.double().reshape(64, -1, 32) * d.double()[..., None] + m.double()[..., None]).reshape(64, 256)
    q, dx, _ = cpu_int4.quantize_activations(x)
    xdq = (q.double() * dx.double()[..., None]).reshape(4, 256)
    torch.testing.assert_close(y, xdq @ wdq.t(), rtol=1e-5, atol=1e-4)  # the integer math is the float math
    exact = x.double() @ wdq.t()
    err = ((y - exact).norm() / exact.norm()).item()
    assert 1e-7 < err < 1e-4, err  # activations quantized (16-bit codes), and close


def test_quantizer_recovers_q4_1_codes():
    """Weights that are Q4_1 blocks (each group spans codes 0..15) give back their codes and scales."""
    codes, d, m = layer(32, 64, 2)
    codes[:, ::32], codes[:, 1::32] = 0, 15
    w = (codes.float().reshape(32, -1, 32) * d[..., None] + m[..., None]).reshape(32, 64)
    c2, d2, m2 = quantize_int4_groups(w)
    assert torch.equal(c2, codes) and torch.equal(d2, d) and torch.equal(m2, m)


def test_fallback_keeps_its_operands_and_gives_the_same_bits(monkeypatch):
    """Without the C++ op, int4_linear runs the torch twin and keeps its unpacked operands in the
    layer's cache; the bits are the kernel's (or the reference's where nothing was built)."""
    w = cpu_int4.pack(*layer(64, 96, 3))
    x = acts(3, 96, 3)
    want = cpu_int4.int4_linear(x, w)  # the C++ op where it builds
    monkeypatch.setattr(cpu_int4, "extension", lambda: None)
    cache: dict = {}
    assert torch.equal(cpu_int4.int4_linear(x, w, cache), want)
    ops = cache["ref_operands"]
    assert ops[0].dtype == torch.uint8 and ops[0].shape == (3, 32, 64)
    assert torch.equal(cpu_int4.int4_linear(x, w, cache), want) and cache["ref_operands"] is ops


def test_quantizer_takes_a_constant_group():
    w = torch.randn(16, 64)
    w[3, :32] = 0.25  # hi == lo: d is 0
    codes, d, m = quantize_int4_groups(w)
    assert d[3, 0] == 0 and m[3, 0] == 0.25 and (codes[3, :32] == 0).all()
    assert torch.isfinite(d).all() and codes.min() >= 0 and codes.max() <= 15
