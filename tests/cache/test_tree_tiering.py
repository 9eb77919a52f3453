"""The HiRadixTree's L1 <-> L2 moves (pure bookkeeping): backups when L2 is full, demotion and
load-back (all or nothing, stale matches), L2-only nodes adopted on insert, L2 eviction (locks,
leaves first, L1-resident copies, dropped backups and which go first)."""

from __future__ import annotations

import pytest

from harness.tree_cases import make, put
from hicache.hiradix import StaleMatch, Transfer


def test_backup_skipped_when_host_full_never_fails():
    t = make(dev=16, host=2, policy="write_through")
    put(t, [1, 1, 2, 2])
    m = t.match_prefix([1, 1, 2, 2])
    t.lock(m.last_device_node)
    put(t, [3, 3, 4, 4])
    t.match_prefix([3, 3, 4, 4])  # L2 is full of [1,1,2,2], which is L1-resident: backup skipped
    t.unlock(m.last_device_node)
    t.check_integrity()
    kinds = [x.kind for x in t.take_transfers()]
    assert kinds == ["backup"]
    assert t.match_prefix([3, 3, 4, 4]).device_hit_tokens == 4


def test_demotion_then_load_back_roundtrip():
    t = make(dev=6, host=12, policy="write_back")
    put(t, [1, 1, 2, 2, 3, 3])
    old = t.match_prefix([1, 1, 2, 2, 3, 3]).device_pages
    assert t.evict_device(3) == 3
    (tr,) = t.take_transfers()
    assert tr.kind == "backup" and tr.src_pages == old
    host_pages = tr.dst_pages
    m = t.match_prefix([1, 1, 2, 2, 3, 3, 4])
    assert (m.device_hit_tokens, m.host_hit_tokens) == (0, 6)
    r = t.load_back(m)
    assert r.device_hit_tokens == 6 and r.host_hit_tokens == 0 and len(r.device_pages) == 3
    assert r.last_device_node is m.last_host_node and r.last_device_node.loading
    (tr,) = t.take_transfers()
    assert tr == Transfer("load", host_pages, r.device_pages)
    t.check_integrity()
    # loading nodes are locked: not evictable
    assert t.evict_device(3) == 0
    t.finish_load(r.last_device_node)
    assert not r.last_device_node.loading
    with pytest.raises(ValueError):
        t.finish_load(r.last_device_node)
    t.check_integrity()
    # partial L1 + L2: load only the L2 part; the result lists old + new pages
    put(t, [1, 1, 2, 2, 3, 3, 4, 4])
    assert t.evict_device(1) == 1  # the leaf [4,4]: demoted with a backup
    (tr,) = t.take_transfers()
    m = t.match_prefix([1, 1, 2, 2, 3, 3, 4, 4])
    assert (m.device_hit_tokens, m.host_hit_tokens) == (6, 2) and m.device_pages == r.device_pages
    r2 = t.load_back(m)
    (ld,) = t.take_transfers()
    assert ld.src_pages == tr.dst_pages and r2.device_pages == r.device_pages + ld.dst_pages
    t.finish_load(r2.last_device_node)
    t.check_integrity()


def test_load_back_all_or_nothing_and_threshold():
    t = make(dev=4, host=16, policy="write_back", load_back_threshold=2)
    put(t, [1, 1, 2, 2, 3, 3])
    t.evict_device(3)
    put(t, [9, 9])
    t.take_transfers()
    # below threshold: one page on L2
    m = t.match_prefix([1, 1, 9])
    assert m.host_hit_tokens == 2
    assert t.load_back(m) is m and t.take_transfers() == []
    # 3 pages needed; L1 has 4 pages, 1 used by a locked node and 1 free... lock [9,9]
    m9 = t.match_prefix([9, 9])
    t.lock(m9.last_device_node)
    hog = t.device.alloc(2)  # a running request holds 2 pages
    m = t.match_prefix([1, 1, 2, 2, 3, 3])
    assert m.host_hit_tokens == 6
    before = (t.device.num_free, t.cached_pages("device"))
    assert t.load_back(m) is m  # cannot get 3 pages: loads nothing
    assert (t.device.num_free, t.cached_pages("device")) == before
    assert t.take_transfers() == []
    t.check_integrity(device_in_use=2)
    t.device.free(hog)
    r = t.load_back(m)
    assert r.device_hit_tokens == 6
    chain = r.last_device_node.path_to_root()[::-1]
    assert [len(n.key) for n in chain] == [2, 4]  # two nodes (split by the first match)
    (tr,) = t.take_transfers()
    assert tr.kind == "load" and tr.src_pages == chain[0].host_pages + chain[1].host_pages
    assert tr.dst_pages == r.device_pages == chain[0].device_pages + chain[1].device_pages
    t.finish_load(r.last_device_node)
    t.unlock(m9.last_device_node)
    t.check_integrity()


