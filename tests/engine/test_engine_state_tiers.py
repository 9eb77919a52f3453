"""Models with recurrent-state layers on the HiCache tiers (issue 43): a tiny random Qwen3.5 (Gated
DeltaNet + gated attention) and Nemotron-H (Mamba2 + attention + MLP), float32 on CPU, page size 4.

A finished request leaves state snapshots in the tree (serving/cache/request_states.py: at the end of its
full pages, where the next turn resumes, and before its prompt's last token); a match stops at the
deepest snapshot. Every case compares with HF transformers' greedy tokens on the whole conversation: a
returning turn from L1, from L2 (its KV and snapshot demoted when L1 was too small), requests sharing a
prefix whose snapshot is still loading, chunked-prefill boundaries that are not page boundaries, and a
match that must stop above a snapshot evicted alone (the rest recomputed, never guessed)."""

from __future__ import annotations

import random

import pytest

from harness.engine_cases import hits, ids_of, prompts
from harness.model_utils import hf_greedy, tiny_model
from harness.state_cases import GREEDY, NEW, STATE_FAMILIES, generate, two_turns
from serving.engine import Engine


@pytest.fixture(scope="module", params=sorted(STATE_FAMILIES))
def tiny(request, tmp_path_factory):
    """The model; 4 first turns (30-50 tokens); their second turns (first turn + its answer + 5-12 more
    tokens) and HF's greedy answers to both; 6 unrelated prompts to push the first ones out of L1."""
    path = tiny_model(tmp_path_factory.mktemp(request.param), request.param, **STATE_FAMILIES[request.param])
    return (path, *two_turns(path, 4, seed=5), prompts(6, 512, seed=7, lo=40, hi=60))


def test_second_turns_resume_from_l1_snapshots(tiny) -> None:
    path, first, ref1, second, ref2, _ = tiny
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=1024, chunked_prefill_size=10)
    try:
        assert ids_of(eng.generate(input_ids=first, sampling_params=GREEDY)) == ref1  # chunks of 10: mid-page
        eng.check_integrity()
        outs = generate(eng, path, second, ref2)
        # each resumes at the end of its first turn's full pages (its answer's last token is not in KV)
        want = [(len(p) + NEW - 1) // 4 * 4 for p in first]
        assert hits(outs, "device") == want, (hits(outs, "device"), want)
        eng.check_integrity()
        assert eng.core.req_cache.states.snapshots_attached > 0
    finally:
        eng.shutdown()


def test_second_turns_resume_from_l2(tiny) -> None:
    path, first, ref1, second, ref2, others = tiny
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=200, hicache_ratio=4.0,
                 hicache_write_policy="write_through", write_through_threshold=1, max_running_requests=2)
    try:
        assert ids_of(eng.generate(input_ids=first, sampling_params=GREEDY)) == ref1
        eng.generate(input_ids=others, sampling_params=GREEDY)  # pushes the first turns out of L1
        assert eng.core.tree.state.cached_slots("host") > 0  # their snapshots were demoted with their KV
        eng.check_integrity()
        outs = generate(eng, path, second, ref2)
        assert sum(hits(outs, "host")) > 0, [o["meta_info"] for o in outs]
        assert eng.core.controller.state_slots_moved > 0
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_concurrent_turns_share_a_snapshot_while_it_loads(tiny) -> None:
    """Four requests continue the same first turn at once: its snapshot comes back from L2 for the
    first of them and the others read it (or wait for it), each with its own working state."""
    path, first, ref1, second, _, others = tiny
    rng = random.Random(9)
    base = first[0] + ref1[0]
    fan = [base + [rng.randrange(1, 511) for _ in range(n)] for n in (2, 5, 9, 13)]
    ref_fan = hf_greedy(path, fan, NEW)
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=200, hicache_ratio=4.0,
                 hicache_write_policy="write_through", write_through_threshold=1, max_running_requests=4)
    try:
        assert ids_of(eng.generate(input_ids=first[:1], sampling_params=GREEDY)) == ref1[:1]
        eng.generate(input_ids=others, sampling_params=GREEDY)
        outs = generate(eng, path, fan, ref_fan)
        assert all(h > 0 for h in (d + h for d, h in zip(hits(outs, "device"), hits(outs, "host"), strict=True)))
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_a_match_stops_above_an_evicted_snapshot(tiny) -> None:
    """The deepest snapshot is evicted alone (no L2 to demote it to): the next turn's match stops at the
    one above it (the prompt capture) and recomputes the rest."""
    path, first, ref1, second, ref2, _ = tiny
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=1024)
    try:
        assert ids_of(eng.generate(input_ids=first[:1], sampling_params=GREEDY)) == ref1[:1]
        tree = eng.core.tree
        assert tree.state.cached_slots("device") == 2  # the prompt capture and the end of the turn
        end = tree.node_at(second[0][: (len(first[0]) + NEW - 1) // 4 * 4])
        assert end is not None and end.snap is not None
        key = tree.state._key
        tree.state._key = lambda nd: (nd is not end, key(nd))  # evict the deepest one first
        try:
            assert tree.state.evict_device(1) == 1
        finally:
            tree.state._key = key
        assert end.snap is None and tree.state.demotions_dropped == 0
        eng.check_integrity()
        outs = generate(eng, path, second[:1], ref2[:1])
        assert hits(outs, "device") == [(len(first[0]) - 1) // 4 * 4]  # the prompt capture's position
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_more_conversations_than_state_slots(tiny) -> None:
    """Twelve conversations through a state pool of 2 running requests: snapshots are evicted alone
    (policy order) to give running requests their slots; every answer stays exact."""
    path = tiny[0]
    ps = prompts(12, 512, seed=11, lo=10, hi=40)
    ref = hf_greedy(path, ps, NEW)
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=1024, max_running_requests=2)
    try:
        for i in range(0, 12, 3):
            generate(eng, path, ps[i: i + 3], ref[i: i + 3])
            eng.check_integrity()
        state = eng.core.runner.state_pool
        assert eng.core.tree.state.cached_slots("device") == state.num_used <= state.num_slots
    finally:
        eng.shutdown()


def test_a_document_asked_again_resumes_at_a_chunk_boundary(tiny) -> None:
    """A long prompt prefilled in chunks leaves a snapshot at each chunk's last page boundary: a second
    prompt with the same first 45 tokens and another question resumes at the chunk boundary before it
    differs (fixed captures, serving/cache/request_states.py)."""
    path = tiny[0]
    rng = random.Random(12)
    doc = [rng.randrange(1, 511) for _ in range(45)]
    first, second = doc + [rng.randrange(1, 511) for _ in range(20)], doc + [rng.randrange(1, 511) for _ in range(9)]
    ref = hf_greedy(path, [first, second], NEW)
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=1024, chunked_prefill_size=14)
    try:
        generate(eng, path, [first], ref[:1])
        outs = generate(eng, path, [second], ref[1:])
        # chunks of 14 end at 14, 28, 42, 56: their last page boundaries 12, 28, 40, 56; 40 <= 45 < 56
        assert hits(outs, "device") == [40], hits(outs, "device")
        eng.check_integrity()
    finally:
        eng.shutdown()
