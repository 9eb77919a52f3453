"""The storage tier never holds up serving: no L1 pinned by write-backs, no storage I/O on the
scheduler thread, prefetch that cannot fail after it counted, flushes during write-backs, and
no hit counts from bookkeeping lookups. Each test failed on the code before the fix."""

from __future__ import annotations

import random
import threading
import time

import pytest

from harness.model_utils import hf_greedy, tiny_model
from harness.slow_storage import slow_lmdb  # noqa: F401 - fixture
from serving.engine import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("nb"))


def rand_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 511) for _ in range(length)] for _ in range(n)]


def engine(path, db, backend: str = "lmdb", extra: dict | None = None, **kw) -> Engine:
    kw.setdefault("hicache_ratio", 2.0)
    kw.setdefault("hicache_storage_prefetch_threshold", 8)
    kw.setdefault("hicache_storage_load_policy", "always_load")  # the tiny model recomputes faster
    return Engine(model_path=str(path), page_size=4, hicache_storage_backend=backend,
                  hicache_storage_backend_extra_config={"path": str(db), "capacity_gb": 0.05, "initial_map_mb": 1,
                                                        **(extra or {})}, **kw)


def test_write_back_never_pins_l1(model, tmp_path):
    """Under write_through, with the writers held: while the writes are in flight nothing on
    L1 is locked, and a wave that needs every L1 page is admitted and finishes before them."""
    eng = engine(model, tmp_path / "l3", max_total_tokens=128, hicache_write_policy="write_through")
    core = eng.core
    release = threading.Event()  # the writers hold every write until the wave is done
    core.storage.writeback.before_write = lambda: release.wait(60)
    a = rand_prompts(3, 36, seed=1)
    eng.generate(input_ids=a, sampling_params=GREEDY)
    eng.generate(input_ids=a, sampling_params=GREEDY)  # hits: backed up to L2, written on to L3
    assert core.storage.writeback.in_flight
    tree = core.tree
    assert tree.cached_pages("device") > 0
    assert tree.evictable_pages("device") == tree.cached_pages("device"), "a write-back locks L1 pages"
    b = rand_prompts(3, 36, seed=2)  # 3 x 10 pages: more than L1 has free, so a's pages must go
    outs = eng.generate(input_ids=b, sampling_params=GREEDY)
    assert all(o["meta_info"]["completion_tokens"] == 4 for o in outs)
    assert core.storage.pages_written == 0, "the wave waited for the write-backs"
    core.check_integrity()
    release.set()
    core.storage.poll(wait=True)
    assert core.storage.pages_written > 0
    core.check_integrity()
    eng.shutdown()


