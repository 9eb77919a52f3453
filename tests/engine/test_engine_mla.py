"""DeepSeek-V2 (MLA + MoE) in the engine with the HiCache tiers (issue 45), float32 on CPU: a tiny
random checkpoint (no q_lora_rank, as V2-Lite; a dense layer then two MoE layers with group-limited
routing and shared experts). Greedy tokens equal HF's cold and with the prefix served from L1, from
L2 and from L3 (LMDB, after a restart); every tier holds the latent once per token (kv_lora_rank +
qk_rope_head_dim elements per layer), under a namespace of its own."""

from __future__ import annotations

import time

import pytest

from harness.engine_cases import ids_of, tier_prompts
from harness.model_utils import hf_greedy, tiny_model
from hicache.tiers.lmdb.store import LMDBStore
from serving.engine import Engine
from serving.engine.offline import output_dict

GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
LATENT = 32 + 8  # the tiny family's kv_lora_rank + qk_rope_head_dim
LAYERS = 3
PS = 4
LMDB = {"capacity_gb": 0.05, "initial_map_mb": 1}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tiny_model(tmp_path_factory.mktemp("dsv2"), "deepseek_v2")
    ps, others = tier_prompts()  # 40-60 tokens each
    return path, ps, others, hf_greedy(path, ps, GREEDY["max_new_tokens"])


def hits(outs, tier: str) -> list[int]:
    return [o["meta_info"]["cached_tokens_details"][tier] for o in outs]


def steps(eng: Engine, prompts: list[list[int]]) -> list[dict]:
    """The prompts' outputs (as ``Engine.generate`` gives them), run concurrently with the engine's
    ``check_integrity`` (every rank's, under TP) after every scheduler step."""
    core = eng.core
    reqs = [core.make_request(input_ids=p, sampling_params=dict(GREEDY)) for p in prompts]
    for r in reqs:
        core.add(r)
    while not all(r.finished for r in reqs):
        before = core.scheduler.stats.forward_passes
        core.step()
        core.check_integrity()
        if core.scheduler.stats.forward_passes == before:
            time.sleep(0.002)  # waiting for a copy or the store
    return [output_dict(core, r) for r in reqs]


def test_cold_and_l1_hits_equal_hf_and_l1_holds_the_latent(tiny) -> None:
    path, ps, _, ref = tiny
    eng = Engine(model_path=str(path), page_size=PS, max_total_tokens=1024, chunked_prefill_size=11)
    try:
        pool = eng.core.runner.pool
        assert pool.layout.format == "mla" and pool.bytes_per_page == LAYERS * PS * LATENT * 4  # no V copy
        assert eng.core.runner.attn.name == "torch"
        assert ids_of(steps(eng, ps)) == ref  # cold, chunks of 11
        again = steps(eng, ps)
        assert ids_of(again) == ref and all(h > 0 for h in hits(again, "device")), hits(again, "device")
        longer = [p + [5, 6, 7] for p in ps[:2]]  # the prefix from L1, the rest computed
        assert ids_of(steps(eng, longer)) == hf_greedy(path, longer, GREEDY["max_new_tokens"])
    finally:
        eng.shutdown()


def test_prefix_comes_back_from_l2(tiny) -> None:
    path, ps, others, ref = tiny
    eng = Engine(model_path=str(path), page_size=PS, max_total_tokens=160, hicache_ratio=4.0,
                 hicache_write_policy="write_through", write_through_threshold=1, max_running_requests=2)
    try:
        assert ids_of(steps(eng, ps)) == ref
        steps(eng, others)  # pushes ps out of L1
        assert eng.core.tree.cached_pages("host") > 0
        again = steps(eng, ps)
        assert ids_of(again) == ref
        assert sum(hits(again, "host")) > 0, [o["meta_info"] for o in again]
    finally:
        eng.shutdown()


def l3_engine(path, db, **kw) -> Engine:
    return Engine(model_path=str(path), page_size=PS, max_total_tokens=256, hicache_ratio=2.0,
                  hicache_storage_backend="lmdb", hicache_storage_backend_extra_config={"path": str(db), **LMDB},
                  hicache_storage_prefetch_policy="wait_complete", hicache_storage_prefetch_threshold=8,
                  hicache_storage_prefetch_timeout_base=30.0, hicache_storage_load_policy="always_load", **kw)


def test_prefix_comes_back_from_l3_after_restart(tiny, tmp_path) -> None:
    path, ps, _, ref = tiny
    db = tmp_path / "l3"
    eng = l3_engine(path, db)
    try:  # two rounds: the second hits the first's pages, which are written on to L3
        for _ in range(2):
            assert ids_of(steps(eng, ps)) == ref
        eng.core.storage.poll(wait=True)
        assert eng.core.storage.pages_written > 0
        namespace = eng.core.storage.writeback.namespace
        assert ".mla|" in namespace  # the KV format is part of the namespace
    finally:
        eng.shutdown()
    store = LMDBStore.from_config({"path": str(db), **LMDB})
    from hicache.keys import page_keys

    (key, *_) = page_keys(ps[0], PS, namespace)
    value = store.get(key)
    store.close()
    assert value is not None and LAYERS * PS * LATENT * 4 <= len(value) < LAYERS * PS * LATENT * 4 + 256
    eng = l3_engine(path, db, max_running_requests=1)  # a restart: L1 and L2 empty, LMDB holds the pages
    try:
        outs = steps(eng, ps)
        assert ids_of(outs) == ref
        assert all(h > 0 for h in hits(outs, "storage")), hits(outs, "storage")
    finally:
        eng.shutdown()
