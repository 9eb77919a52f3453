"""The GPU path on a real GPU: the page-move kernel through pinned memory, CUDA graphs against
eager, greedy tokens equal to HF transformers (fp32) with graphs and overlap scheduling on, fused
kernels on a whole model, L2 load-back, fp8 checkpoints, and shutdown giving the GPU back. The
kernels alone (Triton attention in bf16, the fused per-layer kernels, fp8) are
tests/kernels/test_gpu_kernels.py.

Skipped without CUDA (tests/engine/test_gpu_paths.py runs the same logic on a CPU).
"""

from __future__ import annotations

import json

import pytest
import torch

from harness.kernel_cases import rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# -- page moves ----------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_page_mover_kernel_round_trip(layout):
    from hicache.tiers.device import DeviceKVPool, KVLayout
    from hicache.tiers.host import make_host_pool
    from serving.kernels.page_copy import PageMover

    lay = KVLayout(4, 8, 128, torch.bfloat16)
    pool = DeviceKVPool(lay, 64, 16, "cuda")
    pool.kv_buffer.normal_()
    host = make_host_pool(layout, lay, 80, 16)
    assert host.buffer.is_pinned()
    mover = PageMover(pool.kv_buffer, host)
    assert mover.use_kernel
    g = torch.Generator().manual_seed(1)
    src = torch.randperm(64, generator=g)[:40].tolist()
    dst = torch.randperm(80, generator=g)[:40].tolist()
    before = pool.kv_buffer.clone()
    mover.device_to_host(src, dst)
    mover.synchronize()
    flat = before.view(2 * 4, 64, -1).cpu()
    got = host.read_pages(torch.tensor(dst))
    assert torch.equal(got, flat[:, src])
    pool.kv_buffer.zero_()
    back = torch.randperm(64, generator=g)[:40].tolist()
    with torch.cuda.stream(torch.cuda.Stream()):  # like the controller: loads on a side stream
        mover.host_to_device(dst, back, non_blocking=True)
        torch.cuda.current_stream().synchronize()
    assert torch.equal(pool.kv_buffer.view(8, 64, -1)[:, back].cpu(), flat[:, src])


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_layered_load_waits_per_layer_on_the_gpu(layout):
    """A layered load on a side stream that is held back (a GPU sleep): the main stream's
    reads of layer i, queued behind LayerWaits.before_layer(i), still see the loaded KV."""
    from hicache.tiers.device import DeviceKVPool, KVLayout
    from hicache.tiers.host import make_host_pool
    from serving.kernels.page_copy import PageMover
    from serving.structs.forward_batch import LayerWaits

    lay = KVLayout(6, 8, 128, torch.bfloat16)
    pool = DeviceKVPool(lay, 64, 16, "cuda")
    host = make_host_pool(layout, lay, 64, 16)
    host.buffer.normal_()
    mover = PageMover(pool.kv_buffer, host)
    src, dst = list(range(10, 50)), list(range(3, 43))
    want = host.read_pages(torch.tensor(src)).view(2, 6, 40, -1)  # [K/V, layer, page, X]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s: without the waits the reads below see zeros
        events = mover.host_to_device_layered(src, dst)
    assert len(events) == 6
    waits = LayerWaits([events])
    got = []
    for layer in range(6):
        waits.before_layer(layer)
        got.append(pool.kv_buffer[:, layer, dst].clone())  # [2, pages, ps, H, D], on the main stream
    torch.cuda.synchronize()
    for layer in range(6):
        assert torch.equal(got[layer].view(2, 40, -1).cpu(), want[:, layer])


