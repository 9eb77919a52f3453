"""Paged attention kernels: torch backend vs a dense reference, Triton vs torch.

Triton chooses between compiling and interpreting when ``@triton.jit`` decorates a function,
and its own ``tl.zeros`` / ``tl.max`` / ``tl.sum`` ... are decorated when ``triton`` is first
imported (which ``import transformers`` already does). So ``TRITON_INTERPRET=1`` must be in the
environment before ``triton`` is imported at all. Hence:

- with CUDA, or with ``TRITON_INTERPRET=1`` already set, the ``test_triton_*`` tests run here;
- otherwise they are skipped here and ``test_kernels_in_triton_interpreter`` runs them in a
  child pytest with ``TRITON_INTERPRET=1`` set from the start (nothing leaks into this process).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from harness.interpreted import run_file_interpreted, triton_module
from harness.kernel_cases import DEVICE, EXTEND_CASES, dense_reference, make_case, run_backend
from serving.kernels.attention import get_attention_backend
from serving.structs.forward_batch import ForwardBatch

ATOL = 1e-4


@pytest.fixture(scope="module")
def triton() -> ModuleType:
    return triton_module("serving.kernels.attention_triton", "test_kernels_in_triton_interpreter")


def test_kernels_in_triton_interpreter() -> None:
    """Run this file's Triton tests in a child process under the interpreter."""
    run_file_interpreted(__file__, "test_triton_")


HEADS = [(4, 2), (3, 1), (2, 2)]


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("name", sorted(EXTEND_CASES))
def test_torch_backend_matches_dense(name: str, page_size: int) -> None:
    case = make_case(EXTEND_CASES[name], page_size)
    out = run_backend(get_attention_backend("torch"), case, 0.25)
    torch.testing.assert_close(out, dense_reference(case, 0.25), atol=ATOL, rtol=0)


def test_torch_backend_decode_matches_dense() -> None:
    case = make_case([(0, 1), (5, 1), (40, 1)], 4)
    assert case.batch.is_decode
    out = run_backend(get_attention_backend("torch"), case, 0.3)
    torch.testing.assert_close(out, dense_reference(case, 0.3), atol=ATOL, rtol=0)


def test_reference_detects_a_wrong_page() -> None:
    """Sanity: the comparison fails when a prefix page is corrupted."""
    case = make_case([(8, 2)], 4)
    case.k_cache[case.batch.page_table[0, 0]] += 1.0
    out = run_backend(get_attention_backend("torch"), case, 0.25)
    assert not torch.allclose(out, dense_reference(case, 0.25), atol=ATOL)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_triton_store_kv(triton: ModuleType, page_size: int) -> None:
    case = make_case([(3, 5), (0, 9)], page_size)
    qkv = torch.randn(
        case.batch.num_tokens, 3, 2, 16, device=DEVICE
    )  # v as a strided view, like the model's split
    qkv[:, 2] = case.v_new
    ref_k, ref_v = case.k_cache.clone(), case.v_cache.clone()
    get_attention_backend("torch").store_kv(ref_k, ref_v, case.batch.out_cache_loc, case.k_new, case.v_new)
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    triton.TritonAttentionBackend().store_kv(kc, vc, case.batch.out_cache_loc, case.k_new, qkv[:, 2])
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("name", sorted(EXTEND_CASES))
def test_triton_extend(triton: ModuleType, name: str, page_size: int, heads: tuple[int, int]) -> None:
    case = make_case(EXTEND_CASES[name], page_size, heads=heads[0], kv_heads=heads[1])
    ref = run_backend(get_attention_backend("torch"), case, 0.25)
    out = run_backend(triton.TritonAttentionBackend(), case, 0.25)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("name", sorted(EXTEND_CASES))
def test_triton_one_pass_extend(triton: ModuleType, name: str, heads: tuple[int, int]) -> None:
    """The one-pass kernel (batches over SPLIT_MAX_TOKENS take it; the cases here would take the split one)."""
    from serving.kernels.triton_extend import one_pass_extend_attention

    case = make_case(EXTEND_CASES[name], 4, heads=heads[0], kv_heads=heads[1])
    ref = run_backend(get_attention_backend("torch"), case, 0.25)
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    triton.store_kv(kc, vc, case.batch.out_cache_loc, case.k_new, case.v_new)
    torch.testing.assert_close(one_pass_extend_attention(case.q, kc, vc, case.batch, 0.25), ref, atol=ATOL, rtol=0)


