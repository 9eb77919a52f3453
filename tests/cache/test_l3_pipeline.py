"""The L3 read path under concurrency: fetches in flight at once, one read per key for
requests with the same prefix, every answer equal to HF's fp32 recompute after a restart.

Reads are held deterministically (harness/slow_storage.py: ``hold`` makes every value read
wait at its start, ``held`` shows which keys wait), the engine is stepped by hand and
``check_integrity`` runs after every step. Engines are fp32 on whatever device there is (on a
CUDA machine: pinned L2, layered loads, CUDA graphs), so answers stay exact there too.
"""

from __future__ import annotations

import random
import time

import pytest

from harness.model_utils import hf_greedy, tiny_model
from harness.slow_storage import slow_lmdb  # noqa: F401 - fixture
from serving.engine import Engine

PS = 4
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def _rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 511) for _ in range(n)]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    path = tiny_model(tmp_path_factory.mktemp("l3pipe"))
    rng = random.Random(26)
    shared = _rand(rng, 48)  # 12 pages
    more = _rand(rng, 40)  # 10 more pages after ``shared``, stored for one prompt only
    prompts = {
        "a": shared + _rand(rng, 3), "b": shared + _rand(rng, 5), "c": shared + _rand(rng, 2),
        "long": shared + more + _rand(rng, 3),
        "x": _rand(rng, 50), "y": _rand(rng, 46),
    }
    ref = dict(zip(prompts, hf_greedy(path, list(prompts.values()), GREEDY["max_new_tokens"]), strict=True))
    return path, prompts, ref


def make(path, db, backend: str = "lmdb", **kw) -> Engine:
    return Engine(model_path=str(path), dtype="float32", page_size=PS, max_total_tokens=512, hicache_ratio=2.0,
                  hicache_mem_layout="page_first", hicache_storage_backend=backend,
                  hicache_storage_backend_extra_config={"path": str(db), "capacity_gb": 0.05, "initial_map_mb": 1},
                  hicache_storage_prefetch_policy="wait_complete", hicache_storage_prefetch_threshold=8,
                  hicache_storage_prefetch_timeout_base=30.0, hicache_storage_load_policy="always_load", **kw)


def stored(world, tmp_path, names) -> str:
    """A store that holds the prompts ``names`` (a shutdown writes every cached page)."""
    path, prompts, ref = world
    db = tmp_path / "l3"
    eng = make(path, db)
    outs = eng.generate(input_ids=[prompts[n] for n in names], sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == [ref[n] for n in names]
    eng.shutdown()
    return db


def step_until(core, cond, what: str, limit_s: float = 20.0) -> None:
    """Step (checking integrity after each step) until ``cond()``; fails after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, f"never happened: {what}"
        core.step()
        core.check_integrity()
        time.sleep(0.001)


def finish(core, reqs, ref, names) -> None:
    while core.scheduler.has_work:
        core.step()
        core.check_integrity()
        time.sleep(0.0005)
    assert [r.output_ids for r in reqs] == [ref[n] for n in names]
    core.storage.poll(wait=True)
    core.check_integrity()
    assert all(n.lock_ref == 0 for n in core.tree.nodes())
    assert core.storage.in_flight_host_pages(core.scheduler.waiting) == 0


def fetching(r) -> bool:
    return r.kv.prefetch is not None and r.kv.prefetch.fetch is not None


def test_requests_with_one_prefix_read_it_once(world, tmp_path, slow_lmdb):  # noqa: F811
    """Three requests whose prompts share a 12-page prefix arrive at once after a restart: the
    first one's fetch reads it, the other two follow that fetch (its reads held until all three
    hold it) -- every key is read once, and every answer is HF's."""
    path, prompts, ref = world
    db = stored(world, tmp_path, ["a"])
    eng = make(path, db, slow_lmdb, hicache_storage_read_threads=2)
    core, store = eng.core, eng.core.storage.tier.backend
    store.hold()
    names = ["a", "b", "c"]
    reqs = [core.make_request(input_ids=prompts[n], sampling_params=GREEDY) for n in names]
    for r in reqs:
        core.add(r)
    step_until(core, lambda: all(fetching(r) for r in reqs), "every request holds a fetch")
    store.release()
    finish(core, reqs, ref, names)
    assert store.keys_read and max(store.keys_read.values()) == 1, store.keys_read.most_common(3)
    assert len(store.keys_read) == 12
    st = core.storage_stats()
    assert st["fetches_followed"] == 2 and st["pages_deduplicated"] == 24, st
    assert all(r.kv.cached_by_tier["storage"] == 48 for r in reqs), [r.kv.cached_by_tier for r in reqs]
    eng.shutdown()


