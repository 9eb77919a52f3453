"""L1 for recurrent state: per state layer, its tensors ``[num_slots, *shape]`` on the compute device.

A linear-attention (Gated DeltaNet) or Mamba2 layer keeps one state per sequence instead of KV per
token: the short convolution's last inputs and the recurrent state (hicache/tiers/state_layout.py).
A slot holds one sequence's state for every state layer. A running request owns a working slot (the
model updates it in place, serving.structs.forward_batch's ``state_slots``); snapshots of a state at a
chosen position (``snap_slots``) are slots too, held by the cache.
"""

from __future__ import annotations

import torch

from hicache.tiers.allocator import OutOfPages, PageAllocator
from hicache.tiers.state_layout import StateLayout


class OutOfStateSlots(RuntimeError):
    """Raised by :meth:`DeviceStatePool.alloc` when fewer slots are free than asked for."""


class DeviceStatePool:
    """``buffers[j][t]``: state layer ``j``'s tensor ``t`` (StateLayout order), ``[num_slots, *shape]``,
    zeros at start.

    Contract:
    - Slot ids ``0 .. num_slots-1`` come from :meth:`alloc` (a free list, as PageAllocator's: a
      double free raises); the tensors are never resized. :meth:`alloc` does not zero a slot: a
      request's working slot is zeroed (:meth:`zero_slot`) before its first token.
    - Writers: the model's state layers (the batch's ``state_slots`` in place, ``snap_slots``
      copies) and :meth:`zero_slot` / :meth:`copy_slot` / :meth:`write_slot`. All run on the
      scheduler's thread, in its stream order (a copy issued after a forward sees its state).
    - :meth:`read_slot` copies to the host and waits for the device: the scheduler calls it
      only off its hot path (tests, a tier move that already waits).
    - No locking: one scheduler thread owns the pool.
    """

    def __init__(self, layout: StateLayout, num_slots: int, device: torch.device | str) -> None:
        if layout.num_layers == 0:
            raise ValueError("a state pool needs at least one state layer")
        self.layout = layout
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.buffers: list[list[torch.Tensor]] = [
            [torch.zeros((num_slots, *t.shape), dtype=t.dtype, device=self.device) for t in layer]
            for layer in layout.layers
        ]
        self._slots = PageAllocator(num_slots)

    def layer(self, j: int) -> list[torch.Tensor]:
        """State layer ``j``'s tensors (``[num_slots, *shape]`` each), in StateLayout order."""
        return self.buffers[j]

    # -- slots ---------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return self._slots.num_free

    @property
    def num_used(self) -> int:
        return self._slots.num_used

    def can_alloc(self, n: int = 1) -> bool:
        return self._slots.can_alloc(n)

    def alloc(self, n: int = 1) -> list[int]:
        """``n`` distinct free slots (their contents are stale: zero or overwrite them)."""
        try:
            return self._slots.alloc(n)
        except OutOfPages:
            raise OutOfStateSlots(
                f"asked for {n} state slots, {self._slots.num_free} free of {self.num_slots}") from None

    def free(self, slots: list[int] | tuple[int, ...]) -> None:
        """Give slots back; a slot not allocated raises ValueError (a double free is a bug)."""
        for s in slots:
            if not 0 <= s < self.num_slots or not self._slots.is_allocated(s):
                raise ValueError(f"state slot {s} freed but not allocated")
        self._slots.free(slots)

    def is_allocated(self, slot: int) -> bool:
        return self._slots.is_allocated(slot)

    def check_integrity(self) -> None:
        self._slots.check_integrity()

    # -- contents ------------------------------------------------------------------------------

    def zero_slot(self, slot: int) -> None:
        """The state before any token (every layer's tensors zero)."""
        for layer in self.buffers:
            for buf in layer:
                buf[slot].zero_()

    def copy_slot(self, src: int, dst: int) -> None:
        """``dst`` := ``src`` for every layer (on the device, in stream order)."""
        if src == dst:
            return
        for layer in self.buffers:
            for buf in layer:
                buf[dst].copy_(buf[src])

    def read_slot(self, slot: int) -> list[torch.Tensor]:
        """Host copies of the slot's tensors, layer by layer in StateLayout order (what L2/L3 store)."""
        return [buf[slot].to("cpu", copy=True) for layer in self.buffers for buf in layer]

    def write_slot(self, slot: int, tensors: list[torch.Tensor]) -> None:
        """The slot := ``tensors`` (``read_slot``'s list: the same shapes and order)."""
        flat = [buf for layer in self.buffers for buf in layer]
        if len(tensors) != len(flat):
            raise ValueError(f"{len(tensors)} tensors for a slot of {len(flat)}")
        for buf, t in zip(flat, tensors, strict=True):
            if tuple(t.shape) != tuple(buf.shape[1:]):
                raise ValueError(f"state tensor of shape {tuple(t.shape)}, the slot holds {tuple(buf.shape[1:])}")
            buf[slot].copy_(t)

    @property
    def bytes_per_slot(self) -> int:
        return self.layout.bytes_per_slot()

    def nbytes(self) -> int:
        return self.bytes_per_slot * self.num_slots
