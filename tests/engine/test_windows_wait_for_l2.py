"""Window room for an admission while L3 writes pin L2 (serving/cache/request_windows.py, ``_drop_windows``):
a tree node on L1 only that would lose its window pages is demoted to L2 first; when L2 has no room for it
(its pages pinned by L3 writes still in flight), the admission waits (NO_ROOM) and the node keeps its window
KV, instead of dropping it unsaved (its conversation's next turn then recomputed everything: the burst of a
multi-turn bench whose L3 writes pinned L2). Once the writes land, the node is demoted and its window comes
back from L2. A tiny random Gemma-3 (8-token windows), float32 on CPU, page size 4, real LMDB L3, the L3
writer held by its test hook (``WriteBack.before_write``); HF's greedy tokens; check_integrity() after every
step."""

from __future__ import annotations

import threading

import pytest

from harness.engine_cases import generate_checked, ids_of, window_case
from serving.engine import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
PS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return window_case("gemma3", tmp_path_factory.mktemp("gemma3"), GREEDY["max_new_tokens"])


def _engine(path, tmp_path) -> Engine:
    return Engine(model_path=str(path), page_size=PS, max_total_tokens=256, hicache_ratio=1.0,
                  hicache_write_policy="write_back", max_running_requests=2, enable_hybrid_swa_memory=True,
                  swa_full_tokens_ratio=0.1, hicache_storage_backend="lmdb",
                  hicache_storage_backend_extra_config={"path": str(tmp_path / "l3"), "capacity_gb": 0.05,
                                                        "initial_map_mb": 1})


def test_an_admission_waits_for_l2_rather_than_drop_windows_it_cannot_demote(tiny, tmp_path) -> None:
    _, path, ps, _, ref, _ = tiny
    eng = _engine(path, tmp_path)
    gate = threading.Event()
    try:
        core, rw = eng.core, eng.core.req_cache.windows
        tree, host, wmap = core.tree, core.host_pool, rw.windows.map
        core.storage.writeback.before_write = lambda: gate.wait(30)
        assert ids_of(generate_checked(eng, ps[:1], GREEDY)) == ref[:1]
        tree.backup_all()  # the first prompt on L2, its L3 write held: its L2 pages stay pinned
        core.req_cache.flush_transfers()
        for nd in tree.nodes():
            core.storage.writeback.write(nd)
        assert core.storage.writeback.in_flight or core.storage.writeback.waiting
        assert ids_of(generate_checked(eng, ps[1:2], GREEDY)) == ref[1:2]  # write_back: on L1 only
        node, _ = tree.lookup(ps[1])
        ends = [nd for nd in node.path_to_root() if nd.device_pages is not None and nd.host_pages is None
                and any(wmap[p] >= 0 for p in nd.device_pages)]
        assert ends, "the second prompt's end is on L1 only, with its window pages"
        held = host.allocator.alloc(host.allocator.num_free)  # L2 full: the rest pinned by the held write
        windowed = sum(1 for nd in ends for p in nd.device_pages if wmap[p] >= 0)
        need = rw.windows.num_free + windowed  # only taking that end's window pages would do
        # an admission: the end cannot be demoted now and L2 room comes back when the write lands -> wait
        assert not rw.room_for_load([], 0, None, restore=need)
        assert sum(1 for nd in ends for p in nd.device_pages if wmap[p] >= 0) == windowed, "windows dropped unsaved"
        host.allocator.free(held)  # (check_integrity counts every allocated L2 page as the tree's)
        eng.check_integrity()
        gate.set()
        core.storage.poll(wait=True)
        assert rw.room_for_load([], 0, None, restore=need)  # demoted now: L2 keeps the end's window KV
        assert all(nd.host_pages is not None for nd in ends)
        eng.check_integrity()
        tree.evict_device(tree.cached_pages("device"))
        core.req_cache.flush_transfers()
        outs = generate_checked(eng, ps[1:2], GREEDY)
        assert ids_of(outs) == ref[1:2]
        assert outs[0]["meta_info"]["cached_tokens_details"]["host"] > 0, outs[0]["meta_info"]
        eng.check_integrity()
    finally:
        gate.set()
        eng.shutdown()
