"""Holds (``HiRadixTree.hold``): a waiting request's cached prefix, on L2, that an L3 fetch's eviction and
an L1 demotion of pages L3 holds pass over; a demotion of pages L3 lacks still takes its room (no loss).

The case they fix (serving/cache/fetch_room.py): a request waiting for L1 with its prefix fetched onto L2;
the requests running before it finish, and their L1 pages (read from L3, so on L3) are demoted to L2 as
L1 makes room. LRU evicted the waiting prefix for them, and it was read from L3 again.
"""

from __future__ import annotations

from hicache.hiradix import HiRadixTree
from hicache.tiers.allocator import PageAllocator

PS = 2
WAITING = [10, 11, 12, 13, 14, 15, 16, 17]  # 4 pages, on L2 only (fetched from L3)
RUN = [1, 2, 3, 4]  # 2 pages on L1 (a request that ran)


def setup(run_on_l3: bool, hold: bool) -> tuple[HiRadixTree, object]:
    """L2 of 4 pages, all of it the waiting prefix; the run's pages on L1 only (``write_back``)."""
    t = HiRadixTree(PS, PageAllocator(4), PageAllocator(4), write_policy="write_back")
    assert t.insert_host(WAITING, t.host.alloc(4)) == []
    assert t.insert(RUN, t.device.alloc(2)) == []
    if run_on_l3:
        t.mark_stored(RUN, 0, 2)
    node, matched = t.lookup(WAITING)
    assert matched == len(WAITING) and node.host_pages is not None and node.device_pages is None
    if hold:
        t.hold(node)
    t.check_integrity()
    return t, node


def test_a_demotion_of_pages_l3_holds_passes_over_a_held_prefix():
    t, node = setup(run_on_l3=True, hold=True)
    assert t.evict_device(2) == 2
    t.check_integrity()
    assert not node.removed and t.lookup(WAITING)[1] == len(WAITING)  # the waiting prefix stays on L2
    assert t.lookup(RUN)[1] == 0 and t.backups_skipped_pages == 0  # the run's pages: on L3 only, nothing lost
    t.hold(node, -1)
    t.check_integrity()


def test_without_the_hold_the_demotion_evicts_the_waiting_prefix():
    t, node = setup(run_on_l3=True, hold=False)
    assert t.evict_device(2) == 2
    t.check_integrity()
    assert node.removed and t.lookup(RUN)[1] == len(RUN)  # LRU: the older waiting prefix went


def test_a_demotion_of_pages_l3_lacks_still_takes_the_room():
    t, node = setup(run_on_l3=False, hold=True)
    assert t.evict_device(2) == 2
    assert node.removed and t.lookup(RUN)[1] == len(RUN)  # demoted, not lost (the prefix is on L3)
    assert t.backups_skipped_pages == 0
    t.hold(node, -1)  # a hold on a removed node is still released
    t.check_integrity()
    assert all(nd.wait_ref == 0 for nd in t.nodes())


def test_a_fetch_spares_held_prefixes_and_a_split_keeps_the_hold():
    t, node = setup(run_on_l3=True, hold=True)
    t.match_prefix(WAITING[:4])  # splits the held node: both parts are held
    t.check_integrity()
    assert [nd.wait_ref for nd in t.nodes() if nd.device_pages is None] == [1, 1]
    assert t.evict_host(4, drop_backups=True, spare_held=True) == 0
    assert t.lookup(WAITING)[1] == len(WAITING)
    t.hold(node, -1)
    t.check_integrity()
    assert all(nd.wait_ref == 0 for nd in t.nodes())
    assert t.evict_host(4, drop_backups=True, spare_held=True) == 4  # released: evictable again
    t.check_integrity()
