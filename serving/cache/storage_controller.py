"""L2 <-> L3: the storage tier's controller, as the scheduler sees it.

The tree decides, this controller moves, on background threads; it composes two parts:
- :class:`serving.cache.l3_writeback.WriteBack`: a node that got an L2 copy (a backup) is written
  on to L3 under its page keys (in the exclusive mode only the coldest L2 nodes, ahead of their
  eviction: hicache/hiradix/exclusive.py); its L2 pages are pinned until then (never dropped: over the
  writers' cap it waits), never its L1 pages.
- :class:`serving.cache.l3_prefetch.Prefetcher`: a waiting request whose prompt continues past
  L1/L2 in L3 gets a lookup, then a fetch into host pages, committed into the tree as L2
  copies batch by batch as they land, and loaded on to L1 right away when L1 has free room
  (the prefetch policy says how long the request may wait for it).
- :class:`serving.cache.l3_promote.Promotions` (the exclusive mode with a private L3: the backend's
  ``shared`` is False): an L3 hit's pages, once landed and verified in L2, are deleted from L3 (unless
  hot or pinned: hicache/hiradix/exclusive.py); a per-key guard orders those deletes with the
  write-back's writes of the same keys.

A model with state layers (the tree's ``state``, with an L2 state pool): its snapshots go to L3 with
their nodes (a :class:`~hicache.tiers.storage_state.StateStore` on the same backend), and a lookup
fetches pages only up to the deepest page boundary with a stored snapshot, which comes into an L2
state slot with them (nothing deeper is usable without a state).

Concurrency contract: every method here is called on the scheduler thread and never waits
on the store (except :meth:`persist_all` and :meth:`shutdown`, which are for a shutdown);
each part's docstring says what its threads may touch.
"""

from __future__ import annotations

from collections.abc import Callable

from hicache.hiradix import HiRadixTree
from hicache.hiradix.node import TreeNode
from hicache.tiers.host import HostKVPool
from hicache.tiers.host_state import HostStatePool
from hicache.tiers.storage import StorageTier
from hicache.tiers.storage_state import StateStore
from serving.cache.cost_model import LoadPolicy
from serving.cache.l3_prefetch import Prefetcher
from serving.cache.l3_promote import KeyGuard, Promotions
from serving.cache.l3_writeback import WriteBack
from serving.cache.transfers import TransferRunner, TransferSink
from serving.structs.request import Req


