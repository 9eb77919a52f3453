"""HiRadixTree: a radix tree over token pages recording which tier holds each page's KV.

Pure bookkeeping: no tensors. The tree decides; a controller elsewhere moves bytes according to the
:class:`Transfer` orders drained with :meth:`HiRadixTree.take_transfers`.

Invariants (checked by :meth:`HiRadixTree.check_integrity`):
- Every non-root node holds at least one copy (L1 and/or L2). A node that loses its last copy leaves the
  tree together with its subtree (whose nodes are L2-only and unlocked, since locks cover whole paths).
- L1 residency is prefix-closed: a node on L1 has its parent on L1 (or is a child of the root). So a
  match is: an L1 run from the root, then an L2-only run.
- Locks cover the path root→node; locked nodes are never evicted from L1 nor dropped from L2. A loading
  node is locked (by the load itself). Holds (:meth:`hold`: a waiting request's cached prefix) cover the
  path too; L2 eviction for an L3 fetch, or for an L1 demotion of pages L3 holds, passes held nodes over.
- L2 pages pinned by a reader outside the tree (an L3 write-back, :meth:`pin_host`) are never handed out
  again while pinned: the node keeps them, or, if the tree drops the node meanwhile, the pages wait in a
  deferred set until :meth:`unpin_host` frees them. Pins do not lock: a pinned node may still lose its L1
  copy (write-back never pins L1).
- Write policy ``exclusive``: a node on both L1 and L2 is hot, loading, pinned or backed up on purpose
  (hicache/hiradix/exclusive.py).

Parts (each owns its state; the tree composes them and is the one face callers use), in hicache/hiradix/:
``TreeShape`` (shape.py: nodes, keys, walks, splits), ``Residency`` (residency.py: tier copies, counters,
locks, eviction candidates), ``HostPins`` (pins.py, ``tree.pins``: L2 pages read outside the tree),
``TreeEvents`` (events.py: listeners, tenant ledger), ``Tiering`` (tiering.py: eviction, backup, load-back,
the transfer outbox), ``L3Marks`` (l3_marks.py: pages from and to L3), ``Matcher`` (matcher.py: matches,
lookups, load-backs), ``StateSnapshots`` (state_snapshots.py, ``tree.state``: recurrent-state snapshots
for a model with state layers; None otherwise).

Transfer ordering contract: the caller drains :meth:`take_transfers` right after each tree operation and
executes the transfers in the order given, and it must execute (or at least order on its copy stream) the
drained backups before it writes to any L1 page freed meanwhile: eviction frees L1 pages into the
allocator immediately, right after emitting the backup that still reads them. ``load_back`` may reuse
such a page as a load destination in the same operation; the order of the outbox covers it. A queued
backup's L2 pages: hicache/hiradix/outbox.py. Nodes being
loaded report as L1 hits to later matches, with the load's :class:`~hicache.hiradix.match.PendingLoad`
in ``MatchResult.pending_loads``: every reader, like the request that started the load, waits until it is
done before computing on them.

Typical request (scheduler)::

    m = tree.match_prefix(tokens)
    m = tree.load_back(m)                 # no-op unless m.host_hit_tokens > 0
    tree.lock(m.last_device_node)
    ... wait until every m.pending_loads is done() (without blocking the loop) ...
    ... allocate the uncached pages (tree.evict_device(k) when short), prefill, decode ...
    dup = tree.insert(tokens_with_output, m.device_pages + new_pages)
    allocator.free(dup)
    tree.unlock(m.last_device_node)
    tree.finish_load(node) once the controller reports the load done (if one was started)
    transfers = tree.take_transfers()     # after every call above that may emit

A model with state layers (a tree built with ``state_device``): the match stops at the deepest snapshot
(``m.state``); after ``load_back`` a request with ``m.resumable`` copies the snapshot (``m.state.device_slot``;
none: the zero state) into its working slot once ``m.pending_loads`` are done, else it starts from scratch;
at the end it inserts, then ``tree.attach_state(tree.node_at(tokens), snap_slot)`` gives the tree the state
at its last full page (a refused slot is the caller's to free).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from typing import TYPE_CHECKING

from hicache.config import CacheConfig
from hicache.hiradix.events import TreeEvents
from hicache.hiradix.exclusive import ExclusiveTiers
from hicache.hiradix.integrity import check_states, check_tree
from hicache.hiradix.l3_marks import L3Marks
from hicache.hiradix.match import MatchResult, Transfer
from hicache.hiradix.matcher import Matcher
from hicache.hiradix.node import TreeNode
from hicache.hiradix.pins import HostPins
from hicache.hiradix.policies import EvictionPolicy, WritePolicy, make_eviction_policy, make_write_policy
from hicache.hiradix.residency import Residency
from hicache.hiradix.sessions import SessionTable
from hicache.hiradix.shape import TreeShape
from hicache.hiradix.state_snapshots import SlotAllocator, StateSnapshots
from hicache.hiradix.tiering import Tiering
from hicache.hiradix.unbounded import UnboundedAllocator
from hicache.tiers.allocator import PageAllocator

if TYPE_CHECKING:
    from hicache.hiradix.quota import TenantLedger


class HiRadixTree:
    """See the module docstring.

    Concurrency contract: not thread-safe; the scheduler thread owns the tree and every part (callers
    that read L2 pages on other threads pin them first: :meth:`pin_host`).

    Eviction, backup and load-back are :class:`Tiering`'s (``self.tiering``); the L3 inserts and stored
    marks :class:`L3Marks`' (``self.l3``); the methods below are the public API.
    """

    def __init__(
        self,
        page_size: int,
        device: PageAllocator | None,
        host: PageAllocator | None = None,
        write_policy: str = "write_through",
        write_through_threshold: int = 2,
        load_back_threshold: int = 1,
        eviction_policy: str = "lru",
        state_device: SlotAllocator | None = None,
        state_host: SlotAllocator | None = None,
    ) -> None:
        """``state_device`` / ``state_host``: the free lists of the L1 / L2 state pools of a model
        with state layers (its snapshots then live in the tree, and matches stop at them)."""
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if device is None and host is not None:
            raise ValueError("a host (L2) pool needs a device (L1) pool")
        if state_host is not None and (state_device is None or host is None):
            raise ValueError("an L2 state pool needs an L1 state pool and an L2 (host) pool")
        self.page_size = page_size
        self.pool_less = device is None
        self.device: PageAllocator | UnboundedAllocator = UnboundedAllocator() if device is None else device
        self.host = host
        self.sessions = SessionTable()
        self.shape = TreeShape(page_size)
        self.events = TreeEvents()
        self.pins = HostPins(host)  # L2 pages readers outside the tree hold (pin_host)
        evict = make_eviction_policy(eviction_policy)
        self.state = None if state_device is None else StateSnapshots(
            self.shape, state_device, state_host, lambda t: self.tiering.emit(t), evict.key, self.pins)
        self.residency = Residency(self.shape, self.device, host, self.pins, self.events, self.state)
        self.tiering = Tiering(self.shape, self.residency, self.pins, self.events, self.device, host,
                               make_write_policy(write_policy, write_through_threshold), evict,
                               load_back_threshold)
        self.l3 = L3Marks(self.shape, self.residency, host, self.tiering.exclusive)
        self.matcher = Matcher(self.shape, self.residency, self.tiering, self.state, host)

    @classmethod
    def from_config(
        cls, config: CacheConfig, device: PageAllocator | None, host: PageAllocator | None = None,
        state_device: SlotAllocator | None = None, state_host: SlotAllocator | None = None,
    ) -> HiRadixTree:
        return cls(config.page_size, device, host, write_policy=config.hicache_write_policy,
                   write_through_threshold=config.write_through_threshold,
                   load_back_threshold=config.load_back_threshold, eviction_policy=config.eviction_policy,
                   state_device=state_device, state_host=state_host)

    @property
    def root(self) -> TreeNode:
        return self.shape.root

    @property
    def needs_state(self) -> bool:
        """The model has state layers: a match stops at the deepest state snapshot."""
        return self.state is not None

    @property
    def write_policy(self) -> WritePolicy:
        return self.tiering.write_policy

    @property
    def eviction_policy(self) -> EvictionPolicy:
        return self.tiering.eviction_policy

    @property
    def load_back_threshold(self) -> int:
        return self.tiering.load_back_threshold

    @property
    def backups_skipped_pages(self) -> int:
        """L1 pages that got no L2 copy because L2 had no room, while L3 lacks them (an eviction
        then loses them)."""
        return self.tiering.backups_skipped_pages

    # ------------------------------------------------------------------ match / insert
    def match_prefix(self, tokens: Sequence[int], needs_state: bool | None = None) -> MatchResult:
        """Longest cached prefix of the full pages of ``tokens`` (see :meth:`Matcher.match_prefix`:
        a split where it ends mid-node, hit counts, backups on hit; ``needs_state``, default the
        tree's, cuts it at the deepest state snapshot)."""
        return self.matcher.match_prefix(tokens, self.needs_state if needs_state is None else needs_state)

    def lookup(self, tokens: Sequence[int], needs_state: bool | None = None) -> tuple[TreeNode, int]:
        """Read-only match (no split, no hit counts, no backups): the deepest node reached and the
        tokens matched on L1 or L2 (see :meth:`Matcher.lookup`)."""
        return self.matcher.lookup(tokens, self.needs_state if needs_state is None else needs_state)

    def node_at(self, tokens: Sequence[int]) -> TreeNode | None:
        """The node ending at the last full page of ``tokens``, or None (see :meth:`Matcher.node_at`)."""
        return self.matcher.node_at(tokens)

    def attach_state(self, node: TreeNode, slot: int) -> int | None:
        """``node`` takes the state snapshot in L1 state ``slot`` (the state after its last token);
        returns None, or ``slot`` for the caller to free when refused (a duplicate, or a node not
        on L1: see :meth:`StateSnapshots.attach`)."""
        if self.state is None:
            raise ValueError("attach_state on a tree without state pools")
        return self.state.attach(node, slot)

    def walk(self, tokens: list[int], n: int) -> Iterator[tuple[TreeNode, int, int]]:
        """Read-only walk over ``tokens[:n]`` (page-aligned ``n``): each node it reaches with
        the position it starts at and how many of its tokens match (the last may match part).
        A generator: finish or drop it before the tree changes."""
        return self.shape.walk(tokens, n)

    def peek_prefix_len(self, tokens: Sequence[int]) -> int:
        """Tokens of ``tokens`` cached on L1 or L2, untouched (for ordering a waiting queue)."""
        return self.lookup(tokens)[1]

    def insert(self, tokens: Sequence[int], device_pages: Sequence[int]) -> list[int]:
        """Insert the full pages of ``tokens`` held in L1 pages ``device_pages``.

        ``device_pages`` needs one id per full page (extra ids are ignored and stay
        the caller's). Returns the ids the caller must free: those of pages the tree
        already holds on L1 under a different id. Nodes on the path that are on L2
        only adopt the given pages. New nodes get ``hit_count == 0``.
        """
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        shape, residency = self.shape, self.residency
        ps = self.page_size
        n = len(tokens) - len(tokens) % ps
        if len(device_pages) < n // ps:
            raise ValueError(f"{n // ps} full pages but only {len(device_pages)} device pages")
        tick = shape.next_tick()
        node, pos, dup, adopted = shape.root, 0, [], []
        while pos < n:
            child = node.children.get(tuple(tokens[pos : pos + ps]))
            if child is None:
                new = shape.add_child(node, tokens[pos:n], tick)
                residency.set_device(new, list(device_pages[pos // ps : n // ps]))
                break
            child, end = shape.descend(child, tokens, pos, n)
            given = list(device_pages[pos // ps : end // ps])
            if child.device_pages is None:
                residency.set_device(child, given)
                adopted.append(child)
            elif child.device_pages != given:
                dup.extend(b for a, b in zip(child.device_pages, given, strict=True) if a != b)
            child.last_access = tick
            node, pos = child, end
        self.tiering.exclusive.drop_duplicates(adopted)  # exclusive: a recomputed page's L2 copy goes
        return dup

    def insert_host(self, tokens: Sequence[int], host_pages: Sequence[int], start_page: int = 0) -> list[int]:
        """Insert pages that arrived from L3 into L2 (see :meth:`L3Marks.insert_host`)."""
        return self.l3.insert_host(tokens, host_pages, start_page)

    def mark_stored(self, tokens: Sequence[int], lo: int, hi: int) -> int:
        """Pages ``lo <= i < hi`` of ``tokens``' path are on L3 (see :meth:`L3Marks.mark_stored`)."""
        return self.l3.mark_stored(tokens, lo, hi)

    # ------------------------------------------------------------------ locks, pins
    def lock(self, node: TreeNode) -> None:
        """``lock_ref += 1`` on the path root→node (no-op for the root)."""
        self.residency.lock(node)

    def unlock(self, node: TreeNode) -> None:
        """``lock_ref -= 1`` on the path root→node; raises if the node is not locked."""
        self.residency.unlock(node)

    def hold(self, node: TreeNode, delta: int = 1) -> None:
        """A waiting request holds (``delta`` 1) or releases (-1) ``node`` as its cached prefix: ``wait_ref``
        on the path root→node (see :class:`TreeNode`)."""
        self.residency.hold(node, delta)

    def pin_host(self, pages: Sequence[int]) -> None:
        """A reader outside the tree (an L3 write-back) reads L2 ``pages`` until :meth:`unpin_host`:
        never dropped by L2 eviction nor reused meanwhile (a node removed while pinned leaves them
        deferred). Pins nothing on L1."""
        self.pins.pin(pages)

    def unpin_host(self, pages: Sequence[int]) -> None:
        """End one pin of each page; frees pages the tree dropped meanwhile, and (exclusive tiers) the L2
        copies of cold L1 nodes that only these pins kept."""
        self.pins.unpin(pages)
        self.tiering.exclusive.unpinned()

    @property
    def host_pinned(self) -> int:
        """Distinct L2 pages pinned now (for tests and stats)."""
        return len(self.pins)

    # ------------------------------------------------------------------ tier moves
    def evict_device(self, num_pages: int) -> int:
        """Free at least ``num_pages`` L1 pages if possible (see :meth:`Tiering.evict_device`)."""
        return self.tiering.evict_device(num_pages)

    @property
    def exclusive(self) -> ExclusiveTiers:
        """The exclusive mode's rules (``.on``: write policy ``exclusive``; ``.dirty_tail()``)."""
        return self.tiering.exclusive

    def on_l3(self, node: TreeNode) -> bool:
        """Whether all of ``node``'s pages are known to be on L3 (see :meth:`Tiering.on_l3`)."""
        return self.tiering.on_l3(node)

    def evict_host(self, num_pages: int, drop_backups: bool = False, spare_held: bool = False) -> int:
        """Free ``num_pages`` L2 pages if possible (see :meth:`Tiering.evict_host`)."""
        return self.tiering.evict_host(num_pages, drop_backups, spare_held)

    def drop_tail_for_l3(self, tokens: Sequence[int], from_page: int) -> int:
        """Drop the tail of ``tokens``' path that L3 holds (see :meth:`Tiering.drop_tail_for_l3`)."""
        return self.tiering.drop_tail_for_l3(list(tokens), from_page)

    def load_back(self, match: MatchResult) -> MatchResult:
        """Bring the L2-only part of ``match`` back to L1, and its state snapshot (see
        :meth:`Matcher.load_back`)."""
        return self.matcher.load_back(match)

    def finish_load(self, node: TreeNode) -> None:
        """The loads ending at ``node`` are done (see :meth:`Matcher.finish_load`)."""
        self.matcher.finish_load(node)

    def backup_all(self) -> int:
        """Give every L1 node an L2 copy as far as L2 has room (see :meth:`Tiering.backup_all`)."""
        return self.tiering.backup_all()

    def backup_prefix(self, tokens: list[int]) -> int:
        """Give the L1 nodes on ``tokens``' path an L2 copy now (see :meth:`Tiering.backup_prefix`)."""
        return self.tiering.backup_prefix(tokens)

    def demote(self, nodes: list[TreeNode], protect: TreeNode | None = None) -> int:
        """L2 copies for L1 nodes about to lose part of their L1 KV (see :meth:`Tiering.demote`)."""
        return self.tiering.demote(nodes, protect)

    def take_transfers(self) -> list[Transfer]:
        """Drain the outbox (see the ordering contract in the module docstring)."""
        return self.tiering.take()

    # ------------------------------------------------------------------ events
    @property
    def ledger(self) -> TenantLedger | None:
        """The per-tenant ledger (:meth:`set_ledger`), or None."""
        return self.events.ledger

    def add_listener(self, fn: Callable[[str, TreeNode], None]) -> None:
        """Call ``fn(kind, node)`` after each change (kinds: :mod:`hicache.hiradix.events`)."""
        self.events.add_listener(fn)

    def set_ledger(self, ledger: TenantLedger) -> None:
        """Count pages per tenant, and evict tenants over their quota first."""
        self.events.set_ledger(ledger)

    # ------------------------------------------------------------------ sessions
    def open_session(self, session_id: str) -> None:
        self.sessions.open(session_id)

    def attach_session(self, session_id: str, node: TreeNode) -> None:
        self.sessions.attach(session_id, node)

    def close_session(self, session_id: str) -> None:
        self.sessions.close(session_id)

    # ------------------------------------------------------------------ admin / stats
    def reset(self, keep: Collection[int] = ()) -> None:
        """Drop every node and its pages (flush). Refuses while anything is locked.

        Pending transfers are discarded and sessions stay open but detached. With ``keep`` (L2
        page ids: the KV control's pin leases), the nodes holding one of them stay with their
        ancestors, on L2 only, and everything else goes as an eviction would drop it (one event
        per node, sessions attached as before: :meth:`Residency.clear_except`).
        """
        root = self.shape.root
        if any(c.lock_ref for c in root.children.values()) or self.tiering.loading or (
                self.state is not None and self.state.loads_in_flight):
            raise RuntimeError("cannot reset the tree while requests hold locks")
        self.tiering.discard_transfers()
        if keep:
            self.residency.clear_except(keep)
            return
        self.residency.clear()
        self.sessions.detach_all()
        self.events.emit("reset", root)

    def cached_pages(self, tier: str) -> int:
        """Pages held by the tree on ``tier`` ("device" or "host")."""
        return self.residency.cached_pages(tier)

    def evictable_pages(self, tier: str) -> int:
        """Pages on ``tier`` that eviction could free now (host: L2-only unlocked nodes; O(tree))."""
        return self.residency.evictable_pages(tier)

    @property
    def num_nodes(self) -> int:
        return self.shape.num_nodes

    def nodes(self) -> list[TreeNode]:
        """All nodes except the root (DFS order)."""
        return self.shape.nodes()

    def path_tokens(self, node: TreeNode) -> list[int]:
        """The tokens of the path root→node."""
        return self.shape.path_tokens(node)

    def check_integrity(self, device_in_use: int = 0, host_in_use: int = 0,
                        state_device_in_use: int = 0, state_host_in_use: int = 0) -> None:
        """Raise AssertionError unless the tree and its pools are consistent.

        ``*_in_use``: pages (state slots) the caller allocated from the pool and holds outside
        the tree (e.g. pages of running requests not inserted yet, duplicates returned by
        insert and not freed yet; working state slots). Pages of matched prefixes belong to
        the tree.
        """
        check_tree(self, device_in_use, host_in_use)
        check_states(self, state_device_in_use, state_host_in_use)
