"""TreeEvents: who hears about the tree's changes, and the per-tenant ledger that biases eviction.

Listeners, ``fn(kind, node)``, are called synchronously right after a change: "device_add"
(the node got L1 pages), "device_evict" (it lost them), "host_add" (it got an L2 copy),
"host_evict" (it lost its L2 copy but stays on L1), "remove" (it leaves the tree;
``host_pages`` still tells whether it had an L2 copy), "reset" (flush; node = root).
Listeners must not raise nor touch the tree.

With a ledger (:class:`hicache.hiradix.quota.TenantLedger`, which listens too), eviction takes
nodes of tenants over their quota on the tier first (:meth:`TreeEvents.evict_key`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from hicache.hiradix.node import TreeNode

if TYPE_CHECKING:
    from hicache.hiradix.quota import TenantLedger

Listener = Callable[[str, TreeNode], None]


class TreeEvents:
    """The tree's listeners and ledger.

    Concurrency contract: not thread-safe; the thread that owns the tree registers listeners and
    the ledger (before serving) and every event is emitted on it.
    """

    def __init__(self) -> None:
        self.listeners: tuple[Listener, ...] = ()
        self.ledger: TenantLedger | None = None

    def add_listener(self, fn: Listener) -> None:
        self.listeners = (*self.listeners, fn)

    def set_ledger(self, ledger: TenantLedger) -> None:
        self.ledger = ledger
        self.add_listener(ledger.on_tree_event)

    def emit(self, kind: str, node: TreeNode) -> None:
        for fn in self.listeners:
            fn(kind, node)

    def evict_key(self, tier: str, base: Callable[[TreeNode], tuple]) -> Callable[[TreeNode], tuple]:
        """The eviction order on ``tier``: the policy's ``base`` key, tenants over quota first."""
        return base if self.ledger is None else self.ledger.eviction_key(tier, base)
