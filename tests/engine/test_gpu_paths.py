"""The GPU path's logic, exercised on a CPU: overlap scheduling (forced on), the page-move
kernel and the CUDA-graph runner's static buffers and padding (both under Triton's
interpreter, in a child process). On the GPU itself, tests/engine/test_gpu.py runs them for real.
"""

from __future__ import annotations

import pytest

from harness.engine_cases import GREEDY, ids_of, prompts
from harness.interpreted import run_interpreted
from harness.model_utils import hf_greedy, tiny_model
from serving.engine import Engine
from serving.scheduler.overlap import OverlapScheduler


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tiny_model(tmp_path_factory.mktemp("overlap"))
    ps = prompts(6, 512, seed=11, lo=3, hi=50)
    return path, ps, hf_greedy(path, ps, GREEDY["max_new_tokens"])


def overlapped(eng: Engine) -> OverlapScheduler:
    sched = eng.core.scheduler
    sched._overlap = OverlapScheduler(sched)
    return sched._overlap


@pytest.mark.parametrize("kw", [
    {},
    {"chunked_prefill_size": 7},
    {"max_total_tokens": 96, "max_running_requests": 4},  # preemption: retracts while tokens are pending
    {"max_total_tokens": 160, "hicache_ratio": 4.0, "max_running_requests": 2},  # L2 backups / loads
], ids=["plain", "chunked", "retract", "l2"])
def test_overlap_greedy_matches_hf(tiny, kw):
    path, ps, ref = tiny
    kw = {"page_size": 4, "max_total_tokens": 4096, "dtype": "float32", **kw}  # fp32 on CUDA too (auto: bf16)
    eng = Engine(model_path=str(path), **kw)
    ov = overlapped(eng)
    outs = eng.generate(input_ids=ps, sampling_params=GREEDY)
    assert ids_of(outs) == ref
    assert ov.overlapped_steps > 0
    again = eng.generate(input_ids=ps, sampling_params=GREEDY)  # prefixes cached now
    assert ids_of(again) == ref
    for o in outs:
        assert o["meta_info"]["finish_reason"] == {"type": "length", "length": GREEDY["max_new_tokens"]}
    eng.check_integrity()
    assert not any(r.pending >= 0 for r in eng.core.scheduler.running)
    assert ov.released_early == 2 * len(ps)  # each one's KV went back as its last decode was launched
    eng.shutdown()


def test_a_last_pass_gives_its_pages_back_at_launch(tiny):
    """Overlap scheduling: one-token requests that do not fit in L1 together. Each one's pages go back as its
    pass is launched (its token ends it whatever it is), so the next one is admitted in the very next step,
    while that pass would still run on a GPU; no step in between plans an empty batch and only waits for the
    token (a returning turn ran admit, wait, admit, wait). Outputs as HF's."""
    path, ps, ref = tiny
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=64, dtype="float32")
    ov = overlapped(eng)
    core = eng.core
    reqs = [core.make_request(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 1}) for p in ps]
    for r in reqs:
        core.add(r)
    steps = passes = 0
    while core.scheduler.has_work:
        before = core.scheduler.stats.forward_passes
        core.step()
        core.check_integrity()
        steps += 1
        passes += core.scheduler.stats.forward_passes - before
        assert core.scheduler.in_use_pages() <= 16
    assert passes >= 4  # they did not fit together (64 tokens: 16 pages of 4)
    assert steps <= passes + 1, (steps, passes)  # one more: the last token's
    assert [r.output_ids for r in reqs] == [out[:1] for out in ref]
    assert ov.released_early == len(ps)
    eng.shutdown()


