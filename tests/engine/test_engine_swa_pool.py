"""The hybrid SWA L1 (hicache/tiers/window_pages.py, serving/cache/request_windows.py): the sliding layers
of a tiny random Gemma-3 (2 sliding layers with an 8-token window to 1 full) and Mistral (every layer
an 8-token window) keep their KV in a window pool only where a window can still read it, float32 on
CPU, page size 4. What the pool holds, the cut of a match whose window was evicted, small window pools
under concurrency, and the flag that turns it off -- every answer HF's greedy tokens, check_integrity()
after every step."""

from __future__ import annotations

import random

import pytest

from harness.engine_cases import generate_checked, ids_of, tier_prompts
from harness.model_utils import hf_greedy, tiny_model
from serving.engine import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
WINDOW, PS = 8, 4
PER_WINDOW = -(-(WINDOW - 1) // PS) + 1  # pages overlapping the window before a page boundary


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def tiny(request, tmp_path_factory):
    path = tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    ps, _ = tier_prompts()
    return path, ps, hf_greedy(path, ps, GREEDY["max_new_tokens"])


def test_a_long_decode_keeps_about_one_window(tiny) -> None:
    """One request decodes 60 tokens past a 47-token prompt: the tree then holds all its full pages but
    window pages only for the window before its prompt's end and before its own end (today: every page)."""
    path, ps, _ = tiny
    long = {"temperature": 0, "max_new_tokens": 60, "ignore_eos": True}
    ref = hf_greedy(path, ps[:1], 60)
    eng = Engine(model_path=str(path), page_size=PS, max_total_tokens=1024, enable_hybrid_swa_memory=True)
    try:
        pool = eng.core.runner.pool
        assert pool.window_pages == 205 and pool.num_pages == 256  # --swa-full-tokens-ratio 0.8
        assert ids_of(generate_checked(eng, ps[:1], long)) == ref
        cached = eng.core.tree.cached_pages("device")
        held = pool.windows.allocator.num_used
        assert cached >= (len(ps[0]) + 59) // PS
        assert held <= 2 * PER_WINDOW, (held, cached)
    finally:
        eng.shutdown()
    off = Engine(model_path=str(path), page_size=PS, max_total_tokens=1024, enable_hybrid_swa_memory=True,
                 disable_hybrid_swa_memory=True)
    try:
        assert off.core.runner.pool.windows is None
        assert ids_of(off.generate(input_ids=ps[:1], sampling_params=long)) == ref
        assert off.core.tree.cached_pages("device") == cached  # the same pages, every layer of them
    finally:
        off.shutdown()


def test_match_is_cut_where_window_pages_were_evicted(tiny) -> None:
    path, ps, ref = tiny
    eng = Engine(model_path=str(path), page_size=PS, max_total_tokens=1024, enable_hybrid_swa_memory=True)
    try:
        assert ids_of(generate_checked(eng, ps, GREEDY)) == ref
        windows = eng.core.req_cache.windows
        held = windows.windows.allocator.num_used
        assert held > 0 and windows.make_room(held) == held  # every window page the tree holds goes (alone)
        assert eng.core.runner.pool.windows.allocator.num_used == 0
        assert eng.core.tree.cached_pages("device") > 0  # the full layers' pages stay
        again = eng.generate(input_ids=ps, sampling_params=GREEDY)
        assert ids_of(again) == ref
        # a match may still resume where no window is needed: the first page ends before any window matters
        assert all(o["meta_info"]["cached_tokens_details"]["device"] <= PS for o in again), \
            [o["meta_info"] for o in again]
        third = eng.generate(input_ids=ps, sampling_params=GREEDY)  # the second run's windows are back
        assert ids_of(third) == ref
        assert all(o["meta_info"]["cached_tokens_details"]["device"] >= 40 for o in third)
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_small_window_pool_concurrent_shared_prefix_chunked(tiny) -> None:
    """A window pool of 40 pages for 256 logical ones, four requests sharing a 36-token prefix, chunks of 7
    (boundaries inside windows), asked twice: exact, the second time from L1."""
    path, _, _ = tiny
    rng = random.Random(8)
    shared = [rng.randrange(1, 511) for _ in range(36)]
    sharing = [shared + [rng.randrange(1, 511) for _ in range(n)] for n in (3, 9, 14, 21)]
    ref = hf_greedy(path, sharing, 10)
    eng = Engine(model_path=str(path), page_size=PS, max_total_tokens=1024, enable_hybrid_swa_memory=True,
                 swa_full_tokens_ratio=40 / 256,
                 chunked_prefill_size=7, max_running_requests=4)
    try:
        assert eng.core.runner.pool.window_pages == 40
        assert ids_of(generate_checked(eng, sharing, GREEDY)) == ref
        outs = eng.generate(input_ids=sharing[::-1], sampling_params=GREEDY)
        assert ids_of(outs) == ref[::-1]
        assert sum(o["meta_info"]["cached_tokens_details"]["device"] for o in outs) > 0
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_prefixes_come_back_from_l2_and_from_l3_after_a_restart(tiny, tmp_path) -> None:
    """With the window pool, prefixes demoted to L2 (a small L1) and read from L3 by a restarted engine
    carry their sliding layers' KV (the host page's sliding part, flagged valid): HF's tokens, hits."""
    path, ps, ref = tiny
    _, others = tier_prompts()
    l3 = {"hicache_storage_backend": "lmdb", "hicache_storage_prefetch_policy": "wait_complete",
          "hicache_storage_backend_extra_config": {"path": str(tmp_path / "l3"), "capacity_gb": 0.05,
                                                   "initial_map_mb": 1},
          "hicache_storage_prefetch_threshold": 8, "hicache_storage_load_policy": "always_load"}

    def engine(**kw) -> Engine:
        return Engine(model_path=str(path), page_size=PS, max_total_tokens=256, hicache_ratio=4.0,
                      hicache_write_policy="write_through", write_through_threshold=1, max_running_requests=2,
                      enable_hybrid_swa_memory=True, **l3, **kw)

    eng = engine()
    try:
        assert eng.core.runner.pool.windows is not None  # the window pool is on
        assert ids_of(generate_checked(eng, ps, GREEDY)) == ref
        eng.generate(input_ids=others, sampling_params=GREEDY)  # pushes ps out of L1
        outs = eng.generate(input_ids=ps, sampling_params=GREEDY)
        assert ids_of(outs) == ref
        assert sum(o["meta_info"]["cached_tokens_details"]["host"] for o in outs) > 0, [o["meta_info"] for o in outs]
        eng.core.storage.poll(wait=True)
        eng.check_integrity()
    finally:
        eng.shutdown()
    eng = engine()  # a restart: L1 and L2 empty
    try:
        outs = eng.generate(input_ids=ps, sampling_params=GREEDY)
        assert ids_of(outs) == ref
        assert all(o["meta_info"]["cached_tokens_details"]["storage"] > 0 for o in outs), [o["meta_info"] for o in outs]
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_a_prompt_longer_than_the_window_pool_runs_in_chunks_that_fit(tiny) -> None:
    """A 120-token prompt (30 pages) in one pass would need 30 window pages, more than the 26-page window pool
    (a 256-token L1, ratio 0.4) will ever have free: it never ran (a stall). Its passes are now cut so their
    window pages fit (ReqCache.chunk), and it gives HF's tokens."""
    path = tiny[0]
    rng = random.Random(17)
    prompt = [rng.randrange(1, 511) for _ in range(120)]
    ref = hf_greedy(path, [prompt], GREEDY["max_new_tokens"])
    eng = Engine(model_path=str(path), page_size=PS, max_total_tokens=256, enable_hybrid_swa_memory=True,
                 swa_full_tokens_ratio=0.4)
    try:
        windows = eng.core.runner.pool.windows
        assert windows is not None and windows.num_pages == 26
        from serving.structs.request import Req
        from serving.structs.sampling_params import SamplingParams

        probe = Req("probe", prompt, SamplingParams())
        assert eng.core.req_cache.chunk(probe, 120) <= (26 - 2 * PER_WINDOW - 1) * PS  # the cut
        assert ids_of(generate_checked(eng, [prompt], GREEDY)) == ref
    finally:
        eng.shutdown()


def test_a_window_pool_smaller_than_one_request_needs_is_refused(tiny) -> None:
    """Two windows and a page (2 x 3 + 1 = 7 pages of 4 tokens for an 8-token window): one page less and
    a request that decodes past its prompt would wait for window pages for ever."""
    path = tiny[0]
    with pytest.raises(ValueError, match=r"window pool: 6 pages .* less than one request needs: 7 pages"):
        Engine(model_path=str(path), page_size=PS, max_total_tokens=1024, enable_hybrid_swa_memory=True,
               swa_full_tokens_ratio=6 / 256)


def _within(seconds: float, run):  # noqa: ANN001, ANN202
    """``run()`` in a thread; its result, or AssertionError if it is still running after ``seconds``
    (a stalled engine: no pass ever runs)."""
    import threading

    box: list = []

    def target() -> None:
        try:
            box.append(run())
        except BaseException as e:  # noqa: BLE001 (raised below, in the test's thread)
            box.append(e)
    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s: the engine stalled"
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def test_prompts_in_chunks_never_wait_for_one_another_in_the_smallest_window_pool(tiny) -> None:
    """10 prompts, 4 running, a window pool of one request's need: each prompt's chunks take window pages
    while the others hold theirs; before, every running request waited for window pages for ever (no pass
    ran: the engine hung). A chunk that finds no room now retracts younger prefilling requests."""
    path, ps, ref = tiny
    _, others = tier_prompts()
    eng = Engine(model_path=str(path), page_size=PS, max_total_tokens=1024, enable_hybrid_swa_memory=True,
                 swa_full_tokens_ratio=7 / 256, max_running_requests=4)
    try:
        outs = _within(240, lambda: generate_checked(eng, ps + others, GREEDY))
        assert ids_of(outs)[:len(ps)] == ref
        assert eng.core.scheduler.stats.retractions > 0
    finally:
        eng.shutdown()


def test_the_smallest_window_pool_serves_concurrent_chunked_prompts_and_l2_returns(tiny) -> None:
    """The window pool at exactly one request's need, 10 prompts 4 at a time in 8-token chunks, then 4 of
    the latest 4 back from L2: requests in chunks that each held part of the pool used to wait for one another
    for ever (a chunk now retracts younger prefilling requests, as decode does), and an L2 load that found
    no window pages for its last window raised; now every answer is HF's."""
    path, ps, ref = tiny
    _, others = tier_prompts()
    eng = Engine(model_path=str(path), page_size=PS, max_total_tokens=1024, enable_hybrid_swa_memory=True,
                 swa_full_tokens_ratio=7 / 256, chunked_prefill_size=8, max_running_requests=4, hicache_ratio=4.0,
                 hicache_write_policy="write_through", write_through_threshold=1)
    try:
        assert eng.core.runner.pool.window_pages == 7
        first = _within(240, lambda: generate_checked(eng, ps + others, GREEDY))  # 10 prompts, 4 at a time
        assert ids_of(first)[:len(ps)] == ref
        eng.core.tree.evict_device(eng.core.tree.cached_pages("device"))  # everything to L2
        # the latest prompts (the host window pool keeps the most recent windows: the first prompts' were
        # reclaimed for the later ones' demotions)
        again = _within(240, lambda: generate_checked(eng, others[-4:], GREEDY))
        assert ids_of(again) == hf_greedy(path, others[-4:], GREEDY["max_new_tokens"])
        assert sum(o["meta_info"]["cached_tokens_details"]["host"] for o in again) > 0
    finally:
        eng.shutdown()
