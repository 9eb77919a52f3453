"""HF fp8 checkpoints (serving/models/fp8_checkpoint.py): per-tensor and per-channel
``weight_scale`` and block ``weight_scale_inv`` are read as the dequantized weights; the fp8
method's per-channel quantization then gives back the checkpoint's own e4m3 codes (per-tensor and
per-channel), scales within bf16 rounding; a weight without a scale, or scales that do not tile
it, are load errors naming the tensor."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.fp8_checkpoint import dequantized_twin, fp8_checkpoint, greedy_tokens
from harness.model_utils import tiny_model
from serving.models.loader import load_model
from serving.models.quant.fp8 import Fp8W8A8


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


def test_auto_serves_an_fp8_checkpoint_in_fp8_on_an_fp8_gpu(tiny, tmp_path):
    """``--quantization auto`` reads config.json's ``quantization_config`` as vLLM and SGLang do: an fp8
    checkpoint runs ``fp8`` on a GPU with fp8 GEMMs (8.9+), is dequantized on an older one, saying why;
    a float checkpoint keeps the model's dtype on a GPU (fp8 opt-in); the CPU's choice ignores it."""
    from serving.models.fp8_checkpoint import is_fp8_checkpoint
    from serving.models.quant.auto import cuda_mode, resolve_quantization

    fp8_checkpoint(tiny, tmp_path / "fp8", "block")
    assert is_fp8_checkpoint(tmp_path / "fp8") and not is_fp8_checkpoint(tiny)
    assert not is_fp8_checkpoint(tmp_path / "missing")
    assert cuda_mode(True, (9, 0))[0] == "fp8" and cuda_mode(True, (8, 9))[0] == "fp8"
    mode, why = cuda_mode(True, (8, 0))
    assert mode == "none" and "compute capability 8.0" in why and "dequantized" in why
    assert cuda_mode(False, (9, 0))[0] == "none"
    assert resolve_quantization("auto", "cpu", tmp_path / "fp8") == resolve_quantization("auto", "cpu", tiny)
    assert resolve_quantization("none", "cuda", tmp_path / "fp8") == "none"  # an explicit mode is taken as it is
