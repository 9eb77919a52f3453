"""L3 -> L2 fetches in flight, shared by the requests that wait for them (see serving/cache/l3_prefetch.py).

A :class:`FetchOp` reads consecutive L3 pages hanging below a locked tree node into host
pages, as a read job on the storage tier's reader threads (``StorageTier.start_read``: every
fetch in flight at once, first come first served, no thread per fetch), or -- for a tier
that only has ``batch_get`` (tensor parallel) -- as a job of ``batch_get`` calls on this
module's fetch workers. :class:`Fetches` owns them: it starts them, finds the one already
reading a prefix (a second request with the same prefix follows it instead of reading the
same keys again), commits landed pages into the tree as they arrive and releases a fetch
once no request holds it. In the exclusive mode with a private L3, the keys of committed pages the
tree promoted (hicache/hiradix/exclusive.py) go to ``on_promote`` (serving/cache/l3_promote.py).

The concurrency contract is :class:`Fetches`'.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from hicache.hiradix import HiRadixTree, MatchResult
from hicache.hiradix.match import PendingLoad
from hicache.hiradix.node import TreeNode
from hicache.tiers.host import HostKVPool
from hicache.tiers.storage import ReadJob, StorageTier
from serving.cache.transfers import TransferRunner


@dataclass(eq=False)
class FetchOp:
    start_page: int  # prompt page of keys[0]
    tokens: list[int]  # tokens up to the fetch's last page (full pages)
    keys: list[str]
    node: TreeNode  # locked until released; moves down with each commit
    host_pages: list[int]
    job: ReadJob | None = None
    users: int = 1  # requests holding it (the one that started it and its followers)
    committed: int = 0  # leading host pages handed to the tree
    new: list[bool] = field(default_factory=list)  # per committed page: the tree did not hold it yet
    observed: bool = False  # its read was reported to the load policy

    @property
    def loaded(self) -> int:
        return self.job.loaded

    @property
    def reading(self) -> int:
        """Pages its readers have started on (``ReadJob.reading``): ``loaded`` once they land."""
        return self.job.reading

    @property
    def done(self) -> bool:
        return self.job.done()

    def new_pages(self, lo: int = 0, hi: int | None = None) -> int:
        """Committed pages in ``[lo, hi)`` that the tree did not hold before."""
        return sum(self.new[lo:hi])


class Fetches:
    """The L3 -> L2 fetches in flight (see the module docstring for what they do).

    Concurrency contract: scheduler thread only for every method and every
    tree call; reader threads only write the fetch's uncommitted host pages (which belong to
    nobody else) and its job's counters. Rules that keep readers exact:
    - a page is handed to the tree only once the job counts it landed *and verified*
      (``job.loaded``); pages past it are never in the tree;
    - the fetch's node is locked from its start until it is released, and the lock moves down
      with each commit, so nothing it committed (nor the prefix it hangs below) is evicted
      while a request waits for it; host pages it has not committed are in no tree node;
    - a released fetch whose job still runs keeps its uncommitted pages in ``draining`` until
      the job has ended; only then are they freed.
    """

    def __init__(self, tree: HiRadixTree, host_pool: HostKVPool, tier: StorageTier, transfers: TransferRunner,
                 on_read: Callable[[int, float], None], fetch_workers: int = 4) -> None:
        self.tree = tree
        self.host_pool = host_pool
        self.tier = tier
        self.page_size = tree.page_size
        self.on_read = on_read  # (bytes, seconds) of every finished read (the load policy learns)
        # a hybrid SWA L1 (serving/cache/l3_windows.py): window pages for an early load's chain
        # (before, after) -> None, before its transfers run; None: no window pool
        self.on_load: Callable[[MatchResult, MatchResult], None] | None = None
        # ... and whether an early load may run now (its last window's window pages can be had); None: always
        self.can_load: Callable[[], bool] | None = None
        # ... and host window pages for a fetch's pages in the last window before its end, before its read
        # starts (the readers never reclaim): (start page, host pages) -> None; None: no host window pool
        self.on_start: Callable[[int, list[int]], None] | None = None
        # a private L3 in the exclusive mode: the keys of committed pages whose L3 copy the tree gave up
        # (an L3 hit promotes: serving/cache/l3_promote.py deletes them); None: no promotion
        self.on_promote: Callable[[list[str]], None] | None = None
        self.active: list[FetchOp] = []
        self.draining: list[tuple[ReadJob, list[int]]] = []  # host pages a released fetch may still write
        self._unobserved: list[FetchOp] = []  # released before their read ended: reported once it has
        self._by_key: dict[str, tuple[FetchOp, int]] = {}  # key -> (active fetch, index in its keys)
        self._workers = None if isinstance(tier, StorageTier) else \
            ThreadPoolExecutor(max_workers=fetch_workers, thread_name_prefix="hicache-l3-fetch")
        self.transfers = transfers  # runs the tree's moves (an early load's backups and copy)
        self.l1_loads: list[tuple[TreeNode, PendingLoad]] = []  # early L2 -> L1 loads to finish
        self.pages_loaded_early = 0
        self.pages_deduplicated = 0  # pages a request found already being read by another one's fetch
        self.fetches_followed = 0

    # -- start / follow -----------------------------------------------------------------
    def start(self, start_page: int, tokens: list[int], keys: list[str], node: TreeNode,
              host_pages: list[int]) -> FetchOp:
        """Read ``keys`` (pages ``start_page`` on of ``tokens``) into ``host_pages``; ``node``
        (where the prefix ends) is locked by the caller and becomes the fetch's."""
        op = FetchOp(start_page, tokens[: (start_page + len(keys)) * self.page_size], keys, node, host_pages)
        if self.on_start is not None:
            self.on_start(start_page, host_pages)
        if self._workers is None:
            op.job = self.tier.start_read(keys, self.host_pool, host_pages)
        else:  # a tier with only batch_get (tensor parallel: every rank reads its part)
            def run(lo: int, hi: int) -> int:
                return self.tier.batch_get(keys[lo:hi], self.host_pool, host_pages[lo:hi])

            group = 4 * self.tier.fetch_batch_pages(self.host_pool)  # each call is mirrored on every rank
            op.job = ReadJob(len(keys), group, run).submit(self._workers)
        self.active.append(op)
        for i, k in enumerate(keys):
            self._by_key.setdefault(k, (op, i))
        return op

    def follow(self, keys: list[str]) -> tuple[FetchOp, int, int] | None:
        """Hold the active fetch that reads ``keys[0]`` (page keys name their whole prefix, so
        the same key is the same prefix), if any: ``(fetch, index of keys[0] in it, leading keys
        in common)``; the caller releases it like one it started."""
        hit = self._by_key.get(keys[0]) if keys else None
        if hit is None:
            return None
        op, j = hit
        n = 0
        while n < len(keys) and j + n < len(op.keys) and op.keys[j + n] == keys[n]:
            n += 1
        if op.job.done() and op.loaded <= j:
            return None  # it ended before that page: nothing to wait for
        op.users += 1
        self.fetches_followed += 1
        self.pages_deduplicated += n
        return op, j, n

    # -- commits ------------------------------------------------------------------------
    def advance(self, op: FetchOp, min_pages: int = 1, to_l1: bool = True) -> None:
        """Commit what has landed once it is ``min_pages`` pages or the read is over."""
        landed = op.loaded
        if landed - op.committed >= min_pages or (landed > op.committed and op.done):
            self.commit(op, landed, to_l1)
        if op.done and not op.observed:
            self._observe(op)

    def commit(self, op: FetchOp, loaded: int, to_l1: bool = True) -> None:
        """Hand host pages ``[op.committed, loaded)`` to the tree, move the lock to the new end
        and (``to_l1``, room permitting) start loading the chain on to L1."""
        if loaded <= op.committed or op.node.removed:
            return
        tree, ps = self.tree, self.page_size
        upto = (op.start_page + loaded) * ps
        given = op.host_pages[op.committed:loaded]
        dup = tree.insert_host(op.tokens[:upto], given, start_page=op.start_page + op.committed)
        tree.host.free(list(dup))
        promoted = tree.exclusive.take_promoted()  # landed and verified: their L3 copies go
        if promoted and self.on_promote is not None:
            self.on_promote([k for lo, hi in promoted for k in op.keys[lo - op.start_page : hi - op.start_page]])
        dups = set(dup)
        op.new += [p not in dups for p in given]
        fresh, op.committed = loaded - op.committed, loaded
        node, matched = tree.lookup(op.tokens[:upto], needs_state=False)  # (a state model's pages too)
        if matched == upto:
            tree.lock(node)
            tree.unlock(op.node)
            op.node = node
        if to_l1 and tree.device.num_free >= fresh and \
                self._l2_only(node) <= tree.device.num_free and \
                (self.can_load is None or self.can_load()):  # never evict L1 for an early load
            m = tree.match_prefix(op.tokens[:upto])
            loaded_m = tree.load_back(m)  # no eviction: L1 has the room
            if loaded_m is not m and self.on_load is not None:
                self.on_load(m, loaded_m)
            self.transfers.flush()  # backups the match asked for; binds the load's PendingLoad
            if loaded_m is not m:
                self.l1_loads.append((loaded_m.last_device_node, loaded_m.pending_loads[-1]))
                self.pages_loaded_early += m.host_hit_tokens // ps

    @staticmethod
    def _l2_only(node: TreeNode) -> int:
        """Pages on the path to ``node`` that are on L2 only (what a load back would copy)."""
        return sum(len(nd.host_pages) for nd in node.path_to_root()
                   if nd.device_pages is None and nd.host_pages is not None)

    def _observe(self, op: FetchOp) -> None:
        op.observed = True
        if op.job.loaded:
            self.on_read(op.job.loaded * self.tier.codec.value_nbytes, op.job.read_s)

    # -- release ------------------------------------------------------------------------
    def release(self, op: FetchOp) -> None:
        """One request stops holding ``op``; the last one commits what has landed, cancels the
        rest of the read and gives back its lock and pages (pages still being written are
        freed by :meth:`poll` once the job has ended)."""
        op.users -= 1
        if op.users > 0:
            return
        op.job.cancel()
        self.commit(op, op.loaded, to_l1=False)
        if op.done and not op.observed:
            self._observe(op)
        self.active.remove(op)
        for k in op.keys:
            if self._by_key.get(k, (None,))[0] is op:
                del self._by_key[k]
        rest = op.host_pages[op.committed:]
        if not op.done:
            self._unobserved.append(op)
            if rest:
                self.draining.append((op.job, rest))
        elif rest:
            self.tree.host.free(rest)
        self.tree.unlock(op.node)

    def poll(self, wait: bool = False) -> None:
        """Release early L1 loads that have landed; free host pages of released fetches once
        their job has ended."""
        loads = []
        for end, pending in self.l1_loads:
            if wait:
                pending.wait()
            if pending.done():
                self.tree.finish_load(end)
            else:
                loads.append((end, pending))
        self.l1_loads = loads
        keep = []
        for job, pages in self.draining:
            if wait:
                job.result()
            if job.done():
                if pages:
                    self.tree.host.free(pages)
            else:
                keep.append((job, pages))
        self.draining = keep
        for op in [op for op in self._unobserved if wait or op.done]:
            op.job.result()
            self._unobserved.remove(op)
            self._observe(op)

    def held_host_pages(self) -> list[int]:
        """Host pages of fetches and drains that are in no tree node."""
        held = [p for op in self.active for p in op.host_pages[op.committed:]]
        return held + [p for _, pages in self.draining for p in pages]

    def check_integrity(self, holds: dict[int, int]) -> None:
        """``holds``: id(fetch) -> requests holding it. Raises AssertionError unless every active
        fetch is held by exactly its ``users``, has its node locked and ``committed <= loaded``,
        and the host pages held are allocated, none twice."""
        assert set(holds) <= {id(op) for op in self.active}, "prefetch: a request holds a fetch that is not active"
        for op in self.active:
            assert holds.get(id(op), 0) == op.users, (
                f"prefetch: a fetch counts {op.users} users, {holds.get(id(op), 0)} requests hold it")
            assert op.node.parent is None or op.node.lock_ref > 0, (
                f"prefetch: the node of a fetch is not locked ({op.node})")
            assert 0 <= op.committed <= op.loaded <= len(op.host_pages), (
                f"prefetch: committed {op.committed}, loaded {op.loaded} of {len(op.host_pages)} pages")
        held = self.held_host_pages()
        assert len(held) == len(set(held)), "prefetch: a host page is held twice"
        assert all(self.tree.host.is_allocated(p) for p in held), "prefetch: a held host page is free"

    def shutdown(self) -> None:
        for op in list(self.active):
            op.users = 1
            self.release(op)
        self.poll(wait=True)
        if self._workers is not None:
            self._workers.shutdown(wait=True)
