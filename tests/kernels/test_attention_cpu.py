"""``--attention-backend cpu`` (serving/kernels/csrc/paged_attention.cpp): the dense causal
reference within float tolerance, on ragged extend and decode batches with GQA; and batch
invariance bit for bit -- a token's output alone, in a decode batch and inside a prefill chunk
are the same bits (which is what keeps KV from prefill and from decode identical); and every C++
variant this CPU runs gives the portable scalar variant's bits (the same tokens on every machine)."""

from __future__ import annotations

import pytest
import torch

from harness.cpu_variants import ext  # noqa: F401 - the fixture
from harness.kernel_cases import EXTEND_CASES, dense_reference, make_case, run_backend
from serving.kernels import attention_cpu, cpu_ext, cpu_fused
from serving.kernels.attention import get_attention_backend
from serving.kernels.cpu_ext import extension
from serving.structs.forward_batch import ForwardBatch

pytestmark = pytest.mark.skipif(extension() is None, reason="needs g++ (the C++ CPU ops)")


@pytest.mark.parametrize("heads,dim", [((9, 3), 64), ((16, 1), 128)])
def test_every_variant_gives_the_scalar_bits(ext, monkeypatch, heads, dim):  # noqa: F811 - the fixture
    scalar = cpu_ext.build("scalar")
    if scalar is None:
        pytest.skip("the scalar variant did not build")
    case = make_case(EXTEND_CASES["mixed_ragged"], 16, heads=heads[0], kv_heads=heads[1], dim=dim, seed=4)
    outs = []
    for mod in (scalar, ext):
        monkeypatch.setattr(attention_cpu, "extension", lambda m=mod: m)
        outs.append(run_backend(get_attention_backend("cpu"), case, 0.125))
    assert torch.equal(outs[0], outs[1])
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(9, (heads[0] + 2 * heads[1]) * dim, generator=g)
    pos = torch.randint(0, 64, (9,), generator=g)
    cos, sin = torch.rand(64, dim, generator=g), torch.rand(64, dim, generator=g)
    ropes = [m.rope_qk(qkv, pos, cos, sin, heads[0], heads[1], dim) for m in (scalar, ext)]
    assert torch.equal(ropes[0], ropes[1])


@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (16, 1)])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", sorted(EXTEND_CASES))
def test_matches_dense_reference(name, page_size, heads):
    case = make_case(EXTEND_CASES[name], page_size, heads=heads[0], kv_heads=heads[1], dim=64, seed=1)
    out = run_backend(get_attention_backend("cpu"), case, 0.125)
    torch.testing.assert_close(out, dense_reference(case, 0.125), atol=2e-5, rtol=1e-4)


def test_decode_matches_dense_reference_and_long_context():
    case = make_case([(0, 1), (5, 1), (700, 1), (63, 1)], 16, heads=8, kv_heads=2, dim=128, seed=2)
    assert case.batch.is_decode
    out = run_backend(get_attention_backend("cpu"), case, 0.09)
    torch.testing.assert_close(out, dense_reference(case, 0.09), atol=2e-5, rtol=1e-4)


def test_a_token_has_the_same_bits_in_prefill_decode_and_alone():
    """Sequence 0 is prefilled in one chunk of 30 tokens next to another sequence; then its
    token 29 is recomputed as a decode step (prefix 29) in a batch of 3, and alone."""
    torch.manual_seed(0)
    ps, kh, d, h = 4, 3, 64, 9
    k_cache, v_cache = torch.randn(64, ps, kh, d), torch.randn(64, ps, kh, d)
    pages0, pages1, pages2 = list(range(1, 9)), list(range(20, 30)), list(range(40, 45))
    be = get_attention_backend("cpu")
    q_all = torch.randn(30 + 12, h, d)
    # prefill: seq 0 tokens 0..29, seq 1 tokens 0..11 (prefix 25 already in cache)
    prefill = ForwardBatch.build([([1] * 30, 0, pages0), ([1] * 12, 25, pages1)], ps)
    kv_new = torch.randn(42, kh, d), torch.randn(42, kh, d)
    be.store_kv(k_cache, v_cache, prefill.out_cache_loc, *kv_new)
    out_prefill = be.forward(q_all, k_cache, v_cache, prefill, 0.125)
    q29 = q_all[29:30]
    decode = ForwardBatch.build([([1], 13, pages2), ([1], 29, pages0), ([1], 36, pages1)], ps)
    # the decode step re-stores token 29's K/V at its slot (same values) and other tokens' new ones
    loc = decode.out_cache_loc
    k29, v29 = k_cache.view(-1, kh, d)[loc[1]].clone(), v_cache.view(-1, kh, d)[loc[1]].clone()
    be.store_kv(k_cache, v_cache, loc, torch.stack([torch.randn(kh, d), k29, torch.randn(kh, d)]),
                torch.stack([torch.randn(kh, d), v29, torch.randn(kh, d)]))
    q_dec = torch.cat([torch.randn(1, h, d), q29, torch.randn(1, h, d)])
    out_decode = be.forward(q_dec, k_cache, v_cache, decode, 0.125)
    alone = ForwardBatch.build([([1], 29, pages0)], ps)
    out_alone = be.forward(q29, k_cache, v_cache, alone, 0.125)
    assert torch.equal(out_decode[1], out_prefill[29])
    assert torch.equal(out_alone[0], out_prefill[29])
    torch_out = get_attention_backend("torch").forward(q29, k_cache, v_cache, alone, 0.125)
    torch.testing.assert_close(torch_out[0], out_prefill[29], atol=2e-5, rtol=1e-4)


def test_rope_qk_has_the_bits_of_apply_rope():
    from serving.models.rope import apply_rope

    g = torch.Generator().manual_seed(3)
    t, h, kh, d = 37, 9, 3, 64
    qkv = torch.randn(t, (h + 2 * kh) * d, generator=g) * 4
    pos = torch.randint(0, 500, (t,), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.outer(torch.arange(512).float(), inv)
    cos, sin = torch.cat((emb, emb), -1).cos(), torch.cat((emb, emb), -1).sin()
    q, k = cpu_fused.rope_qk(qkv, pos, cos, sin, h, kh, d)
    assert torch.equal(q, apply_rope(qkv[:, : h * d].view(t, h, d), cos[pos][:, None], sin[pos][:, None]))
    assert torch.equal(k, apply_rope(qkv[:, h * d: (h + kh) * d].view(t, kh, d), cos[pos][:, None],
                                     sin[pos][:, None]))
    with pytest.raises(RuntimeError, match="position outside the rope table"):
        cpu_fused.rope_qk(qkv, pos + 600, cos, sin, h, kh, d)


def test_store_kv_equals_the_torch_store():
    case = make_case([(3, 5), (0, 9), (12, 1)], 4, heads=4, kv_heads=2, dim=64)
    stored = []
    for name in ("torch", "cpu"):
        kc, vc = case.k_cache.clone(), case.v_cache.clone()
        get_attention_backend(name).store_kv(kc, vc, case.batch.out_cache_loc, case.k_new, case.v_new)
        stored.append((kc, vc))
    assert torch.equal(stored[0][0], stored[1][0]) and torch.equal(stored[0][1], stored[1][1])
    assert not torch.equal(stored[1][0], case.k_cache)  # it wrote something