def test_engine_layered_l2_loads_under_concurrency(tiny):
    """Requests that share a prefix being loaded back from L2 run in the same step as the load
    (their forward waits per layer on the GPU): greedy tokens equal the cold run's."""
    from harness.engine_cases import GREEDY, ids_of
    from serving.engine import Engine

    path, ps, ref = tiny
    eng = Engine(model_path=str(path), dtype="float32", page_size=4, max_total_tokens=320, hicache_ratio=4.0,
                 max_running_requests=8, cuda_graph_max_bs=8)
    assert ids_of(eng.generate(input_ids=ps[:4], sampling_params=GREEDY)) == ref[:4]
    eng.generate(input_ids=ps[4:], sampling_params=GREEDY)  # pushes the first prompts out of L1
    before = eng.core.controller.pages_loaded
    again = eng.generate(input_ids=ps[:4] * 2, sampling_params=GREEDY)  # each prefix matched twice at once
    assert ids_of(again) == ref[:4] * 2
    assert eng.core.controller.pages_loaded > before
    eng.check_integrity()
    eng.shutdown()


def test_backup_is_ordered_after_queued_kv_writes():
    """A backup issued right after a (queued, not yet run) write of the page sees the write."""
    from hicache.tiers.device import DeviceKVPool, KVLayout
    from hicache.tiers.host import make_host_pool
    from serving.kernels.page_copy import PageMover

    lay = KVLayout(8, 8, 128, torch.bfloat16)
    pool = DeviceKVPool(lay, 16, 16, "cuda")
    host = make_host_pool("layer_first", lay, 16, 16)
    mover = PageMover(pool.kv_buffer, host)
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # keep the stream busy so the write below is still queued
        big = big @ big / 64
    pool.kv_buffer[:, :, 3].fill_(2.5)
    mover.device_to_host([3], [9])
    pool.kv_buffer[:, :, 3].fill_(-1.0)  # after the backup, on the model's stream
    mover.synchronize()
    assert bool((host.read_pages(torch.tensor([9])) == 2.5).all())


# -- models --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from harness.engine_cases import GREEDY, prompts
    from harness.model_utils import hf_greedy, tiny_model

    path = tiny_model(tmp_path_factory.mktemp("gpu"))
    ps = prompts(12, 512, seed=7, lo=3, hi=90)
    return path, ps, hf_greedy(path, ps, GREEDY["max_new_tokens"])


def test_overlap_runs_no_decode_after_a_request_s_last_token(tiny):
    """A request whose pending token ends it by length gets no overlapped decode: a one-token
    request is one forward pass (the extra decode cost an L1 hit a second one), and a batch of
    n-token requests runs n passes; tokens unchanged."""
    from harness.engine_cases import GREEDY, ids_of
    from serving.engine import Engine

    path, ps, ref = tiny
    eng = Engine(model_path=str(path), dtype="float32", page_size=4, max_total_tokens=8192)
    assert eng.core.scheduler._overlap is not None
    stats = eng.core.scheduler.stats
    before = stats.forward_passes
    one = eng.generate(input_ids=ps[0], sampling_params={**GREEDY, "max_new_tokens": 1})
    assert stats.forward_passes - before == 1 and one["output_ids"] == ref[0][:1]
    before = stats.forward_passes
    outs = eng.generate(input_ids=ps[:4], sampling_params={**GREEDY, "max_new_tokens": 5})
    assert stats.forward_passes - before == 5 and ids_of(outs) == [r[:5] for r in ref[:4]]
    eng.check_integrity()
    eng.shutdown()


@pytest.mark.parametrize("graph,overlap", [(True, True), (False, False), (True, False), (False, True)])
def test_greedy_matches_hf_fp32(tiny, graph, overlap):
    from harness.engine_cases import GREEDY, ids_of
    from serving.engine import Engine

    path, ps, ref = tiny
    eng = Engine(model_path=str(path), dtype="float32", page_size=4, max_total_tokens=8192,
                 disable_cuda_graph=not graph, disable_overlap_schedule=not overlap, cuda_graph_max_bs=8)
    assert eng.core.runner.attn.name == "triton"
    assert (eng.core.runner.graphs is not None) == graph
    assert (eng.core.scheduler._overlap is not None) == overlap
    outs = eng.generate(input_ids=ps, sampling_params=GREEDY)  # 12 requests: 8 in graphs, more eager
    assert ids_of(outs) == ref
    again = eng.generate(input_ids=ps[:5], sampling_params=GREEDY)  # cached prefixes, padded graph batch
    assert ids_of(again) == ref[:5]
    if graph:
        assert eng.core.runner.graphs.replays > 0
    eng.check_integrity()
    eng.shutdown()


