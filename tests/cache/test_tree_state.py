"""The HiRadixTree's state snapshots (a model with linear-attention / Mamba layers), on real tensors in
small state pools on the CPU (harness/tree_cases.py's StateRig): a match stops at the deepest
snapshot; splits keep it at the lower part; the cascade (L1 KV evicted -> snapshot demoted to L2 or
dropped; L2 KV gone -> L2 snapshot dropped, marked stored first when L3 has it); write-through
copies; eviction of snapshots alone under state-pool pressure (demote first, LRU, locks protect);
load-back of a snapshot brings the same bytes; check_integrity after every step, and catching a
corrupted slot ownership."""

from __future__ import annotations

import pytest
import torch

from harness.tree_cases import STATE_LAYOUT, StateRig, make, same, state_value
from hicache.hiradix import HiRadixTree, StaleMatch
from hicache.keys import component_key, page_keys, state_key, tp_shard_key
from hicache.tiers.allocator import PageAllocator
from hicache.tiers.host_state import HostStatePool, copy_slots
from hicache.tiers.state_pool import DeviceStatePool

A = [1, 1, 2, 2]
AB = A + [3, 3, 4, 4]


def test_match_stops_at_the_deepest_snapshot():
    r = StateRig(policy="write_through")
    t = r.tree
    na = r.request(A, 1.0)
    r.request(AB, None)  # a request that kept no snapshot at its end
    m = t.match_prefix(AB + [5])
    assert (m.device_hit_tokens, m.host_hit_tokens) == (4, 0) and m.state.node is na and m.resumable
    assert m.state.tier == "device" and same(r.l1_value(m.state.device_slot), state_value(1.0))
    assert t.lookup(AB) == (na, 4) and t.peek_prefix_len(AB) == 4
    assert t.match_prefix(AB, needs_state=False).device_hit_tokens == 8  # the KV is all there
    assert t.lookup(AB, needs_state=False)[1] == 8
    nab = r.request(AB, 2.0)
    m = t.match_prefix(AB)
    assert m.device_hit_tokens == 8 and m.state.node is nab and same(r.l1_value(m.state.device_slot), state_value(2.0))
    # no snapshot on the path: nothing matches (the request starts from the zero state)
    m = t.match_prefix([1, 1])
    assert m.cached_tokens == 0 and m.state is None and m.last_device_node is t.root and m.resumable
    assert t.lookup([1, 1, 7, 7]) == (t.root, 0)
    r.check()


def test_attach_refuses_duplicates_and_nodes_off_l1():
    r = StateRig()
    t = r.tree
    node = r.request(A, 1.0)
    slot = r.capture(9.0)
    assert t.attach_state(node, slot) == slot  # a duplicate: the caller frees it
    assert t.attach_state(t.root, slot) == slot
    r.l1.free([slot])
    r.check()
    assert same(r.l1_value(node.snap.device_slot), state_value(1.0))  # the first one stays
    assert t.node_at(A + [9]) is node and t.node_at([5, 5]) is None
    with pytest.raises(ValueError):
        make().attach_state(node, 0)  # a tree without state pools


def test_split_keeps_the_snapshot_on_the_lower_part():
    r = StateRig()
    t = r.tree
    node = r.request(AB, 3.0)
    slot = node.snap.device_slot
    m = t.match_prefix(A + [9, 9], needs_state=False)  # splits [1,1,2,2 | 3,3,4,4]
    upper = m.last_device_node
    assert upper.key == A and upper.snap is None and node.parent is upper
    assert node.key == [3, 3, 4, 4] and node.snap.device_slot == slot
    r.check()
    assert t.match_prefix(A + [9, 9]).cached_tokens == 0  # no snapshot at 4 tokens
    m = t.match_prefix(AB)
    assert m.state.node is node and m.device_hit_tokens == 8 and same(r.l1_value(slot), state_value(3.0))
    # node_at splits too, and the snapshot still stays below
    assert t.node_at([1, 1]).snap is None and node.snap.device_slot == slot
    r.check()


