"""Tiering: moving pages between tiers: L1 eviction (demote or drop), L2 eviction, backup, load-back.

Owns the transfer outbox (hicache/hiradix/outbox.py: the ordered :class:`~hicache.hiradix.match.Transfer`
orders a controller executes; see tree.py for the ordering contract), the loads in flight, the write
and eviction policies and the load-back threshold. It decides and allocates; every change of
a node's copies goes through :class:`~hicache.hiradix.residency.Residency`. See tree.py for
the invariants.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from hicache.hiradix.events import TreeEvents
from hicache.hiradix.exclusive import ExclusiveTiers
from hicache.hiradix.match import MatchResult, PendingLoad, Transfer
from hicache.hiradix.node import TreeNode
from hicache.hiradix.outbox import Outbox
from hicache.hiradix.pins import HostPins
from hicache.hiradix.policies import EvictionPolicy, WritePolicy
from hicache.hiradix.residency import Residency, has_device_child
from hicache.hiradix.shape import TreeShape
from hicache.hiradix.unbounded import UnboundedAllocator
from hicache.tiers.allocator import PageAllocator


class StaleMatch(ValueError):
    """load_back got a MatchResult that no longer describes the tree."""


class Tiering:
    """Tier moves of one tree.

    Concurrency contract: not thread-safe; the thread that owns the tree (the scheduler thread)
    makes every call, and drains :meth:`Tiering.take` (``HiRadixTree.take_transfers``) on it.
    """

    def __init__(self, shape: TreeShape, residency: Residency, pins: HostPins, events: TreeEvents,
                 device: PageAllocator | UnboundedAllocator, host: PageAllocator | None,
                 write_policy: WritePolicy, eviction_policy: EvictionPolicy, load_back_threshold: int) -> None:
        self.shape = shape
        self.residency = residency
        self.pins = pins
        self.events = events
        self.device = device
        self.host = host
        self.write_policy = write_policy
        self.eviction_policy = eviction_policy
        self.load_back_threshold = load_back_threshold
        self.outbox = Outbox(host)
        self._loads: dict[TreeNode, TreeNode] = {}  # end of a loading chain -> node above the chain
        # L1 pages that got no L2 copy because L2 had no room (every evictable page was locked or
        # pinned, e.g. waiting for its L3 write-back): skipped backups and demotions that dropped
        self.backups_skipped_pages = 0
        self.exclusive = ExclusiveTiers(shape, residency, pins, host, write_policy, lambda: self._evict_key("host"))

    def take(self) -> list[Transfer]:
        """Drain the outbox (see the ordering contract in tree.py and hicache/hiradix/outbox.py)."""
        return self.outbox.take()

    def emit(self, transfer: Transfer) -> None:
        """Queue ``transfer`` in the outbox (the state snapshots' moves come in here too)."""
        self.outbox.emit(transfer)

    def discard_transfers(self) -> None:
        self.outbox.discard()

    @property
    def loading(self) -> bool:
        """Whether a load is in flight."""
        return bool(self._loads)

    def has_load(self, node: TreeNode) -> bool:
        """Whether a load in flight ends at ``node``."""
        return node in self._loads

    def _evict_key(self, tier: str) -> Callable[[TreeNode], tuple]:
        return self.events.evict_key(tier, self.eviction_policy.key)

    # ------------------------------------------------------------------ eviction
    def evict_device(self, num_pages: int) -> int:
        """Free at least ``num_pages`` L1 pages if possible; return how many were freed.

        Candidates: unlocked L1 nodes without an L1 child, in eviction-policy order.
        With an L2 the node is demoted (backed up first if it has no L2 copy and L2
        has room), otherwise dropped. Demote before drop: a candidate that would be
        lost (no L2 copy, no L2 room for one, not on L3) is passed over while others
        can be freed without loss; only then are the passed-over ones dropped (counted
        in ``backups_skipped_pages``).
        """
        if num_pages <= 0:
            return 0
        key = self._evict_key("device")
        heap = [(key(nd), nd.id, nd) for nd in self.residency.device_leaves()]
        heapq.heapify(heap)
        freed = 0
        for allow_drop in (False, True):
            passed: list[TreeNode] = []
            freed += self._evict_device_nodes(heap, num_pages - freed, key, allow_drop, passed)
            if freed >= num_pages or not passed:
                break
            heap = [(key(nd), nd.id, nd) for nd in passed] + heap
            heapq.heapify(heap)
        return freed

    def _evict_device_nodes(self, heap: list, num_pages: int, key: Callable[[TreeNode], tuple],
                            allow_drop: bool, passed: list[TreeNode]) -> int:
        """One pass of :meth:`evict_device` over ``heap``; the nodes it would have dropped go to
        ``passed`` instead unless ``allow_drop``."""
        root = self.shape.root
        freed = 0
        while freed < num_pages and heap:
            nd = heapq.heappop(heap)[2]
            if nd.removed or nd.device_pages is None or nd.lock_ref:
                continue
            n, parent = len(nd.device_pages), nd.parent
            if not self._evict_device_node(nd, allow_drop):
                passed.append(nd)
                continue
            freed += n
            if (
                parent is not root
                and parent.device_pages is not None
                and parent.lock_ref == 0
                and not has_device_child(parent)
            ):
                heapq.heappush(heap, (key(parent), parent.id, parent))
        return freed

    def evict_host(self, num_pages: int, drop_backups: bool = False, spare_held: bool = False) -> int:
        """Drop L2 copies of unlocked L2-only leaves (policy order) until ``num_pages`` are freed;
        with ``drop_backups`` then also L2 backups of nodes that are on L1 too (an L3 prefetch
        makes room so). Pages an L3 write-back is reading (pinned) are skipped, so are nodes whose backup this
        operation queued (not drained yet: dropping the copy would leave it writing freed pages), and with
        ``spare_held`` the prefixes waiting requests hold (``wait_ref``)."""
        if self.host is None or num_pages <= 0:
            return 0
        key = self._evict_key("host")
        heap = [(key(nd), nd.id, nd) for nd in self.residency.host_leaves()]
        heapq.heapify(heap)
        root, pins = self.shape.root, self.pins
        freed = 0
        while freed < num_pages and heap:
            nd = heapq.heappop(heap)[2]
            if (nd.removed or nd.lock_ref or nd.children or nd.device_pages is not None or self.outbox.writing(nd)
                    or pins.any_pinned(nd.host_pages) or (spare_held and nd.wait_ref)):
                continue
            freed += len(nd.host_pages)
            parent = nd.parent
            self.exclusive.dropping(nd)
            self.residency.remove(nd)
            if (
                parent is not root
                and parent.device_pages is None
                and not parent.children
                and parent.lock_ref == 0
            ):
                heapq.heappush(heap, (key(parent), parent.id, parent))
        if freed < num_pages and drop_backups:
            freed += self._drop_backups(num_pages - freed, spare_held)
        return freed

    def drop_tail_for_l3(self, tokens: list[int], from_page: int) -> int:
        """Remove from the tree the cached pages of ``tokens``' path from page ``from_page`` on (the node
        starting there and the chain below it, their L1 and L2 copies) when every node of it is on L3,
        unlocked, unpinned and not loading, and branches nowhere: a lookup then finds those pages on L3
        alone, so the next fetch reads them again. (A windowed cache whose copies above L3 lost their
        sliding part: L3 may still hold it; serving/cache/l3_windows.py.) Returns the pages dropped (0:
        nothing changed, except a split at ``from_page``)."""
        ps = self.shape.page_size
        if from_page <= 0:
            return 0
        path, pos = self.shape.match_path(tokens[: from_page * ps])  # splits a node that ends past it
        if pos != from_page * ps:
            return 0
        nd = start = path[-1].children.get(tuple(tokens[pos:pos + ps]))
        chain: list[TreeNode] = []
        while nd is not None:
            if (nd.lock_ref or nd.load is not None or len(nd.children) > 1 or not self.on_l3(nd)
                    or (nd.host_pages is not None and self.pins.any_pinned(nd.host_pages))):
                return 0
            chain.append(nd)
            nd = next(iter(nd.children.values()), None)
        if start is None:
            return 0
        for nd in reversed(chain):  # leaves first: each an unlocked L1 leaf when its copy goes
            if nd.device_pages is not None:
                self.residency.drop_device(nd)
            self.exclusive.dropping(nd)
        self.residency.remove(start)
        return sum(len(nd.key) // ps for nd in chain)

    def _drop_backups(self, num_pages: int, spare_held: bool) -> int:
        """Free the L2 copies of nodes that are on L1 too until ``num_pages`` are freed: the L1
        copy stays, and an eviction from L1 backs the node up again. Nodes on L3 go first (an L1
        eviction without L2 room then loses nothing), each group in policy order. Loading and
        pinned nodes keep theirs, and so do locked nodes L3 lacks (a locked node on L3 keeps its
        L1 copy while locked, and L3 has the rest), and so do those whose backup is still queued."""
        pins = self.pins
        cands = [nd for nd in self.shape.nodes() if nd.host_pages is not None and nd.device_pages is not None
                 and (nd.lock_ref == 0 or self.on_l3(nd)) and nd.load is None and not self.outbox.writing(nd)
                 and not pins.any_pinned(nd.host_pages) and not (spare_held and nd.wait_ref)]
        key = self._evict_key("host")
        cands.sort(key=lambda nd: (not self.on_l3(nd), key(nd)))
        freed = 0
        for nd in cands:
            if freed >= num_pages:
                break
            freed += self.residency.drop_host(nd)
        return freed

    # ------------------------------------------------------------------ load-back
    def load_back(self, match: MatchResult, threshold: int | None = None) -> MatchResult:
        """Bring the L2-only part of ``match`` back to L1, all or nothing.

        Returns ``match`` unchanged when there is nothing to load, the chain is shorter
        than ``threshold`` pages (default ``load_back_threshold``), or L1 cannot make room (evicting neither
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
        npages = match.host_hit_tokens // self.shape.page_size
        if npages < (self.load_back_threshold if threshold is None else threshold):
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
        self.residency.lock(end)
        device = self.device
        if device.num_free < npages:
            self.evict_device(npages - device.num_free)
        if device.num_free < npages:
            self.residency.unlock(end)
            return match
        pages = device.alloc(npages)
        pending = PendingLoad()
        src: list[int] = []
        i = 0
        for nd in chain:
            k = len(nd.host_pages)
            src += nd.host_pages
            self.residency.set_device(nd, pages[i : i + k])
            nd.load = pending
            i += k
        self.outbox.emit(Transfer("load", src, list(pages), pending=pending))
        self._loads[end] = top
        prefix = [p for n in reversed(top.path_to_root()) for p in n.device_pages]
        return MatchResult(prefix + pages, (len(prefix) + npages) * self.shape.page_size, 0, end, end,
                           (*match.pending_loads, pending), match.state)

    def finish_load(self, node: TreeNode) -> None:
        """The load ending at ``node`` is done: clear ``node.load`` on the chain and release the
        load's lock."""
        try:
            top = self._loads.pop(node)
        except KeyError:
            raise ValueError(f"no load in flight ends at {node!r}") from None
        nd, chain = node, []
        while nd is not top:
            nd.load = None
            chain.append(nd)
            nd = nd.parent
        self.residency.unlock(node)
        self.exclusive.drop_duplicates(chain)  # the exclusive mode: the L2 source goes unless hot

    def _alloc_host(self, n: int, spare_held: bool = False) -> list[int] | None:
        host = self.host
        if host.num_free < n:
            self.evict_host(n - host.num_free, spare_held=spare_held)
        return host.alloc(n) if host.num_free >= n else None

    def backup_all(self) -> int:
        """Give every L1 node without an L2 copy one, as far as L2 has room (for a graceful
        shutdown that persists the cache); emits backup transfers; returns pages backed up."""
        if self.host is None:
            return 0
        nodes = [n for n in self.shape.nodes() if n.device_pages is not None and n.host_pages is None]
        return self.backup(nodes, protect=self.shape.root, keep=True)

    def backup_prefix(self, tokens: list[int]) -> int:
        """Give the L1 nodes on ``tokens``' path an L2 copy now (and so, with L3, a write-back),
        whatever the write policy says (a PD decode server publishes each finished sequence);
        returns pages backed up."""
        if self.host is None:
            return 0
        path, _ = self.shape.match_path(tokens)
        nodes = [n for n in path if n.device_pages is not None and n.host_pages is None]
        return self.backup(nodes, protect=path[-1] if path else self.shape.root, keep=True)

    def demote(self, nodes: list[TreeNode], protect: TreeNode | None = None) -> int:
        """Give unlocked L1 nodes without an L2 copy one before a part of their L1 KV is dropped (a hybrid SWA
        L1's window pages), L2 room made as for any backup but never on ``protect``'s path; emits backup
        transfers; returns pages backed up. The exclusive mode keeps these copies beside the L1 ones while those
        live (``TreeNode.window_copy``): they hold the window KV the L1 copies lose."""
        nodes = [n for n in nodes if n.device_pages is not None and n.host_pages is None and not n.removed]
        if self.host is None or not nodes:
            return 0
        done = self.backup(nodes, protect=protect if protect is not None else self.shape.root)
        for nd in nodes:
            self.exclusive.keep_window_copy(nd)
        return done

    def backup(self, nodes: list[TreeNode], protect: TreeNode, keep: bool = False) -> int:
        """Give L1 nodes an L2 copy (one backup Transfer); nodes that find no room are skipped; returns
        pages backed up. ``keep``: a copy asked for on purpose, which the exclusive mode keeps beside the
        L1 one."""
        self.residency.lock(protect)  # evict_host must not drop the path being matched
        src: list[int] = []
        dst: list[int] = []
        done: list[TreeNode] = []
        for nd in nodes:
            hp = self._alloc_host(len(nd.device_pages))
            if hp is None:
                if not self.on_l3(nd):
                    self.backups_skipped_pages += len(nd.device_pages)
                continue
            self.residency.set_host(nd, hp)
            src += nd.device_pages
            dst += hp
            done.append(nd)
            if keep and self.exclusive.on:
                self.exclusive.kept.add(nd)
        self.residency.unlock(protect)
        if src:
            self.outbox.backup(src, dst, tuple(done))
        return len(src)

    def on_l3(self, node: TreeNode) -> bool:
        """Whether all of ``node``'s pages are known to be on L3 (``storage_pages``, a hint: L3
        evicts on its own): dropping its L1 / L2 copies then loses nothing a lookup cannot find."""
        return node.storage_pages * self.shape.page_size >= len(node.key)

    def _evict_device_node(self, node: TreeNode, allow_drop: bool = True) -> bool:
        """Demote ``node`` off L1 (or drop it); False, leaving it as it is, when that would lose its KV
        (no L2 copy, no L2 room, not on L3) and ``allow_drop`` is False."""
        if self.host is not None and node.host_pages is None and self.write_policy.backup_on_evict:
            # (pages L3 holds never take L2 from a waiting request's prefix: they come back from L3 too)
            hp = self._alloc_host(len(node.device_pages), spare_held=self.on_l3(node))
            if hp is not None:
                self.residency.set_host(node, hp)
                self.outbox.backup(list(node.device_pages), hp, (node,))
            elif not self.on_l3(node):
                if not allow_drop:
                    return False
                self.backups_skipped_pages += len(node.device_pages)  # lost: recomputed if asked for again
        self.residency.drop_device(node)
        if node.host_pages is None:
            self.residency.remove(node)
        return True

    def check_integrity(self) -> None:
        """Raise AssertionError unless every load in flight ends on a locked, loading node."""
        for end, top in self._loads.items():
            assert end.loading and end.lock_ref > 0 and not end.removed, f"load in flight on a bad node: {end!r}"
            assert not top.removed, f"load in flight under a removed node: {top!r}"
        self.exclusive.check_integrity()
