"""The Q8_0 x Q8_0 linear of int4's LM head (serving/kernels/cpu_q8.py, csrc/group_linear.cpp),
every variant this CPU runs: the same bits as its torch twin, each row independent of its batch;
the packing round-trips; the quantizer gives back a Q8_0 table's codes from its dequantized
weights; and the twin is the dequantized weights times the quantized activations."""

from __future__ import annotations

import pytest
import torch

from harness.cpu_cases import acts
from harness.cpu_variants import ext  # noqa: F401 - the fixture
from serving.kernels import cpu_int4, cpu_q8


def layer(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    codes[0, :32] = 127  # a group at the extremes: the int16 pairs of the AVX2 path at their largest
    codes[1 % n, :32] = -127
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-4).half().float()
    return codes, d


def test_pack_round_trips():
    codes, d = layer(48, 96, 0)
    w = cpu_q8.pack(codes, d)
    assert w.shape == (3, 3, cpu_q8.BLOCK_BYTES) and w.dtype == torch.uint8
    c2, d2 = cpu_q8.unpack(w)
    assert torch.equal(c2, codes) and torch.equal(d2, d)


@pytest.mark.parametrize("mm,n,k", [(1, 4096, 576), (3, 16, 32), (7, 1008, 576), (70, 32, 64)])
def test_kernel_equals_reference_bit_for_bit(ext, mm, n, k):  # noqa: F811 - the fixture
    for seed in range(2):
        w = cpu_q8.pack(*layer(n, k, seed))
        x = acts(mm, k, seed)
        x[-1, :32] = torch.where(torch.arange(32) % 2 == 0, 50.0, -50.0)  # q = +-127 against codes +-127
        y = ext.q8_linear(x, w)
        assert torch.isfinite(y).all()
        assert torch.equal(y, cpu_q8.q8_linear_ref(x, w))
        for r in range(mm):
            assert torch.equal(ext.q8_linear(x[r:r + 1].clone(), w), y[r:r + 1])


def test_reference_is_the_dequantized_product():
    codes, d = layer(64, 256, 1)
    x = acts(4, 256, 1)
    y = cpu_q8.q8_linear_ref(x, cpu_q8.pack(codes, d)).double()
    wdq = (codes.double().reshape(64, -1, 32) * d.double()[..., None]).reshape(64, 256)
    q, dx, _ = cpu_int4.quantize_activations(x)
    xdq = (q.double() * dx.double()[..., None]).reshape(4, 256)
    torch.testing.assert_close(y, xdq @ wdq.t(), rtol=1e-5, atol=1e-4)


def test_quantizer_recovers_q8_0_codes():
    codes, d = layer(32, 64, 2)
    codes[:, ::32] = 127  # every Q8_0 block holds its amax as +-127
    w = (codes.float().reshape(32, -1, 32) * d[..., None]).reshape(32, 64)
    c2, d2 = cpu_q8.quantize_groups(w)
    assert torch.equal(c2, codes) and torch.equal(d2, d)
    zero = cpu_q8.quantize_groups(torch.zeros(16, 32))
    assert (zero[0] == 0).all() and (zero[1] == 0).all()


def test_fallback_keeps_its_operands_and_gives_the_same_bits(monkeypatch):
    w = cpu_q8.pack(*layer(64, 96, 3))
    x = acts(3, 96, 3)
    want = cpu_q8.q8_linear(x, w)
    monkeypatch.setattr(cpu_q8, "extension", lambda: None)
    cache: dict = {}
    assert torch.equal(cpu_q8.q8_linear(x, w, cache), want)
    assert cache["ref_operands"][0].shape == (3, 32, 64)
