"""Outbox: the tier moves a tree queued (:class:`~hicache.hiradix.match.Transfer` orders), drained by the
tree's owner after every operation and executed in order (see tree.py for the ordering contract).

A backup is queued before its L2 pages are written: until the outbox is drained, the operation that queued it
must not drop that L2 copy (:meth:`Outbox.writing`: L2 eviction skips those nodes). A copy that leaves the
tree anyway (its node removed with an L1 parent dropped for want of L2 room) is left out when the outbox is
drained, where its L2 pages are free again (:meth:`Outbox.take`); where a later backup of the same operation
took them, the order has that one overwrite them.
"""

from __future__ import annotations

from hicache.hiradix.match import Transfer
from hicache.hiradix.node import TreeNode
from hicache.tiers.allocator import PageAllocator


class Outbox:
    """The queued moves of one tree (see the module docstring).

    Concurrency contract: not thread-safe; the thread that owns the tree queues and drains.
    """

    def __init__(self, host: PageAllocator | None) -> None:
        self._host = host
        self._queue: list[Transfer] = []
        self._writing: set[TreeNode] = set()  # nodes whose backup is queued, not drained yet

    def emit(self, transfer: Transfer) -> None:
        """Queue ``transfer`` (loads, the state snapshots' moves)."""
        self._queue.append(transfer)

    def backup(self, src: list[int], dst: list[int], nodes: tuple[TreeNode, ...]) -> None:
        """Queue the backup of L1 pages ``src`` into L2 pages ``dst``, the copies of ``nodes`` (in order)."""
        self._queue.append(Transfer("backup", src, dst, nodes))
        self._writing.update(nodes)

    def writing(self, node: TreeNode) -> bool:
        """Whether a queued backup writes ``node``'s L2 copy (its operation must not drop it)."""
        return node in self._writing

    def take(self) -> list[Transfer]:
        """Drain: every queued move in order, less backup pairs whose L2 page is free again."""
        out, self._queue = self._queue, []
        self._writing.clear()
        if self._host is None or not any(t.kind == "backup" for t in out):
            return out
        return [t for t in map(self._still_held, out) if t is not None]

    def discard(self) -> None:
        self._queue.clear()
        self._writing.clear()

    def _still_held(self, t: Transfer) -> Transfer | None:
        """``t``, less a backup's pairs whose L2 page is free now (None: nothing left)."""
        if t.kind != "backup":
            return t
        keep = [i for i, p in enumerate(t.dst_pages) if self._host.is_allocated(p)]
        if len(keep) == len(t.dst_pages):
            return t
        if not keep:
            return None
        nodes = tuple(nd for nd in t.nodes if not nd.removed and nd.host_pages is not None)
        return Transfer("backup", [t.src_pages[i] for i in keep], [t.dst_pages[i] for i in keep], nodes)
