"""An L3 fetch never evicts from L2 the prefix that landed for another waiting request.

A waiting request's fetch lands its prefix on L2; when the request then finds no L1 room (the requests
running hold it), its prefix stays on L2 unlocked while it waits (``ReqCache.try_admit``: NO_ROOM). The
fetches of the requests behind it made L2 room by evicting LRU, and what had landed first went first: it
was read from L3 again (the Gemma-3 probe: each page read about twice). Now a fetch spares the prefixes the
other waiting requests found cached (``Prefetcher._evict_sparing``) and waits for room instead.

The real engine on the tiny model, on the CPU, with LMDB as L3, after a restart (L1 and L2 empty): four
returning prompts of 12 pages, L1 room for about one of them, L2 for two. Each page is read from L3 once.
"""

from __future__ import annotations

import random
import time

import pytest

from harness.engine_cases import lmdb_l3
from harness.model_utils import tiny_model
from serving.engine import Engine

PS = 4
PAGES = 12
G = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("spares"))


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 511) for _ in range(n)]


def engine(path, db, l2_ratio: float = 1.7) -> Engine:
    return Engine(model_path=str(path), page_size=PS, device="cpu", max_total_tokens=(PAGES + 6) * PS,
                  hicache_size=0, hicache_ratio=l2_ratio, write_through_threshold=1, max_running_requests=4,
                  **lmdb_l3(db))


def test_a_fetch_spares_what_landed_for_a_waiting_request(tiny, tmp_path):
    prompts = [ids(PAGES * PS + 1, s) for s in range(4)]
    eng = engine(tiny, tmp_path / "l3", l2_ratio=4)  # L2 holds every prompt: none is lost while L3 writes lag
    want = [eng.generate(input_ids=p, sampling_params=G)["output_ids"] for p in prompts]
    eng.core.storage.poll(wait=True)
    eng.shutdown()  # every page on L3

    eng = engine(tiny, tmp_path / "l3")
    try:
        core = eng.core
        assert core.host_pool.num_pages < 3 * PAGES  # L2 holds fewer than three of the prefixes
        reqs = [core.make_request(input_ids=p, sampling_params=G) for p in prompts]
        for r in reqs:
            core.add(r)
        deadline = time.monotonic() + 60
        while not all(r.finished for r in reqs):
            assert time.monotonic() < deadline, "stalled"
            eng._step()
            eng.check_integrity()
        assert [r.output_ids for r in reqs] == want
        assert [r.kv.cached_by_tier["storage"] for r in reqs] == [PAGES * PS] * 4
        assert core.storage_stats()["hits"] == 4 * PAGES  # each page read once (before: 120)
    finally:
        eng.shutdown()
