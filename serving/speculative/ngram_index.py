"""The HiRadixTree as the n-gram source of NGRAM speculative decoding.

The tree holds the token ids of every cached sequence, prompts and generated outputs alike, on
every tier (a node whose KV is only on L2, or came from L3, keeps its key). This index holds no
tokens of its own: for each key length ``w`` of ``levels`` it maps a run of ``w`` tokens (with its
cache partition, hicache.salt: salted requests draft only from their own partition) to the
positions that follow its latest occurrences in the tree, packed as ``node id << 32 | depth``
(depth: tokens from the root). A depth is absolute, so a position survives the tree's splits (a
split puts a new node above the recorded one; the position is found by walking up).

Fed by the tree's events (``HiRadixTree.add_listener``): a node that appears (``device_add`` or
``host_add`` of a node not seen before and without children: an insert, an L3 prefetch) is queued
and its positions are indexed by :meth:`catch_up`, at most ``tokens`` per call (the worker calls
it once a step, so a long sequence never stalls a step); a node that leaves (``remove``) is
forgotten at once, and its positions are dropped when a lookup meets them (or by the capacity
bound); ``reset`` clears the index. A node not seen before that has children is the upper part
of a split: its tokens are indexed already (or queued), under the lower part's id.

Bounded: at most ``per_key`` positions per key (the latest) and ``capacity`` positions in all
(the keys used least recently go first). A lookup is O(levels + per_key x path length).

Concurrency: the scheduler thread's (the listener runs inside the tree's calls, which that
thread makes). It reads nodes' keys, children and access ticks, and never changes the tree.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from hicache import salt
from hicache.hiradix.node import TreeNode

_DEPTH_BITS = 32
_DEPTH_MASK = (1 << _DEPTH_BITS) - 1
_TOKEN_MOD = 1 << 32
MAX_QUEUED = 65536  # nodes waiting to be indexed


def raw_tokens(tokens: list[int], depth: int) -> list[int]:
    """``tokens`` (starting at ``depth`` of their sequence) with the salted first ids made raw."""
    if depth >= salt.SALTED_TOKENS or not any(t < 0 for t in tokens[: salt.SALTED_TOKENS - depth]):
        return tokens
    out = list(tokens)
    for i in range(min(len(out), salt.SALTED_TOKENS - depth)):
        if out[i] < 0:
            out[i] = (-out[i] - 1) % _TOKEN_MOD
    return out


def partition_of(first: TreeNode) -> tuple[int, ...]:
    """The cache partition of the sequences under a child of the root (``()``: unsalted)."""
    return salt.salt_of(first.key) or ()


class _Path:
    """A root-to-node chain and the depth where each of its nodes starts."""

    __slots__ = ("nodes", "starts", "end")

    def __init__(self, node: TreeNode) -> None:
        self.nodes = node.path_to_root()[::-1]
        self.starts, d = [], 0
        for n in self.nodes:
            self.starts.append(d)
            d += len(n.key)
        self.end = d

    def tokens(self, lo: int, hi: int) -> list[int]:
        """Raw tokens at depths ``lo .. hi - 1`` of the chain."""
        out: list[int] = []
        for n, s in zip(self.nodes, self.starts, strict=True):
            e = s + len(n.key)
            if e <= lo or s >= hi:
                continue
            a = max(lo, s)
            out.extend(raw_tokens(n.key[a - s: min(hi, e) - s], a))
        return out


class TreeNgramIndex:
    """Positions of the tree's token runs (see the module doc). ``rank_child`` orders a node's
    children for a continuation that runs past the recorded occurrence (the most recent first)."""

    def __init__(self, tree, levels: tuple[int, ...], capacity: int, per_key: int = 8,  # noqa: ANN001 - HiRadixTree
                 rank_child: Callable[[TreeNode], object] | None = None) -> None:
        self.levels = tuple(sorted(set(levels), reverse=True))
        self.capacity = capacity
        self.per_key = per_key
        self.rank_child = rank_child or (lambda n: n.last_access)
        self._map: dict[tuple, list[int]] = {}
        self._nodes: dict[int, TreeNode] = {}
        self._queue: deque[list] = deque()  # [node, next depth to index] of nodes not yet (fully) indexed
        self.size = 0  # positions held (stale ones too, until met or evicted)
        self.indexed_tokens = 0
        self.evicted = 0
        tree.add_listener(self._on_event)

    # -- the tree's listener ---------------------------------------------------------------
    def _on_event(self, kind: str, node: TreeNode) -> None:
        if kind == "remove":
            self._nodes.pop(node.id, None)
        elif kind == "reset":
            self._map.clear()
            self._nodes.clear()
            self._queue.clear()
            self.size = 0
        elif kind in ("device_add", "host_add") and node.id not in self._nodes:
            self._nodes[node.id] = node
            if not node.children:  # else the upper part of a split: indexed already (or queued)
                start = sum(len(n.key) for n in node.path_to_root()[1:])  # a split later puts the rest above
                self._queue.append([node, start])
                if len(self._queue) > MAX_QUEUED:  # inserts faster than catch_up: the oldest go unindexed
                    self._queue.popleft()

    def catch_up(self, tokens: int) -> None:
        """Index queued nodes, about ``tokens`` positions' worth at most."""
        while self._queue and tokens > 0:
            item = self._queue[0]
            node = item[0]
            if node.removed or node.id not in self._nodes:
                self._queue.popleft()
                continue
            path = _Path(node)
            end = min(path.end, item[1] + tokens)
            self._index(node, path, item[1], end)
            tokens -= end - item[1]
            item[1] = end
            if end >= path.end:
                self._queue.popleft()

    @property
    def pending(self) -> int:
        return len(self._queue)

    def _index(self, node: TreeNode, path: _Path, start: int, end: int) -> None:
        """Positions of the tokens at depths ``start .. end - 1`` (on ``node``'s path)."""
        part = partition_of(path.nodes[0])
        ctx = max(0, start - (self.levels[0] - 1))
        toks = path.tokens(ctx, end)
        tag = node.id << _DEPTH_BITS
        m, per_key, added = self._map, self.per_key, 0
        for w in self.levels:
            for j in range(max(w - 1, start - ctx), len(toks)):
                key = (part, *toks[j - w + 1: j + 1])
                lst = m.pop(key, None)  # re-inserted last: the key was used most recently
                if lst is None:
                    lst = []
                m[key] = lst
                lst.append(tag | (ctx + j + 1))
                added += 1
                if len(lst) > per_key:
                    del lst[0]
                    added -= 1
        self.size += added
        self.indexed_tokens += end - start
        while self.size > self.capacity:
            oldest = next(iter(m))
            n = len(m.pop(oldest))
            self.size -= n
            self.evicted += n

    # -- lookup ----------------------------------------------------------------------------
    def find(self, part: tuple[int, ...], seq: list[int], max_window: int, k: int) -> list[tuple[int, list[int]]]:
        """``(match length, continuation)`` of the latest occurrences of ``seq``'s longest indexed
        suffix in the tree (latest first): the suffix is compared back to ``max_window`` tokens and
        the continuation has at most ``k`` tokens."""
        for w in self.levels:
            if len(seq) < w:
                continue
            lst = self._map.get((part, *seq[-w:]))
            if not lst:
                continue
            out: list[tuple[int, list[int]]] = []
            for packed in reversed(list(lst)):
                node = self._nodes.get(packed >> _DEPTH_BITS)
                if node is None or node.removed:
                    lst.remove(packed)
                    self.size -= 1
                    continue
                path = _Path(node)
                depth = packed & _DEPTH_MASK
                if depth > path.end:  # cannot happen in a consistent tree; never draft from it
                    continue
                back = min(max_window, len(seq)) - w
                before = path.tokens(max(0, depth - w - back), depth - w)
                n = w
                for a, b in zip(reversed(before), reversed(seq[: len(seq) - w]), strict=False):
                    if a != b:
                        break
                    n += 1
                out.append((n, self._continuation(path, depth, k)))
            if out:
                return out
        return []

    def _continuation(self, path: _Path, depth: int, k: int) -> list[int]:
        """Up to ``k`` raw tokens from ``depth`` on: along the recorded path, then down the
        children ranked by ``rank_child``."""
        out = path.tokens(depth, min(path.end, depth + k))
        node, at = path.nodes[-1], max(depth, path.end)
        while len(out) < k and node.children:
            node = max(node.children.values(), key=self.rank_child)
            out.extend(raw_tokens(node.key[: k - len(out)], at))
            at += len(node.key)
        return out

    def stats(self) -> dict[str, int]:
        return {"index_positions": self.size, "index_keys": len(self._map), "index_nodes": len(self._nodes),
                "indexed_tokens": self.indexed_tokens, "index_evicted": self.evicted, "index_queued": len(self._queue)}
