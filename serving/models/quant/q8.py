"""``q8_0``: int4's LM head (CPU) -- GGUF Q8_0 weights (int8 in groups of 32 input channels with a
half-float scale per (output row, group)) times 16-bit activations per token and group of 32, as
int4's (serving.kernels.cpu_q8). Not a ``--quantization`` value of its own (``head_only``).

On SmolLM2 the tied embedding / head table of the GGUF is Q8_0: its codes and scales come back
exactly from the converted weights, so this head computes with the file's own table.
"""

from __future__ import annotations

import torch

from serving.kernels import cpu_q8
from serving.models.quant.base import QuantizationError, QuantMethod, register_quant


@register_quant
class Q8Group(QuantMethod):
    name = "q8_0"
    devices = ("cpu",)
    head_only = True
    description = "int8 weights (groups of 32: one scale) x 16-bit activations (per token and group)"

    def check_shape(self, name: str, out_features: int, in_features: int) -> None:
        if out_features % cpu_q8.ROWS or in_features % cpu_q8.GROUP:
            raise QuantizationError(
                f"{name} has shape [{out_features}, {in_features}]; the q8_0 CPU kernel needs outputs a multiple "
                f"of {cpu_q8.ROWS} and inputs a multiple of the group size {cpu_q8.GROUP}")

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"packed": cpu_q8.pack(*cpu_q8.quantize_groups(weight))}

    def matmul(self, x: torch.Tensor, q: dict[str, torch.Tensor]) -> torch.Tensor:
        return cpu_q8.q8_linear(x, q["packed"], q).to(x.dtype)
