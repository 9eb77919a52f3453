"""The slots of a recurrent-state pool: per state layer its tensors ``[num_slots, *shape]`` in
:class:`~hicache.tiers.state_layout.StateLayout` order, the free list over slot ids, and the
per-slot reads, writes and copies.

Both state tiers hold one: L1 on the compute device (hicache/tiers/state_pool.py) and L2 in host
memory (hicache/tiers/host_state.py); each adds what only it does (zeroing a working slot, the L3
payload bytes) and keeps its own error type for a full pool.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from hicache.tiers.allocator import PageAllocator
from hicache.tiers.host_pinning import PinnedTensors
from hicache.tiers.state_layout import StateLayout


class StateSlots:
    """``buffers[j][t]``: state layer ``j``'s tensor ``t``, ``[num_slots, *shape]`` on ``device``
    (pinned host memory when ``pin_memory``), zeros at start.

    Contract:
    - Slot ids ``0 .. num_slots-1`` come from :meth:`alloc` (a free list, as PageAllocator's:
      :meth:`alloc` raises OutOfPages when fewer are free, a slot freed but not allocated raises
      ValueError). :meth:`alloc` does not zero a slot. The tensors are never resized.
    - ``name`` names a slot in errors ("state slot", "L2 state slot").
    - ``extra`` rows past ``num_slots`` (ids ``num_slots .. num_slots + extra - 1``) are outside the free
      list: the owner uses them as it says (L1: speculative verification's scratch).
    - No locking: the owning pool's contract says which thread calls what.
    """

    def __init__(self, layout: StateLayout, num_slots: int, name: str, device: torch.device | str = "cpu",
                 pin_memory: bool = False, extra: int = 0) -> None:
        if layout.num_layers == 0:
            raise ValueError("a state pool needs at least one state layer")
        self.layout = layout
        self.num_slots = num_slots
        self.extra = extra
        self.name = name
        # pinned host memory through PinnedTensors (exact sizes, unpinned on release), not torch's pin_memory
        self._pinned = PinnedTensors(pin_memory)
        self._unpin = weakref.finalize(self, self._pinned.close)

        def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            if torch.device(device).type == "cpu":
                return self._pinned.zeros(shape, dtype)
            return torch.zeros(shape, dtype=dtype, device=device)

        self.buffers: list[list[torch.Tensor]] = [
            [zeros((num_slots + extra, *t.shape), t.dtype) for t in layer] for layer in layout.layers
        ]
        self.free_list = PageAllocator(num_slots)

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer, layer by layer in StateLayout order."""
        return [buf for layer in self.buffers for buf in layer]

    def release(self) -> None:
        """Unpin and drop the buffers (shutdown: their memory goes back once nothing else holds them)."""
        self._unpin()
        self.buffers = []

    # -- slots ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.free_list.num_free

    @property
    def num_used(self) -> int:
        return self.free_list.num_used

    def can_alloc(self, n: int = 1) -> bool:
        return self.free_list.can_alloc(n)

    def alloc(self, n: int = 1) -> list[int]:
        """``n`` distinct free slots (raises OutOfPages when fewer are free)."""
        return self.free_list.alloc(n)

    def free(self, slots: Sequence[int]) -> None:
        """Give slots back; a slot not allocated raises ValueError (a double free is a bug)."""
        for s in slots:
            if not 0 <= s < self.num_slots or not self.free_list.is_allocated(s):
                raise ValueError(f"{self.name} {s} freed but not allocated")
        self.free_list.free(slots)

    def is_allocated(self, slot: int) -> bool:
        return self.free_list.is_allocated(slot)

    def check_integrity(self) -> None:
        """The free list's invariants, and every buffer has the layout's shape and dtype."""
        self.free_list.check_integrity()
        for layer, bufs in zip(self.layout.layers, self.buffers, strict=True):
            for t, buf in zip(layer, bufs, strict=True):
                rows = self.num_slots + self.extra
                assert buf.shape == (rows, *t.shape) and buf.dtype == t.dtype, (
                    f"{self.name} buffer {t.name} is {tuple(buf.shape)} {buf.dtype}, not {(rows, *t.shape)}"
                )

    # -- contents ------------------------------------------------------------------------------
    def zero(self, slot: int) -> None:
        for buf in self.tensors():
            buf[slot].zero_()

    def copy(self, src: int, dst: int) -> None:
        """``dst`` := ``src`` for every tensor (on the buffers' device, in stream order)."""
        if src == dst:
            return
        for buf in self.tensors():
            buf[dst].copy_(buf[src])

    def read(self, slot: int) -> list[torch.Tensor]:
        """Host copies of the slot's tensors, layer by layer in StateLayout order."""
        return [buf[slot].to("cpu", copy=True) for buf in self.tensors()]

    def write(self, slot: int, tensors: Sequence[torch.Tensor]) -> None:
        """The slot := ``tensors`` (:meth:`read`'s list: the same shapes and order)."""
        flat = self.tensors()
        if len(tensors) != len(flat):
            raise ValueError(f"{len(tensors)} tensors for a slot of {len(flat)}")
        for buf, t in zip(flat, tensors, strict=True):
            if tuple(t.shape) != tuple(buf.shape[1:]):
                raise ValueError(f"state tensor of shape {tuple(t.shape)}, the slot holds {tuple(buf.shape[1:])}")
            buf[slot].copy_(t)
