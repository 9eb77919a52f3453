"""Full consistency check of a HiRadixTree and its pools (O(tree); for tests and debugging).

Checks, raising AssertionError with a message naming the culprit:
- per tier: pages allocated from the pool == pages cached in the tree + pages the caller
  holds outside it (``*_in_use``); every cached page is allocated; no page id twice;
- every node: key length a positive multiple of page_size, equal to pages * page_size on
  each tier it is on; at least one copy; L1 prefix-closed (parent on L1 or the root);
  children keyed by their first page and pointing back to the parent; not removed;
- refs: lock_ref, session_ref and wait_ref >= 0 and a parent's >= the sum of its children's;
  session refs equal what the open sessions imply; loading nodes are locked and on both tiers;
- then each part checks its own state against the nodes: the counters and lazy eviction-candidate
  sets (:meth:`Residency.check_integrity`), the loads in flight (:meth:`Tiering.check_integrity`),
  pinned L2 pages in the tree or deferred, deferred ones pinned and counted as used
  (:meth:`HostPins.check_integrity`), and the tenant ledger's counts.
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


def check_states(tree: HiRadixTree, device_in_use: int = 0, host_in_use: int = 0) -> None:
    """The state snapshots' half of the tree's check (``*_in_use``: working slots callers hold)."""
    if tree.state is not None:
        tree.state.check_integrity(device_in_use, host_in_use)
        return
    assert device_in_use == host_in_use == 0, "state slots in use but no state pools"
    assert all(nd.snap is None for nd in tree.nodes()), "a snapshot in a tree without state pools"


def check_tree(tree: HiRadixTree, device_in_use: int = 0, host_in_use: int = 0) -> None:
    ps = tree.page_size
    root = tree.root
    assert root.parent is None and not root.key and root.lock_ref == 0, "root corrupted"
    dev_ids: set[int] = set()
    host_ids: set[int] = set()
    num_nodes = 0
    expected_sess: dict[int, int] = {}
    for node in tree.sessions.attachments():
        for nd in node.path_to_root():
            expected_sess[nd.id] = expected_sess.get(nd.id, 0) + 1

    stack = [root]
    while stack:
        parent = stack.pop()
        child_locks = child_sess = child_waits = 0
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
                assert parent is root or parent.device_pages is not None, (
                    f"L1 node under a non-L1 parent: {where}"
                )
            assert 0 <= nd.storage_pages <= klen // ps, f"storage_pages {nd.storage_pages} out of range: {where}"
            assert nd.lock_ref >= 0, f"negative lock_ref: {where}"
            assert nd.session_ref >= 0, f"negative session_ref: {where}"
            assert nd.wait_ref >= 0, f"negative wait_ref: {where}"
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
            child_waits += nd.wait_ref
        if parent is not root:
            assert parent.lock_ref >= child_locks, (
                f"lock_ref {parent.lock_ref} < children's {child_locks}: {parent!r}"
            )
            assert parent.session_ref >= child_sess, (
                f"session_ref {parent.session_ref} < children's {child_sess}: {parent!r}"
            )
            assert parent.wait_ref >= child_waits, f"wait_ref {parent.wait_ref} < children's {child_waits}: {parent!r}"

    assert num_nodes == tree.num_nodes, f"node counter {tree.num_nodes} != {num_nodes} nodes"
    tree.residency.check_integrity()
    tree.tiering.check_integrity()
    deferred = tree.pins.check_integrity(host_ids)
    _check_pool("device", tree.device, dev_ids, device_in_use)
    _check_pool("host", tree.host, host_ids | deferred, host_in_use)
    if tree.ledger is not None:
        tree.ledger.check_integrity(tree.nodes())
