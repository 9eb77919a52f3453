"""``--quantization int8`` (CPU): W8A8, symmetric int8 weights with one scale per output channel,
activations quantized per token at run time (asymmetric: each token's [min, max] onto 0..255, a
scale and a zero point per token), integer matmul with int32 accumulation.

The kernel is ``serving.kernels.cpu_int8``: AVX-512 VNNI C++ (quantization, the u8 x s8 product and
the zero-point/scale epilogue in one call), or the same arithmetic in torch ops, bit for bit. On
SmolLM2 asymmetric activations cut the perplexity increase from 6.8 % (symmetric, per token) to
about 4.5 % (bench/cpu_decode.py).

Integer accumulation is exact, so a row's result is the same whatever else is in its batch
(batch-invariant by construction, which keeps cache hits token-identical with recompute).
fbgemm's dynamic linear was faster than oneDNN's, but its per-tensor activation scale breaks that.
"""

from __future__ import annotations

import torch

from serving.kernels.cpu_int8 import int8_linear
from serving.models.quant.base import QuantMethod, register_quant

QMAX = 127.0


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes ``[out, in]``, float32 scales ``[out]``), symmetric, round to nearest."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / QMAX
    codes = torch.round(w / scale[:, None]).clamp(-QMAX, QMAX).to(torch.int8)
    return codes, scale


@register_quant
class Int8W8A8(QuantMethod):
    name = "int8"
    kv_tag = "int8v2"  # L3 namespace: v1 (oneDNN, rounding after the zero point) computed other KV
    devices = ("cpu",)
    description = "int8 weights (per channel) x int8 activations (per token), int32 accumulation"

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, scale = quantize_int8_per_channel(weight)
        return {"codes": codes.contiguous(), "wsum": codes.sum(dim=1, dtype=torch.int64),
                "scale": scale.float().contiguous()}

    def matmul(self, x: torch.Tensor, q: dict[str, torch.Tensor]) -> torch.Tensor:
        return int8_linear(x, q["codes"], q["wsum"], q["scale"]).to(x.dtype)
