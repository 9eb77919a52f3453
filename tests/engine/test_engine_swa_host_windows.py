"""L2 and L3 of the hybrid SWA L1 (hicache/tiers/host_windows.py, hicache/tiers/storage_windows.py): L2's
pages hold the full layers and a host window pool much smaller than L2 holds the sliding layers' part of the
pages that keep one; L3 stores a page without a kept sliding part as a smaller value. A tiny random Gemma-3
(2 sliding layers with an 8-token window to 1 full) and Mistral (every layer an 8-token window), float32 on
CPU, page size 4, prompts of 40-60 tokens: HF's greedy tokens from L2 and from L3 after a restart, cached hits,
fewer L2 and L3 bytes than with every layer, host window pages dropped (LRU) before L2 pages under pressure;
check_integrity() after every step."""

from __future__ import annotations

import pytest

from harness.engine_cases import generate_checked, ids_of, window_case
from serving.cache.l3_windows import L3Windows
from serving.engine import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
PS = 4
RATIO = 0.1  # --swa-full-tokens-ratio: 6 window pages of L1's 64 (a 256-token L1), 26 host window pages of L2's 256


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def tiny(request, tmp_path_factory):
    return window_case(request.param, tmp_path_factory.mktemp(request.param), GREEDY["max_new_tokens"])


def _engine(path, tmp_path=None, **kw) -> Engine:
    l3 = {} if tmp_path is None else {
        "hicache_storage_backend": "lmdb", "hicache_storage_prefetch_policy": "wait_complete",
        "hicache_storage_backend_extra_config": {"path": str(tmp_path / "l3"), "capacity_gb": 0.05,
                                                 "initial_map_mb": 1},
        "hicache_storage_prefetch_threshold": 8, "hicache_storage_load_policy": "always_load"}
    args = {"model_path": str(path), "page_size": PS, "max_total_tokens": 256, "hicache_ratio": 4.0,
            "hicache_write_policy": "write_through", "write_through_threshold": 1, "max_running_requests": 2,
            "enable_hybrid_swa_memory": True, "swa_full_tokens_ratio": RATIO, **l3}
    return Engine(**{**args, **kw})


def _host_pages(eng: Engine) -> tuple[int, int]:
    """(L2 pages the tree holds, how many of them keep a sliding part)."""
    hw = eng.core.host_pool.windows
    pages = [p for nd in eng.core.tree.nodes() if nd.host_pages is not None for p in nd.host_pages]
    return len(pages), sum(1 for p in pages if hw.has(p))


def test_l2_and_l3_hits_are_exact_with_a_small_host_window_pool(tiny, tmp_path) -> None:
    """L1 holds 6 window pages (two windows): the window pages of finished prompts are dropped while the next
    ones run, each node demoted to L2 first (its window KV into a host window page), so the latest prompts
    asked again resume from L2 (without the demotion their L2 copies kept no sliding part: recomputed); the
    first ones, whose host window pages the later backups reclaimed (LRU), come back from L3 after a restart."""
    _, path, ps, others, ref, ref_o = tiny
    eng = _engine(path, tmp_path)
    try:
        host = eng.core.host_pool
        assert host.windows is not None and host.num_pages == 256 and host.windows.num_pages == 26
        assert ids_of(generate_checked(eng, ps, GREEDY)) == ref
        assert ids_of(generate_checked(eng, others, GREEDY)) == ref_o  # pushes ps out of L1
        held, kept = _host_pages(eng)
        assert kept <= host.windows.num_pages < held // 2, (held, kept)  # most L2 pages keep no sliding part
        eng.core.tree.evict_device(eng.core.tree.cached_pages("device"))  # every prompt from L2 now
        eng.core.req_cache.flush_transfers()
        outs = generate_checked(eng, others[-4:-2], GREEDY)  # their window pages left L1 before they did
        assert ids_of(outs) == ref_o[-4:-2]
        assert all(o["meta_info"]["cached_tokens_details"]["host"] > 0 for o in outs), [o["meta_info"] for o in outs]
        eng.core.storage.poll(wait=True)
        eng.check_integrity()
        stats, full_value = eng.core.storage_stats(), eng.core.storage.tier.codec.value_nbytes
        assert stats["stored"] > 0 and stats["bytes_written"] < stats["stored"] * full_value  # short values
    finally:
        eng.shutdown()
    eng = _engine(path, tmp_path)  # a restart: L1 and L2 empty
    try:
        outs = eng.generate(input_ids=ps, sampling_params=GREEDY)
        assert ids_of(outs) == ref
        # a prompt whose last window's pages were stored without their sliding part is cut (recomputed)
        assert sum(o["meta_info"]["cached_tokens_details"]["storage"] for o in outs) > 0, [o["meta_info"] for o in outs]
        eng.check_integrity()
        assert eng.core.storage_stats()["corrupt"] == 0
    finally:
        eng.shutdown()


