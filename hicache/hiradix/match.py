"""Value objects the tree hands out: the result of a prefix match (with the state snapshot it ends
at), a page or state-slot transfer order and the handle of a load in flight."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal

from hicache.hiradix.node import TreeNode


class PendingLoad:
    """One L2 -> L1 load in flight: the pages it fills hold no KV until it is :meth:`done`.

    Concurrency contract: ``load_back`` (scheduler thread) creates it, puts it on every node
    of the chain (``TreeNode.load``) and in the load's :class:`Transfer`; the cache controller
    that executes the transfer binds the copy's future to it (:meth:`bind`, once, on the
    scheduler thread, before the transfer list returns). Every reader of those L1 pages --
    the request that started the load and any later match that reports them as L1 hits
    (``MatchResult.pending_loads``) -- must not run a forward pass over them until
    :meth:`done` is true -- or, when the copy runs on a GPU stream and its future exposes
    per-layer events (:meth:`layer_events`), until that forward pass is queued behind those
    events on the GPU (layer ``i`` waits for event ``i``). ``done()`` may be polled from any
    thread; it never blocks. An unbound load is not done.
    """

    __slots__ = ("_future",)

    def __init__(self) -> None:
        self._future: Future | None = None

    def bind(self, future: Future) -> None:
        if self._future is not None:
            raise RuntimeError("a pending load is bound once")
        self._future = future

    def done(self) -> bool:
        return self._future is not None and self._future.done()

    def layer_events(self) -> list | None:
        """The copy's per-layer GPU events (opaque here), or None when readers must wait for
        :meth:`done` on the host (CPU copies, unbound loads)."""
        return None if self._future is None else getattr(self._future, "layer_events", None)

    def wait(self) -> None:
        """Block until the copy has landed (raises what the copy raised); for teardown."""
        if self._future is None:
            raise RuntimeError("waiting for a load that was never started")
        self._future.result()


@dataclass(frozen=True)
class StateHit:
    """The state snapshot a match of a state model ends at: ``node``'s (the match's last node),
    where it was when the match was made: ``device_slot`` (L1, ready to copy into the request's
    working slot once ``node.snap.load``, if any, is done) or ``host_slot`` (L2 only:
    ``HiRadixTree.load_back`` brings it to L1); ``stored``: L3 has it too. A match never ends at a
    snapshot on L3 only (the L3 prefetch brings those to L2 first)."""

    node: TreeNode
    device_slot: int | None
    host_slot: int | None
    stored: bool

    @property
    def tier(self) -> Literal["device", "host"]:
        """The nearest tier holding it."""
        return "device" if self.device_slot is not None else "host"


@dataclass(frozen=True)
class MatchResult:
    """The longest cached prefix of a token sequence.

    - ``device_pages``: L1 page ids of the prefix that is on L1, in order
      (``len(device_pages) * page_size == device_hit_tokens``).
    - ``host_hit_tokens``: tokens after the L1 hit that are cached on L2 only; they
      run from ``last_device_node`` (exclusive) down to ``last_host_node``.
    - ``last_device_node``: deepest matched node on L1 (the root when there is no hit);
      lock this one for a request that reads ``device_pages``.
    - ``last_host_node``: deepest matched node on L1 or L2.
    - ``pending_loads``: loads still filling some of ``device_pages`` (or the L1 slot of
      ``state``); a reader waits until each is ``done()`` before it computes on them (see
      :class:`PendingLoad`).
    - ``state``: a tree of a state model (``needs_state``) cuts the match at the deepest node
      on the path that has a state snapshot on L1 or L2; this says where that one is. ``None``
      without a cut, and when the path has no snapshot (the match is then empty: a request
      starts from the zero state).
    """

    device_pages: list[int]
    device_hit_tokens: int
    host_hit_tokens: int
    last_device_node: TreeNode
    last_host_node: TreeNode
    pending_loads: tuple[PendingLoad, ...] = ()
    state: StateHit | None = None

    @property
    def cached_tokens(self) -> int:
        """Tokens cached on L1 or L2."""
        return self.device_hit_tokens + self.host_hit_tokens

    @property
    def resumable(self) -> bool:
        """A request can compute from ``device_hit_tokens`` now (once ``pending_loads`` are done):
        nothing left on L2 and, for a state model, the snapshot there on L1. Without state, any
        match is resumable at its L1 part; a state match that is not (its L2 run or snapshot not
        loaded) is usable only from the start."""
        return self.state is None or (self.host_hit_tokens == 0 and self.state.device_slot is not None)


TRANSFER_KINDS = ("backup", "load", "state_backup", "state_load", "window_load")


@dataclass(frozen=True)
class Transfer:
    """An order for the cache controller to copy pages between tiers.

    ``kind == "backup"``: L1 ``src_pages`` → L2 ``dst_pages``;
    ``kind == "load"``: L2 ``src_pages`` → L1 ``dst_pages``. Same length, in order.
    ``kind == "window_load"``: a hybrid SWA L1's window-only load: the sliding layers' KV of L2
    ``src_pages`` into the window pages of L1 ``dst_pages`` (whose full layers are there already); not the
    tree's: the request side's window policy (``serving/cache/request_windows.py``) orders it, with its
    ``pending``.
    ``kind == "state_backup"`` / ``"state_load"``: the same for state snapshots, whose
    "pages" are slot ids of the L1 state pool (``hicache/tiers/state_pool.py``) and the L2
    one (:class:`~hicache.tiers.host_state.HostStatePool`); a state load carries its
    ``pending``, a state backup its node. Only a tree with state pools emits them.
    Transfers must be executed in the order the tree emitted them.
    """

    kind: Literal["backup", "load", "state_backup", "state_load", "window_load"]
    src_pages: list[int]
    dst_pages: list[int]
    # backups: the nodes whose pages these are, in order (so a controller can write
    # them on to L3 under their page keys); empty for loads
    nodes: tuple[TreeNode, ...] = field(default=(), compare=False, repr=False)
    # loads: the handle readers wait on; the executing controller binds its copy to it
    pending: PendingLoad | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in TRANSFER_KINDS:
            raise ValueError(f"unknown transfer kind {self.kind!r}")
        if len(self.src_pages) != len(self.dst_pages):
            raise ValueError("src_pages and dst_pages differ in length")
