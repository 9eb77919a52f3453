"""L3 in the engine: KV written back to LMDB comes back after a restart, outputs unchanged."""

from __future__ import annotations

import pytest

from harness.engine_cases import GREEDY, ids_of, prompts
from harness.model_utils import hf_greedy, tiny_model
from serving.engine import Engine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tiny_model(tmp_path_factory.mktemp("l3"))
    ps = prompts(4, 512, seed=5, lo=40, hi=60)
    return path, ps, hf_greedy(path, ps, GREEDY["max_new_tokens"])


def make(path, db, policy: str, **kw) -> Engine:
    kw.setdefault("hicache_ratio", 2.0)
    return Engine(model_path=str(path), page_size=4, max_total_tokens=256,
                  hicache_storage_backend="lmdb",
                  hicache_storage_backend_extra_config={"path": str(db), "capacity_gb": 0.05, "initial_map_mb": 1},
                  hicache_storage_prefetch_policy=policy, hicache_storage_prefetch_threshold=8,
                  hicache_storage_prefetch_timeout_base=5.0, hicache_storage_load_policy="always_load", **kw)


def warm_store(path, db, ps, ref) -> None:
    """Two rounds: the second hits the first's pages, so they are backed up to L2 and
    written on to L3 (write_through); shutdown waits for the writes."""
    eng = make(path, db, "wait_complete")
    assert ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY)) == ref
    assert ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY)) == ref
    eng.core.storage.poll(wait=True)
    assert eng.core.storage.pages_written > 0
    eng.check_integrity()
    eng.shutdown()


@pytest.mark.parametrize("policy", ["wait_complete", "timeout", "best_effort"])
def test_prefix_comes_back_from_l3_after_restart(tiny, tmp_path, policy):
    path, ps, ref = tiny
    db = tmp_path / "l3"
    warm_store(path, db, ps, ref)
    # A new engine (a restart): L1 and L2 are empty, LMDB still holds the pages.
    # One request at a time, so queued requests' prefetches run while others compute
    # (best_effort takes only what has arrived when a request is scheduled).
    eng = make(path, db, policy, max_running_requests=1)
    outs = eng.generate(input_ids=ps, sampling_params=GREEDY)
    assert ids_of(outs) == ref
    storage_hits = [o["meta_info"]["cached_tokens_details"]["storage"] for o in outs]
    if policy == "best_effort":
        assert sum(storage_hits[1:]) > 0, storage_hits
    else:
        assert all(h > 0 for h in storage_hits), storage_hits
    for o in outs:
        assert o["meta_info"]["cached_tokens"] >= o["meta_info"]["cached_tokens_details"]["storage"]
    assert eng.core.storage.tier.stats()["corrupt"] == 0
    eng.check_integrity()
    eng.shutdown()


def test_corrupt_values_are_never_served(tiny, tmp_path):
    path, ps, ref = tiny
    db = tmp_path / "l3"
    warm_store(path, db, ps, ref)
    import lmdb

    env = lmdb.open(str(db), subdir=True, max_dbs=4, lock=True)
    data = env.open_db(b"data")  # the LMDB backend's value table
    flipped = 0
    with env.begin(write=True, db=data) as txn:
        items = [(k, bytes(v)) for k, v in txn.cursor()]
        for k, v in items:
            b = bytearray(v)
            b[len(b) // 2] ^= 0xFF  # a byte in the KV payload, past the header
            txn.put(k, bytes(b))
            flipped += 1
    env.close()
    assert flipped > 0
    eng = make(path, db, "wait_complete")
    outs = eng.generate(input_ids=ps, sampling_params=GREEDY)
    assert ids_of(outs) == ref  # recomputed, not served from corrupt pages
    assert all(o["meta_info"]["cached_tokens_details"]["storage"] == 0 for o in outs)
    assert eng.core.storage.tier.stats()["corrupt"] > 0
    eng.check_integrity()
    eng.shutdown()


def test_abort_while_prefetching_gives_back_host_pages(tiny, tmp_path):
    path, ps, ref = tiny
    db = tmp_path / "l3"
    warm_store(path, db, ps, ref)
    eng = make(path, db, "wait_complete", max_running_requests=1)
    core = eng.core
    reqs = [core.make_request(input_ids=p, sampling_params=GREEDY) for p in ps]
    for r in reqs:
        core.add(r)
    core.step()
    core.check_integrity()
    for r in reqs[1:]:
        core.scheduler.abort(r.rid)
        core.check_integrity()
    while core.scheduler.has_work:
        core.step()
    core.check_integrity()
    assert core.storage.in_flight_host_pages(core.scheduler.waiting) == 0
    eng.shutdown()


def test_storage_integrity_checks_catch_miscounts_and_a_free_page(tiny, tmp_path):
    """The L3 controllers' own checks (run by every check_integrity) fail on broken bookkeeping."""
    from concurrent.futures import Future

    path, ps, ref = tiny
    eng = make(path, tmp_path / "l3", "wait_complete")
    pf, host = eng.core.storage.prefetcher, eng.core.tree.host
    eng.check_integrity()
    pf._fetching += 1  # a fetch counted that no request holds
    with pytest.raises(AssertionError, match="1 fetches counted, 0 held"):
        eng.check_integrity()
    pf._fetching -= 1
    page = host.alloc(1)
    host.free(page)
    done: Future = Future()
    done.set_result(None)
    pf._draining.append((done, page))  # a drain holding a page the allocator has free
    with pytest.raises(AssertionError, match="a held host page is free"):
        eng.check_integrity()
    pf._draining.clear()
    wb = eng.core.storage.writeback
    wb._queued_pages += 1  # a page counted against the write queue that no write holds
    with pytest.raises(AssertionError, match="write-back: queued pages"):
        eng.check_integrity()
    wb._queued_pages -= 1
    eng.core.ledger.storage_reserved["alice"] = 2  # an L3 reservation without a write
    with pytest.raises(AssertionError, match="write-back: L3 reservations"):
        eng.check_integrity()
    eng.core.ledger.storage_reserved.clear()
    eng.check_integrity()
    eng.shutdown()


def test_shutdown_persists_pages_never_hit(tiny, tmp_path):
    path, ps, ref = tiny
    db = tmp_path / "l3"
    eng = make(path, db, "wait_complete")
    assert ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY)) == ref  # one round: nothing hit
    assert eng.core.storage.pages_written == 0
    eng.shutdown()  # backs L1 up to L2 and writes everything on to L3
    eng = make(path, db, "wait_complete")
    outs = eng.generate(input_ids=ps, sampling_params=GREEDY)
    assert ids_of(outs) == ref
    assert all(o["meta_info"]["cached_tokens_details"]["storage"] > 0 for o in outs)
    eng.check_integrity()
    eng.shutdown()


