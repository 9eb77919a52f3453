"""Sliding-window models on CUDA (issue 43): a tiny random Gemma-3 and Mistral (8-token windows), prompts
40-300 tokens, the engine in float32 with the Triton backend, CUDA graphs on and off, chunks of 13
tokens: greedy tokens equal HF's (CPU, fp32) cold and with the prefixes from L1, also with the hybrid SWA L1
(the window pool: graphs read their window view, the page-move kernel moves window pages to L2 and back).
Skips without CUDA (the kernels' windows run in Triton's interpreter in tests/kernels/test_attention_window.py,
the window pool's graph buffers and page moves in tests/engine/test_swa_pool_graphs.py and
tests/kernels/test_page_copy_windows.py)."""

from __future__ import annotations

import pytest
import torch

from harness.engine_cases import ids_of, prompts, tier_prompts
from harness.model_utils import hf_greedy, tiny_model
from serving.engine import Engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}


@pytest.mark.parametrize("swa", [False, True], ids=["one-pool", "window-pool"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_windows_on_cuda_match_hf(tmp_path, arch: str, graphs: bool, swa: bool) -> None:
    path = tiny_model(tmp_path, arch)
    ps = prompts(4, 512, seed=11, lo=40, hi=300)
    ref = hf_greedy(path, ps, GREEDY["max_new_tokens"])
    eng = Engine(model_path=str(path), page_size=16, dtype="float32", max_total_tokens=8192,
                 chunked_prefill_size=13, disable_cuda_graph=not graphs, hicache_ratio=2.0,
                 enable_hybrid_swa_memory=swa, swa_full_tokens_ratio=0.25)
    try:
        assert eng.core.runner.attn.name == "triton"
        assert (eng.core.runner.pool.windows is not None) == swa
        if graphs:
            assert (eng.core.runner.graphs.win is not None) == swa
        assert ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY)) == ref
        again = eng.generate(input_ids=ps, sampling_params=GREEDY)
        assert ids_of(again) == ref and all(o["meta_info"]["cached_tokens"] > 0 for o in again)
        eng.check_integrity()
    finally:
        eng.shutdown()


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_window_pool_prefixes_come_back_from_l2_on_cuda(tmp_path, arch: str) -> None:
    """The window pool with graphs, a small L1 and pinned L2 (the page-move kernel): prefixes pushed out of L1
    come back from L2 with their sliding layers' KV (window pages loaded by the kernel): HF's tokens, hits."""
    path = tiny_model(tmp_path, arch)
    ps, others = tier_prompts()
    ref = hf_greedy(path, ps, GREEDY["max_new_tokens"])
    eng = Engine(model_path=str(path), page_size=4, dtype="float32", max_total_tokens=256, hicache_ratio=4.0,
                 hicache_write_policy="write_through", write_through_threshold=1, max_running_requests=2,
                 enable_hybrid_swa_memory=True)
    try:
        assert eng.core.runner.pool.windows is not None and eng.core.runner.graphs is not None
        assert ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY)) == ref
        eng.generate(input_ids=others, sampling_params=GREEDY)  # pushes ps out of L1
        outs = eng.generate(input_ids=ps, sampling_params=GREEDY)
        assert ids_of(outs) == ref
        assert sum(o["meta_info"]["cached_tokens_details"]["host"] for o in outs) > 0, [o["meta_info"] for o in outs]
        eng.check_integrity()
    finally:
        eng.shutdown()


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_window_only_loads_on_cuda(tmp_path, arch: str) -> None:
    """The window pool with graphs and pinned L2: prompts whose full KV stayed on L1 but whose last windows lost
    their window pages come back as whole L1 hits, their windows restored by the page-move kernel's window-only
    load (serving/cache/request_windows.py, ``restore``): HF's tokens."""
    path = tiny_model(tmp_path, arch)
    ps, others = tier_prompts()
    ref = hf_greedy(path, ps, GREEDY["max_new_tokens"])
    eng = Engine(model_path=str(path), page_size=4, dtype="float32", max_total_tokens=1024, hicache_ratio=4.0,
                 hicache_write_policy="write_through", write_through_threshold=1, max_running_requests=2,
                 enable_hybrid_swa_memory=True, swa_full_tokens_ratio=0.04)
    try:
        assert ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY)) == ref
        eng.generate(input_ids=others, sampling_params=GREEDY)  # takes ps's window pages
        outs = eng.generate(input_ids=ps, sampling_params=GREEDY)
        assert ids_of(outs) == ref
        assert eng.core.req_cache.windows.restored_pages > 0
        assert eng.core.tree.host_pinned == 0
        eng.check_integrity()
    finally:
        eng.shutdown()
