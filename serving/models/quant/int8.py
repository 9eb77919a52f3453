"""``--quantization int8`` (CPU): W8A8, symmetric int8 weights with one scale per output channel,
activations quantized per token at run time (asymmetric: each token's [min, max] onto 0..255, a
scale and a zero point per token), integer matmul with int32 accumulation.

The kernel subtracts one fixed zero point (128); a token's own zero point ``z`` is put right
after: ``sum_k (x_k - z) w_k = sum_k (x_k - 128) w_k - (z - 128) sum_k w_k`` with the weight's
row sums kept from load time. On SmolLM2 asymmetric activations cut the perplexity increase from
6.8 % (symmetric, per token) to 4.5 % (bench/cpu_decode.py).

Integer accumulation is exact, so a row's result is the same whatever else is in its batch
(batch-invariant by construction, which keeps cache hits token-identical with recompute).

Kernel: oneDNN's ``qlinear_pointwise`` (u8 x s8 -> f32, VNNI on AVX-512 machines) with a prepacked
weight; ``torch._int_mm`` when oneDNN is unavailable. bench/cpu_decode.py measured the choices
(README "Quantized weights").
"""

from __future__ import annotations

import torch

from serving.models.quant.base import QuantMethod, register_quant

QMAX = 127.0
_U8_ZERO = 128  # the kernel's fixed activation zero point


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes ``[out, in]``, float32 scales ``[out]``), symmetric, round to nearest."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / QMAX
    codes = torch.round(w / scale[:, None]).clamp(-QMAX, QMAX).to(torch.int8)
    return codes, scale


def _onednn_ok() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


@register_quant
class Int8W8A8(QuantMethod):
    name = "int8"
    devices = ("cpu",)
    description = "int8 weights (per channel) x int8 activations (per token), int32 accumulation"

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, scale = quantize_int8_per_channel(weight)
        out = {"scale": scale, "zeros": torch.zeros(codes.shape[0], dtype=torch.long),
               "row_sum": codes.float().sum(dim=1) * scale}  # [out]: sum_k w_k (dequantized)
        if _onednn_ok():
            out["packed"] = torch.ops.onednn.qlinear_prepack(codes, None)
        else:
            out["codes_t"] = codes.t().contiguous()  # [in, out] for torch._int_mm
        return out

    def matmul(self, x: torch.Tensor, q: dict[str, torch.Tensor]) -> torch.Tensor:
        xf = x.float()
        lo, hi = torch.aminmax(xf, dim=-1, keepdim=True)
        xs = (hi - lo).clamp_(min=1e-12).div_(255)  # [M, 1] per-token scale
        zero = torch.round(lo.div(xs)).neg_()  # [M, 1]: x ~= (code - zero) * xs, code in 0..255
        xq = torch.addcmul(zero, xf, xs.reciprocal()).round_().clamp_(0, 255)
        if "packed" in q:
            y = torch.ops.onednn.qlinear_pointwise(
                xq.to(torch.uint8), 1.0, _U8_ZERO, q["packed"], q["scale"], q["zeros"],
                None, 1.0, 0, torch.float32, "none", [], "")
        else:
            y = torch._int_mm(xq.sub_(_U8_ZERO).to(torch.int8), q["codes_t"]).float().mul_(q["scale"])
        y = torch.addcmul(y, zero.sub_(_U8_ZERO), q["row_sum"], value=-1).mul_(xs)
        return y.to(x.dtype)
