"""Extend (prefill) batches in CUDA graphs on a real GPU: the external-event semantics the per-layer
waits rely on, per-layer waits inside a replay, graphed vs eager logits on the 8B layer shapes, greedy
tokens graphed vs eager (fp32 and bf16) and under L2 loads.

Skipped without CUDA (tests/engine/test_gpu_paths.py and tests/kernels/test_kernels.py run the same logic on a CPU
under Triton's interpreter).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from harness.kernel_cases import rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ROOT = Path(__file__).resolve().parents[2]
SLEEP = 400_000_000  # torch.cuda._sleep cycles: ~0.2 s on an H200, far longer than any host step here


# -- the semantics GraphLayerWaits relies on ------------------------------------------------
LAUNCH_SEMANTICS_CODE = f"""
import time, torch
ev = torch.cuda.Event(external=True)
main, side = torch.cuda.current_stream(), torch.cuda.Stream()
ev.record(main)
src, dst = torch.zeros(4, device="cuda"), torch.full((4,), -1.0, device="cuda")
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    torch.cuda._sleep({SLEEP})  # the wait node runs only after this
    torch.cuda.current_stream().wait_event(ev)
    dst.copy_(src)
# 1. an external wait node waits for the record made before the launch
with torch.cuda.stream(side):
    torch.cuda._sleep({SLEEP})
    src.fill_(1.0)
    ev.record(side)
graph.replay()
torch.cuda.synchronize()
assert bool((dst == 1.0).all()), dst
# 2. a record made after the launch (here: behind the replay itself) does not move its wait: with
#    wait nodes that resolved the event when they run, this would never finish
graph.replay()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    src.fill_(2.0)
    ev.record(side)
done = torch.cuda.Event()
done.record(side)
t0 = time.time()
while not done.query():
    assert time.time() - t0 < 20, "DEADLOCK: the wait node waited for a record made after the launch"
    time.sleep(0.01)
