"""A window-only load-back (serving/cache/request_windows.py, ``restore``): a prefix whose full KV is still on
L1 but whose last window lost its window pages under window-pool pressure resumes at its end, its sliding
layers' KV of that window copied back from its L2 copy (the demotion before the drop put it there), instead of
being cut and recomputed. A tiny random Gemma-3 (2 sliding layers with an 8-token window to 1 full) and Mistral
(every layer an 8-token window), float32 on CPU, page size 4, prompts of 40-60 tokens: HF's greedy tokens, the
whole prefix an L1 hit, check_integrity() after every step; two requests sharing a prefix whose window is still
loading; no L2 page left pinned."""

from __future__ import annotations

import pytest

from harness.engine_cases import generate_checked, hits, ids_of, window_case
from harness.model_utils import hf_greedy
from serving.engine import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
PS = 4


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def tiny(request, tmp_path_factory):
    return window_case(request.param, tmp_path_factory.mktemp(request.param), GREEDY["max_new_tokens"])


def _engine(path, **kw) -> Engine:
    # L1: 256 pages, 10 window pages (two requests' windows); L2: 1024 pages, 40 host window pages
    args = {"model_path": str(path), "page_size": PS, "max_total_tokens": 1024, "hicache_ratio": 4.0,
            "hicache_write_policy": "write_through", "write_through_threshold": 1, "max_running_requests": 2,
            "enable_hybrid_swa_memory": True, "swa_full_tokens_ratio": 0.04}
    return Engine(**{**args, **kw})


def _windowless(eng: Engine, prompt: list[int]) -> int:
    """How many pages the last window of ``prompt``'s prefix has when the prefix is all on L1 with no window
    page in that window (the pressure's work); else 0."""
    rw = eng.core.req_cache.windows
    node, matched = eng.core.tree.lookup(prompt[:-1])
    pages = [p for nd in reversed(node.path_to_root()) if nd.device_pages is not None for p in nd.device_pages]
    end = matched // PS
    last = pages[rw.first_needed(end * PS): end]
    return len(last) if len(pages) >= end and last and all(rw.windows.map[p] < 0 for p in last) else 0


def test_a_windowless_l1_prefix_resumes_at_its_end(tiny) -> None:
    """The 4 prompts, then 6 others whose windows push theirs out of the window pool (their full KV stays on
    L1): asked again they are whole L1 hits, their last windows restored from L2, with HF's tokens."""
    _, path, ps, others, ref, ref_o = tiny
    eng = _engine(path)
    try:
        assert ids_of(generate_checked(eng, ps, GREEDY)) == ref
        assert ids_of(generate_checked(eng, others, GREEDY)) == ref_o
        back = [i for i, p in enumerate(ps) if _windowless(eng, p)]
        assert len(back) >= 2, back  # the setup this test is about
        before = eng.core.tree.cached_pages("device")
        outs = generate_checked(eng, [ps[i] for i in back], GREEDY)
        assert ids_of(outs) == [ref[i] for i in back]
        want = [(len(ps[i]) - 1) // PS * PS for i in back]
        assert hits(outs, "device") == want, [o["meta_info"] for o in outs]
        rw = eng.core.req_cache.windows
        assert rw.restored_pages > 0 and eng.core.tree.cached_pages("device") >= before
        assert eng.core.tree.host_pinned == 0  # the loads' pins are gone
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_requests_sharing_a_prefix_whose_window_is_loading(tiny) -> None:
    """Two requests with one windowless prefix admitted together: one window load, and the second, admitted
    while it may still be in flight, waits for it (it finds the window pages the first one's restore took;
    whether the copy has landed by then is the loader thread's timing); HF's tokens for both."""
    _, path, ps, others, ref, _ = tiny
    eng = _engine(path)
    try:
        generate_checked(eng, ps, GREEDY)
        generate_checked(eng, others, GREEDY)
        i = next(i for i, p in enumerate(ps) if _windowless(eng, p))
        n = _windowless(eng, ps[i])
        rw, started, flying = eng.core.req_cache.windows, [], []
        restore = rw.restore

        def spy(m):  # noqa: ANN001, ANN202 - every window load still in flight is among what an admission waits for
            before = [w for w in started if not w.done()]
            got = restore(m)
            flying.append(len(before))
            assert got is not None and all(w in got for w in before), (before, got)
            started.extend(w for w in got if w not in started)
            return got

        rw.restore = spy
        outs = generate_checked(eng, [ps[i], ps[i]], GREEDY)
        assert len(started) == 1 and len(flying) == 2, (started, flying)
        assert ids_of(outs) == [ref[i], ref[i]]
        assert hits(outs, "device") == [(len(ps[i]) - 1) // PS * PS] * 2
        assert rw.restored_pages == n  # one load, both read it
        assert eng.core.tree.host_pinned == 0
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_without_an_l2_copy_the_match_is_cut(tiny) -> None:
    """No L2 (nothing to restore from): the window pages dropped under pressure are gone, the match is cut
    where the last window lost them and the rest is recomputed (HF's tokens, fewer cached tokens)."""
    _, path, ps, others, ref, _ = tiny
    eng = _engine(path, hicache_ratio=0)
    try:
        generate_checked(eng, ps, GREEDY)
        generate_checked(eng, others, GREEDY)
        i = next(i for i, p in enumerate(ps) if _windowless(eng, p))
        outs = generate_checked(eng, [ps[i]], GREEDY)
        assert ids_of(outs) == [ref[i]]
        assert hits(outs, "device")[0] < (len(ps[i]) - 1) // PS * PS
        assert eng.core.req_cache.windows.restored_pages == 0
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_an_l2_run_not_loaded_resumes_where_its_l1_part_has_windows(tiny) -> None:
    """A match whose L2 run is not loaded back (L1 has no room for it: forced here, as the tree answers when
    no page can be freed) resumes at its L1 part only where the window before has its window KV (or can be
    restored), else earlier: HF's tokens. Before, it resumed at the end of its L1 part whatever its windows
    held, and the sliding layers read window pages that were not there (wrong tokens)."""
    import random

    _, path, _, _, _, _ = tiny
    rng = random.Random(5)
    shared = [rng.randrange(1, 511) for _ in range(40)]
    two = [shared + [rng.randrange(1, 511) for _ in range(n)] for n in (20, 24)]
    ref = hf_greedy(path, two, GREEDY["max_new_tokens"])
    eng = _engine(path)
    try:
        assert ids_of(generate_checked(eng, two, GREEDY)) == ref
        tree = eng.core.tree
        tree.evict_device(12)  # the two suffixes leave L1 (their L2 copies stay); the shared 40 tokens stay
        eng.core.req_cache.flush_transfers()
        m = tree.match_prefix(two[0][:-1])
        assert m.device_hit_tokens == 40 and m.host_hit_tokens > 0, m
        tree.load_back = lambda match: match  # no L1 room for any L2 run
        outs = generate_checked(eng, two, GREEDY)
        assert ids_of(outs) == ref, [o["meta_info"] for o in outs]
        assert hits(outs, "host") == [0, 0]
        eng.check_integrity()
    finally:
        eng.shutdown()
