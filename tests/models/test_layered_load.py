"""A quantized model loads a decoder layer at a time (serving/models/layered_load.py), CPU with
``--quantization int8`` standing in for fp8 on a GPU: the model equals the one loaded whole and then
quantized (dummy weights and real checkpoints of a dense, an MoE and a GPT-OSS model); while it loads
the device never holds more floating weights than those outside the layers plus one layer; a model
that does not fit is refused before anything is allocated, in one line naming the sizes and flags."""

from __future__ import annotations

import pytest
import torch

from harness.model_utils import tiny_model
from serving.kernels.attention import get_attention_backend
from serving.models import layered_load
from serving.models.loader import load_model
from serving.models.quant import quantize_model
from serving.structs.forward_batch import ForwardBatch

PAGE = 4
# int8's kernels want sizes that are multiples of 16: the tiny families with hidden 64 / 128 qualify
SHAPES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2)


def _logits(model, cfg) -> torch.Tensor:
    from hicache.tiers.device import DeviceKVPool

    pool = DeviceKVPool(cfg.kv_layout(torch.float32), 16, PAGE, "cpu")
    batch = ForwardBatch.build([(list(range(3, 14)), 0, [1, 2, 3]), ([7, 8, 9], 0, [4])], PAGE)
    return model(batch, pool, get_attention_backend("torch"))


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("load_format", ["dummy", "auto"])
def test_layered_equals_whole_then_quantized(tmp_path, arch, load_format) -> None:
    path = tiny_model(tmp_path, arch, **SHAPES)
    layered, cfg = load_model(path, load_format=load_format, quantization="int8")
    whole, _ = load_model(path, load_format=load_format, quantization="none")
    quantize_model(whole, "int8", "cpu")
    assert layered.quant_tag == whole.quant_tag and layered.quantization == "int8"
    assert not any(p.is_meta for p in layered.parameters())
    torch.testing.assert_close(_logits(layered, cfg), _logits(whole, cfg), rtol=0, atol=0)


def test_at_most_one_layer_in_float_at_a_time(tmp_path, monkeypatch) -> None:
    path = tiny_model(tmp_path, "llama", **{**SHAPES, "num_hidden_layers": 6})
    peaks: list[int] = []
    quantize = layered_load.quantize_modules

    def spy(root, method, prefix, pre):
        model_params = [p for p in spy.model.parameters() if not p.is_meta and p.is_floating_point()]
        peaks.append(sum(p.numel() * p.element_size() for p in model_params))
        return quantize(root, method, prefix, pre)

    real = layered_load.load_layered

    def capture(model, *a, **kw):
        spy.model = model
        return real(model, *a, **kw)
    monkeypatch.setattr(layered_load, "quantize_modules", spy)
    monkeypatch.setattr("serving.models.loader.load_layered", capture)
    model, _ = load_model(path, load_format="auto", quantization="int8")
    outside = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".layers." not in n)
    whole, _ = load_model(path, load_format="auto", quantization="none")
    layer = sum(p.numel() * p.element_size() for p in whole.model.layers[0].parameters())
    assert len(peaks) == 6
    # before layer i is quantized: the float parameters outside the layers, layer i, and the biases /
    # norms the quantized layers keep in float (a few hundred bytes each here)
    assert max(peaks) < outside + layer + 6 * 1024, (peaks, outside, layer)
    assert outside + layer * 6 > max(peaks) + 4 * layer  # the whole model in float would be far more


def test_a_model_that_does_not_fit_is_refused_before_loading(tmp_path, monkeypatch) -> None:
    path = tiny_model(tmp_path, "llama", **SHAPES)
    monkeypatch.setattr(layered_load, "free_bytes", lambda device: (10_000, "cpu has 0.0 GiB free"))
    allocated = []
    monkeypatch.setattr(layered_load, "_materialize", lambda *a: allocated.append(a) or [])
    with pytest.raises(layered_load.WeightsDoNotFit, match=r"need 0\.\d GiB with --quantization int8 and cpu has "
                                                           r"0\.0 GiB free: use a stronger --quantization, a larger "
                                                           r"--tp-size"):
        load_model(path, load_format="dummy", quantization="int8")
    assert not allocated