class StorageController:
    """L2 <-> L3 for the scheduler: a :class:`WriteBack` and a :class:`Prefetcher` over one
    storage tier and namespace (see the module docstring).

    Concurrency contract: every method is called on the scheduler thread and returns without
    waiting on the store, except :meth:`persist_all` (waits for every write) and
    :meth:`shutdown` (stops both parts' threads, then closes the tier); ``poll(wait=True)``
    waits too, and is for tests and shutdown. No lock and no thread of its own: its parts'
    background threads (L3 writers; lookup and fetch threads) touch only what their class
    docstrings say, and hand results back through futures the scheduler thread polls here.
    """

    def __init__(self, tree: HiRadixTree, host_pool: HostKVPool, tier: StorageTier, namespace: str,
                 execute: TransferSink, policy: str = "best_effort", threshold_tokens: int = 256,
                 timeout_base_s: float = 0.5, timeout_per_1k_tokens_s: float = 0.25,
                 load_policy: LoadPolicy | None = None, write_queue_pages: int = 16384,
                 write_rate_mb_s: float = 0.0, host_state_pool: HostStatePool | None = None,
                 backlog: Callable[[Req], int] | None = None) -> None:
        """``backlog(req)``: prefill tokens queued ahead of ``req``, for the load policy (the scheduler's)."""
        self.tree = tree
        self.tier = tier
        if host_state_pool is None and tree.state is not None and isinstance(tree.state.host, HostStatePool):
            host_state_pool = tree.state.host  # the L2 state pool the tree hands slots of
        # a tensor-parallel tier makes its own (each rank stores its part: serving/tp/state_l3.py)
        make_store = getattr(tier, "state_store", None) or (lambda layout: StateStore(tier.backend, layout))
        self.state_store = None if host_state_pool is None else make_store(host_state_pool.layout)
        states = None if host_state_pool is None else (host_state_pool, self.state_store)
        self.writeback = WriteBack(tree, host_pool, tier, namespace, write_queue_pages, write_rate_mb_s, states)
        # the one runner of the tree's moves (the request cache flushes through it too): backups
        # it runs go on to the write-back; the prefetcher's early L2 -> L1 loads run through it
        self.transfers = TransferRunner(tree, execute, self.writeback)
        self.prefetcher = Prefetcher(tree, host_pool, tier, namespace, self.transfers, policy, threshold_tokens,
                                     timeout_base_s, timeout_per_1k_tokens_s, load_policy, states, backlog)
        self.load_policy = self.prefetcher.load_policy
        tree.exclusive.enable_demotion()  # exclusive tiers: L3 takes the coldest L2 pages (poll)
        # ... and an L3 hit promotes, on a private store only (StorageBackend.shared: others read a shared one;
        # a tensor-parallel tier, without one backend, keeps its copies)
        backend = getattr(tier, "backend", None)
        self.promotions: Promotions | None = None
        if tree.exclusive.on and backend is not None and not getattr(backend, "shared", True):
            guard = KeyGuard()
            self.promotions = Promotions(backend, guard)
            self.writeback.guard = guard
            self.prefetcher.fetches.on_promote = self.promotions.delete
            tree.exclusive.enable_promotion()

    # -- write-back -----------------------------------------------------------------------
    def on_hit(self, node: TreeNode) -> None:
        """A request matched the path to ``node``: retry write-backs that did not reach L3
        (the store was down, say) for its L2 nodes; not in the exclusive mode (L3 takes cold pages only)."""
        if self.tree.exclusive.on:
            return
        while node is not None and node.parent is not None:
            self.writeback.write(node)
            node = node.parent

    @property
    def busy(self) -> bool:
        """Writes waiting or in flight, or fetches not settled: an idle engine loop keeps polling
        (:meth:`poll`) so their L2 pins are released and their progress marked without a step."""
        wb, f = self.writeback, self.prefetcher.fetches
        return bool(wb.waiting or wb.in_flight or f.active or f.draining or
                    (self.promotions is not None and self.promotions.in_flight))

    def poll(self, wait: bool = False) -> None:
        """Record finished write-backs and free pages of finished cancelled fetches; in the exclusive
        mode write the coldest L2 pages L3 lacks (``tree.exclusive.dirty_tail``: L2 eviction then
        drops pages L3 holds)."""
        self.writeback.poll(wait)
        self.prefetcher.poll(wait)
        if self.promotions is not None:
            self.promotions.poll(wait)
        for node in self.tree.exclusive.dirty_tail():
            self.writeback.write(node)

    def persist_all(self) -> None:
        """Write every L2 page that is not in L3 yet (L1-only nodes are backed up to L2 first
        by the caller's flush), and every state snapshot of a node on L2 (copied down first);
        waits for the writes. No L3 hit promotes from here on (what it brings up stays on L3 too)."""
        self.tree.exclusive.enable_promotion(False)
        if self.tree.state is not None and self.state_store is not None and self.tree.state.copy_down_all():
            self.transfers.flush()  # the snapshots' state_backups (they queue their nodes' writes)
        for node in self.tree.nodes():
            self.writeback.write(node)  # never dropped: over the cap, it waits for a writer
        self.writeback.poll(wait=True)

    def clear(self) -> None:
        """Remove every page of the store (a /flush_cache with ``clear_storage``, the tree flushed
        first and no write in flight: :meth:`poll` waited). The nodes a flush kept (pinned) forget
        their L3 copies and are written again. Waits on the store: an operator's call."""
        backend = getattr(self.tier, "backend", None)
        if backend is None:
            raise ValueError("clearing L3 is not supported with tensor parallelism (each rank's tier)")
        backend.clear()
        for node in self.tree.nodes():
            node.storage_pages = 0
        if not self.tree.exclusive.on:
            for node in self.tree.nodes():
                self.writeback.write(node)

    # -- prefetch (the request cache drives ``prefetcher`` for waiting requests) -----------------
    def in_flight_host_pages(self, reqs: list[Req]) -> int:
        return self.prefetcher.in_flight_host_pages(reqs)

    # -- stats / teardown -------------------------------------------------------------------
    @property
    def pages_written(self) -> int:
        return self.writeback.pages_written

    @property
    def pages_prefetched(self) -> int:
        return self.prefetcher.pages_prefetched

    @property
    def prefetches_revoked(self) -> int:
        return self.prefetcher.prefetches_revoked

    def stats(self) -> dict[str, float]:
        """The tier's counters, the controller's, and the load policy's estimates."""
        st = dict(self.tier.stats())
        st.update(pages_written=self.pages_written, pages_prefetched=self.pages_prefetched,
                  prefetches_revoked=self.prefetches_revoked,
                  **self.prefetcher.stats(),
                  write_pages_dropped=self.writeback.pages_dropped,
                  write_retries=self.writeback.write_retries,
                  write_pages_waiting=self.writeback.waiting_pages,
                  write_pages_in_flight=self.writeback.in_flight_pages,
                  write_pages_waiting_max=self.writeback.max_waiting_pages,
                  l2_backups_skipped_pages=self.tree.backups_skipped_pages,
                  l2_demotions_dropped_pages=self.tree.exclusive.demotions_dropped_pages,
                  l3_pages_promoted=self.tree.exclusive.l3_promoted_pages,
                  l3_promoted_pages_deleted=0 if self.promotions is None else self.promotions.pages_deleted,
                  **(self.state_store.stats() if self.state_store is not None else {}),
                  **self.load_policy.stats())
        return st

    def check_integrity(self, reqs: list[Req]) -> None:
        """The write-back's and the prefetcher's own checks (``reqs``: every waiting and running request)."""
        self.writeback.check_integrity()
        self.prefetcher.check_integrity(reqs)

    def shutdown(self) -> None:
        self.tree.exclusive.enable_promotion(False)  # fetches committed from here on keep their L3 copy
        self.writeback.shutdown()
        self.prefetcher.shutdown()
        if self.promotions is not None:
            self.promotions.shutdown()
        self.tier.close()
