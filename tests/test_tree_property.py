"""Stateful property test of the HiRadixTree against a shadow of the pools' contents.

The shadow maps every L1 and L2 page id to the token prefix whose KV it holds (the KV of
a page depends on the whole prefix, so the shadow value is the prefix up to the end of
that page). Fresh pages get their content when a simulated request writes them; drained
Transfers are applied to the shadow in order. After every step: ``check_integrity``,
every cached page holds the prefix of its position in the tree, locked paths still hold
their pages, and matches agree with a reference walk over a snapshot of the tree.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hicache.hiradix import HiRadixTree, MatchResult, UnknownSession
from hicache.tiers.allocator import PageAllocator

# Sequences share prefixes often: a cut of one of a few stems, then a random tail.
STEMS = [[(i * 7 + j * j) % 3 for j in range(16)] for i in range(3)]
tokens_st = st.builds(
    lambda stem, cut, tail: STEMS[stem][:cut] + tail,
    st.integers(0, len(STEMS) - 1),
    st.integers(0, 16),
    st.lists(st.integers(0, 2), max_size=6),
)
SESSIONS = ["a", "b", "c"]


class TreeMachine(RuleBasedStateMachine):
    @initialize(
        ps=st.integers(2, 4),
        dev=st.integers(8, 24),
        host_mult=st.sampled_from([0, 2, 3, 4]),
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
        self.dev_shadow: dict[int, tuple[int, ...]] = {}
        self.host_shadow: dict[int, tuple[int, ...]] = {}
        self.inserted: set[tuple[int, ...]] = set()
        self.history: list[list[int]] = []  # token lists inserted so far, to revisit
        self.locks: list[tuple] = []  # (node, device pages of its prefix)
        self.loads: list = []  # end nodes of loads in flight
        self.now = 0.0

    # ------------------------------------------------------------------ helpers
    def drain(self) -> None:
        for tr in self.tree.take_transfers():
            src, dst = (
                (self.dev_shadow, self.host_shadow)
                if tr.kind == "backup"
                else (self.host_shadow, self.dev_shadow)
            )
            for s, d in zip(tr.src_pages, tr.dst_pages, strict=True):
                assert s in src, f"{tr.kind} reads page {s} whose content is unknown"
                dst[d] = src[s]

    def snapshot(self) -> dict[tuple[int, ...], tuple[int | None, int | None]]:
        """prefix (page-aligned, tuple) -> (L1 page, L2 page), by an independent tree walk."""
        out = {}
        stack = [(self.tree.root, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                for i in range(len(child.key) // self.ps):
                    p = prefix + tuple(child.key[: (i + 1) * self.ps])
                    dev = child.device_pages[i] if child.device_pages is not None else None
                    host = child.host_pages[i] if child.host_pages is not None else None
                    out[p] = (dev, host)
                stack.append((child, prefix + tuple(child.key)))
        return out

    def check_match(self, m: MatchResult, tokens: list[int]) -> None:
        ps = self.ps
        assert m.device_hit_tokens == len(m.device_pages) * ps
        for i, p in enumerate(m.device_pages):
            assert self.dev_shadow[p] == tuple(tokens[: (i + 1) * ps]), "L1 page holds other tokens"
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
        m = self.tree.match_prefix(tokens)
        self.drain()
        self.check_match(m, tokens)
        return m

    def load(self, m: MatchResult, tokens: list[int]) -> MatchResult:
        r = self.tree.load_back(m)
        self.drain()
        if r is m:
            return m
        assert r.host_hit_tokens == 0 and r.device_hit_tokens == m.device_hit_tokens + m.host_hit_tokens
        assert r.device_pages[: len(m.device_pages)] == m.device_pages
        self.check_match(r, tokens)  # loaded pages hold the right tokens
        self.loads.append(r.last_device_node)
        return r

    # ------------------------------------------------------------------ rules
    @rule(tokens=tokens_st)
    def do_match(self, tokens):
        self.match(tokens)

    @rule(tokens=tokens_st, use_prefix=st.booleans(), do_load=st.booleans())
    def request(self, tokens, use_prefix, do_load):
        """A request: (match, load-back, lock), allocate, write, insert, free duplicates, unlock."""
        tree, ps = self.tree, self.ps
        npages = len(tokens) // ps
        node, prefix = tree.root, []
        if use_prefix:
            m = self.match(tokens)
            if do_load:
                m = self.load(m, tokens)
            node, prefix = m.last_device_node, m.device_pages
        tree.lock(node)
        need = npages - len(prefix)
        if tree.device.num_free < need:
            tree.evict_device(need - tree.device.num_free)
            self.drain()
        if tree.device.num_free >= need:
            new = tree.device.alloc(need)
            for i, p in enumerate(new):
                self.dev_shadow[p] = tuple(tokens[: (len(prefix) + i + 1) * ps])
            tree.check_integrity(device_in_use=need)
            dup = tree.insert(tokens, prefix + new)
            assert tree.take_transfers() == []
            assert set(dup) <= set(new) and len(set(dup)) == len(dup)
            tree.device.free(dup)
            self.inserted.update(tuple(tokens[: (i + 1) * ps]) for i in range(npages))
            self.history.append(tokens)
            snap = self.snapshot()
            for i in range(npages):
                assert snap[tuple(tokens[: (i + 1) * ps])][0] is not None, "inserted page not on L1"
        tree.unlock(node)

    @precondition(lambda self: self.tree.host is not None)
    @rule(tokens=tokens_st, use_history=st.booleans(), i=st.integers(0, 100), after_cached=st.booleans())
    def prefetch(self, tokens, use_history, i, after_cached):
        """Pages of ``tokens`` arrive from L3 into fresh L2 pages (insert_host), either all
        of them or (like the controller) those after the cached prefix."""
        tree, ps = self.tree, self.ps
        if use_history and self.history:
            tokens = self.history[i % len(self.history)] + tokens[:4]
        npages = len(tokens) // ps
        start = tree.peek_prefix_len(tokens) // ps if after_cached else 0
        host = tree.host
        if host.num_free < npages - start:
            tree.evict_host(npages - start - host.num_free)
            start = min(start, tree.peek_prefix_len(tokens) // ps)  # eviction may shorten the prefix
        if host.num_free < npages - start:
            return
        pages = host.alloc(npages - start)
        for j, p in enumerate(pages):
            self.host_shadow[p] = tuple(tokens[: (start + j + 1) * ps])
        dup = tree.insert_host(tokens, pages, start_page=start)
        assert tree.take_transfers() == []
        assert set(dup) <= set(pages) and len(set(dup)) == len(dup)
        tree.check_integrity(host_in_use=len(dup))
        host.free(dup)
        self.inserted.update(tuple(tokens[: (j + 1) * ps]) for j in range(start, npages))
        snap = self.snapshot()
        for j in range(start, npages):
            assert snap[tuple(tokens[: (j + 1) * ps])][1] is not None, "prefetched page not on L2"

    @precondition(lambda self: len(self.locks) < 3)
    @rule(tokens=tokens_st, do_load=st.booleans())
    def hold(self, tokens, do_load):
        m = self.match(tokens)
        if do_load:
            m = self.load(m, tokens)
        self.tree.lock(m.last_device_node)
        self.locks.append((m.last_device_node, list(m.device_pages)))

    @precondition(lambda self: self.history)
    @rule(i=st.integers(0, 100), hold=st.booleans())
    def revisit(self, i, hold):
        """Come back to an earlier sequence (L1 or L2 hits, load-back); maybe keep it locked."""
        tokens = self.history[i % len(self.history)]
        m = self.load(self.match(tokens), tokens)
        if hold and len(self.locks) < 3:
            self.tree.lock(m.last_device_node)
            self.locks.append((m.last_device_node, list(m.device_pages)))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 2))
    def release(self, i):
        node, _ = self.locks.pop(i % len(self.locks))
        self.tree.unlock(node)

    @precondition(lambda self: self.loads)
    @rule(i=st.integers(0, 2))
    def finish_load(self, i):
        node = self.loads.pop(i % len(self.loads))
        assert node.loading
        self.tree.finish_load(node)

    @rule(n=st.integers(1, 12))
    def evict_device(self, n):
        tree = self.tree
        before = tree.cached_pages("device")
        freed = tree.evict_device(n)
        self.drain()
        assert freed == before - tree.cached_pages("device")
        if freed < n:
            assert tree.evictable_pages("device") == 0, "evict_device stopped with evictable pages left"

    @rule(n=st.integers(1, 12))
    def evict_host(self, n):
        tree = self.tree
        before = tree.cached_pages("host")
        freed = tree.evict_host(n)
        assert tree.take_transfers() == []
        assert freed == before - tree.cached_pages("host")
        if freed < n and tree.host is not None:
            assert tree.evictable_pages("host") == 0, "evict_host stopped with evictable pages left"

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

    @precondition(lambda self: not self.locks and not self.loads)
    @rule(go=st.integers(0, 9))
    def reset(self, go):
        if go:  # keep resets rare
            return
        self.tree.reset()
        assert self.tree.num_nodes == 0 and self.tree.cached_pages("device") == 0

    # ------------------------------------------------------------------ invariants
    @invariant()
    def consistent(self):
        tree = self.tree
        tree.check_integrity()
        assert tree.take_transfers() == [], "a rule left transfers undrained"
        for prefix, (dev, host) in self.snapshot().items():
            assert prefix in self.inserted, f"tree caches {prefix} that was never inserted"
            if dev is not None:
                assert self.dev_shadow[dev] == prefix, (
                    f"L1 page {dev} holds {self.dev_shadow[dev]}, not {prefix}"
                )
            if host is not None:
                assert self.host_shadow[host] == prefix, f"L2 page {host} holds the wrong tokens"
        for node, pages in self.locks:
            assert not node.removed, "a locked node was removed"
            got = [p for n in reversed(node.path_to_root()) for p in n.device_pages]
            assert got == pages, "a locked prefix lost or changed its L1 pages"


TreeMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,  # deterministic: same examples every run
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_tree_state_machine = TreeMachine.TestCase