def test_cascade_demotes_with_the_kv_and_loads_back_the_same_bytes():
    r = StateRig(policy="write_back")
    t = r.tree
    node = r.request(AB, 4.0)
    slot = node.snap.device_slot
    assert t.evict_device(100) == 4
    kinds = [x.kind for x in r.drain()]
    assert sorted(kinds) == ["backup", "state_backup"]
    assert node.snap.device_slot is None and not r.l1.is_allocated(slot)
    hslot = node.snap.host_slot
    assert same(r.l2_value(hslot), state_value(4.0))
    r.l1.write_slot(slot, state_value(-1.0))  # the freed L1 slot is reused: the load must come from L2
    m = t.match_prefix(AB)
    assert (m.device_hit_tokens, m.host_hit_tokens) == (0, 8) and m.state.tier == "host" and not m.resumable
    got = t.load_back(m)
    assert got.resumable and got.device_hit_tokens == 8 and got.state.tier == "device"
    out = r.drain()
    assert [x.kind for x in out] == ["load", "state_load"] and len(got.pending_loads) == 2
    assert out[1].pending is got.pending_loads[-1] and node.snap.load is not None
    assert same(r.l1_value(got.state.device_slot), state_value(4.0))
    assert t.state.evict_device(100) == 0 and t.evict_device(100) == 0  # loading: locked
    with pytest.raises(RuntimeError):
        t.reset()
    t.finish_load(node)
    assert node.snap.load is None and node.lock_ref == 0 and not node.loading
    with pytest.raises(ValueError):
        t.finish_load(node)
    r.check()
    # the snapshot is on both tiers now; an L1 eviction only frees its L1 slot (no copy)
    assert t.evict_device(100) == 4
    assert [x.kind for x in r.drain()] == [] and node.snap.host_slot == hslot
    with pytest.raises(StaleMatch):
        stale = t.match_prefix(AB)
        t.state.evict_host(1)
        t.load_back(stale)


def test_l1_eviction_without_l2_drops_the_snapshot():
    r = StateRig(host=0)
    t = r.tree
    r.request(AB, 5.0)
    assert t.evict_device(100) == 4 and t.num_nodes == 0
    assert r.drain() == [] and r.l1.num_used == 0 and t.state.demotions_dropped == 0


def test_l2_eviction_drops_the_snapshot_or_keeps_the_stored_mark():
    r = StateRig(policy="write_back")
    t = r.tree
    na = r.request(A, 1.0)
    nab = r.request(AB, 2.0)
    t.evict_device(100)
    r.drain()
    assert na.snap.host_slot is not None and nab.snap.host_slot is not None
    assert t.state.mark_stored(na)  # its write-back to L3 finished (KV and state)
    assert t.state.evict_host(2) == 2  # both L2 snapshots go; the KV stays
    r.check()
    assert nab.snap is None and na.snap.stored and na.snap.host_slot is None
    m = t.match_prefix(AB)  # na's snapshot is on L3 only: no hit a request can use now (the prefetch fetches it)
    assert m.state is None and m.cached_tokens == 0 and t.lookup(AB)[1] == 0
    assert t.load_back(m) is m and r.drain() == []
    # the L3 fetch brings it into an L2 slot; then it loads as any
    (h,) = r.l2.alloc(1)
    r.l2.write_slot(h, state_value(1.0))
    assert t.state.attach_host(na, h) is None
    got = t.load_back(t.match_prefix(A))
    r.drain()
    assert same(r.l1_value(got.state.device_slot), state_value(1.0))
    t.finish_load(na)
    # L2 KV eviction: the node leaves, every slot goes back
    t.evict_device(100)
    r.drain()
    assert t.evict_host(100) == 4 and t.num_nodes == 0
    r.check()
    assert r.l1.num_used == 0 and r.l2.num_used == 0


def test_write_through_copies_the_snapshot_with_the_backup():
    r = StateRig(policy="write_through")
    t = r.tree
    node = r.request(A, 6.0)
    assert node.snap.host_slot is None
    t.match_prefix(A)  # first hit: backed up, the snapshot too
    out = r.drain()
    assert sorted(x.kind for x in out) == ["backup", "state_backup"]
    assert node.host_pages is not None and same(r.l2_value(node.snap.host_slot), state_value(6.0))
    assert same(r.l1_value(node.snap.device_slot), state_value(6.0))
    # a prefetch dropping L2 backups of L1 nodes takes the L2 snapshot with the pages
    assert t.evict_host(1, drop_backups=True) == 2
    assert node.host_pages is None and node.snap.host_slot is None and node.snap.device_slot is not None
    assert r.l2.num_used == 0
    r.check()