# (prefix, new) per sequence, page size, (q heads, kv heads), head dim: prefixes from 0 to over 1000,
# 1 to 64 new tokens, GQA / MQA / MHA, a head dim that is not a power of two
SPLIT_CASES = {
    "long_prefixes_gqa": ([(1100, 3), (16, 64), (0, 1), (333, 17)], 16, (8, 2), 16),
    "ragged_small_prefixes": ([(0, 7), (5, 1), (0, 20), (63, 33), (1, 1)], 4, (4, 2), 16),
    "mqa_page1_dim24": ([(130, 5), (1, 2), (64, 64)], 1, (3, 1), 24),
    "mha_no_prefix": ([(0, 40), (0, 1)], 4, (2, 2), 16),
}


@pytest.mark.parametrize("name", sorted(SPLIT_CASES))
def test_triton_split_extend_matches_torch(triton: ModuleType, name: str) -> None:
    """The split-KV extend kernel (what extend CUDA graphs run) against the torch backend."""
    from serving.kernels.triton_extend_split import split_extend_attention

    lens, page_size, (heads, kv_heads), dim = SPLIT_CASES[name]
    case = make_case(lens, page_size, heads=heads, kv_heads=kv_heads, dim=dim, seed=5)
    ref = run_backend(get_attention_backend("torch"), case, 0.2)
    torch.testing.assert_close(run_backend(triton.TritonAttentionBackend(), case, 0.2), ref, atol=ATOL, rtol=0)
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    triton.store_kv(kc, vc, case.batch.out_cache_loc, case.k_new, case.v_new)
    torch.testing.assert_close(split_extend_attention(case.q, kc, vc, case.batch, 0.2), ref, atol=ATOL, rtol=0)


def padded_to_bucket(b: ForwardBatch, tokens: int, seqs: int) -> ForwardBatch:
    """``b`` laid out as an extend graph's static batch of bucket (tokens, sequences) holds it
    (serving/runner/cuda_graph_extend.py): padding tokens at slot -1, padding sequences with no new tokens."""
    t, n = b.num_tokens, b.batch_size
    pad_t, pad_s = tokens - t, seqs - n

    def cat(x: torch.Tensor, fill: int, k: int) -> torch.Tensor:
        return torch.cat([x, torch.full((k,), fill, dtype=x.dtype, device=x.device)])

    table = torch.cat([b.page_table, torch.zeros((pad_s, b.page_table.shape[1]), dtype=torch.int32,
                                                 device=b.page_table.device)])
    return ForwardBatch(
        input_ids=cat(b.input_ids, 0, pad_t), positions=cat(b.positions, 0, pad_t),
        prefix_lens=cat(b.prefix_lens, 0, pad_s), extend_lens=cat(b.extend_lens, 0, pad_s),
        seq_lens=cat(b.seq_lens, 0, pad_s), extend_start=cat(b.extend_start, tokens, pad_s), page_table=table,
        out_cache_loc=cat(b.out_cache_loc, -1, pad_t), page_size=b.page_size,
        prefix_lens_list=[2048] * seqs, extend_lens_list=[0] * seqs, extend_bucket=(tokens, seqs),
    )


