"""Strategy classes for the tree, chosen by name through registries (no if/elif over names).

Write policies (when L1 pages are copied down to L2), with SGLang's meanings:
- ``write_through``: back a node up on its first hit (when it is first reused).
- ``write_through_selective``: back a node up once ``hit_count >= threshold``.
- ``write_back``: back a node up only when it is evicted from L1.
All three demote on eviction (``backup_on_evict``): a node evicted from L1 that has no
L2 copy yet is copied to L2 before its L1 pages are freed, when L2 has room. With an L3 they are
*inclusive*: every page that reaches L2 is written on to L3.
- ``exclusive``: the tiers hold different pages (hicache/hiradix/exclusive.py): L1 eviction demotes to
  L2 (as ``write_back``), a load-back to L1 frees the L2 copy unless the node is hot (``hit_count >=
  threshold``), and with an L3 a page is written to L3 only as it nears L2's eviction end (the
  coldest L2 pages, ahead of their eviction), so L2 eviction demotes to L3.

Eviction policies give a sort key; smaller keys are evicted first. Nodes without
session references go before session-referenced ones, then the policy's order.
"""

from __future__ import annotations

from typing import ClassVar

from hicache.hiradix.node import TreeNode


class WritePolicy:
    """Decides when a node on L1 gets an L2 copy."""

    backup_on_evict: ClassVar[bool] = True
    exclusive: ClassVar[bool] = False  # the tiers hold different pages (see Exclusive)

    def __init__(self, threshold: int = 2) -> None:
        if threshold < 1:
            raise ValueError(f"write_through_threshold must be >= 1, got {threshold}")
        self.threshold = threshold

    def should_backup_on_hit(self, node: TreeNode) -> bool:
        """Called after ``node.hit_count`` was incremented by a match."""
        return False


class WriteThrough(WritePolicy):
    def should_backup_on_hit(self, node: TreeNode) -> bool:
        return node.hit_count >= 1


class WriteThroughSelective(WritePolicy):
    def should_backup_on_hit(self, node: TreeNode) -> bool:
        return node.hit_count >= self.threshold


class WriteBack(WritePolicy):
    """Never backs up on hit; only eviction copies to L2."""


class Exclusive(WritePolicy):
    """Never backs up on hit; a page lives in one tier unless it is hot (hicache/hiradix/exclusive.py)."""

    exclusive = True

    def hot(self, node: TreeNode) -> bool:
        """A node reused often enough to keep its L2 copy beside its L1 one after a load-back."""
        return node.hit_count >= self.threshold


class EvictionPolicy:
    """Sort key for eviction candidates (smaller = evicted first)."""

    def key(self, node: TreeNode) -> tuple[int, ...]:
        raise NotImplementedError


class LRU(EvictionPolicy):
    def key(self, node: TreeNode) -> tuple[int, ...]:
        return (node.session_ref > 0, node.last_access)


class LFU(EvictionPolicy):
    def key(self, node: TreeNode) -> tuple[int, ...]:
        return (node.session_ref > 0, node.hit_count, node.last_access)


WRITE_POLICIES: dict[str, type[WritePolicy]] = {
    "write_through": WriteThrough,
    "write_through_selective": WriteThroughSelective,
    "write_back": WriteBack,
    "exclusive": Exclusive,
}

EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRU, "lfu": LFU}


def make_write_policy(name: str, threshold: int = 2) -> WritePolicy:
    try:
        cls = WRITE_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown write policy {name!r}; choose from {sorted(WRITE_POLICIES)}") from None
    return cls(threshold)


def make_eviction_policy(name: str) -> EvictionPolicy:
    try:
        cls = EVICTION_POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose from {sorted(EVICTION_POLICIES)}"
        ) from None
    return cls()
