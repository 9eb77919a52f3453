"""L1's recurrent-state pool (hicache/tiers/state_pool.py): slots, their contents, their bytes."""

from __future__ import annotations

import pytest
import torch

from hicache.tiers.state_layout import StateLayout, StateTensor
from hicache.tiers.state_pool import DeviceStatePool, OutOfStateSlots

LAYOUT = StateLayout((
    (StateTensor("conv", (6, 3), torch.float16), StateTensor("recurrent", (2, 4, 5), torch.float32)),
    (StateTensor("conv", (8, 3), torch.float16), StateTensor("recurrent", (3, 2, 2), torch.float32)),
))


def _random_slot(gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(t.shape, generator=gen).to(t.dtype) for layer in LAYOUT.layers for t in layer]


def test_buffers_shapes_and_bytes() -> None:
    pool = DeviceStatePool(LAYOUT, 5, "cpu")  # 5 slots, then the padding row of CUDA graphs (pad_slot)
    assert pool.pad_slot == 5
    assert [[tuple(b.shape) for b in layer] for layer in pool.buffers] == [
        [(6, 6, 3), (6, 2, 4, 5)], [(6, 8, 3), (6, 3, 2, 2)]]
    assert pool.layer(1)[0].dtype == torch.float16 and pool.layer(1)[1].dtype == torch.float32
    per_slot = (18 + 24) * 2 + (40 + 12) * 4
    assert pool.bytes_per_slot == LAYOUT.bytes_per_slot() == per_slot
    assert pool.nbytes() == 6 * per_slot == sum(b.numel() * b.element_size() for lay in pool.buffers for b in lay)
    assert all(bool((b == 0).all()) for lay in pool.buffers for b in lay)


def test_alloc_free() -> None:
    pool = DeviceStatePool(LAYOUT, 3, "cpu")
    a = pool.alloc(2)
    assert len(set(a)) == 2 and pool.num_used == 2 and pool.num_free == 1 and pool.can_alloc(1)
    with pytest.raises(OutOfStateSlots, match="2 state slots, 1 free of 3"):
        pool.alloc(2)
    assert pool.num_free == 1  # nothing taken by the refused call
    pool.free([a[0]])
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([a[0]])
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([7])
    pool.check_integrity()
    assert sorted(pool.alloc(2) + [a[1]]) == [0, 1, 2]


def test_write_read_copy_zero() -> None:
    gen = torch.Generator().manual_seed(0)
    pool = DeviceStatePool(LAYOUT, 4, "cpu")
    s0, s1, s2 = pool.alloc(3)
    data = _random_slot(gen)
    pool.write_slot(s0, data)
    got = pool.read_slot(s0)
    assert [tuple(t.shape) for t in got] == [(6, 3), (2, 4, 5), (8, 3), (3, 2, 2)]
    assert all(torch.equal(a, b) for a, b in zip(got, data, strict=True))
    got[0].fill_(9)  # a host copy: the slot is unchanged
    assert torch.equal(pool.read_slot(s0)[0], data[0])
    pool.copy_slot(s0, s1)
    assert all(torch.equal(a, b) for a, b in zip(pool.read_slot(s1), data, strict=True))
    assert all(bool((t == 0).all()) for t in pool.read_slot(s2))  # neighbours untouched
    pool.zero_slot(s0)
    assert all(bool((t == 0).all()) for t in pool.read_slot(s0))
    assert all(torch.equal(a, b) for a, b in zip(pool.read_slot(s1), data, strict=True))


def test_write_slot_checks_shapes() -> None:
    pool = DeviceStatePool(LAYOUT, 2, "cpu")
    data = _random_slot(torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="3 tensors for a slot of 4"):
        pool.write_slot(0, data[:3])
    with pytest.raises(ValueError, match=r"shape \(6, 4\)"):
        pool.write_slot(0, [torch.zeros(6, 4), *data[1:]])


def test_needs_state_layers() -> None:
    with pytest.raises(ValueError, match="at least one state layer"):
        DeviceStatePool(StateLayout(()), 2, "cpu")


def test_forward_batch_state_fields() -> None:
    from serving.structs.forward_batch import ForwardBatch

    seqs = [([1, 2, 3], 0, [1]), ([4], 5, [2, 3])]
    b = ForwardBatch.build(seqs, 4, state_slots=[3, 5], snap_slots=[-1, 7], snap_offsets=[-1, 0])
    assert b.state_slots.tolist() == [3, 5] and b.snap_slots.tolist() == [-1, 7] and b.snap_offsets.tolist() == [-1, 0]
    assert b.state_slots.dtype == torch.int64 and b.snap_offsets_list == [-1, 0]
    plain = ForwardBatch.build(seqs, 4)  # existing callers: no state fields
    assert plain.state_slots is None and plain.snap_slots is None
    for kw, match in ((dict(state_slots=[3]), "1 / 2 / 2 sequences"),
                      (dict(state_slots=[3, 5], snap_slots=[-1, 7], snap_offsets=[-1, 1]), "after new token 1 of 1"),
                      (dict(state_slots=[3, 5], snap_slots=[-1, 3], snap_offsets=[-1, 0]), "repeat a slot"),
                      (dict(state_slots=[3, 3]), "repeat a slot"),
                      (dict(snap_slots=[1, 2]), "without state slots")):
        with pytest.raises(ValueError, match=match):
            ForwardBatch.build(seqs, 4, **kw)
