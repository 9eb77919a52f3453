"""L2 -> L3 write-back: nodes that got an L2 copy are written on to the storage tier.

Concurrency contract (the class owns it):
- Scheduler thread only: :meth:`WriteBack.write` and :meth:`WriteBack.poll` (and every tree
  call). The writer threads only read the L2 pages they were given and call the storage tier
  (thread-safe); they never touch the tree.
- What a write reads is protected, and nothing else: the node's L2 pages are pinned in the
  tree (:meth:`HiRadixTree.pin_host`) from :meth:`write` until :meth:`poll` sees the write
  finished. L1 is never locked, so a node being written stays evictable from L1; L2 eviction
  skips pinned pages, and if the tree drops the node meanwhile (its L2 copy included), the
  pinned pages are freed only when the write is done, so the write still lands: dropping an L2
  page that waits for L3 is a demotion, never a loss.
- Progress is recorded by tokens, not by node: the write remembers the path's tokens and
  the page range it covers, and :meth:`poll` marks that range stored with
  :meth:`HiRadixTree.mark_stored`, which walks the tree as it is then (splits since the
  submission, removals and re-insertions are all fine). Pages are marked only after the
  store confirmed them.
- L3 page keys (a hash over the whole path) are computed on the writer threads.
- Nothing is dropped: every write is accepted and waits in a FIFO backlog (pinned) until a
  writer takes it. At most ``max_queued_pages`` pages are handed to the writers at once (a
  write larger than that goes alone): the cap applies back-pressure -- the backlog's pinned
  pages leave L2 less room, so the tree backs up less while the store is behind -- instead of
  dropping. Waiting writes are coalesced: a writer takes a whole staging batch of them (many
  nodes) and stores them with one ``batch_set`` (one LMDB transaction per staging batch);
  ``tier.write_threads`` writers run at once (they frame pages in parallel; the backend
  serialises its commits where it must). ``rate_mb_s`` caps each writer's bandwidth so
  write-back does not take the memory bandwidth and cores that decode needs.
- A write the store fails (all or part of it: a full map whose free pages readers still hold, a
  remote store's timeout) is retried, not dropped: it goes back to the head of the backlog with
  its pages still pinned and L3's reservation kept, and is handed out again after a backoff
  (``RETRY_S`` doubling per attempt; pages already on L3 are skipped). Only after
  ``MAX_ATTEMPTS`` failed attempts in a row (a dead or full disk: pinning L2 for it forever would
  stop L2 itself) are the pages unpinned and counted in ``pages_dropped`` (the node is written
  again at its next backup or hit); ``write_retries`` counts the retries.
- A private L3 in the exclusive mode (``guard``: serving/cache/l3_promote.py's KeyGuard): a write holds
  its page keys from before its ``batch_exists`` until :meth:`poll` has marked them stored (or handed
  the write back to retry), and waits there first for a promotion's delete of any of them; a delete
  never starts on keys a write holds. So a write never finds a page that is being deleted.
- A model with state layers: a node's L2 state snapshot not stored yet goes with the node's write
  (its L2 slot pinned in ``tree.state.pins`` until the write is done; read on the writer thread), under
  ``state_key`` of the node's last page key, once all of the node's pages are on L3; :meth:`poll`
  then marks it stored (``tree.state.mark_stored`` of the node ending at the write's tokens).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from hicache.hiradix import HiRadixTree
from hicache.hiradix.node import TreeNode
from hicache.keys import page_keys
from hicache.ratelimited_log import RateLimitedLog
from hicache.tiers.host import HostKVPool
from hicache.tiers.host_state import HostStatePool
from hicache.tiers.storage import StorageTier
from hicache.tiers.storage_state import StateStore
from serving.cache.l3_promote import KeyGuard

RETRY_S = 0.05  # backoff before a failed write's first retry; doubles per attempt
MAX_ATTEMPTS = 8  # about 6 s of retries in all before a failing store's pages are given up


@dataclass(eq=False)
class _Write:
    tokens: list[int]  # the path's tokens up to the node's end
    first: int  # path page index of the first page written
    host_pages: list[int]  # pinned until the write is done
    node_id: int
    tenant: str | None = None  # whose L3 quota the pages are reserved against (hicache.hiradix.quota)
    state_slot: int | None = None  # the node's L2 state snapshot, pinned until the write is done
    attempts: int = 0  # store calls that failed it so far
    wrote: int = 0  # pages it wrote in failed attempts (for the tenant's ledger)
    retry_at: float = 0.0  # time.monotonic() before which it is not handed out again
    keys: list[str] | None = None  # its page keys, held in the key guard from its store call until settled


@dataclass(eq=False)
class _Job:
    """Writes one writer stores together; ``future`` -> per write (leading pages now in L3, pages
    written, its state snapshot on L3)."""

    writes: list[_Write]
    pages: int
    future: Future | None = None


class WriteBack:
    """Writes L2 pages on to L3 in the background (see the module docstring)."""

    def __init__(self, tree: HiRadixTree, host_pool: HostKVPool, tier: StorageTier, namespace: str,
                 max_queued_pages: int = 16384, rate_mb_s: float = 0.0,
                 states: tuple[HostStatePool, StateStore] | None = None) -> None:
        if max_queued_pages < 1:
            raise ValueError(f"max_queued_pages must be >= 1, got {max_queued_pages}")
        self.tree = tree
        self.host_pool = host_pool
        self.tier = tier
        self.namespace = namespace
        self.states = states  # (L2 state pool, its L3 store) of a model with state layers
        self.page_size = tree.page_size
        self.threads = max(1, int(getattr(tier, "write_threads", 1)))
        self.batch_pages = max(1, int(getattr(tier, "batch_pages", 64)))  # pages a writer takes at once
        self._writer = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="hicache-l3-write")
        self._backlog: deque[_Write] = deque()  # accepted, pinned, not handed to a writer yet
        self._jobs: list[_Job] = []  # handed to the writers
        self._pending: set[int] = set()  # ids of nodes with a write waiting or in flight
        self.max_queued_pages = max_queued_pages
        self.rate_mb_s = rate_mb_s
        self._waiting_pages = 0  # pages in the backlog
        self._queued_pages = 0  # pages handed to the writers, not finished
        self.pages_written = 0
        self.pages_dropped = 0  # pages of writes the store failed MAX_ATTEMPTS times (rewritten at the next hit)
        self.write_retries = 0  # failed writes handed back to the backlog (pinned) to try again
        self.snapshots_written = 0  # state snapshots now on L3
        self.pages_over_quota = 0  # not written: their tenant is at its L3 quota (hicache.hiradix.quota)
        self.max_waiting_pages = 0  # the backlog's high-water mark (how far behind the writers got)
        self._warn = RateLimitedLog(logging.getLogger("hicache.storage"))
        self.before_write = None  # test hook: called on a writer thread before each store call
        # a private L3 in the exclusive mode: orders writes after deletes of the same keys (l3_promote.py)
        self.guard: KeyGuard | None = None

    @property
    def in_flight(self) -> int:
        """Writes handed to the writers and not finished."""
        return sum(len(j.writes) for j in self._jobs)

    @property
    def waiting(self) -> int:
        """Writes accepted and waiting for a writer (their L2 pages pinned)."""
        return len(self._backlog)

    @property
    def landing(self) -> bool:
        """Writes waiting or in flight and none of them failed: the L2 pages they pin come free soon (a store
        that fails them holds those pages for up to ``MAX_ATTEMPTS`` backoffs: not soon)."""
        writes = self._all_writes()
        return bool(writes) and not any(w.attempts for w in writes)

    @property
    def waiting_pages(self) -> int:
        return self._waiting_pages

    @property
    def in_flight_pages(self) -> int:
        """Pages handed to the writers and not finished (not yet marked stored)."""
        return self._queued_pages

    def write(self, node: TreeNode) -> None:
        """Write ``node``'s L2 pages that are not on L3 yet, and its L2 state snapshot if not stored
        (no-op if none, or one is waiting or in flight). Never drops: a write over the cap waits in
        the backlog, its pages pinned."""
        npages = len(node.key) // self.page_size
        done = node.storage_pages
        snap = node.snap
        slot = snap.host_slot if self.states is not None and snap is not None and not snap.stored else None
        if node.removed or node.host_pages is None or (done >= npages and slot is None) or node.id in self._pending:
            return
        pages = list(node.host_pages[done:])
        tokens = self.tree.path_tokens(node)
        room = None if self.tree.ledger is None else self.tree.ledger.storage_room(tokens)
        if room is not None and room < len(pages):  # its tenant's L3 quota (writes in flight count)
            self.pages_over_quota += len(pages) - room
            pages, slot = pages[:room], None  # (a snapshot after pages L3 lacks would never be found)
            if not pages:
                return
        first = len(tokens) // self.page_size - npages + done
        self.tree.pin_host(pages)
        if slot is not None:
            self.tree.state.pins.pin([slot])
        tenant = None if self.tree.ledger is None else self.tree.ledger.reserve_storage(tokens, len(pages))
        self._backlog.append(_Write(tokens, first, pages, node.id, tenant, slot))
        self._waiting_pages += len(pages)
        self._pending.add(node.id)
        self._pump()

    def _pump(self) -> None:
        """Hand waiting writes to idle writers, a staging batch (or one larger write) per writer,
        while the pages handed out stay under the cap."""
        while self._backlog and len(self._jobs) < self.threads:
            if self._backlog[0].retry_at > time.monotonic():  # a failed write backs off (FIFO: the rest wait)
                break
            head = len(self._backlog[0].host_pages)
            if self._jobs and self._queued_pages + head > self.max_queued_pages:
                break
            writes, pages = [], 0
            while self._backlog:
                n = len(self._backlog[0].host_pages)
                if writes and (pages + n > self.batch_pages or self._queued_pages + pages + n > self.max_queued_pages):
                    break
                writes.append(self._backlog.popleft())
                pages += n
            job = _Job(writes, pages)
            try:
                job.future = self._writer.submit(self._store, writes)
            except BaseException:  # (a shut-down executor) nothing was handed out: the writes wait on
                self._backlog.extendleft(reversed(writes))
                raise
            self._waiting_pages -= pages
            self._queued_pages += pages
            self._jobs.append(job)
        if self._waiting_pages > self.max_waiting_pages:
            self.max_waiting_pages = self._waiting_pages
        if self._backlog and self._waiting_pages >= self.max_queued_pages:
            self._warn.warning("write_behind", "L3 write-back is behind: %d pages wait for a writer (%d in flight, "
                               "the cap is %d); they stay pinned in L2 until written", self._waiting_pages,
                               self._queued_pages, self.max_queued_pages)

    def _store(self, writes: list[_Write]) -> list[tuple[int, int, bool]]:
        """On a writer thread: the writes' pages that L3 lacks, stored with one ``batch_set``
        (split by the tier into one backend call per staging batch); it stops at the first
        failure, so the writes after it get nothing. Then the state snapshots of the writes whose
        pages are all on L3."""
        if self.before_write is not None:
            self.before_write()
        chains = [page_keys(w.tokens, self.page_size, self.namespace) for w in writes]
        wkeys = [chain[w.first : w.first + len(w.host_pages)] for w, chain in zip(writes, chains, strict=True)]
        last_keys = [chain[-1] if chain else None for chain in chains]
        if self.guard is not None:  # a delete of these keys in flight ends first; none starts until settled
            self.guard.begin_write([k for ks in wkeys for k in ks])
            for w, ks in zip(writes, wkeys, strict=True):
                w.keys = ks
        runs = [(ks, self._present(ks, w.host_pages)) for ks, w in zip(wkeys, writes, strict=True)]
        keys = [k for ks, present in runs for k in ks[present:]]
        pages = [p for w, (_, present) in zip(writes, runs, strict=True) for p in w.host_pages[present:]]
        t0 = time.monotonic()
        stored = self.tier.batch_set(keys, self.host_pool, pages) if keys else 0
        if self.rate_mb_s > 0:  # hold the writer back to the configured bandwidth
            time.sleep(max(0.0, stored * self.tier.codec.value_nbytes / (self.rate_mb_s * 1e6)
                           - (time.monotonic() - t0)))
        out = []
        for w, (ks, present), last in zip(writes, runs, last_keys, strict=True):
            wrote = max(0, min(len(ks) - present, stored))
            stored -= wrote
            state = False
            if w.state_slot is not None and present + wrote == len(ks) and last is not None:
                pool, store = self.states
                state = store.put_slot(last, pool, w.state_slot)
            out.append((present + wrote, wrote, state))
        return out

    def _present(self, keys: list[str], host_pages: list[int]) -> int:
        """How many leading pages of a write L3 holds already (another server's, or this one's before a
        recompute): those are not written again, except, with a host window pool, from the first that keeps
        its sliding part on L2: L3 may hold it short (stored when its sliding part was not kept), and a
        short value there stayed for good (that page's window was lost each time L2 let go of it, the
        conversation recomputed whole turn after turn). Writer thread: the pages are pinned, so their host
        window pages stay as they are."""
        present = self.tier.batch_exists(keys)
        hw = self.host_pool.windows
        if hw is not None and present:
            present = next((i for i in range(present) if hw.has(host_pages[i])), present)
        return present

    def poll(self, wait: bool = False) -> None:
        """Finish the writes that are done (all of them, the backlog included, with ``wait``):
        mark what reached L3, unpin their pages, and hand waiting writes to idle writers."""
        while True:
            for job in list(self._jobs):
                if wait:
                    job.future.exception()  # waits; a failure is handled below
                if job.future.done():
                    self._finish(job)
            self._pump()
            if not (wait and (self._jobs or self._backlog)):
                return
            if not self._jobs:  # only a failed write backing off is left
                time.sleep(max(0.0, min(1.0, self._backlog[0].retry_at - time.monotonic())))

    def _finish(self, job: _Job) -> None:
        self._jobs.remove(job)  # before its effects: a failure below cannot settle it twice
        self._queued_pages -= job.pages
        try:
            results = job.future.result()
        except Exception:  # a backend bug: nothing is marked, the pages are unpinned
            results = [(0, 0, False)] * len(job.writes)
        retry = []
        for w, (stored, wrote, state) in zip(job.writes, results, strict=True):
            self.pages_written += wrote
            w.wrote += wrote
            if stored < len(w.host_pages) and w.attempts + 1 < MAX_ATTEMPTS:  # back to the backlog, still pinned
                self._release_keys(w)
                w.attempts += 1
                w.retry_at = time.monotonic() + RETRY_S * 2 ** (w.attempts - 1)
                retry.append(w)
                continue
            self._pending.discard(w.node_id)
            self.pages_dropped += len(w.host_pages) - stored
            if self.tree.ledger is not None:
                self.tree.ledger.settle_storage(w.tenant, len(w.host_pages), w.tokens, w.wrote)
            if stored:
                self.tree.mark_stored(w.tokens, w.first, w.first + stored)
            self._release_keys(w)  # after the mark: a delete of these keys may start now
            if w.state_slot is not None:
                if state:  # the node ending there (split since, maybe) holds the snapshot
                    node, end = self.tree.lookup(w.tokens, needs_state=True)
                    if end == len(w.tokens) and self.tree.state.mark_stored(node):
                        self.snapshots_written += 1
                self.tree.state.pins.unpin([w.state_slot])
            self.tree.unpin_host(w.host_pages)  # last: an exclusive tree may drop the L2 copy it kept for us
        if retry:
            self.write_retries += len(retry)
            self._backlog.extendleft(reversed(retry))
            self._waiting_pages += sum(len(w.host_pages) for w in retry)

    def _release_keys(self, w: _Write) -> None:
        if w.keys is not None and self.guard is not None:
            self.guard.end_write(w.keys)
        w.keys = None

    def _all_writes(self) -> list[_Write]:
        return [*self._backlog, *(w for j in self._jobs for w in j.writes)]

    def check_integrity(self) -> None:
        """Raise AssertionError unless the page counts, pending nodes, L2 pins and the tenants' L3
        reservations equal what the waiting and in-flight writes hold."""
        writes = self._all_writes()
        assert self._waiting_pages == sum(len(w.host_pages) for w in self._backlog), "write-back: waiting pages"
        assert self._queued_pages == sum(j.pages for j in self._jobs), "write-back: queued pages"
        assert all(j.pages == sum(len(w.host_pages) for w in j.writes) for j in self._jobs), "write-back: job pages"
        assert len(self._jobs) <= self.threads, "write-back: more jobs than writers"
        assert self._pending == {w.node_id for w in writes}, "write-back: pending nodes"
        held = Counter(p for w in writes for p in w.host_pages)
        pins = self.tree.pins
        short = [p for p, k in held.items() if pins.count(p) < k]
        assert not short, f"write-back: L2 pages of waiting or in-flight writes not pinned: {short[:8]}"
        slots = Counter(w.state_slot for w in writes if w.state_slot is not None)
        assert all(self.tree.state.pins.count(s) >= k for s, k in slots.items()), (
            "write-back: an L2 state slot of a waiting or in-flight write is not pinned")
        if self.tree.ledger is not None:
            want: dict[str | None, int] = {}
            for w in writes:
                want[w.tenant] = want.get(w.tenant, 0) + len(w.host_pages)
            assert self.tree.ledger.storage_reserved == want, (
                f"write-back: L3 reservations {self.tree.ledger.storage_reserved}, writes in flight {want}")

    def shutdown(self) -> None:
        self.poll(wait=True)
        self._writer.shutdown(wait=True)
