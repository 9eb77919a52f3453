"""Exclusive tiers (``hicache_write_policy: exclusive``): a page lives in one tier unless it is hot.

- L1 -> L2: a node gets an L2 copy when it is evicted from L1 (a demotion, as ``write_back``), never
  on a hit. A load-back to L1 (an L2 hit, or pages an L3 prefetch brought into L2) frees the L2 copy
  once the copy has landed, unless the node is hot (``hit_count >= write_through_threshold``), its L2
  pages are pinned (an L3 write, a waiting request: the copy goes when the last pin does), it was
  backed up on purpose (``backup_prefix`` / ``backup_all``: a PD publish, a shutdown's persist), or its L1
  copy lost window pages whose KV the L2 copy keeps (a hybrid SWA L1: ``TreeNode.window_copy``, while the L1
  copy lives). A
  request that recomputes pages the tree holds on L2 only (its load-back was refused) frees their L2 copy
  the same way when it inserts them; pages an L3 fetch brings for a node that is on L1 are not adopted.
- L2 -> L3 (with a storage controller that cleans, :meth:`ExclusiveTiers.enable_demotion`): nothing
  is written to L3 when it reaches L2. The coldest L2 pages are written as they near L2's eviction
  end (:meth:`ExclusiveTiers.dirty_tail`: the L2 eviction order is walked until the free pages plus
  the pages on L3 cover ``reserve``; the nodes L3 lacks on the way are the ones to write), so L2
  eviction finds them on L3 and dropping them there is the demotion. A victim whose write is in
  flight (pinned) waits in L2, as every pinned page does; one no write was asked for (more L2 demand
  in one step than the reserve covers) is dropped, counted in ``demotions_dropped_pages``.
- L3 -> L2 -> L1 (:meth:`ExclusiveTiers.enable_promotion`: a *private* L3, one no other server reads:
  ``StorageBackend.shared`` is False): an L3 hit promotes the page. The nodes an L3 fetch adds to the
  tree (their bytes landed in L2 and verified) are not marked stored, and their page ranges go to
  :meth:`ExclusiveTiers.take_promoted` for the controller to delete from L3 -- unless the node is hot
  (this hit is at least its ``write_through_threshold``-th: a node new to the tree has had none, so
  only a threshold of 1 keeps every L3 copy), pinned, or backed up on purpose. Such a page is written
  to L3 again like any other cold L2 page (:meth:`dirty_tail`) when it nears L2's eviction end: a
  page promoted and evicted again is demoted back. A shared L3 (Mooncake, an LMDB directory several
  servers use) keeps every L3 copy: other servers need the page.

What is only on L1 or L2 is lost at a crash; a graceful shutdown persists L1 and L2 to L3 first
(``backup_all``, then the controller's ``persist_all``). On a shared L3 (Mooncake) other servers see
a page once it has left this server's L2, not while it is hot here: ``write_through`` publishes at
once.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable

from hicache.hiradix.node import TreeNode
from hicache.hiradix.pins import HostPins
from hicache.hiradix.policies import WritePolicy
from hicache.hiradix.residency import Residency
from hicache.hiradix.shape import TreeShape
from hicache.tiers.allocator import PageAllocator

CLEAN_RESERVE_SHARE = 0.125  # of L2's pages: free or on L3 at its eviction end (see dirty_tail)


class ExclusiveTiers:
    """The exclusive mode's rules for one tree (inert under the inclusive write policies).

    Concurrency contract: not thread-safe; the thread that owns the tree makes every call.
    """

    def __init__(self, shape: TreeShape, residency: Residency, pins: HostPins, host: PageAllocator | None,
                 policy: WritePolicy, evict_key: Callable[[], Callable[[TreeNode], tuple]]) -> None:
        self.shape = shape
        self.residency = residency
        self.pins = pins
        self.host = host
        self.policy = policy
        self.on = policy.exclusive and host is not None
        self._evict_key = evict_key
        self.demote_to_l3 = False  # a storage controller writes dirty_tail's nodes to L3
        self.kept: set[TreeNode] = set()  # nodes backed up on purpose (backup_prefix / backup_all)
        # cold nodes on L1 and L2 whose L2 copy drop_duplicates spared only because a reader pinned it: dropped
        # once the last pin goes (unpinned)
        self._pinned_duplicates: set[TreeNode] = set()
        self.demotions_dropped_pages = 0
        self.promote_from_l3 = False  # an L3 hit deletes the L3 copy (a private L3: enable_promotion)
        self._promoted: list[tuple[int, int]] = []  # path page ranges whose L3 copy goes (take_promoted)
        self.l3_promoted_pages = 0  # pages an L3 hit brought up whose L3 copy the tree gave up
        self.l3_kept_pages = 0  # pages an L3 hit brought up that keep their L3 copy (hot or pinned)

    def enable_demotion(self) -> None:
        """An L3 is there and its controller writes :meth:`dirty_tail`'s nodes (nothing else is
        written to L3 in this mode)."""
        self.demote_to_l3 = self.on

    def enable_promotion(self, on: bool = True) -> None:
        """The L3 is private: an L3 hit deletes the L3 copy of what it brought up (see the module
        docstring); ``on=False`` stops that (a shutdown persists L2 to L3 first)."""
        self.promote_from_l3 = on and self.on

    def promotes(self, node: TreeNode, first_page: int) -> bool:
        """``node`` (path pages ``first_page`` on) just got its pages from L3: whether its L3 copy
        goes (recorded for :meth:`take_promoted`); False keeps it (hot, pinned, kept, or no promotion)."""
        if not self.promote_from_l3:
            return False
        n = len(node.key) // self.shape.page_size
        if node.hit_count + 1 >= self.policy.threshold or node in self.kept or \
                self.pins.any_pinned(node.host_pages or ()):  # (this L3 hit counts as one)
            self.l3_kept_pages += n
            return False
        self._promoted.append((first_page, first_page + n))
        self.l3_promoted_pages += n
        return True

    def take_promoted(self) -> list[tuple[int, int]]:
        """The path page ranges ``[lo, hi)`` (of the tokens given to the latest ``insert_host``
        calls) whose L3 copy the tree no longer counts on: the caller deletes them from L3."""
        out, self._promoted = self._promoted, []
        return out

    def on_l3(self, node: TreeNode) -> bool:
        return node.storage_pages * self.shape.page_size >= len(node.key)

    def duplicate_ok(self, node: TreeNode) -> bool:
        """Whether ``node`` may keep an L2 copy beside its L1 one."""
        return (self.policy.hot(node) or node.load is not None or node in self.kept or node.window_copy
                or self.pins.any_pinned(node.host_pages))

    def keep_window_copy(self, node: TreeNode) -> None:
        """``node``'s L1 copy loses its window pages while its L2 copy keeps their KV (a hybrid SWA L1's
        demotion, or its window pages dropped beside an L2 copy): both copies stay while the L1 one lives."""
        if node.device_pages is not None and node.host_pages is not None:
            node.window_copy = True

    def drop_duplicates(self, nodes: Iterable[TreeNode]) -> None:
        """Free the L2 copies of ``nodes`` that are on L1 too, unless :meth:`duplicate_ok`."""
        if not self.on:
            return
        for nd in nodes:
            if nd.removed or nd.device_pages is None or nd.host_pages is None:
                continue
            if not self.duplicate_ok(nd):
                self.residency.drop_host(nd)
            elif not (self.policy.hot(nd) or nd.load is not None or nd in self.kept):
                self._pinned_duplicates.add(nd)  # only its pins keep it

    def unpinned(self) -> None:
        """L2 pages were unpinned: the duplicates only their pins kept go now (:meth:`drop_duplicates`)."""
        if not self._pinned_duplicates:
            return
        free = [nd for nd in self._pinned_duplicates if nd.removed or nd.host_pages is None
                or not self.pins.any_pinned(nd.host_pages)]
        self._pinned_duplicates.difference_update(free)
        root, up = self.shape.root, []
        for nd in free:  # the upper parts of a node split since it was spared are its ancestors
            p = nd.parent
            while p is not root and p is not None and not p.removed and p.device_pages is not None \
                    and p.host_pages is not None and not self.duplicate_ok(p):
                up.append(p)
                p = p.parent
        self.drop_duplicates(free + up)

    def adopts(self, node: TreeNode) -> bool:
        """Whether an L1 node takes L2 pages an L3 fetch brought (never in the exclusive mode)."""
        return not self.on

    def dropping(self, node: TreeNode) -> None:
        """L2 eviction drops ``node``: count what L3 lacks of it (a demotion nobody wrote)."""
        if self.demote_to_l3 and not self.on_l3(node):
            self.demotions_dropped_pages += len(node.key) // self.shape.page_size - node.storage_pages

    def reserve_pages(self) -> int:
        return 0 if self.host is None else max(1, int(self.host.num_pages * CLEAN_RESERVE_SHARE))

    def dirty_tail(self, reserve: int | None = None) -> list[TreeNode]:
        """The L2-only nodes to write to L3 now: L2's eviction order is walked (leaves first, a parent
        once its children are counted) until the free L2 pages plus the pages met that are on L3 or
        being written cover ``reserve`` (default :data:`CLEAN_RESERVE_SHARE` of L2); the nodes met
        that L3 lacks and no write holds are returned, coldest first. Empty unless demotion is on."""
        host = self.host
        reserve = self.reserve_pages() if reserve is None else reserve
        if not self.demote_to_l3 or host.num_free >= reserve:
            return []
        key = self._evict_key()
        heap = [(key(nd), nd.id, nd) for nd in self.residency.host_leaves(include_pinned=True)]
        heapq.heapify(heap)
        root, pins = self.shape.root, self.pins
        have, out, counted = host.num_free, [], set()
        while have < reserve and heap:
            nd = heapq.heappop(heap)[2]
            counted.add(nd)
            have += len(nd.host_pages)
            if not self.on_l3(nd) and not pins.any_pinned(nd.host_pages):
                out.append(nd)
            p = nd.parent
            if (p is not root and p.device_pages is None and p.host_pages is not None and p.lock_ref == 0
                    and all(c in counted for c in p.children.values())):
                heapq.heappush(heap, (key(p), p.id, p))
        return out

    def check_integrity(self) -> None:
        """Raise AssertionError unless every node on both L1 and L2 may be (:meth:`duplicate_ok`)."""
        self.kept = {nd for nd in self.kept if not nd.removed and nd.host_pages is not None}
        if not self.on:
            return
        for nd in self.shape.nodes():
            if nd.device_pages is not None and nd.host_pages is not None:
                assert self.duplicate_ok(nd), f"exclusive tiers: a cold node on L1 and L2: {nd!r}"
