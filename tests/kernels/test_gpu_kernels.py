"""GPU kernels on a real GPU, each against the torch reference: Triton attention in bf16 (decode,
split-KV decode, extend, one-pass extend, a long prefix), the KV store's padding slots, the fused
per-layer kernels (RMSNorm, RoPE, SiLU-mul, add + norm) in fp32 and bf16, and the fp8 activation
quantization and GEMV. The model-level GPU paths are tests/engine/test_gpu.py.

Skipped without CUDA (tests/engine/test_gpu_paths.py and tests/kernels/test_kernels.py run the same logic on a CPU).
"""

from __future__ import annotations

import pytest
import torch

from harness.kernel_cases import rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

REL_TOL = 1e-2  # bf16


# -- kernels, bf16 -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["decode", "decode_graph_splits", "extend", "extend_one_pass", "extend_long_prefix"])
def test_triton_attention_bf16_vs_torch(kind):
    from harness.kernel_cases import make_case
    from serving.kernels.attention import get_attention_backend
    from serving.kernels.attention_triton import TritonAttentionBackend
    from serving.kernels.triton_extend import one_pass_extend_attention

    lens = {"extend": [(0, 40), (96, 17), (5, 1), (250, 64)], "extend_one_pass": [(0, 40), (96, 17), (5, 1), (250, 64)],
            "extend_long_prefix": [(4096, 16)]}.get(kind, [(0, 1), (37, 1), (300, 1), (1000, 1)])
    case = make_case(lens, 16, heads=32, kv_heads=8, dim=128, seed=3)
    for name in ("q", "k_new", "v_new", "k_cache", "v_cache"):
        setattr(case, name, getattr(case, name).to("cuda", torch.bfloat16))
    b = case.batch
    if kind == "decode_graph_splits":
        b.decode_splits = 16
    scale = 128**-0.5
    torch_backend = get_attention_backend("torch")
    # reference: the torch backend in float32 on the same (bf16-rounded) inputs
    kc, vc = case.k_cache.float(), case.v_cache.float()
    torch_backend.store_kv(kc, vc, b.out_cache_loc, case.k_new.float(), case.v_new.float())
    ref = torch_backend.forward(case.q.float(), kc, vc, b, scale)
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    triton_backend = TritonAttentionBackend()
    triton_backend.store_kv(kc, vc, b.out_cache_loc, case.k_new, case.v_new)
    if kind == "extend_one_pass":
        out = one_pass_extend_attention(case.q, kc, vc, b, scale)
    else:  # extend batches of up to 512 new tokens take the split-KV kernel
        out = triton_backend.forward(case.q, kc, vc, b, scale)
    ref_k = case.k_cache.clone()
    torch_backend.store_kv(ref_k, case.v_cache.clone(), b.out_cache_loc, case.k_new, case.v_new)
    assert torch.equal(kc, ref_k)
    err = rel_err(out.float(), ref)
    print(f"{kind}: relative error {err:.2e}")
    assert err < REL_TOL


