"""L3 promotion in the exclusive tiers, below the engine: the storage contract's ``shared`` and
``batch_delete`` (a real sharded LMDB), and the key guard that orders a page's delete and its writes
(serving/cache/l3_promote.py)."""

from __future__ import annotations

import threading

from hicache.tiers.base import StorageBackend
from hicache.tiers.lmdb.store import LMDBStore
from hicache.tiers.mooncake.store import MooncakeStore
from serving.cache.l3_promote import KeyGuard, Promotions


def lmdb(tmp_path, **extra) -> LMDBStore:
    return LMDBStore.from_config({"path": str(tmp_path / "l3"), "capacity_gb": 0.05, "initial_map_mb": 1,
                                  "shards": 4, **extra})


def test_a_private_lmdb_deletes_a_batch_across_shards(tmp_path):
    st = lmdb(tmp_path)
    try:
        assert st.shared is False and StorageBackend.shared is True and MooncakeStore.shared is True
        keys = [f"k{i:03d}" for i in range(40)]
        assert all(st.batch_set(keys, [bytes([i]) * 100 for i in range(40)]))
        assert st.batch_delete(keys[:30] + ["absent"]) == 30
        assert [st.exists(k) for k in keys] == [False] * 30 + [True] * 10
        assert st.stats()["deleted"] == 30 and st.check_integrity()["entries"] == 10
    finally:
        st.close()


def test_an_lmdb_directory_shared_by_servers_says_so(tmp_path):
    st = lmdb(tmp_path, shared=True)
    try:
        assert st.shared is True
    finally:
        st.close()


def test_a_write_waits_for_a_delete_of_its_keys_and_a_delete_skips_keys_being_written():
    g = KeyGuard()
    assert g.begin_delete(["a", "a"]) == ["a"]
    started = threading.Event()

    def write():
        g.begin_write(["a", "b"])  # a delete of "a" is in flight: the write's exists check waits
        started.set()

    t = threading.Thread(target=write)
    t.start()
    t.join(0.2)
    assert t.is_alive() and not started.is_set()
    g.end_delete(["a"])
    t.join(10)
    assert started.is_set()
    assert g.begin_delete(["a", "c"]) == ["c"]  # "a" is held by the write until it is marked stored
    g.end_write(["a", "b"])
    g.end_delete(["c"])
    assert g.idle and g.begin_delete(["a"]) == ["a"]


def test_promotions_delete_from_the_store_and_keep_what_a_write_holds(tmp_path):
    st = lmdb(tmp_path)
    g = KeyGuard()
    p = Promotions(st, g)
    try:
        keys = [f"p{i}" for i in range(8)]
        assert all(st.batch_set(keys, [b"x" * 64] * 8))
        g.begin_write(keys[:2])  # a write of these keys is in flight
        p.delete(keys)
        p.poll(wait=True)
        assert p.pages_deleted == 6 and p.pages_kept_writing == 2 and p.in_flight == 0
        assert [st.exists(k) for k in keys] == [True] * 2 + [False] * 6
        g.end_write(keys[:2])
        assert g.idle
    finally:
        p.shutdown()
        st.close()