def test_decode_advances_while_the_store_sleeps(model, tmp_path, slow_lmdb):  # noqa: F811
    """Every store call sleeps 2 s. A request whose prompt is in L3 waits for its prefetch
    (wait_complete) while a running request keeps decoding: no step includes storage I/O."""
    db = tmp_path / "l3"
    long_prompt = rand_prompts(1, 48, seed=3)[0]
    ref = hf_greedy(model, [long_prompt], 4)[0]
    warm = engine(model, db, max_total_tokens=256)
    warm.generate(input_ids=long_prompt, sampling_params=GREEDY)
    warm.shutdown()  # persists the prompt's pages to L3
    eng = engine(model, db, slow_lmdb, {"delay_s": 2.0}, max_total_tokens=256,
                 hicache_storage_prefetch_policy="wait_complete", hicache_storage_prefetch_timeout_base=30.0)
    core, store = eng.core, eng.core.storage.tier.backend
    runner = core.make_request(input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_new_tokens": 400})
    core.add(runner)
    core.step()
    waiter = core.make_request(input_ids=long_prompt, sampling_params=GREEDY)
    core.add(waiter)
    longest, tokens_while_waiting, t_end = 0.0, 0, time.monotonic() + 60
    while not waiter.finished and time.monotonic() < t_end:
        n = len(runner.output_ids)
        t0 = time.monotonic()
        core.step()
        longest = max(longest, time.monotonic() - t0)
        if waiter in core.scheduler.waiting and not runner.finished:
            tokens_while_waiting += len(runner.output_ids) - n
    assert waiter.finished and waiter.output_ids == ref
    assert waiter.kv.cached_by_tier["storage"] > 0, waiter.kv.cached_by_tier
    assert store.calls["exists"] >= 1 and store.calls["get"] >= 1  # 4 s of store calls in all
    assert longest < 1.0, f"a step took {longest:.2f} s: it waited on the store"
    assert tokens_while_waiting >= 10, tokens_while_waiting
    core.scheduler.abort(runner.rid)
    core.check_integrity()
    eng.shutdown()


def test_prefetch_locks_and_makes_room_before_it_allocates(model, tmp_path):
    """L2 has 16 pages; a 10-page prefix is on L1 only, the next 15 pages are in L3. The
    prefetch counted free L2 pages before the write-through backup of that prefix took 10 of
    them: the old code then failed to allocate (OutOfPages in the middle of a step). The
    prefetch threshold (44 tokens) keeps the 10-page prefix itself from being prefetched."""
    db = tmp_path / "l3"
    p = rand_prompts(1, 40, seed=4)[0]
    full = p + rand_prompts(1, 61, seed=5)[0]
    ref = hf_greedy(model, [full], 4)[0]
    warm = engine(model, db, max_total_tokens=512)
    warm.generate(input_ids=full, sampling_params=GREEDY)
    warm.shutdown()
    eng = engine(model, db, max_total_tokens=256, hicache_ratio=0.25,  # backed up on the first hit:
                 hicache_write_policy="write_through_selective", write_through_threshold=1,
                 hicache_storage_prefetch_policy="wait_complete", hicache_storage_prefetch_timeout_base=30.0,
                 hicache_storage_prefetch_threshold=44)
    core = eng.core
    assert core.host_pool.num_pages == 16
    eng.generate(input_ids=p + [1], sampling_params=GREEDY)  # the prefix on L1 only, never hit
    assert core.tree.cached_pages("host") == 0
    out = eng.generate(input_ids=full, sampling_params=GREEDY)
    assert out["output_ids"] == ref
    assert out["meta_info"]["cached_tokens_details"]["storage"] > 0, out["meta_info"]
    core.check_integrity()
    eng.shutdown()


def test_flush_during_write_back(model, tmp_path):
    """A flush while write-backs are in flight succeeds (it used to refuse: the writes held
    locks); the pages they read are freed once they finish."""
    eng = engine(model, tmp_path / "l3", max_total_tokens=256, hicache_write_policy="write_through")
    core = eng.core
    release = threading.Event()  # the writes stay in flight until the flush is checked
    core.storage.writeback.before_write = lambda: release.wait(60)
    a = rand_prompts(2, 36, seed=6)
    eng.generate(input_ids=a, sampling_params=GREEDY)
    eng.generate(input_ids=a, sampling_params=GREEDY)
    assert core.storage.writeback.in_flight and core.tree.host_pinned
    assert eng.flush_cache() is True
    assert core.tree.num_nodes == 0
    core.check_integrity()
    release.set()
    core.storage.poll(wait=True)
    assert core.tree.host_pinned == 0 and core.host_pool.allocator.num_used == 0
    core.check_integrity()
    eng.shutdown()


def test_session_bookkeeping_counts_no_hits(model, tmp_path):
    """write_through_selective with threshold 2: two turns of a session reuse its prefix once,
    so nothing may be backed up; the session's release used to count as a hit."""
    eng = Engine(model_path=str(model), page_size=4, max_total_tokens=256, hicache_ratio=2.0,
                 hicache_write_policy="write_through_selective", write_through_threshold=2)
    core = eng.core
    sid = eng.open_session()
    turn1 = rand_prompts(1, 40, seed=7)[0]
    out = eng.generate(input_ids=turn1, sampling_params=GREEDY, session_id=sid)
    assert all(n.hit_count == 0 for n in core.tree.nodes()), core.tree.nodes()
    eng.generate(input_ids=turn1 + out["output_ids"] + [9, 9, 9, 9], sampling_params=GREEDY, session_id=sid)
    assert max(n.hit_count for n in core.tree.nodes()) == 1
    assert core.controller.pages_backed_up == 0 and core.tree.cached_pages("host") == 0
    core.check_integrity()
    eng.shutdown()


def test_write_back_queue_is_capped_but_shutdown_persists_everything(model, tmp_path):
    """At most 4 pages are handed to the (held) writers at once (a larger node only when it
    goes alone): further write-backs wait, pinned, and are never dropped; a graceful shutdown
    writes every page."""
    db = tmp_path / "l3"
    eng = engine(model, db, max_total_tokens=256, hicache_write_policy="write_through",
                 hicache_storage_write_queue_pages=4)
    a = rand_prompts(3, 36, seed=8)
    release = threading.Event()  # the writers hold their first write until the checks below
    wb = eng.core.storage.writeback
    wb.before_write = lambda: release.wait(60)
    eng.generate(input_ids=a, sampling_params=GREEDY)
    eng.generate(input_ids=a, sampling_params=GREEDY)  # hits: 27 pages backed up, at most 4 handed out
    st = eng.core.storage_stats()
    assert st["write_pages_dropped"] == 0, st
    assert wb.in_flight == 1 and wb.waiting >= 2, (wb.in_flight, wb.waiting)  # an 8-page node goes alone
    assert st["write_pages_waiting"] == sum(len(w.host_pages) for w in wb._backlog) > 0, st
    eng.core.check_integrity()
    release.set()
    eng.shutdown()
    again = engine(model, db, max_total_tokens=256, hicache_storage_prefetch_policy="wait_complete",
                   hicache_storage_prefetch_timeout_base=30.0)
    outs = again.generate(input_ids=a, sampling_params=GREEDY)
    assert all(o["meta_info"]["cached_tokens_details"]["storage"] >= 32 for o in outs), [o["meta_info"] for o in outs]
    again.check_integrity()
    again.shutdown()
