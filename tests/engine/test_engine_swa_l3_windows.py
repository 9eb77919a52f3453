"""Returning conversations of a sliding-window model whose last windows only L3 still holds whole (the hybrid SWA
L1 with a host window pool far smaller than the conversations: serving/cache/l3_windows.py, ``fetch_room``,
``for_fetch``, ``cut_stale_tail``; serving/cache/req_cache.py's re-armed prefetch after NO_ROOM). A tiny random
Gemma-3 (an 8-token window, page size 4), float32 on CPU, 16 conversations of 44-56 tokens, L1 of 64 pages with
7 window pages, L2 of 128 pages with 13 host window pages (about 4 windows), LMDB L3: the second turn of every
conversation gets HF's greedy tokens, ``check_integrity()`` after every step, and most of its prompt from the
cache, where a fetch that landed without window room, or a request that found no L1 room after its fetch, used to
lose its last window and recompute nearly everything (0.17-0.19 of the prompts cached; now 0.75-0.79)."""

from __future__ import annotations

import time

from harness.engine_cases import generate_checked, ids_of, lmdb_l3, prompts
from harness.model_utils import hf_greedy, tiny_model
from serving.engine import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


def test_returning_turns_get_their_last_windows_from_l3(tmp_path) -> None:
    path = tiny_model(tmp_path, "gemma3")
    first = prompts(16, 512, seed=21, lo=44, hi=56)
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=256, hicache_ratio=2.0,
                 hicache_write_policy="write_through", enable_hybrid_swa_memory=True, swa_full_tokens_ratio=0.1,
                 max_running_requests=4, **lmdb_l3(tmp_path / "l3"))
    try:
        host = eng.core.host_pool
        assert host.windows is not None and host.windows.num_pages * 4 < 16 * 8  # far fewer windows than turns
        outs = generate_checked(eng, first, GREEDY)
        assert ids_of(outs) == hf_greedy(path, first, GREEDY["max_new_tokens"])
        eng.core.storage.poll(wait=True)  # the users read the answers: the write-backs land
        again = [p + o["output_ids"] + [7, 9, 11] for p, o in zip(first, outs, strict=True)]
        outs = generate_checked(eng, again, GREEDY)
        assert ids_of(outs) == hf_greedy(path, again, GREEDY["max_new_tokens"])
        cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
        assert cached >= 0.6 * sum(len(p) for p in again), [o["meta_info"]["cached_tokens_details"] for o in outs]
        assert sum(o["meta_info"]["cached_tokens_details"]["storage"] for o in outs) > 0
        eng.core.storage.poll(wait=True)
        assert eng.core.tree.host_pinned == 0
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_later_turns_are_exact_and_refetch_windows_dropped_above_l3(tmp_path, monkeypatch) -> None:
    """Four turns of the same 16 conversations, for each of four prompt seeds: every turn's greedy tokens are
    HF's, no L2 -> L1 load gives a page a window page without copying its sliding part into it, and turns
    three and four come mostly from the cache.

    Exactness: making window room for a match's load backs L1 pages up, and their host window pages came
    from the least recently used nodes', those of the match itself when it had split a node (an L3 fetch's
    run); the load left stale rows in the window pages the request then read (wrong tokens, about one run in
    five at the fourth turn). Reuse: a waiting request whose last window was dropped from L1 while it waited
    (and reclaimed from L2) refetches it from L3, L1 tail and all (``_recheck`` through the window cut,
    ``drop_tail_for_l3``); window pages go first where their KV is safe elsewhere (L1 windows whose L2 copy
    keeps them, host windows of pages on L3 or on L1 too: ``_drop_windows``, ``make_host_room``), so the
    backups of sequence ends find host window pages. Before, whole conversations were recomputed: 0.44-0.58
    of those turns' prompts cached (the mean of the two, seed 21, six runs). Which windows survive depends on
    when each fetch lands against the other requests' steps, so one seed's share varies from run to run (0.77
    to 0.92 on the 2-vCPU Xeon, 0.65 once under the suite's load): the floor is on the mean over the seeds
    (0.85-0.86 alone, 0.84-0.87 beside three busy processes), each seed's on what no run of the fixed code
    came near."""
    from serving.kernels.page_copy import PageMover

    stale: list[tuple[int, int]] = []
    load = PageMover.host_to_device

    def spied(self, host_pages, device_pages, non_blocking=False, full=True):  # noqa: ANN001, ANN202
        if self.windows is not None and self.hwin is not None:
            m, hm = self.windows.map, self.hwin.map
            stale.extend((d, h) for d, h in zip(device_pages, host_pages, strict=True) if m[d] >= 0 and hm[h] < 0)
        return load(self, host_pages, device_pages, non_blocking, full)

    monkeypatch.setattr(PageMover, "host_to_device", spied)
    path = tiny_model(tmp_path, "gemma3")
    later: dict[int, float] = {}  # seed -> the mean share of turns three and four
    for seed in (21, 23, 24, 25):
        cur = prompts(16, 512, seed=seed, lo=44, hi=56)
        eng = Engine(model_path=str(path), page_size=4, max_total_tokens=256, hicache_ratio=2.0,
                     hicache_write_policy="write_through", enable_hybrid_swa_memory=True, swa_full_tokens_ratio=0.1,
                     max_running_requests=4, **lmdb_l3(tmp_path / f"l3-{seed}"))
        try:
            shares = []
            for turn in range(4):
                outs = generate_checked(eng, cur, GREEDY)
                assert ids_of(outs) == hf_greedy(path, cur, GREEDY["max_new_tokens"]), (seed, turn)
                assert not stale, (seed, turn, stale)
                shares.append(sum(o["meta_info"]["cached_tokens"] for o in outs) / sum(len(p) for p in cur))
                eng.core.storage.poll(wait=True)
                cur = [p + o["output_ids"] + [7, 9, 11 + turn] for p, o in zip(cur, outs, strict=True)]
            later[seed] = (shares[2] + shares[3]) / 2
            assert eng.core.tree.host_pinned == 0
            eng.check_integrity()
        finally:
            eng.shutdown()
    assert sum(later.values()) / len(later) >= 0.67 and min(later.values()) >= 0.5, later


