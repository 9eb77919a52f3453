"""L3Marks: what the tree records about L3: pages that arrived from it into L2 (a prefetch) and
pages written to it (a write-back finished).

Both mark nodes' ``storage_pages`` (the leading pages of a node known to be on L3). Inserts of
prefetched pages are structural (they walk, split and add L2-only nodes through
:class:`~hicache.hiradix.shape.TreeShape`, and give nodes their L2 copies through
:class:`~hicache.hiradix.residency.Residency`); they emit no transfers. See tree.py for the
invariants.
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache.hiradix.exclusive import ExclusiveTiers
from hicache.hiradix.residency import Residency
from hicache.hiradix.shape import TreeShape
from hicache.tiers.allocator import PageAllocator


class L3Marks:
    """L3 inserts and stored marks of one tree.

    Concurrency contract: not thread-safe; the thread that owns the tree makes every call (the
    L3 threads hand their results to it).
    """

    def __init__(self, shape: TreeShape, residency: Residency, host: PageAllocator | None,
                 exclusive: ExclusiveTiers | None = None) -> None:
        self.exclusive = exclusive
        self.shape = shape
        self.residency = residency
        self.host = host

    def insert_host(self, tokens: Sequence[int], host_pages: Sequence[int], start_page: int = 0) -> list[int]:
        """Insert pages of ``tokens`` whose KV arrived from L3 in L2 pages ``host_pages`` (a
        prefetch result); nothing goes to L1.

        ``host_pages`` holds one id per full page from page ``start_page`` on (extra ids
        stay the caller's); the pages before ``start_page`` must already be in the tree (on
        any tier; the caller keeps that path locked). Nodes that have an L2 copy keep it
        and the given ids of their pages are returned for the caller to free; L1-only
        nodes adopt the given pages as their L2 copy (in the exclusive mode they do not: the ids
        are returned); the rest becomes new L2-only nodes
        (``hit_count == 0``). Nodes that got pages from this call are marked as stored on
        L3, except new nodes the exclusive mode promotes (their L3 copy goes:
        :meth:`ExclusiveTiers.promotes`). If the tree no longer holds the first ``start_page`` pages, nothing is
        inserted and every given id is returned. Emits no transfers. Raises
        ``ValueError`` without an L2 pool, with too few page ids or a bad ``start_page``.
        """
        if self.host is None:
            raise ValueError("insert_host needs a host (L2) pool")
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        shape = self.shape
        ps = shape.page_size
        n = len(tokens) - len(tokens) % ps
        base = start_page * ps
        if start_page < 0 or base > n:
            raise ValueError(f"start_page {start_page} outside the {n // ps} full pages")
        if len(host_pages) < (n - base) // ps:
            raise ValueError(f"{(n - base) // ps} pages to insert but only {len(host_pages)} host pages")
        given_all = list(host_pages[: (n - base) // ps])
        node, pos = shape.root, 0
        while pos < base:  # the part already cached: walk it, split at start_page if needed
            child = node.children.get(tuple(tokens[pos : pos + ps]))
            if child is None:
                return given_all
            m = shape.common(child.key, tokens, pos, base)
            if m < len(child.key):
                if pos + m < base:
                    return given_all  # diverges before start_page: the prefix is gone
                child = shape.split(child, m)
            node, pos = child, pos + m
        tick = shape.next_tick()
        dup = []
        while pos < n:
            first = tuple(tokens[pos : pos + ps])
            child = node.children.get(first)
            if child is None:
                hp = given_all[(pos - base) // ps :]
                new = shape.add_child(node, tokens[pos:n], tick)
                self.residency.set_host(new, hp)
                promoted = self.exclusive is not None and self.exclusive.promotes(new, pos // ps)
                new.storage_pages = 0 if promoted else len(hp)  # a promotion: the L3 copy goes
                break
            child, end = shape.descend(child, tokens, pos, n)
            given = given_all[(pos - base) // ps : (end - base) // ps]
            if child.host_pages is None and (self.exclusive is None or self.exclusive.adopts(child)):
                self.residency.set_host(child, given)
            elif child.host_pages is None:  # the exclusive mode: an L1 node takes no L2 copy
                dup.extend(given)
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
        ps = self.shape.page_size
        end = 0
        for child, pos, m in self.shape.walk(tokens, min(hi * ps, len(tokens) - len(tokens) % ps)):
            a = pos // ps  # the node's first page in path numbering
            first, last = max(lo, a) - a, min(hi, a + m // ps) - a
            if first < last and first <= child.storage_pages:
                child.storage_pages = max(child.storage_pages, last)
            end = pos + m
        return max(0, end // ps - lo)
