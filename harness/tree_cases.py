"""The HiRadixTree's unit-test cases: a small tree over page allocators and a request's life on it
(tests/cache/test_tree.py, tests/cache/test_tree_tiering.py)."""

from __future__ import annotations

from hicache.hiradix import HiRadixTree, MatchResult
from hicache.tiers.allocator import PageAllocator

PS = 2


def make(dev: int = 16, host: int = 0, policy: str = "write_through", **kw) -> HiRadixTree:
    return HiRadixTree(
        PS, PageAllocator(dev), PageAllocator(host) if host else None, write_policy=policy, **kw
    )


def put(tree: HiRadixTree, tokens: list[int]) -> MatchResult:
    """A request's life: match, lock, alloc the rest, insert, free duplicates, unlock."""
    m = tree.match_prefix(tokens)
    tree.lock(m.last_device_node)
    need = len(tokens) // PS - len(m.device_pages)
    if tree.device.num_free < need:
        tree.evict_device(need - tree.device.num_free)
    new = tree.device.alloc(need)
    tree.check_integrity(device_in_use=need)
    dup = tree.insert(tokens, m.device_pages + new)
    assert dup == []
    tree.unlock(m.last_device_node)
    tree.check_integrity()
    return m
