"""Tree support for L3: insert_host (prefetch results into L2), storage_pages, write-back helpers."""

from __future__ import annotations

import pytest

from hicache.hiradix import HiRadixTree
from hicache.tiers.allocator import PageAllocator

PS = 2


def make(dev: int = 16, host: int = 32) -> HiRadixTree:
    """write_back: inserted nodes stay L1-only until evicted (the cases below need them so)."""
    return HiRadixTree(PS, PageAllocator(dev), PageAllocator(host) if host else None, write_policy="write_back")


def put_device(t: HiRadixTree, tokens: list[int]) -> list[int]:
    pages = t.device.alloc(len(tokens) // PS)
    assert t.insert(tokens, pages) == []
    return pages


def test_insert_host_new_chain_is_l2_only_and_stored():
    t = make()
    hp = t.host.alloc(3)
    assert t.insert_host([1, 2, 3, 4, 5, 6, 7], hp) == []  # the partial page is ignored
    t.check_integrity()
    (node,) = t.nodes()
    assert node.device_pages is None and node.host_pages == hp and node.storage_pages == 3
    m = t.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.device_hit_tokens == 0 and m.host_hit_tokens == 6 and m.last_host_node is node
    assert t.cached_pages("host") == 3 and t.evictable_pages("host") == 3
    # L2-only nodes from L3 are evictable like any other, and load back to L1
    m = t.load_back(m)
    assert m.device_hit_tokens == 6 and [tr.kind for tr in t.take_transfers()] == ["load"]
    t.finish_load(m.last_device_node)
    t.check_integrity()


def test_insert_host_below_existing_path_returns_duplicates():
    t = make()
    dev = put_device(t, [1, 2, 3, 4])  # L1 only (no backup yet: write_through backs up on hit)
    hp = t.host.alloc(4)
    dup = t.insert_host([1, 2, 3, 4, 5, 6, 7, 8], hp)
    # the L1-only node adopts the given L2 pages (same KV, from L3): nothing to free
    assert dup == []
    t.check_integrity()
    top = t.match_prefix([1, 2, 3, 4]).last_device_node
    assert top.device_pages == dev and top.host_pages == hp[:2] and top.storage_pages == 2
    (low,) = top.children.values()
    assert low.device_pages is None and low.host_pages == hp[2:] and low.storage_pages == 2
    # again with fresh pages: every node already has an L2 copy, all given ids come back
    hp2 = t.host.alloc(4)
    dup = t.insert_host([1, 2, 3, 4, 5, 6, 7, 8], hp2)
    assert sorted(dup) == sorted(hp2)
    t.check_integrity(host_in_use=4)
    t.host.free(dup)
    t.check_integrity()


def test_insert_host_splits_mid_node_and_keeps_l1_prefix_closed():
    t = make()
    put_device(t, [1, 2, 3, 4, 5, 6])
    hp = t.host.alloc(3)
    dup = t.insert_host([1, 2, 3, 4, 9, 9], hp)  # diverges after two pages
    t.check_integrity(host_in_use=len(dup))
    assert dup == []
    top = t.match_prefix([1, 2, 3, 4]).last_device_node
    assert top.key == [1, 2, 3, 4] and top.host_pages == hp[:2]
    kids = {tuple(c.key): c for c in top.children.values()}
    assert kids[(5, 6)].device_pages is not None and kids[(5, 6)].host_pages is None
    assert kids[(9, 9)].device_pages is None and kids[(9, 9)].host_pages == hp[2:]
    m = t.match_prefix([1, 2, 3, 4, 9, 9])
    assert m.device_hit_tokens == 4 and m.host_hit_tokens == 2


def test_insert_host_needs_l2_and_enough_pages():
    with pytest.raises(ValueError):
        make(host=0).insert_host([1, 2], [0])
    t = make()
    with pytest.raises(ValueError):
        t.insert_host([1, 2, 3, 4], [0])


def test_storage_pages_split_and_mark_stored():
    t = make()
    put_device(t, [1, 2, 3, 4, 5, 6, 7, 8])
    assert t.mark_stored([1, 2, 3, 4, 5, 6, 7, 8], 0, 3) == 3
    (node,) = t.nodes()
    assert node.storage_pages == 3
    t.match_prefix([1, 2, 3, 4, 5, 6, 0, 0])  # split after 3 pages
    upper = t.match_prefix([1, 2]).last_device_node  # split after 1 page
    path = t.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).last_device_node.path_to_root()
    assert [n.storage_pages for n in path] == [0, 2, 1]
    assert upper.storage_pages == 1
    # marking is idempotent and never shrinks; a diverging tail stops the walk
    assert t.mark_stored([1, 2, 3, 4, 9, 9, 9, 9], 0, 4) == 2
    assert [n.storage_pages for n in path] == [0, 2, 1]
    assert t.mark_stored([1, 2, 3, 4, 5, 6, 7, 8], 3, 4) == 1
    assert [n.storage_pages for n in path] == [1, 2, 1]
    t.check_integrity()


