"""The approximate radix tree: what the router sent to each worker, one tree shared by all.

As SGLang's router does, one radix tree holds every worker's prefixes and each node keeps the
set of workers ("tenants") that were sent it, with a last-access tick per tenant. A tenant on
a node is on every node above it, so the deepest node a request reaches that has an eligible
tenant gives the longest prefix any eligible worker was sent.

Keys are ``str``: token ids become characters (``chr(id)``, see :func:`token_key`) when the
router can tokenize, else the request's text is used as is. Python's C string operations
(``startswith``, slicing, dict lookups by the first character) keep a match at a few
microseconds per node.

Sizes are counted per tenant (characters of the nodes it is on); :meth:`evict` trims a tenant
to a size by dropping its least recently used leaves first.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Collection, Iterable, Sequence

MAX_TOKEN = 0x10FFFF
TOKEN_MARK = "\x01"  # keys from token ids never collide with keys from text
TEXT_MARK = "\x02"


def token_key(ids: Sequence[int]) -> str:
    """One character per token id (UTF-32 decoding in C: ~10 ns a token); ValueError when an
    id is negative or above 0x10FFFF."""
    try:
        return TOKEN_MARK + array("I", ids).tobytes().decode("utf-32-le", "surrogatepass")
    except (OverflowError, UnicodeDecodeError, TypeError):
        raise ValueError("token id out of range for a routing key") from None


def text_key(text: str) -> str:
    return TEXT_MARK + text


class _Node:
    __slots__ = ("key", "children", "parent", "tenants")

    def __init__(self, key: str, parent: _Node | None) -> None:
        self.key = key
        self.children: dict[str, _Node] = {}
        self.parent = parent
        self.tenants: dict[str, int] = {}  # tenant -> last access tick


def _common(edge: str, text: str, pos: int) -> int:
    """Length of the common prefix of ``edge`` and ``text[pos:]`` (edge[0] is known to match)."""
    n = min(len(edge), len(text) - pos)
    if text.startswith(edge[:n] if n < len(edge) else edge, pos):
        return n
    lo, hi = 1, n  # edge[:lo] matches, edge[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if text.startswith(edge[:mid], pos):
            lo = mid
        else:
            hi = mid
    return lo


class ApproxTree:
    def __init__(self) -> None:
        self.root = _Node("", None)
        self.sizes: dict[str, int] = {}
        self._tick = 0

    # -- match -------------------------------------------------------------------------------
    def match(self, key: str, eligible: Collection[str] | None = None) -> tuple[int, list[str]]:
        """``(matched characters, tenants)`` of the longest prefix of ``key`` held by an
        eligible tenant (all tenants when ``eligible`` is None); ``(0, [])`` if none."""
        node, pos = self.root, 0
        path: list[tuple[int, _Node]] = []
        n = len(key)
        while pos < n:
            child = node.children.get(key[pos])
            if child is None:
                break
            edge = child.key
            if key.startswith(edge, pos):
                pos += len(edge)
                path.append((pos, child))
                node = child
                continue
            path.append((pos + _common(edge, key, pos), child))
            break
        for depth, nd in reversed(path):
            if eligible is None:
                return depth, list(nd.tenants)
            hit = [t for t in nd.tenants if t in eligible]
            if hit:
                return depth, hit
        return 0, []

    # -- insert ------------------------------------------------------------------------------
    def insert(self, key: str, tenant: str) -> None:
        self._tick += 1
        tick = self._tick
        sizes = self.sizes
        sizes.setdefault(tenant, 0)
        node, pos, n = self.root, 0, len(key)
        while pos < n:
            child = node.children.get(key[pos])
            if child is None:
                leaf = _Node(key[pos:], node)
                leaf.tenants[tenant] = tick
                node.children[key[pos]] = leaf
                sizes[tenant] += n - pos
                return
            edge = child.key
            if not key.startswith(edge, pos):
                child = self._split(child, _common(edge, key, pos))
            if tenant not in child.tenants:
                sizes[tenant] += len(child.key)
            child.tenants[tenant] = tick
            pos += len(child.key)
            node = child

    def retract(self, key: str, tenant: str, keep: int) -> int:
        """Take back an :meth:`insert` of ``key`` for ``tenant`` that held only ``keep`` characters
        of it before (its attempt failed): ``tenant`` leaves the nodes of ``key``'s path that
        start at or past ``keep``, deepest first, while it is on none of their other children (a
        tenant on a node stays on every node above it). Returns the characters taken back."""
        path, node, pos, n = [], self.root, 0, len(key)
        while pos < n:
            child = node.children.get(key[pos])
            if child is None or not key.startswith(child.key, pos):
                break
            path.append((pos, child))
            pos += len(child.key)
            node = child
        dropped = 0
        for start, nd in reversed(path):
            if start < keep or tenant not in nd.tenants or any(tenant in c.tenants for c in nd.children.values()):
                break
            dropped += self._drop(nd, tenant)
        if dropped:
            self.sizes[tenant] = self.sizes.get(tenant, 0) - dropped
        return dropped

    @staticmethod
    def _split(node: _Node, at: int) -> _Node:
        parent = node.parent
        assert parent is not None
        upper = _Node(node.key[:at], parent)
        upper.tenants = dict(node.tenants)
        parent.children[upper.key[0]] = upper
        node.key = node.key[at:]
        node.parent = upper
        upper.children[node.key[0]] = node
        return upper

    # -- eviction ----------------------------------------------------------------------------
    def evict(self, tenant: str, max_size: int) -> int:
        """Drop ``tenant``'s least recently used leaves until its size is <= ``max_size``;
        returns the characters dropped."""
        size = self.sizes.get(tenant, 0)
        if size <= max_size:
            return 0
        heap = [(nd.tenants[tenant], id(nd), nd) for nd in self._tenant_leaves(tenant)]
        heapq.heapify(heap)
        dropped = 0
        while heap and size - dropped > max_size:
            _, _, nd = heapq.heappop(heap)
            dropped += self._drop(nd, tenant)
            parent = nd.parent
            if (
                parent is not None
                and parent is not self.root
                and tenant in parent.tenants
                and not any(tenant in c.tenants for c in parent.children.values())
            ):
                heapq.heappush(heap, (parent.tenants[tenant], id(parent), parent))
        self.sizes[tenant] = size - dropped
        return dropped

    def remove_tenant(self, tenant: str) -> None:
        """Forget everything sent to ``tenant`` (a worker removed, restarted or flushed)."""
        if tenant in self.sizes:
            self.evict(tenant, 0)
            self.sizes.pop(tenant, None)

    def clear(self) -> None:
        self.root = _Node("", None)
        self.sizes = {t: 0 for t in self.sizes}

    def _tenant_leaves(self, tenant: str) -> Iterable[_Node]:
        stack = [c for c in self.root.children.values() if tenant in c.tenants]
        while stack:
            nd = stack.pop()
            below = [c for c in nd.children.values() if tenant in c.tenants]
            if below:
                stack.extend(below)
            else:
                yield nd

    def _drop(self, node: _Node, tenant: str) -> int:
        del node.tenants[tenant]
        if not node.tenants and not node.children and node.parent is not None:
            del node.parent.children[node.key[0]]
        return len(node.key)

    def num_nodes(self) -> int:
        count, stack = 0, [self.root]
        while stack:
            nd = stack.pop()
            count += 1
            stack.extend(nd.children.values())
        return count - 1
