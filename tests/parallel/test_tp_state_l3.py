"""State snapshots on L3 under tensor parallelism (CPU, gloo, fp32, TP=2, LMDB): a tiny random Qwen3.5 (Gated
DeltaNet) and Nemotron-H (Mamba2), each rank holding its heads' share of every snapshot.

As the pages, each rank stores its own part of a snapshot as its own value (``part_key(page_key, r, 2)``,
hicache/tiers/storage_state.py), and a snapshot is on L3 only when every part is. A TP=2 engine serves the
first turns and shuts down (persisting every rank's pages and parts); a restarted TP=2 engine serves the
second turns from L3 (pages up to the deepest snapshot, the snapshot into every rank's L2 slot, then L1):
HF transformers' greedy tokens and log-probabilities. One rank's part damaged in the store is a miss at that
depth (the shallower snapshot is used), never a wrong state."""

from __future__ import annotations

import random

import pytest

from harness.engine_cases import ids_of, prompts
from harness.lmdb_pages import open_store
from harness.model_utils import hf_greedy, hf_output_logprobs, tiny_model
from hicache.keys import page_keys, state_key
from hicache.tiers.storage_state import part_key
from serving.engine import Engine

pytestmark = pytest.mark.slow
NEW = 8
PS = 4
GREEDY = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
LOGPROB_TOL = 2e-3
FAMILIES = {"qwen3_5": {"num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"]},
            "nemotron_h": {"hybrid_override_pattern": "M*-MM*-", "time_step_min": 1e-9}}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory):
    """The model (vocab 501: padded over 2 ranks); 3 first turns, their second turns, HF's answers to both."""
    path = tiny_model(tmp_path_factory.mktemp(f"tp-l3-{request.param}"), request.param, vocab_size=501,
                      **FAMILIES[request.param])
    first = prompts(3, 500, seed=25, lo=30, hi=50)
    ref1 = hf_greedy(path, first, NEW)
    rng = random.Random(26)
    second = [p + a + [rng.randrange(1, 500) for _ in range(rng.randint(5, 12))]
              for p, a in zip(first, ref1, strict=True)]
    return path, first, ref1, second, hf_greedy(path, second, NEW)


def _engine(path, db) -> Engine:
    return Engine(model_path=str(path), page_size=PS, max_total_tokens=1024, hicache_ratio=2.0, tp_size=2,
                  hicache_storage_backend="lmdb",
                  hicache_storage_backend_extra_config={"path": str(db), "capacity_gb": 0.05, "initial_map_mb": 1},
                  hicache_storage_prefetch_policy="wait_complete", hicache_storage_prefetch_threshold=8,
                  hicache_storage_prefetch_timeout_base=30.0, hicache_storage_load_policy="always_load")


def _generate(eng: Engine, path, ps: list[list[int]], ref: list[list[int]]) -> list[dict]:
    outs = []
    for p in ps:
        (o,) = eng.generate(input_ids=[p], sampling_params=GREEDY, return_logprob=True)
        eng.check_integrity()
        outs.append(o)
    assert ids_of(outs) == ref
    got = [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]
    want = hf_output_logprobs(path, ps, ref)
    worst = max(abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    assert worst < LOGPROB_TOL, worst
    return outs


def _first_turns(path, db, first, ref1) -> str:
    eng = _engine(path, db)
    try:
        _generate(eng, path, first, ref1)
        ns = eng.core.kv_namespace
    finally:
        eng.shutdown()  # persists every rank's pages and snapshot parts
    return ns


def _resume_at(p: list[int]) -> int:
    return (len(p) + NEW - 1) // PS * PS


def _storage_hits(outs) -> list[int]:
    return [o["meta_info"]["cached_tokens_details"]["storage"] for o in outs]


def test_tp2_second_turns_come_from_l3_after_a_restart(tiny, tmp_path) -> None:
    path, first, ref1, second, ref2 = tiny
    db = tmp_path / "l3"
    ns = _first_turns(path, db, first, ref1)
    store = open_store(db, capacity_gb=0.05, initial_map_mb=1)
    try:  # per-rank entries: both parts of each end-of-turn snapshot, none whole
        for p, a in zip(first, ref1, strict=True):
            last = page_keys((p + a)[:_resume_at(p)], PS, ns)[-1]
            assert store.exists(part_key(last, 0, 2)) and store.exists(part_key(last, 1, 2))
            assert not store.exists(state_key(last))
    finally:
        store.close()
    eng = _engine(path, db)  # a restart: L1 and L2 empty on every rank
    try:
        outs = _generate(eng, path, second, ref2)
        assert _storage_hits(outs) == [_resume_at(p) for p in first], [o["meta_info"] for o in outs]
        st = eng.core.storage.stats()
        assert st["state_snapshots_fetched"] == len(first) and st["state_corrupt"] == 0, st
    finally:
        eng.shutdown()


def test_tp2_a_damaged_part_is_a_miss(tiny, tmp_path) -> None:
    """Rank 1's part of each end-of-turn snapshot is damaged: the second turn resumes at the snapshot above
    it (before the first prompt's last token), exactly."""
    path, first, ref1, second, ref2 = tiny
    db = tmp_path / "l3"
    ns = _first_turns(path, db, first, ref1)
    store = open_store(db, capacity_gb=0.05, initial_map_mb=1)
    try:
        for p, a in zip(first, ref1, strict=True):
            key = part_key(page_keys((p + a)[:_resume_at(p)], PS, ns)[-1], 1, 2)
            bad = bytearray(store.get(key))
            bad[len(bad) // 3] ^= 0x40
            store.delete(key)
            assert store.set(key, bytes(bad))
    finally:
        store.close()
    eng = _engine(path, db)
    try:
        outs = _generate(eng, path, second, ref2)
        assert _storage_hits(outs) == [(len(p) - 1) // PS * PS for p in first], [o["meta_info"] for o in outs]
        assert eng.core.storage.stats()["state_corrupt"] == len(first)
    finally:
        eng.shutdown()