def test_mark_stored_is_split_safe():
    """A write-back of pages 2..3 of a node finishes after the node was split after page 3:
    the range lands on both parts, in their own numbering, with no page marked that was not
    written (the old offset arithmetic marked 4 pages on a 1-page node)."""
    t = make()
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    put_device(t, tokens)
    t.mark_stored(tokens, 0, 2)
    (node,) = t.nodes()
    assert node.storage_pages == 2
    t.match_prefix([1, 2, 3, 4, 5, 6, 0, 0])  # split after 3 pages while pages 2..3 are written
    assert t.mark_stored(tokens, 2, 4) == 2
    lower = t.match_prefix(tokens).last_device_node
    assert [n.storage_pages for n in lower.path_to_root()] == [1, 3]
    t.check_integrity()
    # a range that does not continue a node's stored pages leaves a hole unmarked
    t2 = make()
    put_device(t2, tokens)
    t2.mark_stored(tokens, 2, 4)
    assert t2.nodes()[0].storage_pages == 0


def test_pinned_host_pages_survive_eviction_and_are_freed_after_unpin():
    t = HiRadixTree(PS, PageAllocator(8), PageAllocator(8))
    put_device(t, [1, 2, 3, 4])
    node = t.match_prefix([1, 2, 3, 4]).last_device_node  # write_through: backed up on the hit
    t.take_transfers()
    hp = list(node.host_pages)
    t.pin_host(hp)
    assert t.evict_device(2) == 2  # pins never hold L1: the node is demoted to L2
    assert node.device_pages is None and node.host_pages == hp
    t.check_integrity()
    assert t.evict_host(2) == 0  # but L2 eviction skips pages a write-back reads
    assert node.host_pages == hp
    t.reset()  # a flush drops the node; its pinned pages wait
    assert node.removed and all(t.host.is_allocated(p) for p in hp)
    t.check_integrity()
    t.unpin_host(hp)
    assert not any(t.host.is_allocated(p) for p in hp)
    t.check_integrity(host_in_use=0)


def test_path_tokens():
    t = make()
    put_device(t, [1, 2, 3, 4])
    t.insert([1, 2, 3, 4, 5, 6], t.match_prefix([1, 2, 3, 4]).device_pages + t.device.alloc(1))
    end = t.match_prefix([1, 2, 3, 4, 5, 6]).last_device_node
    t.take_transfers()
    assert t.path_tokens(end) == [1, 2, 3, 4, 5, 6]
    t.check_integrity()


