"""Matcher: the tree's prefix matches, read-only lookups and load-backs, state snapshots included.

A match walks the full pages of the tokens (:class:`~hicache.hiradix.shape.TreeShape`), counts the
hit on the path, and asks :class:`~hicache.hiradix.tiering.Tiering` to back hit nodes up when the
write policy says so. For a model with state layers (``needs_state``) it stops at the deepest node
on the path with a state snapshot on L1 or L2 (:class:`~hicache.hiradix.state_snapshots.
StateSnapshots` owns those): anything deeper would need a state nobody kept, so it is recomputed.
A load-back brings the L2 run and the snapshot to L1 together, all or nothing. See tree.py for the
invariants and the ordering contract of the transfers it emits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from hicache.hiradix.match import MatchResult, PendingLoad
from hicache.hiradix.node import TreeNode
from hicache.hiradix.residency import Residency
from hicache.hiradix.shape import TreeShape
from hicache.hiradix.state_snapshots import StateSnapshots
from hicache.hiradix.tiering import StaleMatch, Tiering
from hicache.tiers.allocator import PageAllocator


class Matcher:
    """Matches and load-backs of one tree.

    Concurrency contract: not thread-safe; the thread that owns the tree makes every call.
    """

    def __init__(self, shape: TreeShape, residency: Residency, tiering: Tiering, state: StateSnapshots | None,
                 host: PageAllocator | None) -> None:
        self.shape = shape
        self.residency = residency
        self.tiering = tiering
        self.state = state
        self.host = host

    def match_prefix(self, tokens: Sequence[int], needs_state: bool) -> MatchResult:
        """Longest cached prefix of the full pages of ``tokens``.

        Splits the node where the match ends mid-node; bumps ``hit_count`` and
        ``last_access`` on the matched path; backs hit nodes up to L2 when the write
        policy says so (skipped silently when L2 has no room). ``needs_state`` cuts the
        match at the deepest node with a state snapshot on L1 or L2 (``MatchResult.state``
        says where it is; a snapshot being loaded adds its load to ``pending_loads``);
        nothing below it is a hit, and a path without one matches nothing.
        """
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        path, pos = self.shape.match_path(tokens)
        if needs_state:
            path = path[: self.state.cut(path)] if self.state is not None else []
            pos = sum(len(nd.key) for nd in path)
        tick = self.shape.next_tick()
        dev_pages: list[int] = []
        dev_node = host_node = self.shape.root
        to_backup = []
        loads: dict[int, PendingLoad] = {}
        should_backup = self.tiering.write_policy.should_backup_on_hit
        for nd in path:
            nd.hit_count += 1
            nd.last_access = tick
            if nd.device_pages is not None:
                dev_pages += nd.device_pages
                dev_node = nd
                if nd.load is not None:
                    loads.setdefault(id(nd.load), nd.load)
                if nd.host_pages is None and self.host is not None and should_backup(nd):
                    to_backup.append(nd)
            host_node = nd
        if to_backup:
            self.tiering.backup(to_backup, protect=host_node)
        state = None
        if needs_state and path:
            state = StateSnapshots.hit(host_node)
            if host_node.snap.load is not None:
                loads.setdefault(id(host_node.snap.load), host_node.snap.load)
        dev_tokens = len(dev_pages) * self.shape.page_size
        return MatchResult(dev_pages, dev_tokens, pos - dev_tokens, dev_node, host_node, tuple(loads.values()),
                           state)

    def lookup(self, tokens: Sequence[int], needs_state: bool) -> tuple[TreeNode, int]:
        """Read-only match (no split, no hit counts, no backups): the deepest node the full
        pages of ``tokens`` reach (one they end inside included; the root if none) and the
        number of matched tokens (on L1 or L2). ``needs_state``: the deepest whole node with a
        state snapshot instead, as :meth:`match_prefix` cuts."""
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        last, end = self.shape.root, 0
        for child, pos, m in self.shape.walk(tokens, len(tokens) - len(tokens) % self.shape.page_size):
            if not needs_state or (m == len(child.key) and StateSnapshots.resident(child)):
                last, end = child, pos + m
        return last, end

    def node_at(self, tokens: Sequence[int]) -> TreeNode | None:
        """The node ending exactly at the last full page of ``tokens`` (splitting the one they
        end inside), or None when the tree does not hold them all: where a request that just
        inserted ``tokens`` attaches its snapshot. Counts no hit."""
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        n = len(tokens) - len(tokens) % self.shape.page_size
        path, pos = self.shape.match_path(tokens)
        return path[-1] if path and pos == n else None

    # ------------------------------------------------------------------ load-back
    def load_back(self, match: MatchResult) -> MatchResult:
        """Bring the L2-only part of ``match`` back to L1 (see :meth:`Tiering.load_back`).

        A state match (``match.state``) loads its L2 run whatever the load-back threshold (the
        snapshot at its end is the only way to use it), and its snapshot when that is on L2 only:
        a ``state_load`` Transfer with its own PendingLoad (in the result's ``pending_loads``),
        the node locked until :meth:`finish_load`. All or nothing: ``match`` comes back unchanged
        when L1 has no room for the run or no state slot can be freed, or when the snapshot is
        on L3 only (fetch it into L2 first). A stale match raises :class:`StaleMatch`.
        """
        hit, state = match.state, self.state
        if hit is None or state is None:
            return self.tiering.load_back(match)
        if hit.device_slot is not None:
            return self.tiering.load_back(match, threshold=1)
        if hit.host_slot is None:
            return match
        node = hit.node
        snap = node.snap
        if node.removed or snap is None or snap.host_slot != hit.host_slot or snap.device_slot is not None:
            raise StaleMatch("the tree changed since this match")
        self.residency.lock(node)  # making room must not take this snapshot; then it is the load's lock
        slot = state.alloc_device()
        loaded = self.tiering.load_back(match, threshold=1) if slot is not None else None
        if loaded is None or (match.host_hit_tokens and loaded is match):
            if slot is not None:
                state.device.free([slot])
            self.residency.unlock(node)
            return match
        pending = state.start_load(node, slot)
        return replace(loaded, state=state.hit(node), pending_loads=(*loaded.pending_loads, pending))

    def finish_load(self, node: TreeNode) -> None:
        """The loads ending at ``node`` are done: its L2 run's (see :meth:`Tiering.finish_load`)
        and its snapshot's; raises ValueError when neither is in flight."""
        state_load = self.state is not None and self.state.loading(node)
        if not state_load or self.tiering.has_load(node):
            self.tiering.finish_load(node)
        if state_load:
            self.state.finish_load(node)
            self.residency.unlock(node)
