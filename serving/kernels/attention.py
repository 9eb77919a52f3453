"""Attention backends over the paged KV cache by name: the registry (the contract every backend
implements, ``AttentionBackend``: serving/kernels/attention_base.py). Backends:

- ``"torch"``: plain PyTorch, the reference (and the CPU default where the C++ ops do not build).
- ``"cpu"``: one C++ call per layer over float32 KV (AVX-512); the CPU default where it builds.
- ``"triton"``: Triton kernels. Needs CUDA, or ``TRITON_INTERPRET=1`` in the environment
  *before* ``serving.kernels.attention_triton`` is first imported (Triton decides between
  compiling and interpreting when ``@triton.jit`` decorates a kernel, i.e. at import).
"""

from __future__ import annotations

import importlib

from serving.kernels.attention_base import AttentionBackend

# name -> "module:Class", imported on first use so the torch path never imports Triton.
ATTENTION_BACKENDS: dict[str, str] = {
    "torch": "serving.kernels.attention_torch:TorchAttentionBackend",
    "cpu": "serving.kernels.attention_cpu:CpuAttentionBackend",
    "triton": "serving.kernels.attention_triton:TritonAttentionBackend",
}


def get_attention_backend(name: str) -> AttentionBackend:
    """A new backend instance by name (see ``ATTENTION_BACKENDS``)."""
    target = ATTENTION_BACKENDS.get(name)
    if target is None:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(ATTENTION_BACKENDS)}")
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)()
