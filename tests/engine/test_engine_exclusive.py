"""The exclusive tiers in the engine (tiny Llama, fp32 CPU, LMDB L3): greedy output from L1, L2, L3 and
L3 after a restart equals cold recompute; pages demote L1 -> L2 -> L3 and are not duplicated."""

from __future__ import annotations

import pytest

from harness.engine_cases import GREEDY, ids_of, prompts
from harness.model_utils import hf_greedy, tiny_model
from serving.engine import Engine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tiny_model(tmp_path_factory.mktemp("excl"))
    ps = prompts(8, 512, seed=7, lo=40, hi=60)
    return path, ps, hf_greedy(path, ps, GREEDY["max_new_tokens"])


def make(path, db) -> Engine:
    return Engine(model_path=str(path), page_size=4, max_total_tokens=128, hicache_ratio=2.0,
                  hicache_write_policy="exclusive", write_through_threshold=1000, max_running_requests=1,
                  hicache_storage_backend="lmdb",
                  hicache_storage_backend_extra_config={"path": str(db), "capacity_gb": 0.05, "initial_map_mb": 1},
                  hicache_storage_prefetch_policy="wait_complete", hicache_storage_prefetch_threshold=8,
                  hicache_storage_prefetch_timeout_base=5.0, hicache_storage_load_policy="always_load")


def one_by_one(eng: Engine, ps, ref) -> dict[str, int]:
    """Each prompt alone, integrity checked after each; returns the tokens hit per tier."""
    hits = {"device": 0, "host": 0, "storage": 0}
    for p, want in zip(ps, ref, strict=True):
        out = eng.generate(input_ids=[p], sampling_params=GREEDY)
        assert ids_of(out) == [want]
        for k in hits:
            hits[k] += out[0]["meta_info"]["cached_tokens_details"][k]
        eng.core.storage.poll(wait=True)
        eng.check_integrity()
        tree = eng.core.tree
        assert not [n for n in tree.nodes() if n.device_pages is not None and n.host_pages is not None]
    return hits


def test_exclusive_tiers_serve_every_tier_and_a_restart(tiny, tmp_path):
    path, ps, ref = tiny
    db = tmp_path / "l3"
    eng = make(path, db)
    tree, storage = eng.core.tree, eng.core.storage
    assert tree.exclusive.on and tree.exclusive.demote_to_l3
    one_by_one(eng, ps[:2], ref[:2])
    assert storage.pages_written == 0  # nothing reaches L3 while L2 has room
    first = one_by_one(eng, ps, ref)  # L1 (128 tokens) overflows into L2, L2's cold end into L3
    assert storage.pages_written > 0 and tree.cached_pages("host") > 0
    second = one_by_one(eng, ps, ref)
    again = one_by_one(eng, ps[-1:], ref[-1:])  # the last prompt is still on L1
    hits = {k: first[k] + second[k] + again[k] for k in first}
    assert hits["device"] > 0 and hits["host"] > 0 and hits["storage"] > 0, hits
    assert storage.stats()["write_pages_dropped"] == 0
    eng.shutdown()  # persists L1 and L2 to L3
    eng = make(path, db)
    hits = one_by_one(eng, ps, ref)
    assert hits["storage"] > 0, hits
    eng.shutdown()
