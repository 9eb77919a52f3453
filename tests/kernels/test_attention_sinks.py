"""Attention sinks (GPT-OSS: a learned logit per query head in the softmax's denominator, no value) in
every backend against a dense reference: out = sum_j e^(s_j - m) v_j / (e^(sink_h - m) + sum_j e^(s_j - m)),
m = max(sink_h, max_j s_j); with and without a sliding window, decode and extend (with and without a
cached prefix), GQA. The cpu backend's C++ attention runs on every variant this CPU runs (and gives the
scalar variant's bits, the same in a prefill chunk, a decode batch and alone), the fused C++ decoder's
per-layer sinks against a torch layer; Triton runs here with CUDA or under TRITON_INTERPRET=1 (a child
pytest, as in test_attention_window.py)."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from harness.cpu_variants import ext  # noqa: F401 - the fixture
from harness.interpreted import run_file_interpreted, triton_module
from harness.kernel_cases import DEVICE, Case, make_case
from serving.kernels import attention_cpu, cpu_ext
from serving.kernels.attention import get_attention_backend
from serving.structs.forward_batch import ForwardBatch

ATOL = 1e-4
SCALE = 0.25
# (prefix, new) per sequence
DECODE = [(0, 1), (6, 1), (11, 1), (40, 1), (70, 1)]
EXTEND = [(0, 13), (5, 3), (16, 9), (33, 20), (8, 1)]
HEADS = [(4, 2), (6, 2), (4, 4)]  # (q heads, kv heads)


def sinks_for(heads: int) -> torch.Tensor:
    """Per q head: below, near and above the scores (|s| ~ 1 here), so some heads' sink takes most weight."""
    return torch.tensor([-3.0, 0.5, 2.0, 4.0, -0.5, 1.0][:heads], dtype=torch.float32, device=DEVICE)


