"""Attention backends over the paged KV cache: the contract and the registry.

A backend stores the new tokens' K/V into pages (``store_kv``) and then computes causal
attention of the new tokens' queries over all the sequence's KV, prefix and new alike, read
back from the pages (``forward``). Backends:

- ``"torch"``: plain PyTorch, the reference (and the CPU default where the C++ ops do not build).
- ``"cpu"``: one C++ call per layer over float32 KV (AVX-512); the CPU default where it builds.
- ``"triton"``: Triton kernels. Needs CUDA, or ``TRITON_INTERPRET=1`` in the environment
  *before* ``serving.kernels.attention_triton`` is first imported (Triton decides between
  compiling and interpreting when ``@triton.jit`` decorates a kernel, i.e. at import).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from serving.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Paged attention. Shapes: ``k_cache``/``v_cache`` are one layer's
    ``[num_pages, page_size, kv_heads, head_dim]`` buffers from ``DeviceKVPool``."""

    name: str = ""
    # Set by the model runner in a mode with a lossy lower-tier encoding: the encoding's round
    # trip (hicache.tiers.kv_codec), applied to K and V before they are stored, so that L1 holds
    # exactly what L2 / L3 give back. None: store as is.
    kv_round_trip: Callable[[torch.Tensor], torch.Tensor] | None = None

    def init_forward(self, batch: ForwardBatch) -> None:  # noqa: B027 - optional hook
        """Called once per forward pass before the first layer: build per-batch metadata
        shared by all layers. Backends also call it lazily from ``forward``."""

    @abstractmethod
    def store_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        loc: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Write ``k``, ``v`` ``[T, kv_heads, head_dim]`` at flat slots ``loc [T]``
        (``page * page_size + offset``), casting to the cache dtype."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:
        """``q [T, q_heads, head_dim]`` -> ``[T, q_heads, head_dim]`` (dtype of ``q``).

        New token ``j`` of sequence ``i`` attends to positions ``0 .. prefix_lens[i] + j``.
        ``q_heads`` is a multiple of ``kv_heads`` (GQA: q head ``h`` reads kv head
        ``h // (q_heads // kv_heads)``).
        """


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
