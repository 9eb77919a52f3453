"""TreeNode: one run of full pages in the HiRadixTree and where its KV lives.

Contract:
- ``key`` is a list of token ids whose length is a positive multiple of the tree's
  page size (the root's key is empty).
- ``device_pages`` (L1) and ``host_pages`` (L2) are either ``None`` (no copy on that
  tier) or a list with exactly one page id per page of ``key``, in order.
- ``storage_pages``: how many leading pages of this node are known to be on L3 (written
  there by a write-back, or read from there by a prefetch). A hint, not a guarantee: L3
  evicts on its own, so a reader still checks the store. Split keeps it per page.
- ``children`` maps the first page of each child's key (as a tuple) to the child.
- ``lock_ref`` counts requests reading the node; a lock covers the whole path
  root→node, so a parent's ``lock_ref`` is at least the sum of its children's.
- ``session_ref`` counts soft references from sessions (same path rule).
- ``wait_ref`` counts waiting requests holding the node as their cached prefix (same path rule):
  L2 eviction for an L3 fetch, or for an L1 demotion of pages L3 holds, passes it over.
- ``last_access`` is a tick of the tree's monotonic counter (not wall time).
- ``load`` is the :class:`~hicache.hiradix.match.PendingLoad` of an L2→L1 load-back of
  this node still in flight (``None`` otherwise; ``loading`` says whether there is one).
  A loading node is always locked; its L1 pages hold no KV until the load is done.
- ``removed`` is set when the node leaves the tree; a removed node keeps its
  ``parent`` pointer so that sessions still attached to it can release their refs.
- ``window_copy``: its L1 copy lost window pages (a hybrid SWA L1) whose KV its L2 copy keeps: the exclusive
  tiers keep both copies while the L1 one lives (:class:`~hicache.hiradix.exclusive.ExclusiveTiers`). A split
  keeps it on both parts.
- ``snap``: the :class:`Snapshot` of the recurrent state after the node's last token (a tree
  of a model with state layers; ``None`` when it has none). Its tiers follow the node's KV:
  an L1 slot only while the node is on L1, an L2 slot only while it is on L2
  (:class:`~hicache.hiradix.state_snapshots.StateSnapshots` owns every change). A split keeps
  it on the lower part (the one that still ends where the node ended).
"""

from __future__ import annotations


class Snapshot:
    """Where one node's recurrent-state snapshot lives: an L1 slot, an L2 slot, stored on L3 (a
    hint, like ``storage_pages``), and the :class:`~hicache.hiradix.match.PendingLoad` of an
    L2 -> L1 load of it still in flight. Plain mutable record; only StateSnapshots mutates it."""

    __slots__ = ("device_slot", "host_slot", "stored", "load")

    def __init__(self, device_slot: int | None = None, host_slot: int | None = None, stored: bool = False) -> None:
        self.device_slot = device_slot
        self.host_slot = host_slot
        self.stored = stored
        self.load = None  # PendingLoad | None

    @property
    def empty(self) -> bool:
        """On no tier at all (the record then goes)."""
        return self.device_slot is None and self.host_slot is None and not self.stored

    def __repr__(self) -> str:
        return (f"Snapshot(L1={self.device_slot}, L2={self.host_slot}, L3={self.stored}"
                f"{', loading' if self.load is not None else ''})")


class TreeNode:
    """A radix-tree node. Plain mutable record; only the tree mutates it."""

    __slots__ = (
        "id",
        "key",
        "device_pages",
        "host_pages",
        "storage_pages",
        "children",
        "parent",
        "lock_ref",
        "session_ref",
        "wait_ref",
        "hit_count",
        "last_access",
        "load",
        "removed",
        "window_copy",
        "snap",
    )

    def __init__(
        self,
        node_id: int,
        key: list[int],
        parent: TreeNode | None = None,
        device_pages: list[int] | None = None,
        host_pages: list[int] | None = None,
    ) -> None:
        self.id = node_id
        self.key = key
        self.device_pages = device_pages
        self.host_pages = host_pages
        self.storage_pages = 0
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.session_ref = 0
        self.wait_ref = 0
        self.hit_count = 0
        self.last_access = 0
        self.load = None  # PendingLoad | None
        self.removed = False
        self.window_copy = False
        self.snap: Snapshot | None = None

    @property
    def num_pages(self) -> int:
        """Pages in this node (0 for the root)."""
        pages = self.device_pages if self.device_pages is not None else self.host_pages
        if pages is not None:
            return len(pages)
        return 0 if not self.key else -1  # -1: a node without any copy (never in a healthy tree)

    @property
    def loading(self) -> bool:
        return self.load is not None

    @property
    def on_device(self) -> bool:
        return self.device_pages is not None

    def path_to_root(self) -> list[TreeNode]:
        """Nodes from this one up to (excluding) the root, deepest first."""
        out = []
        node: TreeNode | None = self
        while node is not None and node.parent is not None:
            out.append(node)
            node = node.parent
        return out

    def __repr__(self) -> str:
        tiers = (
            ("L1" if self.device_pages is not None else "")
            + ("L2" if self.host_pages is not None else "")
            + (f"L3:{self.storage_pages}" if self.storage_pages else "")
        )
        snap = "" if self.snap is None else f", {self.snap!r}"
        return (
            f"TreeNode(id={self.id}, tokens={len(self.key)}, tiers={tiers or '-'}, lock={self.lock_ref}, "
            f"sess={self.session_ref}, hits={self.hit_count}, t={self.last_access}"
            f"{', loading' if self.loading else ''}{', removed' if self.removed else ''}{snap})"
        )
