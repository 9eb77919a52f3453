"""Cache events: which pages (by L3 page key) this worker holds on L1 / L2, as a feed.

Enabled with ``--enable-cache-events`` (server.enable_cache_events). The engine process
listens to its HiRadixTree (``add_listener``) and keeps a bounded log of events::

    [seq, op, tier, keys]     op: "add" | "remove" | "clear";  tier: "L1" | "L2" (None for clear)

``keys`` are :func:`hicache.keys.page_keys` of the node's pages (the chain from the root,
under the engine's namespace, ``EngineCore.kv_namespace``: the keys L3 stores them under), so
a router that tokenizes like the worker can compute the same keys for a request and see
exactly which worker holds its prefix on which tier.

``GET /cache_events?since=SEQ&epoch=E`` answers the events after ``SEQ``; when ``E`` is not
this engine's epoch (a restart) or the log no longer reaches back to ``SEQ``, it answers a
``snapshot`` of every page key per tier instead, and the reader starts over from it.
Keys of a node are memoized per node (re-derived when a split changed the node), so an
event costs hashing only the pages that are new.
"""

from __future__ import annotations

import itertools
import uuid
from collections import deque
from typing import Any

from hicache.hiradix import HiRadixTree
from hicache.keys import page_keys

MAX_EVENTS = 65536  # events kept; a reader further behind gets a snapshot
MAX_BATCH = 4096  # events per answer ("more": true when there are further ones)


class CacheEventLog:
    def __init__(self, tree: HiRadixTree, namespace: str, page_size: int, capacity: int = MAX_EVENTS) -> None:
        self.tree = tree
        self.namespace = namespace
        self.page_size = page_size
        self.epoch = uuid.uuid4().hex
        self.seq = 0
        self.events: deque[tuple[int, str, str | None, list[str]]] = deque(maxlen=capacity)
        self._memo: dict[int, tuple[int, int, list[str]]] = {}  # node id -> (parent id, len(key), keys)
        tree.add_listener(self.on_tree_event)

    # -- the tree's listener ---------------------------------------------------------------
    def on_tree_event(self, kind: str, node: Any) -> None:
        if kind == "device_add":
            self._append("add", "L1", self.node_keys(node))
        elif kind == "device_evict":
            self._append("remove", "L1", self.node_keys(node))
        elif kind == "host_add":
            self._append("add", "L2", self.node_keys(node))
        elif kind == "host_evict":  # an L2 backup dropped; the node stays on L1
            self._append("remove", "L2", self.node_keys(node))
        elif kind == "remove":
            if node.host_pages is not None:
                self._append("remove", "L2", self.node_keys(node))
            self._memo.pop(node.id, None)
        elif kind == "reset":
            self._memo.clear()
            self._append("clear", None, [])

    def _append(self, op: str, tier: str | None, keys: list[str]) -> None:
        self.seq += 1
        self.events.append((self.seq, op, tier, keys))

    def node_keys(self, node: Any) -> list[str]:
        """Page keys of ``node``'s own pages (memoized; valid while its parent and key stay)."""
        parent = node.parent
        if parent is None:
            return []
        hit = self._memo.get(node.id)
        if hit is not None and hit[0] == parent.id and hit[1] == len(node.key):
            return hit[2]
        above = self.node_keys(parent)
        parent_key = above[-1] if above else None
        keys = page_keys(node.key, self.page_size, self.namespace, parent_key)
        self._memo[node.id] = (parent.id, len(node.key), keys)
        return keys

    # -- reading ---------------------------------------------------------------------------
    def read(self, since: int, epoch: str | None) -> dict[str, Any]:
        head = {"epoch": self.epoch, "namespace": self.namespace, "page_size": self.page_size}
        first = self.events[0][0] if self.events else self.seq + 1
        if epoch != self.epoch or since < first - 1 or since > self.seq:
            return {**head, "last_seq": self.seq, "snapshot": self.snapshot(), "events": [], "more": False}
        start = since - first + 1
        batch = [list(e) for e in itertools.islice(self.events, start, start + MAX_BATCH)]
        last = batch[-1][0] if batch else since
        return {**head, "last_seq": last, "events": batch, "more": last < self.seq}

    def snapshot(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {"L1": [], "L2": []}
        stack = list(self.tree.root.children.values())
        while stack:
            nd = stack.pop()
            stack.extend(nd.children.values())
            keys = self.node_keys(nd)
            if nd.device_pages is not None:
                out["L1"] += keys
            if nd.host_pages is not None:
                out["L2"] += keys
        return out

