"""The fused Triton MoE (serving/kernels/triton_moe.py) against SparseMoE's torch path (fp32): both expert
activations (SwiGLU, GPT-OSS's clamped gate), with and without expert biases, top-k 1/2/3, T = 1, 5, 37 tokens,
E = 4 and 8 experts, routings that leave experts without tokens; the alignment into padded expert blocks
(every row once, in its expert's blocks, padding never written); ``syncs_host`` only on the torch path.
Triton runs here with CUDA or under TRITON_INTERPRET=1 (a child pytest, as in test_kernels.py)."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from harness.interpreted import run_file_interpreted, triton_module
from harness.kernel_cases import DEVICE
from serving.models import moe as moe_mod
from serving.models.moe import MoEOptions, SparseMoE

HIDDEN, INTER = 48, 40  # not multiples of the kernels' tiles: the masks are exercised


def make_moe(experts: int, top_k: int, activation: str, bias: bool, seed: int) -> SparseMoE:
    opts = MoEOptions(experts, top_k, INTER, activation=activation, expert_bias=bias,
                      scoring="topk_softmax" if activation == "gpt_oss" else "softmax_topk",
                      router_bias=activation == "gpt_oss", swiglu_limit=1.5)  # a low limit: the clamps bite
    moe = SparseMoE(HIDDEN, opts)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return moe.to(DEVICE)


def routing(tokens: int, top_k: int, experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-k routings that never pick expert 0 (nor E-1 when k leaves room), weights in float32."""
    gen = torch.Generator().manual_seed(seed)
    pool = experts - 1 - (top_k <= experts - 2)
    ids = torch.stack([torch.randperm(pool, generator=gen)[:top_k] + 1 for _ in range(tokens)])
    return torch.rand((tokens, top_k), generator=gen).to(DEVICE), ids.to(DEVICE)


