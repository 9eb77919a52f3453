"""The Triton extend kernels at head_dim 256 (Gemma-3, Qwen3.5's attention layers) on a GPU: a tile of
64 rows x 64 keys needs ~295 KB of shared memory there, over Hopper's 227 KB, and did not launch (an L1
hit's extend failed on the H200: bench/hybrid.py's first run); the key block is now 32 past head_dim
128 (triton_extend_split.key_block). Both kernels, bf16 and fp32, GQA, against the dense reference.
CUDA only: the interpreter has no shared-memory limit, so it cannot show this."""

from __future__ import annotations

import pytest
import torch

from harness.kernel_cases import dense_reference, make_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (shared-memory limits)")
LENS = [(0, 70), (300, 80), (1000, 17), (64, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["split", "one_pass"])
def test_extend_at_head_dim_256(kernel: str, dtype: torch.dtype) -> None:
    from serving.kernels.triton_extend import one_pass_extend_attention, split_extend_attention

    case = make_case(LENS, 16, heads=16, kv_heads=4, dim=256, seed=5)
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    kc.view(-1, 4, 256)[case.batch.out_cache_loc] = case.k_new
    vc.view(-1, 4, 256)[case.batch.out_cache_loc] = case.v_new
    fn = split_extend_attention if kernel == "split" else one_pass_extend_attention
    out = fn(case.q.to(dtype), kc.to(dtype), vc.to(dtype), case.batch, 0.0625)
    ref = dense_reference(case, 0.0625)
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
