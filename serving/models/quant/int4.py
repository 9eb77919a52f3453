"""``--quantization int4`` (CPU): GGUF Q4_1 weights -- 4-bit codes in groups of 32 input channels
with a half-float scale ``d`` and minimum ``m`` per group and output channel (``w = d * c + m``) --
times activations quantized per token and group of 32 to 16-bit codes, integer products exact in
int32 (serving.kernels.cpu_int4: C++ for every CPU variant, or its torch-op twin).
It needs the output size to be a multiple of 16 and the input size a multiple of GROUP.

The LM head goes through q8_0 (``head_method``: int8 in groups of 32 x per-group int8 activations,
serving.models.quant.q8), as llama.cpp's Q4 files keep the embedding / output table in Q8_0: 4-bit
logits cost far more accuracy than 4-bit projections, and per-token activation scales (the int8
mode's) made SmolLM2 miss Paris in the README's first example. On the default
model the groups coincide with the GGUF's own Q4_1 blocks (32 input channels, min/max), so the
codes this recovers from the converted fp32 weights are exactly the file's (docs/cpu.md); where the
folder's GGUF source is at hand its blocks are packed directly (serving.models.quant.gguf_q4).

Each group's activation scale comes from that token's own values, so a token's result does not
depend on its batch, and cache hits stay token-identical with recompute.
"""

from __future__ import annotations

import torch

from serving.kernels import cpu_int4
from serving.models.quant.base import QuantizationError, QuantMethod, register_quant

GROUP = cpu_int4.GROUP
N_MULTIPLE = cpu_int4.ROWS


def quantize_int4_groups(weight: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes ``[out, in]`` int32 in 0..15, d, m ``[out, in/group]`` float32 holding half floats)
    with ``w ~= d * code + m`` (min/max per group, round to nearest; Q4_1's quantizer)."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // group, group)
    lo, hi = w.amin(-1), w.amax(-1)
    d = ((hi - lo) / 15).half().float()  # 0 for a constant group (or one narrower than a half float step)
    m = lo.half().float()
    codes = torch.round((w - m[..., None]) / d[..., None]).clamp(0, 15)
    codes = torch.where(d[..., None] > 0, codes, 0).to(torch.int32).reshape(n, k)  # there: every w ~= m
    return codes, d, m


@register_quant
class Int4W4A8(QuantMethod):
    name = "int4"
    # L3 namespace: v1 (float activations, torch's int4 kernel) and v2 (8-bit activations) computed other KV
    kv_tag = "int4v3"
    devices = ("cpu",)
    bits = 4

    def weight_bytes(self, out_features: int, in_features: int) -> int:
        return out_features * in_features // 2 + 8 * out_features * max(1, in_features // GROUP)  # + d, m a group
    description = f"int4 weights (groups of {GROUP}: scale + min) x 16-bit activations (per token and group)"
    head_method = "q8_0"

    def check_shape(self, name: str, out_features: int, in_features: int) -> None:
        if out_features % N_MULTIPLE or in_features % GROUP:
            raise QuantizationError(
                f"--quantization int4: {name} has shape [{out_features}, {in_features}]; the int4 CPU kernel "
                f"needs outputs a multiple of {N_MULTIPLE} and inputs a multiple of the group size {GROUP}")

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.pack(*quantize_int4_groups(weight))

    @staticmethod
    def pack(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> dict[str, torch.Tensor]:
        """The kernel's tensor from codes ``[out, in]`` (0..15) and ``d``, ``m`` ``[out, in/GROUP]``."""
        return {"packed": cpu_int4.pack(codes, d, m)}

    def matmul(self, x: torch.Tensor, q: dict[str, torch.Tensor]) -> torch.Tensor:
        return cpu_int4.int4_linear(x, q["packed"], q).to(x.dtype)
