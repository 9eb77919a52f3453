"""A state model's snapshots on L3 under tensor parallelism: every rank stores its heads' share.

As with the pages (serving/tp/leader.py: ``TPStorageTier``), each rank writes its own part of a
snapshot, from its own L2 state slot, as its own value (per-rank entries: part ``r`` of ``size`` under
``hicache.tiers.storage_state.part_key``). :class:`TPStateStore` is rank 0's store: a write is sent to
every follower (its request thread writes its part once the ``state_backup`` that filled the slot has
run) and counts only when every rank wrote; a lookup (rank 0's lookup thread, on the shared store) finds
the deepest snapshot whose every part is stored and verifies each, and answers every rank's payload.
When the tree takes that snapshot into an L2 state slot (serving/cache/l3_state.py ``attach_fetched``,
scheduler thread), :func:`mirror_loads`' wrap of rank 0's L2 state pool loads rank 0's part and sends each
follower its own part in a ``StateLoad`` command, ahead of the ``state_load`` move that brings the slot to
L1: every rank's slot then holds its heads of the same snapshot.

Concurrency: ``put_slot`` / ``find_deepest`` from L3's writer and lookup threads (the store is
thread-safe; the followers' requests go through the leader's RPC clients); the pool wrap on the
scheduler thread only (it sends a command).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hicache.tiers.storage_state import StateParts, StateStore
from serving.tp import messages as msg


class TPStateStore:
    """Rank 0's :class:`StateStore` (part 0 of ``leader.size``), mirrored on every rank (see the module
    docstring); the rest (``stats``, ...) is rank 0's store's."""

    def __init__(self, store: StateStore, leader: Any) -> None:
        self._store, self._leader = store, leader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def put_slot(self, page_key: str, pool: Any, slot: int) -> bool:
        """Every rank stores its part of L2 state slot ``slot`` (True when every rank's part is on L3)."""
        ld = self._leader
        return bool(ld.mirrored(lambda r: msg.L3StateSet(ld.seq, page_key, slot),
                                lambda: int(self._store.put_slot(page_key, pool, slot))))

    def put(self, page_key: str, payload: bytes) -> bool:
        raise RuntimeError("a tensor-parallel snapshot is written from every rank's L2 slot (put_slot)")

    def find_deepest(self, page_keys: Sequence[str]) -> tuple[int, StateParts] | None:
        return self._store.find_deepest(page_keys)


def mirror_loads(pool: Any, send_each: Any) -> None:
    """Wrap rank 0's L2 state pool (this instance only): ``load_slot_bytes(slot, parts)`` with a
    :class:`StateParts` loads part 0 here and sends follower ``r`` ``StateLoad(slot, parts[r])``
    (``send_each(make)``: one command, ``make(r)`` for rank ``r``); plain bytes (one rank's heads) raise."""
    load = pool.load_slot_bytes

    def tp_load(slot: int, data: Any) -> None:
        if not isinstance(data, StateParts):
            raise RuntimeError("a state snapshot loaded into rank 0's L2 state pool must carry every "
                               "tensor-parallel rank's part")
        load(slot, data[0])
        send_each(lambda r: msg.StateLoad(slot, data[r]))

    pool.load_slot_bytes = tp_load
