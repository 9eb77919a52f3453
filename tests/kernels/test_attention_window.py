"""Sliding-window paged attention (HF semantics: the query at position p reads max(0, p - window + 1) .. p)
in every backend against a dense masked reference: windows smaller than, equal to and larger than the
sequence, decode and extend (with and without a cached prefix), the window's start inside a page and on
a page boundary. Triton runs here with CUDA or under TRITON_INTERPRET=1 (a child pytest, as in
test_kernels.py)."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from harness.interpreted import run_file_interpreted, triton_module
from harness.kernel_cases import Case, make_case, run_backend
from serving.kernels import cpu_ext
from serving.kernels.attention import get_attention_backend

ATOL = 1e-4
# (prefix, new) per sequence
DECODE = [(0, 1), (6, 1), (11, 1), (40, 1), (70, 1)]
EXTEND = [(0, 13), (5, 3), (16, 9), (33, 20), (8, 1)]
WINDOWS = [1, 4, 8, 12, 200]  # 200: larger than every sequence (full attention)


def windowed_reference(case: Case, scale: float, window: int | None) -> torch.Tensor:
    """Dense attention with the causal + window mask, per sequence (no pages)."""
    out, s = [], 0
    heads, kv_heads = case.q.shape[1], case.k_new.shape[1]
    for i, (prefix, n) in enumerate(zip(case.batch.prefix_lens_list, case.batch.extend_lens_list, strict=True)):
        q = case.q[s : s + n]
        k = case.k_full[i].repeat_interleave(heads // kv_heads, dim=1)
        v = case.v_full[i].repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
        key = torch.arange(prefix + n, device=q.device)[None, :]
        pos = torch.arange(prefix, prefix + n, device=q.device)[:, None]
        visible = key <= pos
        if window is not None:
            visible &= key > pos - window
        out.append(torch.einsum("hnl,lhd->nhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v))
        s += n
    return torch.cat(out)


def _backends() -> list[str]:
    return ["torch"] + (["cpu"] if cpu_ext.extension() is not None and not torch.cuda.is_available() else [])


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("lens", [DECODE, EXTEND], ids=["decode", "extend"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("backend", _backends())
def test_window_matches_dense(backend: str, page_size: int, lens, window: int) -> None:
    case = make_case(lens, page_size, heads=4, kv_heads=2, dim=16, seed=3)
    out = _run(backend, case, window)
    torch.testing.assert_close(out, windowed_reference(case, 0.25, window), atol=ATOL, rtol=0)


def _run(backend: str, case: Case, window: int) -> torch.Tensor:
    be = get_attention_backend(backend)
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    be.store_kv(kc, vc, case.batch.out_cache_loc, case.k_new, case.v_new)
    return be.forward(case.q, kc, vc, case.batch, 0.25, window=window)


def test_window_is_not_full_attention() -> None:
    """The reference can tell a window from full attention (the window tests can fail)."""
    case = make_case(EXTEND, 4, seed=3)
    full = run_backend(get_attention_backend("torch"), case, 0.25)
    assert not torch.allclose(full, windowed_reference(case, 0.25, 8), atol=ATOL)
    torch.testing.assert_close(full, windowed_reference(case, 0.25, None), atol=ATOL, rtol=0)


@pytest.mark.skipif(cpu_ext.extension() is None, reason="no C++ CPU ops")
def test_cpu_window_same_bits_decode_prefill_alone() -> None:
    """The cpu backend's windowed token has the same bits in a prefill chunk, a decode batch and alone."""
    torch.manual_seed(0)
    ps, kh, d, window, n = 4, 2, 16, 7, 30
    k_cache, v_cache = torch.randn(12, ps, kh, d), torch.randn(12, ps, kh, d)
    pages = [3, 7, 1, 9, 4, 11, 2, 5]
    q_all, k_all, v_all = torch.randn(n, 4, d), torch.randn(n, kh, d), torch.randn(n, kh, d)
    from serving.structs.forward_batch import ForwardBatch

    be = get_attention_backend("cpu")
    prefill = ForwardBatch.build([([1] * n, 0, pages)], ps)
    be.store_kv(k_cache, v_cache, prefill.out_cache_loc, k_all, v_all)
    out_prefill = be.forward(q_all, k_cache, v_cache, prefill, 0.125, window=window)
    other = ForwardBatch.build([([1], 20, pages[:6]), ([1], n - 1, pages)], ps)  # token 29 beside another
    out_decode = be.forward(torch.stack([q_all[20], q_all[29]]), k_cache, v_cache, other, 0.125, window=window)
    alone = ForwardBatch.build([([1], n - 1, pages)], ps)
    out_alone = be.forward(q_all[29:], k_cache, v_cache, alone, 0.125, window=window)
    assert torch.equal(out_prefill[29], out_decode[1]) and torch.equal(out_prefill[29], out_alone[0])
    assert torch.equal(out_prefill[20], out_decode[0])


# ---- Triton -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def triton() -> ModuleType:
    return triton_module("serving.kernels.attention_triton", "test_window_in_triton_interpreter")


def test_window_in_triton_interpreter() -> None:
    """Run this file's Triton tests in a child process under the interpreter."""
    run_file_interpreted(__file__, "test_triton_")


@pytest.mark.parametrize("window", [1, 5, 8, 200])
@pytest.mark.parametrize("splits", [None, 3])
def test_triton_decode_window(triton: ModuleType, window: int, splits: int | None) -> None:
    case = make_case(DECODE, 4, heads=4, kv_heads=2, dim=16, seed=3)
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    triton.store_kv(kc, vc, case.batch.out_cache_loc, case.k_new, case.v_new)
    out = triton.decode_attention(case.q, kc, vc, case.batch, 0.25, block_n=16, splits=splits, window=window)
    torch.testing.assert_close(out, windowed_reference(case, 0.25, window), atol=ATOL, rtol=0)


@pytest.mark.parametrize("window", [1, 5, 8, 200])
@pytest.mark.parametrize("kernel", ["split", "one_pass"])
def test_triton_extend_window(triton: ModuleType, window: int, kernel: str) -> None:
    from serving.kernels.triton_extend import one_pass_extend_attention
    from serving.kernels.triton_extend_split import split_extend_attention

    case = make_case(EXTEND, 4, heads=4, kv_heads=2, dim=16, seed=3)
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    triton.store_kv(kc, vc, case.batch.out_cache_loc, case.k_new, case.v_new)
    fn = split_extend_attention if kernel == "split" else one_pass_extend_attention
    out = fn(case.q, kc, vc, case.batch, 0.25, block_n=16, rows=16, window=window)
    torch.testing.assert_close(out, windowed_reference(case, 0.25, window), atol=ATOL, rtol=0)


def test_triton_backend_window(triton: ModuleType) -> None:
    """Through the backend's forward (decode and extend dispatch)."""
    for lens in (DECODE, EXTEND):
        case = make_case(lens, 16, heads=4, kv_heads=2, dim=16, seed=4)
        out = _run_triton(triton, case, 6)
        torch.testing.assert_close(out, windowed_reference(case, 0.25, 6), atol=ATOL, rtol=0)


def _run_triton(triton: ModuleType, case: Case, window: int) -> torch.Tensor:
    be = triton.TritonAttentionBackend()
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    be.store_kv(kc, vc, case.batch.out_cache_loc, case.k_new, case.v_new)
    return be.forward(case.q, kc, vc, case.batch, 0.25, window=window)
