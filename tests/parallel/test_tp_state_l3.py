"""State snapshots on L3 under tensor parallelism (CPU, gloo, fp32, TP=2, LMDB): a tiny random Qwen3.5 (Gated
DeltaNet) and Nemotron-H (Mamba2), each rank holding its heads' share of every snapshot.

As the pages, each rank stores its own part of a snapshot as its own value (``part_key(page_key, r, 2)``,
hicache/tiers/storage_state.py), and a snapshot is on L3 only when every part is. A TP=2 engine serves the
first turns and shuts down (persisting every rank's pages and parts); a restarted TP=2 engine serves the
second turns from L3 (pages up to the deepest snapshot, the snapshot into every rank's L2 slot, then L1):
HF transformers' greedy tokens and log-probabilities. One rank's part damaged in the store is a miss at that
depth (the shallower snapshot is used), never a wrong state."""

from __future__ import annotations

import pytest

from harness.engine_cases import lmdb_l3
from harness.lmdb_pages import open_store
from harness.model_utils import tiny_model
from harness.state_cases import NEW, STATE_FAMILIES, generate, two_turns
from hicache.keys import page_keys, state_key
from hicache.tiers.storage_state import part_key
from serving.engine import Engine

pytestmark = pytest.mark.slow
PS = 4


@pytest.fixture(scope="module", params=sorted(STATE_FAMILIES))
def tiny(request, tmp_path_factory):
    """The model (vocab 501: padded over 2 ranks); 3 first turns, their second turns, HF's answers to both."""
    path = tiny_model(tmp_path_factory.mktemp(f"tp-l3-{request.param}"), request.param, vocab_size=501,
                      **STATE_FAMILIES[request.param])
    return (path, *two_turns(path, 3, seed=25, vocab=500))


def _engine(path, db) -> Engine:
    return Engine(model_path=str(path), page_size=PS, max_total_tokens=1024, hicache_ratio=2.0, tp_size=2,
                  **lmdb_l3(db))


def _first_turns(path, db, first, ref1) -> str:
    eng = _engine(path, db)
    try:
        generate(eng, path, first, ref1, one_at_a_time=True)
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
        outs = generate(eng, path, second, ref2, one_at_a_time=True)
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
        outs = generate(eng, path, second, ref2, one_at_a_time=True)
        assert _storage_hits(outs) == [(len(p) - 1) // PS * PS for p in first], [o["meta_info"] for o in outs]
        assert eng.core.storage.stats()["state_corrupt"] == len(first)
    finally:
        eng.shutdown()
