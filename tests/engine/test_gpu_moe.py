"""Mixture-of-experts families on CUDA (issue 45): a tiny random Qwen3-MoE and GPT-OSS in float32 with
the Triton backend give HF's greedy tokens, cold and from L1. By default their experts run in the fused
Triton MoE (serving/kernels/triton_moe.py), which reads nothing back to the host, so the engine captures
decode and extend graphs around it and replays them; with ``moe.FUSED_KERNEL = False`` the torch expert path
reads counts on the host and the engine runs without graphs (`graphs` None). Skips without CUDA (the CPU runs
the kernel under the interpreter in tests/engine/test_moe_kernel_graphs.py, the torch path in
tests/engine/test_engine.py and test_engine_families.py)."""

from __future__ import annotations

import pytest
import torch

from harness.engine_cases import ids_of, prompts
from harness.model_utils import hf_greedy, tiny_model
from serving.engine import Engine
from serving.models import moe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}


@pytest.mark.parametrize("fused", [True, False], ids=["kernel_graphs", "torch_eager"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_moe_models_on_cuda_match_hf(tmp_path, monkeypatch: pytest.MonkeyPatch, arch: str, fused: bool) -> None:
    monkeypatch.setattr(moe, "FUSED_KERNEL", None if fused else False)
    path = tiny_model(tmp_path, arch)
    ps = prompts(4, 512, seed=17, lo=20, hi=90)
    ref = hf_greedy(path, ps, GREEDY["max_new_tokens"])
    eng = Engine(model_path=str(path), page_size=16, dtype="float32", max_total_tokens=4096)
    try:
        runner = eng.core.runner
        layers = [m for m in runner.model.modules() if isinstance(m, moe.SparseMoE)]
        assert layers and all(m.syncs_host != fused for m in layers)
        assert (runner.graphs is not None) == fused  # graphs exactly when nothing syncs
        assert ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY)) == ref
        if fused:
            assert runner.graphs.replays > 0
        again = eng.generate(input_ids=ps, sampling_params=GREEDY)
        assert ids_of(again) == ref and all(o["meta_info"]["cached_tokens"] > 0 for o in again)
        eng.check_integrity()
    finally:
        eng.shutdown()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_moe_in_a_captured_graph(dtype: torch.dtype) -> None:
    """The kernels (align, the two GEMMs, the sum) captured in one CUDA graph and replayed on new inputs in
    the same buffers equal the torch path: nothing in them syncs, and no size depends on the routing."""
    from serving.kernels.triton_moe import fused_moe

    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens, hidden, inter, experts, top_k = 24, 256, 128, 16, 4
    opts = moe.MoEOptions(experts, top_k, inter, renormalize=True)
    layer = moe.SparseMoE(hidden, opts).to("cuda", dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device="cuda", dtype=dtype) * 0.05)
    x = torch.randn(tokens, hidden, generator=gen, device="cuda", dtype=dtype)
    with torch.no_grad():
        weights, ids = layer.route(x)
        w_buf, id_buf = weights.clone(), ids.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up (compiles) off the capture
            fused_moe(x, w_buf, id_buf, layer.w13, layer.w2)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_moe(x, w_buf, id_buf, layer.w13, layer.w2)
        for seed in range(3):  # new inputs, new routings (other experts empty), same buffers
            x.copy_(torch.randn(tokens, hidden, generator=gen, device="cuda", dtype=dtype) * (seed + 1))
            weights, ids = layer.route(x)
            w_buf.copy_(weights)
            id_buf.copy_(ids)
            graph.replay()
            moe.FUSED_KERNEL = False
            try:
                ref = layer(x)
            finally:
                moe.FUSED_KERNEL = None
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
            torch.testing.assert_close(out, ref, atol=tol * float(ref.abs().max()), rtol=tol)
