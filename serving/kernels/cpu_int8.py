"""The int8 W8A8 linear of ``--quantization int8`` on CPU: one call per projection.

``int8_linear(x, w, wsum, ws)``: ``x [M, K]`` float32, ``w [N, K]`` int8 codes, ``wsum [N]`` int64
(each row's code sum), ``ws [N]`` float32 scales -> ``[M, N]`` float32. Each activation row is
quantized on its own (asymmetric, codes 0..255: ``xs = max(hi - lo, 1e-12) / 255``,
``zero = -round(lo / xs)``, ``q = clamp(round(x / xs) + zero, 0, 255)`` with ``/ xs`` as a product
with ``1 / xs``), the product accumulates in int32 (exact), and
``y = float(acc - zero * wsum) * xs * ws``.

Two implementations give the same bits (tests/kernels/test_cpu_int8.py):
- ``csrc/int8_linear.cpp``, every variant of serving.kernels.cpu_ext (``vpdpbusd`` with VNNI,
  ``vpmaddubsw`` on AVX2, scalar), quantization and epilogue inside; on AVX2 without VNNI batches
  of 64 rows or more (prefill) take ``csrc/many_rows.h``: blocks of 16 output rows widened once to int16, 16-bit
  products (``vpmaddwd`` / ``vpdpwssd``) serving 6-8 rows per pass, the same int32 sums and
  epilogue, so the same bits;
- ``int8_linear_ref`` in torch ops, used where the CPU lacks VNNI or nothing can be built.

The C++ op replaces ~12 small torch ops per projection and oneDNN's ``qlinear_pointwise`` (which
read the weights at ~11 GB/s at batch 1): bench/cpu_decode.py.
"""

from __future__ import annotations

import torch

from serving.kernels.cpu_ext import extension


def int8_linear_ref(x: torch.Tensor, w: torch.Tensor, wsum: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """The same computation in torch ops (bit for bit)."""
    xf = x.float()
    lo, hi = torch.aminmax(xf, dim=-1, keepdim=True)
    xs = (hi - lo).clamp_(min=1e-12).div_(255)  # [M, 1]
    zero = torch.round(lo / xs).neg_()
    q = torch.round(xf * xs.reciprocal()).add_(zero).clamp_(0, 255)
    acc = torch._int_mm(q.sub_(128).to(torch.int8), w.t()).to(torch.int64) + 128 * wsum  # exact
    v = (acc - zero.to(torch.int64) * wsum).float()
    return v.mul_(xs).mul_(ws)


def int8_linear(x: torch.Tensor, w: torch.Tensor, wsum: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    ext = extension()
    if ext is None:
        return int8_linear_ref(x, w, wsum, ws)
    return ext.int8_linear(x if x.dtype == torch.float32 else x.float(), w, wsum, ws)

