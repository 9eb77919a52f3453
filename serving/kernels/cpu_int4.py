"""The int4 linear of ``--quantization int4`` on CPU (W4A16): one call per projection.

Weights are GGUF Q4_1 blocks: 4-bit codes ``c`` in groups of 32 input channels, ``w = d * c + m``
with a half-float ``d`` and ``m`` per (output row, group). Activations are quantized per row and
group of 32 to 16-bit codes, symmetric: ``dx = amax / 32512``, ``q = clamp(round(x * (1 / dx)),
-32512, 32512)`` (``1 / dx`` is 0 when ``dx`` is 0 or subnormal: the group counts as zeros),
``sx = sum(q)``; ``32512 = 127 * 256``, so ``q = 256 qh + ql`` with a signed byte ``qh`` and an
unsigned ``ql``, and byte products (``vpmaddubsw``, ``vpdpbusd``) carry ``c * q`` exactly. Each
group adds ``dx * (d * dot + m * sx)`` with ``dot = sum(c * q)`` exact in int32, groups in order.

Why 16-bit activations: SmolLM2's int4 weights are its GGUF's own blocks, which the fp32 model
is converted from, so with exact activations int4 is fp32 (the same weights); llama.cpp's 8-bit
activations (Q8_1, this kernel's first form) cost +1.9 % perplexity and turned the README's "What
is the capital of France?" into "L'Étoile, la Marseillaise..." where fp32 names Paris. 16-bit
codes cost about twice the byte products of 8-bit ones, still a fraction of fp32's work.

Two implementations give the same bits (tests/kernels/test_cpu_int4.py):
- ``csrc/group_linear.cpp``, every variant of serving.kernels.cpu_ext (AVX-512 VNNI, AVX-VNNI,
  AVX2, scalar): the codes are unpacked from nibbles in registers, so the weights stream at 0.625
  bytes per weight; batches of 16 rows or more (prefill) take ``csrc/many_rows.h``, the same
  integer dots as 16-bit products (``vpmaddwd`` / ``vpdpwssd``) with each unpacked register serving
  6-8 rows, then the same epilogue: the same bits, so prefill, decode and cache hits agree;
- ``int4_linear_ref`` in torch ops, where nothing can be built (it keeps the codes unpacked, one
  byte per weight, and multiplies them as floats).

``pack`` lays out a layer's codes and scales as the kernel reads them (see the C++ file): per block
of 16 output rows and group, 256 bytes of nibbles then ``d[16]`` and ``m[16]``.
"""

from __future__ import annotations

import torch

from serving.kernels.cpu_ext import extension

GROUP = 32
ROWS = 16
BLOCK_BYTES = 4 * 64 + 2 * ROWS * 2
REF_ROWS = 64  # rows per call of the torch twin's float temporaries


def pack(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``[N / 16, K / 32, 320]`` uint8 from codes ``[N, K]`` (0..15) and ``d``, ``m`` ``[N, K / 32]``
    (rounded to half floats: exact for a GGUF's own scales)."""
    n, k = codes.shape
    nb, g = n // ROWS, k // GROUP
    c = codes.to(torch.uint8).reshape(nb, ROWS, g, 8, 4).permute(0, 2, 3, 1, 4)  # [nb, g, quad, row, 4]
    nibbles = (c[:, :, :4] | (c[:, :, 4:] << 4)).reshape(nb, g, 256)

    def halves(s: torch.Tensor) -> torch.Tensor:
        return s.to(torch.float16).reshape(nb, ROWS, g).permute(0, 2, 1).contiguous().view(torch.uint8)

    return torch.cat([nibbles, halves(d), halves(m)], dim=-1).contiguous()


def unpack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes ``[N, K]`` int32, ``d``, ``m`` ``[N, K / 32]`` float32) of a packed layer."""
    nb, g, _ = w.shape
    c = w[..., :256].reshape(nb, g, 4, ROWS, 4)
    codes = torch.cat([c & 15, c >> 4], dim=2).permute(0, 3, 1, 2, 4).reshape(nb * ROWS, g * GROUP)

    def floats(lo: int) -> torch.Tensor:
        h = w[..., lo:lo + 2 * ROWS].contiguous().view(torch.float16)  # [nb, g, 16]
        return h.permute(0, 2, 1).reshape(nb * ROWS, g).float()

    return codes.to(torch.int32), floats(256), floats(256 + 2 * ROWS)


QMAX = 127 * 256


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q ``[M, G, 32]`` as floats, dx ``[M, G]``, sx ``[M, G]``) of ``x [M, K]`` (module doc)."""
    xg = x.float().reshape(x.shape[0], -1, GROUP)
    dx = xg.abs().amax(dim=-1) / QMAX
    inv = torch.where(dx >= torch.finfo(torch.float32).tiny, 1 / dx, torch.zeros_like(dx))  # 1 / subnormal: inf
    q = torch.round(xg * inv[..., None]).clamp_(-QMAX, QMAX)
    return q, dx, q.sum(dim=-1)  # the sums are integers below 2^24: exact in any order


def split_codes(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qh, ql) with ``q = 256 qh + ql``, ``qh`` in -127..127, ``ql`` in 0..255 (as floats)."""
    qh = torch.floor(q / 256)
    return qh, q - 256 * qh


def ref_operands(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What :func:`int4_linear_ref` reads of a packed layer: codes ``[G, 32, N]`` uint8 (one byte
    per weight), ``d`` and ``m`` ``[G, N]`` float32. Unpacking takes longer than the product, so
    callers keep them (:func:`int4_linear`'s ``cache``)."""
    codes, d, m = unpack(w)
    n, groups = d.shape
    return (codes.to(torch.uint8).reshape(n, groups, GROUP).permute(1, 2, 0).contiguous(),
            d.t().contiguous(), m.t().contiguous())


def int4_linear_ref(x: torch.Tensor, w: torch.Tensor,
                    operands: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The kernel's computation in torch ops (bit for bit); ``operands``: ``ref_operands(w)``."""
    codes, d, m = ref_operands(w) if operands is None else operands
    if x.shape[0] > REF_ROWS:  # rows are independent: bounded [G, rows, N] temporaries, the same bits
        return torch.cat([int4_linear_ref(x[i:i + REF_ROWS], w, (codes, d, m))
                          for i in range(0, x.shape[0], REF_ROWS)])
    q, dx, sx = quantize_activations(x)
    qh, ql = split_codes(q.transpose(0, 1))
    c = codes.float()
    dot = 256 * torch.bmm(qh, c) + torch.bmm(ql, c)  # [G, M, N]; every partial an integer < 2^24: exact
    u = dx.t()[..., None] * (d[:, None, :] * dot + m[:, None, :] * sx.t()[..., None])
    acc = torch.zeros(x.shape[0], d.shape[1])
    for g in range(u.shape[0]):  # in order, as the kernel adds them
        acc = acc + u[g]
    return acc


def int4_linear(x: torch.Tensor, w: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
    """``x [M, K] @ W^T -> [M, N]`` float32 for a packed layer ``w``. Without the C++ op the torch
    twin runs, keeping its unpacked operands in ``cache`` (the layer's tensors) after the first call."""
    ext = extension()
    if ext is not None:
        return ext.int4_linear(x if x.dtype == torch.float32 else x.float(), w)
    operands = None if cache is None else cache.get("ref_operands")
    if operands is None:
        operands = ref_operands(w)
        if cache is not None:
            cache["ref_operands"] = operands
    return int4_linear_ref(x, w, operands)
