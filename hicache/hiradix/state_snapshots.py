"""StateSnapshots: the recurrent-state component of the tree (models with linear-attention or Mamba
layers keep a state per sequence, not KV per token).

A node may carry a snapshot (``node.snap``): the state after its last token, in a slot of the L1
state pool, of the L2 one, and/or stored on L3. This part is the one owner of those facts: it
hands the slots to the nodes and back to the pools, keeps the per-tier sets of nodes holding one,
decides the snapshot's moves (emitted as ``state_backup`` / ``state_load`` :class:`Transfer`
orders into the tree's one outbox, so the ordering contract of tree.py covers slots as it covers
pages: a slot freed right after its backup is emitted is reused only behind it), and checks them.

Rules:
- A snapshot's tiers follow the node's KV: an L1 slot only while the node has L1 pages, an L2
  slot only while it has L2 pages. So the KV's moves cascade (:class:`Residency` calls the
  ``on_*`` hooks): the node gets an L2 copy -> its L1 snapshot is copied to L2 too (write-through,
  demotion; a snapshot attached to a node already on L2 is copied at once, so the write-back takes
  it on to L3 with the node); it loses its L1 pages -> its L1 snapshot goes (already on L2, or demoted: copied to
  an L2 slot when the node keeps L2 pages, else dropped); it loses its L2 pages or leaves the tree
  -> its L2 snapshot goes (the ``stored`` mark says whether L3 has it: ``mark_stored``).
- Under state-pool pressure a snapshot is evicted alone (:meth:`evict_device` /
  :meth:`evict_host`), policy order (LRU: session-referenced nodes last), never one of a locked node
  nor one loading: L1 ones are demoted to L2 first where the node has L2 pages; L2-only snapshots go
  before L2 backups of L1 ones. The node's KV stays; a state match then stops higher. A node whose
  L2 pages are pinned (``page_pins``: a ``cache_control`` breakpoint's or a ``/cache/pin`` lease, an
  L3 write in flight) keeps its L2 snapshot, and leaves L1 only with one on L2: its prefix is
  useless to a state model without it.
- A match of a state model stops at the deepest node on its path with a snapshot (:meth:`cut`);
  a snapshot on L2 only is loaded back with the node's L2 run (``HiRadixTree.load_back``):
  a ``state_load`` Transfer carrying its own PendingLoad, the node locked until
  ``HiRadixTree.finish_load``. A transfer, not a direct copy: the tree moves no bytes, and one
  outbox keeps the slot reuse order (a demotion's source slot may be the next load's
  destination); the controller executes both kinds on its copy stream like page moves.
- Slots of running requests (working states, captures not attached yet) are the caller's: it
  allocates them from the same pools and says how many it holds in ``check_integrity``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from hicache.hiradix.match import PendingLoad, StateHit, Transfer
from hicache.hiradix.node import Snapshot, TreeNode
from hicache.hiradix.pins import HostPins
from hicache.hiradix.shape import TreeShape


class SlotAllocator(Protocol):
    """What the tree needs of a state pool's free list (a :class:`PageAllocator` is one)."""

    @property
    def num_free(self) -> int: ...
    @property
    def num_used(self) -> int: ...
    def alloc(self, n: int) -> list[int]: ...
    def free(self, ids: list[int]) -> None: ...
    def is_allocated(self, slot: int) -> bool: ...


