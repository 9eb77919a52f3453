"""Quantized experts on CPU (issue 45): ``--quantization int8`` / ``int4`` quantizes each expert's projections
(serving/models/moe.py ``quantize_experts``: the C++ ops, per-expert scales) and keeps the router in the
model's dtype. Tiny random Qwen3-MoE, DeepSeek-V2 (its router reads ``gate.weight``: a quantized router
crashed it) and GPT-OSS (expert biases, its own activation): the experts hold no float copy, a batch's
rows equal each row alone (the methods' batch invariance), and a returning prompt from L1 and from L2
gives the tokens of its cold recompute."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.engine_cases import prompts
from harness.model_utils import tiny_model
from serving.engine import Engine
from serving.models.moe import SparseMoE
from serving.models.quant import QuantizationError, get_quant_method

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def _moes(eng: Engine) -> list[SparseMoE]:
    return [m for m in eng.core.runner.model.modules() if isinstance(m, SparseMoE)]


# the tiny MLA's latent projection ([40, 64]) is no int4 shape: DeepSeek-V2 runs int8 only
@pytest.mark.parametrize(("arch", "quant"), [("qwen3_moe", "int8"), ("qwen3_moe", "int4"), ("gpt_oss", "int8"),
                                             ("gpt_oss", "int4"), ("deepseek_v2", "int8")])
def test_quantized_experts_serve_and_hit_like_recompute(tmp_path, arch: str, quant: str) -> None:
    path = tiny_model(tmp_path, arch)
    ps = prompts(3, 40, seed=5)
    eng = Engine(model_path=str(path), device="cpu", quantization=quant, page_size=4, max_total_tokens=512,
                 hicache_ratio=2.0)
    try:
        moes = _moes(eng)
        assert moes and all(m.quant is not None and m.w13 is None and m.w2 is None for m in moes)
        # the L3 namespace: KV computed with float experts (before) is not this KV
        assert eng.core.weights_tag.endswith(":experts") and ":experts" in eng.core.kv_namespace
        assert all(type(m.gate) is nn.Linear for m in moes)  # the router keeps the model's dtype
        cold = [eng.generate(input_ids=[p], sampling_params=GREEDY)[0]["output_ids"] for p in ps]
        l1 = [eng.generate(input_ids=[p], sampling_params=GREEDY)[0] for p in ps]
        eng.core.tree.evict_device(eng.core.tree.cached_pages("device"))
        eng.core.req_cache.flush_transfers()
        l2 = [eng.generate(input_ids=[p], sampling_params=GREEDY)[0] for p in ps]
        eng.check_integrity()
    finally:
        eng.shutdown()
    assert [o["output_ids"] for o in l1] == cold and [o["output_ids"] for o in l2] == cold
    assert all(o["meta_info"]["cached_tokens_details"]["device"] for o in l1)
    assert all(o["meta_info"]["cached_tokens_details"]["host"] for o in l2)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_an_experts_projection_of_a_batch_equals_each_token_alone(tmp_path, quant: str) -> None:
    """Tokens through an expert's quantized projections, alone or in a batch: the same bits (the methods
    quantize activations per token), and the method's product with that expert's weight. (The router's
    float matmul is not batch-invariant in its last bits, as every float projection.)"""
    path = tiny_model(tmp_path, "qwen3_moe")
    eng = Engine(model_path=str(path), device="cpu", quantization="none", page_size=4, max_total_tokens=256)
    try:
        moe = _moes(eng)[0]
        w13, w2 = moe.w13.detach().clone(), moe.w2.detach().clone()
        method = get_quant_method(quant)
        assert moe.quantize_experts(method) and not moe.quantize_experts(method)  # once
        x = torch.randn(7, w13.shape[2], generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert moe(x).shape == x.shape
            for e, which in ((3, 0), (5, 1)):
                xe = x[:, :(w13, w2)[which].shape[2]]
                batch = moe.project(xe, e, which, None)
                assert torch.equal(batch, torch.cat([moe.project(xe[i:i + 1], e, which, None) for i in range(7)]))
            e = 3
            want = method.matmul(x, method.quantize(w13[e]))
            assert torch.equal(moe.project(x, e, 0, None), want)
            assert torch.equal(moe.project(x[:, :w2.shape[2]], e, 1, None),
                               method.matmul(x[:, :w2.shape[2]], method.quantize(w2[e])))
    finally:
        eng.shutdown()


def test_an_expert_shape_the_kernel_cannot_take_is_refused(tmp_path) -> None:
    path = tiny_model(tmp_path, "qwen3_moe", moe_intermediate_size=24)
    with pytest.raises(QuantizationError, match="experts.w2"):
        Engine(model_path=str(path), device="cpu", quantization="int4", page_size=4, max_total_tokens=256)


def test_the_fit_check_counts_cpu_experts_at_the_methods_size(tmp_path) -> None:
    """Before loading, the weights' bytes (``kept_bytes``): on CPU the experts at the method's size (they
    are quantized there), where the fused CUDA kernels run them at the model's; routers stay float."""
    from serving.models.layered_load import kept_bytes

    path = tiny_model(tmp_path, "qwen3_moe")
    eng = Engine(model_path=str(path), device="cpu", quantization="none", page_size=4, max_total_tokens=256)
    try:
        model = eng.core.runner.model
        method = get_quant_method("int8")
        moes = _moes(eng)
        floats = sum(m.w13.numel() * m.w13.element_size() + m.w2.numel() * m.w2.element_size() for m in moes)
        coded = sum(m.num_experts * (method.weight_bytes(*m.expert_shapes()["w13"])
                                     + method.weight_bytes(*m.expert_shapes()["w2"])) for m in moes)
        cpu, cuda = kept_bytes(model, method, torch.device("cpu")), kept_bytes(model, method, torch.device("cuda"))
    finally:
        eng.shutdown()
    assert cuda - cpu == floats - coded > 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_what_quantization_replaces_is_the_list_the_fit_check_counts(tmp_path, arch: str) -> None:
    """``quantized_weights`` (what the fit check and the shape checks count) names exactly the weights
    ``--quantization int8`` replaces: every projection that became quantized is listed, every listed one
    was, the experts of each mixture are listed, its router is not. DeepSeek-V2's shared experts sit inside
    its mixture module: they are quantized, and were left out of the list (counted at float size)."""
    from serving.models.quant.apply import QuantLinear, quantized_weights

    path = tiny_model(tmp_path, arch)
    kw = dict(model_path=str(path), device="cpu", page_size=4, max_total_tokens=256)
    eng = Engine(quantization="none", **kw)
    try:
        listed = set(quantized_weights(eng.core.runner.model, torch.device("cpu")))
    finally:
        eng.shutdown()
    eng = Engine(quantization="int8", **kw)
    try:
        model = eng.core.runner.model
        done = {f"{name}.weight" for name, mod in model.named_modules()
                if isinstance(mod, QuantLinear) and not name.endswith(".linear")}
        done |= {f"{name[: -len('.linear')]}.weight" for name, mod in model.named_modules()
                 if isinstance(mod, QuantLinear) and name.endswith(".linear")}  # a row-parallel projection's
        done |= {f"{name}.{part}" for name, mod in model.named_modules() if isinstance(mod, SparseMoE)
                 and mod.quant is not None for part in mod.expert_shapes()}
        routers = {f"{name}.gate.weight" for name, mod in model.named_modules() if isinstance(mod, SparseMoE)}
    finally:
        eng.shutdown()
    assert done == listed, (sorted(done - listed), sorted(listed - done))
    assert routers and not routers & listed
    if arch == "deepseek_v2":
        assert any(".shared_experts." in n for n in listed)
