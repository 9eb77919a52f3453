"""L2 <-> L3: write-back of backed-up pages and prefetch for waiting requests.

The tree decides, this controller moves, on background threads:
- **Write-back.** When a node gets an L2 copy (a backup transfer), its pages that are
  not in L3 yet are written under their page keys. The node stays locked while the
  write reads its host pages (so they cannot be dropped and reused meanwhile); the
  scheduler thread unlocks it in :meth:`poll`.
- **Prefetch.** A waiting request whose prompt continues past L1/L2 in L3 gets host
  pages and a background fetch in batches that stops at the first miss. The request's
  matched node stays locked until the prefetch is committed (pages inserted into the
  tree as L2 copies) or revoked (every host page given back).

All tree calls happen on the scheduler thread; the threads only touch host pages that
the tree handed out and the storage tier (thread-safe).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from hicache.hiradix import HiRadixTree, Transfer
from hicache.hiradix.node import TreeNode
from hicache.keys import page_keys
from hicache.tiers.host import HostKVPool
from hicache.tiers.storage import StorageTier
from serving.request import Req


@dataclass
class PrefetchOp:
    node: TreeNode  # locked: the path the prefetched pages hang below
    start_page: int  # first page of the request's prompt being fetched
    keys: list[str]
    host_pages: list[int]
    started: float
    deadline: float
    cancel: threading.Event = field(default_factory=threading.Event)
    loaded: int = 0
    future: Future | None = None


class PrefetchPolicy:
    """When a waiting request stops waiting for its prefetch (SGLang's names)."""

    def ready(self, op: PrefetchOp, now: float) -> bool:
        raise NotImplementedError


class BestEffort(PrefetchPolicy):
    """Never wait: take whatever has arrived when the request is scheduled."""

    def ready(self, op: PrefetchOp, now: float) -> bool:
        return True


class WaitComplete(PrefetchPolicy):
    def ready(self, op: PrefetchOp, now: float) -> bool:
        return op.future is None or op.future.done()


class Timeout(PrefetchPolicy):
    """Wait until done or ``base + per_1k_tokens * tokens / 1000`` seconds have passed."""

    def ready(self, op: PrefetchOp, now: float) -> bool:
        return op.future is None or op.future.done() or now >= op.deadline


PREFETCH_POLICIES: dict[str, type[PrefetchPolicy]] = {
    "best_effort": BestEffort, "wait_complete": WaitComplete, "timeout": Timeout}


class StorageController:
    def __init__(self, tree: HiRadixTree, host_pool: HostKVPool, tier: StorageTier, namespace: str,
                 policy: str = "best_effort", threshold_tokens: int = 256,
                 timeout_base_s: float = 0.5, timeout_per_1k_tokens_s: float = 0.25) -> None:
        if policy not in PREFETCH_POLICIES:
            raise ValueError(f"unknown prefetch policy {policy!r}; choose from {sorted(PREFETCH_POLICIES)}")
        self.tree = tree
        self.host_pool = host_pool
        self.tier = tier
        self.namespace = namespace
        self.page_size = tree.page_size
        self.policy = PREFETCH_POLICIES[policy]()
        self.threshold_tokens = threshold_tokens
        self.timeout_base_s = timeout_base_s
        self.timeout_per_1k_tokens_s = timeout_per_1k_tokens_s
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicache-l3-write")
        self._fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicache-l3-fetch")
        self._writes: list[tuple[Future, TreeNode, int]] = []
        self._pending: set[int] = set()  # ids of nodes with a write in flight
        self.pages_written = 0
        self.pages_prefetched = 0
        self.prefetches_revoked = 0

    # -- keys -----------------------------------------------------------------------------
    def node_keys(self, node: TreeNode) -> list[str]:
        """Page keys of ``node``'s own pages (the chain runs from the root)."""
        path = list(reversed(node.path_to_root()))
        tokens = [t for nd in path for t in nd.key]
        return page_keys(tokens, self.page_size, self.namespace)[-(len(node.key) // self.page_size):]

    def request_keys(self, req: Req, upto_pages: int) -> list[str]:
        if len(req.page_keys) < upto_pages:
            req.page_keys = page_keys(req.fill_ids[: upto_pages * self.page_size], self.page_size, self.namespace)
        return req.page_keys[:upto_pages]

    # -- write-back ---------------------------------------------------------------------
    def on_transfers_done(self, transfers: list[Transfer]) -> None:
        """Called on the scheduler thread after backups ran: write their nodes on to L3."""
        for t in transfers:
            if t.kind == "backup":
                for node in t.nodes:
                    self._write_back(node)

    def on_hit(self, node: TreeNode) -> None:
        """A request matched the path to ``node``: retry write-backs that did not reach L3
        (the store was down, say) for its L2 nodes."""
        while node is not None and node.parent is not None:
            self._write_back(node)
            node = node.parent

    def _write_back(self, node: TreeNode) -> None:
        npages = len(node.key) // self.page_size
        done = node.storage_pages
        if node.removed or node.host_pages is None or done >= npages or node.id in self._pending:
            return
        keys = self.node_keys(node)[done:]
        self.tree.lock(node)  # its host pages stay put until the write has read them
        self._pending.add(node.id)
        write = self._writer.submit(self._write, keys, list(node.host_pages[done:]))
        self._writes.append((write, node, done))

    def _write(self, keys: list[str], host_pages: list[int]) -> tuple[int, int]:
        """Returns (leading pages now in L3, pages this call wrote)."""
        present = self.tier.batch_exists(keys)  # another server may have stored them
        if present == len(keys):
            return present, 0
        wrote = self.tier.batch_set(keys[present:], self.host_pool, host_pages[present:])
        return present + wrote, wrote

    def poll(self, wait: bool = False) -> None:
        """Finish write-backs (all of them with ``wait``): record what reached L3 (a failed
        write is retried at the node's next backup) and unlock the nodes."""
        keep = []
        for fut, node, start in self._writes:
            if wait or fut.done():
                stored, wrote = fut.result()
                self.pages_written += wrote
                if not node.removed:
                    node.storage_pages = max(node.storage_pages, start + stored)
                self.tree.unlock(node)
                self._pending.discard(node.id)
            else:
                keep.append((fut, node, start))
        self._writes = keep

    # -- prefetch -------------------------------------------------------------------------
    def maybe_prefetch(self, req: Req) -> None:
        """Start fetching the request's prompt pages that are in L3 but not in L1/L2."""
        req.prefetch_checked = True
        tokens = req.fill_ids[: req.seq_len - 1]
        full = len(tokens) // self.page_size
        cached = self.tree.peek_prefix_len(tokens) // self.page_size
        if (full - cached) * self.page_size < self.threshold_tokens:
            return
        keys = self.request_keys(req, full)[cached:]
        n = self.tier.batch_exists(keys)
        if n * self.page_size < self.threshold_tokens:
            return
        host = self.tree.host
        if host.num_free < n:
            self.tree.evict_host(n - host.num_free)
        n = min(n, host.num_free)
        if n * self.page_size < self.threshold_tokens:
            return
        m = self.tree.match_prefix(tokens[: cached * self.page_size])
        node = m.last_host_node
        self.tree.lock(node)
        now = time.monotonic()
        tokens_k = n * self.page_size / 1000
        op = PrefetchOp(node, cached, keys[:n], host.alloc(n), now,
                        now + self.timeout_base_s + self.timeout_per_1k_tokens_s * tokens_k)
        op.future = self._fetcher.submit(self._fetch, op)
        req.prefetch = op

    def _fetch(self, op: PrefetchOp) -> None:
        step = self.tier.batch_pages
        for lo in range(0, len(op.keys), step):
            if op.cancel.is_set():
                return
            hi = min(len(op.keys), lo + step)
            got = self.tier.batch_get(op.keys[lo:hi], self.host_pool, op.host_pages[lo:hi])
            op.loaded += got
            if got < hi - lo:
                return

    def prefetch_ready(self, req: Req) -> bool:
        return req.prefetch is None or self.policy.ready(req.prefetch, time.monotonic())

    def finish_prefetch(self, req: Req) -> int:
        """Stop the request's prefetch and commit what arrived into L2; returns pages committed.
        Every host page not committed goes back to the free list."""
        op: PrefetchOp | None = req.prefetch
        if op is None:
            return 0
        req.prefetch = None
        op.cancel.set()
        op.future.result()  # at most one batch in flight
        loaded = op.loaded
        committed = 0
        if loaded and not op.node.removed:
            upto = (op.start_page + loaded) * self.page_size
            dup = self.tree.insert_host(req.fill_ids[:upto], op.host_pages[:loaded], start_page=op.start_page)
            committed = loaded - len(dup)
            self.tree.host.free(list(dup) + op.host_pages[loaded:])
        else:
            self.tree.host.free(op.host_pages)
        if committed < len(op.host_pages):
            self.prefetches_revoked += int(committed == 0)
        self.tree.unlock(op.node)
        self.pages_prefetched += committed
        return committed

    def persist_all(self) -> None:
        """Write every cached page that is not in L3 yet (L1-only nodes are backed up to L2
        first by the caller's flush); waits for the writes."""
        for node in self.tree.nodes():
            self._write_back(node)
        self.poll(wait=True)

    def in_flight_host_pages(self, reqs: list[Req]) -> int:
        """Host pages held by uncommitted prefetches (for integrity checks)."""
        return sum(len(r.prefetch.host_pages) for r in reqs if r.prefetch is not None)

    def shutdown(self) -> None:
        self.poll(wait=True)
        self._writer.shutdown(wait=True)
        self._fetcher.shutdown(wait=True)
        self.tier.close()
