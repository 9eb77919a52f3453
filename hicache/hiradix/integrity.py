"""Full consistency check of a HiRadixTree and its pools (O(tree); for tests and debugging).

Checks, raising AssertionError with a message naming the culprit:
- per tier: pages allocated from the pool == pages cached in the tree + pages the caller
  holds outside it (``*_in_use``); every cached page is allocated; no page id twice;
- every node: key length a positive multiple of page_size, equal to pages * page_size on
  each tier it is on; at least one copy; L1 prefix-closed (parent on L1 or the root);
  children keyed by their first page and pointing back to the parent; not removed;
- refs: lock_ref and session_ref >= 0 and a parent's >= the sum of its children's;
  session refs equal what the open sessions imply; loading nodes are locked and on both tiers;
- the tree's counters and its lazy eviction-candidate sets are up to date;
- pinned L2 pages are in the tree or deferred; deferred pages are pinned and counted as used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hicache.hiradix.tree import HiRadixTree


def _check_pool(name: str, alloc, ids: set[int], in_use: int) -> None:
    if alloc is None:
        assert not ids, f"{name}: tree holds pages {sorted(ids)[:8]} but there is no {name} pool"
        assert in_use == 0, f"{name}: {in_use} pages in use but there is no {name} pool"
        return
    alloc.check_integrity()
    used = alloc.num_used
    assert used == len(ids) + in_use, (
        f"{name}: {used} pages allocated != {len(ids)} cached in tree + {in_use} in use by callers"
    )
    bad = [p for p in ids if not alloc.is_allocated(p)]
    assert not bad, f"{name}: tree holds pages not allocated in the pool: {sorted(bad)[:8]}"


def check_tree(tree: HiRadixTree, device_in_use: int = 0, host_in_use: int = 0) -> None:
    ps = tree.page_size
    root = tree.root
    assert root.parent is None and not root.key and root.lock_ref == 0, "root corrupted"
    dev_ids: set[int] = set()
    host_ids: set[int] = set()
    dev_count = host_count = locked_dev = num_nodes = 0
    expected_sess: dict[int, int] = {}
    for node in tree.sessions.attachments():
        for nd in node.path_to_root():
            expected_sess[nd.id] = expected_sess.get(nd.id, 0) + 1

    stack = [root]
    while stack:
        parent = stack.pop()
        child_locks = child_sess = 0
        for first, nd in parent.children.items():
            stack.append(nd)
            num_nodes += 1
            where = repr(nd)
            assert not nd.removed, f"removed node still in tree: {where}"
            assert nd.parent is parent, f"child's parent pointer is wrong: {where}"
            klen = len(nd.key)
            assert klen > 0 and klen % ps == 0, f"key length {klen} not a positive multiple of {ps}: {where}"
            assert first == tuple(nd.key[:ps]), f"child keyed by {first}, key starts {nd.key[:ps]}: {where}"
            assert nd.device_pages is not None or nd.host_pages is not None, f"node with no copy: {where}"
            for tier, pages, ids in (("L1", nd.device_pages, dev_ids), ("L2", nd.host_pages, host_ids)):
                if pages is None:
                    continue
                assert len(pages) * ps == klen, f"{tier}: {len(pages)} pages for {klen} tokens: {where}"
                for p in pages:
                    assert p not in ids, f"{tier}: page {p} appears twice in the tree ({where})"
                    ids.add(p)
            if nd.device_pages is not None:
                dev_count += len(nd.device_pages)
                if nd.lock_ref:
                    locked_dev += len(nd.device_pages)
                assert parent is root or parent.device_pages is not None, (
                    f"L1 node under a non-L1 parent: {where}"
                )
                if not any(c.device_pages is not None for c in nd.children.values()):
                    assert nd in tree._dev_leaves, f"L1 leaf missing from the candidate set: {where}"
            if nd.host_pages is not None:
                host_count += len(nd.host_pages)
                if nd.device_pages is None and not nd.children:
                    assert nd in tree._host_leaves, f"L2 leaf missing from the candidate set: {where}"
            assert 0 <= nd.storage_pages <= klen // ps, f"storage_pages {nd.storage_pages} out of range: {where}"
            assert nd.lock_ref >= 0, f"negative lock_ref: {where}"
            assert nd.session_ref >= 0, f"negative session_ref: {where}"
            assert nd.hit_count >= 0, f"negative hit_count: {where}"
            assert nd.session_ref == expected_sess.get(nd.id, 0), (
                f"session_ref {nd.session_ref} != {expected_sess.get(nd.id, 0)} implied by sessions: {where}"
            )
            if nd.loading:
                assert nd.lock_ref > 0, f"loading node not locked: {where}"
                assert nd.device_pages is not None and nd.host_pages is not None, (
                    f"loading node tiers: {where}"
                )
            child_locks += nd.lock_ref
            child_sess += nd.session_ref
        if parent is not root:
            assert parent.lock_ref >= child_locks, (
                f"lock_ref {parent.lock_ref} < children's {child_locks}: {parent!r}"
            )
            assert parent.session_ref >= child_sess, (
                f"session_ref {parent.session_ref} < children's {child_sess}: {parent!r}"
            )

    assert num_nodes == tree.num_nodes, f"node counter {tree.num_nodes} != {num_nodes} nodes"
    assert dev_count == tree.cached_pages("device"), (
        f"device counter {tree.cached_pages('device')} != {dev_count}"
    )
    assert host_count == tree.cached_pages("host"), (
        f"host counter {tree.cached_pages('host')} != {host_count}"
    )
    assert locked_dev == tree._device_locked, f"locked device counter {tree._device_locked} != {locked_dev}"
    for end, top in tree._loads.items():
        assert end.loading and end.lock_ref > 0 and not end.removed, f"load in flight on a bad node: {end!r}"
        assert not top.removed, f"load in flight under a removed node: {top!r}"
    deferred = tree._host_deferred
    assert not deferred & host_ids, f"deferred L2 pages still in the tree: {sorted(deferred & host_ids)[:8]}"
    stray = [p for p in tree._host_pins if p not in host_ids and p not in deferred]
    assert not stray, f"pinned L2 pages neither in the tree nor deferred: {stray[:8]}"
    assert all(p in tree._host_pins for p in deferred), "a deferred L2 page is not pinned"
    _check_pool("device", tree.device, dev_ids, device_in_use)
    _check_pool("host", tree.host, host_ids | deferred, host_in_use)
    if tree.ledger is not None:
        tree.ledger.check_integrity(tree.nodes())
