"""Policy replay: a request trace through the real HiRadixTree bookkeeping, no model (CPU).

The tree is driven as the engine drives it (serving/cache/req_cache.py, serving/cache/l3_prefetch.py,
serving/cache/storage_controller.py), each forward pass as the scheduler plans it
(bench/trace_sched.py: chunked prefill, the ``lpm`` / ``fcfs`` admission order, retraction, a
closed loop of ``concurrency`` clients). A request's admission (:meth:`PolicyReplay.admit`):

1. L3 prefetch (with an L3): the prompt's pages after its L1/L2 prefix that L3 holds, at least
   ``prefetch_threshold`` tokens, are read into L2 pages (L2 room made with
   ``evict_host(drop_backups=True)``) and committed with ``insert_host``;
2. ``match_prefix`` of the prompt minus its last token, ``load_back`` of an L2 hit, ``lock``;
   write-back retries on the hit path (``on_hit``);
3. L1 pages for its first chunk (``evict_device`` when short; none: it is not admitted in this pass),
   then for each later chunk and decode token;
4. at its end: ``insert`` of its computed full pages, duplicates freed, ``unlock``.

After every tree call the transfers are drained as the engine does; every L1 -> L2 backup is
written on to L3 at once (what a write-back that keeps up does). With ``write_policy="exclusive"``
no backup is written and no hit retries a write: after each drain the coldest L2 nodes L3 lacks
(``tree.exclusive.dirty_tail()``, as StorageController.poll) are written at once instead, and an L3 hit
promotes (unless ``l3_shared``): the pages the tree gives up the L3 copy of (``tree.exclusive.
take_promoted()``, as serving/cache/l3_fetch.py) are deleted from L3 at once (the engine's key guard
orders a delete and a write of one key; here both are instant and in order). L3 is modelled as an LRU of
page keys (a key chains the page's tokens onto its parent's, as hicache.keys does) with
``l3_tokens`` of room, stamped on write and read like the LMDB store. Tier capacities are in
tokens. Hits per tier are counted as the engine counts them (``Req.kv.cached_by_tier``, at a
request's first admission).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bench.trace_l3model import L3Model, chain_keys
from hicache.hiradix import HiRadixTree
from hicache.hiradix.match import MatchResult
from hicache.hiradix.node import TreeNode
from hicache.tiers.allocator import PageAllocator
from serving.cache.admission import lpm_key
from serving.scheduler.schedule_policy import SCHEDULE_POLICIES

if TYPE_CHECKING:
    from bench.trace_sched import PassLoop

_clock = time.process_time  # CPU time of this (single-threaded) process: other load on the machine does not count


@dataclass(frozen=True)
class PolicyConfig:
    l1_tokens: int
    l2_tokens: int = 0
    l3_tokens: int = 0
    page_size: int = 16
    write_policy: str = "write_through"
    eviction_policy: str = "lru"
    prefetch_threshold: int = 256  # tokens (hicache_storage_prefetch_threshold)
    concurrency: int = 1  # clients of the closed loop: requests in the server (waiting or running)
    max_new_tokens: int = 1  # output tokens per request (capped by the trace's output_length)
    l3_evict_to: float = 1.0  # a full L3 evicts down to this fraction of l3_tokens (LMDB: low / high watermark)
    l3_shared: bool = False  # the L3 is shared (Mooncake): an exclusive L3 hit keeps its L3 copy (no promotion)
    write_through_threshold: int = 2  # hits that make a node hot (write_through_selective; exclusive: keeps copies)
    # the scheduler's (serving.config.SchedulerConfig): prompt tokens per pass (-1: no limit), admission order
    chunked_prefill_size: int = 2048
    schedule_policy: str = "lpm"
    max_running_requests: int = 64
    overlap_schedule: bool = False  # CUDA's default: a pass's results are resolved after the next one is planned

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.l1_tokens < self.page_size:
            raise ValueError(f"l1_tokens ({self.l1_tokens}) must hold at least one page of {self.page_size}")
        if self.l2_tokens < 0 or self.l3_tokens < 0:
            raise ValueError("l2_tokens and l3_tokens must be >= 0")
        if self.l3_tokens and not self.l2_tokens:
            raise ValueError("an L3 needs an L2 (pages reach L3 through L2)")
        if self.concurrency < 1 or self.max_new_tokens < 1 or self.prefetch_threshold < 0:
            raise ValueError("concurrency and max_new_tokens must be >= 1, prefetch_threshold >= 0")
        if not 0 < self.l3_evict_to <= 1:
            raise ValueError(f"l3_evict_to must be in (0, 1], got {self.l3_evict_to}")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1 or self.max_running_requests < 1:
            raise ValueError("chunked_prefill_size must be positive or -1, max_running_requests >= 1")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy {self.schedule_policy!r}: choose one of {sorted(SCHEDULE_POLICIES)}")

    @property
    def total_tokens(self) -> int:
        return self.l1_tokens + self.l2_tokens + self.l3_tokens


@dataclass(eq=False)
class SimReq:
    """One request of the replay, as the scheduler sees it (``Req`` and its ``ReqKV``)."""

    index: int  # its place in the slice
    prompt: list[int]
    output: list[int]  # the tokens it generates (at least one)
    filled: int = 0  # tokens whose KV is computed (or cached) in ``pages``
    pages: list[int] = field(default_factory=list)
    prefix_pages: int = 0  # the leading pages that are the tree's (its matched prefix)
    lock: TreeNode | None = None
    out_done: int = 0  # output tokens generated
    storage_pages: int = 0  # pages its L3 prefetches added to the tree
    by_tier: dict[str, int] | None = None  # cached_by_tier at its first admission

    @property
    def prefilling(self) -> bool:
        return self.filled < len(self.prompt)


@dataclass
class Counts:
    requests: int = 0
    rejected: int = 0  # the prompt does not fit in L1
    retractions: int = 0
    passes: int = 0
    prompt_tokens: int = 0
    hit: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "storage": 0})
    per_request: list[dict[str, int]] = field(default_factory=list)  # cached_by_tier of each request

    @property
    def hit_tokens(self) -> int:
        return sum(self.hit.values())


class PolicyReplay:
    """See the module docstring. Feed requests with :meth:`request`, then :meth:`finish`."""

    def __init__(self, cfg: PolicyConfig) -> None:
        self.cfg = cfg
        ps = cfg.page_size
        self.device = PageAllocator(cfg.l1_tokens // ps)
        self._l1_pages = cfg.l1_tokens // ps
        self.holders = 0  # requests holding L1 pages (admitted, not yet released)
        self.host = PageAllocator(cfg.l2_tokens // ps) if cfg.l2_tokens >= ps else None
        self.tree = HiRadixTree(ps, self.device, self.host, write_policy=cfg.write_policy,
                                write_through_threshold=cfg.write_through_threshold,
                                eviction_policy=cfg.eviction_policy)
        with_l3 = cfg.l3_tokens >= ps and self.host is not None
        self.l3 = L3Model(cfg.l3_tokens // ps, cfg.l3_evict_to) if with_l3 else None
        if self.l3 is not None:
            self.tree.exclusive.enable_demotion()  # StorageController does so (a no-op unless exclusive)
            self.tree.exclusive.enable_promotion(not cfg.l3_shared)  # ... and for a private store this
        self.counts = Counts()
        self.model_s = 0.0  # time in the L3 model (keys, LRU), not the tree's bookkeeping
        self.total_s = 0.0

    # -- the request path (bench/trace_sched.py's PassLoop calls these as the scheduler calls ReqCache) --
    def run(self, reqs: Iterable[tuple[Sequence[int], Sequence[int]]],
            after_pass: Callable[[PassLoop, int], None] | None = None) -> None:
        """Replay ``(prompt, output)`` pairs through the server's pass loop (bench/trace_sched.py),
        then end: every request's ``cached_by_tier`` is in ``counts.per_request`` (slice order).
        ``after_pass(loop, prompt tokens computed)``: called after each pass."""
        self._loop(reqs, after_pass)
        self.finish()

    def request(self, prompt: list[int], output: Sequence[int] = ()) -> dict[str, int]:
        """Replay one request alone (``concurrency`` 1: the next one starts once it has ended); returns
        its ``cached_by_tier`` (tokens). Call :meth:`finish` after the last."""
        if self.cfg.concurrency != 1:
            raise ValueError("request() replays one at a time; use run() for concurrency > 1")
        self._loop([(prompt, list(output[: self.cfg.max_new_tokens]))], None)
        return self.counts.per_request[-1]

    def _loop(self, reqs: Iterable[tuple[Sequence[int], Sequence[int]]],
              after_pass: Callable[[PassLoop, int], None] | None) -> None:
        from bench.trace_sched import PassLoop

        t0 = _clock()
        loop = PassLoop(self, after_pass)
        done = loop.run(reqs)
        self.counts.passes += loop.passes
        self.counts.per_request.extend(r.by_tier or {"device": 0, "host": 0, "storage": 0} for r in done)
        self.total_s += _clock() - t0

    def finish(self) -> None:
        """Check the tree (every request has ended)."""
        self.tree.check_integrity()

    def _matchable(self, r: SimReq) -> list[int]:
        return r.prompt[: len(r.prompt) - 1]  # the last token is computed for its logits

    def admission_key(self, r: SimReq) -> int:
        """``ReqCache.admission_key``: the ``lpm`` order's key."""
        return lpm_key(self.tree, self._matchable(r))

    def uncached_len(self, r: SimReq) -> int:
        """``ReqCache.uncached_len``: prompt tokens past its prefix cached on L1 or L2."""
        return len(r.prompt) - self.tree.peek_prefix_len(self._matchable(r))

    def admit(self, r: SimReq, budget: int) -> int | None:
        """``ReqCache.try_admit``: prefetch from L3, match, load back, lock, reserve a first chunk of at
        most ``budget`` tokens; returns its length, or None (no room: nothing kept but what the
        prefetch and load-back put in the tree)."""
        tree, ps = self.tree, self.cfg.page_size
        matchable = self._matchable(r)
        if self.l3 is not None:
            r.storage_pages += self._prefetch(matchable)
        m0 = tree.match_prefix(matchable)
        self._drain()
        m = m0
        loaded = None
        if m0.host_hit_tokens > 0:
            m = tree.load_back(m0)
            self._drain()
            if m is not m0:
                loaded = m.last_device_node
            elif r.by_tier is None and self._wait_for_l1(m0):
                return None  # ReqCache._wait_for_l1: it waits for L1 room rather than recompute its L2 hit
        tree.lock(m.last_device_node)
        if loaded is not None:
            tree.finish_load(loaded)  # the copy is instant here
        if self.l3 is not None and not tree.exclusive.on:
            nd = m.last_device_node
            while nd is not None and nd.parent is not None:  # StorageController.on_hit
                self._write(nd)
                nd = nd.parent
        r.lock, r.pages = m.last_device_node, list(m.device_pages)
        r.filled = len(r.pages) * ps
        n = min(len(r.prompt) - r.filled, budget)
        if not self.reserve(r, r.filled + n):
            tree.unlock(r.lock)
            r.lock, r.pages, r.filled = None, [], 0
            return None
        if r.by_tier is None:  # its first admission: what the engine reports for it
            storage = min(r.storage_pages * ps, r.filled)
            device = min(m0.device_hit_tokens, r.filled - storage)
            r.by_tier = {"device": device, "host": r.filled - device - storage, "storage": storage}
            c = self.counts
            c.requests += 1
            c.prompt_tokens += len(r.prompt)
            for k, v in r.by_tier.items():
                c.hit[k] += v
        r.prefix_pages = len(m.device_pages)
        self.holders += 1
        return n

    def _wait_for_l1(self, m: MatchResult) -> bool:
        """An L2 hit whose load found no L1 room waits while other requests hold L1 (the engine waits
        up to ``ReqCache.L1_WAIT_S``; here until the requests in flight have ended)."""
        pages = m.host_hit_tokens // self.cfg.page_size
        return pages >= max(1, self.tree.load_back_threshold) and self.holders > 0 and \
            pages + len(m.device_pages) <= self._l1_pages

    def reserve(self, r: SimReq, upto: int) -> bool:
        """``ReqCache.reserve``: ``r.pages`` cover positions ``< upto`` (L1 eviction when short);
        False, nothing taken, when L1 cannot make the room."""
        need = -(-upto // self.cfg.page_size) - len(r.pages)
        if need <= 0:
            return True
        dev = self.device
        if dev.num_free < need:
            self.tree.evict_device(need - dev.num_free)
            self._drain()
        if dev.num_free < need:
            return False
        r.pages.extend(dev.alloc(need))
        return True

    def release(self, r: SimReq) -> None:
        """``ReqCache.release``: its computed full pages go into the tree, the rest are freed; it
        keeps its tokens (a retracted request starts again from its prompt)."""
        ps = self.cfg.page_size
        full = r.filled // ps
        tokens = (r.prompt + r.output)[: full * ps]
        dup = self.tree.insert(tokens, r.pages[:full]) if full else []
        if r.lock is not None:
            self.tree.unlock(r.lock)
        self._drain()
        free = list(dup) + r.pages[full:]
        if free:
            self.device.free(free)
        self.holders -= 1
        r.lock, r.pages, r.filled, r.out_done, r.prefix_pages = None, [], 0, 0, 0

    def reject(self, r: SimReq) -> None:
        """A request that cannot run (its prompt needs more pages than L1 has): given up, counted."""
        if r.lock is not None:
            self.tree.unlock(r.lock)
            self.holders -= 1
        if r.pages:
            self.device.free(r.pages)
        r.lock, r.pages, r.filled, r.by_tier = None, [], 0, None
        self.counts.rejected += 1

    # -- L3 -----------------------------------------------------------------------------
    def _prefetch(self, prompt: list[int]) -> int:
        """Prefetcher._start_lookup / _start_fetch / finish with an instant fetch; returns the
        pages it added to the tree."""
        tree, ps = self.tree, self.cfg.page_size
        full = len(prompt) // ps
        cached = tree.peek_prefix_len(prompt) // ps
        if (full - cached) * ps < max(1, self.cfg.prefetch_threshold):
            return 0
        t0 = _clock()
        keys = chain_keys(prompt, ps, full)[cached:]
        n = self.l3.present(keys)
        self.model_s += _clock() - t0
        node, matched = tree.lookup(prompt[: cached * ps])
        if n * ps < max(1, self.cfg.prefetch_threshold) or matched < cached * ps:
            return 0
        tree.lock(node)
        host = self.host
        if host.num_free < n:
            tree.evict_host(n - host.num_free, drop_backups=True)
        n = min(n, host.num_free)
        if n * ps < max(1, self.cfg.prefetch_threshold):
            tree.unlock(node)
            return 0
        pages = host.alloc(n)
        t0 = _clock()
        self.l3.read(keys[:n])
        self.model_s += _clock() - t0
        dup = tree.insert_host(prompt[: (cached + n) * ps], pages, start_page=cached)
        if dup:
            host.free(list(dup))
        promoted = tree.exclusive.take_promoted()  # Fetches.commit -> Promotions.delete, done at once
        if promoted:
            t0 = _clock()
            self.l3.delete(k for lo, hi in promoted for k in keys[lo - cached : hi - cached])
            self.model_s += _clock() - t0
        tree.unlock(node)
        return n - len(dup)

    def _drain(self) -> None:
        """The engine's flush: run the transfers (nothing to copy here), then write every node
        that got an L2 copy on to L3."""
        transfers = self.tree.take_transfers()
        if self.l3 is None:
            return
        if self.tree.exclusive.on:  # StorageController.clean: the coldest L2 pages L3 lacks
            for nd in self.tree.exclusive.dirty_tail():
                self._write(nd)
            return
        for t in transfers:
            if t.kind == "backup":
                for nd in t.nodes:
                    self._write(nd)

    def _write(self, node: TreeNode) -> None:
        """WriteBack.write done at once: the node's L2 pages not marked stored go to L3."""
        ps = self.cfg.page_size
        npages = len(node.key) // ps
        done = node.storage_pages
        if node.removed or node.host_pages is None or done >= npages:
            return
        t0 = _clock()
        tokens = self.tree.path_tokens(node)
        end = len(tokens) // ps
        first = end - npages + done
        self.l3.write(chain_keys(tokens, ps, end)[first:])
        self.model_s += _clock() - t0
        self.tree.mark_stored(tokens, first, end)

    # -- results --------------------------------------------------------------------------
    def summary(self) -> dict[str, float]:
        c = self.counts
        n = max(1, c.requests)
        out: dict[str, float] = {
            "requests": c.requests, "rejected": c.rejected, "prompt_tokens": c.prompt_tokens,
            "hit_tokens_device": c.hit["device"], "hit_tokens_host": c.hit["host"],
            "hit_tokens_storage": c.hit["storage"], "hit_rate": c.hit_tokens / max(1, c.prompt_tokens),
            "bookkeeping_us_per_request": (self.total_s - self.model_s) / n * 1e6,
            "bookkeeping_us_per_1k_tokens": (self.total_s - self.model_s) / max(1, c.prompt_tokens) * 1e9,
            "l3_model_us_per_request": self.model_s / n * 1e6,
            "tree_nodes": self.tree.num_nodes, "l1_pages": self.tree.cached_pages("device"),
            "l2_pages": self.tree.cached_pages("host") if self.host is not None else 0,
            "l3_pages": len(self.l3) if self.l3 is not None else 0,
            "l3_pages_written": self.l3.pages_written if self.l3 is not None else 0,
            "l2_backups_skipped_pages": self.tree.backups_skipped_pages,
            "l2_demotions_dropped_pages": self.tree.exclusive.demotions_dropped_pages,
            "l3_pages_promoted": self.tree.exclusive.l3_promoted_pages,
            "l3_pages_deleted": self.l3.pages_deleted if self.l3 is not None else 0,
        }
        return out


def distinct_tokens(rep: PolicyReplay) -> int:
    """Tokens held on at least one tier now: pages of the tree (L1 and/or L2) and L3's pages,
    each distinct prefix page counted once (the tiers are inclusive: copies count once)."""
    ps = rep.cfg.page_size
    keys: set[int] = set()
    stack = [(c, 0) for c in rep.tree.root.children.values()]
    while stack:
        nd, prev = stack.pop()
        ks = chain_keys(nd.key, ps, prev=prev)
        keys.update(ks)
        stack.extend((c, ks[-1]) for c in nd.children.values())
    if rep.l3 is not None:
        keys.update(rep.l3._keys)
    return len(keys) * ps
