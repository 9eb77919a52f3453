"""The MoE of a few tokens (serving/kernels/triton_moe_decode.py) against SparseMoE's torch path (fp32): the
routing kernel equals moe.py's scorings (softmax over every expert with and without renormalizing, GPT-OSS's
softmax over the top k), numbers of experts and choices that are not powers of two; the matrix-vector
gate/up and down kernels equal the torch path for both activations, with and without biases, and with two
choices of one token sharing an expert; SparseMoE on the fused path takes them for a few tokens only.
Triton runs here with CUDA or under TRITON_INTERPRET=1 (a child pytest, as in test_triton_moe.py)."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.nn as nn

from harness.interpreted import run_file_interpreted, triton_module
from harness.kernel_cases import DEVICE
from serving.models import moe as moe_mod
from serving.models.moe import SCORINGS, MoEOptions, SparseMoE

HIDDEN, INTER = 48, 40  # not multiples of the kernels' tiles: the masks are exercised


def make_moe(experts: int, top_k: int, activation: str, bias: bool, seed: int, renormalize: bool = True) -> SparseMoE:
    opts = MoEOptions(experts, top_k, INTER, activation=activation, expert_bias=bias, renormalize=renormalize,
                      scoring="topk_softmax" if activation == "gpt_oss" else "softmax_topk",
                      router_bias=activation == "gpt_oss", swiglu_limit=1.5)
    moe = SparseMoE(HIDDEN, opts)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return moe.to(DEVICE)


def test_decode_path_is_for_few_pairs() -> None:
    from serving.kernels.triton_moe_decode import use_decode_path

    assert use_decode_path(1, 8, 128) and use_decode_path(4, 8, 128)  # Qwen3-30B-A3B: up to 4 tokens
    assert not use_decode_path(5, 8, 128) and not use_decode_path(64, 8, 128)
    assert use_decode_path(1, 2, 8) and not use_decode_path(2, 2, 8)


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    return triton_module("serving.kernels.triton_moe_decode", "test_moe_decode_in_triton_interpreter")


def test_moe_decode_in_triton_interpreter() -> None:
    """Run this file's Triton tests in a child process under the interpreter."""
    run_file_interpreted(__file__, "test_kernel_")


@pytest.mark.parametrize("experts,top_k", [(8, 1), (8, 3), (60, 8), (128, 8), (32, 4)])
@pytest.mark.parametrize("scoring,renormalize", [("softmax_topk", True), ("softmax_topk", False),
                                                 ("topk_softmax", False)])
def test_kernel_route_equals_the_scorings(kernels: ModuleType, scoring: str, renormalize: bool, top_k: int,
                                          experts: int) -> None:
    gen = torch.Generator().manual_seed(experts * 10 + top_k)
    tokens = 3
    gate = nn.Linear(HIDDEN, experts, bias=False)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=gen))
    gate = gate.to(DEVICE)
    x = torch.randn((tokens, HIDDEN), generator=gen).to(DEVICE)
    ref_w, ref_ids = SCORINGS[scoring](gate, x, MoEOptions(experts, top_k, INTER, scoring=scoring,
                                                           renormalize=renormalize))
    with torch.no_grad():
        w, ids = kernels.route_topk(gate(x), top_k, scoring, renormalize, x.dtype)
    assert ids.tolist() == ref_ids.tolist()  # random logits: no ties, the same order (best first)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-5)


def test_kernel_route_refuses_what_it_does_not_compute(kernels: ModuleType) -> None:
    with pytest.raises(ValueError, match="no scoring 'deepseek'"):
        kernels.route_topk(torch.zeros(1, 8), 2, "deepseek", True, torch.float32)
    with pytest.raises(ValueError, match="top_k 9 of 8 experts"):
        kernels.route_topk(torch.zeros(1, 8), 9, "softmax_topk", True, torch.float32)


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("activation", ["silu", "gpt_oss"])
def test_kernel_moe_decode_equals_torch_path(kernels: ModuleType, monkeypatch: pytest.MonkeyPatch, activation: str,
                                             bias: bool, tokens: int, top_k: int) -> None:
    """The whole module on the fused path (routing kernel, then the matrix-vector kernels) against the
    torch path (moe.py's scoring, expert by expert)."""
    experts = 32  # 2 tokens x 3 choices x 4 <= 32: the matrix-vector kernels
    moe = make_moe(experts, top_k, activation, bias, seed=tokens * 10 + top_k)
    x = torch.randn((tokens, HIDDEN), generator=torch.Generator().manual_seed(top_k)).to(DEVICE)
    monkeypatch.setattr(moe_mod, "FUSED_KERNEL", True, raising=False)
    assert moe._decode_sized(x)
    with torch.no_grad():
        out = moe(x)
        monkeypatch.setattr(moe_mod, "FUSED_KERNEL", False, raising=False)
        ref = moe(x)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert ref.abs().max() > 0.1


def test_kernel_two_choices_of_one_expert(kernels: ModuleType) -> None:
    """A routing handed in from elsewhere may pick one expert twice for a token: each choice is its own row."""
    moe = make_moe(8, 2, "silu", True, seed=4)
    x = torch.randn((2, HIDDEN), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    ids = torch.tensor([[3, 3], [5, 1]], device=DEVICE)
    weights = torch.tensor([[0.25, 0.5], [0.7, 0.3]], device=DEVICE)
    with torch.no_grad():
        out = kernels.moe_decode(x, weights, ids, moe.w13, moe.w2, moe.b13, moe.b2)
        ref = torch.stack([sum(weights[t, j] * expert(moe, x[t], int(ids[t, j])) for j in range(2)) for t in range(2)])
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def expert(moe: SparseMoE, x: torch.Tensor, e: int) -> torch.Tensor:
    h = moe.w13[e] @ x + moe.b13[e]
    gate, up = h.split(INTER)
    return moe.w2[e] @ (torch.nn.functional.silu(gate) * up) + moe.b2[e]
