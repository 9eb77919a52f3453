"""--quantization (weights): the methods' numerics, batch invariance, refusals, and tier exactness
within a mode (recompute, L1, L2 and L3 hits token-identical) under int8 and int4."""

from __future__ import annotations

import pytest
import torch

from harness.engine_cases import GREEDY, ids_of, tier_prompts
from harness.kv_modes import check_mode, make, tier_hits
from harness.model_utils import tiny_model
from serving.config import QUANTIZATIONS, ModelConfig
from serving.engine import Engine
from serving.kernels import cpu_int8
from serving.models.loader import load_model
from serving.models.quant import QuantizationError, QuantLinear, get_quant_method, int8, quant_methods

CPU_METHODS = ["int8", "int4"]
REL_ERR = {"int8": 0.02, "int4": 0.15}  # of a random [256, 512] layer's output, measured ~0.01 / ~0.08


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tiny_model(tmp_path_factory.mktemp("quant"))
    ps, others = tier_prompts()
    return path, ps, others, None


def test_config_names_the_registry_and_refuses_others():
    assert sorted(QUANTIZATIONS) == sorted(["none", "auto", *quant_methods()])
    assert "q8_0" not in quant_methods()  # int4's head, not a mode of its own
    with pytest.raises(ValueError, match="quantization must be one of none, auto, int8, int4, fp8, got 'int3'"):
        ModelConfig(quantization="int3")


@pytest.mark.parametrize("variant,want", [("avx2", "int4"), ("avx512vnni", "int4"), ("avxvnni", "int4"),
                                          ("scalar", "none"), (None, "none")])
def test_auto_follows_the_cpu_ops_that_run_here(monkeypatch, caplog, variant, want):
    from serving.kernels import cpu_ext
    from serving.models.quant.auto import resolve_quantization

    monkeypatch.setattr(cpu_ext, "variant", lambda: variant)
    monkeypatch.setattr(cpu_ext, "why_not", "HICACHE_CPU_KERNELS=0" if variant is None else "")
    with caplog.at_level("INFO", logger="serving.models.quant.auto"):
        assert resolve_quantization("auto", "cpu") == want
        assert resolve_quantization("int8", "cpu") == "int8"  # an explicit mode is taken as it is
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(f"--quantization auto: {'fp32' if want == 'none' else want} (")
    assert (variant or "HICACHE_CPU_KERNELS=0") in lines[0]


def test_auto_model_records_the_mode_it_resolved_to(tiny):
    from serving.kernels import cpu_ext

    model, _ = load_model(tiny[0], quantization="auto")
    assert model.quantization == ("int4" if cpu_ext.variant() not in (None, "scalar") else "none")
    assert model.quant_tag == ("int4v3" if model.quantization == "int4" else "none")


@pytest.mark.parametrize("name", [*CPU_METHODS, "int8-torch-ops"])
def test_quant_linear_is_close_and_batch_invariant(name, monkeypatch):
    if name == "int8-torch-ops":  # the reference used without AVX-512 VNNI or a compiler
        monkeypatch.setattr(int8, "int8_linear", cpu_int8.int8_linear_ref)
        name = "int8"
    torch.manual_seed(0)
    w, b = torch.randn(256, 512) * 0.05, torch.randn(256)
    lin = QuantLinear(get_quant_method(name), w, b)
    x = torch.randn(9, 512) + torch.linspace(-1, 3, 512)  # skewed rows: the zero points matter
    y, ref = lin(x), x @ w.t() + b
    err = ((y - ref).norm() / ref.norm()).item()
    assert err < REL_ERR[name], err
    assert err > 1e-5  # it really is quantized
    for rows in (slice(3, 4), slice(0, 5), slice(8, 9)):  # a row's result ignores the rest of its batch
        assert torch.equal(lin(x[rows]), y[rows])
    assert torch.equal(lin(x.view(3, 3, 512)).view(9, 256), y)


def test_fp8_on_cpu_is_a_startup_error_naming_it(tiny):
    with pytest.raises(QuantizationError, match="fp8 runs on cuda only, not on cpu"):
        load_model(tiny[0], quantization="fp8")
    with pytest.raises(QuantizationError, match="fp8 runs on cuda only"):
        Engine(model_path=str(tiny[0]), quantization="fp8")


def test_int4_refuses_a_shape_the_kernel_cannot_take(tmp_path):
    path = tiny_model(tmp_path / "m", hidden_size=48, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(QuantizationError, match=r"int4: model.layers.0.self_attn.qkv_proj has shape \[96, 48\]"):
        load_model(path, quantization="int4")
    load_model(path, quantization="int8")  # int8 takes any shape


@pytest.mark.parametrize("name", CPU_METHODS)
def test_every_projection_and_the_head_are_quantized(tiny, name):
    model, _ = load_model(tiny[0], quantization=name)
    assert not any(isinstance(m, torch.nn.Linear) for n, m in model.named_modules() if n != "lm_head")
    # int4's head is q8_0 (the Q8_0 table of llama.cpp's Q4 files, with int4's 16-bit activations)
    assert model.logits_matmul.__self__.method.name == {"int8": "int8", "int4": "q8_0"}[name]
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert names >= {"qkv_proj", "gate_up_proj", "linear"}  # linear: inside o_proj / down_proj


@pytest.mark.parametrize("name", CPU_METHODS)
def test_recompute_l1_l2_l3_identical_within_the_mode(tiny, tmp_path, name):
    path, ps, others, _ = tiny
    fp32 = Engine(model_path=str(path), page_size=4, max_total_tokens=160)
    ref = ids_of(fp32.generate(input_ids=ps, sampling_params=GREEDY))
    fp32.shutdown()
    cold = check_mode(path, ps, others, None, tmp_path / "l3", {"quantization": name}, "page_first")
    assert cold != ref  # the mode changes the model (random tiny weights: the answers move)


def test_l3_of_another_weight_mode_is_a_miss(tiny, tmp_path):
    path, ps, _, _ = tiny
    db = tmp_path / "l3"
    eng = make(path, db, {})
    eng.generate(input_ids=ps, sampling_params=GREEDY)
    eng.core.storage.poll(wait=True)
    eng.shutdown()  # fp32 KV in L3
    eng = make(path, db, {"quantization": "int8"})
    outs = eng.generate(input_ids=ps, sampling_params=GREEDY)
    assert tier_hits(outs, "storage") == 0 and eng.core.storage.tier.stats()["hits"] == 0
    eng.check_integrity()
    eng.shutdown()


@pytest.mark.slow
def test_int4_tp2_quantizes_each_shard_and_matches_tp1(tiny):
    """int4's groups are 32 input channels and every shard boundary of the tiny model is a multiple
    of 32, so each rank quantizing its own shard gives TP=1's int4 weights: the same tokens."""
    path, ps, _, _ = tiny
    want = None
    for tp in (1, 2):
        eng = Engine(model_path=str(path), page_size=4, max_total_tokens=256, quantization="int4", tp_size=tp)
        try:
            got = ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY))
            eng.check_integrity()
        finally:
            eng.shutdown()
        want = want or got
        assert got == want
