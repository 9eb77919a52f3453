"""``--attention-backend cpu``: causal GQA attention over the paged float32 KV in one C++ call per
layer (serving/kernels/csrc/paged_attention.cpp, AVX-512), the CPU default where it builds.

The torch backend gathers each sequence's keys, builds a mask and calls SDPA: ~15 small ops per
layer at decode, more time than the attention itself for a small model. Here every (token, kv
head) pair is computed alone from its own query and the keys it may see, in key order, so a
token's output has the same bits in a decode batch, in a prefill chunk and alone (the same KV
for the same token whichever path computed it; tests/kernels/test_attention_cpu.py).

A sliding-window layer runs in the same C++ call (``klo``: each token's first visible key, so its
keys are the window's only, summed in the same lanes whatever its batch), and so do attention sinks
(``sinks``: a float32 logit per q head in each softmax's max and denominator; other dtypes are
refused by the C++ op, not cast per step).

Storing K/V is one C++ copy (the torch backend's store with a lossy-tier round trip). KV in another dtype
than float32, a head_dim that is not a multiple of 16, or a machine without the C++ ops: the
torch backend's forward.
"""

from __future__ import annotations

import torch

from serving.kernels.attention_torch import TorchAttentionBackend
from serving.kernels.cpu_ext import extension
from serving.structs.forward_batch import ForwardBatch


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def init_forward(self, batch: ForwardBatch) -> None:
        super().init_forward(batch)
        seq, nkeys = [], []
        for i, (prefix, n) in enumerate(zip(batch.prefix_lens_list, batch.extend_lens_list, strict=True)):
            seq += [i] * n
            nkeys += range(prefix + 1, prefix + n + 1)
        self._tok_seq = torch.tensor(seq, dtype=torch.int64)
        self._tok_nkeys = torch.tensor(nkeys, dtype=torch.int64)
        self._tok_klo: dict[int, torch.Tensor] = {}  # window -> each token's first visible key

    def _klo(self, window: int | None) -> torch.Tensor | None:
        if window is None:
            return None
        klo = self._tok_klo.get(window)
        if klo is None:
            klo = self._tok_klo[window] = (self._tok_nkeys - window).clamp_(min=0)
        return klo

    def store_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> None:
        ext = extension()
        if (ext is None or self.kv_round_trip is not None or k.dtype != k_cache.dtype or v.dtype != v_cache.dtype
                or k_cache.is_cuda):
            return super().store_kv(k_cache, v_cache, loc, k, v)
        ext.store_kv(k_cache, v_cache, loc, k, v)
        return None

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                scale: float, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        ext = extension()
        d = q.shape[-1]
        if (ext is None or q.dtype != torch.float32 or k_cache.dtype != torch.float32 or d % 16 or q.is_cuda):
            return super().forward(q, k_cache, v_cache, batch, scale, window, sinks)
        meta = self._meta_for(batch)
        kh = k_cache.shape[-2]
        return ext.paged_attention(q, k_cache.view(-1, kh, d), v_cache.view(-1, kh, d), meta.slots,
                                   self._tok_seq, self._tok_nkeys, scale, self._klo(window), sinks)
