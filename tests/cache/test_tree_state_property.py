"""Stateful property test of the HiRadixTree's state snapshots on real tensors (harness/tree_cases.py's
StateRig: small L1 / L2 state pools on the CPU, the tree's transfers executed in order as drained).

Requests (match -> load back -> lock -> insert -> attach the snapshot of their last full page, or
none), held matches, KV evictions of both tiers (dropping L2 backups too), snapshot evictions alone,
L3 marks and flushes, in any order. After every step:
- ``check_integrity`` with the slots the test holds;
- every snapshot's L1 and L2 slot holds the bytes of the state captured for its node's prefix (a
  value derived from the prefix), whatever demotions, evictions, load-backs and slot reuse came
  between;
- a match stops exactly at the deepest node on its path that has a snapshot, and says where it is;
- a held (locked) match keeps its snapshot on L1.
"""

from __future__ import annotations

import zlib

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from harness.tree_cases import PS, StateRig, same, state_value

STEM = [0, 1, 1, 2, 0, 2, 1, 0, 2, 2, 1, 1]
tokens_st = st.builds(lambda cut, tail: STEM[:cut] + tail, st.integers(0, len(STEM)),
                      st.lists(st.integers(0, 2), max_size=6))


def value_of(prefix: list[int]) -> float:
    """The state a request leaves after ``prefix`` (one value per prefix)."""
    return float(zlib.crc32(bytes(prefix)) % 997)


class StateTreeMachine(RuleBasedStateMachine):
    @initialize(dev=st.integers(6, 16), host=st.sampled_from([0, 8, 16, 32]), dev_slots=st.integers(2, 5),
                host_slots=st.integers(1, 5),
                policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]))
    def setup(self, dev, host, dev_slots, host_slots, policy):
        self.r = StateRig(dev=dev, host=host, dev_slots=dev_slots, host_slots=host_slots, policy=policy)
        self.held = []  # (node, device slot) of held matches
        self.history = []  # token lists requested so far

    @rule(tokens=tokens_st, keep=st.booleans())
    def new_request(self, tokens, keep):
        self.request(tokens, keep)

    def request(self, tokens, keep):
        full = tokens[: len(tokens) - len(tokens) % PS]
        if not full or self.r.tree.device.num_free + self.r.tree.evictable_pages("device") < len(full) // PS:
            return
        self.r.request(tokens, value_of(full) if keep else None)
        self.history.append(list(tokens))

    @precondition(lambda self: self.history)
    @rule(i=st.integers(0, 100), squeeze=st.sampled_from(["none", "kv", "state", "both"]), keep=st.booleans())
    def revisit(self, i, squeeze, keep):
        """An earlier sequence comes back (the next turn of a conversation), maybe after its KV
        and / or its snapshot were pushed off L1: it loads them back (or recomputes)."""
        t = self.r.tree
        if squeeze in ("kv", "both"):
            t.evict_device(t.cached_pages("device"))
        if squeeze in ("state", "both"):
            t.state.evict_device(t.state.cached_slots("device"))
        self.r.drain()
        self.request(self.history[i % len(self.history)], keep)

    @rule(tokens=tokens_st)
    def match(self, tokens):
        t = self.r.tree
        m = t.match_prefix(tokens)
        self.r.drain()
        path, _ = t.shape.match_path(list(tokens))  # the uncut path (splits like the match did)
        with_snap = [nd for nd in path if t.state.resident(nd)]  # on L1 or L2: one on L3 only is prefetched
        want = with_snap[-1] if with_snap else None
        assert (m.state.node if m.state else None) is want, "the match does not stop at the deepest snapshot"
        assert t.lookup(tokens)[0] is (want or t.root)
        if want is not None:
            assert m.cached_tokens == len(t.path_tokens(want)) and m.last_host_node is want
            assert (m.state.device_slot, m.state.host_slot) == (want.snap.device_slot, want.snap.host_slot)
        else:
            assert m.cached_tokens == 0

    @precondition(lambda self: len(self.held) < 2)
    @rule(tokens=tokens_st)
    def hold(self, tokens):
        """A running request: its match loaded back and locked (its loads landed and finished)."""
        t = self.r.tree
        first = t.match_prefix(tokens)
        m = t.load_back(first)
        self.r.drain()
        if m.state is None or not m.resumable:
            return
        t.lock(m.last_device_node)
        if m is not first:
            t.finish_load(m.last_device_node)
        self.r.check()
        self.held.append((m.state.node, m.state.device_slot))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 1))
    def release(self, i):
        node, _ = self.held.pop(i % len(self.held))
        self.r.tree.unlock(node)

    @rule(tier=st.sampled_from(["device", "host", "state_device", "state_host", "backups"]), n=st.integers(1, 8))
    def evict(self, tier, n):
        t = self.r.tree
        if tier == "device":
            t.evict_device(n)
        elif tier == "host":
            t.evict_host(n)
        elif tier == "backups":
            t.evict_host(n, drop_backups=True)
        elif tier == "state_device":
            t.state.evict_device(n)
        else:
            t.state.evict_host(n)
        self.r.drain()

    @rule(i=st.integers(0, 100))
    def mark_stored(self, i):
        nodes = [nd for nd in self.r.tree.nodes() if nd.snap is not None]
        if nodes:
            assert self.r.tree.state.mark_stored(nodes[i % len(nodes)])

    @rule(go=st.integers(0, 9))
    def reset(self, go):
        if go != 3 or self.held:
            return
        self.r.tree.reset()
        self.r.check()
        assert self.r.l1.num_used == 0 and (self.r.l2 is None or self.r.l2.num_used == 0)

    @invariant()
    def snapshots_hold_their_prefix(self):
        r = self.r
        r.check()
        assert r.tree.take_transfers() == []
        for nd in r.tree.nodes():
            if nd.snap is None:
                continue
            want = state_value(value_of(r.tree.path_tokens(nd)))
            if nd.snap.device_slot is not None:
                assert same(r.l1_value(nd.snap.device_slot), want), f"L1 snapshot of {nd!r} holds other bytes"
            if nd.snap.host_slot is not None:
                assert same(r.l2_value(nd.snap.host_slot), want), f"L2 snapshot of {nd!r} holds other bytes"
        for node, slot in self.held:
            assert not node.removed and node.snap is not None and node.snap.device_slot == slot, (
                f"a held match lost its L1 snapshot: {node!r}"
            )


StateTreeMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_state_tree_machine = StateTreeMachine.TestCase
