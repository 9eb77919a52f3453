"""HF fp8 checkpoints (serving/models/fp8_checkpoint.py): per-tensor and per-channel
``weight_scale`` and block ``weight_scale_inv`` are read as the dequantized weights; the fp8
method's per-channel quantization then gives back the checkpoint's own e4m3 codes (per-tensor and
per-channel), scales within bf16 rounding; a weight without a scale, or scales that do not tile
it, are load errors naming the tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from serving.engine import Engine
from serving.models.loader import load_model
from serving.models.quant.fp8 import Fp8W8A8, quantize_fp8_per_channel
from tests.model_utils import tiny_model

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


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("float"), hidden_size=96, intermediate_size=160)


@pytest.mark.parametrize("layout", ["channel", "tensor", "block"])
def test_fp8_checkpoint_loads_as_its_dequantized_weights(tiny, tmp_path, layout):
    deq = fp8_checkpoint(tiny, tmp_path / "fp8", layout)
    model, _ = load_model(tmp_path / "fp8")
    layer = model.model.layers[1]
    q, k, v = (deq[f"model.layers.1.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj"))
    assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat([q, k, v]))
    assert torch.equal(layer.mlp.down_proj.weight, deq["model.layers.1.mlp.down_proj.weight"])
    ref, _ = load_model(tiny)
    assert torch.equal(model.model.embed_tokens.weight, ref.model.embed_tokens.weight)  # not fp8: as it was


def test_fp8_method_recovers_per_channel_checkpoint_codes(tiny, tmp_path):
    fp8_checkpoint(tiny, tmp_path / "fp8", "channel")
    raw = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    model, _ = load_model(tmp_path / "fp8", dtype=torch.bfloat16)
    name = "model.layers.0.mlp.down_proj.weight"
    q = Fp8W8A8().quantize(model.model.layers[0].mlp.down_proj.weight)
    assert torch.equal(q["codes"].view(torch.uint8), raw[name].view(torch.uint8))
    assert torch.allclose(q["scale"].reshape(-1), raw[name + "_scale"].reshape(-1), rtol=2**-7, atol=0)


@pytest.mark.parametrize("layout", ["tensor", "block"])
def test_other_layouts_are_requantized_per_channel_within_an_e4m3_step(tiny, tmp_path, layout):
    deq = fp8_checkpoint(tiny, tmp_path / "fp8", layout)
    model, _ = load_model(tmp_path / "fp8")
    name = "model.layers.0.mlp.down_proj.weight"
    q = Fp8W8A8().quantize(model.model.layers[0].mlp.down_proj.weight)
    again = q["codes"].float() * q["scale"].reshape(-1, 1)
    assert ((again - deq[name]).abs() <= deq[name].abs() * 2**-4 + q["scale"].reshape(-1, 1) * 2**-9).all()


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


def test_fp8_checkpoint_serves_like_its_dequantized_float_checkpoint(tiny, tmp_path):
    deq = fp8_checkpoint(tiny, tmp_path / "fp8", "channel")
    outs = greedy_tokens([tmp_path / "fp8", dequantized_twin(tiny, tmp_path / "plain", deq)])
    assert outs[0] == outs[1]


def test_fp8_weight_without_scale_or_with_bad_blocks_is_a_named_error(tiny, tmp_path):
    fp8_checkpoint(tiny, tmp_path / "a", "channel")
    f = tmp_path / "a" / "model.safetensors"
    t = load_file(str(f))
    del t["model.layers.0.self_attn.o_proj.weight_scale"]
    save_file(t, str(f))
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.o_proj.weight has neither .*_scale"):
        load_model(tmp_path / "a")
    fp8_checkpoint(tiny, tmp_path / "b", "block")
    f = tmp_path / "b" / "model.safetensors"
    t = load_file(str(f))
    t["model.layers.1.mlp.up_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(t, str(f))
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj.weight: weight_scale_inv \(1, 1\) does not tile"):
        load_model(tmp_path / "b")
