"""The HiRadixTree state machine's world (tests/cache/test_tree_property.py): the tree under test, a
shadow of every L1 and L2 page's contents, and the slow copies in flight (L2 -> L1 loads, L2 -> L3
write-backs, L3 -> L2 prefetches) that the machine's rules start and land, checking as they go
that no page is read before it arrived nor written while something reads it.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field

import pytest

from hicache.hiradix import HiRadixTree, MatchResult
from hicache.hiradix.match import PendingLoad
from hicache.hiradix.node import TreeNode

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


class TreeShadow:
    """The tree under test, a shadow of its pools' contents and the copies in flight (see
    tests/cache/test_tree_property.py's docstring); the state machine's rules drive it. One thread."""

    def __init__(self, tree: HiRadixTree, ps: int) -> None:
        self.ps = ps
        self.tree = tree
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
