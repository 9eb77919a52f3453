"""The HiRadixTree's unit-test cases: a small tree over page allocators and a request's life on it
(tests/cache/test_tree.py, tests/cache/test_tree_tiering.py), and a tree of a state model over real
state pools on the CPU (tests/cache/test_tree_state.py)."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from hicache.hiradix import HiRadixTree, MatchResult, Transfer, TreeNode
from hicache.tiers.allocator import PageAllocator
from hicache.tiers.host_state import HostStatePool, copy_slots
from hicache.tiers.state_layout import StateLayout, StateTensor
from hicache.tiers.state_pool import DeviceStatePool

PS = 2


def make(dev: int = 16, host: int = 0, policy: str = "write_through", **kw) -> HiRadixTree:
    return HiRadixTree(
        PS, PageAllocator(dev), PageAllocator(host) if host else None, write_policy=policy, **kw
    )


def put(tree: HiRadixTree, tokens: list[int]) -> MatchResult:
    """A request's life: match, lock, alloc the rest, insert, free duplicates, unlock."""
    m = tree.match_prefix(tokens)
    tree.lock(m.last_device_node)
    need = len(tokens) // PS - len(m.device_pages)
    if tree.device.num_free < need:
        tree.evict_device(need - tree.device.num_free)
    new = tree.device.alloc(need)
    tree.check_integrity(device_in_use=need)
    dup = tree.insert(tokens, m.device_pages + new)
    assert dup == []
    tree.unlock(m.last_device_node)
    tree.check_integrity()
    return m


# two state layers of a conv and a recurrent tensor each, as Gated DeltaNet / Mamba2 keep
STATE_LAYOUT = StateLayout(((StateTensor("conv", (3, 4), torch.float32),
                             StateTensor("recurrent", (2, 4, 4), torch.bfloat16)),) * 2)


def _flat(pool: DeviceStatePool | HostStatePool) -> list[torch.Tensor]:
    return [buf for layer in pool.buffers for buf in layer]


def state_value(v: float) -> list[torch.Tensor]:
    """A distinct snapshot per ``v``: every tensor of the layout, each element different."""
    out = []
    for i, t in enumerate(x for layer in STATE_LAYOUT.layers for x in layer):
        n = 1
        for d in t.shape:
            n *= d
        out.append((v + i / 8 + torch.arange(n, dtype=torch.float32) / 64).reshape(t.shape).to(t.dtype))
    return out


class StateRig:
    """A tree of a state model on the CPU: KV pages are ids only, state snapshots real tensors in an
    L1 :class:`DeviceStatePool` and an L2 :class:`HostStatePool`. :meth:`drain` executes the tree's
    transfers like the controller (state ones with ``copy_slots``; every load lands at once) and
    checks the tree's integrity with the slots the rig holds (``held``: working / captured slots)."""

    def __init__(self, dev: int = 16, host: int = 16, dev_slots: int = 4, host_slots: int = 4,
                 policy: str = "write_back", **kw) -> None:
        self.l1 = DeviceStatePool(STATE_LAYOUT, dev_slots, "cpu")
        self.l2 = HostStatePool(STATE_LAYOUT, host_slots, pin_memory=False) if host and host_slots else None
        self.tree = HiRadixTree(PS, PageAllocator(dev), PageAllocator(host) if host else None, write_policy=policy,
                                state_device=self.l1, state_host=self.l2, **kw)
        self.held: list[int] = []  # L1 slots the rig (a running request) holds
        self.transfers: list[Transfer] = []  # every transfer drained so far

    def drain(self) -> list[Transfer]:
        out = self.tree.take_transfers()
        for t in out:
            if t.kind == "state_backup":
                copy_slots(_flat(self.l1), _flat(self.l2), t.src_pages, t.dst_pages)
            elif t.kind == "state_load":
                copy_slots(_flat(self.l2), _flat(self.l1), t.src_pages, t.dst_pages)
            if t.pending is not None:
                done: Future = Future()
                done.set_result(None)
                t.pending.bind(done)
        self.transfers += out
        self.check()
        return out

    def check(self) -> None:
        self.tree.check_integrity(state_device_in_use=len(self.held))

    def capture(self, v: float) -> int | None:
        """A request's state at its last full page, captured into a fresh L1 slot (None when every
        slot is held: by snapshots of locked paths, the request's own included)."""
        if self.l1.num_free < 1:
            self.tree.state.evict_device(1)
            self.drain()
        if self.l1.num_free < 1:
            return None
        (slot,) = self.l1.alloc(1)
        self.l1.write_slot(slot, state_value(v))
        return slot

    def request(self, tokens: list[int], v: float | None) -> TreeNode:
        """A request's life on a state model: match (cut at a snapshot), load back, lock, compute
        the rest, insert, attach its snapshot (value ``v``; None: it keeps none), unlock."""
        tree = self.tree
        first = tree.match_prefix(tokens)
        m = tree.load_back(first)
        self.drain()
        started = m is not first  # load_back is all or nothing: what it started made m resumable
        if not m.resumable:
            m = tree.match_prefix([])  # recompute from the start
        assert all(p.done() for p in m.pending_loads)  # every load landed in drain
        tree.lock(m.last_device_node)
        if started:
            tree.finish_load(m.last_device_node)  # the loads this request started
        if m.state is not None:  # the request's working slot starts as a copy of the snapshot
            assert m.state.device_slot is not None and m.state.node.snap.device_slot == m.state.device_slot
        need = len(tokens) // PS - len(m.device_pages)
        if tree.device.num_free < need:
            tree.evict_device(need - tree.device.num_free)
            self.drain()
        dup = tree.insert(tokens, m.device_pages + tree.device.alloc(need))
        tree.device.free(dup)
        node = tree.node_at(tokens)
        slot = None if v is None else self.capture(v)
        if slot is not None:
            refused = tree.attach_state(node, slot)
            if refused is not None:
                self.l1.free([refused])
        tree.unlock(m.last_device_node)
        self.drain()
        return node

    def l1_value(self, slot: int) -> list[torch.Tensor]:
        return self.l1.read_slot(slot)

    def l2_value(self, slot: int) -> list[torch.Tensor]:
        return self.l2.read_slot(slot)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
