"""Moving pages between tiers: L1 eviction (demote or drop), L2 eviction, backup, load-back.

A mixin of :class:`hicache.hiradix.tree.HiRadixTree` (split out to keep files small); it
uses the tree's state (allocators, counters, lazy candidate sets, outbox) directly.
See tree.py for the invariants and the transfer ordering contract.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from hicache.hiradix.match import MatchResult, PendingLoad, Transfer
from hicache.hiradix.node import TreeNode
from hicache.hiradix.policies import EvictionPolicy, WritePolicy
from hicache.hiradix.unbounded import UnboundedAllocator
from hicache.tiers.allocator import PageAllocator


class StaleMatch(ValueError):
    """load_back got a MatchResult that no longer describes the tree."""


class TieringMixin:
    """Tier moves of the HiRadixTree; the attributes below are set by ``HiRadixTree.__init__``."""

    page_size: int
    device: PageAllocator | UnboundedAllocator
    host: PageAllocator | None
    root: TreeNode
    write_policy: WritePolicy
    eviction_policy: EvictionPolicy
    load_back_threshold: int
    _outbox: list[Transfer]
    _loads: dict[TreeNode, TreeNode]
    _host_pins: dict[int, int]
    _host_deferred: set[int]
    _dev_leaves: set[TreeNode]
    _host_leaves: set[TreeNode]
    _device_cached: int
    _host_cached: int
    _num_nodes: int
    # Cache-event listeners, ``fn(kind, node)``, called synchronously right after a change:
    # "device_add" (the node got L1 pages), "device_evict" (it lost them), "host_add" (it got
    # an L2 copy), "remove" (it leaves the tree; ``host_pages`` still tells whether it had an
    # L2 copy), "reset" (flush; node = root). Listeners must not raise nor touch the tree.
    _listeners: tuple[Callable[[str, TreeNode], None], ...] = ()
    # per-tenant accounting (hicache.hiradix.quota.TenantLedger): with quotas, eviction takes
    # nodes of tenants over their quota on the tier first
    ledger = None
    # L1 pages that got no L2 copy because L2 had no room (every evictable page was locked or
    # pinned, e.g. waiting for its L3 write-back): skipped backups and demotions that dropped
    backups_skipped_pages = 0

    def add_listener(self, fn: Callable[[str, TreeNode], None]) -> None:
        self._listeners = (*self._listeners, fn)

    def set_ledger(self, ledger) -> None:  # noqa: ANN001 - hicache.hiradix.quota.TenantLedger
        self.ledger = ledger
        self.add_listener(ledger.on_tree_event)

    def _evict_key(self, tier: str) -> Callable[[TreeNode], tuple]:
        base = self.eviction_policy.key
        return base if self.ledger is None else self.ledger.eviction_key(tier, base)

    def _emit(self, kind: str, node: TreeNode) -> None:
        for fn in self._listeners:
            fn(kind, node)

    # ------------------------------------------------------------------ eviction
    def evict_device(self, num_pages: int) -> int:
        """Free at least ``num_pages`` L1 pages if possible; return how many were freed.

        Candidates: unlocked L1 nodes without an L1 child, in eviction-policy order.
        With an L2 the node is demoted (backed up first if it has no L2 copy and L2
        has room), otherwise dropped.
        """
        if num_pages <= 0:
            return 0
        key = self._evict_key("device")
        heap = []
        for nd in list(self._dev_leaves):
            if nd.removed or nd.device_pages is None or self._has_device_child(nd):
                self._dev_leaves.discard(nd)
            elif nd.lock_ref == 0:
                heap.append((key(nd), nd.id, nd))
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            nd = heapq.heappop(heap)[2]
            if nd.removed or nd.device_pages is None or nd.lock_ref:
                continue
            freed += len(nd.device_pages)
            parent = nd.parent
            self._evict_device_node(nd)
            if (
                parent is not self.root
                and parent.device_pages is not None
                and parent.lock_ref == 0
                and not self._has_device_child(parent)
            ):
                heapq.heappush(heap, (key(parent), parent.id, parent))
        return freed

    def evict_host(self, num_pages: int, drop_backups: bool = False) -> int:
        """Drop L2 copies of unlocked L2-only leaves (policy order) until ``num_pages`` are freed;
        with ``drop_backups`` then also L2 backups of nodes that are on L1 too (an L3 prefetch
        makes room so). Pages an L3 write-back is reading (pinned) are skipped."""
        if self.host is None or num_pages <= 0:
            return 0
        key = self._evict_key("host")
        heap = []
        for nd in list(self._host_leaves):
            if nd.removed or nd.host_pages is None or nd.device_pages is not None or nd.children:
                self._host_leaves.discard(nd)
            elif nd.lock_ref == 0 and not self._host_pinned(nd):
                heap.append((key(nd), nd.id, nd))
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            nd = heapq.heappop(heap)[2]
            if nd.removed or nd.lock_ref or nd.children or nd.device_pages is not None or self._host_pinned(nd):
                continue
            freed += len(nd.host_pages)
            parent = nd.parent
            self._remove(nd)
            if (
                parent is not self.root
                and parent.device_pages is None
                and not parent.children
                and parent.lock_ref == 0
            ):
                heapq.heappush(heap, (key(parent), parent.id, parent))
        if freed < num_pages and drop_backups:
            freed += self._drop_backups(num_pages - freed)
        return freed

    def _drop_backups(self, num_pages: int) -> int:
        """Free the L2 copies of nodes that are on L1 too (policy order) until ``num_pages`` are
        freed: the L1 copy stays, and an eviction from L1 backs the node up again. Locked, loading
        and write-pinned nodes keep theirs."""
        cands = [nd for nd in self.nodes() if nd.host_pages is not None and nd.device_pages is not None
                 and nd.lock_ref == 0 and nd.load is None and not self._host_pinned(nd)]
        cands.sort(key=self._evict_key("host"))
        freed = 0
        for nd in cands:
            if freed >= num_pages:
                break
            if self._listeners:
                self._emit("host_evict", nd)
            pages, nd.host_pages = nd.host_pages, None
            self._host_cached -= len(pages)
            self.host.free(pages)
            freed += len(pages)
        return freed

    def _host_pinned(self, node: TreeNode) -> bool:
        pins = self._host_pins
        return bool(pins) and any(p in pins for p in node.host_pages)

    # ------------------------------------------------------------------ load-back
    def load_back(self, match: MatchResult) -> MatchResult:
        """Bring the L2-only part of ``match`` back to L1, all or nothing.

        Returns ``match`` unchanged when there is nothing to load, the chain is shorter
        than ``load_back_threshold`` pages, or L1 cannot make room (evicting neither
        the chain, its prefix, nor anything locked). Otherwise allocates L1 pages for
        the whole chain, emits one ``load`` Transfer carrying a new :class:`PendingLoad`,
        puts that on every node of the chain (``node.load``) and locks the chain, and
        returns a MatchResult whose ``device_pages`` is the whole prefix (old + new), whose
        ``last_device_node`` is the chain's end and whose ``pending_loads`` include the new
        load. Call :meth:`finish_load` with that node once the copy is done.
        Call it right after :meth:`match_prefix`; a stale match raises :class:`StaleMatch`.
        """
        if match.host_hit_tokens <= 0 or self.host is None:
            return match
        npages = match.host_hit_tokens // self.page_size
        if npages < self.load_back_threshold:
            return match
        top, end = match.last_device_node, match.last_host_node
        chain, nd = [], end
        while nd is not top:
            if (
                nd is None
                or nd.parent is None
                or nd.removed
                or nd.device_pages is not None
                or nd.host_pages is None
            ):
                raise StaleMatch("the tree changed since this match")
            chain.append(nd)
            nd = nd.parent
        if top.removed or top.device_pages is None or sum(len(c.host_pages) for c in chain) != npages:
            raise StaleMatch("the tree changed since this match")
        chain.reverse()
        self.lock(end)
        device = self.device
        if device.num_free < npages:
            self.evict_device(npages - device.num_free)
        if device.num_free < npages:
            self.unlock(end)
            return match
        pages = device.alloc(npages)
        pending = PendingLoad()
        src: list[int] = []
        i = 0
        for nd in chain:
            k = len(nd.host_pages)
            src += nd.host_pages
            self._set_device(nd, pages[i : i + k])
            nd.load = pending
            i += k
        self._outbox.append(Transfer("load", src, list(pages), pending=pending))
        self._loads[end] = top
        prefix = [p for n in reversed(top.path_to_root()) for p in n.device_pages]
        return MatchResult(prefix + pages, (len(prefix) + npages) * self.page_size, 0, end, end,
                           (*match.pending_loads, pending))

    def finish_load(self, node: TreeNode) -> None:
        """The load ending at ``node`` is done: clear ``node.load`` on the chain and release the
        load's lock."""
        try:
            top = self._loads.pop(node)
        except KeyError:
            raise ValueError(f"no load in flight ends at {node!r}") from None
        nd = node
        while nd is not top:
            nd.load = None
            nd = nd.parent
        self.unlock(node)

    @staticmethod
    def _has_device_child(node: TreeNode) -> bool:
        return any(c.device_pages is not None for c in node.children.values())

    def _drop_device(self, node: TreeNode) -> None:
        pages, node.device_pages = node.device_pages, None
        self._device_cached -= len(pages)
        self.device.free(pages)
        if self._listeners:
            self._emit("device_evict", node)
        self._dev_leaves.discard(node)
        if node.parent is not self.root:
            self._dev_leaves.add(node.parent)
        if node.host_pages is not None and not node.children:
            self._host_leaves.add(node)

    def _drop_subtree_device(self, node: TreeNode) -> None:
        stack = [node]
        while stack:
            nd = stack.pop()
            stack.extend(nd.children.values())
            if nd.device_pages is not None:
                self._device_cached -= len(nd.device_pages)
                self.device.free(nd.device_pages)
                nd.device_pages = None

    def _alloc_host(self, n: int) -> list[int] | None:
        host = self.host
        if host.num_free < n:
            self.evict_host(n - host.num_free)
        return host.alloc(n) if host.num_free >= n else None

    def backup_all(self) -> int:
        """Give every L1 node without an L2 copy one, as far as L2 has room (for a graceful
        shutdown that persists the cache); emits backup transfers; returns pages backed up."""
        if self.host is None:
            return 0
        nodes = [n for n in self.nodes() if n.device_pages is not None and n.host_pages is None]
        before = self._host_cached
        self._backup(nodes, protect=self.root)
        return self._host_cached - before

    def backup_prefix(self, tokens: list[int]) -> int:
        """Give the L1 nodes on ``tokens``' path an L2 copy now (and so, with L3, a write-back),
        whatever the write policy says (a PD decode server publishes each finished sequence);
        returns pages backed up."""
        if self.host is None:
            return 0
        path, _ = self._walk(tokens)
        nodes = [n for n in path if n.device_pages is not None and n.host_pages is None]
        before = self._host_cached
        self._backup(nodes, protect=path[-1] if path else self.root)
        return self._host_cached - before

    def _backup(self, nodes: list[TreeNode], protect: TreeNode) -> None:
        """Give L1 nodes an L2 copy (one backup Transfer); nodes that find no room are skipped."""
        self.lock(protect)  # evict_host must not drop the path being matched
        src: list[int] = []
        dst: list[int] = []
        done: list[TreeNode] = []
        for nd in nodes:
            hp = self._alloc_host(len(nd.device_pages))
            if hp is None:
                self.backups_skipped_pages += len(nd.device_pages)
                continue
            nd.host_pages = hp
            self._host_cached += len(hp)
            if self._listeners:
                self._emit("host_add", nd)
            src += nd.device_pages
            dst += hp
            done.append(nd)
        self.unlock(protect)
        if src:
            self._outbox.append(Transfer("backup", src, dst, tuple(done)))

    def _evict_device_node(self, node: TreeNode) -> None:
        if self.host is not None and node.host_pages is None and self.write_policy.backup_on_evict:
            hp = self._alloc_host(len(node.device_pages))
            if hp is not None:
                node.host_pages = hp
                self._host_cached += len(hp)
                if self._listeners:
                    self._emit("host_add", node)
                self._outbox.append(Transfer("backup", list(node.device_pages), hp, (node,)))
            else:
                self.backups_skipped_pages += len(node.device_pages)
        self._drop_device(node)
        if node.host_pages is None:
            self._remove(node)

    def _remove(self, node: TreeNode) -> None:
        """Detach ``node`` and its subtree (no L1 copies left, unlocked); free their L2 pages
        (pinned ones once they are unpinned)."""
        parent = node.parent
        del parent.children[tuple(node.key[: self.page_size])]
        stack = [node]
        while stack:
            nd = stack.pop()
            assert nd.lock_ref == 0 and nd.device_pages is None, f"removing {nd!r}"
            stack.extend(nd.children.values())
            if self._listeners:
                self._emit("remove", nd)
            nd.children = {}
            if nd.host_pages is not None:
                self._host_cached -= len(nd.host_pages)
                pins = self._host_pins
                self.host.free([p for p in nd.host_pages if p not in pins])
                self._host_deferred.update(p for p in nd.host_pages if p in pins)
                nd.host_pages = None
            nd.removed = True
            self._num_nodes -= 1
            self._dev_leaves.discard(nd)
            self._host_leaves.discard(nd)
        if parent is not self.root:
            self._dev_leaves.add(parent)
            self._host_leaves.add(parent)
