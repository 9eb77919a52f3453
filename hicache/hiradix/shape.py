"""TreeShape: the radix structure of the HiRadixTree (nodes, keys, parents), no residency.

Owns the root, the node ids, the access clock and the node count. Walks match full pages of
tokens against the keys: a node's key is a positive multiple of ``page_size`` tokens, children
are keyed by their first page. :meth:`TreeShape.walk` is read-only; :meth:`TreeShape.match_path`
and :meth:`TreeShape.descend` split the node where the tokens end or diverge inside it (the
split keeps every copy, lock and mark on both halves: see :meth:`TreeShape.split`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from hicache.hiradix.node import TreeNode


class TreeShape:
    """Nodes and keys of one tree.

    Concurrency contract: not thread-safe; the thread that owns the tree (the scheduler thread)
    makes every call. :meth:`walk` is a generator: finish or drop it before the tree changes.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.root = TreeNode(0, [], device_pages=[], host_pages=[])
        self._ids = itertools.count(1)
        self._tick = 0
        self._num_nodes = 0

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    def next_tick(self) -> int:
        """Advance the access clock (``last_access`` stamps); returns the new time."""
        self._tick += 1
        return self._tick

    def nodes(self) -> list[TreeNode]:
        """All nodes except the root (DFS order)."""
        out, stack = [], list(self.root.children.values())
        while stack:
            nd = stack.pop()
            out.append(nd)
            stack.extend(nd.children.values())
        return out

    @staticmethod
    def path_tokens(node: TreeNode) -> list[int]:
        """The tokens of the path root→node."""
        return [t for nd in reversed(node.path_to_root()) for t in nd.key]

    # ------------------------------------------------------------------ walks
    def walk(self, tokens: list[int], n: int) -> Iterator[tuple[TreeNode, int, int]]:
        """Read-only walk over ``tokens[:n]`` (page-aligned ``n``): each node it reaches with
        the position it starts at and how many of its tokens match (the last may match part)."""
        ps = self.page_size
        node, pos = self.root, 0
        while pos < n:
            child = node.children.get(tuple(tokens[pos : pos + ps]))
            if child is None:
                return
            m = self.common(child.key, tokens, pos, n)
            yield child, pos, m
            if m < len(child.key):
                return
            node, pos = child, pos + m

    def match_path(self, tokens: list[int]) -> tuple[list[TreeNode], int]:
        """Matched path and length over the full pages of ``tokens``; a match ending mid-node
        splits that node."""
        ps = self.page_size
        n = len(tokens) - len(tokens) % ps
        node, pos, path = self.root, 0, []
        while pos < n:
            child = node.children.get(tuple(tokens[pos : pos + ps]))
            if child is None:
                break
            m = self.common(child.key, tokens, pos, n)
            if m == len(child.key):
                path.append(child)
                node, pos = child, pos + m
                continue
            path.append(self.split(child, m))
            pos += m
            break
        return path, pos

    def descend(self, child: TreeNode, tokens: list[int], pos: int, n: int) -> tuple[TreeNode, int]:
        """Step into ``child`` while inserting ``tokens[:n]`` from ``pos``: split it where the
        tokens diverge from (or end inside) its key; returns the node taken and its end."""
        m = self.common(child.key, tokens, pos, n)
        return (child, pos + m) if m == len(child.key) else (self.split(child, m), pos + m)

    def common(self, key: list[int], tokens: list[int], pos: int, n: int) -> int:
        """Matched length (page-aligned, >= one page) of ``key`` against ``tokens[pos:n]``."""
        end = pos + len(key)
        if end <= n and tokens[pos:end] == key:  # the whole key: one list compare, not one a page
            return len(key)
        ps = self.page_size
        m, lim = ps, min(len(key), n - pos)
        while m < lim and key[m : m + ps] == tokens[pos + m : pos + m + ps]:
            m += ps
        return m

    # ------------------------------------------------------------------ changes
    def split(self, node: TreeNode, at: int) -> TreeNode:
        """Split ``node`` after ``at`` tokens; returns the new upper part (``node`` keeps the lower)."""
        ps, k = self.page_size, at // self.page_size
        upper = TreeNode(next(self._ids), node.key[:at], parent=node.parent)
        if node.device_pages is not None:
            upper.device_pages, node.device_pages = node.device_pages[:k], node.device_pages[k:]
        if node.host_pages is not None:
            upper.host_pages, node.host_pages = node.host_pages[:k], node.host_pages[k:]
        upper.storage_pages, node.storage_pages = min(node.storage_pages, k), max(0, node.storage_pages - k)
        upper.lock_ref, upper.session_ref, upper.wait_ref = node.lock_ref, node.session_ref, node.wait_ref
        upper.hit_count, upper.last_access, upper.load = node.hit_count, node.last_access, node.load
        upper.window_copy = node.window_copy
        node.parent.children[tuple(node.key[:ps])] = upper
        node.key = node.key[at:]
        upper.children[tuple(node.key[:ps])] = node
        node.parent = upper
        self._num_nodes += 1
        return upper

    def add_child(self, parent: TreeNode, key: list[int], tick: int) -> TreeNode:
        """A new node under ``parent`` with ``key`` (no copies yet: the caller gives it one)."""
        new = TreeNode(next(self._ids), key, parent=parent)
        new.last_access = tick
        parent.children[tuple(key[: self.page_size])] = new
        self._num_nodes += 1
        return new

    def detach(self, node: TreeNode) -> None:
        """Unlink ``node`` (and so its subtree) from its parent; :meth:`retire` each node after."""
        del node.parent.children[tuple(node.key[: self.page_size])]

    def retire(self, node: TreeNode) -> None:
        """A detached node is gone: no children, marked removed, uncounted."""
        node.children = {}
        node.removed = True
        self._num_nodes -= 1
