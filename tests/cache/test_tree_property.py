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

The world the rules act on (the tree, the shadow, the copies in flight and their checks) is
harness/tree_shadow.py; the rules, the invariants and the settings are here.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from harness.tree_shadow import MAX_WRITES, Prefetch, Reader, TreeShadow
from hicache.hiradix import HiRadixTree, UnknownSession
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
        tree = HiRadixTree(
            ps,
            PageAllocator(dev),
            PageAllocator(dev * host_mult) if host_mult else None,
            write_policy=policy,
            write_through_threshold=threshold,
            load_back_threshold=load_threshold,
            eviction_policy=eviction,
        )
        self.w = TreeShadow(tree, ps)  # the pools' shadow and the copies in flight (harness/tree_shadow.py)
        self.holds = []  # nodes waiting requests hold (tree.hold), removed ones included

    # ------------------------------------------------------------------ rules: requests and readers
    @rule(tokens=tokens_st)
    def do_match(self, tokens):
        self.w.match(tokens)

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
        tokens = self.w.pick(tokens, source, i, squeeze)
        if use_prefix:
            r = self.w.reader(tokens)
        else:
            self.w.tree.lock(self.w.tree.root)
            r = Reader(tokens, self.w.tree.root, [], ())
        if r.ready():
            self.w.run_request(r)
        elif len(self.w.waiting) < MAX_HELD:
            self.w.waiting.append(r)
        else:  # abort: give the lock back unread
            self.w.tree.unlock(r.node)

    @precondition(lambda self: len(self.w.locks) < MAX_HELD)
    @rule(tokens=tokens_st, source=SOURCES, i=st.integers(0, 100), squeeze=st.integers(0, 2))
    def hold(self, tokens, source, i, squeeze):
        """A match kept locked (a running request or a session's reader)."""
        self.w.locks.append(self.w.reader(self.w.pick(tokens, source, i, squeeze)))

    @precondition(lambda self: self.w.locks)
    @rule(i=st.integers(0, 2), done=st.booleans())
    def read_held(self, i, done):
        """A held match computes on its prefix once its loads are done, maybe finishing (unlock)."""
        r = self.w.locks[i % len(self.w.locks)]
        if r.ready():
            self.w.read(r)
        if done:
            self.w.locks.remove(r)
            self.w.tree.unlock(r.node)

    # ------------------------------------------------------------------ rules: operations in flight
    @precondition(lambda self: self.w.loads or any(r.ready() for r in self.w.waiting))
    @rule(picks=st.lists(st.integers(0, 100), min_size=1, max_size=3))
    def load_progress(self, picks):
        """Loads in flight and requests waiting for them take their next step (one to three of
        them, like the scheduler's poll): a load lands (or, landed, is finished), a request whose
        loads are done runs."""
        for i in picks:
            events = [("land" if not ld.landed else "finish", ld) for ld in self.w.loads.values()]
            events += [("run", r) for r in self.w.waiting if r.ready()]
            if not events:
                return
            what, obj = events[i % len(events)]
            if what == "land":
                self.w.land(obj)
            elif what == "finish":
                self.w.finish(obj)
            else:
                self.w.waiting.remove(obj)
                self.w.run_request(obj)

    @precondition(lambda self: self.w.writes)
    @rule(i=st.integers(0, 100), part=st.integers(0, 3))
    def write_back_done(self, i, part):
        """A write-back in flight completes with the first ``part`` thirds of its pages on L3
        (at least one page unless ``part == 0``; the store may fail or fill up)."""
        w = self.w.writes[i % len(self.w.writes)]
        self.w.complete_write_back(w, 0 if part == 0 else max(1, len(w.pages) * part // 3))

    @precondition(lambda self: self.w.fetches)
    @rule(i=st.integers(0, 100), k=st.integers(0, 3))
    def prefetch_progress(self, i, k):
        """``k`` more pages of a prefetch arrive; with ``k == 0`` or all arrived it is committed."""
        f = self.w.fetches[i % len(self.w.fetches)]
        if k and f.arrived < len(f.pages):
            self.w.arrive(f, k)
        else:
            self.w.commit(f)

    @precondition(lambda self: self.w.tree.host is not None and len(self.w.writes) < MAX_WRITES)
    @rule(i=st.integers(0, 100))
    def start_write_back(self, i):
        """Retry or persist: write back some node with L2 pages not on L3 yet."""
        cands = [n for n in self.w.tree.nodes()
                 if n.host_pages is not None and n.storage_pages < len(n.key) // self.w.ps]
        if cands:
            self.w.write_back(cands[i % len(cands)])

    @precondition(lambda self: self.w.tree.host is not None and len(self.w.fetches) < MAX_HELD)
    @rule(tokens=tokens_st, source=SOURCES, i=st.integers(0, 100), after_cached=st.booleans())
    def start_prefetch(self, tokens, source, i, after_cached):
        """Like the prefetcher: read-only lookup of the cached prefix, lock it, make room, allocate;
        the pages arrive in later steps."""
        tree, ps = self.w.tree, self.w.ps
        tokens = self.w.pick(tokens, source, i)
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
        assert not set(pages) & self.w.busy_host(), "L2 handed out a page that is still being read"
        self.w.fetches.append(Prefetch(tokens[: (start + n) * ps], start, node, pages))

    # ------------------------------------------------------------------ rules: eviction, sessions, flush
    @rule(tokens=tokens_st, release=st.booleans())
    def wait_hold(self, tokens, release):
        """A waiting request holds its cached prefix (``tree.hold``), or one releases its hold (on a node
        removed meanwhile too)."""
        tree = self.w.tree
        if release and self.holds:
            tree.hold(self.holds.pop(0), -1)
            return
        node, _ = tree.lookup(tokens)
        if node is not tree.root and len(self.holds) < MAX_HELD:
            tree.hold(node)
            self.holds.append(node)

    @rule(tier=st.sampled_from(["device", "host"]), n=st.integers(1, 24), spare=st.booleans())
    def evict(self, tier, n, spare):
        """Evict ``n`` pages of a tier. When it frees less, everything left is needed: on L1 every
        node is on the path of something the test holds (a write-back never blocks L1 eviction);
        on L2 every L2-only node is held, or with ``spare`` held by a waiting request, or has a page
        pinned by a write-back below it."""
        tree = self.w.tree
        before = tree.cached_pages(tier)
        freed = tree.evict_device(n) if tier == "device" else tree.evict_host(n, spare_held=spare)
        self.w.drain()
        assert freed == before - tree.cached_pages(tier)
        if freed >= n or (tier == "host" and tree.host is None):
            return
        held = {nd for h in self.w.held_nodes() for nd in h.path_to_root()}
        for nd in tree.nodes():
            if tier == "device":
                assert nd.device_pages is None or nd in held, (
                    f"evict_device left {nd!r} on L1 though no reader holds it (a write-back blocks it?)"
                )
            elif nd.device_pages is None and nd not in held and not (spare and nd.wait_ref):
                sub, stack = [], [nd]
                while stack:
                    x = stack.pop()
                    sub += x.host_pages
                    stack.extend(x.children.values())
                assert any(p in self.w.pinned for p in sub), f"evict_host left {nd!r} that nothing needs"
        if tier == "device":
            assert tree.evictable_pages("device") == 0, "evict_device stopped with evictable pages left"

    @rule(
        op=st.sampled_from(["open", "attach", "close", "sweep"]),
        sid=st.sampled_from(SESSIONS),
        tokens=tokens_st,
    )
    def session(self, op, sid, tokens):
        tree = self.w.tree
        if op == "open":
            tree.open_session(sid)
        elif op == "attach":
            node = self.w.match(tokens).last_host_node
            if sid in tree.sessions:
                tree.attach_session(sid, node)
            else:
                with pytest.raises(UnknownSession):
                    tree.attach_session(sid, node)
        elif op == "close":
            if sid in tree.sessions:
                tree.close_session(sid)
            else:
                with pytest.raises(UnknownSession):
                    tree.close_session(sid)
        else:  # the engine loop's sweep closes idle sessions (serving/cache/kv_sessions.py): all here
            self.w.now += len(tokens) / 4
            for s in SESSIONS:
                if s in tree.sessions:
                    tree.close_session(s)
            assert len(tree.sessions) == 0

    @rule(go=st.integers(0, 7), quiesce=st.booleans())
    def reset(self, go, quiesce):
        """Flush (rarely; a bit less rarely while write-backs are in flight): refused while the
        test holds a lock or a load is in flight; with ``quiesce``, readers are aborted, loads
        land and finish and prefetches commit first. Write-backs in flight keep their pinned
        pages (deferred) until they complete."""
        if go != 3 and not (go in (5, 6) and self.w.writes):  # hypothesis favours 0 and the bounds
            return
        if quiesce:
            for r in self.w.locks + self.w.waiting:
                self.w.tree.unlock(r.node)
            self.w.locks, self.w.waiting = [], []
            for ld in list(self.w.loads.values()):
                if not ld.landed:
                    self.w.land(ld)
                self.w.finish(ld)
            for f in list(self.w.fetches):
                self.w.commit(f)
        if self.w.held_nodes():
            with pytest.raises(RuntimeError):
                self.w.tree.reset()
            return
        self.w.tree.reset()
        assert self.w.tree.num_nodes == 0 and self.w.tree.cached_pages("device") == 0

    # ------------------------------------------------------------------ invariants
    @invariant()
    def consistent(self):
        tree, ps = self.w.tree, self.w.ps
        self.w.integrity()
        assert tree.take_transfers() == [], "a rule left transfers undrained"
        for node, prefix in self.w.walk():
            for i in range(len(node.key) // ps):
                key = prefix + tuple(node.key[: (i + 1) * ps])
                assert key in self.w.inserted, f"tree caches {key} that was never inserted"
                if node.device_pages is not None:
                    loads = (node.load,) if node.load is not None else ()
                    self.w.check_dev_page(node.device_pages[i], key, loads)
                if node.host_pages is not None:
                    assert self.w.host_shadow[node.host_pages[i]] == key, "L2 page holds the wrong tokens"
                if i < node.storage_pages:
                    assert key in self.w.stored, f"{node!r} counts page {i} as on L3, but no write of it finished"
        for r in self.w.locks + self.w.waiting:
            assert not r.node.removed, "a locked node was removed"
            got = [p for n in reversed(r.node.path_to_root()) for p in n.device_pages]
            assert got == r.pages, "a locked prefix lost or changed its L1 pages"
        for ld in self.w.loads.values():
            assert ld.end is not None and not ld.end.removed and ld.end.load is ld.pending
        assert tree.host_pinned == len(self.w.pinned)
        for nd in tree.nodes():  # each hold counts on its node's path as it is now (splits, removals)
            want = sum(nd in h.path_to_root() for h in self.holds)
            assert nd.wait_ref == want, f"{nd!r}: wait_ref {nd.wait_ref}, {want} holds on its path"


TreeMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,  # deterministic: same examples every run
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_tree_state_machine = TreeMachine.TestCase
