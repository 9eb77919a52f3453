"""``--quantization auto`` (``make serve``'s default): the fastest mode that answers sensibly on
this machine, decided at start-up from the CPU and the C++ ops that built.

- CPU with a SIMD variant of the C++ ops (serving.kernels.cpu_ext: avx512vnni, avxvnni, avx2):
  ``int4`` -- on SmolLM2 5-7x fp32's decode and llama.cpp's speed (bench/cpu_decode.py), the
  README's first question answered as fp32 answers it (tests/server/test_quant_server.py);
- CPU without them (no g++, another ISA: only the torch twins or the scalar variant): ``none``
  (fp32), whose torch path is faster there than int4's torch twin;
- CUDA: ``none`` (the model's dtype; fp8 is opt-in).

The choice and why is one log line.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)
FAST_VARIANTS = ("avx512vnni", "avxvnni", "avx2")


def resolve_quantization(name: str, device: torch.device | str) -> str:
    """``name`` itself unless it is ``auto``; then the mode for ``device`` (module doc), logged."""
    if name != "auto":
        return name
    device = torch.device(device)
    if device.type != "cpu":
        mode, why = "none", f"on {device.type} the model's dtype is the default (fp8 is opt-in)"
    else:
        from serving.kernels import cpu_ext

        variant = cpu_ext.variant()
        if variant in FAST_VARIANTS:
            mode, why = "int4", f"the C++ CPU ops run here (variant {variant})"
        else:
            reason = cpu_ext.why_not or f"only the {variant} variant"
            mode, why = "none", f"no SIMD variant of the C++ CPU ops ({reason}): int4's torch twin is slower than fp32"
    log.info("--quantization auto: %s (%s)", "fp32" if mode == "none" and device.type == "cpu" else mode, why)
    return mode
