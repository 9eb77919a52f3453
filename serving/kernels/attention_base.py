"""The contract of an attention backend over the paged KV cache (the backends and their registry:
serving/kernels/attention.py).

A backend stores the new tokens' K/V into pages (``store_kv``) and then computes causal
attention of the new tokens' queries over all the sequence's KV, prefix and new alike, read
back from the pages (``forward``), or over the last ``window`` positions only (a sliding-window
layer: the model passes each layer's window); with ``sinks``, a learned logit per query head joins
each softmax's denominator (GPT-OSS's attention sinks; the model passes each layer's).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from serving.structs.forward_batch import ForwardBatch


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
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``q [T, q_heads, head_dim]`` -> ``[T, q_heads, head_dim]`` (dtype of ``q``).

        New token ``j`` of sequence ``i`` (position ``p = prefix_lens[i] + j``) attends to positions
        ``0 .. p``; with a sliding ``window`` (HF's ``sliding_window``) to ``max(0, p - window + 1) .. p``.
        ``q_heads`` is a multiple of ``kv_heads`` (GQA: q head ``h`` reads kv head
        ``h // (q_heads // kv_heads)``).

        ``sinks``: float32 ``[q_heads]`` on ``q``'s device (the layer's own, fixed: graph-safe, never
        read on the host), GPT-OSS's attention sinks: head ``h``'s output is
        ``sum_j e^(s_j - m) v_j / (e^(sinks[h] - m) + sum_j e^(s_j - m))`` over its visible keys' scaled
        scores ``s_j``, ``m = max(sinks[h], max_j s_j)`` (the sink has a weight, no value). None: none.
        """
