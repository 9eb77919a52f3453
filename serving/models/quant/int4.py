"""``--quantization int4`` (CPU): weight-only, asymmetric 4-bit groups of GROUP input channels
(a scale and a zero point per group and output channel), activations stay float.

Kernel: ``aten._weight_int4pack_mm_for_cpu`` on weights packed by
``aten._convert_weight_to_int4pack_for_cpu``; it dequantizes ``w = (q - 8) * scale + zero`` per
group inside the kernel and computes each output row from its input row only.
It needs the output size to be a multiple of 16 and the input size a multiple of GROUP.

The LM head goes through int8 (``head_method``), as llama.cpp's Q4 files keep the embedding /
output table in Q8_0: 4-bit logits cost far more accuracy than 4-bit projections. On the default
model the groups coincide with the GGUF's own Q4_1 blocks (32 input channels, min/max), so the
codes this recovers from the converted fp32 weights are exactly the file's (README); where the
folder's GGUF source is at hand its blocks are packed directly (serving.models.quant.gguf_q4).
"""

from __future__ import annotations

import torch

from serving.models.quant.base import QuantizationError, QuantMethod, register_quant

GROUP = 32
N_MULTIPLE = 16


def quantize_int4_groups(weight: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes ``[out, in]`` int32 in 0..15, scales_and_zeros ``[in/group, out, 2]`` float32)
    with ``w ~= (code - 8) * scale + zero`` (min/max per group, round to nearest)."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // group, group)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    codes = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = lo + 8 * scale
    return codes, torch.stack([scale.t(), zero.t()], dim=-1).contiguous()


@register_quant
class Int4WeightOnly(QuantMethod):
    name = "int4"
    devices = ("cpu",)
    description = f"int4 weights (groups of {GROUP}, scale + zero point), float activations"
    head_method = "int8"

    def check_shape(self, name: str, out_features: int, in_features: int) -> None:
        if out_features % N_MULTIPLE or in_features % GROUP:
            raise QuantizationError(
                f"--quantization int4: {name} has shape [{out_features}, {in_features}]; the int4 CPU kernel "
                f"needs outputs a multiple of {N_MULTIPLE} and inputs a multiple of the group size {GROUP}")

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.pack(*quantize_int4_groups(weight))

    @staticmethod
    def pack(codes: torch.Tensor, sz: torch.Tensor) -> dict[str, torch.Tensor]:
        """The kernel's tensors from codes ``[out, in]`` (0..15) and scales_and_zeros ``[in/GROUP, out, 2]``."""
        return {"packed": torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), "sz": sz}

    def matmul(self, x: torch.Tensor, q: dict[str, torch.Tensor]) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.float(), q["packed"], GROUP, q["sz"])
        return y.to(x.dtype)