class StateSnapshots:
    """Snapshots of one tree (see the module docstring).

    Concurrency contract: not thread-safe; the thread that owns the tree (the scheduler thread)
    makes every call. L2 slots read outside the tree (an L3 write-back) are pinned in
    ``self.pins`` (a :class:`HostPins` over the L2 state pool) like L2 pages.
    """

    def __init__(self, shape: TreeShape, device: SlotAllocator, host: SlotAllocator | None,
                 emit: Callable[[Transfer], None], key: Callable[[TreeNode], tuple],
                 page_pins: HostPins | None = None) -> None:
        self.shape = shape
        self.page_pins = page_pins  # the tree's L2 page pins (pinned prefixes keep their snapshots)
        self.device = device
        self.host = host
        self.pins = HostPins(host) if host is not None else None
        self._emit = emit
        self._key = key
        self._on_device: set[TreeNode] = set()  # nodes whose snapshot has an L1 slot
        self._on_host: set[TreeNode] = set()  # ... an L2 slot
        self._loads: dict[TreeNode, tuple[PendingLoad, int]] = {}  # node -> its load, the L2 slot read
        self.demotions_dropped = 0  # L1 snapshots lost for want of an L2 slot

    # ------------------------------------------------------------------ the face
    def attach(self, node: TreeNode, slot: int) -> int | None:
        """``node`` (on L1; the one ending where the snapshot was taken) takes L1 ``slot``.
        Returns None when taken, else ``slot`` for the caller to free: the node already has an
        L1 snapshot (a duplicate), is the root, removed, or has no L1 pages."""
        if node.parent is None or node.removed or node.device_pages is None:
            return slot
        snap = node.snap
        if snap is not None and snap.device_slot is not None:
            return slot
        if snap is None:
            snap = node.snap = Snapshot()
        snap.device_slot = slot
        self._on_device.add(node)
        if node.host_pages is not None and snap.host_slot is None:
            self._copy_down(node)  # the node's KV is on L2 already: a write-through (and then L3) of the state
        return None

    def attach_host(self, node: TreeNode, slot: int) -> int | None:
        """A snapshot that arrived from L3 into L2 ``slot`` goes to ``node`` (which has L2 pages):
        None when taken (it is marked stored), else ``slot`` for the caller to free."""
        if node.parent is None or node.removed or node.host_pages is None or self.host is None:
            return slot
        snap = node.snap
        if snap is not None and snap.host_slot is not None:
            return slot
        if snap is None:
            snap = node.snap = Snapshot()
        snap.host_slot, snap.stored = slot, True
        self._on_host.add(node)
        return None

    def alloc_host(self) -> int | None:
        """One L2 slot (for a snapshot arriving from L3), evicting a snapshot alone when none is free
        (None: no L2 state pool, or every slot is held)."""
        host = self.host
        if host is None:
            return None
        if host.num_free < 1:
            self.evict_host(1)
        return host.alloc(1)[0] if host.num_free >= 1 else None

    def copy_down_all(self) -> int:
        """Give every L1 snapshot of a node with L2 pages an L2 copy (``state_backup``s; before a
        persist to L3); how many were copied."""
        todo = [nd for nd in self._on_device if nd.snap.host_slot is None and nd.host_pages is not None]
        return sum(self._copy_down(nd) for nd in sorted(todo, key=lambda nd: nd.id))

    def mark_stored(self, node: TreeNode) -> bool:
        """``node``'s snapshot was written to L3 (under its state key); False if it has none."""
        if node.snap is None or node.removed:
            return False
        node.snap.stored = True
        return True

    def cut(self, path: list[TreeNode]) -> int:
        """How many nodes of a matched ``path`` a state match keeps: up to the deepest one with a
        snapshot on L1 or L2 (0: none). One stored on L3 only is not a hit a request can use now:
        the L3 prefetch looks it up (from the deepest resident one on) and brings it to L2."""
        for i in range(len(path) - 1, -1, -1):
            if self.resident(path[i]):
                return i + 1
        return 0

    @staticmethod
    def resident(node: TreeNode) -> bool:
        """``node`` has a snapshot on L1 or L2."""
        snap = node.snap
        return snap is not None and (snap.device_slot is not None or snap.host_slot is not None)

    @staticmethod
    def hit(node: TreeNode) -> StateHit | None:
        snap = node.snap
        return None if snap is None else StateHit(node, snap.device_slot, snap.host_slot, snap.stored)

    def cached_slots(self, tier: str) -> int:
        """Slots held by snapshots on ``tier`` ("device" or "host")."""
        return len({"device": self._on_device, "host": self._on_host}[tier])

    # ------------------------------------------------------------------ eviction alone
    def evict_device(self, n: int) -> int:
        """Free ``n`` L1 slots if possible: snapshots of unlocked nodes, policy order, demoted to
        L2 where the node has L2 pages (dropped otherwise); the nodes keep their KV."""
        cands = sorted((nd for nd in self._on_device if nd.lock_ref == 0 and nd.snap.load is None
                        and (nd.snap.host_slot is not None or not self._pinned(nd))), key=self._key)
        for nd in cands[:n]:
            self._leave_device(nd)
        return min(n, len(cands))

    def evict_host(self, n: int, keep: TreeNode | None = None) -> int:
        """Free ``n`` L2 slots if possible: snapshots of unlocked nodes, not pinned, L2-only ones
        first, each group in policy order (``keep``'s is never taken)."""
        pins = self.pins
        if pins is None:
            return 0
        cands = [nd for nd in self._on_host if nd.lock_ref == 0 and nd is not keep and nd.snap.load is None
                 and not pins.any_pinned((nd.snap.host_slot,)) and not self._pinned(nd)]
        cands.sort(key=lambda nd: (nd.snap.device_slot is not None, self._key(nd)))
        for nd in cands[:n]:
            self._drop_host(nd)
        return min(n, len(cands))

    def _pinned(self, node: TreeNode) -> bool:
        """Some of ``node``'s L2 pages are pinned."""
        return self.page_pins is not None and node.host_pages is not None and self.page_pins.any_pinned(node.host_pages)

    # ------------------------------------------------------------------ cascade (Residency's hooks)
    def on_set_host(self, node: TreeNode) -> None:
        """``node`` just got L2 pages: its L1 snapshot is copied to L2 too (when L2 has room)."""
        snap = node.snap
        if snap is not None and snap.device_slot is not None and snap.host_slot is None:
            self._copy_down(node)

    def on_drop_device(self, node: TreeNode) -> None:
        """``node`` lost its L1 pages: its L1 snapshot goes (demoted when the node has L2 pages)."""
        if node.snap is not None and node.snap.device_slot is not None:
            self._leave_device(node)

    def on_drop_host(self, node: TreeNode) -> None:
        """``node`` lost its L2 pages (it stays on L1): its L2 snapshot goes."""
        if node.snap is not None and node.snap.host_slot is not None:
            self._drop_host(node)

    def on_remove(self, node: TreeNode) -> None:
        """``node`` leaves the tree: every slot it holds goes back (pinned L2 ones once unpinned)."""
        snap = node.snap
        if snap is None:
            return
        if snap.device_slot is not None:
            self.device.free([snap.device_slot])
            self._on_device.discard(node)
        if snap.host_slot is not None:
            self.pins.release([snap.host_slot])
            self._on_host.discard(node)
        node.snap = None

    # ------------------------------------------------------------------ load-back
    def alloc_device(self) -> int | None:
        """One L1 slot, evicting a snapshot alone when none is free (None: every one is held)."""
        if self.device.num_free < 1:
            self.evict_device(1)
        return self.device.alloc(1)[0] if self.device.num_free >= 1 else None

    def start_load(self, node: TreeNode, slot: int) -> PendingLoad:
        """Load ``node``'s L2 snapshot into L1 ``slot``: emits the ``state_load``; the caller holds
        a lock on ``node`` until :meth:`finish_load`. The L2 slot it reads is pinned until then (the
        lock does not keep a node's L2 copy: a prefetch may drop backups of locked nodes on L3)."""
        snap = node.snap
        assert snap is not None and snap.host_slot is not None and snap.device_slot is None, f"no L2 snapshot: {node!r}"
        pending = PendingLoad()
        snap.device_slot, snap.load = slot, pending
        self._on_device.add(node)
        self._loads[node] = (pending, snap.host_slot)
        self.pins.pin([snap.host_slot])
        self._emit(Transfer("state_load", [snap.host_slot], [slot], pending=pending))
        return pending

    def loading(self, node: TreeNode) -> bool:
        return node in self._loads

    def finish_load(self, node: TreeNode) -> None:
        """The state load of ``node`` is done (the caller then releases the load's lock)."""
        _, src = self._loads.pop(node)
        self.pins.unpin([src])
        node.snap.load = None

    @property
    def loads_in_flight(self) -> int:
        return len(self._loads)

    # ------------------------------------------------------------------ moves
    def _copy_down(self, node: TreeNode) -> bool:
        """Give ``node``'s L1 snapshot an L2 copy (a ``state_backup``); False without room."""
        host = self.host
        if host is None:
            return False
        if host.num_free < 1:
            self.evict_host(1, keep=node)
        if host.num_free < 1:
            return False
        snap = node.snap
        snap.host_slot = host.alloc(1)[0]
        self._on_host.add(node)
        self._emit(Transfer("state_backup", [snap.device_slot], [snap.host_slot], (node,)))
        return True

    def _leave_device(self, node: TreeNode) -> None:
        snap = node.snap
        if snap.host_slot is None and node.host_pages is not None and not self._copy_down(node):
            self.demotions_dropped += 1
        self.device.free([snap.device_slot])
        snap.device_slot = None
        self._on_device.discard(node)
        if snap.empty:
            node.snap = None

    def _drop_host(self, node: TreeNode) -> None:
        snap = node.snap
        self.pins.release([snap.host_slot])
        snap.host_slot = None
        self._on_host.discard(node)
        if snap.empty:
            node.snap = None

    # ------------------------------------------------------------------ integrity
    def check_integrity(self, device_in_use: int = 0, host_in_use: int = 0) -> None:
        """Raise AssertionError unless every snapshot is consistent: each L1 / L2 slot is free, held
        by exactly one node's snapshot, pinned and deferred (L2), or one of the caller's
        ``*_in_use``; a snapshot's tiers follow its node's KV (no L1 slot without L1 pages, no L2
        slot without L2 pages), is on some tier, and sits on a node in the tree; the per-tier
        sets and the loads in flight agree with the nodes (a loading snapshot: locked, both
        slots)."""
        dev: dict[int, TreeNode] = {}
        host: dict[int, TreeNode] = {}
        for nd in self.shape.nodes():
            snap = nd.snap
            if snap is None:
                assert nd not in self._on_device and nd not in self._on_host, f"stale snapshot entry: {nd!r}"
                continue
            assert not snap.empty, f"a snapshot on no tier: {nd!r}"
            for tier, slot, pages, owners, held in (
                ("L1", snap.device_slot, nd.device_pages, dev, self._on_device),
                ("L2", snap.host_slot, nd.host_pages, host, self._on_host),
            ):
                assert (slot is not None) == (nd in held), f"{tier} snapshot set disagrees: {nd!r}"
                if slot is None:
                    continue
                assert pages is not None, f"{tier} snapshot on a node without {tier} pages: {nd!r}"
                assert slot not in owners, f"{tier} state slot {slot} held by {owners[slot]!r} and {nd!r}"
                owners[slot] = nd
            if snap.load is not None:
                assert self._loads.get(nd, (None,))[0] is snap.load, f"a snapshot load the tree does not track: {nd!r}"
                assert nd.lock_ref > 0 and snap.device_slot is not None, f"loading snapshot unlocked or off L1: {nd!r}"
        assert len(dev) == len(self._on_device) and len(host) == len(self._on_host), (
            "a node outside the tree holds a snapshot slot"
        )
        for nd, (pending, src) in self._loads.items():
            assert not nd.removed and nd.snap is not None and nd.snap.load is pending, f"stale state load: {nd!r}"
            assert self.pins.count(src), f"the L2 slot {src} a state load reads is not pinned: {nd!r}"
        self._check_pool("L1 state", self.device, set(dev), device_in_use)
        if self.host is None:
            assert not host and host_in_use == 0, "L2 state slots without an L2 state pool"
            return
        deferred = self.pins.check_integrity(set(host))
        self._check_pool("L2 state", self.host, set(host) | deferred, host_in_use)

    @staticmethod
    def _check_pool(name: str, alloc: SlotAllocator, ids: set[int], in_use: int) -> None:
        check = getattr(alloc, "check_integrity", None)
        if check is not None:
            check()
        assert alloc.num_used == len(ids) + in_use, (
            f"{name}: {alloc.num_used} slots allocated != {len(ids)} held by snapshots + {in_use} in use by callers"
        )
        bad = sorted(s for s in ids if not alloc.is_allocated(s))
        assert not bad, f"{name}: snapshots hold slots not allocated in the pool: {bad[:8]}"