def test_insert_host_from_start_page_below_a_cached_prefix():
    t = HiRadixTree(PS, PageAllocator(16), PageAllocator(32), write_policy="write_back")  # no backup on hit
    dev = put_device(t, [1, 2, 3, 4, 5, 6])  # 3 pages on L1
    hp = t.host.alloc(3)
    # the prefetch fetched pages 2.. (page 2 is cached already, pages 3-4 are new)
    dup = t.insert_host([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], hp, start_page=2)
    t.check_integrity(host_in_use=len(dup))
    assert dup == []
    m = t.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert m.device_pages == dev and m.host_hit_tokens == 4
    path = list(reversed(m.last_host_node.path_to_root()))
    assert [n.key for n in path] == [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10]]  # split at start_page
    assert path[0].host_pages is None and path[0].storage_pages == 0  # before start_page: untouched
    assert path[1].host_pages == hp[:1] and path[1].storage_pages == 1  # L1-only node adopts its page
    assert path[2].host_pages == hp[1:] and path[2].device_pages is None and path[2].storage_pages == 2
    # the prefix is gone (diverges before start_page): nothing inserted, every id returned
    hp2 = t.host.alloc(2)
    assert sorted(t.insert_host([1, 2, 9, 9, 5, 6, 7, 8], hp2, start_page=2)) == sorted(hp2)
    assert sorted(t.insert_host([5, 5, 3, 4, 5, 6], hp2, start_page=2)) == sorted(hp2[:1])
    t.check_integrity(host_in_use=2)
    with pytest.raises(ValueError):
        t.insert_host([1, 2], [], start_page=2)


# ---- drop_tail_for_l3: a tail L3 holds leaves the tree, L1 and L2 copies (a windowed cache refetches it whole) ----


def _l2_chain(t: HiRadixTree, tokens: list[int]) -> list[int]:
    """``tokens`` on L2 only, and on L3 (as from a fetch); returns the path's L2 pages."""
    hp = t.host.alloc(len(tokens) // PS)
    dup = t.insert_host(tokens, hp)
    t.host.free(dup)
    return [p for nd in reversed(t.node_at(tokens).path_to_root()) if nd.host_pages for p in nd.host_pages]


def test_drop_tail_for_l3_removes_the_tail_from_a_page_on():
    t = make()
    toks = list(range(1, 13))  # 6 pages
    hp = _l2_chain(t, toks[:8])
    _l2_chain(t, toks)  # a child of 2 more pages below it
    assert t.drop_tail_for_l3(toks, 3) == 3  # pages 3..5: the split node's tail and its child
    t.check_integrity()
    assert t.peek_prefix_len(toks) == 3 * PS and t.cached_pages("host") == 3
    assert all(t.host.is_allocated(p) for p in hp[:3]) and not any(t.host.is_allocated(p) for p in hp[3:])


@pytest.mark.parametrize("why", ["locked", "pinned", "not_on_l3", "branches", "no_tail", "page_0"])
def test_drop_tail_for_l3_changes_nothing_it_cannot_drop(why: str):
    t = make()
    toks = list(range(1, 9))  # 4 pages
    hp = _l2_chain(t, toks)
    node = t.node_at(toks)
    frm = 2
    if why == "locked":
        t.lock(node)
    elif why == "pinned":
        t.pin_host(hp[3:])
    elif why == "not_on_l3":
        node.storage_pages = 0
    elif why == "branches":
        _l2_chain(t, toks[:6] + [99, 98])
    elif why == "no_tail":
        frm = 4
    else:
        frm = 0
    before = t.cached_pages("host")
    assert t.drop_tail_for_l3(toks, frm) == 0
    assert t.cached_pages("host") == before and t.peek_prefix_len(toks) == len(toks)
    if why == "locked":
        t.unlock(node)
    if why == "pinned":
        t.unpin_host(hp[3:])
    t.check_integrity(host_in_use=0)


def test_drop_tail_for_l3_drops_l1_copies_too():
    """A tail on L1 (with or without an L2 copy) whose window KV is gone above L3 is dropped as an L2-only one
    is: its L1 and L2 pages freed, the prefix before it kept (the fetch reads the tail again, whole)."""
    t = make()
    toks = list(range(1, 9))  # 4 pages
    put_device(t, toks)
    t.host.free(t.insert_host(toks, t.host.alloc(4)))  # an L2 copy from L3 beside the L1 one
    node = t.node_at(toks)
    node.storage_pages = len(node.key) // PS
    dev_before, host_before = t.cached_pages("device"), t.cached_pages("host")
    assert t.drop_tail_for_l3(toks, 2) == 2
    t.check_integrity()
    assert t.peek_prefix_len(toks) == 2 * PS
    assert t.cached_pages("device") == dev_before - 2 and t.cached_pages("host") == host_before - 2
