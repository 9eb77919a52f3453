"""Stateful property test of the HiRadixTree against a shadow of the pools' contents.

The shadow maps every L1 and L2 page id to the token prefix whose KV it holds (the KV of
a page depends on the whole prefix, so the shadow value is the prefix up to the end of
that page). Fresh pages get their content when a simulated request writes them; drained
backups are applied to the shadow at once, in order.

The slow copies are separate steps that complete later, with matches (splits), inserts,
evictions and flushes in between:

- L2 -> L1 loads (``load_progress``): the destination pages hold :class:`Garbage` until a
  step lands the load (copying the source pages as they are then) and completes the Future
  bound to its PendingLoad; a later step hands it back with ``finish_load``. Readers
  (requests, held matches) read ``match.device_pages`` only once every
  ``match.pending_loads`` is done; a request whose loads are not done waits for a later step.
- L2 -> L3 write-backs (started for every drained backup, like the controller, or by
  ``start_write_back``; ``write_back_done``): pin the node's unstored L2 pages, complete later
  (all, some or none stored), then ``mark_stored`` by tokens and unpin.
- L3 -> L2 prefetches (``start_prefetch``, ``prefetch_progress``): look up and lock the cached
  prefix, allocate L2 pages, let pages arrive over several steps, then commit the arrived
  ones with ``insert_host``.

Properties (after every step, or where the step happens):
- ``check_integrity`` with the pages the test holds outside the tree;
- every cached page holds the prefix of its position in the tree, or is the destination of
  a load in flight that will bring exactly that prefix;
- every match is the longest cached prefix, and each of its L1 pages has arrived or is
  covered by one of its ``pending_loads`` that is not done; a reader that waits for them
  never reads a page that has not arrived;
- no page is written while something reads it: a load's destination is never handed out
  and its source, like an L2 page pinned by a write-back, never changes before the copy is
  done (what a write-back stores under a page's key is that page's prefix);
- a node's leading ``storage_pages`` pages are all on L3 (a shadow set of stored page keys);
- write-backs never block L1 eviction: when ``evict_device`` frees less than asked, every
  node left on L1 is on the path of something the test holds (a lock, a waiting request, a
  load, a prefetch);
- when ``evict_host`` frees less than asked, every L2-only node left is held or has a page
  pinned by a write-back in its subtree;
- locked paths keep their L1 pages; ``reset`` refuses exactly while the test holds a lock or
  a load is in flight, and pinned pages it drops stay allocated until their write-back ends.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hicache.hiradix import HiRadixTree, MatchResult, UnknownSession
from hicache.hiradix.match import PendingLoad
from hicache.hiradix.node import TreeNode
from hicache.tiers.allocator import PageAllocator

# Sequences share prefixes often: a cut of one of a few stems (which share their first 5 or 11
# tokens), then a random tail.
BASE = [(j * j + j // 4) % 3 for j in range(16)]
STEMS = [BASE, BASE[:5] + [(t + 1) % 3 for t in BASE[5:]], BASE[:11] + [(t + 2) % 3 for t in BASE[11:]]]
tokens_st = st.builds(
    lambda stem, cut, tail: STEMS[stem][:cut] + tail,
    st.integers(0, len(STEMS) - 1),
    st.integers(0, 16),
    st.lists(st.integers(0, 2), max_size=6),
)
SOURCES = st.sampled_from(["new", "history", "in_flight"])  # where a request's tokens come from
SESSIONS = ["a", "b", "c"]
MAX_HELD = 3  # locks, waiting requests, prefetches in flight (each)
MAX_WRITES = 6  # write-backs in flight


@dataclass(frozen=True, eq=False)
class Garbage:
    """Shadow of an L1 page a load has not filled yet; ``want`` is what the load will bring."""

    want: tuple[int, ...]
    pending: PendingLoad


@dataclass(eq=False)
class Load:
    pending: PendingLoad
    future: Future
    src: list[int]
    dst: list[int]
    want: list[tuple[int, ...]]  # the source pages' contents when the load was issued
    end: TreeNode | None = None  # the chain's last node (set by load_back's caller)
    landed: bool = False


@dataclass(eq=False)
class Reader:
    """A request or a held match: reads ``pages`` (the L1 prefix of ``tokens``) under a lock."""

    tokens: list[int]
    node: TreeNode
    pages: list[int]
    pending: tuple[PendingLoad, ...]

    def ready(self) -> bool:
        return all(p.done() for p in self.pending)


@dataclass(eq=False)
class WriteBack:
    tokens: list[int]
    first: int
    pages: list[int]
    want: list[tuple[int, ...]]


@dataclass(eq=False)
class Prefetch:
    tokens: list[int]  # up to the last page allocated
    start: int
    node: TreeNode
    pages: list[int]
    arrived: int = 0
    keys: list[tuple[int, ...]] = field(default_factory=list)


class TreeMachine(RuleBasedStateMachine):
    @initialize(
        ps=st.integers(2, 4),
        dev=st.integers(8, 24),
        host_mult=st.sampled_from([1, 2, 3, 4, 1, 2, 0]),  # 0: no L2 (rarely)
        policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
        eviction=st.sampled_from(["lru", "lfu"]),
        threshold=st.integers(1, 3),
        load_threshold=st.integers(1, 2),
    )
    def setup(self, ps, dev, host_mult, policy, eviction, threshold, load_threshold):
        self.ps = ps
        self.tree = HiRadixTree(
            ps,
            PageAllocator(dev),
            PageAllocator(dev * host_mult) if host_mult else None,
            write_policy=policy,
            write_through_threshold=threshold,
            load_back_threshold=load_threshold,
            eviction_policy=eviction,
            session_timeout=5.0,
        )
        self.dev_shadow: dict[int, tuple[int, ...] | Garbage] = {}
        self.host_shadow: dict[int, tuple[int, ...]] = {}
        self.inserted: set[tuple[int, ...]] = set()
        self.stored: set[tuple[int, ...]] = set()  # page keys (path prefixes) on L3
        self.history: list[list[int]] = []  # token lists inserted so far, to revisit
        self.locks: list[Reader] = []  # held matches
        self.waiting: list[Reader] = []  # requests waiting for their loads
        self.loads: dict[PendingLoad, Load] = {}  # loads the tree started and finish_load has not ended
        self.writes: list[WriteBack] = []
        self.pinned: Counter[int] = Counter()  # L2 page -> write-backs reading it
        self.fetches: list[Prefetch] = []
        self.now = 0.0

    # ------------------------------------------------------------------ shadow writes
    def busy_dev(self) -> set[int]:
        """L1 pages a load in flight will write."""
        return {d for ld in self.loads.values() if not ld.landed for d in ld.dst}

    def busy_host(self) -> set[int]:
        """L2 pages someone reads outside the tree's bookkeeping: write-backs, loads in flight."""
        return set(self.pinned) | {s for ld in self.loads.values() if not ld.landed for s in ld.src}

    def write_dev(self, page: int, value: tuple[int, ...]) -> None:
        assert page not in self.busy_dev(), f"L1 page {page} written while a load in flight fills it"
        self.dev_shadow[page] = value

    def write_host(self, page: int, value: tuple[int, ...]) -> None:
        assert page not in self.busy_host(), f"L2 page {page} overwritten while a write-back or load reads it"
        self.host_shadow[page] = value

    def drain(self) -> None:
        """Execute drained transfers in order: backups at once, loads start (they land in a later
        step); then, like the controller, write the backed-up nodes on to L3."""
        backed_up: list[TreeNode] = []
        for tr in self.tree.take_transfers():
            if tr.kind == "backup":
                for s, d in zip(tr.src_pages, tr.dst_pages, strict=True):
                    v = self.dev_shadow.get(s)
                    assert isinstance(v, tuple), f"backup reads L1 page {s} that holds no KV ({v})"
                    self.write_host(d, v)
                at = 0
                for n in tr.nodes:  # the nodes whose pages these are (unless dropped again since)
                    k = len(n.key) // self.ps
                    assert n.removed or n.host_pages == tr.dst_pages[at : at + k], "backup names other nodes"
                    at += k
                assert at == len(tr.dst_pages), "backup names other nodes"
                backed_up += tr.nodes
                continue
            assert tr.pending is not None and tr.pending not in self.loads and not tr.pending.done()
            fut: Future = Future()
            tr.pending.bind(fut)
            want = []
            for s in tr.src_pages:
                assert s in self.host_shadow, f"load reads L2 page {s} whose content is unknown"
                want.append(self.host_shadow[s])
            assert not set(tr.dst_pages) & self.busy_dev(), "two loads in flight fill the same L1 page"
            for d, w in zip(tr.dst_pages, want, strict=True):
                self.dev_shadow[d] = Garbage(w, tr.pending)
            self.loads[tr.pending] = Load(tr.pending, fut, list(tr.src_pages), list(tr.dst_pages), want)
        for node in backed_up:
            self.write_back(node)

    # ------------------------------------------------------------------ helpers
    def host_in_use(self) -> int:
        return sum(len(f.pages) for f in self.fetches)

    def integrity(self, device_in_use: int = 0, host_in_use: int = 0) -> None:
        self.tree.check_integrity(device_in_use=device_in_use, host_in_use=self.host_in_use() + host_in_use)

    def walk(self):
        """Yield (node, path prefix up to the node's start) for every node, independently of the tree."""
        stack = [(self.tree.root, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                yield child, prefix
                stack.append((child, prefix + tuple(child.key)))

    def snapshot(self) -> dict[tuple[int, ...], tuple[int | None, int | None]]:
        """prefix (page-aligned, tuple) -> (L1 page, L2 page), by an independent tree walk."""
        out = {}
        for child, prefix in self.walk():
            for i in range(len(child.key) // self.ps):
                p = prefix + tuple(child.key[: (i + 1) * self.ps])
                dev = child.device_pages[i] if child.device_pages is not None else None
                host = child.host_pages[i] if child.host_pages is not None else None
                out[p] = (dev, host)
        return out

    def held_nodes(self) -> list[TreeNode]:
        """Nodes whose path the test keeps locked."""
        ends = [r.node for r in self.locks + self.waiting] + [f.node for f in self.fetches]
        ends += [ld.end for ld in self.loads.values()]
        return [n for n in ends if n.parent is not None]

    def check_dev_page(self, page: int, want: tuple[int, ...], pending: tuple[PendingLoad, ...]) -> None:
        """``page`` holds ``want`` or will once one of ``pending`` (not done) lands."""
        v = self.dev_shadow[page]
        if isinstance(v, Garbage):
            assert any(v.pending is p for p in pending), f"L1 page {page} not arrived and no pending load covers it"
            assert not v.pending.done() and v.want == want, f"L1 page {page} is being loaded with other tokens"
        else:
            assert v == want, f"L1 page {page} holds {v}, not {want}"

    def read(self, r: Reader) -> None:
        """A reader computes on its prefix: only once its loads are done, and then every page arrived."""
        assert r.ready()
        for i, p in enumerate(r.pages):
            v = self.dev_shadow[p]
            assert v == tuple(r.tokens[: (i + 1) * self.ps]), f"reader reads L1 page {p} holding {v}"

    def check_match(self, m: MatchResult, tokens: list[int]) -> None:
        ps = self.ps
        assert m.device_hit_tokens == len(m.device_pages) * ps
        assert len({id(p) for p in m.pending_loads}) == len(m.pending_loads), "a pending load reported twice"
        for i, p in enumerate(m.device_pages):
            self.check_dev_page(p, tuple(tokens[: (i + 1) * ps]), m.pending_loads)
        total = m.device_hit_tokens + m.host_hit_tokens
        if total:
            assert tuple(tokens[:total]) in self.inserted, "matched a prefix never inserted"
        # the L2 part, from the chain of nodes between last_device_node and last_host_node
        host_pages = []
        node = m.last_host_node
        while node is not m.last_device_node:
            host_pages = node.host_pages + host_pages
            node = node.parent
        assert len(host_pages) * ps == m.host_hit_tokens
        for i, p in enumerate(host_pages):
            want = tuple(tokens[: m.device_hit_tokens + (i + 1) * ps])
            assert self.host_shadow[p] == want, "L2 page holds other tokens"
        # maximality against the snapshot
        snap = self.snapshot()
        dev_k = k = 0
        while (k + 1) * ps <= len(tokens) and tuple(tokens[: (k + 1) * ps]) in snap:
            k += 1
        while dev_k < k and snap[tuple(tokens[: (dev_k + 1) * ps])][0] is not None:
            dev_k += 1
        assert (m.device_hit_tokens, total) == (dev_k * ps, k * ps), "match is not the longest cached prefix"

    def match(self, tokens: list[int]) -> MatchResult:
        tree, n_before = self.tree, self.tree.num_nodes
        node, matched = tree.lookup(tokens)  # read-only: same length, no split
        assert tree.num_nodes == n_before and not node.removed, "lookup is not read-only"
        m = tree.match_prefix(tokens)
        self.drain()
        self.check_match(m, tokens)
        assert matched == m.cached_tokens, "lookup and match_prefix disagree"
        return m

    def load(self, m: MatchResult, tokens: list[int]) -> MatchResult:
        before = set(self.loads)
        r = self.tree.load_back(m)
        self.drain()
        new = [p for p in self.loads if p not in before]
        if r is m:
            assert not new, "load_back emitted a load but returned the match unchanged"
            return m
        assert len(new) == 1 and r.pending_loads[-1] is new[0], "load_back's result lacks its own load"
        assert r.pending_loads[:-1] == m.pending_loads
        assert r.host_hit_tokens == 0 and r.device_hit_tokens == m.device_hit_tokens + m.host_hit_tokens
        assert r.device_pages[: len(m.device_pages)] == m.device_pages
        self.check_match(r, tokens)  # the loaded pages will hold the right tokens
        self.loads[new[0]].end = r.last_device_node
        assert r.last_device_node.loading and r.last_device_node.load is new[0]
        return r

    def reader(self, tokens: list[int]) -> Reader:
        """Like the scheduler: match, load back the L2 part (no-op unless worth it), lock."""
        m = self.load(self.match(tokens), tokens)
        self.tree.lock(m.last_device_node)
        return Reader(tokens, m.last_device_node, list(m.device_pages), m.pending_loads)

    def run_request(self, r: Reader) -> None:
        """Compute on the prefix (loads done), allocate and write the rest, insert, unlock."""
        tree, ps, tokens = self.tree, self.ps, r.tokens
        self.read(r)
        npages = len(tokens) // ps
        need = npages - len(r.pages)
        if tree.device.num_free < need:
            tree.evict_device(need - tree.device.num_free)
            self.drain()
        if tree.device.num_free >= need:
            new = tree.device.alloc(need)
            for i, p in enumerate(new):
                self.write_dev(p, tuple(tokens[: (len(r.pages) + i + 1) * ps]))
            self.integrity(device_in_use=need)
            dup = tree.insert(tokens, r.pages + new)
            if tree.write_policy.backup_on_insert:  # write_through: the new node's backup, if L2 has room
                self.drain()
            else:
                assert tree.take_transfers() == []
            assert set(dup) <= set(new) and len(set(dup)) == len(dup)
            tree.device.free(dup)
            self.inserted.update(tuple(tokens[: (i + 1) * ps]) for i in range(npages))
            self.history.append(tokens)
            snap = self.snapshot()
            for i in range(npages):
                assert snap[tuple(tokens[: (i + 1) * ps])][0] is not None, "inserted page not on L1"
        tree.unlock(r.node)

    def write_back(self, node: TreeNode) -> None:
        """Like the controller: pin the node's L2 pages not on L3 yet, remember the path's tokens;
        the write completes in a later step."""
        tree, ps = self.tree, self.ps
        npages = len(node.key) // ps
        if len(self.writes) >= MAX_WRITES or node.removed or node.host_pages is None or node.storage_pages >= npages:
            return
        pages = list(node.host_pages[node.storage_pages :])
        tokens = tree.path_tokens(node)
        first = len(tokens) // ps - npages + node.storage_pages
        want = [tuple(tokens[: (first + j + 1) * ps]) for j in range(len(pages))]
        for p, w in zip(pages, want, strict=True):
            assert self.host_shadow[p] == w, "write-back would store other tokens under a page's key"
        tree.pin_host(pages)
        self.pinned.update(pages)
        self.writes.append(WriteBack(tokens, first, pages, want))
        assert tree.host_pinned == len(self.pinned)

    def pick(self, tokens: list[int], source: str, i: int, squeeze: int = 0) -> list[int]:
        """The tokens of a new request: ``tokens``, or (``source``) an earlier sequence or a cut of
        one a reader in flight reads (its loads maybe still running), then a few of ``tokens``.
        First, L1 pressure (``squeeze``: none, half of L1, all of it) demotes what it can."""
        if squeeze:
            self.tree.evict_device(max(1, self.tree.cached_pages("device") * squeeze // 2))
            self.drain()
        seqs = self.history if source == "history" else [r.tokens for r in self.waiting + self.locks]
        if source == "new" or not seqs:
            return tokens
        seq = seqs[i % len(seqs)]
        if source == "in_flight":
            seq = seq[: len(seq) * (i % 4 + 1) // 4]
        return seq + tokens[: i % 5]

    # ------------------------------------------------------------------ completions of operations in flight
    def land(self, ld: Load) -> None:
        """A load's copy finishes: its pages get the sources' contents (as they are now), then its
        Future completes."""
        for s, w in zip(ld.src, ld.want, strict=True):
            assert self.host_shadow[s] == w, f"L2 page {s} changed while a load was reading it"
        for d, w in zip(ld.dst, ld.want, strict=True):
            v = self.dev_shadow[d]
            assert isinstance(v, Garbage) and v.pending is ld.pending, f"L1 page {d} reused during its load"
            self.dev_shadow[d] = w
        ld.landed = True
        ld.future.set_result(None)
        assert ld.pending.done()

    def finish(self, ld: Load) -> None:
        """The owner hands a landed load back to the tree."""
        assert ld.end.loading and ld.end.load is ld.pending and not ld.end.removed
        self.tree.finish_load(ld.end)
        del self.loads[ld.pending]
        assert not ld.end.loading
        with pytest.raises(ValueError):
            self.tree.finish_load(ld.end)

    def complete_write_back(self, w: WriteBack, stored: int) -> None:
        """The store confirms the first ``stored`` pages of a write-back (maybe none): mark, unpin."""
        tree, ps = self.tree, self.ps
        self.writes.remove(w)
        assert 0 <= stored <= len(w.pages)
        for p, want in zip(w.pages, w.want, strict=True):
            assert self.host_shadow[p] == want, f"pinned L2 page {p} changed during its write-back"
            assert tree.host.is_allocated(p), f"pinned L2 page {p} freed during its write-back"
        self.stored.update(w.want[:stored])
        if stored:
            lo, hi = w.first, w.first + stored
            snap, k = self.snapshot(), 0
            while k < hi and tuple(w.tokens[: (k + 1) * ps]) in snap:
                k += 1
            assert tree.mark_stored(w.tokens, lo, hi) == max(0, k - lo)
        tree.unpin_host(w.pages)
        for p in w.pages:
            self.pinned[p] -= 1
            if not self.pinned[p]:
                del self.pinned[p]
        assert tree.host_pinned == len(self.pinned)

    def arrive(self, f: Prefetch, k: int) -> None:
        """The next ``k`` pages of a prefetch arrive from L3 into its L2 pages."""
        upto = min(len(f.pages), f.arrived + k)
        for j in range(f.arrived, upto):
            key = tuple(f.tokens[: (f.start + j + 1) * self.ps])
            self.write_host(f.pages[j], key)
            f.keys.append(key)
        f.arrived = upto

    def commit(self, f: Prefetch) -> None:
        """A prefetch ends: the arrived pages go in with ``insert_host``, duplicates and the pages
        that did not arrive are freed, the prefix is unlocked."""
        tree, ps = self.tree, self.ps
        self.fetches.remove(f)
        assert not f.node.removed, "a prefetch's locked prefix was removed"
        rest = f.pages[f.arrived :]
        dup: list[int] = []
        if f.arrived:
            self.stored.update(f.keys)  # they came from L3
            dup = tree.insert_host(f.tokens[: (f.start + f.arrived) * ps], f.pages[: f.arrived], start_page=f.start)
            assert tree.take_transfers() == []
            assert set(dup) <= set(f.pages[: f.arrived]) and len(set(dup)) == len(dup)
            self.inserted.update(f.keys)
            snap = self.snapshot()
            for key in f.keys:
                assert snap[key][1] is not None, "prefetched page not on L2"
        self.integrity(host_in_use=len(dup) + len(rest))
        tree.host.free(dup + rest)
        tree.unlock(f.node)

    # ------------------------------------------------------------------ rules: requests and readers
    @rule(tokens=tokens_st)
    def do_match(self, tokens):
        self.match(tokens)

    @rule(
        tokens=tokens_st,
        source=SOURCES,
        i=st.integers(0, 100),
        squeeze=st.integers(0, 2),
        use_prefix=st.booleans(),
    )
    def request(self, tokens, source, i, squeeze, use_prefix):
        """A request, maybe coming back to an earlier sequence after L1 pressure: (match,
        load-back, lock); computes now if its loads are done, else waits for them."""
        tokens = self.pick(tokens, source, i, squeeze)
        if use_prefix:
            r = self.reader(tokens)
        else:
            self.tree.lock(self.tree.root)
            r = Reader(tokens, self.tree.root, [], ())
        if r.ready():
            self.run_request(r)
        elif len(self.waiting) < MAX_HELD:
            self.waiting.append(r)
        else:  # abort: give the lock back unread
            self.tree.unlock(r.node)

    @precondition(lambda self: len(self.locks) < MAX_HELD)
    @rule(tokens=tokens_st, source=SOURCES, i=st.integers(0, 100), squeeze=st.integers(0, 2))
    def hold(self, tokens, source, i, squeeze):
        """A match kept locked (a running request or a session's reader)."""
        self.locks.append(self.reader(self.pick(tokens, source, i, squeeze)))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 2), done=st.booleans())
    def read_held(self, i, done):
        """A held match computes on its prefix once its loads are done, maybe finishing (unlock)."""
        r = self.locks[i % len(self.locks)]
        if r.ready():
            self.read(r)
        if done:
            self.locks.remove(r)
            self.tree.unlock(r.node)

    # ------------------------------------------------------------------ rules: operations in flight
    @precondition(lambda self: self.loads or any(r.ready() for r in self.waiting))
    @rule(picks=st.lists(st.integers(0, 100), min_size=1, max_size=3))
    def load_progress(self, picks):
        """Loads in flight and requests waiting for them take their next step (one to three of
        them, like the scheduler's poll): a load lands (or, landed, is finished), a request whose
        loads are done runs."""
        for i in picks:
            events = [("land" if not ld.landed else "finish", ld) for ld in self.loads.values()]
            events += [("run", r) for r in self.waiting if r.ready()]
            if not events:
                return
            what, obj = events[i % len(events)]
            if what == "land":
                self.land(obj)
            elif what == "finish":
                self.finish(obj)
            else:
                self.waiting.remove(obj)
                self.run_request(obj)

    @precondition(lambda self: self.writes)
    @rule(i=st.integers(0, 100), part=st.integers(0, 3))
    def write_back_done(self, i, part):
        """A write-back in flight completes with the first ``part`` thirds of its pages on L3
        (at least one page unless ``part == 0``; the store may fail or fill up)."""
        w = self.writes[i % len(self.writes)]
        self.complete_write_back(w, 0 if part == 0 else max(1, len(w.pages) * part // 3))

    @precondition(lambda self: self.fetches)
    @rule(i=st.integers(0, 100), k=st.integers(0, 3))
    def prefetch_progress(self, i, k):
        """``k`` more pages of a prefetch arrive; with ``k == 0`` or all arrived it is committed."""
        f = self.fetches[i % len(self.fetches)]
        if k and f.arrived < len(f.pages):
            self.arrive(f, k)
        else:
            self.commit(f)

    @precondition(lambda self: self.tree.host is not None and len(self.writes) < MAX_WRITES)
    @rule(i=st.integers(0, 100))
    def start_write_back(self, i):
        """Retry or persist: write back some node with L2 pages not on L3 yet."""
        cands = [n for n in self.tree.nodes() if n.host_pages is not None and n.storage_pages < len(n.key) // self.ps]
        if cands:
            self.write_back(cands[i % len(cands)])

    @precondition(lambda self: self.tree.host is not None and len(self.fetches) < MAX_HELD)
    @rule(tokens=tokens_st, source=SOURCES, i=st.integers(0, 100), after_cached=st.booleans())
    def start_prefetch(self, tokens, source, i, after_cached):
        """Like the prefetcher: read-only lookup of the cached prefix, lock it, make room, allocate;
        the pages arrive in later steps."""
        tree, ps = self.tree, self.ps
        tokens = self.pick(tokens, source, i)
        npages = len(tokens) // ps
        n_before = tree.num_nodes
        start = tree.peek_prefix_len(tokens) // ps if after_cached else 0
        node, matched = tree.lookup(tokens[: start * ps])
        assert matched == start * ps and tree.num_nodes == n_before, "lookup is not read-only"
        tree.lock(node)
        host = tree.host
        n = npages - start
        if host.num_free < n:
            tree.evict_host(n - host.num_free)
        assert tree.take_transfers() == []
        n = min(n, host.num_free)
        if n == 0:
            tree.unlock(node)
            return
        pages = host.alloc(n)
        assert not set(pages) & self.busy_host(), "L2 handed out a page that is still being read"
        self.fetches.append(Prefetch(tokens[: (start + n) * ps], start, node, pages))

    # ------------------------------------------------------------------ rules: eviction, sessions, flush
    @rule(tier=st.sampled_from(["device", "host"]), n=st.integers(1, 24))
    def evict(self, tier, n):
        """Evict ``n`` pages of a tier. When it frees less, everything left is needed: on L1 every
        node is on the path of something the test holds (a write-back never blocks L1 eviction);
        on L2 every L2-only node is held or has a page pinned by a write-back below it."""
        tree = self.tree
        before = tree.cached_pages(tier)
        freed = tree.evict_device(n) if tier == "device" else tree.evict_host(n)
        self.drain()
        assert freed == before - tree.cached_pages(tier)
        if freed >= n or (tier == "host" and tree.host is None):
            return
        held = {nd for h in self.held_nodes() for nd in h.path_to_root()}
        for nd in tree.nodes():
            if tier == "device":
                assert nd.device_pages is None or nd in held, (
                    f"evict_device left {nd!r} on L1 though no reader holds it (a write-back blocks it?)"
                )
            elif nd.device_pages is None and nd not in held:
                sub, stack = [], [nd]
                while stack:
                    x = stack.pop()
                    sub += x.host_pages
                    stack.extend(x.children.values())
                assert any(p in self.pinned for p in sub), f"evict_host left {nd!r} that nothing needs"
        if tier == "device":
            assert tree.evictable_pages("device") == 0, "evict_device stopped with evictable pages left"

    @rule(
        op=st.sampled_from(["open", "attach", "close", "tick"]),
        sid=st.sampled_from(SESSIONS),
        tokens=tokens_st,
    )
    def session(self, op, sid, tokens):
        tree = self.tree
        if op == "open":
            tree.open_session(sid, now=self.now)
        elif op == "attach":
            node = self.match(tokens).last_host_node
            if sid in tree.sessions:
                tree.attach_session(sid, node, now=self.now)
            else:
                with pytest.raises(UnknownSession):
                    tree.attach_session(sid, node, now=self.now)
        elif op == "close":
            if sid in tree.sessions:
                tree.close_session(sid)
            else:
                with pytest.raises(UnknownSession):
                    tree.close_session(sid)
        else:
            self.now += len(tokens) / 4
            for s in tree.expire_sessions(now=self.now):
                assert s not in tree.sessions

    @rule(go=st.integers(0, 7), quiesce=st.booleans())
    def reset(self, go, quiesce):
        """Flush (rarely; a bit less rarely while write-backs are in flight): refused while the
        test holds a lock or a load is in flight; with ``quiesce``, readers are aborted, loads
        land and finish and prefetches commit first. Write-backs in flight keep their pinned
        pages (deferred) until they complete."""
        if go != 3 and not (go in (5, 6) and self.writes):  # hypothesis favours 0 and the bounds
            return
        if quiesce:
            for r in self.locks + self.waiting:
                self.tree.unlock(r.node)
            self.locks, self.waiting = [], []
            for ld in list(self.loads.values()):
                if not ld.landed:
                    self.land(ld)
                self.finish(ld)
            for f in list(self.fetches):
                self.commit(f)
        if self.held_nodes():
            with pytest.raises(RuntimeError):
                self.tree.reset()
            return
        self.tree.reset()
        assert self.tree.num_nodes == 0 and self.tree.cached_pages("device") == 0

    # ------------------------------------------------------------------ invariants
    @invariant()
    def consistent(self):
        tree, ps = self.tree, self.ps
        self.integrity()
        assert tree.take_transfers() == [], "a rule left transfers undrained"
        for node, prefix in self.walk():
            for i in range(len(node.key) // ps):
                key = prefix + tuple(node.key[: (i + 1) * ps])
                assert key in self.inserted, f"tree caches {key} that was never inserted"
                if node.device_pages is not None:
                    loads = (node.load,) if node.load is not None else ()
                    self.check_dev_page(node.device_pages[i], key, loads)
                if node.host_pages is not None:
                    assert self.host_shadow[node.host_pages[i]] == key, "L2 page holds the wrong tokens"
                if i < node.storage_pages:
                    assert key in self.stored, f"{node!r} counts page {i} as on L3, but no write of it finished"
        for r in self.locks + self.waiting:
            assert not r.node.removed, "a locked node was removed"
            got = [p for n in reversed(r.node.path_to_root()) for p in n.device_pages]
            assert got == r.pages, "a locked prefix lost or changed its L1 pages"
        for ld in self.loads.values():
            assert ld.end is not None and not ld.end.removed and ld.end.load is ld.pending
        assert tree.host_pinned == len(self.pinned)


TreeMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,  # deterministic: same examples every run
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_tree_state_machine = TreeMachine.TestCase
