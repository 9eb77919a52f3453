"""The exclusive tiers (hicache_write_policy: exclusive) in the tree: a page lives in one tier unless hot."""

from __future__ import annotations

import pytest

from hicache.hiradix import HiRadixTree
from hicache.tiers.allocator import PageAllocator

PS = 4


def make(dev: int = 8, host: int = 8, threshold: int = 3) -> HiRadixTree:
    return HiRadixTree(PS, PageAllocator(dev), PageAllocator(host), write_policy="exclusive",
                       write_through_threshold=threshold)


def seq(base: int, pages: int) -> list[int]:
    return [base + i for i in range(pages * PS)]


def put(t: HiRadixTree, toks: list[int]) -> None:
    t.insert(toks, t.device.alloc(len(toks) // PS))
    t.take_transfers()
    t.check_integrity()


def test_eviction_demotes_and_a_load_back_frees_the_l2_copy():
    t = make()
    a = seq(1000, 4)
    put(t, a)
    m = t.match_prefix(a)  # a hit: no L2 copy (write_through would back it up here)
    assert t.cached_pages("host") == 0 and not [x for x in t.take_transfers() if x.kind == "backup"]
    assert t.evict_device(4) == 4  # L1 -> L2
    assert [x.kind for x in t.take_transfers()] == ["backup"]
    assert t.cached_pages("device") == 0 and t.cached_pages("host") == 4
    t.check_integrity()
    m = t.match_prefix(a)
    m2 = t.load_back(m)
    t.take_transfers()
    assert m2.device_hit_tokens == 16 and t.cached_pages("host") == 4  # the copy's source, while loading
    t.check_integrity()
    t.finish_load(m2.last_device_node)
    assert t.cached_pages("host") == 0 and t.cached_pages("device") == 4  # moved up, not copied
    t.check_integrity()


def test_a_hot_node_keeps_both_copies():
    t = make(threshold=2)
    a = seq(2000, 2)
    put(t, a)
    t.match_prefix(a)
    t.evict_device(2)
    t.take_transfers()
    m = t.load_back(t.match_prefix(a))  # second hit: hot
    t.take_transfers()
    t.finish_load(m.last_device_node)
    assert t.cached_pages("host") == 2 and t.cached_pages("device") == 2
    t.check_integrity()


def test_integrity_refuses_a_cold_duplicate():
    t = make()
    a = seq(3000, 2)
    put(t, a)
    node = t.match_prefix(a).last_device_node
    t.tiering.backup([node], protect=t.root)  # an L2 copy nobody asked to keep, of a cold node
    t.take_transfers()
    with pytest.raises(AssertionError, match="cold node on L1 and L2"):
        t.check_integrity()


def test_l3_pages_do_not_join_an_l1_node():
    t = make()
    a = seq(4000, 2)
    put(t, a)
    dup = t.insert_host(a, t.host.alloc(2))
    assert len(dup) == 2 and t.cached_pages("host") == 0  # returned: the node stays on L1 only
    t.host.free(dup)
    t.check_integrity()


def test_l3_takes_the_coldest_l2_pages_ahead_of_their_eviction():
    t = make(dev=4, host=8)
    t.exclusive.enable_demotion()
    chains = [seq(10_000 * (i + 1), 2) for i in range(5)]
    for c in chains[:2]:
        put(t, c)
    assert t.exclusive.dirty_tail(2) == []  # L2 has room: nothing is written
    for c in chains[2:]:  # each insert pushes older chains down to L2
        t.evict_device(2)
        t.take_transfers()
        put(t, c)
    assert t.cached_pages("host") == 6 and t.host.num_free == 2
    tail = t.exclusive.dirty_tail(4)  # 2 free + 2 more: the coldest node, chains[0]
    assert [t.path_tokens(n) for n in tail] == [chains[0]]
    t.mark_stored(chains[0], 0, 2)  # the controller wrote it
    assert t.exclusive.dirty_tail(4) == []
    assert t.evict_host(2) == 2 and t.exclusive.demotions_dropped_pages == 0  # it was on L3: a demotion
    assert t.evict_host(2) == 2 and t.exclusive.demotions_dropped_pages == 2  # chains[1]: L3 lacked it
    t.check_integrity()


def test_an_l3_hit_on_a_private_l3_promotes_the_page():
    t = make(dev=4, host=8)
    t.exclusive.enable_demotion()
    t.exclusive.enable_promotion()
    a = seq(20_000, 3)
    put(t, a[: 1 * PS])  # page 0 on L1; pages 1, 2 come from L3 below it
    assert t.insert_host(a, t.host.alloc(2), start_page=1) == []
    node, _ = t.lookup(a)
    assert node.storage_pages == 0 and t.exclusive.take_promoted() == [(1, 3)]  # the L3 copy goes
    assert t.exclusive.take_promoted() == [] and t.exclusive.l3_promoted_pages == 2
    t.check_integrity()
    t.evict_device(1)  # L1 -> L2: now L2 is the only copy of all three pages
    t.take_transfers()
    assert node in t.exclusive.dirty_tail(8)  # demoted back to L3 as it nears L2's eviction end
    t.mark_stored(a, 1, 3)
    assert t.evict_host(8) >= 2 and t.exclusive.demotions_dropped_pages == 1  # page 0: L3 never had it
    t.check_integrity()


@pytest.mark.parametrize("why", ["hot", "shared"])
def test_an_l3_hit_keeps_its_l3_copy_when_hot_or_shared(why):
    t = make(threshold=1 if why == "hot" else 3)
    t.exclusive.enable_demotion()
    if why == "hot":  # threshold 1: this hit makes every page hot
        t.exclusive.enable_promotion()  # (a shared L3: the controller never enables promotion)
    a = seq(30_000, 2)
    assert t.insert_host(a, t.host.alloc(2)) == []
    node, _ = t.lookup(a)
    assert node.storage_pages == 2 and t.exclusive.take_promoted() == [] and t.exclusive.l3_promoted_pages == 0
    assert t.exclusive.l3_kept_pages == (2 if why == "hot" else 0)
    t.check_integrity()


def _reloaded_while_pinned(t: HiRadixTree, a: list[int], pins: int) -> list[int]:
    """``a`` demoted to L2, then loaded back while ``pins`` readers pin its L2 pages; returns those pages."""
    put(t, a)
    t.evict_device(len(a) // PS)
    t.take_transfers()
    m = t.match_prefix(a)
    pages = list(m.last_host_node.host_pages)
    for _ in range(pins):
        t.pin_host(pages)
    m2 = t.load_back(m)
    t.take_transfers()
    t.finish_load(m2.last_device_node)
    return pages


def test_a_duplicate_only_pins_kept_goes_with_the_last_pin():
    """A load-back lands while the L2 source is pinned (an L3 write, a window-only load): the cold copy stays
    only while pinned, and goes when the last pin does (before: it stayed, a cold node on L1 and L2)."""
    t = make()
    pages = _reloaded_while_pinned(t, seq(3000, 4), pins=2)
    assert t.cached_pages("host") == 4  # pinned: kept beside the L1 copy
    t.check_integrity()
    t.unpin_host(pages)
    assert t.cached_pages("host") == 4  # one reader left
    t.check_integrity()
    t.unpin_host(pages)
    assert t.cached_pages("host") == 0 and t.cached_pages("device") == 4
    t.check_integrity()


def test_a_demotion_before_window_pages_go_keeps_both_copies_while_l1_lives():
    """``demote`` (a hybrid SWA L1 drops a node's window pages, its L2 copy keeps that window KV): both copies
    stay, a split's parts too (before: a cold node on L1 and L2 failed the check); once the L1 copy goes, a
    reload brings the window KV along and frees the L2 copy as any load does."""
    t = make(threshold=10)  # no node hot
    a = seq(4000, 4)
    put(t, a)
    node = t.match_prefix(a).last_device_node
    assert t.demote([node]) == 4
    assert [x.kind for x in t.take_transfers()] == ["backup"]
    assert t.cached_pages("host") == 4 and t.cached_pages("device") == 4
    t.check_integrity()
    t.match_prefix(a[: 2 * PS] + seq(9000, 1))  # splits it after two pages
    t.check_integrity()
    assert t.evict_device(4) == 4  # L2 copies only now
    t.take_transfers()
    m = t.load_back(t.match_prefix(a))
    t.take_transfers()
    t.finish_load(m.last_device_node)
    assert t.cached_pages("host") == 0 and t.cached_pages("device") == 4
    t.check_integrity()


def test_a_pinned_duplicate_split_meanwhile_goes_whole():
    """A duplicate kept by pins is split before the last pin goes: both parts' L2 copies go with it."""
    t = make(threshold=10)  # no node hot
    a = seq(5000, 4)
    pages = _reloaded_while_pinned(t, a, pins=1)
    t.match_prefix(a[: 2 * PS] + seq(9100, 1))  # splits it after two pages
    t.check_integrity()
    t.unpin_host(pages)
    assert t.cached_pages("host") == 0 and t.cached_pages("device") == 4
    t.check_integrity()