def test_cuda_graph_logits_equal_eager(tmp_path):
    """The 8B-like layer shapes (2 layers), bf16: a graph replay gives the eager logits."""
    from serving.config import ModelConfig, SchedulerConfig
    from serving.runner.model_runner import ModelRunner
    from serving.structs.forward_batch import ForwardBatch

    cfg = dict(architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096,
               rope_theta=500000.0, rms_norm_eps=1e-5)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    runner = ModelRunner(ModelConfig(model_path=str(tmp_path), load_format="dummy", cuda_graph_max_bs=16),
                         SchedulerConfig(max_total_tokens=4096), 16)
    assert runner.graphs is not None
    g = torch.Generator().manual_seed(0)
    lens = [5, 33, 120, 17, 64]
    seqs, page = [], 1
    for n in lens:  # prefill each sequence, then one decode step
        pages = list(range(page, page + n // 16 + 1))
        page += len(pages)
        seqs.append((torch.randint(0, 32000, (n,), generator=g).tolist(), pages))
    runner.forward(ForwardBatch.build([(ids, 0, p) for ids, p in seqs], 16, "cuda"))
    dec = ForwardBatch.build([([7 + i], len(ids), p) for i, (ids, p) in enumerate(seqs)], 16, "cuda")
    kv_before = runner.pool.kv_buffer.clone()
    graph_logits = runner.forward(dec).clone()
    assert runner.graphs.replays == 1
    # the padding rows (5 -> 8) stored no KV: exactly the 5 new slots changed
    changed = (runner.pool.kv_buffer != kv_before).view(2, 2, -1, 8 * 128).any(-1).any(0).any(0)
    assert changed.nonzero().flatten().tolist() == sorted(dec.out_cache_loc.tolist())
    runner.pool.kv_buffer.copy_(kv_before)
    eager = runner._forward_eager(dec)
    err = rel_err(graph_logits, eager)
    print(f"graph vs eager logits: relative error {err:.2e}")
    assert err < 1e-2


def test_engine_l2_on_gpu_matches_l1_only(tiny):
    """KV demoted to pinned L2 and loaded back by the page-move kernel: same greedy tokens."""
    from harness.engine_cases import GREEDY, ids_of
    from serving.engine import Engine

    path, ps, ref = tiny
    for layout in ("layer_first", "page_first"):
        eng = Engine(model_path=str(path), dtype="float32", page_size=4, max_total_tokens=320, hicache_ratio=4.0,
                     hicache_mem_layout=layout, max_running_requests=3, cuda_graph_max_bs=4)
        assert eng.core.controller._backup_mover.use_kernel
        first = eng.generate(input_ids=ps[:4], sampling_params=GREEDY)
        assert ids_of(first) == ref[:4]
        eng.generate(input_ids=ps[4:], sampling_params=GREEDY)  # pushes the first prompts out of L1
        again = eng.generate(input_ids=ps[:4], sampling_params=GREEDY)
        assert ids_of(again) == ref[:4]
        assert eng.core.controller.pages_loaded > 0
        assert sum(o["meta_info"]["cached_tokens_details"]["host"] for o in again) > 0
        eng.check_integrity()
        eng.shutdown()


def test_fused_model_logits_match_unfused(tiny):
    """Whole tiny model in fp32 on CUDA: fused kernels on vs off, same logits."""
    from hicache.tiers.device import DeviceKVPool
    from serving.kernels import triton_fused as tf
    from serving.kernels.attention_triton import TritonAttentionBackend
    from serving.models.loader import load_model
    from serving.structs.forward_batch import ForwardBatch

    path, ps, _ = tiny
    model, arch = load_model(path, device="cuda")
    out = {}
    for enabled in (True, False):
        tf.ENABLED = enabled
        try:
            pool = DeviceKVPool(arch.kv_layout(torch.float32), 64, 4, "cuda")
            fb = ForwardBatch.build([(ps[0], 0, list(range(1, 1 + -(-len(ps[0]) // 4))))], 4, "cuda")
            out[enabled] = model(fb, pool, TritonAttentionBackend())
        finally:
            tf.ENABLED = True
    assert rel_err(out[True], out[False]) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs an fp8 GPU")
def test_fp8_checkpoint_serves_with_fp8_weights(tmp_path):
    """An HF fp8 checkpoint (per-channel weight_scale) under --quantization fp8 gives the tokens of
    its dequantized float checkpoint under --quantization fp8 (the same e4m3 codes either way)."""
    from harness.fp8_checkpoint import dequantized_twin, fp8_checkpoint, greedy_tokens
    from harness.model_utils import tiny_model

    src = tiny_model(tmp_path / "float", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                     num_key_value_heads=2)
    deq = fp8_checkpoint(src, tmp_path / "fp8", "channel")
    outs = greedy_tokens([tmp_path / "fp8", dequantized_twin(src, tmp_path / "plain", deq)], quantization="fp8")
    assert outs[0] == outs[1] and len(outs[0][0]) == 12


# -- shutdown gives the device back (issue 27) -----------------------------------------------
def test_engine_shutdown_frees_the_gpu_and_a_second_engine_gets_the_same_capacity(tmp_path):
    """L1 sized from the GPU's free memory, L2 pinned in the background: after shutdown() the GPU
    memory and the pinned pages are back, and a second Engine gets the capacity the first had
    (it got 16 tokens of L1 before)."""
    import time

    from hicache.sizing import HostMemory
    from serving.engine import Engine

    shape = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
             "intermediate_size": 1024, "num_hidden_layers": 32, "num_attention_heads": 8, "num_key_value_heads": 8,
             "head_dim": 128, "vocab_size": 1024, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(shape))  # 128 KiB of KV per token: ~60k pages of L1
    prompts = [[(11 * i + j) % 1000 + 3 for j in range(100 + 10 * i)] for i in range(4)]
    greedy = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    host_before = HostMemory.probe().available
    caps, outs = [], []
    for _ in range(2):
        eng = Engine(model_path=str(tmp_path), load_format="dummy", page_size=16, hicache_size=4.0,
                     max_running_requests=4, cuda_graph_max_bs=4, grammar_backend="none")
        host = eng.core.host_pool
        caps.append((eng.core.runner.pool.num_pages, host.num_pages))
        outs.append([o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=greedy)])
        deadline = time.monotonic() + 120
        while not host.pinner.done:  # the background pinning finishes; its pages join L2 at the next step
            assert time.monotonic() < deadline
            time.sleep(0.05)
        eng.generate(input_ids=prompts[:1], sampling_params=greedy)
        assert host.allocator.available == host.num_pages and host.buffer.is_pinned()
        eng.check_integrity()
        eng.shutdown()
        torch.cuda.synchronize()
        free_after = torch.cuda.mem_get_info()[0]
        assert free_after >= free_before - 512 * 2**20, (free_before, free_after)  # loaded kernels at most
        assert HostMemory.probe().available >= host_before - 2 * 2**30  # the 4 GiB of pinned L2 went back
    (l1_a, l2_a), (l1_b, l2_b) = caps
    print("capacities (L1 pages, L2 pages):", caps)
    assert l2_a == l2_b and abs(l1_a - l1_b) <= l1_a // 100, caps
    assert outs[0] == outs[1]