def test_state_pool_pressure_evicts_the_lru_snapshot_alone_demoting_first():
    r = StateRig(policy="write_through", dev_slots=2, host_slots=1)
    t = r.tree
    n1 = r.request([1, 1], 1.0)
    t.match_prefix([1, 1])  # backed up with its snapshot: L2 has its one slot
    r.drain()
    n2 = r.request([2, 2], 2.0)
    n2_slot = n2.snap.device_slot
    t.match_prefix([1, 1])  # n1 is the most recent now
    # a third snapshot needs an L1 slot: the LRU one (n2, no L2 pages) is dropped alone
    n3 = r.request([3, 3], 3.0)
    assert n2.snap is None and n2.device_pages is not None and n3.snap is not None
    assert n3.snap.device_slot == n2_slot and same(r.l1_value(n2_slot), state_value(3.0))
    assert t.match_prefix([2, 2]).cached_tokens == 0  # its KV is still there, the match stops higher
    assert t.match_prefix([2, 2], needs_state=False).device_hit_tokens == 2
    # n1 is demoted, not dropped: the next capture takes its L1 slot, its L2 copy stays
    t.match_prefix([3, 3])
    r.drain()
    n1_slot = n1.snap.device_slot
    n4 = r.request([4, 4], 4.0)
    assert n1.snap.device_slot is None and same(r.l2_value(n1.snap.host_slot), state_value(1.0))
    assert n4.snap.device_slot == n1_slot and same(r.l1_value(n1_slot), state_value(4.0))
    # and it loads back, though its KV never left L1: only the state moves
    m = t.match_prefix([1, 1])
    assert m.host_hit_tokens == 0 and m.state.tier == "host" and not m.resumable
    got = t.load_back(m)
    assert [x.kind for x in r.drain()] == ["state_load"] and got.resumable
    assert same(r.l1_value(got.state.device_slot), state_value(1.0))
    t.finish_load(n1)
    r.check()


def test_locks_protect_snapshots_and_l2_room_is_made_lru():
    r = StateRig(policy="write_back", dev_slots=3, host_slots=1)
    t = r.tree
    na = r.request(A, 1.0)
    m = t.match_prefix(A)
    t.lock(m.last_device_node)
    assert t.state.evict_device(5) == 0 and t.evict_device(100) == 0
    r.check()
    t.unlock(m.last_device_node)
    nb = r.request([5, 5], 2.0)
    t.evict_device(100)  # both demoted; L2 has one state slot: the LRU one (na) gives it up
    r.drain()
    assert na.snap is None and nb.snap.host_slot is not None and t.state.demotions_dropped == 0
    assert r.l1.num_used == 0 and same(r.l2_value(nb.snap.host_slot), state_value(2.0))


def test_flush_frees_every_slot():
    r = StateRig(policy="write_through")
    t = r.tree
    r.request(A, 1.0)
    r.request([7, 7], 2.0)
    t.match_prefix(A)
    r.drain()
    t.reset()
    r.check()
    assert r.l1.num_used == 0 and r.l2.num_used == 0


def test_integrity_catches_bad_slot_ownership():
    r = StateRig(policy="write_through")
    na = r.request(A, 1.0)
    nb = r.request([5, 5], 2.0)
    r.check()
    good = nb.snap.device_slot
    nb.snap.device_slot = na.snap.device_slot  # two nodes own one slot
    with pytest.raises(AssertionError, match="held by"):
        r.check()
    nb.snap.device_slot = good
    r.l1.free([good])  # the pool thinks it is free while nb holds it
    with pytest.raises(AssertionError, match="allocated"):
        r.check()
    r.l1.alloc(1)
    r.check()
    r.held.append(r.l1.alloc(1)[0])  # a running request's slot: fine once declared
    r.check()
    r.held.pop()
    with pytest.raises(AssertionError, match="in use by callers"):
        r.check()
    # an L1 snapshot on a node without L1 pages
    pages, na.device_pages = na.device_pages, None
    with pytest.raises(AssertionError):
        r.check()
    na.device_pages = pages


def test_constructor_and_pools():
    with pytest.raises(ValueError):
        HiRadixTree(2, PageAllocator(4), None, state_device=PageAllocator(2), state_host=PageAllocator(2))
    t = make()
    assert not t.needs_state and t.state is None
    t.check_integrity()
    with pytest.raises(AssertionError):
        t.check_integrity(state_device_in_use=1)


def test_host_state_pool_roundtrips_slots():
    dev = DeviceStatePool(STATE_LAYOUT, 3, "cpu")
    host = HostStatePool(STATE_LAYOUT, 2, pin_memory=False)
    host.check_integrity()
    assert host.bytes_per_slot == STATE_LAYOUT.bytes_per_slot() and host.nbytes() == 2 * host.bytes_per_slot
    dev.write_slot(2, state_value(3.0))
    flat_dev = [b for layer in dev.buffers for b in layer]
    copy_slots(flat_dev, host.tensors(), [2], [1])
    assert same(host.read_slot(1), state_value(3.0)) and same(host.read_slot(0), [torch.zeros_like(x) for x in
                                                                                      state_value(0)])
    data = host.slot_bytes(1)
    assert len(data) == host.bytes_per_slot
    host.load_slot_bytes(0, data)
    assert same(host.read_slot(0), state_value(3.0))
    copy_slots(host.tensors(), flat_dev, [0], [0])
    assert same(dev.read_slot(0), state_value(3.0))
    with pytest.raises(ValueError):
        host.load_slot_bytes(0, data[:-1])
    with pytest.raises(ValueError):
        host.free([0])  # not allocated