def test_a_placeholder_of_no_previous_row_is_refused_on_the_host():
    """A batch whose placeholder names a row the previous step does not have fails on the host
    (on a GPU the gather's device-side bounds check would end the whole CUDA context)."""
    import torch

    from serving.scheduler.overlap import _Launched
    from serving.structs.forward_batch import ForwardBatch

    ov = OverlapScheduler(None)
    fb = ForwardBatch.build([([5, 6, -1 - 2], 0, [0])], 4, "cpu")  # the token of row 2 of the previous step
    with pytest.raises(RuntimeError, match="row 2 of the previous step's tokens, which has 0 rows"):
        ov.prepare(fb)
    tokens = torch.tensor([7, 8])
    ov.prev = _Launched(tokens, tokens, None, [object(), object()])  # two rows
    with pytest.raises(RuntimeError, match="which has 2 rows"):
        ov.prepare(fb)
    ok = ForwardBatch.build([([5, 6, -1 - 1], 0, [0])], 4, "cpu")
    assert ov.prepare(ok).input_ids.tolist() == [5, 6, 8]


def test_overlap_stops_one_step_late_but_outputs_are_exact(tiny):
    """Stop tokens and max_new_tokens land on the same token as without overlap."""
    path, ps, ref = tiny
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=4096, dtype="float32")
    overlapped(eng)
    params = [{"temperature": 0, "max_new_tokens": 3 + i, "ignore_eos": True} for i in range(len(ps))]
    params[0] = {"temperature": 0, "max_new_tokens": 12, "stop_token_ids": [ref[0][4]]}
    outs = eng.generate(input_ids=ps, sampling_params=params)
    assert outs[0]["output_ids"] == ref[0][:5]
    assert outs[0]["meta_info"]["finish_reason"]["type"] == "stop"
    for i in range(1, len(ps)):
        assert outs[i]["output_ids"] == ref[i][: 3 + i]
    eng.check_integrity()


def test_overlap_falls_back_for_sampled_requests(tiny):
    """A seeded sampled request gives the same tokens with and without overlap (the step
    resolves pending tokens first and samples on the host)."""
    path, ps, ref = tiny
    sampled = {"temperature": 0.8, "top_p": 0.9, "seed": 5, "max_new_tokens": 8, "ignore_eos": True}
    plain = Engine(model_path=str(path), page_size=4, max_total_tokens=4096, dtype="float32")
    want = plain.generate(input_ids=ps[:2], sampling_params=[GREEDY, sampled])
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=4096, dtype="float32")
    overlapped(eng)
    got = eng.generate(input_ids=ps[:2], sampling_params=[GREEDY, sampled])
    assert ids_of(got) == ids_of(want)
    assert got[0]["output_ids"] == ref[0]


def test_overlap_abort_while_pending(tiny):
    path, ps, _ = tiny
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=4096, dtype="float32")
    ov = overlapped(eng)
    core = eng.core
    reqs = [core.make_request(input_ids=p, sampling_params=GREEDY) for p in ps[:3]]
    for r in reqs:
        core.add(r)
    core.step()
    assert ov.prev is not None and all(r.pending >= 0 for r in reqs)
    core.scheduler.abort(reqs[1].rid)
    while not all(r.finished for r in reqs):
        core.step()
    assert reqs[1].finish_reason["type"] == "abort"
    assert len(reqs[0].output_ids) == GREEDY["max_new_tokens"]
    eng.check_integrity()


PAGE_MOVE_CODE = """
import torch
from serving.kernels.page_copy_triton import move_pages
g = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    dev = torch.randn(2 * 3, 9, 40, generator=g).to(dtype)          # [2L, P, X]
    for page_dim in (0, 1):
        shape = (7, 6, 40) if page_dim == 0 else (6, 7, 40)
        host = torch.full(shape, -7.0, dtype=dtype)
        src, dst = torch.tensor([4, 0, 8]), torch.tensor([6, 2, 3])
        move_pages(dev, 1, src, host, page_dim, dst, block=16)         # X=40: masked tail
        view = host if page_dim == 1 else host.transpose(0, 1)
        assert torch.equal(view[:, [6, 2, 3]], dev[:, [4, 0, 8]])
        assert (view[:, [0, 1, 4, 5]] == -7).all()
        back = torch.zeros_like(dev)
        move_pages(host, page_dim, dst, back, 1, torch.tensor([1, 5, 7]), block=64)
        assert torch.equal(back[:, [1, 5, 7]], dev[:, [4, 0, 8]])
        assert (back[:, [0, 2, 3, 4, 6, 8]] == 0).all()
        for programs in (1, 5):  # persistent: a few programs loop over every (page, row, chunk)
            few = torch.zeros_like(dev)
            move_pages(host, page_dim, dst, few, 1, torch.tensor([1, 5, 7]), block=16, max_programs=programs)
            assert torch.equal(few, back)
print("OK")
"""


