"""L2 -> L3 write-back: nodes that got an L2 copy are written on to the storage tier.

Concurrency contract (the class owns it):
- Scheduler thread only: :meth:`WriteBack.write` and :meth:`WriteBack.poll` (and every tree
  call). The writer thread only reads the L2 pages it was given and calls the storage tier
  (thread-safe); it never touches the tree.
- What the write reads is protected, and nothing else: the node's L2 pages are pinned in
  the tree (:meth:`HiRadixTree.pin_host`) from submission until :meth:`poll` sees the write
  finished. L1 is never locked, so a node being written stays evictable from L1; if the
  tree drops the node meanwhile, its pinned pages are freed only when the write is done.
- Progress is recorded by tokens, not by node: the write remembers the path's tokens and
  the page range it covers, and :meth:`poll` marks that range stored with
  :meth:`HiRadixTree.mark_stored`, which walks the tree as it is then (splits since the
  submission, removals and re-insertions are all fine). Pages are marked only after the
  store confirmed them.
- L3 page keys (a hash over the whole path) are computed on the writer thread.
- Write-back never slows serving: at most ``max_queued_pages`` pages wait for the writer
  (a write that would exceed it is dropped and counted in ``pages_dropped``, unless the queue
  is empty: a node larger than the cap still goes alone; the node is
  written at its next backup or hit), and ``rate_mb_s`` caps the writer's bandwidth so it
  does not take the memory bandwidth and cores that decode needs.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from hicache.hiradix import HiRadixTree
from hicache.hiradix.node import TreeNode
from hicache.keys import page_keys
from hicache.ratelimited_log import RateLimitedLog
from hicache.tiers.host import HostKVPool
from hicache.tiers.storage import StorageTier


@dataclass(eq=False)
class _Write:
    future: Future  # -> (leading pages now in L3, pages this call wrote)
    tokens: list[int]  # the path's tokens up to the node's end
    first: int  # path page index of the first page written
    host_pages: list[int]  # pinned until the write is done
    node_id: int
    tenant: str | None = None  # whose L3 quota the pages are reserved against (hicache.hiradix.quota)


class WriteBack:
    """Writes L2 pages on to L3 in the background (see the module docstring)."""

    def __init__(self, tree: HiRadixTree, host_pool: HostKVPool, tier: StorageTier, namespace: str,
                 max_queued_pages: int = 16384, rate_mb_s: float = 0.0) -> None:
        self.tree = tree
        self.host_pool = host_pool
        self.tier = tier
        self.namespace = namespace
        self.page_size = tree.page_size
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicache-l3-write")
        self._writes: list[_Write] = []
        self._pending: set[int] = set()  # ids of nodes with a write in flight
        self.max_queued_pages = max_queued_pages
        self.rate_mb_s = rate_mb_s
        self._queued_pages = 0
        self.pages_written = 0
        self.pages_dropped = 0
        self.pages_over_quota = 0  # not written: their tenant is at its L3 quota (hicache.hiradix.quota)
        self._warn = RateLimitedLog(logging.getLogger("hicache.storage"))
        self.before_write = None  # test hook: called on the writer thread before each write

    @property
    def in_flight(self) -> int:
        return len(self._writes)

    def room_for(self, node: TreeNode) -> bool:
        """Whether a write of ``node`` would fit under ``max_queued_pages`` now."""
        pages = len(node.key) // self.page_size - node.storage_pages
        return not self._queued_pages or self._queued_pages + pages <= self.max_queued_pages

    def write(self, node: TreeNode) -> None:
        """Write ``node``'s L2 pages that are not on L3 yet (no-op if none, or one is in flight)."""
        npages = len(node.key) // self.page_size
        done = node.storage_pages
        if node.removed or node.host_pages is None or done >= npages or node.id in self._pending:
            return
        pages = list(node.host_pages[done:])
        if self._queued_pages and self._queued_pages + len(pages) > self.max_queued_pages:
            self.pages_dropped += len(pages)  # under pressure: retried at the next backup or hit
            self._warn.warning("write_dropped", "L3 write-back queue full (%d pages queued, the cap is %d): "
                               "the write of %d pages is dropped for now", self._queued_pages,
                               self.max_queued_pages, len(pages))
            return
        tokens = self.tree.path_tokens(node)
        room = None if self.tree.ledger is None else self.tree.ledger.storage_room(tokens)
        if room is not None and room < len(pages):  # its tenant's L3 quota (writes in flight count)
            self.pages_over_quota += len(pages) - room
            pages = pages[:room]
            if not pages:
                return
        first = len(tokens) // self.page_size - npages + done
        self.tree.pin_host(pages)
        try:
            future = self._writer.submit(self._write, tokens, first, pages)
        except BaseException:  # (a shut-down executor) nothing was submitted: nothing stays pinned
            self.tree.unpin_host(pages)
            raise
        tenant = None if self.tree.ledger is None else self.tree.ledger.reserve_storage(tokens, len(pages))
        self._queued_pages += len(pages)
        self._pending.add(node.id)
        self._writes.append(_Write(future, tokens, first, pages, node.id, tenant))

    def _write(self, tokens: list[int], first: int, host_pages: list[int]) -> tuple[int, int]:
        if self.before_write is not None:
            self.before_write()
        keys = page_keys(tokens, self.page_size, self.namespace)[first : first + len(host_pages)]
        present = self.tier.batch_exists(keys)  # another server may have stored them
        if present == len(keys):
            return present, 0
        t0 = time.monotonic()
        wrote = self.tier.batch_set(keys[present:], self.host_pool, host_pages[present:])
        if self.rate_mb_s > 0:  # hold the writer back to the configured bandwidth
            time.sleep(max(0.0, wrote * self.tier.codec.value_nbytes / (self.rate_mb_s * 1e6)
                           - (time.monotonic() - t0)))
        return present + wrote, wrote

    def poll(self, wait: bool = False) -> None:
        """Finish the writes that are done (all of them with ``wait``): mark what reached L3
        (a failed write is retried at the node's next backup or hit) and unpin their pages."""
        for w in list(self._writes):
            if not (wait or w.future.done()):
                continue
            self._writes.remove(w)  # before its effects: a failure below cannot settle it twice
            self._queued_pages -= len(w.host_pages)
            self._pending.discard(w.node_id)
            try:
                stored, wrote = w.future.result()
            except Exception:  # a backend bug: nothing is marked, the pages are unpinned
                stored, wrote = 0, 0
            self.pages_written += wrote
            if self.tree.ledger is not None:
                self.tree.ledger.settle_storage(w.tenant, len(w.host_pages), w.tokens, wrote)
            if stored:
                self.tree.mark_stored(w.tokens, w.first, w.first + stored)
            self.tree.unpin_host(w.host_pages)

    def check_integrity(self) -> None:
        """Raise AssertionError unless the queue count and the tenants' L3 reservations equal
        what the writes in flight hold."""
        assert self._queued_pages == sum(len(w.host_pages) for w in self._writes), "write-back: queued pages"
        assert self._pending == {w.node_id for w in self._writes}, "write-back: pending nodes"
        if self.tree.ledger is not None:
            want: dict[str | None, int] = {}
            for w in self._writes:
                want[w.tenant] = want.get(w.tenant, 0) + len(w.host_pages)
            assert self.tree.ledger.storage_reserved == want, (
                f"write-back: L3 reservations {self.tree.ledger.storage_reserved}, writes in flight {want}")

    def shutdown(self) -> None:
        self.poll(wait=True)
        self._writer.shutdown(wait=True)
