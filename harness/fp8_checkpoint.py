"""fp8 checkpoints for tests: an HF fp8 checkpoint (weights + scales) written from a tiny model,
its dequantized twin, its greedy tokens."""

from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import load_file, save_file

from serving.engine import Engine
from serving.models.quant.fp8 import quantize_fp8_per_channel

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fp8_checkpoint(src, dst, layout: str):
    """Copy the float checkpoint ``src`` into ``dst`` with every projection in e4m3 + scales;
    return {weight name: the dequantized float32 weight}."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    out, deq = {}, {}
    for name, w in tensors.items():
        if not any(f".{p}." in name for p in PROJ):
            out[name] = w
            continue
        if layout == "channel":
            codes, scale = quantize_fp8_per_channel(w)
            out[name], out[name + "_scale"] = codes, scale.reshape(-1, 1)
            deq[name] = codes.float() * scale.reshape(-1, 1)
        elif layout == "tensor":
            s = w.abs().max().float() / 448.0
            codes = (w.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)
            out[name], out[name + "_scale"] = codes, s.reshape(())
            deq[name] = codes.float() * s
        else:  # 32 x 32 blocks
            n, k = w.shape
            s = torch.rand(-(-n // 32), -(-k // 32)) * 0.01 + 0.001
            full = s.repeat_interleave(32, 0)[:n].repeat_interleave(32, 1)[:, :k]
            codes = (w.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn)
            out[name], out[name + "_scale_inv"] = codes, s
            deq[name] = codes.float() * full
        out[name.replace(".weight", ".input_scale")] = torch.tensor(1.0)  # static-activation checkpoints carry it
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [32, 32]}
    (dst / "config.json").write_text(json.dumps(cfg))
    return deq


def dequantized_twin(src, dst, deq):
    """A copy of the float checkpoint ``src`` at ``dst`` with ``deq``'s weights in place."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    tensors.update(deq)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def greedy_tokens(paths, **engine_kw) -> list:
    """Each checkpoint's greedy output ids for two fixed prompts, one engine at a time."""
    outs = []
    for path in paths:
        eng = Engine(model_path=str(path), max_total_tokens=2048, **engine_kw)
        try:
            outs.append([o["output_ids"] for o in eng.generate(
                input_ids=[[5, 9, 30, 2, 7], [100, 3]], sampling_params={"temperature": 0, "max_new_tokens": 12})])
        finally:
            eng.shutdown()
    return outs
