"""The L2 state pool's slot bytes and its contract with copies queued on a device stream
(hicache/tiers/host_state.py): a slot's L3 payload round-trips through any buffer type, and every
host-side access of a slot first waits for the queued copy recorded for it."""

from __future__ import annotations

import torch

from hicache.tiers.host_state import HostStatePool, copy_slots
from hicache.tiers.state_layout import StateLayout, StateTensor

LAYER = (StateTensor("conv", (6, 3), torch.bfloat16), StateTensor("recurrent", (2, 4, 4), torch.float32))
LAYOUT = StateLayout((LAYER, LAYER))


class FakeEvent:
    """Stands in for a CUDA event: counts the waits."""

    def __init__(self) -> None:
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1


def _fill(pool: HostStatePool, slot: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(buf.shape[1:], generator=g).to(buf.dtype) for buf in pool.tensors()]
    pool.write_slot(slot, tensors)
    return tensors


def test_slot_bytes_round_trip_through_bytes_bytearray_and_memoryview():
    pool = HostStatePool(LAYOUT, 4, pin_memory=False)
    want = _fill(pool, 1, seed=3)
    payload = pool.slot_bytes(1)
    assert len(payload) == LAYOUT.bytes_per_slot()
    for i, data in enumerate((bytes(payload), payload, memoryview(bytes(payload)))):
        pool.load_slot_bytes(2 + i % 2, data)
        got = pool.read_slot(2 + i % 2)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    pool.check_integrity()


def test_a_wrong_length_is_refused():
    pool = HostStatePool(LAYOUT, 2, pin_memory=False)
    try:
        pool.load_slot_bytes(0, b"\0" * (LAYOUT.bytes_per_slot() - 1))
    except ValueError as e:
        assert "bytes for a state slot" in str(e)
    else:
        raise AssertionError("a short payload was taken")


def test_host_access_waits_for_the_copy_queued_on_the_slot():
    """A backup queued on the device stream fills a slot later: reading its bytes (the L3 writer),
    reading or writing it, waits for the recorded event first, once; other slots do not wait."""
    pool = HostStatePool(LAYOUT, 4, pin_memory=False)
    for access in (lambda: pool.slot_bytes(1), lambda: pool.read_slot(1),
                   lambda: pool.load_slot_bytes(1, bytes(LAYOUT.bytes_per_slot())),
                   lambda: _fill(pool, 1, seed=1)):
        ev = FakeEvent()
        pool.note_copy([1], ev)
        pool.slot_bytes(0)
        assert ev.waits == 0
        access()
        assert ev.waits == 1
        access()
        assert ev.waits == 1  # settled once


def test_release_waits_for_every_queued_copy():
    pool = HostStatePool(LAYOUT, 4, pin_memory=False)
    evs = [FakeEvent(), FakeEvent()]
    pool.note_copy([0, 2], evs[0])
    pool.note_copy([3], evs[1])
    pool.release()
    assert all(e.waits >= 1 for e in evs)


def test_copy_slots_moves_whole_slots_between_pools():
    a, b = HostStatePool(LAYOUT, 4, pin_memory=False), HostStatePool(LAYOUT, 4, pin_memory=False)
    want = [_fill(a, s, seed=s) for s in range(4)]
    copy_slots(a.tensors(), b.tensors(), [3, 0], [1, 2])
    assert all(torch.equal(x, y) for x, y in zip(b.read_slot(1), want[3], strict=True))
    assert all(torch.equal(x, y) for x, y in zip(b.read_slot(2), want[0], strict=True))
    assert all(t.abs().sum() == 0 for t in b.read_slot(0))
