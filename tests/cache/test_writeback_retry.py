"""L3 write-back under a store that fails writes for a while (a full map whose free pages readers
still hold, a remote store's timeout): the failed writes wait in L2, pinned, and are retried, so
every page the policy keeps reaches L3 and nothing is dropped. A store that keeps failing gets its
pages back after ``MAX_ATTEMPTS`` (counted as dropped, unpinned: L2 is not held forever).

The store is a real LMDB store whose first ``fail_calls`` writes report failure (registered as a
backend for the test, as harness/slow_storage.py's is)."""

from __future__ import annotations

import random

import pytest

from harness.model_utils import tiny_model
from hicache import config_fields
from hicache.keys import page_keys
from hicache.tiers import storage
from hicache.tiers.lmdb.config import LMDBConfig
from hicache.tiers.lmdb.store import LMDBStore
from serving.cache import l3_writeback
from serving.engine import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}


class FailingLMDBStore(LMDBStore):
    """LMDB whose first ``fail_calls`` write calls store nothing and say why."""

    def __init__(self, config: LMDBConfig, fail_calls: int) -> None:
        super().__init__(config)
        self.fail_calls = fail_calls
        self.failed = 0

    @classmethod
    def from_config(cls, config):  # noqa: ANN001, ANN206
        cfg = dict(config)
        n = int(cfg.pop("fail_calls"))
        return cls(LMDBConfig.from_mapping(cfg), n)

    def batch_set_from(self, keys, buf, spans):  # noqa: ANN001, ANN201
        if self.failed < self.fail_calls:
            self.failed += 1
            self._cause.text = "the store is busy (a failure the test makes)"
            return [False] * len(keys)
        return super().batch_set_from(keys, buf, spans)


@pytest.fixture
def failing_lmdb(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(storage.STORAGE_BACKENDS, "failing_lmdb", FailingLMDBStore.from_config)
    allowed = config_fields.field_choices

    def with_it(f):  # noqa: ANN001, ANN202
        names = allowed(f)
        return (*names, "failing_lmdb") if names is not None and f.name == "hicache_storage_backend" else names

    monkeypatch.setattr(config_fields, "field_choices", with_it)
    monkeypatch.setattr(l3_writeback, "RETRY_S", 0.002, raising=False)  # the backoff's length is not what is tested
    return "failing_lmdb"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("wbr"))


def engine(path, db, backend: str, fail_calls: int) -> Engine:  # noqa: ANN001
    return Engine(model_path=str(path), page_size=4, max_total_tokens=256, hicache_write_policy="write_through",
                  hicache_ratio=2.0, hicache_storage_write_queue_pages=2, hicache_storage_backend=backend,
                  hicache_storage_backend_extra_config={"path": str(db), "capacity_gb": 0.05, "initial_map_mb": 1,
                                                       "fail_calls": fail_calls})


def kept_and_run(eng: Engine, seed: int) -> list[list[int]]:
    """Two rounds of 10 prompts (the second hits the first: backups to L2, then write-backs), the
    engine's integrity checked after every step; returns every path the tree gave an L2 copy."""
    core = eng.core
    paths: list[list[int]] = []
    core.tree.add_listener(lambda kind, node: paths.append(core.tree.path_tokens(node)) if kind == "host_add" else None)
    rng = random.Random(seed)
    ps = [[rng.randrange(1, 511) for _ in range(22)] for _ in range(10)]
    for _ in range(2):
        reqs = [core.make_request(input_ids=p, sampling_params=GREEDY) for p in ps]
        for r in reqs:
            core.add(r)
        while any(not r.finished for r in reqs):
            core.step()
            core.check_integrity()
    core.storage.poll(wait=True)
    core.check_integrity()
    return paths


def missing(eng: Engine, paths: list[list[int]]) -> int:
    st, ps = eng.core.storage, eng.core.tree.page_size
    return sum(len(k) - st.tier.batch_exists(k) for k in (page_keys(p, ps, st.writeback.namespace) for p in paths))


def test_writes_the_store_fails_for_a_while_are_retried_not_dropped(model, tmp_path, failing_lmdb):
    eng = engine(model, tmp_path / "l3", failing_lmdb, fail_calls=5)
    try:
        paths = kept_and_run(eng, seed=11)
        wb = eng.core.storage.writeback
        assert len(paths) >= 10 and eng.core.storage.tier.backend.failed == 5
        assert missing(eng, paths) == 0
        assert wb.pages_dropped == 0 and eng.core.storage_stats()["write_pages_dropped"] == 0
        assert wb.write_retries >= 5 and eng.core.tree.host_pinned == 0
        assert eng.core.storage_stats()["write_retries"] == wb.write_retries  # in /metrics' storage events
    finally:
        eng.shutdown()


def test_a_store_that_keeps_failing_gets_its_pages_back(model, tmp_path, failing_lmdb):
    eng = engine(model, tmp_path / "l3", failing_lmdb, fail_calls=10**9)
    try:
        paths = kept_and_run(eng, seed=12)
        wb = eng.core.storage.writeback
        assert missing(eng, paths) > 0 and wb.pages_dropped > 0
        assert eng.core.tree.host_pinned == 0 and not wb.waiting and not wb.in_flight  # L2 is not held forever
    finally:
        eng.shutdown()


def test_writes_that_failed_are_not_landing(model, tmp_path, failing_lmdb, monkeypatch):
    """``WriteBack.landing`` (an admission of a hybrid SWA model waits for L2 room while it is true: the L2 pages
    the writes pin come free soon) is true while writes go through and false once the store failed one: its
    backoffs would hold the admission for seconds."""
    import threading

    monkeypatch.setattr(l3_writeback, "RETRY_S", 30.0, raising=False)  # a failed write stays backing off
    eng = engine(model, tmp_path / "l3", failing_lmdb, fail_calls=10**9)
    try:
        wb = eng.core.storage.writeback
        assert not wb.landing
        eng.generate(input_ids=[[5, 6, 7, 8, 9, 10, 11, 12, 13]], sampling_params=GREEDY)
        eng.core.tree.backup_all()
        eng.core.req_cache.flush_transfers()  # on to L3: the store fails it
        for _ in range(200):
            eng.core.storage.poll()
            if wb.waiting and not wb.in_flight:
                break
            threading.Event().wait(0.01)
        assert wb.waiting and wb.write_retries > 0 and not wb.landing
    finally:
        monkeypatch.setattr(l3_writeback, "RETRY_S", 0.002, raising=False)
        for w in eng.core.storage.writeback._backlog:
            w.retry_at = 0.0  # the shutdown's drain retries at once
        eng.shutdown()
    eng = engine(model, tmp_path / "l3b", failing_lmdb, fail_calls=0)
    gate = threading.Event()
    try:
        wb = eng.core.storage.writeback
        wb.before_write = lambda: gate.wait(30)
        eng.generate(input_ids=[[5, 6, 7, 8, 9, 10, 11, 12, 13]], sampling_params=GREEDY)
        eng.core.tree.backup_all()
        eng.core.req_cache.flush_transfers()  # on to L3: held by the gate
        assert (wb.waiting or wb.in_flight) and wb.landing
        gate.set()
        eng.core.storage.poll(wait=True)
        assert not wb.landing
    finally:
        gate.set()
        eng.shutdown()
