"""Weight-quantization methods: one small strategy class per ``--quantization`` value.

A :class:`QuantMethod` says which devices it runs on, checks a weight's shape, turns a floating
weight ``[out, in]`` into the tensors it keeps (``quantize``), and multiplies activations by them
(``matmul``: ``x [M, in] -> [M, out]`` in ``x``'s dtype, no bias). Methods register by name;
``serving.models.quant.apply`` swaps a loaded model's linears for quantized ones.

Every method here computes each output row from its own input row only (per-token activation
scales, never per-tensor ones), so a token's result does not depend on which other tokens share
its batch: recompute and L1/L2/L3 cache hits stay token-identical within one mode.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class QuantizationError(ValueError):
    """A ``--quantization`` method that cannot run here (device, dtype or a weight's shape)."""


class QuantMethod:
    """One quantization method (stateless; its tensors live in the QuantLinear that uses it)."""

    name: str = ""
    devices: tuple[str, ...] = ()  # torch device types it runs on
    description: str = ""
    head_method: str | None = None  # another registered method for the LM head (None: this one)
    kv_tag: str = ""  # the L3 namespace's tag for KV computed under this method ("": its name)
    head_only: bool = False  # only another method's head_method, not a --quantization value

    def check_device(self, device: torch.device) -> None:
        """Raise QuantizationError unless this method runs on ``device``."""
        if device.type not in self.devices:
            raise QuantizationError(
                f"--quantization {self.name} runs on {' / '.join(self.devices)} only, not on {device.type}"
            )

    def check_shape(self, name: str, out_features: int, in_features: int) -> None:
        """Raise QuantizationError naming ``name`` when the kernel cannot take this weight."""

    bits: int = 8  # bits a weight's code takes (the memory estimate before loading)

    def weight_bytes(self, out_features: int, in_features: int) -> int:
        """About how many bytes ``quantize`` keeps for a weight of this shape: the codes and a float32
        scale per output channel (a method with more scales says so)."""
        return out_features * in_features * self.bits // 8 + 4 * out_features

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """Tensors that replace the floating ``weight [out, in]``."""
        raise NotImplementedError

    def matmul(self, x: torch.Tensor, q: dict[str, torch.Tensor]) -> torch.Tensor:
        """``x [M, in] @ W^T -> [M, out]`` in ``x``'s dtype."""
        raise NotImplementedError


_METHODS: dict[str, QuantMethod] = {}


def register_quant(cls: type[QuantMethod]) -> type[QuantMethod]:
    """Class decorator: register one instance of ``cls`` under ``cls.name``."""
    if not cls.name or cls.name in _METHODS:
        raise ValueError(f"quantization method {cls.name!r} is unnamed or registered twice")
    _METHODS[cls.name] = cls()
    return cls


def quant_methods() -> list[str]:
    """Names ``--quantization`` accepts besides ``none`` (and ``auto``)."""
    return sorted(name for name, m in _METHODS.items() if not m.head_only)


def get_quant_method(name: str) -> QuantMethod:
    method = _METHODS.get(name)
    if method is None:
        raise QuantizationError(f"unknown quantization {name!r}; choose none or one of {quant_methods()}")
    return method


def per_token_scale(x: torch.Tensor, qmax: float, eps: float = 1e-12) -> torch.Tensor:
    """``[M, 1]`` float32 scales so that ``x / scale`` spans ``[-qmax, qmax]`` row by row."""
    return (x.abs().amax(dim=-1, keepdim=True).float().clamp(min=eps) / qmax)


Matmul = Callable[[torch.Tensor], torch.Tensor]