def test_page_move_kernel_in_interpreter():
    pytest.importorskip("triton")
    run_interpreted(PAGE_MOVE_CODE)


GRAPH_RUNNER_CODE = """
import sys, json
from serving.engine import Engine
from harness.model_utils import hf_greedy, tiny_model
from harness.engine_cases import GREEDY, prompts
path = tiny_model(sys.argv[1] if len(sys.argv) > 1 else __import__('tempfile').mkdtemp())
ps = prompts(3, 512, seed=5, lo=3, hi=30)
params = {**GREEDY, "max_new_tokens": 6}
ref = hf_greedy(path, ps, 6)
eng = Engine(model_path=str(path), page_size=4, max_total_tokens=1024, attention_backend="triton",
             context_length=256, device="cpu", dtype="float32")  # the interpreter runs on CPU tensors
runner = eng.core.runner
runner.graphs = runner.make_graph_runner([1, 2, 4], capture=False)  # static buffers, eager forward
outs = eng.generate(input_ids=ps, sampling_params=params)
assert [o["output_ids"] for o in outs] == ref, ([o["output_ids"] for o in outs], ref)
assert runner.graphs.replays > 0
# a batch of 3 ran padded to 4: the padding row must not have written KV anywhere
eng.check_integrity()
print("OK")
"""


@pytest.mark.skipif(__import__("torch").cuda.is_available(),
                    reason="an interpreter test for CPU machines (fails under the device's Triton 3.6 interpreter); "
                           "on CUDA, test_gpu.py runs the graphs for real")
def test_graph_runner_static_buffers_in_interpreter():
    """Decode through the graph runner's static buffers, padded (3 -> 4), with the Triton
    backend under the interpreter: greedy tokens equal HF's."""
    pytest.importorskip("triton")
    run_interpreted(GRAPH_RUNNER_CODE)


