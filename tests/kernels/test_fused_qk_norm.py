"""Qwen3's attention prologue on CUDA: each head's RMSNorm of q and k and the rotary embedding in one launch
(serving/kernels/triton_fused.py ``rope_qk(..., norms=...)``, wired in serving/models/llama.py's Attention).
The kernel against the torch path's arithmetic, and a tiny Qwen3's logits with the fused kernels against
the torch path; both in the Triton interpreter (a child process: ``TRITON_INTERPRET=1`` must be set before
Triton is imported), with serving.models.llama's ``_fused_for`` answering for CPU tensors as it does for CUDA
ones."""

from __future__ import annotations

import pytest

from harness.interpreted import run_interpreted

KERNEL_CODE = """
import torch
from serving.kernels import triton_fused as tf
from serving.models.llama import RMSNorm
from serving.models.rope import apply_rope
g = torch.Generator().manual_seed(0)
t, h, kh, d = 5, 4, 2, 16
for dtype in (torch.float32, torch.bfloat16):
    qkv = (torch.randn(t, (h + 2 * kh) * d, generator=g) * 3).to(dtype)
    qn, kn = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)
    qn.weight.data.normal_(1.0, 0.3, generator=g)
    kn.weight.data.normal_(0.5, 0.3, generator=g)
    qn, kn = qn.to(dtype), kn.to(dtype)
    pos = torch.tensor([0, 3, 9, 1, 7])
    cos, sin = torch.randn(10, d, generator=g), torch.randn(10, d, generator=g)
    q, k = tf.rope_qk(qkv, pos, cos, sin, h, kh, d, norms=(qn.weight, kn.weight, 1e-6))
    c, s = cos[pos][:, None], sin[pos][:, None]
    q_ref = apply_rope(qn(qkv[:, :h * d].reshape(-1, d)).view(t, h, d), c, s)
    k_ref = apply_rope(kn(qkv[:, h * d:(h + kh) * d].reshape(-1, d)).view(t, kh, d), c, s)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
    assert q.dtype == dtype and k.dtype == dtype
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(k, k_ref, **tol)
    plain, _ = tf.rope_qk(qkv, pos, cos, sin, h, kh, d)  # without norms: the rotation alone
    torch.testing.assert_close(plain, apply_rope(qkv[:, :h * d].view(t, h, d), c, s), **tol)
print("OK")
"""

MODEL_CODE = """
import json, tempfile
from pathlib import Path
import torch
import serving.models.llama as L
from hicache.tiers.device import DeviceKVPool
from serving.kernels import cpu_fused
from serving.kernels import triton_fused as tf
from serving.kernels.attention import get_attention_backend
from serving.models.loader import load_model
from serving.structs.forward_batch import ForwardBatch

assert cpu_fused.available(torch.float32)  # whole cos/sin tables on CPU, as on CUDA
L._fused_for = lambda x: tf if tf.ENABLED else None  # as for a CUDA tensor
calls = []
real = tf.rope_qk
tf.rope_qk = lambda *a, **kw: calls.append(kw.get("norms") is not None) or real(*a, **kw)
tmp = Path(tempfile.mkdtemp())
cfg = dict(architectures=["Qwen3ForCausalLM"], hidden_size=48, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64,
           rms_norm_eps=1e-6)
(tmp / "config.json").write_text(json.dumps(cfg))
model, arch = load_model(tmp, device=torch.device("cpu"), load_format="dummy")
with torch.no_grad():
    for name, p in model.named_parameters():
        p.mul_(10) if not name.endswith("norm.weight") else p.normal_(1.0, 0.3)
ps = 4
steps = [[([1, 2, 3, 4, 5, 6], 0, [3, 1]), ([7, 8, 9], 0, [2])], [([10, 11], 6, [3, 1, 5]), ([12], 3, [2])]]
outs = {}
for enabled in (False, True):
    tf.ENABLED = enabled
    pool = DeviceKVPool(arch.kv_layout(torch.float32), 8, ps, torch.device("cpu"))
    backend = get_attention_backend("torch")
    outs[enabled] = [model(ForwardBatch.build(s, ps, torch.device("cpu")), pool, backend) for s in steps]
assert calls and all(calls), calls  # the fused prologue ran, with the norms, in every layer of every step
assert len(calls) == len(steps) * cfg["num_hidden_layers"], calls
for a, b in zip(outs[False], outs[True]):
    assert a.abs().max() > 0.1
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
print("OK")
"""


def test_qk_norm_rope_kernel_matches_torch() -> None:
    pytest.importorskip("triton")
    run_interpreted(KERNEL_CODE)


def test_qwen3_with_the_fused_prologue_matches_the_torch_path() -> None:
    import torch

    from serving.kernels import cpu_fused

    pytest.importorskip("triton")
    if not cpu_fused.available(torch.float32):
        pytest.skip("the C++ extension is not built (make setup)")
    run_interpreted(MODEL_CODE)
