"""Mixture-of-experts models through the fused Triton MoE (serving/kernels/triton_moe.py, and for one
token of Qwen3-MoE's 8 experts serving/kernels/triton_moe_decode.py), the CUDA path,
exercised on a CPU: a tiny random Qwen3-MoE (8 experts, top 2) and GPT-OSS (4 experts, biases, the clamped
activation) with the Triton backend under the interpreter (in a child process), every MoE layer forced onto
the kernel (``moe.FUSED_KERNEL``), so ``syncs_host`` is False and the decode and extend graph runners' static
buffers run them (``capture=False``: the same buffers and padding rows a replay reads, run eagerly): greedy
tokens equal HF's (the reference the torch path matches in tests/engine/test_engine_families.py), cold and
from L1. On the GPU itself, tests/engine/test_gpu_moe.py captures the graphs."""

from __future__ import annotations

import pytest
import torch

from harness.interpreted import run_interpreted

CODE = """
import sys, torch
from serving.engine import Engine
from serving.kernels import triton_moe
from serving.runner.cuda_graph_extend import extend_buckets
from serving.models import moe
from harness.model_utils import hf_greedy, tiny_model
from harness.engine_cases import prompts
moe.FUSED_KERNEL = True
calls = []
kernel = triton_moe.fused_moe
def spy(x, *args, **kw):
    calls.append(x.shape[0])
    return kernel(x, *args, **kw)
triton_moe.fused_moe = spy
from serving.kernels import triton_moe_decode
dec_calls = []
dec_kernel = triton_moe_decode.moe_decode
def dec_spy(x, *args, **kw):
    dec_calls.append(x.shape[0])
    return dec_kernel(x, *args, **kw)
triton_moe_decode.moe_decode = dec_spy
path = tiny_model(sys.argv[1], sys.argv[2])
ps = prompts(3, 512, seed=11, lo=20, hi=40)
params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
ref = hf_greedy(path, ps, 6)
eng = Engine(model_path=str(path), page_size=4, max_total_tokens=1024, attention_backend="triton",
             context_length=256, device="cpu", dtype="float32", chunked_prefill_size=16)
runner = eng.core.runner
layers = [m for m in runner.model.modules() if isinstance(m, moe.SparseMoE)]
assert layers and not any(m.syncs_host for m in layers)
runner.graphs = runner.make_graph_runner([1, 2, 4], capture=False)  # static buffers, eager forward
runner.extend_graphs = runner.make_extend_graph_runner(extend_buckets(32, 4), capture=False)
outs = eng.generate(input_ids=ps, sampling_params=params)
assert [o["output_ids"] for o in outs] == ref, ([o["output_ids"] for o in outs], ref)
assert runner.graphs.replays > 0 and runner.extend_graphs.replays > 0
assert 4 in calls and 16 in calls, sorted(set(calls))  # a padded decode size and a padded extend bucket
# one token a step takes the matrix-vector kernels where its pairs are few against the experts (8 x top 2)
assert (1 in dec_calls) == (sys.argv[2] == "qwen3_moe"), sorted(set(dec_calls))
ps2 = [p + o["output_ids"] + [17 + i, 23] for i, (p, o) in enumerate(zip(ps, outs))]
outs2 = eng.generate(input_ids=ps2, sampling_params=params)
assert [o["output_ids"] for o in outs2] == hf_greedy(path, ps2, 6)
assert all(o["meta_info"]["cached_tokens"] > 0 for o in outs2)
eng.check_integrity()
eng.shutdown()
print("OK")
"""


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="an interpreter test for CPU machines; on CUDA, test_gpu_moe.py captures the graphs")
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_moe_models_through_the_kernel_in_interpreter(tmp_path, arch: str) -> None:
    """Prefill chunks, extends over cached prefixes and padded decode batches, every MoE layer on the fused
    kernel under the interpreter: HF's greedy tokens."""
    pytest.importorskip("triton")
    run_interpreted(CODE.replace("sys.argv[1]", repr(str(tmp_path))).replace("sys.argv[2]", repr(arch)))
