"""Session bookkeeping: soft references from multi-turn sessions onto tree paths.

Contract:
- ``open(sid)`` starts a session (re-opening an open session just touches it).
- ``attach(sid, node)`` makes the session hold one soft ref on every node of the
  path root→node (``session_ref += 1``), releasing the ref it held before.
- ``close(sid)`` releases the ref and forgets the session; nothing is freed at once,
  the nodes just lose their eviction preference.
- Any operation on a session that is not open raises :class:`UnknownSession`.
Removed nodes keep their ``parent`` pointer, so releasing a ref on a node that was
evicted meanwhile still decrements the ancestors that are in the tree.

When a session was last used, and closing it once idle, is not the tree's:
serving/cache/kv_sessions.py owns a session's liveness (its TTL and the engine loop's sweep),
and closes it here.
"""

from __future__ import annotations

from hicache.hiradix.node import TreeNode


class UnknownSession(KeyError):
    """The session id is not open."""


def _add_path_ref(node: TreeNode | None, delta: int) -> None:
    while node is not None and node.parent is not None:
        node.session_ref += delta
        node = node.parent


class SessionTable:
    """Open sessions and the node each is attached to."""

    def __init__(self) -> None:
        self._node: dict[str, TreeNode | None] = {}

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._node

    def __len__(self) -> int:
        return len(self._node)

    def open(self, session_id: str) -> None:
        self._node.setdefault(session_id, None)

    def node_of(self, session_id: str) -> TreeNode | None:
        self._require(session_id)
        return self._node[session_id]

    def attach(self, session_id: str, node: TreeNode) -> None:
        self._require(session_id)
        if node.removed:
            raise ValueError(f"cannot attach session {session_id!r} to a removed node")
        _add_path_ref(node, +1)
        _add_path_ref(self._node[session_id], -1)
        self._node[session_id] = node

    def close(self, session_id: str) -> None:
        self._require(session_id)
        _add_path_ref(self._node.pop(session_id), -1)

    def detach_all(self) -> None:
        """Forget every attachment without touching refs (the tree was cleared)."""
        for sid in self._node:
            self._node[sid] = None

    def attachments(self) -> list[TreeNode]:
        """Attached nodes of all sessions (for integrity checks)."""
        return [n for n in self._node.values() if n is not None]

    def _require(self, session_id: str) -> None:
        if session_id not in self._node:
            raise UnknownSession(session_id)
