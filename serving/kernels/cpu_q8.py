"""The linear of int4's LM head on CPU: GGUF Q8_0 weights -- int8 codes in groups of 32 input
channels with one half-float scale ``d`` per (output row, group), ``w = d * c``, codes -127..127
-- times 16-bit activations quantized per row and group of 32 as int4's are
(serving.kernels.cpu_int4.quantize_activations). Each group adds ``dx * (d * float(dot))`` with
``dot = sum(c * q)`` exact in int32 (``vpmaddwd`` / ``vpdpwssd`` on codes widened to 16 bits),
groups in order.

Per-group 16-bit activations keep the head as accurate as fp32 on SmolLM2 (its GGUF's table is
Q8_0, the converted weights are that table): with the int8 mode's head (per-channel weights x
per-token 8-bit activations) or 8-bit per-group activations the int4 model missed Paris in the
README's first example.

Two implementations give the same bits (tests/kernels/test_cpu_q8.py): ``q8_linear`` in
``csrc/group_linear.cpp`` (every variant of serving.kernels.cpu_ext) and ``q8_linear_ref`` in torch
ops. ``pack`` lays a layer out as the kernel reads it: per block of 16 output rows and group, 512
bytes of codes (chunk ``p`` byte ``2 j + t``: row ``j``'s code ``2 p + t``) then ``d[16]``.
"""

from __future__ import annotations

import torch

from serving.kernels.cpu_ext import extension
from serving.kernels.cpu_int4 import GROUP, REF_ROWS, ROWS, quantize_activations, split_codes

BLOCK_BYTES = 8 * 64 + ROWS * 2


def quantize_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes ``[N, K]`` int8, ``d [N, K / 32]`` float32 holding half floats), symmetric per group
    (Q8_0's quantizer: ``d = amax / 127``; the codes of a GGUF's Q8_0 table come back from its
    dequantized weights)."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // GROUP, GROUP)
    d = (w.abs().amax(-1) / 127).half().float()
    codes = torch.where(d[..., None] > 0, torch.round(w / d[..., None]), 0).clamp(-127, 127)
    return codes.to(torch.int8).reshape(n, k), d


def pack(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``[N / 16, K / 32, 544]`` uint8 from codes ``[N, K]`` (-127..127) and ``d [N, K / 32]``."""
    n, k = codes.shape
    nb, g = n // ROWS, k // GROUP
    c = codes.to(torch.int8).reshape(nb, ROWS, g, 16, 2).permute(0, 2, 3, 1, 4).reshape(nb, g, 512)
    halves = d.to(torch.float16).reshape(nb, ROWS, g).permute(0, 2, 1).contiguous().view(torch.uint8)
    return torch.cat([c.view(torch.uint8), halves], dim=-1).contiguous()


def unpack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes ``[N, K]`` int8, ``d [N, K / 32]`` float32) of a packed layer."""
    nb, g, _ = w.shape
    codes = w[..., :512].contiguous().view(torch.int8).reshape(nb, g, 16, ROWS, 2)
    codes = codes.permute(0, 3, 1, 2, 4).reshape(nb * ROWS, g * GROUP)
    d = w[..., 512:].contiguous().view(torch.float16).permute(0, 2, 1).reshape(nb * ROWS, g).float()
    return codes, d


def ref_operands(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`q8_linear_ref` reads: codes ``[G, 32, N]`` int8 and ``d [G, N]`` float32."""
    codes, d = unpack(w)
    n, groups = d.shape
    return codes.reshape(n, groups, GROUP).permute(1, 2, 0).contiguous(), d.t().contiguous()


def q8_linear_ref(x: torch.Tensor, w: torch.Tensor,
                  operands: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The kernel's computation in torch ops (bit for bit); ``operands``: ``ref_operands(w)``."""
    codes, d = ref_operands(w) if operands is None else operands
    if x.shape[0] > REF_ROWS:  # rows are independent: bounded temporaries, the same bits
        return torch.cat([q8_linear_ref(x[i:i + REF_ROWS], w, (codes, d)) for i in range(0, x.shape[0], REF_ROWS)])
    q, dx, _ = quantize_activations(x)
    qh, ql = split_codes(q)
    acc = torch.zeros(x.shape[0], d.shape[1])
    for g in range(codes.shape[0]):  # in order, as the kernel adds them
        c = codes[g].float()
        # each product sum exact in float (< 2^24); dot itself up to 2^27: summed in int64, then rounded once
        dot = (256 * (qh[:, g] @ c).long() + (ql[:, g] @ c).long()).float()
        acc = acc + dx[:, g, None] * (d[g] * dot)
    return acc


def q8_linear(x: torch.Tensor, w: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
    """``x [M, K] @ W^T -> [M, N]`` float32 for a packed layer ``w`` (the torch twin without the
    C++ op, keeping its operands in ``cache``)."""
    ext = extension()
    if ext is not None:
        return ext.q8_linear(x if x.dtype == torch.float32 else x.float(), w)
    operands = None if cache is None else cache.get("ref_operands")
    if operands is None:
        operands = ref_operands(w)
        if cache is not None:
            cache["ref_operands"] = operands
    return q8_linear_ref(x, w, operands)
