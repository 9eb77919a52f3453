"""Models with state layers (tiny random Qwen3.5 and Nemotron-H) through the CUDA graph runners' static
buffers, on a CPU: the Triton attention backend under its interpreter, graphs not captured (``capture=False``
runs the same padded static batches eagerly).

- Decode, on the fixed state plan of ``StatePlan.for_decode``: every decode step of three concurrent requests
  goes through the graph runner (padded to 4: one padding row on the pool's scratch row); greedy outputs
  equal HF's, the snapshots decode steps take (where a token ends a page) let the next turn resume past its
  prompt, again equal to HF, and no state slot leaks (the scratch row is never allocated).
- Extend, on each bucket's static state plan (serving/models/state_graph.py, with fla's whole-sequence
  contract in torch): returning turns' suffixes go through the extend graph runner, equal to HF, and the
  next turn resumes from the snapshots those replays took.
- A capture that raises leaves a state model decoding / extending eagerly.

On the GPU the graphs are captured: tests/engine/test_gpu_state_graphs.py, bench/hybrid.py."""

from __future__ import annotations

import pytest

from harness.interpreted import run_interpreted

FAMILIES = {"qwen3_5": {}, "nemotron_h": {"hybrid_override_pattern": "M*-MM*-", "time_step_min": 1e-9}}

SETUP = """
import sys
from serving.engine import Engine
from serving.runner.cuda_graph_extend import extend_buckets
from harness.engine_cases import prompts
from harness.model_utils import hf_greedy, tiny_model
path = tiny_model(sys.argv[1], FAMILY, **KW)
eng = Engine(model_path=str(path), page_size=4, max_total_tokens=1024, attention_backend="triton",
             context_length=256, device="cpu", dtype="float32")
runner = eng.core.runner
"""

DECODE = SETUP + """
assert runner.graphs is None  # a CPU engine captures none: put the static-buffer runner in
runner.graphs = runner.make_graph_runner([1, 2, 4], capture=False)
sizes = []
run = runner.graphs.run
runner.graphs.run = lambda b: (sizes.append(b.batch_size), run(b))[1]
state = runner.state_pool
params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
ps = prompts(3, 512, seed=5, lo=9, hi=15)
ref = hf_greedy(path, ps, 10)
outs = eng.generate(input_ids=ps, sampling_params=params)
assert [o["output_ids"] for o in outs] == ref, ([o["output_ids"] for o in outs], ref)
assert 3 in sizes and len(sizes) >= 9, sizes  # every decode step of the three through the graph runner
eng.check_integrity()
# the next turns resume from snapshots decode steps took (past the prompt: where a generated token ended a page)
turn2 = [p + r + [7, 8, 9] for p, r in zip(ps, ref)]
ref2 = hf_greedy(path, turn2, 10)
outs = eng.generate(input_ids=turn2, sampling_params=params)
assert [o["output_ids"] for o in outs] == ref2
cached = [o["meta_info"]["cached_tokens"] for o in outs]
assert all(c > len(p) for c, p in zip(cached, ps)), (cached, [len(p) for p in ps])
eng.check_integrity()
assert state.pad_slot == state.num_slots + state.num_scratch and state.layer(0)[0].shape[0] == state.pad_slot + 1
eng.shutdown()
print("OK", sizes[:12], cached)
"""