def test_waiting_requests_never_leave_the_engine_idle(tmp_path, monkeypatch) -> None:
    """24 conversations of 512 tokens come back three times, all at once (a Gemma-3 of 6 layers with a 128-token
    window, page size 16; L1 of 1536 tokens, its window pool 0.2 of it; L2 of 4 MB, about a window and a half per
    conversation's end in its host window pool; an LMDB L3 slower than the prefill): no scheduler step finds
    requests waiting while nothing runs, no fetch or L3 lookup is in flight and no L3 write is landing (the first
    step of a turn aside, before its lookups start). L3 fetches used to wait for L2 or host window room that only
    the other waiting requests held (pinned: their cached prefixes), so the engine idled until the prefetch
    deadline (here 5 s): turns of 30 s and 20 s with a 10 s deadline instead of about 2.5 s."""
    from harness.model_utils import tiny_model as make
    from hicache.tiers.lmdb.store import LMDBStore
    from serving.scheduler import scheduler as sc

    eng = None
    idle = [0]
    step = sc.Scheduler.step

    def counted(self):  # noqa: ANN001, ANN202
        if eng is not None and self.waiting and not self.running:
            looking = any(r.kv.prefetch is not None and r.kv.prefetch.lookup is not None
                          and not r.kv.prefetch.lookup.done() for r in self.waiting)
            if not (eng.core.req_cache.prefetcher.fetches.active or eng.core.storage.writeback.landing or looking):
                idle[0] += 1
        return step(self)

    monkeypatch.setattr(sc.Scheduler, "step", counted)
    for name in ("batch_set", "batch_set_parts"):  # a store slower than the prefill (as the GPU's is)
        real = getattr(LMDBStore, name)
        monkeypatch.setattr(LMDBStore, name,
                            lambda self, *a, _real=real, **kw: time.sleep(0.05) or _real(self, *a, **kw))
    path = make(tmp_path, "gemma3", sliding_window=128, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64)
    eng = Engine(model_path=str(path), page_size=16, max_total_tokens=1536, hicache_size=0.004,
                 enable_hybrid_swa_memory=True, swa_full_tokens_ratio=0.2, max_running_requests=16,
                 chunked_prefill_size=512, **{**lmdb_l3(tmp_path / "l3"), "hicache_storage_prefetch_timeout_base": 5.0})
    try:
        cur = prompts(24, 500, seed=31, lo=512, hi=512)
        more = prompts(72, 500, seed=32, lo=32, hi=32)
        for turn in range(4):
            outs = eng.generate(input_ids=cur, sampling_params=GREEDY)
            eng.core.storage.poll(wait=True)
            eng.check_integrity()
            cur = [p + o["output_ids"] + more[3 * i + min(turn, 2)] for i, (p, o) in enumerate(zip(cur, outs,
                                                                                                  strict=True))]
        assert idle[0] <= 2 * 4, idle[0]
        assert eng.core.tree.host_pinned == 0
    finally:
        eng.shutdown()