def test_load_back_evicts_other_nodes_and_stale_match():
    t = make(dev=4, host=16, policy="write_back")
    put(t, [1, 1, 2, 2])
    t.evict_device(2)
    put(t, [5, 5, 6, 6, 7, 7, 8, 8])  # fills L1
    t.take_transfers()
    m = t.match_prefix([1, 1, 2, 2])
    r = t.load_back(m)
    assert r.device_hit_tokens == 4
    kinds = [x.kind for x in t.take_transfers()]
    assert kinds == ["backup", "load"]  # the evicted pages are backed up before being reloaded into
    t.finish_load(r.last_device_node)
    t.check_integrity()
    assert t.match_prefix([5, 5, 6, 6, 7, 7, 8, 8]).host_hit_tokens == 8
    m = t.match_prefix([5, 5, 6, 6, 7, 7, 8, 8])
    t.evict_host(100)
    with pytest.raises(StaleMatch):
        t.load_back(m)


def test_insert_adopts_pages_on_l2_only_nodes():
    t = make(dev=8, host=16, policy="write_back")
    put(t, [1, 1, 2, 2, 3, 3])
    t.evict_device(100)
    t.take_transfers()
    new = t.device.alloc(4)
    # a request recomputed the L2-only prefix (e.g. below the load-back threshold)
    assert t.insert([1, 1, 2, 2, 3, 3, 4, 4], new) == []
    t.check_integrity()
    m = t.match_prefix([1, 1, 2, 2, 3, 3, 4, 4])
    assert m.device_pages == new and m.host_hit_tokens == 0
    assert t.cached_pages("host") == 3  # the L2 copy stays
    t.check_integrity()


def test_evict_host_keeps_l1_resident_copies():
    t = make(dev=16, host=16, policy="write_through")
    put(t, [1, 1, 2, 2])
    t.match_prefix([1, 1, 2, 2])  # backed up: on L1 and L2
    put(t, [3, 3])
    t.match_prefix([3, 3])
    t.evict_device(1)  # LRU: [1,1,2,2] -> L2 only
    t.take_transfers()
    assert t.evictable_pages("host") == 2
    assert t.evict_host(100) == 2  # [3,3]'s L2 copy stays: it is on L1
    assert t.cached_pages("host") == 1 and t.num_nodes == 1
    assert t.match_prefix([1, 1, 2, 2]).cached_tokens == 0
    t.check_integrity()


def test_evict_host_respects_locks_and_leaves_first():
    t = make(dev=16, host=16, policy="write_back")
    put(t, [1, 1, 2, 2])
    put(t, [1, 1, 2, 2, 3, 3])
    t.evict_device(100)
    t.take_transfers()
    m = t.match_prefix([1, 1, 2, 2, 3, 3])
    assert m.host_hit_tokens == 6
    t.lock(m.last_host_node)
    assert t.evict_host(100) == 0
    t.unlock(m.last_host_node)
    assert t.evict_host(1) == 1  # the leaf [3,3] only
    assert t.match_prefix([1, 1, 2, 2, 3, 3]).host_hit_tokens == 4
    t.check_integrity()


def test_no_host_eviction_drops_and_demotion_drop_when_host_tiny():
    t = make(dev=8, host=1, policy="write_back")
    put(t, [1, 1, 2, 2])
    assert t.evict_device(2) == 2  # 2 pages do not fit on a 1-page L2: dropped
    assert t.num_nodes == 0 and t.take_transfers() == []
    t.check_integrity()


def test_evict_host_drops_backups_of_l1_nodes_only_when_asked():
    t = make(dev=16, host=16, policy="write_through")
    put(t, [1, 1, 2, 2])
    t.match_prefix([1, 1, 2, 2])  # backed up: on L1 and L2
    t.take_transfers()
    assert t.cached_pages("host") == 2
    assert t.evict_host(100) == 0  # plain eviction keeps backups of L1 nodes
    m = t.match_prefix([1, 1, 2, 2])
    t.lock(m.last_device_node)
    assert t.evict_host(100, drop_backups=True) == 0  # locked: kept
    t.unlock(m.last_device_node)
    assert t.evict_host(1, drop_backups=True) == 2  # a prefetch needs room: the backup goes, L1 stays
    assert t.cached_pages("host") == 0 and t.cached_pages("device") == 2
    assert t.match_prefix([1, 1, 2, 2]).device_hit_tokens == 4
    t.check_integrity()


def test_drop_backups_takes_nodes_on_l3_first():
    """A prefetch that drops L2 backups of L1 nodes takes those of nodes L3 holds first: an L1
    eviction without L2 room then loses nothing. Policy order (LRU) would take [1, 1] first."""
    t = make(dev=16, host=16, policy="write_through")
    for toks in ([1, 1, 2, 2], [3, 3, 4, 4]):
        put(t, toks)
        t.match_prefix(toks)  # backed up: on L1 and L2
        t.take_transfers()
    assert t.mark_stored([3, 3, 4, 4], 0, 2) == 2
    assert t.evict_host(1, drop_backups=True) == 2
    assert t.lookup([3, 3, 4, 4])[0].host_pages is None
    assert t.lookup([1, 1, 2, 2])[0].host_pages is not None
    t.check_integrity()



