"""Policy replay: a request trace through the real HiRadixTree bookkeeping, no model (CPU).

The tree is driven as the engine drives it (serving/cache/req_cache.py, serving/cache/l3_prefetch.py,
serving/cache/storage_controller.py), in trace order with up to ``concurrency`` requests in flight:

1. L3 prefetch (with an L3): the prompt's pages after its L1/L2 prefix that L3 holds, at least
   ``prefetch_threshold`` tokens, are read into L2 pages (L2 room made with
   ``evict_host(drop_backups=True)``) and committed with ``insert_host``;
2. ``match_prefix`` of the prompt minus its last token, ``load_back`` of an L2 hit, ``lock``;
   write-back retries on the hit path (``on_hit``);
3. L1 pages for the rest (``evict_device`` when short; a request that cannot get them waits for
   the next one in flight to finish, and is rejected, counted, when none is left). As the
   scheduler admits, a request starts only when L1 holds its pages beside those in flight;
4. at its end: ``insert`` of its computed full pages, duplicates freed, ``unlock``.

In flight, a request takes time in proportion to the tokens it computes (plus ``STEP_TOKENS``
for its fixed cost): the next request starts when the first of those in flight ends, as on a
server that runs each request at its own pace. With ``concurrency`` 1 the order is exact.

After every tree call the transfers are drained as the engine does; every L1 -> L2 backup is
written on to L3 at once (what a write-back that keeps up does). With ``write_policy="exclusive"``
no backup is written and no hit retries a write: after each drain the coldest L2 nodes L3 lacks
(``tree.exclusive.dirty_tail()``, as StorageController.poll) are written at once instead, and an L3 hit
promotes (unless ``l3_shared``): the pages the tree gives up the L3 copy of (``tree.exclusive.
take_promoted()``, as serving/cache/l3_fetch.py) are deleted from L3 at once (the engine's key guard
orders a delete and a write of one key; here both are instant and in order). L3 is modelled as an LRU of
page keys (a key chains the page's tokens onto its parent's, as hicache.keys does) with
``l3_tokens`` of room, stamped on write and read like the LMDB store. Tier capacities are in
tokens. Hits per tier are counted as the engine counts them (``Req.kv.cached_by_tier``).
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from hicache.hiradix import HiRadixTree
from hicache.hiradix.node import TreeNode
from hicache.tiers.allocator import PageAllocator

_clock = time.process_time  # CPU time of this (single-threaded) process: other load on the machine does not count
STEP_TOKENS = 256  # a request's fixed cost, in computed-token equivalents (for the order requests end in)


@dataclass(frozen=True)
class PolicyConfig:
    l1_tokens: int
    l2_tokens: int = 0
    l3_tokens: int = 0
    page_size: int = 16
    write_policy: str = "write_through"
    eviction_policy: str = "lru"
    prefetch_threshold: int = 256  # tokens (hicache_storage_prefetch_threshold)
    concurrency: int = 1  # requests in flight (see the module docstring for when each one ends)
    max_new_tokens: int = 1  # output tokens per request (capped by the trace's output_length)
    l3_evict_to: float = 1.0  # a full L3 evicts down to this fraction of l3_tokens (LMDB: low / high watermark)
    l3_shared: bool = False  # the L3 is shared (Mooncake): an exclusive L3 hit keeps its L3 copy (no promotion)
    write_through_threshold: int = 2  # hits that make a node hot (write_through_selective; exclusive: keeps copies)

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

    @property
    def total_tokens(self) -> int:
        return self.l1_tokens + self.l2_tokens + self.l3_tokens


class L3Model:
    """An LRU of page keys holding at most ``capacity`` pages (LMDB's order: last write or read);
    once over it, the least recent keys leave until ``evict_to * capacity`` remain."""

    def __init__(self, capacity_pages: int, evict_to: float = 1.0) -> None:
        self.capacity = capacity_pages
        self.evict_to = evict_to
        self._keys: OrderedDict[int, None] = OrderedDict()
        self.pages_written = 0
        self.pages_read = 0
        self.pages_deleted = 0

    def __len__(self) -> int:
        return len(self._keys)

    def present(self, keys: Sequence[int]) -> int:
        """Leading keys held (a lookup: no stamp)."""
        n = 0
        for k in keys:
            if k not in self._keys:
                break
            n += 1
        return n

    def read(self, keys: Iterable[int]) -> None:
        for k in keys:
            self._keys.move_to_end(k)
            self.pages_read += 1

    def delete(self, keys: Iterable[int]) -> None:
        for k in keys:
            if self._keys.pop(k, False) is None:
                self.pages_deleted += 1

    def write(self, keys: Iterable[int]) -> None:
        d = self._keys
        for k in keys:
            d[k] = None
            d.move_to_end(k)
            self.pages_written += 1
        if len(d) > self.capacity:
            keep = int(self.capacity * self.evict_to)
            while len(d) > keep:
                d.popitem(last=False)


def chain_keys(tokens: Sequence[int], page_size: int, upto: int | None = None, prev: int = 0) -> list[int]:
    """One key per full page of ``tokens`` (the first ``upto`` pages): the page's tokens hashed
    with the key before it (``prev``: the key of the page before ``tokens[0]``, 0 at the start),
    so equal keys mean equal prefixes (hicache.keys.page_keys, with Python's tuple hash in place
    of BLAKE2b for speed)."""
    n = len(tokens) // page_size if upto is None else upto
    out = []
    for i in range(n):
        prev = hash((prev, tuple(tokens[i * page_size : (i + 1) * page_size])))
        out.append(prev)
    return out


@dataclass
class _Running:
    tokens: list[int]  # prompt + output tokens whose KV is computed
    pages: list[int]
    lock: TreeNode


@dataclass
class Counts:
    requests: int = 0
    rejected: int = 0  # the prompt does not fit in L1
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
        self._held = 0  # L1 pages of the requests in flight
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
        self._running: list[tuple[float, int, _Running]] = []  # heap by end time
        self._now = 0.0
        self._seq = 0
        self.model_s = 0.0  # time in the L3 model (keys, LRU), not the tree's bookkeeping
        self.total_s = 0.0

    # -- the request path -------------------------------------------------------------
    def request(self, prompt: list[int], output: Sequence[int] = ()) -> dict[str, int]:
        """Replay one request (its prompt tokens; ``output``: its generated tokens); returns its
        ``cached_by_tier`` (tokens)."""
        t0 = _clock()
        # admission as the scheduler's: a request starts only when L1 can hold it beside the
        # requests in flight (else those would evict each other's prefixes, the cache held nothing)
        need = -(-(len(prompt) + self.cfg.max_new_tokens) // self.cfg.page_size)
        while len(self._running) >= self.cfg.concurrency or (self._running and self._held + need > self._l1_pages):
            self._release_next()
        by_tier = self._admit(prompt, list(output[: self.cfg.max_new_tokens]))
        c = self.counts
        c.requests += 1
        c.prompt_tokens += len(prompt)
        for k, v in by_tier.items():
            c.hit[k] += v
        c.per_request.append(by_tier)
        self.total_s += _clock() - t0
        return by_tier

    def finish(self) -> None:
        """End the requests still in flight and check the tree."""
        t0 = _clock()
        while self._running:
            self._release_next()
        self.total_s += _clock() - t0
        self.tree.check_integrity()

    def _admit(self, prompt: list[int], output: list[int]) -> dict[str, int]:
        tree, ps = self.tree, self.cfg.page_size
        matchable = prompt[: len(prompt) - 1]  # the last token is computed for its logits
        storage_new = self._prefetch(matchable) if self.l3 is not None else 0
        m0 = tree.match_prefix(matchable)
        self._drain()
        m = m0
        loaded = None
        if m0.host_hit_tokens > 0:
            m = tree.load_back(m0)
            self._drain()
            if m is not m0:
                loaded = m.last_device_node
        tree.lock(m.last_device_node)
        if loaded is not None:
            tree.finish_load(loaded)  # the copy is instant here
        if self.l3 is not None and not tree.exclusive.on:
            nd = m.last_device_node
            while nd is not None and nd.parent is not None:  # StorageController.on_hit
                self._write(nd)
                nd = nd.parent
        kv_len = len(m.device_pages) * ps
        storage = min(storage_new * ps, kv_len)
        device = min(m0.device_hit_tokens, kv_len - storage)
        by_tier = {"device": device, "host": kv_len - device - storage, "storage": storage}
        computed = prompt + output[:-1]  # the last output token's KV is never computed
        need = -(-len(computed) // ps) - len(m.device_pages)
        pages = self._alloc(need)
        if pages is None:
            tree.unlock(m.last_device_node)
            self.counts.rejected += 1
            return {"device": 0, "host": 0, "storage": 0}
        end = self._now + len(computed) - kv_len + STEP_TOKENS
        self._seq += 1
        self._held += len(m.device_pages) + len(pages)
        heapq.heappush(self._running, (end, self._seq, _Running(computed, m.device_pages + pages, m.last_device_node)))
        return by_tier

    def _alloc(self, n: int) -> list[int] | None:
        dev = self.device
        while True:
            if dev.num_free < n:
                self.tree.evict_device(n - dev.num_free)
                self._drain()
            if dev.num_free >= n:
                return dev.alloc(n)
            if not self._running:
                return None
            self._release_next()  # wait for the next request in flight to end

    def _release_next(self) -> None:
        end, _, r = heapq.heappop(self._running)
        self._held -= len(r.pages)
        self._now = max(self._now, end)
        self._release(r)

    def _release(self, r: _Running) -> None:
        ps = self.cfg.page_size
        full = len(r.tokens) // ps
        dup = self.tree.insert(r.tokens[: full * ps], r.pages[:full]) if full else []
        self.tree.unlock(r.lock)
        self._drain()
        free = list(dup) + r.pages[full:]
        if free:
            self.device.free(free)

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


def output_tokens(index: int, n: int, vocab_size: int, low: int = 10) -> list[int]:
    """Deterministic stand-in output tokens of request ``index`` (never shared with a prompt)."""
    if n <= 0:
        return []
    return (np.random.default_rng(1_000_003 + index).integers(low, vocab_size, n)).tolist()