print("OK")
"""


def test_graph_event_wait_node_waits_for_the_record_at_launch():
    """An external event-wait node in a graph waits for the event's latest record at the launch
    (as cudaStreamWaitEvent does at its call), so GraphLayerWaits can re-arm the events for the next
    replay while an earlier one still runs. In a child process: a deadlock fails the test, not the run."""
    res = subprocess.run([sys.executable, "-c", LAUNCH_SEMANTICS_CODE], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert res.returncode == 0 and "OK" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


def test_graph_layer_waits_wait_per_layer_inside_a_replay():
    """Layer 0's data lands at once, layer 1's behind a GPU sleep; a replay armed with those events
    finishes layer 0 (an external record node) while layer 1's data is still on its way, and then
    reads both correctly."""
    from serving.structs.forward_batch import GraphLayerWaits, LayerWaits

    waits = GraphLayerWaits.create(2, torch.device("cuda"))
    assert waits is not None, "this PyTorch has no external events (torch.cuda.Event(external=True))"
    data = torch.zeros(2, 1024, device="cuda")
    out = torch.full((2, 1024), -1.0, device="cuda")
    layer0_done = torch.cuda.Event(external=True)
    layer0_done.record()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        waits.before_layer(0)
        out[0].copy_(data[0])
        layer0_done.record()
        waits.before_layer(1)
        out[1].copy_(data[1])
    side = torch.cuda.Stream()
    ev0, ev1 = torch.cuda.Event(), torch.cuda.Event()
    with torch.cuda.stream(side):
        data[0].fill_(3.0)
        ev0.record(side)
        torch.cuda._sleep(SLEEP)
        data[1].fill_(4.0)
        ev1.record(side)
    waits.arm(LayerWaits([[ev0, ev1]]))
    graph.replay()
    t0 = time.time()
    while not layer0_done.query():
        assert time.time() - t0 < 10, "layer 0 of the replay never ran"
        time.sleep(0.001)
    assert not ev1.query(), "layer 0 finished only after layer 1's data had landed (waited for all)"
    torch.cuda.synchronize()
    assert bool((out[0] == 3.0).all()) and bool((out[1] == 4.0).all())
    assert waits.armed == 1


# -- the model: graphed vs eager -------------------------------------------------------------
def _runner_8b_shape(tmp_path, **model_kw):
    from serving.config import ModelConfig, SchedulerConfig
    from serving.runner.model_runner import ModelRunner

    cfg = dict(architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, max_position_embeddings=8192,
               rope_theta=500000.0, rms_norm_eps=1e-5)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return ModelRunner(ModelConfig(model_path=str(tmp_path), load_format="dummy", cuda_graph_max_bs=16, **model_kw),
                       SchedulerConfig(max_total_tokens=16384), 16)


def test_extend_graph_logits_equal_eager_8b_shape(tmp_path):
    """8B layer shapes (2 layers), bf16: extend batches over prefixes in L1 (one request with 16 new
    tokens over a 4k prefix, the TTFT case; four ragged ones) replay extend graphs and give the eager
    logits; the padding stores no KV."""
    from serving.structs.forward_batch import ForwardBatch

    runner = _runner_8b_shape(tmp_path)
    ext = runner.extend_graphs
    assert ext is not None and len(ext.graphs) == len(ext.buckets) and ext.waits is not None
    print(f"captured {len(ext.graphs)} extend graphs in {ext.capture_s:.2f} s")
    g = torch.Generator().manual_seed(0)
    page = 1
    for lens, new in (([4096], [16]), ([5, 1030, 64, 300], [9, 1, 40, 3])):
        seqs = []
        for n, k in zip(lens, new, strict=True):
            pages = list(range(page, page + (n + k) // 16 + 1))
            page += len(pages)
            seqs.append((torch.randint(0, 32000, (n,), generator=g).tolist(), pages))
        runner.forward(ForwardBatch.build([(ids, 0, p) for ids, p in seqs], 16, "cuda"))  # prefixes (eager)
        fb = ForwardBatch.build([(torch.randint(0, 32000, (k,), generator=g).tolist(), len(ids), p)
                                 for k, (ids, p) in zip(new, seqs, strict=True)], 16, "cuda")
        assert ext.can_run(fb)
        kv_before = runner.pool.kv_buffer.clone()
        replays = ext.replays
        graph_logits = runner.forward(fb).clone()
        assert ext.replays == replays + 1
        changed = (runner.pool.kv_buffer != kv_before).view(2, 2, -1, 8 * 128).any(-1).any(0).any(0)
        assert changed.nonzero().flatten().tolist() == sorted(fb.out_cache_loc.tolist())
        runner.pool.kv_buffer.copy_(kv_before)
        eager = runner._forward_eager(fb)
        err = rel_err(graph_logits, eager)
        print(f"{len(lens)} sequences, {sum(new)} new tokens: graph vs eager logits relative error {err:.2e}")
        assert err < 1e-2
        torch.cuda.synchronize()
        for name, fn in (("graph", lambda b=fb: runner.forward(b)), ("eager", lambda b=fb: runner._forward_eager(b))):
            t0 = time.perf_counter()
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            print(f"  {name}: {(time.perf_counter() - t0) / 5 * 1e3:.2f} ms per forward (2 layers)")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from harness.engine_cases import GREEDY, prompts
    from harness.model_utils import hf_greedy, tiny_model

    path = tiny_model(tmp_path_factory.mktemp("gpu-extend"))
    ps = prompts(8, 512, seed=13, lo=3, hi=90)
    return path, ps, hf_greedy(path, ps, GREEDY["max_new_tokens"])


def _generate_twice(path, ps, dtype: str, graph: bool) -> tuple[list, list, object]:
    """Greedy tokens of ``ps`` and of longer prompts whose prefixes are then cached in L1."""
    from harness.engine_cases import GREEDY, ids_of
    from serving.engine import Engine

    eng = Engine(model_path=str(path), dtype=dtype, page_size=4, max_total_tokens=8192, cuda_graph_max_bs=8,
                 disable_cuda_graph=not graph, chunked_prefill_size=64)
    first = ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY))
    more = [p + out + [5 + i, 9, 11] for i, (p, out) in enumerate(zip(ps, first, strict=True))]
    second = ids_of(eng.generate(input_ids=more, sampling_params=GREEDY))
    runner = eng.core.runner
    stats = (runner.extend_graphs.replays if runner.extend_graphs is not None else 0), more
    eng.check_integrity()
    eng.shutdown()
    return first, second, stats


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_extend_graphs_greedy_equal_eager(tiny, dtype):
    """Prompts (chunks of 64 mixed with decodes) and then their continuations (suffix extends over L1
    prefixes): the same greedy tokens with extend graphs as eagerly; fp32 also equals HF."""
    from harness.engine_cases import GREEDY
    from harness.model_utils import hf_greedy

    path, ps, ref = tiny
    g_first, g_second, (replays, more) = _generate_twice(path, ps, dtype, graph=True)
    e_first, e_second, _ = _generate_twice(path, ps, dtype, graph=False)
    assert replays > 0
    if dtype == "float32":
        assert g_first == ref == e_first
        assert g_second == e_second == hf_greedy(path, more, GREEDY["max_new_tokens"])
        return
    # bf16: GEMMs over a padded batch round differently from the unpadded one (attention does not);
    # the tiny model's wide logit margins keep greedy tokens equal (a near-tie may flip one sequence)
    pairs = zip(g_first + g_second, e_first + e_second, strict=True)
    same = sum(a == b for x, y in pairs for a, b in zip(x, y, strict=True))
    total = sum(len(x) for x in g_first + g_second)
    print(f"bf16 graphed vs eager: {same}/{total} tokens equal")
    assert same >= 0.9 * total


def test_extend_graph_waits_per_layer_for_a_layered_l2_load(tiny):
    """An extend batch whose prefix pages are still being loaded from pinned L2 (a layered load on a
    side stream held behind a GPU sleep; the pages hold zeros until it lands) replays its graph armed
    with the load's per-layer events, without a host wait, and gives the logits of an eager pass run
    after the load: without the waits the graph would read the zeros."""
    from hicache.tiers.host import make_host_pool
    from serving.config import ModelConfig, SchedulerConfig
    from serving.kernels.page_copy import PageMover
    from serving.runner.model_runner import ModelRunner
    from serving.structs.forward_batch import ForwardBatch, LayerWaits

    path, ps, _ = tiny
    runner = ModelRunner(ModelConfig(model_path=str(path), dtype="float32", cuda_graph_max_bs=8),
                         SchedulerConfig(max_total_tokens=2048), 4)
    ext = runner.extend_graphs
    assert ext is not None and ext.waits is not None
    host = make_host_pool("layer_first", runner.pool.layout, 128, 4)
    mover = PageMover(runner.pool.kv_buffer, host)
    assert mover.use_kernel
    prompts = [ps[0], ps[1]]
    src = [list(range(1 + 40 * i, 1 + 40 * i + -(-len(p) // 4))) for i, p in enumerate(prompts)]
    runner.forward(ForwardBatch.build([(p, 0, pages) for p, pages in zip(prompts, src, strict=True)], 4, "cuda"))
    flat_src = [pg for pages in src for pg in pages]
    mover.device_to_host(flat_src, list(range(len(flat_src))))
    mover.synchronize()
    # the pages come back into other pages, zeroed first; the last 2 tokens of each prompt are new
    dst = [list(range(100 + 40 * i, 100 + 40 * i + len(pages))) for i, pages in enumerate(src)]
    flat_dst = [pg for pages in dst for pg in pages]
    runner.pool.kv_buffer[:, :, flat_dst] = 0
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP)
        events = mover.host_to_device_layered(list(range(len(flat_src))), flat_dst)
    fb = ForwardBatch.build([(p[-2:], len(p) - 2, pages) for p, pages in zip(prompts, dst, strict=True)], 4, "cuda")
    fb.layer_waits = LayerWaits([events])
    assert ext.can_run(fb)
    armed = ext.waits.armed
    kv_before = runner.pool.kv_buffer.clone()  # zeros in the loading pages (the host did not wait)
    graph_logits = runner.forward(fb).clone()
    assert ext.waits.armed == armed + 1
    assert not events[-1].query(), "the load landed before the replay was even queued: the test proves nothing"
    torch.cuda.synchronize()
    assert bool((kv_before[:, :, flat_dst] == 0).all())
    eager = runner._forward_eager(fb)  # the load has landed; the new tokens' KV is rewritten alike
    err = rel_err(graph_logits, eager)
    print(f"graph under a layered load vs eager after it: relative error {err:.2e}")
    assert err < 1e-5


def test_extend_graphs_under_l2_loads_match_cold_run(tiny):
    """Prompts pushed out of L1 come back from L2 (the load stream held behind a GPU sleep, so their
    extends may run while it lands): greedy tokens equal the cold run's, with extend graphs on."""
    from harness.engine_cases import GREEDY, ids_of, prompts
    from serving.engine import Engine

    path, ps, ref = tiny
    eng = Engine(model_path=str(path), dtype="float32", page_size=4, max_total_tokens=320, hicache_ratio=4.0,
                 max_running_requests=8, cuda_graph_max_bs=8)
    ext = eng.core.runner.extend_graphs
    assert ext is not None
    assert ids_of(eng.generate(input_ids=ps[:4], sampling_params=GREEDY)) == ref[:4]
    eng.generate(input_ids=prompts(10, 512, seed=99, lo=40, hi=60), sampling_params=GREEDY)  # out of L1
    loaded, replays = eng.core.controller.pages_loaded, ext.replays
    with torch.cuda.stream(eng.core.controller._stream):
        torch.cuda._sleep(SLEEP)  # the loads queue behind this
    again = eng.generate(input_ids=ps[:4], sampling_params=GREEDY)
    assert ids_of(again) == ref[:4]
    assert eng.core.controller.pages_loaded > loaded
    assert sum(o["meta_info"]["cached_tokens_details"]["host"] for o in again) > 0
    assert ext.replays > replays
    print(f"replays armed with load events: {ext.waits.armed if ext.waits else None}")
    eng.check_integrity()
    eng.shutdown()