EXTEND_GRAPH_CODE = """
import sys, torch
from serving.runner.cuda_graph_extend import extend_buckets
from serving.engine import Engine
from serving.structs.forward_batch import ForwardBatch
from harness.model_utils import hf_greedy, tiny_model
from harness.engine_cases import prompts
path = tiny_model(sys.argv[1])
eng = Engine(model_path=str(path), page_size=4, max_total_tokens=1024, attention_backend="triton",
             context_length=256, device="cpu", dtype="float32", chunked_prefill_size=16)
runner = eng.core.runner
# 1. one extend batch over prefixes already in L1, padded 11 -> 16 tokens and 3 -> 4 sequences: the
#    logits through the static buffers are the eager pass's (GEMMs of 16 rows round like those of 11
#    only to ~1e-6), and KV is written at the batch's 11 slots and nowhere else
ext = runner.make_extend_graph_runner(extend_buckets(32, 4), capture=False)
g = torch.Generator().manual_seed(0)
seqs, page = [], 1
for n in (9, 30, 13):
    pages = list(range(page, page + (n + 8) // 4 + 1))
    page += len(pages)
    seqs.append((torch.randint(1, 500, (n,), generator=g).tolist(), pages))
runner.forward(ForwardBatch.build([(ids, 0, p) for ids, p in seqs], 4))  # the prefixes, into L1
fb = ForwardBatch.build([(nw, len(ids), p) for nw, (ids, p) in zip([[5, 6, 7], [8], [9, 10, 11, 12, 13, 14, 15]],
                                                                     seqs)], 4)
assert ext.can_run(fb) and ext.bucket_for(fb.num_tokens, fb.batch_size) == (16, 4)
kv0 = runner.pool.kv_buffer.clone()
got = ext.run(fb).clone()
kv = runner.pool.kv_buffer  # [2, layers, pages, page size, kv heads, head dim]
changed = (kv != kv0).view(2, kv.shape[1], -1, kv.shape[-2] * kv.shape[-1]).any(-1).any(0).any(0)  # [slots]
assert changed.nonzero().flatten().tolist() == sorted(fb.out_cache_loc.tolist())
runner.pool.kv_buffer.copy_(kv0)
want = runner._forward_eager(fb)
err = float((got - want).norm() / want.norm())
assert got.shape == want.shape == (3, 512) and err < 1e-5, err
assert torch.equal(got.argmax(-1), want.argmax(-1))
# 2. the engine with decode and extend graph runners (capture=False): prompts chunked by 16 (extends
#    mixed with decodes), then longer prompts whose prefixes are cached in L1 (suffix extends)
runner.graphs = runner.make_graph_runner([1, 2, 4], capture=False)
runner.extend_graphs = runner.make_extend_graph_runner(extend_buckets(32, 4), capture=False)
ps = prompts(3, 512, seed=5, lo=10, hi=30)
params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
outs = eng.generate(input_ids=ps, sampling_params=params)
assert [o["output_ids"] for o in outs] == hf_greedy(path, ps, 4)
first = runner.extend_graphs.replays
assert first > 0
ps2 = [p + o["output_ids"] + [17 + i, 23, 42] for i, (p, o) in enumerate(zip(ps, outs))]
outs2 = eng.generate(input_ids=ps2, sampling_params=params)
assert [o["output_ids"] for o in outs2] == hf_greedy(path, ps2, 4)
assert all(o["meta_info"]["cached_tokens"] >= len(p) - 4 for o, p in zip(outs2, ps))
assert runner.extend_graphs.replays > first
eng.check_integrity()
print("OK", err)
"""


@pytest.mark.skipif(__import__("torch").cuda.is_available(),
                    reason="an interpreter test for CPU machines; on CUDA, test_gpu.py captures the graphs")
def test_extend_graph_runner_in_interpreter(tmp_path):
    """Extend batches through the extend-graph runner's static buffers (padded to a bucket), with the
    Triton backend under the interpreter: logits equal the eager pass's, padding writes no KV, and an
    engine with both graph runners gives HF's greedy tokens, also on prefixes cached in L1."""
    pytest.importorskip("triton")
    run_interpreted(EXTEND_GRAPH_CODE.replace("sys.argv[1]", repr(str(tmp_path))))


def test_extend_buckets_round_like_the_token_counts():
    """Every token count takes a bucket with the same power of two above it (the split-KV kernel's
    split count depends on that alone, so graphed and eager attention match bit for bit)."""
    from serving.kernels.triton_common import next_pow2
    from serving.runner.cuda_graph_extend import extend_buckets

    assert extend_buckets(256, 64) == [(16, 1), (16, 16), (32, 1), (32, 16), (32, 32), (64, 1), (64, 16), (64, 64),
                                       (128, 1), (128, 16), (128, 64), (256, 1), (256, 16), (256, 64)]
    assert extend_buckets(8, 4) == [(8, 1), (8, 4)]
    for budget in (8, 16, 100, 256, 300):
        buckets = extend_buckets(budget, 8)
        for t in range(1, budget + 1):
            bucket = min(b for b, _ in buckets if b >= t)
            assert next_pow2(t, 16) == next_pow2(bucket, 16), (budget, t, bucket)
    with pytest.raises(ValueError):
        extend_buckets(0, 4)
    from serving.config import ModelConfig

    with pytest.raises(ValueError, match="cuda_graph_max_extend_tokens"):
        ModelConfig(cuda_graph_max_extend_tokens=0)