def test_a_follower_fetches_the_rest_of_its_prefix_itself(world, tmp_path, slow_lmdb):  # noqa: F811
    """``long`` shares 12 pages with ``a`` and the store holds 10 more of its own: it follows
    ``a``'s fetch for the 12, then looks up and reads the 10 -- each key once, all 22 pages
    reported as L3 hits, answers HF's."""
    path, prompts, ref = world
    db = stored(world, tmp_path, ["long"])
    eng = make(path, db, slow_lmdb, hicache_storage_read_threads=2)
    core, store = eng.core, eng.core.storage.tier.backend
    store.hold()
    a = core.make_request(input_ids=prompts["a"], sampling_params=GREEDY)
    core.add(a)
    step_until(core, lambda: fetching(a), "a's fetch started")
    long = core.make_request(input_ids=prompts["long"], sampling_params=GREEDY)
    core.add(long)
    step_until(core, lambda: fetching(long), "long follows a's fetch")
    assert long.kv.prefetch.fetch is a.kv.prefetch.fetch and long.kv.prefetch.need == 12
    store.release()
    finish(core, [a, long], ref, ["a", "long"])
    assert len(store.keys_read) == 22 and max(store.keys_read.values()) == 1, store.keys_read
    assert long.kv.cached_by_tier["storage"] == 88 and a.kv.cached_by_tier["storage"] == 48
    eng.shutdown()


def test_fetches_of_different_prompts_are_read_at_once(world, tmp_path, slow_lmdb):  # noqa: F811
    """Two requests' prefixes in L3: with the reads held, the reader threads hold reads of both
    fetches at once (one fetch no longer waits for the other's last page), then both answers
    are HF's."""
    path, prompts, ref = world
    db = stored(world, tmp_path, ["x", "y"])
    eng = make(path, db, slow_lmdb, hicache_storage_read_threads=4)
    core, store = eng.core, eng.core.storage.tier.backend
    store.hold()
    names = ["x", "y"]
    reqs = [core.make_request(input_ids=prompts[n], sampling_params=GREEDY) for n in names]
    for r in reqs:
        core.add(r)

    def both_read() -> bool:
        held = {k for keys in list(store.held) for k in keys}
        return all(r.kv.prefetch is not None and held & set(r.kv.prefetch.keys) for r in reqs)

    step_until(core, both_read, "reads of both fetches in flight at once")
    store.release()
    finish(core, reqs, ref, names)
    assert max(store.keys_read.values()) == 1
    assert all(r.kv.cached_by_tier["storage"] > 0 for r in reqs), [r.kv.cached_by_tier for r in reqs]
    eng.shutdown()


def run_all(core, reqs) -> None:
    for r in reqs:
        core.add(r)
    while core.scheduler.has_work:
        before = core.scheduler.stats.forward_passes
        core.step()
        core.check_integrity()
        if core.scheduler.stats.forward_passes == before:
            time.sleep(0.0005)


def test_a_turn_of_returning_conversations_loads_instead_of_recomputing(tmp_path_factory):
    """Sixteen conversations return at once (a multi-turn turn) with an L1 that holds about
    four of them and an L2 about seven: (nearly) every returning request finds its history in
    L1, L2 or L3. Before, a waiting request's L2 prefix was evicted by the prefetches and
    demotions of the others before it ran, and one whose L2 hit found L1 full (the others
    running) recomputed it: 5 to 8 of the 16 found their history. Waiting requests now pin
    their L2 prefixes (fetch_room.PIN_SHARE of L2), wait for L1 room instead of recomputing, L1 hits go
    first, and a prefix that lost pages while waiting is looked up in L3 again. (Two of the
    16 may still miss: the pages of the last turn's last requests were never written
    anywhere and can be evicted from L1 before they run; on a loaded machine a request whose
    wait for L1 room passes its 1 s bound recomputes: CI saw 13.) At least 12 of 16, against
    at most 8 before. Answers are HF's fp32 greedy ones; integrity holds after every step."""
    path = tiny_model(tmp_path_factory.mktemp("turns"))
    rng = random.Random(3)
    hist = [_rand(rng, 40) for _ in range(16)]  # 10 pages each
    first = hf_greedy(path, hist, 1)
    back = [h + o + _rand(rng, 4) for h, o in zip(hist, first, strict=True)]
    ref = hf_greedy(path, back, 3)
    eng = Engine(model_path=str(path), dtype="float32", page_size=PS, max_total_tokens=160, hicache_ratio=2.0,
                 hicache_mem_layout="page_first", hicache_storage_backend="lmdb",
                 hicache_storage_backend_extra_config={"path": str(tmp_path_factory.mktemp("db")),
                                                       "capacity_gb": 0.05, "initial_map_mb": 1},
                 hicache_storage_prefetch_policy="wait_complete", hicache_storage_prefetch_threshold=8,
                 hicache_storage_prefetch_timeout_base=30.0, hicache_storage_load_policy="always_load")
    core = eng.core
    assert core.runner.pool.num_pages == 40 and core.host_pool.num_pages == 80
    turn0 = [core.make_request(input_ids=h, sampling_params={**GREEDY, "max_new_tokens": 1}) for h in hist]
    run_all(core, turn0)
    assert [r.output_ids for r in turn0] == first
    core.storage.poll(wait=True)  # the users think: write-backs drain
    turn1 = [core.make_request(input_ids=b, sampling_params={**GREEDY, "max_new_tokens": 3}) for b in back]
    run_all(core, turn1)
    assert [r.output_ids for r in turn1] == ref
    found = [r.kv.cached_tokens >= 40 for r in turn1]
    assert sum(found) >= 12, [r.kv.cached_by_tier for r in turn1]
    core.storage.poll(wait=True)
    core.check_integrity()
    assert all(n.lock_ref == 0 for n in core.tree.nodes())
    eng.shutdown()
