"""``--quantization auto`` (``make serve``'s default): the fastest mode that answers sensibly on
this machine, decided at start-up from the CPU and the C++ ops that built.

- CPU with a SIMD variant of the C++ ops (serving.kernels.cpu_ext: avx512vnni, avxvnni, avx2):
  ``int4`` -- on SmolLM2 5-7x fp32's decode and llama.cpp's speed (bench/cpu_decode.py), the
  README's first question answered as fp32 answers it (tests/server/test_quant_server.py);
- CPU without them (no g++, another ISA: only the torch twins or the scalar variant): ``none``
  (fp32), whose torch path is faster there than int4's torch twin;
- CUDA: ``none`` (the model's dtype; fp8 is opt-in), except for a checkpoint whose config.json
  declares fp8 weights (``quantization_config``: DeepSeek-V3, Qwen3-FP8, compressed-tensors FP8), which
  runs ``fp8`` on a GPU with fp8 GEMMs (compute capability 8.9+), as vLLM and SGLang serve it; on an older
  GPU it is dequantized to the model's dtype, and the log line says so.

The choice and why is one log line.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)
FAST_VARIANTS = ("avx512vnni", "avxvnni", "avx2")
FP8_CAPABILITY = (8, 9)  # Ada / Hopper: serving.models.quant.fp8


def cuda_mode(fp8_checkpoint: bool, capability: tuple[int, int]) -> tuple[str, str]:
    """(mode, why) of ``auto`` on a GPU of this compute capability."""
    if not fp8_checkpoint:
        return "none", "on cuda the model's dtype is the default (fp8 is opt-in)"
    if capability >= FP8_CAPABILITY:
        return "fp8", "the checkpoint's weights are fp8 (config.json quantization_config) and this GPU runs fp8"
    cap = f"{capability[0]}.{capability[1]}"
    return "none", (f"the checkpoint's weights are fp8 but this GPU (compute capability {cap}) has no fp8 GEMM: "
                    "they are dequantized to the model's dtype")


def resolve_quantization(name: str, device: torch.device | str, model_path: str | Path | None = None) -> str:
    """``name`` itself unless it is ``auto``; then the mode for ``device`` and the checkpoint at
    ``model_path`` (module doc), logged."""
    if name != "auto":
        return name
    device = torch.device(device)
    if device.type == "cuda":
        from serving.models.fp8_checkpoint import is_fp8_checkpoint

        fp8 = model_path is not None and is_fp8_checkpoint(model_path)
        mode, why = cuda_mode(fp8, torch.cuda.get_device_capability(device) if fp8 else (0, 0))
    elif device.type != "cpu":
        mode, why = "none", f"on {device.type} the model's dtype is the default"
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