@pytest.mark.parametrize("policy", ["write_back", "exclusive"])
def test_eviction_demotes_before_it_drops(policy):
    """L2 has no room for a backup (full of a copy of something still on L1): L1 eviction frees the nodes
    it can without losing anything (an L1 copy whose L2 copy exists) before it drops one that has no
    other copy, even when that one is colder."""
    t = make(dev=3, host=2, policy=policy)
    put(t, [3, 3])  # Y: the coldest, on L1 only
    put(t, [1, 1, 2, 2])  # X: on L1, and given an L2 copy on purpose (L2 is then full)
    assert t.backup_prefix([1, 1, 2, 2]) == 2
    t.take_transfers()
    t.check_integrity()
    assert t.evict_device(1) == 2  # X leaves L1 (its two pages), Y stays
    assert t.take_transfers() == []  # nothing to copy: X's L2 copy is there already
    assert t.backups_skipped_pages == 0
    assert t.match_prefix([3, 3]).device_hit_tokens == 2
    m = t.match_prefix([1, 1, 2, 2])
    assert (m.device_hit_tokens, m.host_hit_tokens) == (0, 4)
    t.check_integrity()
    assert t.evict_device(1) == 1  # now Y: X's L2 copy (an L2-only leaf now) makes room for Y's backup
    (tr,) = t.take_transfers()
    assert tr.kind == "backup" and t.backups_skipped_pages == 0
    m = t.match_prefix([3, 3])
    assert (m.device_hit_tokens, m.host_hit_tokens) == (0, 2)
    t.check_integrity()


def test_eviction_drops_what_nothing_else_can_give():
    """The same, with X locked (a running request reads it): Y is all L1 can give, and L2 has no room for it:
    it is dropped and counted."""
    t = make(dev=3, host=2, policy="write_back")
    put(t, [3, 3])
    put(t, [1, 1, 2, 2])
    t.backup_prefix([1, 1, 2, 2])
    t.take_transfers()
    x = t.match_prefix([1, 1, 2, 2]).last_device_node
    t.lock(x)
    assert t.evict_device(1) == 1 and t.take_transfers() == []
    assert t.backups_skipped_pages == 1 and t.match_prefix([3, 3]).device_hit_tokens == 0
    t.unlock(x)
    t.check_integrity()


def _backups_land_in_live_copies(t) -> list[Transfer]:
    """The drained transfers, each backup's L2 pages still the L2 copy of the nodes it names."""
    out = t.take_transfers()
    for tr in out:
        if tr.kind == "backup":
            held = [p for nd in tr.nodes if not nd.removed and nd.host_pages is not None for p in nd.host_pages]
            assert held == tr.dst_pages, f"a backup into L2 pages its nodes no longer hold: {tr.dst_pages}"
    return out


def test_an_eviction_never_drops_the_l2_copy_its_own_demotion_is_about_to_write():
    """L1 eviction of two leaves with room in L2 for one: the first is demoted (its backup queued, not yet
    run); the second's L2 room must not come from dropping that copy (the oldest L2 leaf), which would leave
    the queued backup writing into freed L2 pages (a host window pool then leaked the window pages it took
    for them) and the first leaf lost."""
    t = make(dev=4, host=1, policy="write_back")
    put(t, [1, 1])
    put(t, [2, 2])
    assert t.evict_device(2) == 2
    (tr,) = _backups_land_in_live_copies(t)
    t.check_integrity()
    assert t.match_prefix([1, 1]).host_hit_tokens == 2 and tr.nodes[0].host_pages == tr.dst_pages


def test_a_prefetchs_room_never_drops_a_backup_still_queued():
    """``evict_host(drop_backups=True)`` (an L3 prefetch's room) inside the operation that queued a backup of an
    L1 node: that node keeps the L2 copy the backup writes."""
    t = make(dev=8, host=2, policy="write_through")
    put(t, [1, 1, 2, 2])
    t.take_transfers()
    t.match_prefix([1, 1, 2, 2])  # write-through: the hit queues its backup
    assert t.evict_host(2, drop_backups=True) == 0
    assert [x.kind for x in _backups_land_in_live_copies(t)] == ["backup"]
    t.check_integrity()


def test_a_backup_whose_copy_left_with_its_parent_is_not_run():
    """L1 eviction demotes a leaf (its backup queued), then drops its parent for want of L2 room: the leaf's
    L2 copy leaves the tree with it, and the drained transfers hold no backup into those freed L2 pages."""
    t = make(dev=6, host=1, policy="write_back")
    put(t, [1, 1, 2, 2])
    put(t, [1, 1, 3, 3])  # [1,1] with two leaves
    t.take_transfers()
    assert t.evict_device(3) == 3
    out = _backups_land_in_live_copies(t)
    assert all(t.host.is_allocated(p) for tr in out if tr.kind == "backup" for p in tr.dst_pages)
    t.check_integrity()
    assert t.match_prefix([1, 1, 2, 2]).cached_tokens == 0
