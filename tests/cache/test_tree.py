"""Unit tests of the HiRadixTree (pure bookkeeping): match, insert, split, locks, eviction order,
write policies, sessions, integrity, the registry and config. Its L1 <-> L2 moves (demotion,
load-back, L2 eviction, backups) are tests/cache/test_tree_tiering.py; L3 marks tests/cache/test_tree_storage.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.tree_cases import make, put
from hicache.hiradix import HiRadixTree, UnknownSession
from hicache.tiers.allocator import PageAllocator

ROOT = Path(__file__).resolve().parents[2]


def test_match_insert_split():
    t = make()
    assert t.match_prefix([1, 2, 3]).device_hit_tokens == 0
    pages = t.device.alloc(3)
    assert t.insert([1, 2, 3, 4, 5, 6, 7], pages) == []  # 7th token ignored (partial page)
    t.check_integrity()
    assert t.num_nodes == 1
    m = t.match_prefix([1, 2, 3, 4, 9, 9])
    assert m.device_pages == pages[:2] and m.device_hit_tokens == 4 and m.host_hit_tokens == 0
    assert t.num_nodes == 2  # split at the mismatch
    assert m.last_device_node.key == [1, 2, 3, 4] and m.last_device_node is m.last_host_node
    # match ending mid-node because the query runs out
    m2 = t.match_prefix([1, 2, 3])
    assert m2.device_pages == pages[:1] and t.num_nodes == 3
    # the full sequence still matches through the split nodes
    m3 = t.match_prefix([1, 2, 3, 4, 5, 6])
    assert m3.device_pages == pages and m3.device_hit_tokens == 6
    path = m3.last_device_node.path_to_root()[::-1]
    assert [n.key for n in path] == [[1, 2], [3, 4], [5, 6]]
    assert [n.hit_count for n in path] == [3, 2, 1]  # split halves inherit the hit count
    t.check_integrity()
    # branch
    b = t.device.alloc(2)
    assert t.insert([1, 2, 7, 7, 8, 8], pages[:1] + b) == []
    assert t.match_prefix([1, 2, 7, 7, 8, 8, 9]).device_pages == pages[:1] + b
    t.check_integrity()
    assert t.match_prefix((1, 2, 7, 7)).device_hit_tokens == 4  # tuples work too


def test_insert_returns_duplicates():
    t = make()
    a = t.device.alloc(3)
    t.insert([1, 1, 2, 2, 3, 3], a)
    b = t.device.alloc(4)  # a second request computed the same prefix in other pages
    dup = t.insert([1, 1, 2, 2, 3, 3, 4, 4], b)
    assert dup == b[:3]
    t.check_integrity(device_in_use=3)
    t.device.free(dup)
    t.check_integrity()
    # the request's own matched pages are not returned
    m = t.match_prefix([1, 1, 2, 2, 3, 3, 4, 4, 5, 5])
    c = t.device.alloc(1)
    assert t.insert([1, 1, 2, 2, 3, 3, 4, 4, 5, 5], m.device_pages + c) == []
    t.check_integrity()
    with pytest.raises(ValueError):
        t.insert([1, 1, 2, 2], [a[0]])  # one page id for two pages


def test_lock_protects_from_eviction_and_unlock_below_zero():
    t = make(dev=8)
    put(t, [1, 1, 2, 2])
    put(t, [3, 3, 4, 4])
    m = t.match_prefix([1, 1, 2, 2])
    t.lock(m.last_device_node)
    assert t.evictable_pages("device") == 2
    assert t.evict_device(100) == 2
    t.check_integrity()
    assert t.match_prefix([1, 1, 2, 2]).device_hit_tokens == 4
    assert t.match_prefix([3, 3, 4, 4]).device_hit_tokens == 0
    t.unlock(m.last_device_node)
    with pytest.raises(RuntimeError):
        t.unlock(m.last_device_node)
    assert t.evict_device(1) == 2
    assert t.num_nodes == 0 and t.device.num_free == 8
    t.check_integrity()


def test_lru_order_and_parents_after_children():
    t = make(dev=32)
    put(t, [0, 0, 1, 1])
    put(t, [0, 0, 1, 1, 2, 2])  # child of the first
    put(t, [5, 5])
    put(t, [6, 6])
    t.match_prefix([5, 5])
    # leaves by last access: [2,2] (oldest), [6,6], [5,5]
    assert t.evict_device(1) == 1
    assert t.match_prefix([0, 0, 1, 1, 2, 2]).device_hit_tokens == 4
    # that match touched [0,0,1,1]; now [6,6] is oldest
    assert t.evict_device(1) == 1
    assert t.match_prefix([6, 6]).device_hit_tokens == 0
    assert t.match_prefix([5, 5]).device_hit_tokens == 2
    t.check_integrity()


def test_lfu_order():
    t = make(dev=32, eviction_policy="lfu")
    put(t, [1, 1])
    put(t, [2, 2])
    for _ in range(3):
        t.match_prefix([1, 1])
    t.match_prefix([2, 2])  # most recent but less frequent
    assert t.evict_device(1) == 1
    assert t.match_prefix([1, 1]).device_hit_tokens == 2
    assert t.match_prefix([2, 2]).device_hit_tokens == 0


def test_session_referenced_evicted_after_unreferenced():
    t = make(dev=32)
    put(t, [1, 1, 2, 2])
    put(t, [3, 3])
    put(t, [4, 4])
    t.open_session("s")
    t.attach_session("s", t.match_prefix([1, 1, 2, 2]).last_device_node)
    t.match_prefix([3, 3])
    t.match_prefix([4, 4])  # [1,1,2,2] is the LRU node but session-referenced
    t.check_integrity()
    assert t.evict_device(2) == 2
    assert t.match_prefix([1, 1, 2, 2]).device_hit_tokens == 4
    assert t.match_prefix([3, 3]).device_hit_tokens == 0
    assert t.match_prefix([4, 4]).device_hit_tokens == 0
    # re-attach elsewhere replaces the ref
    t.attach_session("s", t.match_prefix([1, 1]).last_device_node)
    t.check_integrity()
    t.close_session("s")  # (when a session is idle is serving/cache/kv_sessions.py's: it closes it here)
    assert "s" not in t.sessions and t.match_prefix([1, 1]).last_device_node.session_ref == 0
    t.check_integrity()
    with pytest.raises(UnknownSession):
        t.close_session("s")
    with pytest.raises(KeyError):
        t.attach_session("nope", t.root)
    # a session attached to a node that gets evicted releases the ancestors' refs on close
    t.open_session("x")
    t.attach_session("x", t.match_prefix([1, 1, 2, 2]).last_device_node)
    t.evict_device(100)
    t.check_integrity()
    t.close_session("x")
    t.check_integrity()


@pytest.mark.parametrize(
    ("policy", "backup_after_hits"),
    [("write_through", 1), ("write_through_selective", 2), ("write_back", None)],
)
def test_write_policies(policy, backup_after_hits):
    t = make(dev=16, host=16, policy=policy, write_through_threshold=2)
    put(t, [1, 1, 2, 2])
    assert t.take_transfers() == []  # insert never backs up
    for hit in (1, 2, 3):
        t.match_prefix([1, 1, 2, 2])
        tr = t.take_transfers()
        if hit == backup_after_hits:
            assert len(tr) == 1 and tr[0].kind == "backup" and len(tr[0].src_pages) == 2
            assert t.cached_pages("host") == 2
        else:
            assert tr == []
        t.check_integrity()
    # eviction demotes: a backup only if the node has no L2 copy yet
    assert t.evict_device(2) == 2
    tr = t.take_transfers()
    assert [x.kind for x in tr] == ([] if backup_after_hits is not None else ["backup"])
    m = t.match_prefix([1, 1, 2, 2, 3, 3])
    assert m.device_hit_tokens == 0 and m.host_hit_tokens == 4
    t.check_integrity()


def test_split_keeps_locks_and_session_refs():
    t = make(dev=16)
    put(t, [1, 1, 2, 2, 3, 3])
    t.open_session("s")
    m = t.match_prefix([1, 1, 2, 2, 3, 3])
    t.lock(m.last_device_node)
    t.attach_session("s", m.last_device_node)
    t.match_prefix([1, 1, 9, 9])  # splits the locked node
    upper = t.match_prefix([1, 1]).last_device_node
    assert (upper.lock_ref, upper.session_ref) == (1, 1)
    t.check_integrity()
    assert t.evict_device(100) == 0
    t.unlock(m.last_device_node)
    assert upper.lock_ref == 0
    t.check_integrity()


def test_pool_less_tree():
    t = HiRadixTree(4, None)
    assert t.host is None and t.pool_less
    toks = list(range(40))
    m = t.match_prefix(toks)
    pages = t.device.alloc(10)
    assert t.insert(toks, m.device_pages + pages) == []
    assert t.match_prefix(toks + [1]).device_pages == pages
    assert t.cached_pages("device") == 10
    t.check_integrity()
    assert t.evict_device(3) == 10
    assert t.num_nodes == 0
    t.check_integrity()
    assert t.take_transfers() == []
    with pytest.raises(ValueError):
        HiRadixTree(4, None, PageAllocator(4))


def test_reset():
    t = make(dev=16, host=16)
    put(t, [1, 1, 2, 2])
    t.match_prefix([1, 1, 2, 2])
    put(t, [3, 3])
    t.open_session("s")
    t.attach_session("s", t.match_prefix([3, 3]).last_device_node)
    m = t.match_prefix([1, 1])
    t.lock(m.last_device_node)
    with pytest.raises(RuntimeError):
        t.reset()
    t.unlock(m.last_device_node)
    t.reset()
    assert t.num_nodes == 0 and t.device.num_free == 16 and t.host.num_free == 16
    assert t.take_transfers() == []
    t.check_integrity()
    put(t, [3, 3])
    t.attach_session("s", t.match_prefix([3, 3]).last_device_node)
    t.close_session("s")
    t.check_integrity()


def test_check_integrity_catches_corruption():
    t = make(dev=8)
    put(t, [1, 1, 2, 2])
    t.check_integrity()
    with pytest.raises(AssertionError, match="allocated"):
        t.check_integrity(device_in_use=1)
    node = t.match_prefix([1, 1]).last_device_node
    node.lock_ref = -1
    with pytest.raises(AssertionError):
        t.check_integrity()
    node.lock_ref = 0
    node.device_pages[0] = 7  # not allocated
    with pytest.raises(AssertionError):
        t.check_integrity()


def test_from_config():
    from hicache.config import CacheConfig

    cfg = CacheConfig(
        page_size=4, hicache_write_policy="write_back", eviction_policy="lfu", load_back_threshold=3
    )
    t = HiRadixTree.from_config(cfg, PageAllocator(8), PageAllocator(16))
    assert t.page_size == 4 and t.load_back_threshold == 3
    assert type(t.write_policy).__name__ == "WriteBack" and type(t.eviction_policy).__name__ == "LFU"


def test_policy_registry_errors():
    with pytest.raises(ValueError, match="write policy"):
        make(policy="nope")
    with pytest.raises(ValueError, match="eviction policy"):
        make(eviction_policy="nope")


def test_bench_smoke(tmp_path: Path):
    out = tmp_path / "tree.json"  # the benchmark as a script: tests never import bench
    subprocess.run([sys.executable, str(ROOT / "bench" / "tree_ops.py"), "--users", "4", "--turns", "3",
                    "--l1-tokens", "2000", "--json", str(out)], cwd=ROOT, check=True, capture_output=True, timeout=300)
    data = json.loads(out.read_text())
    assert set(data) == {"unbounded", "l1_100k", "l1_100k_l2_400k"}
    for v in data.values():
        assert v["us_per_request"] > 0 and 0 <= v["hit_rate"] <= 1
    assert data["unbounded"]["hit_rate"] >= data["l1_100k_l2_400k"]["hit_rate"] >= data["l1_100k"]["hit_rate"]


def test_peek_prefix_len_is_read_only():
    t = HiRadixTree(4, PageAllocator(16))
    toks = list(range(100, 124))  # 6 pages
    t.insert(toks, t.device.alloc(6))
    nodes, before = t.num_nodes, [(n.hit_count, n.last_access) for n in t.nodes()]
    probe = toks[:10] + [1, 2, 3, 4, 5, 6]  # diverges inside the node, in page 3
    assert t.peek_prefix_len(probe) == 8
    assert t.peek_prefix_len(toks + [7]) == 24 and t.peek_prefix_len([9] * 8) == 0
    assert t.num_nodes == nodes and [(n.hit_count, n.last_access) for n in t.nodes()] == before
    assert t.match_prefix(probe).device_hit_tokens == 8  # the mutating match agrees (and splits)
    assert t.num_nodes == nodes + 1
    t.check_integrity()