def sinks_reference(case: Case, scale: float, window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Dense attention with the causal (+ window) mask and the sink column in the softmax, per sequence."""
    out, s = [], 0
    heads, kv_heads = case.q.shape[1], case.k_new.shape[1]
    for i, (prefix, n) in enumerate(zip(case.batch.prefix_lens_list, case.batch.extend_lens_list, strict=True)):
        q = case.q[s : s + n].double()
        k = case.k_full[i].repeat_interleave(heads // kv_heads, dim=1).double()
        v = case.v_full[i].repeat_interleave(heads // kv_heads, dim=1).double()
        scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
        key = torch.arange(prefix + n, device=q.device)[None, :]
        pos = torch.arange(prefix, prefix + n, device=q.device)[:, None]
        visible = key <= pos
        if window is not None:
            visible &= key > pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.double()[:, None, None].expand(heads, n, 1)
            scores = torch.cat([scores, sink], dim=-1)
        probs = scores.softmax(-1)[..., : prefix + n]  # the sink's weight has no value
        out.append(torch.einsum("hnl,lhd->nhd", probs, v).float())
        s += n
    return torch.cat(out)


def _run(backend: str, case: Case, window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    be = get_attention_backend(backend)
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    be.store_kv(kc, vc, case.batch.out_cache_loc, case.k_new, case.v_new)
    return be.forward(case.q, kc, vc, case.batch, SCALE, window=window, sinks=sinks)


def test_sinks_change_the_reference() -> None:
    """The reference tells sinks from none (the tests below can fail), and -inf sinks are none."""
    case = make_case(EXTEND, 4, heads=4, kv_heads=2, dim=16, seed=3)
    plain = sinks_reference(case, SCALE, None, None)
    assert not torch.allclose(plain, sinks_reference(case, SCALE, None, sinks_for(4)), atol=1e-2)
    none = torch.full((4,), float("-inf"), device=DEVICE)
    torch.testing.assert_close(plain, sinks_reference(case, SCALE, None, none), atol=ATOL, rtol=0)


@pytest.mark.parametrize("window", [None, 1, 5, 200])
@pytest.mark.parametrize("lens", [DECODE, EXTEND], ids=["decode", "extend"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_torch_sinks_match_dense(heads: tuple[int, int], lens, window: int | None) -> None:
    case = make_case(lens, 4, heads=heads[0], kv_heads=heads[1], dim=16, seed=3)
    out = _run("torch", case, window, sinks_for(heads[0]))
    torch.testing.assert_close(out, sinks_reference(case, SCALE, window, sinks_for(heads[0])), atol=ATOL, rtol=0)


def test_layer_stack_says_which_layers_have_sinks() -> None:
    from serving.models.layer_spec import LayerKind, LayerSpec, LayerStack

    stack = LayerStack.from_kinds(["sliding_attention", "linear_attention", "full_attention"], window=8, sinks=True)
    assert stack.sinks == (True, True) and not stack.specs[1].sinks
    assert LayerStack.from_kinds(["sliding_attention", "full_attention"], window=8).sinks == (False, False)
    with pytest.raises(ValueError, match="no attention sinks"):
        LayerSpec(LayerKind.MAMBA, sinks=True)


# ---- the cpu backend's C++ attention ----------------------------------------------------------------

needs_cpp = pytest.mark.skipif(cpu_ext.extension() is None or DEVICE != "cpu", reason="no C++ CPU ops")


@needs_cpp
@pytest.mark.parametrize("window", [None, 1, 5, 200])
@pytest.mark.parametrize("lens", [DECODE, EXTEND], ids=["decode", "extend"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_cpu_sinks_match_dense(ext, monkeypatch, heads, lens, window) -> None:  # noqa: F811 - the fixture
    monkeypatch.setattr(attention_cpu, "extension", lambda: ext)
    case = make_case(lens, 4, heads=heads[0], kv_heads=heads[1], dim=16, seed=3)
    out = _run("cpu", case, window, sinks_for(heads[0]))
    torch.testing.assert_close(out, sinks_reference(case, SCALE, window, sinks_for(heads[0])), atol=ATOL, rtol=0)


@needs_cpp
@pytest.mark.parametrize("window", [None, 6])
def test_cpu_sinks_every_variant_gives_the_scalar_bits(ext, monkeypatch, window) -> None:  # noqa: F811
    scalar = cpu_ext.build("scalar")
    if scalar is None:
        pytest.skip("the scalar variant did not build")
    case = make_case(EXTEND, 16, heads=9, kv_heads=3, dim=64, seed=4)
    sinks = torch.linspace(-2.0, 3.0, 9)
    outs = []
    for mod in (scalar, ext):
        monkeypatch.setattr(attention_cpu, "extension", lambda m=mod: m)
        outs.append(_run("cpu", case, window, sinks))
    assert torch.equal(outs[0], outs[1])


@needs_cpp
def test_cpu_sinks_same_bits_decode_prefill_alone() -> None:
    """A token's output with sinks (and a window) has the same bits in a prefill chunk, a decode batch and alone."""
    torch.manual_seed(0)
    ps, kh, d, window, n = 4, 2, 16, 7, 30
    k_cache, v_cache = torch.randn(12, ps, kh, d), torch.randn(12, ps, kh, d)
    pages = [3, 7, 1, 9, 4, 11, 2, 5]
    q_all, k_all, v_all = torch.randn(n, 4, d), torch.randn(n, kh, d), torch.randn(n, kh, d)
    sinks = sinks_for(4)
    be = get_attention_backend("cpu")
    for w in (None, window):
        prefill = ForwardBatch.build([([1] * n, 0, pages)], ps)
        be.store_kv(k_cache, v_cache, prefill.out_cache_loc, k_all, v_all)
        out_prefill = be.forward(q_all, k_cache, v_cache, prefill, 0.125, window=w, sinks=sinks)
        other = ForwardBatch.build([([1], 20, pages[:6]), ([1], n - 1, pages)], ps)
        out_decode = be.forward(torch.stack([q_all[20], q_all[29]]), k_cache, v_cache, other, 0.125, window=w,
                                sinks=sinks)
        alone = ForwardBatch.build([([1], n - 1, pages)], ps)
        out_alone = be.forward(q_all[29:], k_cache, v_cache, alone, 0.125, window=w, sinks=sinks)
        assert torch.equal(out_prefill[29], out_decode[1]) and torch.equal(out_prefill[29], out_alone[0])
        assert torch.equal(out_prefill[20], out_decode[0])


@needs_cpp
def test_cpu_sinks_checked() -> None:
    """Sinks of the wrong size or dtype: a clear error, not a read past the tensor."""
    case = make_case(DECODE, 4, heads=4, kv_heads=2, dim=16, seed=3)
    with pytest.raises(RuntimeError, match="sinks"):
        _run("cpu", case, None, torch.zeros(3))
    with pytest.raises(RuntimeError, match="sinks"):
        _run("cpu", case, None, torch.zeros(4, dtype=torch.float64))


# ---- the fused C++ decoder (DecoderStack.set_sinks) -------------------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cos / sin [T, D] (rope_store.cpp's rotate-half)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


@needs_cpp
@pytest.mark.parametrize("window", [None, 5])
def test_fused_decoder_sinks_match_a_torch_layer(ext, window: int | None) -> None:  # noqa: F811 - the fixture
    """One Llama block in the C++ DecoderStack with set_sinks (and set_window) against the same block in
    torch ops over the dense reference's attention with sinks, on every variant."""
    hidden, heads, kv_heads, d, inter, eps = 64, 4, 2, 16, 64, 1e-6
    g = torch.Generator().manual_seed(7)
    w = {name: torch.randn(shape, generator=g) * 0.2 for name, shape in {
        "qkv": ((heads + 2 * kv_heads) * d, hidden), "o": (hidden, heads * d), "gu": (2 * inter, hidden),
        "down": (hidden, inter)}.items()}
    n1, n2 = 1 + 0.1 * torch.randn(hidden, generator=g), 1 + 0.1 * torch.randn(hidden, generator=g)
    stack = ext.DecoderStack(hidden, heads, kv_heads, d, inter, eps)
    stack.add_layer(n1, n2, 0, [w["qkv"]], None, 0, [w["o"]], None, 0, [w["gu"]], None, 0, [w["down"]], None)
    sinks = sinks_for(heads) * 2
    stack.set_sinks(0, sinks)
    if window is not None:
        stack.set_window(0, window)
    case = make_case(EXTEND, 4, heads=heads, kv_heads=kv_heads, dim=d, seed=3)  # its page table and prefix KV
    batch, t = case.batch, case.batch.num_tokens
    h = torch.randn(t, hidden, generator=g)
    rows = 128
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    ang = torch.arange(rows).float()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1).contiguous(), torch.cat([ang.sin(), ang.sin()], -1).contiguous()
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    h_fused = h.clone()
    delta = stack.forward(h_fused, None, [kc], [vc], cos, sin, batch.positions, batch.out_cache_loc, batch.page_table,
                          batch.page_size, batch.prefix_lens, batch.extend_lens, SCALE, 0, 1)
    # the same block in torch: the new tokens' K / V into the reference's dense KV, attention with sinks
    qkv = _rms(h, n1, eps) @ w["qkv"].T
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    pc, ps = cos[batch.positions], sin[batch.positions]
    q, k = _rope(q.reshape(t, heads, d), pc, ps), _rope(k.reshape(t, kv_heads, d), pc, ps)
    v = v.reshape(t, kv_heads, d)
    s = 0
    for i, (prefix, n) in enumerate(zip(batch.prefix_lens_list, batch.extend_lens_list, strict=True)):
        case.k_full[i][prefix:] = k[s : s + n]
        case.v_full[i][prefix:] = v[s : s + n]
        s += n
    case.q = q
    attn = sinks_reference(case, SCALE, window, sinks).reshape(t, heads * d)
    h_ref = h + attn @ w["o"].T
    gate, up = (_rms(h_ref, n2, eps) @ w["gu"].T).chunk(2, dim=-1)
    delta_ref = (F.silu(gate) * up) @ w["down"].T
    torch.testing.assert_close(h_fused, h_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(delta, delta_ref, atol=1e-4, rtol=1e-4)


# ---- Triton -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def triton() -> ModuleType:
    return triton_module("serving.kernels.attention_triton", "test_sinks_in_triton_interpreter")


def test_sinks_in_triton_interpreter() -> None:
    """Run this file's Triton tests in a child process under the interpreter."""
    run_file_interpreted(__file__, "test_triton_")


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_decode_sinks(triton: ModuleType, window: int | None, splits: int) -> None:
    case = make_case(DECODE, 4, heads=6, kv_heads=2, dim=16, seed=3)
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    triton.store_kv(kc, vc, case.batch.out_cache_loc, case.k_new, case.v_new)
    out = triton.decode_attention(case.q, kc, vc, case.batch, SCALE, block_n=16, splits=splits, window=window,
                                  sinks=sinks_for(6))
    torch.testing.assert_close(out, sinks_reference(case, SCALE, window, sinks_for(6)), atol=ATOL, rtol=0)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("kernel", ["split", "one_pass"])
def test_triton_extend_sinks(triton: ModuleType, window: int | None, kernel: str) -> None:
    from serving.kernels.triton_extend import one_pass_extend_attention
    from serving.kernels.triton_extend_split import split_extend_attention

    case = make_case(EXTEND, 4, heads=6, kv_heads=2, dim=16, seed=3)
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    triton.store_kv(kc, vc, case.batch.out_cache_loc, case.k_new, case.v_new)
    fn = split_extend_attention if kernel == "split" else one_pass_extend_attention
    out = fn(case.q, kc, vc, case.batch, SCALE, block_n=16, rows=16, window=window, sinks=sinks_for(6))
    torch.testing.assert_close(out, sinks_reference(case, SCALE, window, sinks_for(6)), atol=ATOL, rtol=0)


def test_triton_backend_sinks(triton: ModuleType) -> None:
    """Through the backend's forward (decode and extend dispatch), with and without a window."""
    for lens in (DECODE, EXTEND):
        for window in (None, 6):
            case = make_case(lens, 16, heads=4, kv_heads=2, dim=16, seed=4)
            be = triton.TritonAttentionBackend()
            kc, vc = case.k_cache.clone(), case.v_cache.clone()
            be.store_kv(kc, vc, case.batch.out_cache_loc, case.k_new, case.v_new)
            out = be.forward(case.q, kc, vc, case.batch, SCALE, window=window, sinks=sinks_for(4))
            torch.testing.assert_close(out, sinks_reference(case, SCALE, window, sinks_for(4)), atol=ATOL, rtol=0)
