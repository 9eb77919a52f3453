"""HiRadixTree: a radix tree over token pages recording which tier holds each page's KV.

Pure bookkeeping: no tensors. The tree decides; a controller elsewhere moves bytes
according to the :class:`Transfer` orders drained with :meth:`HiRadixTree.take_transfers`.

Invariants (checked by :meth:`HiRadixTree.check_integrity`):
- Every non-root node holds at least one copy (L1 and/or L2). A node that loses its
  last copy leaves the tree together with its subtree (whose nodes are L2-only and
  unlocked, since locks cover whole paths).
- L1 residency is prefix-closed: a node on L1 has its parent on L1 (or is a child of
  the root). So a match is: an L1 run from the root, then an L2-only run.
- Locks cover the path root→node; locked nodes are never evicted from L1 nor
  dropped from L2. A loading node is locked (by the load itself).
- L2 pages pinned by a reader outside the tree (an L3 write-back, :meth:`pin_host`) are
  never handed out again while pinned: the node keeps them, or, if the tree drops the
  node meanwhile, the pages wait in a deferred set until :meth:`unpin_host` frees them.
  Pins do not lock: a pinned node may still lose its L1 copy (write-back never pins L1).

Transfer ordering contract: the caller drains :meth:`take_transfers` right after each
tree operation and executes the transfers in the order given, and it must execute
(or at least order on its copy stream) the drained backups before it writes to any
L1 page freed meanwhile: eviction frees L1 pages into the allocator immediately,
right after emitting the backup that still reads them. ``load_back`` may reuse such
a page as a load destination in the same operation; the order of the outbox covers it.
Nodes being loaded report as L1 hits to later matches, with the load's
:class:`~hicache.hiradix.match.PendingLoad` in ``MatchResult.pending_loads``: every reader,
like the request that started the load, waits until it is done before computing on them.

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
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from hicache.config import CacheConfig
from hicache.hiradix.integrity import check_tree
from hicache.hiradix.match import MatchResult, PendingLoad, Transfer
from hicache.hiradix.node import TreeNode
from hicache.hiradix.policies import make_eviction_policy, make_write_policy
from hicache.hiradix.sessions import SessionTable
from hicache.hiradix.storage_ops import StorageOpsMixin
from hicache.hiradix.tiering import TieringMixin
from hicache.hiradix.unbounded import UnboundedAllocator
from hicache.tiers.allocator import PageAllocator


class HiRadixTree(TieringMixin, StorageOpsMixin):
    """See the module docstring. Not thread-safe: the scheduler thread owns it.

    Eviction, backup and load-back live in :class:`TieringMixin` (tiering.py); the L3
    support (insert_host, mark_stored, path helpers) in :class:`StorageOpsMixin`
    (storage_ops.py).
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
        session_timeout: float = 600.0,
    ) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if device is None and host is not None:
            raise ValueError("a host (L2) pool needs a device (L1) pool")
        self.page_size = page_size
        self.pool_less = device is None
        self.device: PageAllocator | UnboundedAllocator = UnboundedAllocator() if device is None else device
        self.host = host
        self.write_policy = make_write_policy(write_policy, write_through_threshold)
        self.eviction_policy = make_eviction_policy(eviction_policy)
        self.load_back_threshold = load_back_threshold
        self.sessions = SessionTable(session_timeout)
        self._ids = itertools.count(1)
        self.root = TreeNode(0, [], device_pages=[], host_pages=[])
        self._tick = 0
        self._outbox: list[Transfer] = []
        self._loads: dict[TreeNode, TreeNode] = {}  # end of a loading chain -> node above the chain
        # L2 pages an L3 write-back is reading (page id -> readers), and pages the tree dropped
        # while they were pinned: freed into the host pool when their last reader is done.
        self._host_pins: dict[int, int] = {}
        self._host_deferred: set[int] = set()
        # Lazy supersets of eviction candidates; entries are re-validated when evicting.
        self._dev_leaves: set[TreeNode] = set()
        self._host_leaves: set[TreeNode] = set()
        self._device_cached = 0
        self._host_cached = 0
        self._device_locked = 0
        self._num_nodes = 0

    @classmethod
    def from_config(
        cls, config: CacheConfig, device: PageAllocator | None, host: PageAllocator | None = None
    ) -> HiRadixTree:
        return cls(
            config.page_size,
            device,
            host,
            write_policy=config.hicache_write_policy,
            write_through_threshold=config.write_through_threshold,
            load_back_threshold=config.load_back_threshold,
            eviction_policy=config.eviction_policy,
        )

    # ------------------------------------------------------------------ match / insert
    def match_prefix(self, tokens: Sequence[int]) -> MatchResult:
        """Longest cached prefix of the full pages of ``tokens``.

        Splits the node where the match ends mid-node; bumps ``hit_count`` and
        ``last_access`` on the matched path; backs hit nodes up to L2 when the write
        policy says so (skipped silently when L2 has no room).
        """
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        path, pos = self._walk(tokens)
        self._tick += 1
        tick = self._tick
        dev_pages: list[int] = []
        dev_node = host_node = self.root
        to_backup = []
        loads: dict[int, PendingLoad] = {}
        should_backup = self.write_policy.should_backup_on_hit
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
            self._backup(to_backup, protect=host_node)
        dev_tokens = len(dev_pages) * self.page_size
        return MatchResult(dev_pages, dev_tokens, pos - dev_tokens, dev_node, host_node, tuple(loads.values()))

    def lookup(self, tokens: Sequence[int]) -> tuple[TreeNode, int]:
        """Read-only match (no split, no hit counts, no backups): the deepest node the full
        pages of ``tokens`` reach (one they end inside included; the root if none) and the
        number of matched tokens (on L1 or L2)."""
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        last, end = self.root, 0
        for child, pos, m in self._touched(tokens, len(tokens) - len(tokens) % self.page_size):
            last, end = child, pos + m
        return last, end

    def _touched(self, tokens: list[int], n: int) -> Iterator[tuple[TreeNode, int, int]]:
        """Read-only walk over ``tokens[:n]`` (page-aligned ``n``): each node it reaches with
        the position it starts at and how many of its tokens match (the last may match part)."""
        ps = self.page_size
        node, pos = self.root, 0
        while pos < n:
            child = node.children.get(tuple(tokens[pos : pos + ps]))
            if child is None:
                return
            m = self._common(child.key, tokens, pos, n)
            yield child, pos, m
            if m < len(child.key):
                return
            node, pos = child, pos + m

    def peek_prefix_len(self, tokens: Sequence[int]) -> int:
        """Tokens of ``tokens`` cached on L1 or L2, without touching the tree: for ordering a
        waiting queue."""
        return self.lookup(tokens)[1]

    def insert(self, tokens: Sequence[int], device_pages: Sequence[int]) -> list[int]:
        """Insert the full pages of ``tokens`` held in L1 pages ``device_pages``.

        ``device_pages`` needs one id per full page (extra ids are ignored and stay
        the caller's). Returns the ids the caller must free: those of pages the tree
        already holds on L1 under a different id. Nodes on the path that are on L2
        only adopt the given pages. New nodes get ``hit_count == 0``.
        """
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        ps = self.page_size
        n = len(tokens) - len(tokens) % ps
        if len(device_pages) < n // ps:
            raise ValueError(f"{n // ps} full pages but only {len(device_pages)} device pages")
        self._tick += 1
        tick = self._tick
        node, pos, dup = self.root, 0, []
        while pos < n:
            first = tuple(tokens[pos : pos + ps])
            child = node.children.get(first)
            if child is None:
                new = TreeNode(next(self._ids), tokens[pos:n], parent=node)
                new.last_access = tick
                node.children[first] = new
                self._num_nodes += 1
                self._set_device(new, list(device_pages[pos // ps : n // ps]))
                break
            child, end = self._descend(child, tokens, pos, n)
            given = list(device_pages[pos // ps : end // ps])
            if child.device_pages is None:
                self._set_device(child, given)
            elif child.device_pages != given:
                dup.extend(b for a, b in zip(child.device_pages, given, strict=True) if a != b)
            child.last_access = tick
            node, pos = child, end
        return dup

    # ------------------------------------------------------------------ locks
    def lock(self, node: TreeNode) -> None:
        """``lock_ref += 1`` on the path root→node (no-op for the root)."""
        if node.removed:
            raise ValueError(f"cannot lock a removed node: {node!r}")
        while node.parent is not None:
            if node.lock_ref == 0 and node.device_pages is not None:
                self._device_locked += len(node.device_pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """``lock_ref -= 1`` on the path root→node; raises if the node is not locked."""
        if node.parent is None and not node.removed:
            return
        if node.lock_ref <= 0:
            raise RuntimeError(f"unlock of a node that is not locked: {node!r}")
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0 and node.device_pages is not None:
                self._device_locked -= len(node.device_pages)
            node = node.parent

    def take_transfers(self) -> list[Transfer]:
        """Drain the outbox (see the ordering contract in the module docstring)."""
        out, self._outbox = self._outbox, []
        return out

    # ------------------------------------------------------------------ sessions
    def open_session(self, session_id: str, now: float | None = None) -> None:
        self.sessions.open(session_id, now)

    def attach_session(self, session_id: str, node: TreeNode, now: float | None = None) -> None:
        self.sessions.attach(session_id, node, now)

    def close_session(self, session_id: str) -> None:
        self.sessions.close(session_id)

    def expire_sessions(self, now: float | None = None) -> list[str]:
        return self.sessions.expire(now)

    # ------------------------------------------------------------------ admin / stats
    def reset(self) -> None:
        """Drop every node and its pages (flush). Refuses while anything is locked.

        Pending transfers are discarded and sessions stay open but detached.
        """
        if any(c.lock_ref for c in self.root.children.values()) or self._loads:
            raise RuntimeError("cannot reset the tree while requests hold locks")
        for child in list(self.root.children.values()):
            if child.device_pages is not None:
                self._drop_subtree_device(child)
            self._remove(child)
        self._outbox.clear()
        self._dev_leaves.clear()
        self._host_leaves.clear()
        self.sessions.detach_all()
        if self._listeners:
            self._emit("reset", self.root)

    def cached_pages(self, tier: str) -> int:
        """Pages held by the tree on ``tier`` ("device" or "host")."""
        return {"device": self._device_cached, "host": self._host_cached}[tier]

    def evictable_pages(self, tier: str) -> int:
        """Pages on ``tier`` that eviction could free now (host: L2-only unlocked nodes; O(tree))."""
        if tier == "device":
            return self._device_cached - self._device_locked
        if tier != "host":
            raise KeyError(tier)
        return sum(len(n.host_pages) for n in self.nodes() if n.lock_ref == 0 and n.device_pages is None)

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    def nodes(self) -> list[TreeNode]:
        """All nodes except the root (DFS order)."""
        out, stack = [], list(self.root.children.values())
        while stack:
            nd = stack.pop()
            out.append(nd)
            stack.extend(nd.children.values())
        return out

    def check_integrity(self, device_in_use: int = 0, host_in_use: int = 0) -> None:
        """Raise AssertionError unless the tree and its pools are consistent.

        ``*_in_use``: pages the caller allocated from the pool and holds outside the
        tree (e.g. pages of running requests not inserted yet, duplicates returned by
        insert and not freed yet). Pages of matched prefixes belong to the tree.
        """
        check_tree(self, device_in_use, host_in_use)

    # ------------------------------------------------------------------ internals
    def _walk(self, tokens: list[int]) -> tuple[list[TreeNode], int]:
        """Matched path and length; a match ending mid-node splits that node."""
        ps = self.page_size
        n = len(tokens) - len(tokens) % ps
        node, pos, path = self.root, 0, []
        while pos < n:
            child = node.children.get(tuple(tokens[pos : pos + ps]))
            if child is None:
                break
            end = pos + len(child.key)
            if end <= n and tokens[pos:end] == child.key:
                path.append(child)
                node, pos = child, end
                continue
            path.append(self._split(child, self._common(child.key, tokens, pos, n)))
            pos += len(path[-1].key)
            break
        return path, pos

    def _descend(self, child: TreeNode, tokens: list[int], pos: int, n: int) -> tuple[TreeNode, int]:
        """Step into ``child`` while inserting ``tokens[:n]`` from ``pos``: split it where the
        tokens diverge from (or end inside) its key; returns the node taken and its end."""
        end = pos + len(child.key)
        if end <= n and tokens[pos:end] == child.key:
            return child, end
        m = self._common(child.key, tokens, pos, n)
        return self._split(child, m), pos + m

    def _common(self, key: list[int], tokens: list[int], pos: int, n: int) -> int:
        """Matched length (page-aligned, >= one page) of ``key`` against ``tokens[pos:n]``."""
        ps = self.page_size
        m, lim = ps, min(len(key), n - pos)
        while m < lim and key[m : m + ps] == tokens[pos + m : pos + m + ps]:
            m += ps
        return m

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Split ``node`` after ``at`` tokens; returns the new upper part (``node`` keeps the lower)."""
        ps, k = self.page_size, at // self.page_size
        upper = TreeNode(next(self._ids), node.key[:at], parent=node.parent)
        if node.device_pages is not None:
            upper.device_pages, node.device_pages = node.device_pages[:k], node.device_pages[k:]
        if node.host_pages is not None:
            upper.host_pages, node.host_pages = node.host_pages[:k], node.host_pages[k:]
        upper.storage_pages, node.storage_pages = min(node.storage_pages, k), max(0, node.storage_pages - k)
        upper.lock_ref, upper.session_ref = node.lock_ref, node.session_ref
        upper.hit_count, upper.last_access, upper.load = node.hit_count, node.last_access, node.load
        node.parent.children[tuple(node.key[:ps])] = upper
        node.key = node.key[at:]
        upper.children[tuple(node.key[:ps])] = node
        node.parent = upper
        self._num_nodes += 1
        return upper

    def _set_device(self, node: TreeNode, pages: list[int]) -> None:
        node.device_pages = pages
        self._device_cached += len(pages)
        if node.lock_ref:
            self._device_locked += len(pages)
        self._dev_leaves.add(node)
        if self._listeners:
            self._emit("device_add", node)
