"""Waiting requests' L3 fetches never keep L1 from the requests that could run.

A fetch locks the tree path its pages hang below, and its early L2 -> L1 loads put them on L1 under that
lock (serving/cache/l3_fetch.py), so fetches whose requests still wait can hold every L1 page. When a
request then finds no room and nothing running can free any, the waiting requests give their fetches
back (``ReqCache.give_back_fetches``): what landed stays on L2 and the request runs.

The real engine on the tiny model, on the CPU, with LMDB as L3. The prefetch policy below only holds the
requests until every fetch and early load has landed (what CI's timing happened to do when this stalled
for 600 s); it decides nothing else.
"""

from __future__ import annotations

import random
import time

import pytest

from harness.model_utils import tiny_model
from serving.engine import Engine

PS = 4
G = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}
L1_PAGES = 24  # two prompts of 12 full pages each fill it


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("holds"))


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 511) for _ in range(n)]


def engine(path, db) -> Engine:
    return Engine(model_path=str(path), page_size=PS, device="cpu", max_total_tokens=L1_PAGES * PS,
                  hicache_ratio=4.0, write_through_threshold=1, max_running_requests=2,
                  hicache_storage_backend="lmdb",
                  hicache_storage_backend_extra_config={"path": str(db), "capacity_gb": 0.05, "initial_map_mb": 1},
                  hicache_storage_prefetch_policy="wait_complete", hicache_storage_prefetch_threshold=8,
                  hicache_storage_load_policy="always_load")


class AllLanded:
    """Ready once every fetch in flight has landed, been committed and loaded on to L1."""

    def __init__(self, fetches) -> None:  # noqa: ANN001 (serving.cache.l3_fetch.Fetches)
        self.fetches = fetches

    def ready(self, op, now: float) -> bool:  # noqa: ANN001 (a PrefetchOp)
        f = self.fetches
        return op.fetched and not f.l1_loads and all(x.done and x.committed == x.loaded for x in f.active)


def test_fetches_holding_all_of_l1_give_it_back(tiny, tmp_path):
    prompts = [ids(12 * PS + 1, 1), ids(12 * PS + 1, 2)]
    eng = engine(tiny, tmp_path / "l3")
    want = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=G)]
    eng.core.storage.poll(wait=True)
    eng.shutdown()  # every page on L3

    eng = engine(tiny, tmp_path / "l3")  # a restart: L1 and L2 empty
    core = eng.core
    assert core.req_cache.allocator.num_pages == L1_PAGES
    pf = core.req_cache.prefetcher
    pf.policy = AllLanded(pf.fetches)
    reqs = [core.make_request(input_ids=p, sampling_params=G) for p in prompts]
    for r in reqs:
        core.add(r)
    deadline = time.monotonic() + 30
    while not all(r.finished for r in reqs):
        assert time.monotonic() < deadline, (
            f"stalled: L1 free {core.req_cache.allocator.num_free}, "
            f"waiting {len(core.scheduler.waiting)}, running {len(core.scheduler.running)}")
        eng._step()
        eng.check_integrity()
    assert pf.pages_loaded_early == L1_PAGES  # the fetches had put every L1 page under their locks
    assert [r.output_ids for r in reqs] == want
    assert sum(r.kv.cached_by_tier["storage"] for r in reqs) > 0
    eng.check_integrity()
    eng.shutdown()