def test_l1_l2_l3_and_restart_hits_with_extend_graphs_equal_hf_fp32(tiny, tmp_path):
    """fp32 on the GPU, graphs (decode and extend) and overlap on: prompts cold, then from L1, from
    L2 (L1 emptied), and from L3 after a restart (a new engine on the same LMDB): every time the
    greedy tokens of HF transformers, and the hits come from the tier they should."""
    from harness.engine_cases import GREEDY, ids_of
    from serving.engine import Engine

    path, ps, ref = tiny
    ps, ref = ps[:4], ref[:4]
    db = tmp_path / "l3"

    def make() -> Engine:
        return Engine(model_path=str(path), dtype="float32", page_size=4, max_total_tokens=4096,
                      hicache_ratio=2.0, max_running_requests=1, hicache_storage_backend="lmdb",
                      hicache_storage_backend_extra_config={"path": str(db), "capacity_gb": 0.05, "initial_map_mb": 1},
                      hicache_storage_prefetch_policy="wait_complete", hicache_storage_prefetch_threshold=8,
                      hicache_storage_prefetch_timeout_base=5.0, hicache_storage_load_policy="always_load")

    def tier_hits(outs, tier):
        return [o["meta_info"]["cached_tokens_details"][tier] for o in outs]

    eng = make()
    assert eng.core.runner.extend_graphs is not None and eng.core.scheduler._overlap is not None
    assert ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY)) == ref  # cold
    l1 = eng.generate(input_ids=ps, sampling_params=GREEDY)
    assert ids_of(l1) == ref and all(h > 0 for h in tier_hits(l1, "device"))
    tree = eng.core.tree
    tree.evict_device(tree.cached_pages("device"))  # everything down to L2
    eng.core.req_cache.flush_transfers()
    l2 = eng.generate(input_ids=ps, sampling_params=GREEDY)
    assert ids_of(l2) == ref and all(h > 0 for h in tier_hits(l2, "host"))
    eng.core.storage.poll(wait=True)
    assert eng.core.storage.pages_written > 0
    replays = eng.core.runner.extend_graphs.replays
    assert replays > 0
    eng.check_integrity()
    eng.shutdown()
    eng = make()  # a restart: L1 and L2 empty, LMDB holds the pages
    l3 = eng.generate(input_ids=ps, sampling_params=GREEDY)
    assert ids_of(l3) == ref and all(h > 0 for h in tier_hits(l3, "storage")), tier_hits(l3, "storage")
    assert eng.core.runner.extend_graphs.replays > 0
    assert eng.core.storage.tier.stats()["corrupt"] == 0
    eng.check_integrity()
    eng.shutdown()
