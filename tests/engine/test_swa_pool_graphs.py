"""The hybrid SWA L1 (hicache/tiers/window_pages.py) on the CUDA paths, exercised on a CPU: the decode and
extend graph runners' static buffers (``capture=False``: the same buffers, padding and window view a
replay reads, run eagerly) with the Triton backend under the interpreter (in a child process), and
overlap scheduling (CUDA's default, forced on here). A tiny random Gemma-3 (2 sliding layers with an
8-token window to 1 full) and Mistral (every layer an 8-token window), page size 4, prompts 40-60 tokens:
greedy tokens equal HF's, cold and with the prefixes from L1, with the window pool on. On the GPU itself,
tests/engine/test_gpu_windows.py runs them with graphs captured."""

from __future__ import annotations

import pytest
import torch

from harness.engine_cases import ids_of, tier_prompts
from harness.interpreted import run_interpreted
from harness.model_utils import hf_greedy, tiny_model
from serving.engine import Engine
from serving.scheduler.overlap import OverlapScheduler

GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}

GRAPHS_CODE = """
import sys, torch
from serving.engine import Engine
from serving.runner.cuda_graph_extend import extend_buckets
from serving.structs.forward_batch import ForwardBatch
from harness.model_utils import hf_greedy, tiny_model
from harness.engine_cases import prompts
path = tiny_model(sys.argv[1], sys.argv[2])
ps = prompts(3, 512, seed=7, lo=40, hi=60)  # 5-8 windows long
params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
ref = hf_greedy(path, ps, 6)
eng = Engine(model_path=str(path), page_size=4, max_total_tokens=1024, attention_backend="triton",
             context_length=256, device="cpu", dtype="float32", chunked_prefill_size=16,
             enable_hybrid_swa_memory=True, swa_full_tokens_ratio=0.25)
runner = eng.core.runner
pool = runner.pool
assert pool.windows is not None and pool.window_pages == 64
# the window pool holds different pages from the logical ones: reading a window page id as a logical one
# (or the reverse) reads other KV
runner.graphs = runner.make_graph_runner([1, 2, 4], capture=False)  # static buffers, eager forward
runner.extend_graphs = runner.make_extend_graph_runner(extend_buckets(32, 4), capture=False)
assert runner.graphs.win is not None and runner.extend_graphs.win is not None
static = runner.graphs.batches[4]
assert static.win.page_table.data_ptr() == runner.graphs.win.page_table.data_ptr()
assert static.win.seq_lens is static.seq_lens  # only the page table and the slots differ
# a batch without a window view is not a graph's (it falls back to the eager pass)
plain = ForwardBatch.build([([5], 3, [1])], 4)
assert not runner.graphs.can_run(plain)
seen = []  # the window slots each graph replay stored into: window pages, not logical ones
for g in (runner.graphs, runner.extend_graphs):
    run = g.run
    def spy(batch, run=run, g=g):
        assert batch.win is not None
        out = run(batch)
        t = batch.win.out_cache_loc.shape[0]
        assert torch.equal(g.win.out_cache_loc[:t], batch.win.out_cache_loc)
        seen.append(batch.win.out_cache_loc.tolist())
        return out
    g.run = spy
# a busy L1: the requests' logical pages lie above every window page id (a sliding layer that read its
# page table in logical pages would read and write outside the window pool, or other sequences' windows)
held = pool.allocator.alloc(150)
outs = eng.generate(input_ids=ps, sampling_params=params)
assert [o["output_ids"] for o in outs] == ref, ([o["output_ids"] for o in outs], ref)
assert runner.graphs.replays > 0 and runner.extend_graphs.replays > 0
assert seen and all(0 <= x < pool.window_pages * 4 or x == -1 for s in seen for x in s)
pool.allocator.free(held)
eng.check_integrity()
first = (runner.graphs.replays, runner.extend_graphs.replays)
# the same prompts plus a few tokens: the prefixes (and their last windows) come from L1
ps2 = [p + o["output_ids"] + [17 + i, 23, 42] for i, (p, o) in enumerate(zip(ps, outs))]
outs2 = eng.generate(input_ids=ps2, sampling_params=params)
assert [o["output_ids"] for o in outs2] == hf_greedy(path, ps2, 6)
assert all(o["meta_info"]["cached_tokens"] >= len(p) - 4 for o, p in zip(outs2, ps)), [o["meta_info"] for o in outs2]
assert runner.graphs.replays > first[0] and runner.extend_graphs.replays > first[1]
assert pool.windows.allocator.num_used < pool.allocator.num_used  # the tree keeps fewer window pages
eng.check_integrity()
eng.shutdown()
print("OK")
"""


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="an interpreter test for CPU machines; on CUDA, test_gpu_windows.py captures the graphs")
@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_graph_runners_with_the_window_pool_in_interpreter(tmp_path, arch: str) -> None:
    """Decode and extend batches (chunks of 16 mixed with decodes, suffixes over cached prefixes) through the
    graph runners' static buffers, the window view included, with the Triton backend under the interpreter:
    HF's greedy tokens, and the graphs' window slots are the batch's."""
    pytest.importorskip("triton")
    run_interpreted(GRAPHS_CODE.replace("sys.argv[1]", repr(str(tmp_path))).replace("sys.argv[2]", repr(arch)))


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_overlap_scheduling_with_the_window_pool(tmp_path, arch: str) -> None:
    """Overlap scheduling (on by default on CUDA; forced on here) with the window pool, chunks of 7 and
    concurrency: a request's window pages are trimmed while its next step is prepared; HF's tokens, cold
    and from L1."""
    path = tiny_model(tmp_path, arch)
    ps, _ = tier_prompts()
    ref = hf_greedy(path, ps, GREEDY["max_new_tokens"])
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=1024, dtype="float32",
                 enable_hybrid_swa_memory=True, swa_full_tokens_ratio=0.25, chunked_prefill_size=7)
    try:
        sched = eng.core.scheduler
        sched._overlap = ov = OverlapScheduler(sched)
        assert eng.core.runner.pool.windows is not None
        assert ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY)) == ref
        assert ov.overlapped_steps > 0
        again = eng.generate(input_ids=ps, sampling_params=GREEDY)
        assert ids_of(again) == ref and all(o["meta_info"]["cached_tokens"] > 0 for o in again)
        eng.check_integrity()
    finally:
        eng.shutdown()
