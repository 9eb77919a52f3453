"""The one place the tree's pending tier moves are executed.

The tree decides (``HiRadixTree`` queues :class:`~hicache.hiradix.Transfer` records: backups,
loads, evictions' frees); :class:`TransferRunner` takes them in order and hands them to the cache
controller that copies (``CacheController.execute``, wrapped for tensor parallelism), then passes
the finished backups on to the L3 write-back. Everyone who changes the tree and must see its moves
done before going on -- the request cache (match, admit, alloc, release) and the L3 fetches' early
L2 -> L1 loads -- calls :meth:`TransferRunner.flush` on the one runner it was built with: calls go
down (cache -> runner -> controller, write-back), never back up through a callback. The window pages'
policy (serving/cache/request_windows.py) orders its window-only loads through :meth:`TransferRunner.run`,
behind the tree's queued moves.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from hicache.hiradix import HiRadixTree, Transfer

if TYPE_CHECKING:
    from serving.cache.l3_writeback import WriteBack

TransferSink = Callable[[list[Transfer]], "Future | None"]


class TransferRunner:
    """Executes the tree's queued tier moves, in order, before any page they free is reused.

    Concurrency contract: scheduler thread only (every caller of :meth:`flush` runs there). A
    flush returns once the backups have been copied (their L1 pages may be reused after it); a
    load runs on in the background and is bound to its ``PendingLoad`` before :meth:`flush`
    returns, so a reader of those pages always finds a load it can wait for. No lock: the tree
    and the write-back are touched only from the scheduler thread.

    ``execute`` is None without L2 (nothing to move: the queue only ever holds frees, which
    need no copy); ``write_back`` is None without L3.
    """

    def __init__(self, tree: HiRadixTree, execute: TransferSink | None,
                 write_back: WriteBack | None = None) -> None:
        self.tree = tree
        self._execute = execute
        self._write_back = write_back

    def flush(self) -> None:
        """Run every queued move; then write the nodes that got an L2 copy on to L3."""
        transfers = self.tree.take_transfers()
        if not transfers or self._execute is None:
            return
        self._execute(transfers)  # backups are done when this returns; loads are bound
        if self._write_back is not None and not self.tree.exclusive.on:  # exclusive: L3 takes cold pages only
            for t in transfers:
                if t.kind in ("backup", "state_backup"):  # a snapshot's L2 copy goes on to L3 too
                    for node in t.nodes:
                        self._write_back.write(node)

    def run(self, transfers: list[Transfer]) -> bool:
        """Run the tree's queued moves (:meth:`flush`), then ``transfers``, moves the request side orders
        itself (a hybrid SWA L1's window-only loads), in that order; False: no L2 to move from (nothing run)."""
        self.flush()
        if self._execute is None:
            return False
        if transfers:
            self._execute(transfers)
        return True

