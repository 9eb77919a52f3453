"""Residency: which tier holds each node's pages, the per-tier counters and the eviction candidates.

Every change of a node's L1 or L2 copy goes through :class:`Residency`, which keeps, in step
with the nodes: the pages cached per tier, the L1 pages of locked nodes, and two lazy supersets
of eviction candidates (L1 leaves: nodes on L1 without a child on L1; L2 leaves: L2-only nodes
without children), pruned when read (:meth:`Residency.device_leaves`,
:meth:`Residency.host_leaves`). It frees the pages a node loses into the pools (pinned L2 pages
through :class:`~hicache.hiradix.pins.HostPins`), emits the cache events, and takes a node that
loses its last copy out of the tree (:meth:`Residency.remove`). It never allocates pages: the
callers (the tree, :class:`~hicache.hiradix.tiering.Tiering`) do. With state snapshots (a model
with state layers), each change cascades to the node's snapshot through the ``on_*`` hooks of
:class:`~hicache.hiradix.state_snapshots.StateSnapshots` (which may allocate state slots).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from hicache.hiradix.events import TreeEvents
from hicache.hiradix.node import TreeNode
from hicache.hiradix.pins import HostPins
from hicache.hiradix.shape import TreeShape
from hicache.hiradix.unbounded import UnboundedAllocator
from hicache.tiers.allocator import PageAllocator

if TYPE_CHECKING:
    from hicache.hiradix.state_snapshots import StateSnapshots


def has_device_child(node: TreeNode) -> bool:
    return any(c.device_pages is not None for c in node.children.values())


class Residency:
    """Tier copies of the nodes of one tree.

    Concurrency contract: not thread-safe; the thread that owns the tree makes every call.
    """

    def __init__(self, shape: TreeShape, device: PageAllocator | UnboundedAllocator,
                 host: PageAllocator | None, pins: HostPins, events: TreeEvents,
                 state: StateSnapshots | None = None) -> None:
        self.shape = shape
        self.state = state
        self.device = device
        self.host = host
        self.pins = pins
        self.events = events
        self._dev_leaves: set[TreeNode] = set()
        self._host_leaves: set[TreeNode] = set()
        self._device_cached = 0
        self._host_cached = 0
        self._device_locked = 0

    # ------------------------------------------------------------------ locks
    def lock(self, node: TreeNode) -> None:
        """``lock_ref += 1`` on the path root→node (no-op for the root)."""
        if node.removed:
            raise ValueError(f"cannot lock a removed node: {node!r}")
        while node.parent is not None:
            if node.lock_ref == 0 and node.device_pages is not None:
                self._device_locked += len(node.device_pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """``lock_ref -= 1`` on the path root→node; raises if the node is not locked."""
        if node.parent is None and not node.removed:
            return
        if node.lock_ref <= 0:
            raise RuntimeError(f"unlock of a node that is not locked: {node!r}")
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0 and node.device_pages is not None:
                self._device_locked -= len(node.device_pages)
            node = node.parent

    @staticmethod
    def hold(node: TreeNode, delta: int) -> None:
        """``wait_ref += delta`` on the path root→node (a removed node keeps its ``parent``: its hold is still
        released on the ancestors in the tree)."""
        if delta > 0 and node.removed:
            raise ValueError(f"cannot hold a removed node: {node!r}")
        while node.parent is not None:
            node.wait_ref += delta
            node = node.parent

    # ------------------------------------------------------------------ L1 copies
    def set_device(self, node: TreeNode, pages: list[int]) -> None:
        """``node`` (without an L1 copy) now holds ``pages`` on L1."""
        node.device_pages = pages
        self._device_cached += len(pages)
        if node.lock_ref:
            self._device_locked += len(pages)
        self._dev_leaves.add(node)
        self.events.emit("device_add", node)

    def drop_device(self, node: TreeNode) -> None:
        """Free ``node``'s L1 copy (an unlocked L1 leaf) into the device pool."""
        pages, node.device_pages = node.device_pages, None
        node.window_copy = False  # a reload brings the window KV along: its L2 copy is an ordinary one again
        self._device_cached -= len(pages)
        self.device.free(pages)
        if self.state is not None:
            self.state.on_drop_device(node)  # demoted when the node keeps its L2 copy
        self.events.emit("device_evict", node)
        self._dev_leaves.discard(node)
        if node.parent is not self.shape.root:
            self._dev_leaves.add(node.parent)
        if node.host_pages is not None and not node.children:
            self._host_leaves.add(node)

    # ------------------------------------------------------------------ L2 copies
    def set_host(self, node: TreeNode, pages: list[int]) -> None:
        """``node`` (without an L2 copy) now holds ``pages`` on L2."""
        node.host_pages = pages
        self._host_cached += len(pages)
        if node.device_pages is None and not node.children:
            self._host_leaves.add(node)
        if self.state is not None:
            self.state.on_set_host(node)  # its L1 snapshot is backed up too
        self.events.emit("host_add", node)

    def drop_host(self, node: TreeNode) -> int:
        """Free the L2 copy of ``node``, which stays on L1 (unpinned); returns the pages freed."""
        self.events.emit("host_evict", node)
        pages, node.host_pages = node.host_pages, None
        self._host_cached -= len(pages)
        self.host.free(pages)
        if self.state is not None:
            self.state.on_drop_host(node)
        return len(pages)

    # ------------------------------------------------------------------ leaving the tree
    def remove(self, node: TreeNode) -> None:
        """Detach ``node`` and its subtree (no L1 copies left, unlocked); free their L2 pages
        (pinned ones once they are unpinned)."""
        shape, parent = self.shape, node.parent
        shape.detach(node)
        stack = [node]
        while stack:
            nd = stack.pop()
            assert nd.lock_ref == 0 and nd.device_pages is None, f"removing {nd!r}"
            stack.extend(nd.children.values())
            self.events.emit("remove", nd)
            if nd.host_pages is not None:
                self._host_cached -= len(nd.host_pages)
                self.pins.release(nd.host_pages)
                nd.host_pages = None
            if self.state is not None:
                self.state.on_remove(nd)
            shape.retire(nd)
            self._dev_leaves.discard(nd)
            self._host_leaves.discard(nd)
        if parent is not shape.root:
            self._dev_leaves.add(parent)
            self._host_leaves.add(parent)

    def clear(self) -> None:
        """Drop every node and its pages (a flush; nothing may be locked)."""
        for child in list(self.shape.root.children.values()):
            if child.device_pages is not None:
                self._drop_subtree_device(child)
            self.remove(child)
        self._dev_leaves.clear()
        self._host_leaves.clear()

    def clear_except(self, keep: Collection[int]) -> None:
        """A flush that keeps the nodes holding an L2 page of ``keep`` (pinned leases' pages)
        and their ancestors, on L2 only (a kept node without an L2 copy keeps its L1 copy, and
        so do its ancestors: L1 stays prefix-closed); every other node leaves the tree. Each
        change goes through :meth:`drop_device` / :meth:`remove` (nothing may be locked)."""
        root = self.shape.root
        kept: set[TreeNode] = set()
        for nd in self.shape.nodes():
            if nd.host_pages is not None and any(p in keep for p in nd.host_pages):
                while nd is not root and nd not in kept:
                    kept.add(nd)
                    nd = nd.parent
        on_l1: set[TreeNode] = set()
        for nd in [k for k in kept if k.host_pages is None]:
            while nd is not root and nd not in on_l1:
                on_l1.add(nd)
                nd = nd.parent
        for nd in self.shape.nodes():  # parents before children
            if nd.removed:
                continue  # it went with its parent
            if nd in kept:
                if nd.device_pages is not None and nd not in on_l1:
                    self.drop_device(nd)
                continue
            stack = [nd]
            while stack:
                sub = stack.pop()
                stack.extend(sub.children.values())
                if sub.device_pages is not None:
                    self.drop_device(sub)
            self.remove(nd)

    def _drop_subtree_device(self, node: TreeNode) -> None:
        stack = [node]
        while stack:
            nd = stack.pop()
            stack.extend(nd.children.values())
            if nd.device_pages is not None:
                self._device_cached -= len(nd.device_pages)
                self.device.free(nd.device_pages)
                nd.device_pages = None
                if self.state is not None:
                    self.state.on_remove(nd)  # a flush: every slot goes, nothing is demoted

    # ------------------------------------------------------------------ candidates, counts
    def device_leaves(self) -> list[TreeNode]:
        """Unlocked L1 leaves now (eviction candidates; prunes stale entries of the lazy set)."""
        out, leaves = [], self._dev_leaves
        for nd in list(leaves):
            if nd.removed or nd.device_pages is None or has_device_child(nd):
                leaves.discard(nd)
            elif nd.lock_ref == 0:
                out.append(nd)
        return out

    def host_leaves(self, include_pinned: bool = False) -> list[TreeNode]:
        """Unlocked, unpinned (or also pinned) L2-only leaves now (eviction candidates; prunes the lazy set)."""
        out, leaves, pins = [], self._host_leaves, self.pins
        for nd in list(leaves):
            if nd.removed or nd.host_pages is None or nd.device_pages is not None or nd.children:
                leaves.discard(nd)
            elif nd.lock_ref == 0 and (include_pinned or not pins.any_pinned(nd.host_pages)):
                out.append(nd)
        return out

    def cached_pages(self, tier: str) -> int:
        """Pages held by the tree on ``tier`` ("device" or "host")."""
        return {"device": self._device_cached, "host": self._host_cached}[tier]

    def evictable_pages(self, tier: str) -> int:
        """Pages on ``tier`` that eviction could free now (host: L2-only unlocked nodes; O(tree))."""
        if tier == "device":
            return self._device_cached - self._device_locked
        if tier != "host":
            raise KeyError(tier)
        return sum(len(n.host_pages) for n in self.shape.nodes() if n.lock_ref == 0 and n.device_pages is None)

    def check_integrity(self) -> None:
        """Raise AssertionError unless the counters and the candidate sets agree with the nodes."""
        dev = host = locked = 0
        for nd in self.shape.nodes():
            if nd.device_pages is not None:
                dev += len(nd.device_pages)
                if nd.lock_ref:
                    locked += len(nd.device_pages)
                if not has_device_child(nd):
                    assert nd in self._dev_leaves, f"L1 leaf missing from the candidate set: {nd!r}"
            if nd.host_pages is not None:
                host += len(nd.host_pages)
                if nd.device_pages is None and not nd.children:
                    assert nd in self._host_leaves, f"L2 leaf missing from the candidate set: {nd!r}"
        assert dev == self._device_cached, f"device counter {self._device_cached} != {dev}"
        assert host == self._host_cached, f"host counter {self._host_cached} != {host}"
        assert locked == self._device_locked, f"locked device counter {self._device_locked} != {locked}"
