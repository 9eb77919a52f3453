"""NGRAM speculative decoding on models with recurrent-state layers (issue 43) is exact: a tiny random
Qwen3.5 (Gated DeltaNet) and Nemotron-H (Mamba2), float32 on CPU, with prompts that repeat (so drafts
are proposed, some accepted and some rejected: the tree holds decoys, each prompt with the start of its
output and then other tokens) give HF transformers' greedy tokens and the engine's
without speculation, for concurrent requests, a repeated batch (resumed from the state snapshots the
first one left, some of them taken inside verify passes), a second turn of each conversation and TP=2;
``check_integrity()`` holds after every step and every state slot a request held is back."""

from __future__ import annotations

import random

import pytest

from harness.model_utils import hf_greedy, tiny_model
from serving.engine import Engine
from serving.speculative.cost import StepCost

FAMILIES = {"qwen3_5": {}, "nemotron_h": {"hybrid_override_pattern": "M*-MM*-", "time_step_min": 1e-9}}
NEW = 24
G = {"temperature": 0, "ignore_eos": True, "max_new_tokens": NEW}


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    loop = [rng.randrange(1, 511) for _ in range(9)]
    return [[1, 2, 3, 4, 5, 6, 7] * 6, loop * 5, [9, 8, 7] * 12 + [rng.randrange(1, 511) for _ in range(5)],
            [rng.randrange(1, 511) for _ in range(30)], loop[:5] * 4 + [rng.randrange(1, 511) for _ in range(11)]]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory):
    path = tiny_model(tmp_path_factory.mktemp(request.param), request.param, **FAMILIES[request.param])
    ps = prompts()
    ref = hf_greedy(path, ps, NEW)
    turn2 = [p + out + p[:6] for p, out in zip(ps, ref, strict=True)]  # each conversation's next turn
    return path, ps, ref, turn2, hf_greedy(path, turn2, NEW)


def engine(path, spec: bool) -> Engine:
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=2048,
                 **({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 6} if spec else {}))
    if spec:  # every draft the policy allows, whatever drafts cost on this machine
        eng.core.speculative.cost = StepCost(0.01, adaptive=False)
    return eng


def drive(eng: Engine, ps: list[list[int]]) -> list:
    """Run ``ps`` concurrently to completion, checking the engine after every step; their requests."""
    core = eng.core
    reqs = [core.make_request(input_ids=p, sampling_params=dict(G)) for p in ps]
    for r in reqs:
        core.add(r)
    while not all(r.finished for r in reqs):
        core.step()
        core.check_integrity()
    return reqs


def test_speculative_greedy_is_hf_greedy_across_turns(tiny) -> None:
    path, ps, ref, turn2, ref2 = tiny
    plain = engine(path, spec=False)
    try:
        assert [r.output_ids for r in drive(plain, ps)] == ref
    finally:
        plain.shutdown()
    eng = engine(path, spec=True)
    try:
        core = eng.core
        # decoys: each prompt with its first 8 output tokens and then others, so the tree drafts each
        # request's own continuation (accepted) and then tokens it does not generate (rejected)
        rng = random.Random(1)
        drive(eng, [p + out[:8] + [rng.randrange(1, 511) for _ in range(6)] for p, out in zip(ps, ref, strict=True)])
        first = drive(eng, ps)
        assert [r.output_ids for r in first] == ref
        again = drive(eng, ps)  # from the snapshots the first batch left (some taken in verify passes)
        assert [r.output_ids for r in again] == ref
        assert all(r.kv.cached_tokens > 0 for r in again), [r.kv.cached_tokens for r in again]
        second = drive(eng, turn2)  # the next turns resume where the first ones ended
        assert [r.output_ids for r in second] == ref2
        assert all(r.kv.cached_tokens >= len(p) // 4 * 4 - 4 for r, p in zip(second, ps, strict=True))
        stats = core.speculative.stats
        assert stats.draft_tokens > 0 and stats.verify_steps > 0
        assert 0 < stats.accepted_tokens < stats.draft_tokens, stats  # accepted and rejected drafts
        assert sum(r.spec.drafted > r.spec.accepted > 0 for r in first) >= 3  # accepted, then rejected
        core.check_integrity()
        assert not core.scheduler.running
        state = core.runner.state_pool  # every slot left is a tree snapshot's
        assert state.num_used == core.tree.state.cached_slots("device")
    finally:
        eng.shutdown()


def test_tensor_parallel_speculation_is_exact(tiny) -> None:
    """TP=2: each rank writes its heads' scratch from the batch's SNAP_EVERY offsets and mirrors rank 0's
    settle copies; greedy tokens are HF's, and check_integrity (every rank's pools and slots) holds."""
    path, ps, ref, _, _ = tiny
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=2048, tp_size=2,
                 speculative_algorithm="NGRAM", speculative_num_draft_tokens=6)
    eng.core.speculative.cost = StepCost(0.01, adaptive=False)
    try:
        rng = random.Random(1)
        drive(eng, [p + out[:8] + [rng.randrange(1, 511) for _ in range(6)] for p, out in zip(ps, ref, strict=True)])
        assert [r.output_ids for r in drive(eng, ps)] == ref
        stats = eng.core.speculative.stats
        assert 0 < stats.accepted_tokens < stats.draft_tokens, stats
    finally:
        eng.shutdown()