def test_a_hybrid_model_captures_longer_extends_by_default():
    """Unset, the extend graphs' budget is 256 new tokens, 1024 for a model with sliding-window or state
    layers (its eager extends are launch-bound); a budget given is kept for any."""
    from serving.config import ModelConfig
    from serving.models.layer_spec import LayerStack
    from serving.runner.cuda_graph_extend import extend_buckets, extend_token_budget

    unset = ModelConfig().cuda_graph_max_extend_tokens
    assert unset is None
    full = LayerStack.all_full(4)
    sliding = LayerStack.from_kinds(["sliding_attention"] * 5 + ["full_attention"], window=512)
    state = LayerStack.from_kinds(["linear_attention"] * 3 + ["full_attention"])
    assert [extend_token_budget(unset, s) for s in (full, sliding, state)] == [256, 1024, 1024]
    assert extend_token_budget(512, state) == 512 and extend_token_budget(64, full) == 64
    assert max(t for t, _ in extend_buckets(extend_token_budget(unset, sliding), 64)) == 1024


FUSED_CODE = """
import torch
from serving.kernels import triton_fused as tf
from serving.models.llama import RMSNorm
from serving.models.rope import apply_rope
g = torch.Generator().manual_seed(0)
x = torch.randn(5, 48, generator=g)
norm = RMSNorm(48, 1e-5)
norm.weight.data.normal_(1.0, 0.1, generator=g)
torch.testing.assert_close(tf.rmsnorm(x, norm.weight, 1e-5), norm(x), atol=1e-5, rtol=1e-5)
h, kh, d = 4, 2, 8
qkv = torch.randn(5, (h + 2 * kh) * d, generator=g)
pos = torch.tensor([0, 3, 9, 1, 7])
cos, sin = torch.randn(10, d, generator=g), torch.randn(10, d, generator=g)
q, k = tf.rope_qk(qkv, pos, cos, sin, h, kh, d)
torch.testing.assert_close(q, apply_rope(qkv[:, :h * d].view(5, h, d), cos[pos][:, None], sin[pos][:, None]))
torch.testing.assert_close(k, apply_rope(qkv[:, h * d:(h + kh) * d].view(5, kh, d), cos[pos][:, None],
                                         sin[pos][:, None]))
gu = torch.randn(5, 2 * 40, generator=g)
torch.testing.assert_close(tf.silu_mul(gu, 40), torch.nn.functional.silu(gu[:, :40]) * gu[:, 40:])
print("OK")
"""


def test_fused_kernels_in_interpreter():
    """RMSNorm, RoPE and SiLU-mul kernels (the model's CUDA path) against the torch path."""
    pytest.importorskip("triton")
    run_interpreted(FUSED_CODE)


def test_abort_after_the_early_release_finishes_it_once(tiny):
    """Overlap scheduling: a one-token request whose pages went back at its pass's launch is aborted before
    its token is handed out: it finishes as aborted (its late token joins its output, as for any request
    aborted after its launch), nothing is released twice, and the server goes idle."""
    path, ps, _ = tiny
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=4096, dtype="float32")
    ov = overlapped(eng)
    core = eng.core
    r = core.make_request(input_ids=ps[0], sampling_params={**GREEDY, "max_new_tokens": 1})
    core.add(r)
    core.step()
    assert ov.released_early == 1 and r not in core.scheduler.running and r.pending >= 0
    assert core.scheduler.has_work  # its token is still to come
    assert core.scheduler.abort(r.rid) is r and r.finish_reason["type"] == "abort"
    core.check_integrity()
    while core.scheduler.has_work:
        core.step()
    assert r.pending < 0 and core.scheduler.in_use_pages() == 0 and not core.scheduler.running
    core.check_integrity()
    eng.shutdown()
