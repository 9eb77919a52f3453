"""HF fp8 checkpoints: float8_e4m3fn weights with their scales, read as the model's float weights.

Two layouts, as vLLM and SGLang load them:
- ``<layer>.weight_scale``: one scale per tensor (a scalar) or per output channel (``[N]`` or
  ``[N, 1]``), the compressed-tensors ``FP8`` / ``FP8-Dynamic`` checkpoints;
- ``<layer>.weight_scale_inv``: one scale per ``weight_block_size`` block (``[128, 128]`` unless
  config.json's ``quantization_config`` says otherwise), HF's native ``fp8`` (DeepSeek / Qwen3-FP8).

Each fp8 weight is multiplied by its scale in float32 on the way in (``.input_scale`` and the
scales themselves are not parameters and are skipped). Served with ``--quantization fp8`` the
weights are quantized again per output channel: for per-channel checkpoints that gives back the
checkpoint's own e4m3 codes (the float product moves a weight by far less than half an e4m3
step), with scales within the model dtype's rounding (tests/models/test_fp8_checkpoint.py). Per-tensor
and block scales become per-channel ones: a requantization, each weight within an e4m3 step of
the checkpoint's, not its codes (a block-scaled GEMM would keep them; not built). Without
``--quantization fp8`` the model runs in ``--dtype`` on the dequantized weights (CPU included).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

FP8_DTYPES = ("F8_E4M3",)
SCALE_SUFFIXES = ("_scale", "_scale_inv")  # after "weight"
SKIPPED_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale")


def is_fp8_checkpoint(model_path: str | Path) -> bool:
    """Whether config.json's ``quantization_config`` declares fp8 weights: HF's native ``fp8`` (DeepSeek-V3,
    Qwen3-FP8) or compressed-tensors ``float-quantized`` (what ``--quantization auto`` reads on a GPU)."""
    try:
        qc = json.loads((Path(model_path) / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        return False
    return qc.get("quant_method") == "fp8" or (qc.get("quant_method") == "compressed-tensors"
                                                and qc.get("format") == "float-quantized")


def block_size(model_path: Path) -> tuple[int, int]:
    """``quantization_config.weight_block_size`` of config.json, (128, 128) by default."""
    try:
        qc = json.loads((model_path / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        qc = {}
    size = qc.get("weight_block_size") or [128, 128]
    return int(size[0]), int(size[1])


def dequantize(name: str, weight: torch.Tensor, scale: torch.Tensor, inverse_block: tuple[int, int] | None
               ) -> torch.Tensor:
    """``weight [N, K]`` e4m3 times its scale, float32. ``inverse_block``: ``scale`` holds one value
    per (bn, bk) block (``weight_scale_inv``); else it is a scalar or one value per row."""
    w = weight.float()
    s = scale.float()
    n, k = w.shape
    if inverse_block is not None:
        bn, bk = inverse_block
        if s.shape != (-(-n // bn), -(-k // bk)):
            raise ValueError(f"{name}: weight_scale_inv {tuple(s.shape)} does not tile [{n}, {k}] in {bn}x{bk} "
                             f"blocks")
        return w * s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    if s.numel() == 1:
        return w * s.reshape(())
    if s.numel() != n:
        raise ValueError(f"{name}: weight_scale has {s.numel()} values; expected 1 or one per row ({n})")
    return w * s.reshape(n, 1)


def dequantizing(model_path: Path, tensors: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(name, tensor or lazy slice) of ``tensors`` (name -> an open safetensors handle), fp8
    weights dequantized, scale tensors left out."""
    block = None
    for name, handle in tensors.items():
        if name.endswith(SKIPPED_SUFFIXES):
            continue
        sl = handle.get_slice(name)
        if sl.get_dtype() not in FP8_DTYPES:
            yield name, sl
            continue
        for suffix in SCALE_SUFFIXES:
            scale_name = name + suffix
            if scale_name in tensors:
                if suffix == "_scale_inv" and block is None:
                    block = block_size(model_path)
                scale = tensors[scale_name].get_tensor(scale_name)
                yield name, dequantize(name, handle.get_tensor(name), scale, block if suffix == "_scale_inv" else None)
                break
        else:
            raise ValueError(f"fp8 checkpoint tensor {name} has neither {name}_scale nor {name}_scale_inv")