def test_state_key_is_a_component_of_the_page_key():
    keys = page_keys(list(range(8)), 4, "m|L1.H1.D8.float32|tp0")
    s = state_key(keys[-1])
    assert s == state_key(keys[-1]) and s not in keys and s != tp_shard_key(keys[-1], 1, 1)
    assert len(s) == 32 and s != state_key(keys[0])
    assert component_key(keys[-1], "state") == s
    with pytest.raises(ValueError):
        component_key(keys[-1], "window")
    with pytest.raises(ValueError):
        state_key("not a key")


def test_a_loading_snapshots_l2_slot_is_not_reused_before_the_load_ends():
    """A prefetch dropping L2 backups may take those of a locked node L3 holds; a state load in
    flight reads that node's L2 slot: the slot stays allocated (pinned) until finish_load."""
    r = StateRig(policy="write_through", host_slots=1)
    t = r.tree
    node = r.request(A, 7.0)
    t.match_prefix(A)  # backed up with its snapshot
    r.drain()
    t.state.evict_device(1)  # the snapshot leaves L1 alone: the KV stays there
    r.drain()
    assert node.device_pages is not None and node.host_pages is not None
    t.mark_stored(A, 0, 2)  # its pages are on L3
    got = t.load_back(t.match_prefix(A))
    (load,) = t.take_transfers()  # the state_load, not executed yet
    src = load.src_pages[0]
    assert t.evict_host(1, drop_backups=True) == 2  # the node's L2 copy goes, with its snapshot's
    assert node.snap.host_slot is None and r.l2.is_allocated(src) and r.l2.num_free == 0
    copy_slots(r.l2.tensors(), [b for layer in r.l1.buffers for b in layer], [src], load.dst_pages)
    assert same(r.l1_value(got.state.device_slot), state_value(7.0))
    t.finish_load(node)
    assert not r.l2.is_allocated(src)
    r.check()


def test_a_snapshot_on_l3_only_does_not_hide_a_resident_one_above_it():
    """AB's snapshot is on L3 only (its L2 copy went, its stored mark stays) and A's is on L2: a match
    for AB stops at A, whose snapshot a request can load now, not at AB (which would leave it nothing
    to start from until the L3 prefetch brought AB's back)."""
    r = StateRig(policy="write_back")
    t = r.tree
    na = r.request(A, 1.0)
    nab = r.request(AB, 2.0)
    t.evict_device(100)
    r.drain()
    assert t.state.mark_stored(nab)
    key = t.state._key
    t.state._key = lambda nd: (nd is not nab, key(nd))  # AB's L2 snapshot goes first
    try:
        assert t.state.evict_host(1) == 1
    finally:
        t.state._key = key
    r.check()
    assert nab.snap.stored and nab.snap.host_slot is None and na.snap.host_slot is not None
    m = t.match_prefix(AB + [5, 5, 6, 6])
    assert m.state is not None and m.state.node is na and m.state.tier == "host" and m.cached_tokens == len(A)
    got = t.load_back(m)
    r.drain()
    assert got.resumable and same(r.l1_value(got.state.device_slot), state_value(1.0))
    r.check()


def test_a_pinned_prefix_keeps_its_snapshot_under_state_pressure():
    """A's L2 pages are pinned (a cache_control breakpoint's lease): under state-pool pressure the
    snapshots that go are the unpinned ones, never A's, until the pin ends."""
    r = StateRig(policy="write_back")
    t = r.tree
    na = r.request(A, 1.0)
    nab = r.request(AB, 2.0)
    t.evict_device(100)  # KV and snapshots demoted to L2
    r.drain()
    assert na.snap.host_slot is not None and nab.snap.host_slot is not None
    t.pin_host(na.host_pages)
    key = t.state._key
    t.state._key = lambda nd: (nd is not na, key(nd))  # A's would go first, were it not pinned
    try:
        assert t.state.evict_host(1) == 1
        assert na.snap.host_slot is not None and nab.snap is None
        assert t.state.evict_host(1) == 0  # only A's is left, and it is pinned
        r.check()
        t.unpin_host(na.host_pages)
        assert t.state.evict_host(1) == 1 and na.snap is None
    finally:
        t.state._key = key
    r.check()
