"""The host pool's pending GPU write: a reader on another thread never forgets a newer write.

``wait_pending_writes`` (L3 writer, loader) clears the event it waited for; if the scheduler
thread announces a newer backup between that check and the clear, the newer event must
survive, or the L3 writer would persist a page whose GPU backup is still in flight
(half-copied KV with a valid checksum, forever). The test puts the scheduler's
``add_pending_write`` exactly into that window: the first read of ``pending_write`` after the
reader's wait starts it on another thread and gives it 0.2 s to land.
"""

from __future__ import annotations

import threading

import torch

from hicache.tiers.device import KVLayout
from hicache.tiers.host import make_host_pool


class FakeEvent:
    def __init__(self, on_sync=None) -> None:
        self.synced = False
        self.on_sync = on_sync

    def synchronize(self) -> None:
        self.synced = True
        if self.on_sync is not None:
            self.on_sync()


def test_a_newer_pending_write_is_never_lost():
    pool = make_host_pool("page_first", KVLayout(1, 1, 4, torch.float32), 4, 2)
    newer = FakeEvent()
    state = {"value": None, "armed": False, "adder": None}

    def get(self):
        value = state["value"]
        if state["armed"]:  # the reader is between its wait and its clear: a backup lands now
            state["armed"] = False
            adder = state["adder"] = threading.Thread(target=pool.add_pending_write, args=(newer,))
            adder.start()
            adder.join(0.2)  # a pool that serialises the clear makes the adder wait: fine
        return value

    def put(self, value):
        state["value"] = value

    probe = type("Probe", (type(pool),), {"pending_write": property(get, put)})
    del pool.__dict__["pending_write"]
    pool.__class__ = probe
    older = FakeEvent(on_sync=lambda: state.update(armed=True))
    pool.add_pending_write(older)
    reader = threading.Thread(target=pool.wait_pending_writes)
    reader.start()
    reader.join(5)
    state["adder"].join(5)
    assert not reader.is_alive() and not state["adder"].is_alive()
    assert older.synced
    assert pool.pending_write is newer, "the newer backup's event was cleared without being waited for"
    pool.wait_pending_writes()
    assert newer.synced and pool.pending_write is None