def test_store_kv_skips_padding_slots():
    from serving.kernels.triton_store import store_kv

    kc = torch.zeros(4, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    k = torch.randn(3, 8, 128, device="cuda", dtype=torch.bfloat16)
    store_kv(kc, vc, torch.tensor([5, -1, 63], device="cuda"), k, k)
    flat = kc.view(-1, 8, 128)
    assert torch.equal(flat[5], k[0]) and torch.equal(flat[63], k[2])
    assert int((flat != 0).any(-1).any(-1).sum()) == 2


# -- fused per-layer kernels ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernels_match_torch_path(dtype):
    from serving.kernels import triton_fused as tf
    from serving.models.llama import RMSNorm
    from serving.models.rope import apply_rope

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(37, 4096, device="cuda", generator=g).to(dtype)
    norm = RMSNorm(4096, 1e-5).to("cuda", dtype)
    norm.weight.data.normal_(1.0, 0.1, generator=g)
    tf.ENABLED = False
    try:
        ref = norm(x)
    finally:
        tf.ENABLED = True
    assert rel_err(norm(x).float(), ref.float()) < (1e-6 if dtype == torch.float32 else 1e-2)
    h, kh, d = 32, 8, 128
    qkv = torch.randn(37, (h + 2 * kh) * d, device="cuda", generator=g).to(dtype)
    pos = torch.randint(0, 5000, (37,), device="cuda", generator=g)
    cos = torch.randn(5000, d, device="cuda", generator=g)
    sin = torch.randn(5000, d, device="cuda", generator=g)
    q, k = tf.rope_qk(qkv, pos, cos, sin, h, kh, d)
    q_ref = apply_rope(qkv[:, : h * d].view(37, h, d), cos[pos][:, None], sin[pos][:, None])
    k_ref = apply_rope(qkv[:, h * d: (h + kh) * d].view(37, kh, d), cos[pos][:, None], sin[pos][:, None])
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_err(q.float(), q_ref.float()) < tol and rel_err(k.float(), k_ref.float()) < tol
    qn, kn = RMSNorm(d, 1e-6).to("cuda", dtype), RMSNorm(d, 1e-6).to("cuda", dtype)  # Qwen3's q/k norms
    qn.weight.data.normal_(1.0, 0.3, generator=g)
    kn.weight.data.normal_(1.0, 0.3, generator=g)
    q, k = tf.rope_qk(qkv, pos, cos, sin, h, kh, d, norms=(qn.weight, kn.weight, 1e-6))
    tf.ENABLED = False
    try:
        q_ref = apply_rope(qn(qkv[:, : h * d].reshape(-1, d)).view(37, h, d), cos[pos][:, None], sin[pos][:, None])
        k_ref = apply_rope(kn(qkv[:, h * d: (h + kh) * d].reshape(-1, d)).view(37, kh, d), cos[pos][:, None],
                           sin[pos][:, None])
    finally:
        tf.ENABLED = True
    assert rel_err(q.float(), q_ref.float()) < tol and rel_err(k.float(), k_ref.float()) < tol
    gu = torch.randn(37, 2 * 14336, device="cuda", generator=g).to(dtype)
    ref = torch.nn.functional.silu(gu[:, :14336]) * gu[:, 14336:]
    assert rel_err(tf.silu_mul(gu, 14336).float(), ref.float()) < tol
    delta = torch.randn(37, 4096, device="cuda", generator=g).to(dtype)
    normed, h_sum = norm.add_forward(delta, x)
    tf.ENABLED = False
    try:
        normed_ref, h_ref = norm.add_forward(delta, x)
    finally:
        tf.ENABLED = True
    assert torch.equal(h_sum, h_ref)
    assert rel_err(normed.float(), normed_ref.float()) < (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs an fp8 GPU")
@pytest.mark.parametrize("shape", [(1, 4096), (7, 14336), (64, 576)])
def test_fp8_activation_quant_kernel_equals_torch(shape):
    from serving.kernels.fp8_quant import quantize_rows_fp8
    from serving.models.quant.fp8 import quantize_rows_torch

    torch.manual_seed(0)
    for _ in range(20):  # the division must round as torch's does (Triton's default "/" is approximate)
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 5
        x[0, :3] = torch.tensor([1000.0, -0.0, 1e-6])
        (qa, sa), (qb, sb) = quantize_rows_fp8(x), quantize_rows_torch(x)
        assert torch.equal(sa, sb)
        assert torch.equal(qa.view(torch.uint8), qb.view(torch.uint8))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs an fp8 GPU")
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (1008, 14336), (576, 1536), (49152, 576)])
def test_fp8_gemv_matches_scaled_mm(n, k):
    from serving.kernels.fp8_gemm import fp8_gemv
    from serving.kernels.fp8_quant import quantize_rows_fp8

    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") * 0.05).to(torch.float8_e4m3fn)
    scale = torch.rand(1, n, device="cuda") + 0.5
    for config in (None, (4, 256, 4, 1, False), (8, 2048, 8, 3, False), (16, 512, 4, 3, True), (2, 0, 8, 1, False)):
        ours = fp8_gemv(x, w, scale, torch.float32, config)
        xq, xs = quantize_rows_fp8(x)
        ref = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=scale, out_dtype=torch.float32)
        assert rel_err(ours, ref) < 1e-3, config
        exact = (xq.double() @ w.double().t()) * xs.double() * scale.double()  # same codes, float64 sums
        assert rel_err(ours, exact) < 1e-5, config
