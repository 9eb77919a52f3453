"""Tensor parallelism for models with recurrent-state layers (CPU, gloo, fp32, TP=2): a tiny random Qwen3.5
(Gated DeltaNet split by key / value head) and Nemotron-H (Mamba2 split by head and group), each rank
holding its heads' state. Greedy tokens equal HF transformers' (and so TP=1's, which the single-rank
suites hold to HF) cold, for second turns resumed from L1 snapshots, and from L2 (the snapshots demoted
with their KV and loaded back on every rank); ``check_integrity`` (every rank ran every command and holds
the same pools and state slots) after each step, and after retraction. The log-probabilities stay within the single-rank
tolerance of HF's, which a rank resuming from a wrong or stale state would not."""

from __future__ import annotations

import pytest

from harness.engine_cases import hits, ids_of, prompts
from harness.model_utils import tiny_model
from harness.state_cases import GREEDY, NEW, STATE_FAMILIES, generate, two_turns
from serving.engine import Engine
from serving.parallel.shard import TPShapeError
from serving.parallel.state_shard import DeltaNetShard, Mamba2Shard


@pytest.fixture(scope="module", params=sorted(STATE_FAMILIES))
def tiny(request, tmp_path_factory):
    """The model (vocab 501: padded over 2 ranks); 3 first turns; their second turns; HF's answers;
    6 unrelated prompts to push the first ones out of L1."""
    path = tiny_model(tmp_path_factory.mktemp(f"tp-{request.param}"), request.param, vocab_size=501,
                      **STATE_FAMILIES[request.param])
    return (path, *two_turns(path, 3, seed=5, vocab=500), prompts(6, 500, seed=7, lo=40, hi=60))


def test_tp2_cold_and_second_turns_from_l1(tiny) -> None:
    path, first, ref1, second, ref2, _ = tiny
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=1024, chunked_prefill_size=10, tp_size=2)
    procs = eng.core.tp.procs
    try:
        generate(eng, path, first, ref1)  # chunks of 10: mid-page
        eng.check_integrity()
        outs = generate(eng, path, second, ref2)
        want = [(len(p) + NEW - 1) // 4 * 4 for p in first]  # each resumes at its first turn's full pages
        assert hits(outs, "device") == want, (hits(outs, "device"), want)
        eng.check_integrity()
        assert eng.core.req_cache.states.snapshots_attached > 0
    finally:
        eng.shutdown()
    assert all(not p.is_alive() for p in procs)


def test_tp2_second_turns_from_l2(tiny) -> None:
    path, first, ref1, second, ref2, others = tiny
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=200, hicache_ratio=4.0, tp_size=2,
                 hicache_write_policy="write_through", write_through_threshold=1, max_running_requests=2)
    try:
        generate(eng, path, first, ref1)
        eng.check_integrity()
        eng.generate(input_ids=others, sampling_params=GREEDY)  # pushes the first turns out of L1
        assert eng.core.tree.state.cached_slots("host") > 0
        eng.check_integrity()
        outs = generate(eng, path, second, ref2)
        assert sum(hits(outs, "host")) > 0, [o["meta_info"] for o in outs]
        assert eng.core.controller.state_slots_moved > 0
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_tp2_retracted_requests_resume_exactly(tiny) -> None:
    """A small L1 retracts requests: each gives its pages and captures to the tree and resumes from a
    snapshot copied into a new working slot, on every rank."""
    path, first, ref1, second, ref2, _ = tiny
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=96, max_running_requests=5, tp_size=2)
    try:
        assert ids_of(eng.generate(input_ids=first + second, sampling_params=GREEDY)) == ref1 + ref2
        assert eng.core.scheduler.stats.retractions > 0  # the small L1 made it retract
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_state_heads_that_do_not_split_are_refused(tmp_path) -> None:
    with pytest.raises(TPShapeError, match="does not divide the model's 3 Gated DeltaNet key heads"):
        DeltaNetShard.make(3, 6, 16, 16, 0, 2)
    with pytest.raises(TPShapeError, match="does not divide the model's 1 Mamba2 groups"):
        Mamba2Shard.make(8, 1, 8, 16, 0, 2)
    path = tiny_model(tmp_path / "m", "nemotron_h", n_groups=1)  # 8 heads in one group
    with pytest.raises(TPShapeError, match="--tp-size 2 does not divide the model's 1 Mamba2 groups"):
        Engine(model_path=str(path), page_size=4, max_total_tokens=256, tp_size=2)