def run_path(moe: SparseMoE, x: torch.Tensor, routed: tuple[torch.Tensor, torch.Tensor], fused: bool,
             monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    monkeypatch.setattr(moe_mod, "FUSED_KERNEL", fused, raising=False)
    monkeypatch.setattr(moe, "route", lambda _x: routed)
    with torch.no_grad():
        return moe(x)


def test_syncs_host_only_on_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU model takes the torch path (it reads counts on the host); the fused kernels read nothing back,
    so model_runner captures graphs for them; an activation the kernel lacks keeps the torch path."""
    moe = SparseMoE(HIDDEN, MoEOptions(4, 2, INTER))
    assert moe.syncs_host
    monkeypatch.setattr(moe_mod, "FUSED_KERNEL", True, raising=False)
    assert not moe.syncs_host
    monkeypatch.setitem(moe_mod.ACTIVATIONS, "relu_glu", lambda g, u, o: torch.relu(g) * u)
    assert SparseMoE(HIDDEN, MoEOptions(4, 2, INTER, activation="relu_glu")).syncs_host
    monkeypatch.setattr(moe_mod, "FUSED_KERNEL", False, raising=False)
    assert moe.syncs_host


def test_align_sizes_depend_on_the_shapes_only() -> None:
    from serving.kernels.triton_moe import align_sizes, pick_block_m

    assert align_sizes(5, 2, 8, 16) == (10 + 8 * 15, 9)  # worst case: every expert gets a row
    assert align_sizes(1, 2, 128, 16) == (2 + 2 * 15, 2)  # no more experts than rows can be padded
    assert [pick_block_m(t, 8, 128) for t in (1, 64, 256, 1024, 8192)] == [16, 16, 16, 32, 64]


# ---- Triton -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    return triton_module("serving.kernels.triton_moe", "test_moe_in_triton_interpreter")


def test_moe_in_triton_interpreter() -> None:
    """Run this file's Triton tests in a child process under the interpreter."""
    run_file_interpreted(__file__, "test_kernel_")


@pytest.mark.parametrize("experts", [4, 8])
@pytest.mark.parametrize("tokens", [1, 5, 37, 300])  # 300 x 3: several chunks of 256 rows
@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("single", [True, False], ids=["one_program", "chunks"])
def test_kernel_align(kernels: ModuleType, single: bool, block_m: int, top_k: int, tokens: int, experts: int) -> None:
    """One program (decode) or one per chunk of rows (prefill): the same blocks."""
    _, ids = routing(tokens, top_k, experts, seed=tokens * 10 + experts)
    n = tokens * top_k
    sorted_ids, block_expert = kernels.align(ids, experts, block_m, single=single)
    assert (sorted_ids.numel(), block_expert.numel()) == kernels.align_sizes(tokens, top_k, experts, block_m)
    flat, s, be = ids.reshape(-1).tolist(), sorted_ids.tolist(), block_expert.tolist()
    assert sorted(r for r in s if r != n) == list(range(n))  # every row once; the rest padding
    counts = [flat.count(e) for e in range(experts)]
    start = 0
    for e in range(experts):  # expert by expert, each from a block boundary, its rows in token order
        padded = -(-counts[e] // block_m) * block_m
        assert s[start:start + padded] == [i for i in range(n) if flat[i] == e] + [n] * (padded - counts[e])
        assert be[start // block_m:(start + padded) // block_m] == [e] * (padded // block_m)
        start += padded
    assert set(s[start:]) <= {n} and be[start // block_m:] == [experts] * (len(be) - start // block_m)
    assert counts[0] == 0  # experts without tokens have no blocks


@pytest.mark.parametrize("experts", [4, 8])
@pytest.mark.parametrize("tokens", [1, 5, 37])
@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("activation", ["silu", "gpt_oss"])
def test_kernel_fused_equals_torch_path(kernels: ModuleType, monkeypatch: pytest.MonkeyPatch, activation: str,
                                        bias: bool, top_k: int, tokens: int, experts: int) -> None:
    seed = tokens * 100 + experts * 10 + top_k
    moe = make_moe(experts, top_k, activation, bias, seed)
    x = torch.randn((tokens, HIDDEN), generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    routed = routing(tokens, top_k, experts, seed)
    ref = run_path(moe, x, routed, False, monkeypatch)
    out = run_path(moe, x, routed, True, monkeypatch)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert ref.abs().max() > 0.1


def test_kernel_routed_by_the_router(kernels: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real router's weights and ids (float32 deepseek-style weights too) go through the kernel unchanged."""
    for activation in ("silu", "gpt_oss"):
        moe = make_moe(8, 2, activation, activation == "gpt_oss", 5)
        x = torch.randn((9, HIDDEN), generator=torch.Generator().manual_seed(1)).to(DEVICE)
        routed = moe.route(x)
        torch.testing.assert_close(run_path(moe, x, (routed[0].float(), routed[1]), True, monkeypatch),
                                   run_path(moe, x, routed, False, monkeypatch), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("activation", ["silu", "gpt_oss"])
def test_kernel_chunked_align_equals_torch_path(kernels: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                                activation: str) -> None:
    """A prefill's many rows: the chunked alignment (here forced) feeds the GEMMs the same blocks."""
    monkeypatch.setattr(kernels, "SINGLE_PROGRAM_ROWS", 0)
    tokens, top_k, experts = 200, 2, 8  # 400 rows: two chunks
    moe = make_moe(experts, top_k, activation, True, 9)
    x = torch.randn((tokens, HIDDEN), generator=torch.Generator().manual_seed(9)).to(DEVICE)
    routed = routing(tokens, top_k, experts, 9)
    ref = run_path(moe, x, routed, False, monkeypatch)
    torch.testing.assert_close(run_path(moe, x, routed, True, monkeypatch), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block_m", [16, 64])
def test_kernel_padding_rows_write_nothing(kernels: ModuleType, block_m: int) -> None:
    """Padding slots hold N = T * k: a kernel that wrote them would write row N of its buffers (canaries)."""
    tokens, top_k, experts = 5, 2, 8
    moe = make_moe(experts, top_k, "gpt_oss", True, 3)
    weights, ids = routing(tokens, top_k, experts, 3)
    x = torch.randn((tokens, HIDDEN), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    n = tokens * top_k
    act = torch.full((n + 4, INTER), float("nan"), device=DEVICE)
    y = torch.full((n + 4, HIDDEN), float("nan"), device=DEVICE)
    out = kernels.fused_moe(x, weights, ids, moe.w13.data, moe.w2.data, moe.b13.data, moe.b2.data, "gpt_oss",
                            moe.opts.swiglu_alpha, moe.opts.swiglu_limit, block_m=block_m, buffers=(act, y))
    assert act[n:].isnan().all() and y[n:].isnan().all()  # no padding row wrote
    assert not act[:n].isnan().any() and not y[:n].isnan().any() and not out.isnan().any()  # every real row did


def test_kernel_refuses_unknown_activation(kernels: ModuleType) -> None:
    w13, w2 = torch.zeros(4, 2 * INTER, HIDDEN), torch.zeros(4, HIDDEN, INTER)
    with pytest.raises(ValueError, match="no activation 'gelu'"):
        kernels.fused_moe(torch.zeros(2, HIDDEN), torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long), w13, w2,
                          activation="gelu")
