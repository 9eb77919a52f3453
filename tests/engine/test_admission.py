"""``ReqCache.try_admit``: the scheduler admits a waiting request through one call into serving/cache,
which answers READY, LOADING, WAIT or NO_ROOM (serving/cache/admission.py; issue 43, build step 1).

The real engine on the tiny model, on the CPU; each test calls ``try_admit`` on requests made by the
engine (``EngineCore.make_request``) and checks what the answer promises about the request's KV record
(``Req.kv``): what it holds, what it reserved, what it counted. Every request is released at the end and
the cache's invariants checked. Held on purpose, never timed: an L2 -> L1 copy held at a gate, an L3 read
held by the slow store's ``hold``.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from harness.model_utils import tiny_model
from harness.slow_storage import slow_lmdb  # noqa: F401 - fixture
from serving.cache.admission import Answer
from serving.engine import Engine
from serving.kernels.page_copy import PageMover

PS = 4
G = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("admit"))


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 511) for _ in range(n)]


def engine(path, **kw) -> Engine:
    return Engine(model_path=str(path), page_size=PS, device="cpu", **kw)


def holds_nothing(r) -> bool:
    return not r.kv.pages and r.kv.lock_node is None and not r.kv.wait_loads


def on_l2_only(eng, prompt: list[int]) -> None:
    """``prompt`` answered twice (the hit backs it up to L2), then every L1 page demoted: it is cached on L2 only."""
    eng.generate(input_ids=prompt, sampling_params=G)
    eng.generate(input_ids=prompt, sampling_params=G)
    eng.core.tree.evict_device(eng.core.tree.cached_pages("device"))
    eng.core.req_cache.flush_transfers()

def test_ready_locks_the_prefix_and_reserves_the_first_chunk(tiny):
    eng = engine(tiny, max_total_tokens=1024)
    core, cache = eng.core, eng.core.req_cache
    p = ids(40, 1)
    eng.generate(input_ids=p, sampling_params=G)  # its 10 full pages go into the tree
    r = core.make_request(input_ids=p + ids(20, 2), sampling_params=G)
    a = cache.try_admit(r, 8)
    assert a.answer is Answer.READY and a.first and a.tokens == 8
    kv = r.kv
    assert kv.kv_len == 40 and kv.tree_pages == 10 and kv.lock_node is not None and kv.admitted
    assert len(kv.pages) == (40 + 8) // PS  # the prefix's pages, then the chunk's
    assert kv.cached_tokens == 40 and kv.cached_by_tier == {"device": 40, "host": 0, "storage": 0}
    cache.release(r)
    assert holds_nothing(r) and r.kv.kv_len == 0
    again = cache.try_admit(r, 1 << 20)  # a retracted request comes back: its hits were counted once
    assert again.answer is Answer.READY and not again.first and again.tokens == len(r.input_ids) - 40
    assert r.kv.cached_tokens == 40
    cache.release(r)
    core.check_integrity()
    eng.shutdown()


def test_no_room_gives_everything_back(tiny):
    eng = engine(tiny, max_total_tokens=128)
    core, cache = eng.core, eng.core.req_cache
    n = cache.allocator.num_pages
    big = core.make_request(input_ids=ids((n - 1) * PS, 3), sampling_params=G)
    a = cache.try_admit(big, 1 << 20)
    assert a.answer is Answer.READY and len(big.kv.pages) == n - 1  # L1 has one page left
    small = core.make_request(input_ids=ids(4 * PS, 4), sampling_params=G)
    assert cache.try_admit(small, 1 << 20).answer is Answer.NO_ROOM
    assert holds_nothing(small) and not small.kv.admitted and small.kv.cached_tokens == 0
    cache.release(big)  # its pages go into the tree, unlocked: evictable for the next one
    assert cache.try_admit(small, 1 << 20).answer is Answer.READY
    cache.release(small)
    core.check_integrity()
    eng.shutdown()


def test_loading_admits_it_while_its_l2_prefix_is_copied_back(tiny, monkeypatch):
    eng = engine(tiny, max_total_tokens=256, hicache_ratio=4.0, hicache_write_policy="write_through",
                 write_through_threshold=1)
    core, cache, tree = eng.core, eng.core.req_cache, eng.core.tree
    p = ids(40, 5)
    on_l2_only(eng, p)
    assert tree.cached_pages("host") >= 10 and tree.cached_pages("device") == 0
    gate, copy = threading.Event(), PageMover.host_to_device

    def held_copy(self, *args, **kwargs):
        assert gate.wait(60), "the gate was never opened"
        return copy(self, *args, **kwargs)

    monkeypatch.setattr(PageMover, "host_to_device", held_copy)  # the loader thread waits at the gate
    r = core.make_request(input_ids=p + ids(8, 6), sampling_params=G)
    a = cache.try_admit(r, 1 << 20)
    assert a.answer is Answer.LOADING and a.first and a.tokens == len(r.input_ids) - 40
    assert r.kv.kv_len == 40 and r.kv.cached_by_tier["host"] == 40 and r.kv.wait_loads
    assert not cache.poll_load(r)  # still landing: it may not compute
    gate.set()
    assert cache.poll_load(r, wait=True) and not r.kv.wait_loads
    cache.release(r)
    core.check_integrity()
    eng.shutdown()


def l3_engine(path, db, backend: str, **kw) -> Engine:
    return engine(path, max_total_tokens=256, hicache_ratio=2.0, hicache_storage_backend=backend,
                  hicache_storage_backend_extra_config={"path": str(db), "capacity_gb": 0.05, "initial_map_mb": 1},
                  hicache_storage_prefetch_threshold=8, hicache_storage_load_policy="always_load", **kw)


def until(cond, what: str, limit_s: float = 60.0) -> None:
    end = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < end, f"never: {what}"
        time.sleep(0.005)


def test_wait_keeps_it_queued_for_its_l3_prefetch(tiny, tmp_path, slow_lmdb):  # noqa: F811
    db, p = tmp_path / "l3", ids(48, 7)
    warm = l3_engine(tiny, db, "lmdb")
    warm.generate(input_ids=p, sampling_params=G)
    warm.shutdown()  # persists the prompt's pages to L3
    eng = l3_engine(tiny, db, slow_lmdb, hicache_storage_prefetch_policy="wait_complete",
                    hicache_storage_prefetch_timeout_base=60.0)
    core, cache, store = eng.core, eng.core.req_cache, eng.core.storage.tier.backend
    store.hold()  # every L3 read waits until released
    r = core.make_request(input_ids=p + [9], sampling_params=G)
    cache.advance_prefetches([r])  # its lookup starts
    assert cache.try_admit(r, 1 << 20).answer is Answer.WAIT
    assert holds_nothing(r) and not r.kv.admitted and r.kv.prefetch is not None

    def reading() -> bool:
        cache.advance_prefetches([r])  # the lookup's answer starts the fetch
        return bool(store.held)

    until(reading, "the fetch reads from L3")
    assert cache.try_admit(r, 1 << 20).answer is Answer.WAIT and holds_nothing(r)
    store.release()
    answers = []

    def admitted() -> bool:
        cache.advance_prefetches([r])
        answers.append(cache.try_admit(r, 1 << 20).answer)
        return answers[-1] is not Answer.WAIT

    until(admitted, "the prefetch lands")
    assert answers[-1] in (Answer.READY, Answer.LOADING), answers  # LOADING: its L3 pages, now on L2, copied to L1
    assert cache.poll_load(r, wait=True)
    assert r.kv.prefetch is None and r.kv.storage_hit_tokens >= 40 and r.kv.cached_by_tier["storage"] >= 40
    cache.release(r)
    core.check_integrity()
    eng.shutdown()


def test_no_room_for_its_windows_waits_for_the_load_it_started(tmp_path, monkeypatch):
    """A hybrid SWA L1 whose window-only restores find no window pages after the prefix's L2 -> L1 load has
    started: NO_ROOM, and giving the prefix back waits for that copy (the tree takes its pages only once
    they have landed), instead of ending the load while the loader still writes them."""
    from serving.cache.request_windows import RequestWindows

    path = tiny_model(tmp_path, "gemma3")
    eng = engine(path, max_total_tokens=256, hicache_ratio=4.0, hicache_write_policy="write_through",
                 write_through_threshold=1, enable_hybrid_swa_memory=True, swa_full_tokens_ratio=0.5)
    core, cache, tree = eng.core, eng.core.req_cache, eng.core.tree
    p = ids(40, 8)
    on_l2_only(eng, p)
    assert tree.cached_pages("device") == 0
    gate, landed, copy = threading.Event(), threading.Event(), PageMover.host_to_device

    def held_copy(self, *args, **kwargs):
        assert gate.wait(60), "the gate was never opened"
        out = copy(self, *args, **kwargs)
        landed.set()
        return out

    monkeypatch.setattr(PageMover, "host_to_device", held_copy)
    monkeypatch.setattr(RequestWindows, "restore", lambda self, match: None)  # no window pages now
    r = core.make_request(input_ids=p + ids(8, 9), sampling_params=G)
    threading.Timer(0.3, gate.set).start()
    assert cache.try_admit(r, 1 << 20).answer is Answer.NO_ROOM
    assert landed.is_set(), "the prefix was given back before its load landed"
    assert holds_nothing(r) and not r.kv.load_node
    core.check_integrity()
    eng.shutdown()
