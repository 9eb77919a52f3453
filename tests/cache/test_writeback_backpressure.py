"""L3 write-back that keeps up: a burst of write-backs larger than the writer's queue is never
dropped. Writes over the cap wait (their L2 pages pinned, so L2 eviction cannot take them)
and reach L3 once the writer gets to them, batched several nodes to a store call.

Deterministic: the writer is held (``before_write``) until the burst has been queued."""

from __future__ import annotations

import random
import threading

import pytest

from harness.model_utils import tiny_model
from harness.slow_storage import slow_lmdb  # noqa: F401 - fixture
from hicache.keys import page_keys
from serving.engine import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("wb"))


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 511) for _ in range(length)] for _ in range(n)]


def engine(path, db, backend: str = "lmdb", **kw) -> Engine:
    kw.setdefault("hicache_ratio", 2.0)
    kw.setdefault("hicache_storage_write_queue_pages", 2)
    return Engine(model_path=str(path), page_size=4, max_total_tokens=256, hicache_write_policy="write_through",
                  hicache_storage_backend=backend,
                  hicache_storage_backend_extra_config={"path": str(db), "capacity_gb": 0.05, "initial_map_mb": 1},
                  **kw)


class KeptPaths:
    """Every path the tree gave an L2 copy (a tree listener): what the policy keeps, and so what
    write-back must put on L3."""

    def __init__(self, tree) -> None:  # noqa: ANN001 - HiRadixTree
        self.tree, self.paths = tree, []
        tree.add_listener(self)

    def __call__(self, kind: str, node) -> None:  # noqa: ANN001 - TreeNode
        if kind == "host_add":
            self.paths.append(self.tree.path_tokens(node))

    def missing_from_l3(self, storage) -> list[int]:  # noqa: ANN001 - StorageController
        """Pages of each kept path that L3 does not hold (0 everywhere when nothing was lost)."""
        out = []
        for path in self.paths:
            keys = page_keys(path, self.tree.page_size, storage.writeback.namespace)
            out.append(len(keys) - storage.tier.batch_exists(keys))
        return out


def step_all(eng: Engine, reqs) -> None:  # noqa: ANN001
    core = eng.core
    for r in reqs:
        core.add(r)
    while any(not r.finished for r in reqs):
        core.step()
        core.check_integrity()  # after every step, with the writes held in flight or waiting


def test_a_burst_over_the_write_queue_loses_nothing(model, tmp_path):
    """12 prompts hit while the writer is held: 12 nodes to write, the cap is 2 pages. Every
    page the tree backed up to L2 reaches L3 once the writer runs; nothing is dropped; the
    waiting writes keep their L2 pages pinned meanwhile (integrity checked after each step)."""
    eng = engine(model, tmp_path / "l3")
    core = eng.core
    kept = KeptPaths(core.tree)
    release = threading.Event()
    core.storage.writeback.before_write = lambda: release.wait(60)
    ps = prompts(12, 22, seed=3)
    try:
        for _ in range(2):  # the second round hits the first: 12 backups to L2, then write-backs
            step_all(eng, [core.make_request(input_ids=p, sampling_params=GREEDY) for p in ps])
        assert len(kept.paths) >= 12, kept.paths
        pinned = core.tree.host_pinned  # the waiting writes' L2 pages
        release.set()
        core.storage.poll(wait=True)
        core.check_integrity()
        assert sum(kept.missing_from_l3(core.storage)) == 0, kept.missing_from_l3(core.storage)
        assert core.storage_stats()["write_pages_dropped"] == 0
        assert pinned >= 12 * 5 and core.tree.host_pinned == 0, pinned
    finally:
        release.set()
        eng.shutdown()


def test_waiting_writes_are_batched_into_few_store_calls(model, tmp_path, slow_lmdb):  # noqa: F811
    """Writes that waited behind a held writer go out together: many nodes per store call (one
    LMDB transaction per staging batch), not one call per node."""
    eng = engine(model, tmp_path / "l3", slow_lmdb, hicache_storage_write_queue_pages=1 << 14)
    core = eng.core
    store = core.storage.tier.backend
    kept = KeptPaths(core.tree)
    release = threading.Event()
    core.storage.writeback.before_write = lambda: release.wait(60)
    ps = prompts(12, 22, seed=4)
    try:
        for _ in range(2):
            step_all(eng, [core.make_request(input_ids=p, sampling_params=GREEDY) for p in ps])
        release.set()
        core.storage.poll(wait=True)
        core.check_integrity()
        assert sum(kept.missing_from_l3(core.storage)) == 0
        nodes = len(kept.paths)
        # the first write of each writer thread went alone (held); everything behind it in a few calls
        assert store.calls["set"] < nodes / 2, (store.calls, nodes)
    finally:
        release.set()
        eng.shutdown()


def test_l2_eviction_never_takes_a_page_waiting_for_its_write(model, tmp_path):
    """A small L2 (hicache_ratio 1) under a burst while the writer is held: L2 fills with pages
    waiting for L3; eviction takes none of them (the tree backs up less instead), and every
    page that got an L2 copy is on L3 at the end."""
    eng = engine(model, tmp_path / "l3", hicache_ratio=1.0)
    core = eng.core
    kept = KeptPaths(core.tree)
    release = threading.Event()
    core.storage.writeback.before_write = lambda: release.wait(60)
    ps = prompts(20, 22, seed=5)  # 20 x 5 pages to back up, L2 holds 64
    try:
        for _ in range(2):
            step_all(eng, [core.make_request(input_ids=p, sampling_params=GREEDY) for p in ps])
        release.set()
        core.storage.poll(wait=True)
        core.check_integrity()
        assert sum(kept.missing_from_l3(core.storage)) == 0, kept.missing_from_l3(core.storage)
        assert core.storage.writeback.pages_dropped == 0
    finally:
        release.set()
        eng.shutdown()