EXTEND = SETUP + """
assert runner.extend_graphs is None  # a CPU engine captures none: put the static-buffer runner in
runner.extend_graphs = runner.make_extend_graph_runner(extend_buckets(32, 4), capture=False)
seen = []
run = runner.extend_graphs.run
def spy(b):
    seen.append((b.batch_size, sum(o >= 0 for o in b.snap_offsets_list)))
    return run(b)
runner.extend_graphs.run = spy
params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
ps = prompts(3, 512, seed=5, lo=9, hi=15)
turns = [ps]
for t in range(3):
    ref = hf_greedy(path, turns[-1], 6)
    before = len(seen)
    outs = eng.generate(input_ids=turns[-1], sampling_params=params)
    assert [o["output_ids"] for o in outs] == ref, (t, [o["output_ids"] for o in outs], ref)
    eng.check_integrity()
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    if t:  # a returning turn: its suffixes through the graphs, resuming past the turn before's prompt
        assert len(seen) > before, seen
        assert all(c > len(p) for c, p in zip(cached, turns[-2])), (cached, [len(p) for p in turns[-2]])
    turns.append([p + r + [7, 8, 9, 10, 11] for p, r in zip(turns[-1], ref)])
assert max(b for b, _ in seen) >= 2 and any(s > 0 for _, s in seen), seen  # batched, with snapshots
eng.shutdown()
print("OK", seen)
"""


def _run(code: str, tmp_path, family: str) -> None:
    pytest.importorskip("triton")
    run_interpreted(code.replace("sys.argv[1]", repr(str(tmp_path))).replace("FAMILY", repr(family))
                    .replace("**KW", f"**{FAMILIES[family]!r}"))


CPU_ONLY = pytest.mark.skipif(__import__("torch").cuda.is_available(),
                              reason="an interpreter test for CPU machines; on CUDA the graphs are captured")


@CPU_ONLY
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_state_model_decode_through_graph_buffers_equals_hf(tmp_path, family):
    _run(DECODE, tmp_path, family)


@CPU_ONLY
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_state_model_extends_through_graph_buffers_equal_hf(tmp_path, family):
    """The returning turns' suffixes (a few sequences at once, snapshots where their prompts end a page) through
    the extend graph runner's buffers, each bucket's static state plan (serving/models/state_graph.py, with
    fla's whole-sequence contract in torch); a third turn resumes from the snapshots those replays took."""
    _run(EXTEND, tmp_path, family)


@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
def test_a_state_model_whose_graphs_fail_to_capture_decodes_eagerly(tmp_path, monkeypatch, family):
    """Until the state layers' graphs have run on a GPU, a capture that raises leaves a state model
    decoding eagerly (a warning), where a model without state layers still fails as before."""
    from harness.model_utils import tiny_model
    from serving.config import ModelConfig, SchedulerConfig
    from serving.runner.model_runner import ModelRunner

    path = tiny_model(tmp_path, family, **FAMILIES.get(family, {}))
    runner = ModelRunner(ModelConfig(model_path=str(path), device="cpu", dtype="float32"),
                         SchedulerConfig(max_total_tokens=256, max_running_requests=4), 4)

    def broken(sizes, capture=True):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(runner, "make_graph_runner", broken)
    if family == "llama":
        with pytest.raises(RuntimeError, match="capturing"):
            runner._decode_graphs([1, 2])
    else:
        assert runner._decode_graphs([1, 2]) is None


@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
def test_a_state_model_whose_extend_graphs_fail_to_capture_extends_eagerly(tmp_path, monkeypatch, family):
    """As for decode: a state model whose extend graphs raise at capture runs its extends eagerly (a warning);
    a model without state layers still fails. Extend graphs of a state model need fla-core's kernels."""
    from harness.model_utils import tiny_model
    from serving.config import ModelConfig, SchedulerConfig
    from serving.runner.model_runner import ModelRunner

    path = tiny_model(tmp_path, family, **FAMILIES.get(family, {}))
    runner = ModelRunner(ModelConfig(model_path=str(path), device="cpu", dtype="float32"),
                         SchedulerConfig(max_total_tokens=256, max_running_requests=4), 4)

    def broken(buckets, capture=True, row_buckets=()):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(runner, "make_extend_graph_runner", broken)
    if family == "llama":
        assert runner._state_extend_graphs_ok()
        with pytest.raises(RuntimeError, match="capturing"):
            runner._extend_graphs([(16, 1)], [])
    else:
        assert not runner._state_extend_graphs_ok()  # the torch scan on a CPU
        assert runner._extend_graphs([(16, 1)], []) is None
