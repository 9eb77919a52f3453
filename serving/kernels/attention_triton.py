"""Triton attention backend: paged KV store, decode and extend kernels.

Runs on CUDA. On a CPU it runs only under Triton's interpreter, which must be switched on by
``TRITON_INTERPRET=1`` in the environment before this module (and so the ``@triton.jit``
kernels in ``triton_*.py``) is first imported; otherwise the backend refuses CPU tensors.
"""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction

from serving.kernels.attention_base import AttentionBackend
from serving.kernels.triton_decode import decode_attention, decode_partial_kernel
from serving.kernels.triton_extend import extend_attention
from serving.kernels.triton_store import store_kv
from serving.structs.forward_batch import ForwardBatch

INTERPRETED = isinstance(decode_partial_kernel, InterpretedFunction)


def _check_device(t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(
            "the triton attention backend needs CUDA tensors, or TRITON_INTERPRET=1 set before "
            "serving.kernels.attention_triton is first imported (use the 'torch' backend on CPU)"
        )


class TritonAttentionBackend(AttentionBackend):
    """Decode batches use the split-KV decode kernel; any other batch the extend kernel."""

    name = "triton"

    def store_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        loc: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        _check_device(k_cache)
        if self.kv_round_trip is not None:  # torch ops before the store kernel (untested on a GPU so far)
            k, v = self.kv_round_trip(k), self.kv_round_trip(v)
        store_kv(k_cache, v_cache, loc, k, v)

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
        _check_device(q)
        if batch.is_decode:
            return decode_attention(q, k_cache, v_cache, batch, scale, splits=batch.decode_splits, window=window,
                                    sinks=sinks)
        return extend_attention(q, k_cache, v_cache, batch, scale, window=window, sinks=sinks)
