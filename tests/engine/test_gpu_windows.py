"""Sliding-window models on CUDA (issue 43): a tiny random Gemma-3 and Mistral (8-token windows), prompts
40-300 tokens, the engine in float32 with the Triton backend, CUDA graphs on and off, chunks of 13
tokens: greedy tokens equal HF's (CPU, fp32) cold and with the prefixes from L1. Skips without CUDA
(the kernels' windows run in Triton's interpreter in tests/kernels/test_attention_window.py)."""

from __future__ import annotations

import pytest
import torch

from harness.engine_cases import ids_of, prompts
from harness.model_utils import hf_greedy, tiny_model
from serving.engine import Engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_windows_on_cuda_match_hf(tmp_path, arch: str, graphs: bool) -> None:
    path = tiny_model(tmp_path, arch)
    ps = prompts(4, 512, seed=11, lo=40, hi=300)
    ref = hf_greedy(path, ps, GREEDY["max_new_tokens"])
    eng = Engine(model_path=str(path), page_size=16, dtype="float32", max_total_tokens=8192,
                 chunked_prefill_size=13, disable_cuda_graph=not graphs, hicache_ratio=2.0)
    try:
        assert eng.core.runner.attn.name == "triton"
        assert ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY)) == ref
        again = eng.generate(input_ids=ps, sampling_params=GREEDY)
        assert ids_of(again) == ref and all(o["meta_info"]["cached_tokens"] > 0 for o in again)
        eng.check_integrity()
    finally:
        eng.shutdown()