def test_l2_bytes_are_smaller_than_with_every_layer(tiny) -> None:
    """The same L2 pages (sized against L1) in fewer bytes; sized in GiB, more pages in the same bytes."""
    name, path, _, _, _, _ = tiny
    on, off = _engine(path), _engine(path, disable_hybrid_swa_memory=True)
    try:
        a, b = on.core.host_pool, off.core.host_pool
        assert off.core.runner.pool.windows is None and b.windows is None
        assert a.num_pages == b.num_pages
        sliding = 1.0 if name == "mistral" else 2 / 3
        want = b.nbytes() * (1 - sliding * (1 - a.windows.num_pages / a.num_pages))
        assert a.nbytes() < b.nbytes() and abs(a.nbytes() - want) / want < 0.01, (a.nbytes(), b.nbytes())
    finally:
        on.shutdown()
        off.shutdown()
    gib = 2 * 1024 * b.bytes_per_page / 2**30  # room for 2048 pages of every layer
    on = _engine(path, hicache_size=gib)
    try:
        host = on.core.host_pool
        assert host.num_pages > 2048 and host.nbytes() <= gib * 2**30
    finally:
        on.shutdown()


def _backup_all(eng: Engine) -> None:
    eng.core.tree.backup_all()
    eng.core.req_cache.flush_transfers()
    eng.check_integrity()


def test_host_window_pressure_drops_window_parts_before_pages(tiny) -> None:
    """A host window pool of 15 pages for 153 L2 pages (L1: 256 pages, 25 window pages): the later
    prompts' backups reclaim the least recently used nodes' host window pages; no L2 page is evicted for them
    (L2 never fills), and the prompts asked again give HF's tokens (a match is cut where its last window lost
    its sliding part)."""
    _, path, ps, others, ref, _ = tiny
    eng = _engine(path, max_total_tokens=1024, hicache_ratio=0.6)
    try:
        hw = eng.core.host_pool.windows
        assert hw.num_pages == 15 and eng.core.host_pool.num_pages == 153
        assert ids_of(generate_checked(eng, ps, GREEDY)) == ref
        _backup_all(eng)
        first, _ = _host_pages(eng)
        newest = eng.core.tree.lookup(ps[-1])[0]
        assert first > 0 and any(hw.has(p) for p in newest.host_pages)
        ids_of(generate_checked(eng, others, GREEDY))
        _backup_all(eng)
        held, kept = _host_pages(eng)
        tree = eng.core.tree
        # every page stayed on L2 (L1 may have dropped some for window room: they live on L2)
        assert held == tree.cached_pages("host") >= max(tree.cached_pages("device"),
                                                        first + sum(len(o) // PS - 1 for o in others))
        assert kept == 15 - hw.num_free and hw.reclaimed > 0
        assert not any(hw.has(p) for p in newest.host_pages)  # older than every ``others`` node: reclaimed
        before = eng.core.tree.cached_pages("host")
        freed = eng.core.req_cache.windows.make_host_room(5)
        assert freed >= 5 and eng.core.tree.cached_pages("host") == before  # window parts alone
        eng.check_integrity()
        assert ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY)) == ref
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_a_server_without_the_window_pool_reads_short_values_as_misses(tiny, tmp_path) -> None:
    """L3 values written without their sliding part are a miss (not corrupt, not deleted) for a server with
    the window pool off sharing the store; it recomputes and answers HF's tokens."""
    _, path, ps, _, ref, _ = tiny
    eng = _engine(path, tmp_path)
    try:
        assert ids_of(generate_checked(eng, ps, GREEDY)) == ref
    finally:
        eng.shutdown()
    off = _engine(path, tmp_path, disable_hybrid_swa_memory=True)
    try:
        assert ids_of(generate_checked(off, ps, GREEDY)) == ref
        assert off.core.storage_stats()["corrupt"] == 0
    finally:
        off.shutdown()