def test_queued_prefetches_wait_for_l2_room_instead_of_recomputing(tiny, tmp_path):
    """After a restart, with an L2 that holds about one prompt's pages, every queued request
    still gets its prefix from L3: a prefetch that finds L2 full (other prefetches hold it, or
    backups of pages that are on L1) makes room or waits for it, instead of giving up and
    recomputing. Outputs stay those of HF's recompute."""
    path, ps, ref = tiny
    db = tmp_path / "l3"
    warm_store(path, db, ps, ref)
    eng = make(path, db, "wait_complete", max_running_requests=1, hicache_ratio=0.25)  # 16 L2 pages
    assert eng.core.host_pool.allocator.num_pages < 2 * min(len(p) for p in ps) // 4
    outs = eng.generate(input_ids=ps, sampling_params=GREEDY)
    assert ids_of(outs) == ref
    storage_hits = [o["meta_info"]["cached_tokens_details"]["storage"] for o in outs]
    assert all(h > 0 for h in storage_hits), storage_hits
    eng.check_integrity()
    eng.shutdown()


def test_prefetch_commits_batch_by_batch_and_loads_on_to_l1_early(tiny, tmp_path):
    """With one reader thread a fetch reads 8 pages a batch: each landed batch is committed
    to the tree at once and, L1 having room, loaded on to L1 while the next batch is read.
    The request then finds that part of its prefix on L1 but is still told it came from L3;
    outputs stay those of HF's recompute and no lock or page is left over."""
    path, ps, ref = tiny
    db = tmp_path / "l3"
    warm_store(path, db, ps, ref)
    eng = make(path, db, "wait_complete", max_running_requests=1, hicache_storage_read_threads=1,
               hicache_mem_layout="page_first")  # the direct read path: 8 pages per reader thread
    assert eng.core.storage.tier.fetch_batch_pages(eng.core.host_pool) == 8 < min(len(p) for p in ps) // 4
    outs = eng.generate(input_ids=ps, sampling_params=GREEDY)
    assert ids_of(outs) == ref
    st = eng.core.storage_stats()
    assert st["pages_loaded_early"] > 0, st
    storage_hits = [o["meta_info"]["cached_tokens_details"]["storage"] for o in outs]
    assert all(h > 0 for h in storage_hits), storage_hits
    assert sum(storage_hits) == st["pages_prefetched"] * 4
    eng.core.storage.poll(wait=True)
    eng.check_integrity()
    assert all(n.lock_ref == 0 for n in eng.core.tree.nodes())
    eng.shutdown()


def test_a_waiting_prefix_evicted_from_l2_comes_back_from_l3(tiny, tmp_path):
    """A waiting request whose cached prefix sits in L2 (too long to pin) and whose tail L3 lacks
    watches that prefix: when the request running before it demotes its own pages into L2 and so
    evicts the prefix, the waiting request finds it again in L3 instead of recomputing it (the
    multi-turn burst on the H200 lost a third of its hits so). Output stays HF's recompute."""
    path, _, _ = tiny
    p = prompts(1, 512, seed=41, lo=160, hi=160)[0]  # 40 pages: more than the 32-page pin budget
    a = p + prompts(1, 512, seed=42, lo=12, hi=12)[0]  # its tail: 3 pages that L3 lacks
    x, y = prompts(2, 512, seed=43, lo=200, hi=200)  # 50 pages each, fresh
    ref = hf_greedy(path, [a], GREEDY["max_new_tokens"])
    eng = make(path, tmp_path / "l3", "wait_complete", max_running_requests=1, hicache_ratio=1.0,
               schedule_policy="fcfs")  # 64 L2 pages; y runs before a
    assert eng.core.host_pool.allocator.num_pages == 64
    for ids in (p, p):  # the second one hits: write_through backs p up to L2 and on to L3
        eng.generate(input_ids=ids, sampling_params=GREEDY)
    eng.generate(input_ids=x, sampling_params=GREEDY)  # pushes p out of L1: it stays in L2
    eng.core.storage.poll(wait=True)
    eng.check_integrity()
    # y runs first; its L1 pages demote x into L2, which evicts p there, while a waits
    outs = eng.generate(input_ids=[y, a], sampling_params=GREEDY)
    assert outs[1]["output_ids"] == ref[0]
    hits = outs[1]["meta_info"]["cached_tokens_details"]
    assert hits["storage"] > 0, hits
    eng.core.storage.poll(wait=True)
    eng.check_integrity()
    eng.shutdown()
