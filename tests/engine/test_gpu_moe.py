"""Mixture-of-experts families on CUDA (issue 45): a tiny random Qwen3-MoE and GPT-OSS in float32 with
the Triton backend start (their torch expert path reads counts on the host, so the engine runs them
without CUDA graphs: `graphs` stays None) and give HF's greedy tokens, cold and from L1. Skips without
CUDA (the CPU runs them in tests/engine/test_engine.py and test_engine_families.py)."""

from __future__ import annotations

import pytest
import torch

from harness.engine_cases import ids_of, prompts
from harness.model_utils import hf_greedy, tiny_model
from serving.engine import Engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_moe_models_on_cuda_match_hf(tmp_path, arch: str) -> None:
    path = tiny_model(tmp_path, arch)
    ps = prompts(4, 512, seed=17, lo=20, hi=90)
    ref = hf_greedy(path, ps, GREEDY["max_new_tokens"])
    eng = Engine(model_path=str(path), page_size=16, dtype="float32", max_total_tokens=4096)
    try:
        assert eng.core.runner.graphs is None  # no graphs around a host sync
        assert ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY)) == ref
        again = eng.generate(input_ids=ps, sampling_params=GREEDY)
        assert ids_of(again) == ref and all(o["meta_info"]["cached_tokens"] > 0 for o in again)
        eng.check_integrity()
    finally:
        eng.shutdown()
