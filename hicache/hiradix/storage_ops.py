"""L3 support of the HiRadixTree: prefetched pages into L2, write-back bookkeeping, path helpers.

A mixin of :class:`hicache.hiradix.tree.HiRadixTree` (split out to keep files small); it
uses the tree's state (allocators, counters, lazy candidate sets, ids) and its internal
helpers (``_common``, ``_split``, ``_descend``, ``_emit``) directly. See tree.py for the invariants.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from hicache.hiradix.node import TreeNode
from hicache.tiers.allocator import PageAllocator


class StorageOpsMixin:
    """L3-related operations of the HiRadixTree; the attributes below are set by ``HiRadixTree.__init__``."""

    page_size: int
    host: PageAllocator | None
    root: TreeNode
    _ids: itertools.count
    _tick: int
    _host_leaves: set[TreeNode]
    _host_cached: int
    _num_nodes: int
    _listeners: tuple[Callable[[str, TreeNode], None], ...]

    # helpers defined by HiRadixTree / TieringMixin
    _common: Callable[[list[int], list[int], int, int], int]
    _split: Callable[[TreeNode, int], TreeNode]
    _descend: Callable[[TreeNode, list[int], int, int], tuple[TreeNode, int]]
    _emit: Callable[[str, TreeNode], None]

    def insert_host(self, tokens: Sequence[int], host_pages: Sequence[int], start_page: int = 0) -> list[int]:
        """Insert pages of ``tokens`` whose KV arrived from L3 in L2 pages ``host_pages`` (a
        prefetch result); nothing goes to L1.

        ``host_pages`` holds one id per full page from page ``start_page`` on (extra ids
        stay the caller's); the pages before ``start_page`` must already be in the tree (on
        any tier; the caller keeps that path locked). Nodes that have an L2 copy keep it
        and the given ids of their pages are returned for the caller to free; L1-only
        nodes adopt the given pages as their L2 copy; the rest becomes new L2-only nodes
        (``hit_count == 0``). Nodes that got pages from this call are marked as stored on
        L3. If the tree no longer holds the first ``start_page`` pages, nothing is
        inserted and every given id is returned. Emits no transfers. Raises
        ``ValueError`` without an L2 pool, with too few page ids or a bad ``start_page``.
        """
        if self.host is None:
            raise ValueError("insert_host needs a host (L2) pool")
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        ps = self.page_size
        n = len(tokens) - len(tokens) % ps
        base = start_page * ps
        if start_page < 0 or base > n:
            raise ValueError(f"start_page {start_page} outside the {n // ps} full pages")
        if len(host_pages) < (n - base) // ps:
            raise ValueError(f"{(n - base) // ps} pages to insert but only {len(host_pages)} host pages")
        given_all = list(host_pages[: (n - base) // ps])
        node, pos = self.root, 0
        while pos < base:  # the part already cached: walk it, split at start_page if needed
            child = node.children.get(tuple(tokens[pos : pos + ps]))
            if child is None:
                return given_all
            m = self._common(child.key, tokens, pos, base)
            if m < len(child.key):
                if pos + m < base:
                    return given_all  # diverges before start_page: the prefix is gone
                child = self._split(child, m)
            node, pos = child, pos + m
        self._tick += 1
        tick = self._tick
        dup = []
        while pos < n:
            first = tuple(tokens[pos : pos + ps])
            child = node.children.get(first)
            if child is None:
                hp = given_all[(pos - base) // ps :]
                new = TreeNode(next(self._ids), tokens[pos:n], parent=node, host_pages=hp)
                new.last_access = tick
                new.storage_pages = len(hp)
                node.children[first] = new
                self._num_nodes += 1
                self._host_cached += len(hp)
                self._host_leaves.add(new)
                if self._listeners:
                    self._emit("host_add", new)
                break
            child, end = self._descend(child, tokens, pos, n)
            given = given_all[(pos - base) // ps : (end - base) // ps]
            if child.host_pages is None:
                child.host_pages = given
                self._host_cached += len(given)
                if child.device_pages is None and not child.children:
                    self._host_leaves.add(child)
                if self._listeners:
                    self._emit("host_add", child)
            elif child.host_pages != given:
                dup.extend(b for a, b in zip(child.host_pages, given, strict=True) if a != b)
            child.storage_pages = len(given)
            child.last_access = tick
            node, pos = child, end
        return dup

    def mark_stored(self, tokens: Sequence[int], num_pages: int) -> int:
        """Record that the first ``num_pages`` pages of ``tokens`` are on L3 (a write-back
        finished). Walks without splitting; nodes that changed meanwhile get what still
        applies. Returns the pages marked."""
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        ps = self.page_size
        n = min(num_pages * ps, len(tokens) - len(tokens) % ps)
        node, pos = self.root, 0
        while pos < n:
            child = node.children.get(tuple(tokens[pos : pos + ps]))
            if child is None:
                break
            m = self._common(child.key, tokens, pos, n)
            child.storage_pages = max(child.storage_pages, m // ps)
            pos += m
            if m < len(child.key):
                break
            node = child
        return pos // ps

    def path_tokens(self, node: TreeNode) -> list[int]:
        """The tokens of the path root→node."""
        return [t for nd in reversed(node.path_to_root()) for t in nd.key]

    def host_path_pages(self, node: TreeNode) -> list[int] | None:
        """L2 page ids of the path root→node in order, or None if a node on it has no L2 copy."""
        out: list[int] = []
        for nd in reversed(node.path_to_root()):
            if nd.host_pages is None:
                return None
            out += nd.host_pages
        return out

    def stored_prefix_pages(self, node: TreeNode) -> int:
        """Leading pages of the path root→node known to be on L3 (write-back starts after them)."""
        total = 0
        for nd in reversed(node.path_to_root()):
            total += nd.storage_pages
            if nd.storage_pages < len(nd.key) // self.page_size:
                break
        return total