def test_an_early_load_leaves_one_requests_window_pages_free(tiny) -> None:
    """An L3 prefetch's early L2 -> L1 load gives window pages to its run's last window, never below one
    request's need (``min_window_pages``): the fetch keeps those nodes locked until its request is admitted,
    and 4 restarted prompts whose fetches took all 7 window pages waited for one another for ever."""
    from hicache.tiers.window_pages import min_window_pages

    _, path, ps, _, _, _ = tiny
    eng = _engine(path)
    try:
        generate_checked(eng, ps[:1], GREEDY)
        _backup_all(eng)  # the prompt's last window now has its sliding part on L2
        rw = eng.core.req_cache.windows
        pool = rw.windows
        pool.drop(range(len(pool.map)))  # as after a restart: no window page on L1
        tree = eng.core.tree
        after = tree.match_prefix(ps[0])
        assert after.device_hit_tokens > 0 and pool.num_free == pool.num_pages == 7
        L3Windows(rw).on_early_load(tree.match_prefix([]), after)
        need = min_window_pages(rw.window, PS)
        assert pool.num_free >= need, (pool.num_free, need)
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_an_end_stored_without_its_window_is_stored_whole_once_computed_again(tiny, tmp_path) -> None:
    """A prompt backed up while the host window pool had nothing to give goes to L3 short (no sliding part).
    Computed again by a server that does not read L3 (no prefetch), its last window's pages, backed up with
    their sliding parts now, are written over the short values (``WriteBack._present``), so after a restart
    it comes back from L3 whole. Before, the write skipped every page L3 held already: the short values
    stayed for good (a conversation that lost its window once recomputed whole at every later turn)."""
    _, path, ps, _, ref, _ = tiny
    eng = _engine(path, tmp_path)
    try:
        hw = eng.core.host_pool.windows
        hw.reclaim, reclaim = None, hw.reclaim
        held = hw.allocator.alloc(hw.num_free)  # the host window pool has none to give
        assert ids_of(eng.generate(input_ids=ps[:1], sampling_params=GREEDY)) == ref[:1]
        eng.core.tree.backup_all()  # (check_integrity would count the held host window pages as lost)
        eng.core.req_cache.flush_transfers()
        eng.core.storage.persist_all()
        hw.allocator.free(held)
        hw.reclaim = reclaim
        eng.check_integrity()
        assert hw.not_kept > 0
    finally:
        eng.shutdown()
    eng = _engine(path, tmp_path, hicache_storage_prefetch_threshold=10**6)  # L3 not read: recomputed
    try:
        outs = generate_checked(eng, ps[:1], GREEDY)
        assert ids_of(outs) == ref[:1]
        assert outs[0]["meta_info"]["cached_tokens"] < len(ps[0]) - 2 * PS, outs[0]["meta_info"]
        _backup_all(eng)
        eng.core.storage.persist_all()
        eng.check_integrity()
    finally:
        eng.shutdown()
    eng = _engine(path, tmp_path)
    try:
        outs = generate_checked(eng, ps[:1], GREEDY)
        assert ids_of(outs) == ref[:1]
        assert outs[0]["meta_info"]["cached_tokens_details"]["storage"] == (len(ps[0]) - 1) // PS * PS, \
            outs[0]["meta_info"]
        eng.check_integrity()
    finally:
        eng.shutdown()
