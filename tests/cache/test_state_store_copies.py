"""A state snapshot's way to and from L3 (hicache/tiers/storage_state.py) copies its payload once each way,
into numpy arrays: writer and lookup threads run beside the scheduler's loop, and every ``bytes`` /
``bytearray`` copy of a 50 MB snapshot holds the GIL for ~30 ms (the loop waits; three such copies a
write and two a read before). On a real LMDB store: the value a write hands the store is the array the
slot was copied into, its trailer sealed in place; a lookup's payload is a view of the one array the
store copied the value into (``get_array``), and it loads back into a slot exactly."""

from __future__ import annotations

import numpy as np
import torch

from hicache.tiers.host_state import HostStatePool
from hicache.tiers.lmdb.config import LMDBConfig
from hicache.tiers.lmdb.store import LMDBStore
from hicache.tiers.state_layout import StateLayout, StateTensor
from hicache.tiers.storage_state import StateStore, part_key

LAYER = (StateTensor("conv", (6, 3), torch.bfloat16), StateTensor("recurrent", (2, 64, 64), torch.float32))
LAYOUT = StateLayout((LAYER, LAYER, LAYER))
KEYS = [f"{i:032x}" for i in range(4)]


class Recording(LMDBStore):
    """The real store, keeping what crossed its boundary."""

    def __init__(self, cfg: LMDBConfig) -> None:
        super().__init__(cfg)
        self.sets: list = []
        self.arrays: list = []

    def set(self, key, value):  # noqa: ANN001, ANN201
        self.sets.append(value)
        return super().set(key, value)

    def get_array(self, key):  # noqa: ANN001, ANN201
        got = super().get_array(key)
        self.arrays.append(got)
        return got


def _fill(pool: HostStatePool, slot: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(buf.shape[1:], generator=g).to(buf.dtype) for buf in pool.tensors()]
    pool.write_slot(slot, tensors)
    return tensors


def test_a_snapshot_goes_to_l3_and_back_in_one_array_each_way(tmp_path):
    backend = Recording(LMDBConfig(path=str(tmp_path / "l3"), capacity_gb=0.05, sync=False))
    store = StateStore(backend, LAYOUT)
    pool = HostStatePool(LAYOUT, 3, pin_memory=False)
    want = _fill(pool, 1, seed=5)
    try:
        assert store.put_slot(KEYS[2], pool, 1)
        (value,) = backend.sets
        assert isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.size == store.codec.value_nbytes
        assert bytes(value[: LAYOUT.bytes_per_slot()]) == bytes(pool.slot_bytes(1))
        assert store.codec.decode(part_key(KEYS[2]), value) is not None  # the trailer sealed in place
        assert store.put_slot(KEYS[2], pool, 1) and len(backend.sets) == 1  # already there: not written again

        depth, payload = store.find_deepest(KEYS)
        assert depth == 3
        (read,) = backend.arrays
        assert isinstance(read, np.ndarray) and read.flags.writeable  # a copy out of the map, not a view of it
        assert np.shares_memory(payload, read) and payload.size == LAYOUT.bytes_per_slot()  # no second copy
        assert bytes(read) == bytes(backend.get(part_key(KEYS[2])))
        pool.load_slot_bytes(2, payload)
        for got, w in zip(pool.read_slot(2), want, strict=True):
            assert torch.equal(got, w)
    finally:
        backend.close()


def test_a_flipped_payload_byte_is_a_miss_after_the_copy(tmp_path):
    backend = LMDBStore(LMDBConfig(path=str(tmp_path / "l3"), capacity_gb=0.05, sync=False))
    store = StateStore(backend, LAYOUT)
    pool = HostStatePool(LAYOUT, 2, pin_memory=False)
    _fill(pool, 0, seed=6)
    try:
        key = part_key(KEYS[1])
        value = store.codec.encode(key, pool.slot_bytes(0))
        value[17] ^= 1
        assert backend.set(key, value)
        assert store.find_deepest(KEYS[:2]) is None  # verified on the copy: corrupt, deleted, a miss
        assert backend.get_array(key) is None
        assert store.stats()["state_corrupt"] == 1
    finally:
        backend.close()