@pytest.mark.parametrize("lens,bucket", [
    ([(300, 5), (0, 9), (77, 1)], (16, 4)),  # 15 tokens -> 16, 3 sequences -> 4
    ([(1030, 20), (2, 1)], (32, 16)),
    ([(5, 16)], (16, 1)),  # exactly a bucket: no padding
], ids=["tokens_and_seqs", "many_pad_seqs", "exact"])
def test_triton_split_extend_bucket_padding_is_exact(triton: ModuleType, lens, bucket) -> None:
    """A batch padded into a graph bucket (launch sized by the bucket) gives the same bits on its
    real rows as the batch itself eagerly; padding tokens store no KV, and NaN in their queries
    reaches no real row."""
    from serving.kernels.triton_extend_split import split_extend_attention

    case = make_case(lens, 4, heads=8, kv_heads=2, seed=9)
    b, t = case.batch, case.batch.num_tokens
    pb = padded_to_bucket(b, *bucket)
    pad_t = bucket[0] - t
    q = torch.cat([case.q, torch.full((pad_t, *case.q.shape[1:]), float("nan"), device=DEVICE)])
    k_new = torch.cat([case.k_new, torch.full((pad_t, *case.k_new.shape[1:]), 7.0, device=DEVICE)])
    v_new = torch.cat([case.v_new, torch.full((pad_t, *case.v_new.shape[1:]), 7.0, device=DEVICE)])
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    triton.store_kv(kc, vc, b.out_cache_loc, case.k_new, case.v_new)
    eager = split_extend_attention(case.q, kc, vc, b, 0.25)
    kc2, vc2 = case.k_cache.clone(), case.v_cache.clone()
    triton.store_kv(kc2, vc2, pb.out_cache_loc, k_new, v_new)
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)  # the padding slots (-1) stored nothing
    graphed = split_extend_attention(q, kc2, vc2, pb, 0.25)
    assert torch.equal(graphed[:t], eager)
    torch.testing.assert_close(eager, run_backend(get_attention_backend("torch"), case, 0.25), atol=ATOL, rtol=0)


@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_triton_decode(
    triton: ModuleType, page_size: int, heads: tuple[int, int], splits: int | None
) -> None:
    case = make_case([(0, 1), (6, 1), (70, 1), (17, 1)], page_size, heads=heads[0], kv_heads=heads[1], dim=24)
    assert case.batch.is_decode
    ref = run_backend(get_attention_backend("torch"), case, 0.2)
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    triton.store_kv(kc, vc, case.batch.out_cache_loc, case.k_new, case.v_new)
    out = triton.decode_attention(case.q, kc, vc, case.batch, 0.2, block_n=16, splits=splits)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_backend_refuses_cpu_without_interpreter() -> None:
    """Without TRITON_INTERPRET the CPU gives a clear error (checked in a subprocess: no leak)."""
    code = (
        "import torch\n"
        "from serving.kernels.attention_triton import TritonAttentionBackend\n"
        "try:\n"
        "    TritonAttentionBackend().store_kv(torch.zeros(2,1,1,4), torch.zeros(2,1,1,4),"
        " torch.zeros(1, dtype=torch.long), torch.zeros(1,1,4), torch.zeros(1,1,4))\n"
        "except RuntimeError as e:\n"
        "    print('REFUSED', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "REFUSED" in res.stdout and "TRITON_INTERPRET" in res.stdout, res.stderr[-2000:]


def test_triton_model_matches_torch(triton: ModuleType, tmp_path: Path) -> None:
    """A tiny dummy Llama gives the same logits with either backend (prefill, prefix reuse, decode)."""
    import json

    from hicache.tiers.device import DeviceKVPool
    from serving.models.loader import load_model

    cfg = dict(
        architectures=["LlamaForCausalLM"], hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model, arch = load_model(tmp_path, device=DEVICE, load_format="dummy")
    with torch.no_grad():  # dummy std 0.02 gives near-zero logits: scale up for a meaningful comparison
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(10)
    ps = 4
    steps = [
        [([1, 2, 3, 4, 5, 6], 0, [3, 1]), ([7, 8, 9], 0, [2])],
        [([10, 11], 6, [3, 1, 5]), ([12], 3, [2])],
        [([13], 8, [3, 1, 5]), ([14], 4, [2, 4])],
    ]
    outs = {}
    for name, backend in (
        ("torch", get_attention_backend("torch")),
        ("triton", triton.TritonAttentionBackend()),
    ):
        pool = DeviceKVPool(arch.kv_layout(torch.float32), 8, ps, DEVICE)
        outs[name] = [model(ForwardBatch.build(s, ps, DEVICE), pool, backend) for s in steps]
    for a, b in zip(outs["torch"], outs["triton"], strict=True):
        assert a.abs().max() > 0.1
        torch.testing.assert_close(b, a, atol=ATOL, rtol=0)
