"""DeepSeek-V2 and V3 (MLA + MoE) in the engine with the HiCache tiers (issue 45), float32 on CPU:
tiny random checkpoints (V2: no q_lora_rank, as V2-Lite, group-limited routing; V3: q_lora_rank and
V3's noaux_tc router with a random correction bias; each a dense layer then two MoE layers with
shared experts). Greedy tokens equal HF's cold and with the prefix served from L1, from
L2 and from L3 (LMDB, after a restart); every tier holds the latent once per token (kv_lora_rank +
qk_rope_head_dim elements per layer), under a namespace of its own."""

from __future__ import annotations

import pytest

from harness.engine_cases import generate_checked, hits, ids_of, lmdb_l3, tier_prompts
from harness.model_utils import hf_greedy, tiny_model
from hicache.tiers.lmdb.store import LMDBStore
from serving.engine import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
LATENT = 32 + 8  # the tiny family's kv_lora_rank + qk_rope_head_dim
LAYERS = 3
PS = 4
LMDB = {"capacity_gb": 0.05, "initial_map_mb": 1}


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3"])
def tiny(request, tmp_path_factory):
    path = tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    ps, others = tier_prompts()  # 40-60 tokens each
    return path, ps, others, hf_greedy(path, ps, GREEDY["max_new_tokens"])


def test_cold_and_l1_hits_equal_hf_and_l1_holds_the_latent(tiny) -> None:
    path, ps, _, ref = tiny
    eng = Engine(model_path=str(path), page_size=PS, max_total_tokens=1024, chunked_prefill_size=11)
    try:
        pool = eng.core.runner.pool
        assert pool.layout.format == "mla" and pool.bytes_per_page == LAYERS * PS * LATENT * 4  # no V copy
        assert eng.core.runner.attn.name == "torch"
        assert ids_of(generate_checked(eng, ps, GREEDY)) == ref  # cold, chunks of 11
        again = generate_checked(eng, ps, GREEDY)
        assert ids_of(again) == ref and all(h > 0 for h in hits(again, "device")), hits(again, "device")
        longer = [p + [5, 6, 7] for p in ps[:2]]  # the prefix from L1, the rest computed
        assert ids_of(generate_checked(eng, longer, GREEDY)) == hf_greedy(path, longer, GREEDY["max_new_tokens"])
    finally:
        eng.shutdown()


def test_prefix_comes_back_from_l2(tiny) -> None:
    path, ps, others, ref = tiny
    eng = Engine(model_path=str(path), page_size=PS, max_total_tokens=160, hicache_ratio=4.0,
                 hicache_write_policy="write_through", write_through_threshold=1, max_running_requests=2)
    try:
        assert ids_of(generate_checked(eng, ps, GREEDY)) == ref
        generate_checked(eng, others, GREEDY)  # pushes ps out of L1
        assert eng.core.tree.cached_pages("host") > 0
        again = generate_checked(eng, ps, GREEDY)
        assert ids_of(again) == ref
        assert sum(hits(again, "host")) > 0, [o["meta_info"] for o in again]
    finally:
        eng.shutdown()


def l3_engine(path, db, **kw) -> Engine:
    return Engine(model_path=str(path), page_size=PS, max_total_tokens=256, hicache_ratio=2.0, **lmdb_l3(db), **kw)


def test_prefix_comes_back_from_l3_after_restart(tiny, tmp_path) -> None:
    path, ps, _, ref = tiny
    db = tmp_path / "l3"
    eng = l3_engine(path, db)
    try:  # two rounds: the second hits the first's pages, which are written on to L3
        for _ in range(2):
            assert ids_of(generate_checked(eng, ps, GREEDY)) == ref
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
        outs = generate_checked(eng, ps, GREEDY)
        assert ids_of(outs) == ref
        assert all(h > 0 for h in hits(outs, "storage")), hits(outs, "storage")
    finally:
        eng.shutdown()
