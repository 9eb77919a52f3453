"""The hybrid SWA L1 (``--enable-hybrid-swa-memory``: the sliding layers keep their KV in a window pool, only
where a window can still read it) under tensor parallelism (CPU, gloo, fp32, TP=2): a tiny random Gemma-3
(2 sliding layers with an 8-token window to 1 full; 4 q / 2 kv heads, one kv head a rank), prompts of 36-60
tokens (5-7 windows), page size 4.

Rank 0 decides the window pages; the followers get its window map's writes before each command
(serving/parallel/window_map.py) and build each batch's window view from it, so every rank's sliding layers
read and move the same window pages. HF transformers' greedy tokens with a small window pool, chunks that
end inside windows, concurrency and L1 hits; from L2 (the page mover moves the sliding parts through the
map on every rank) and from L3 after a restart; the same as with the pool off. ``check_integrity`` (every
rank ran every command, and its window map is rank 0's) after every step."""

from __future__ import annotations

import random

import pytest

from harness.engine_cases import GREEDY, generate_checked, ids_of, tier_prompts
from harness.model_utils import hf_greedy, tiny_model
from serving.engine import Engine

PS = 4


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = tiny_model(tmp_path_factory.mktemp("tp-swa-gemma3"), "gemma3")
    ps, others = tier_prompts()
    return path, ps, others, hf_greedy(path, ps, GREEDY["max_new_tokens"])


def test_tp2_small_window_pool_concurrent_chunked(gemma) -> None:
    """A 40-page window pool for 256 logical pages, four requests sharing a 36-token prefix, chunks of 7
    (boundaries inside windows), asked twice: HF's tokens, the second time from L1; every rank's window map
    is rank 0's, and the window pages really go (the pool holds far fewer than the cached pages)."""
    path = gemma[0]
    rng = random.Random(8)
    shared = [rng.randrange(1, 511) for _ in range(36)]
    sharing = [shared + [rng.randrange(1, 511) for _ in range(n)] for n in (3, 9, 14, 21)]
    ref = hf_greedy(path, sharing, GREEDY["max_new_tokens"])
    eng = Engine(model_path=str(path), page_size=PS, max_total_tokens=1024, enable_hybrid_swa_memory=True,
                 swa_full_tokens_ratio=40 / 256, chunked_prefill_size=7, max_running_requests=4, tp_size=2)
    try:
        pool = eng.core.runner.pool
        assert pool.windows is not None and pool.window_pages == 40  # on under TP
        assert ids_of(generate_checked(eng, sharing, GREEDY)) == ref
        assert pool.windows.allocator.num_used < eng.core.tree.cached_pages("device")
        outs = generate_checked(eng, sharing[::-1], GREEDY)
        assert ids_of(outs) == ref[::-1]
        assert sum(o["meta_info"]["cached_tokens_details"]["device"] for o in outs) > 0
    finally:
        eng.shutdown()


def test_tp2_window_pool_from_l2_and_l3_equals_pool_off(gemma, tmp_path) -> None:
    """Prefixes demoted to L2 (a small L1) and read from L3 by a restarted TP=2 engine carry their sliding
    layers' KV on every rank: HF's tokens, host and storage hits, as the same engine with the pool off."""
    path, ps, others, ref = gemma

    def engine(db: str, **kw) -> Engine:
        return Engine(model_path=str(path), page_size=PS, max_total_tokens=256, hicache_ratio=4.0,
                      hicache_write_policy="write_through", write_through_threshold=1, max_running_requests=2,
                      tp_size=2, hicache_storage_backend="lmdb", hicache_storage_prefetch_policy="wait_complete",
                      hicache_storage_backend_extra_config={"path": str(tmp_path / db), "capacity_gb": 0.05,
                                                           "initial_map_mb": 1},
                      hicache_storage_prefetch_threshold=8, hicache_storage_load_policy="always_load", **kw)

    for db, kw in (("on", {"enable_hybrid_swa_memory": True}), ("off", {})):
        eng = engine(db, **kw)
        try:
            assert (eng.core.runner.pool.windows is not None) == bool(kw)
            assert ids_of(generate_checked(eng, ps, GREEDY)) == ref
            eng.generate(input_ids=others, sampling_params=GREEDY)  # pushes ps out of L1
            outs = generate_checked(eng, ps, GREEDY)
            assert ids_of(outs) == ref, db
            assert sum(o["meta_info"]["cached_tokens_details"]["host"] for o in outs) > 0, \
                [o["meta_info"] for o in outs]
            eng.core.storage.poll(wait=True)
            eng.check_integrity()
        finally:
            eng.shutdown()
        eng = engine(db, **kw)  # a restart: L1 and L2 empty on every rank
        try:
            outs = generate_checked(eng, ps, GREEDY)
            assert ids_of(outs) == ref, db
            assert all(o["meta_info"]["cached_tokens_details"]["storage"] > 0 for o in outs), \
                [o["meta_info"] for o in outs]
        finally:
            eng.shutdown()


def test_tp2_window_only_load(gemma) -> None:
    """Prompts whose full KV stayed on L1 but whose last windows lost their window pages under pressure are
    whole L1 hits asked again, their windows restored from L2 on every rank (a ``window_load`` move): HF's
    tokens (serving/cache/request_windows.py, ``restore``)."""
    path, ps, others, ref = gemma
    eng = Engine(model_path=str(path), page_size=PS, max_total_tokens=1024, hicache_ratio=4.0,
                 hicache_write_policy="write_through", write_through_threshold=1, max_running_requests=2,
                 enable_hybrid_swa_memory=True, swa_full_tokens_ratio=0.04, tp_size=2)
    try:
        assert ids_of(generate_checked(eng, ps, GREEDY)) == ref
        generate_checked(eng, others, GREEDY)
        rw = eng.core.req_cache.windows
        outs = generate_checked(eng, ps, GREEDY)
        assert ids_of(outs) == ref
        assert rw.restored_pages > 0
        assert sum(o["meta_info"]["cached_tokens_details"]["device"] for o in outs) > 0
        assert eng.core.tree.host_pinned == 0
    finally:
        eng.shutdown()
