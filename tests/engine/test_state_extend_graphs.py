"""Extends of models with state layers (tiny random Qwen3.5 and Nemotron-H) through the extend CUDA graphs'
static buffers, on a CPU: the Triton attention backend under its interpreter, graphs not captured
(``capture=False`` runs the same padded static batches eagerly, on each bucket's static state plan,
serving/models/state_graph.py, with fla's whole-sequence contract in torch). The returning turns' suffixes
(a few sequences at once, snapshots where their prompts end a page) go through the graph runner; greedy
outputs equal HF's, a third turn resumes from the snapshots those replays took, again equal to HF, and the
cache stays whole. On the GPU the graphs are captured (tests/engine/test_gpu_state_graphs.py)."""

from __future__ import annotations

import pytest

from harness.interpreted import run_interpreted

FAMILIES = {"qwen3_5": {}, "nemotron_h": {"hybrid_override_pattern": "M*-MM*-", "time_step_min": 1e-9}}

CODE = """
import sys
from serving.engine import Engine
from serving.runner.cuda_graph_extend import extend_buckets
from harness.engine_cases import prompts
from harness.model_utils import hf_greedy, tiny_model
path = tiny_model(sys.argv[1], FAMILY, **KW)
eng = Engine(model_path=str(path), page_size=4, max_total_tokens=1024, attention_backend="triton",
             context_length=256, device="cpu", dtype="float32")
runner = eng.core.runner
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


@pytest.mark.skipif(__import__("torch").cuda.is_available(),
                    reason="an interpreter test for CPU machines; on CUDA the graphs are captured")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_state_model_extends_through_graph_buffers_equal_hf(tmp_path, family):
    pytest.importorskip("triton")
    code = CODE.replace("sys.argv[1]", repr(str(tmp_path))).replace("FAMILY", repr(family)) \
        .replace("**KW", f"**{FAMILIES[family]!r}")
    run_interpreted(code)
