"""Models with state layers on CUDA (issue 43): tiny random Qwen3.5 and Nemotron-H in float32, decode
through captured CUDA graphs (the working and snapshot state slots in static buffers, padding rows on
the pool's scratch row) against the same engine with graphs off, with the torch scan (then also
against HF's greedy tokens) and with fla-core's kernels; a second turn resumes from the snapshots
decode steps took, its suffix through the extend graphs with fla-core's kernels. Skips without CUDA
(the static-buffer paths run on CPU in tests/engine/test_state_graph_buffers.py)."""

from __future__ import annotations

import pytest
import torch

from harness.engine_cases import ids_of, prompts
from harness.model_utils import hf_greedy, tiny_model
from serving.engine import Engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
FAMILIES = {"qwen3_5": {}, "nemotron_h": {"hybrid_override_pattern": "M*-MM*-", "time_step_min": 1e-9}}


def _run(path, graphs: bool, turns: list[list[list[int]]]) -> tuple[list, list, int]:
    eng = Engine(model_path=str(path), page_size=4, dtype="float32", max_total_tokens=4096,
                 disable_cuda_graph=not graphs, max_running_requests=8)
    try:
        assert (eng.core.runner.graphs is not None) == graphs
        outs, cached = [], []
        for ps in turns:
            got = eng.generate(input_ids=ps, sampling_params=GREEDY)
            outs.append(ids_of(got))
            cached.append([o["meta_info"]["cached_tokens"] for o in got])
            eng.check_integrity()
        runner = eng.core.runner
        replays = runner.graphs.replays if graphs else 0
        if graphs and runner.extend_graphs is not None:  # fla's kernels: the returning turns' extends replay too
            replays = (replays, runner.extend_graphs.replays)
        return outs, cached, replays
    finally:
        eng.shutdown()


@pytest.mark.parametrize("backend", ["torch", "fla"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_state_models_decode_through_cuda_graphs(tmp_path, monkeypatch, family: str, backend: str) -> None:
    if backend == "fla":
        pytest.importorskip("fla")
    monkeypatch.setenv("HICACHE_STATE_BACKEND", backend)
    path = tiny_model(tmp_path, family, **FAMILIES[family])
    ps = prompts(5, 512, seed=13, lo=20, hi=90)  # 5 at a time: padded to 8
    eager, _, _ = _run(path, False, [ps])
    turn2 = [p + o + [5, 6, 7] for p, o in zip(ps, eager[0], strict=True)]
    eager, _, _ = _run(path, False, [ps, turn2])
    graphed, cached, replays = _run(path, True, [ps, turn2])
    if backend == "fla":  # decode and extend graphs (serving/models/state_graph.py: the extend's static state plan)
        assert isinstance(replays, tuple) and min(replays) > 0, replays
    else:  # the torch scan cuts its steps on the host: decode graphs only
        assert isinstance(replays, int) and replays > 0, replays
    assert graphed == eager
    assert all(c > len(p) for c, p in zip(cached[1], ps, strict=True)), cached  # decode-time snapshots
    if backend == "torch":
        assert graphed[0] == hf_greedy(path, ps, GREEDY["max_new_tokens"])
        assert graphed[1] == hf_greedy(path, turn2, GREEDY["max_new_tokens"])
