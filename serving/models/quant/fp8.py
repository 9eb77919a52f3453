"""``--quantization fp8`` (CUDA, compute capability >= 8.9: Ada / Hopper): W8A8 in float8 e4m3,
one weight scale per output channel (quantized on the fly from the checkpoint's bf16/fp32
weights at load time), activations scaled per token at run time, ``torch._scaled_mm`` with
row-wise scales and the model's dtype out.

``_scaled_mm`` needs both matrix sizes a multiple of 16; a weight that is not is refused at start-up.
"""

from __future__ import annotations

import torch

from serving.models.quant.base import QuantizationError, QuantMethod, per_token_scale, register_quant

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MULTIPLE = 16
GEMV_KERNEL = True  # one token (decode at batch 1): serving.kernels.fp8_gemm; more: _scaled_mm
FUSED_QUANT = True  # activations quantized by serving.kernels.fp8_quant (one launch); False: torch ops


def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes ``[out, in]``, float32 scales ``[out]``)."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes, ``[M, 1]`` float32 scales) per token, in torch ops (the fused kernel's reference)."""
    xs = per_token_scale(x, FP8_MAX)
    return (x.float() / xs).clamp(-FP8_MAX, FP8_MAX).to(FP8), xs


@register_quant
class Fp8W8A8(QuantMethod):
    name = "fp8"
    devices = ("cuda",)
    description = "fp8 e4m3 weights (per channel) x fp8 activations (per token), torch._scaled_mm"

    def check_device(self, device: torch.device) -> None:
        super().check_device(device)
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise QuantizationError(
                f"--quantization fp8 needs an fp8 GPU (compute capability 8.9+: Ada, Hopper); this one is {cap}")

    def check_shape(self, name: str, out_features: int, in_features: int) -> None:
        if out_features % MULTIPLE or in_features % MULTIPLE:
            raise QuantizationError(
                f"--quantization fp8: {name} has shape [{out_features}, {in_features}]; torch._scaled_mm "
                f"needs both a multiple of {MULTIPLE}")

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, scale = quantize_fp8_per_channel(weight)
        return {"codes": codes, "scale": scale.reshape(1, -1).contiguous()}

    def matmul(self, x: torch.Tensor, q: dict[str, torch.Tensor]) -> torch.Tensor:
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        if GEMV_KERNEL and x.shape[0] == 1:
            from serving.kernels.fp8_gemm import fp8_gemv

            return fp8_gemv(x, q["codes"], q["scale"], out_dtype).to(x.dtype)
        if FUSED_QUANT:
            from serving.kernels.fp8_quant import quantize_rows_fp8

            xq, xs = quantize_rows_fp8(x)
        else:
            xq, xs = quantize_rows_torch(x)
        y = torch._scaled_mm(xq, q["codes"].t(), scale_a=xs, scale_b=q["scale"], out_dtype=out_dtype)
        return y.to(x.dtype)
