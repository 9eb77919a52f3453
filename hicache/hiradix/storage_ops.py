"""L3 support of the HiRadixTree: prefetched pages into L2, write-back bookkeeping (pins,
stored marks), path helpers.

A mixin of :class:`hicache.hiradix.tree.HiRadixTree` (split out to keep files small); it
uses the tree's state (allocators, counters, lazy candidate sets, ids) and its internal
helpers (``_common``, ``_split``, ``_descend``, ``_emit``) directly. See tree.py for the invariants.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence

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
    _host_pins: dict[int, int]
    _host_deferred: set[int]
    _listeners: tuple[Callable[[str, TreeNode], None], ...]

    # helpers defined by HiRadixTree / TieringMixin
    _common: Callable[[list[int], list[int], int, int], int]
    _split: Callable[[TreeNode, int], TreeNode]
    _descend: Callable[[TreeNode, list[int], int, int], tuple[TreeNode, int]]
    _touched: Callable[[list[int], int], Iterator[tuple[TreeNode, int, int]]]
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

    def mark_stored(self, tokens: Sequence[int], lo: int, hi: int) -> int:
        """Record that pages ``lo <= i < hi`` of the path of ``tokens`` are on L3 (a write-back
        of those pages finished). Walks by tokens without splitting, so splits and removals
        since the write started do not matter: a node on the path learns the part of the range
        that continues its leading stored pages (``storage_pages`` counts leading pages only).
        Returns how many pages of the range the tree still holds."""
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        ps = self.page_size
        end = 0
        for child, pos, m in self._touched(tokens, min(hi * ps, len(tokens) - len(tokens) % ps)):
            a = pos // ps  # the node's first page in path numbering
            first, last = max(lo, a) - a, min(hi, a + m // ps) - a
            if first < last and first <= child.storage_pages:
                child.storage_pages = max(child.storage_pages, last)
            end = pos + m
        return max(0, end // ps - lo)

    def path_tokens(self, node: TreeNode) -> list[int]:
        """The tokens of the path root→node."""
        return [t for nd in reversed(node.path_to_root()) for t in nd.key]

    # ------------------------------------------------------------------ pins (L3 write-back)
    def pin_host(self, pages: Sequence[int]) -> None:
        """A reader outside the tree (an L3 write-back) reads L2 ``pages`` until
        :meth:`unpin_host`: they are not dropped by L2 eviction and never reused meanwhile
        (a node removed while pinned leaves them deferred). Pins nothing on L1."""
        pins = self._host_pins
        for p in pages:
            pins[p] = pins.get(p, 0) + 1

    def unpin_host(self, pages: Sequence[int]) -> None:
        """End one pin of each page; frees pages the tree dropped meanwhile."""
        pins, freed = self._host_pins, []
        for p in pages:
            k = pins[p] - 1
            if k:
                pins[p] = k
                continue
            del pins[p]
            if p in self._host_deferred:
                self._host_deferred.discard(p)
                freed.append(p)
        if freed:
            self.host.free(freed)

    @property
    def host_pinned(self) -> int:
        """Distinct L2 pages pinned now (for tests and stats)."""
        return len(self._host_pins)
