"""L1 for recurrent state: per state layer, its tensors ``[num_slots, *shape]`` on the compute device.

A linear-attention (Gated DeltaNet) or Mamba2 layer keeps one state per sequence instead of KV per
token: the short convolution's last inputs and the recurrent state (hicache/tiers/state_layout.py).
A slot holds one sequence's state for every state layer. A running request owns a working slot (the
model updates it in place, serving.structs.forward_batch's ``state_slots``); snapshots of a state at a
chosen position (``snap_slots``) are slots too, held by the cache.

With speculative decoding the pool also has **scratch** slots (ids ``scratch_base ..`` past the
allocatable ones, outside the free list): a verify pass writes a drafting request's state after each
of its tokens but the last into a run of them, and the accepted position's state is copied into the
request's working slot (serving/cache/request_states.py). They hold nothing between steps.
"""

from __future__ import annotations

import torch

from hicache.tiers.allocator import OutOfPages
from hicache.tiers.state_layout import StateLayout
from hicache.tiers.state_slots import StateSlots

VERIFY_ROWS = 8  # requests that may verify drafts in one step (their scratch is reserved)


def verify_scratch_slots(num_draft_tokens: int | None, max_running_requests: int) -> int:
    """Scratch slots for speculative decoding with ``num_draft_tokens`` (the last token and its drafts;
    None: off): one per draft for up to ``VERIFY_ROWS`` verifying requests a step."""
    if not num_draft_tokens:
        return 0
    return (num_draft_tokens - 1) * max(1, min(VERIFY_ROWS, max_running_requests))


class OutOfStateSlots(RuntimeError):
    """Raised by :meth:`DeviceStatePool.alloc` when fewer slots are free than asked for."""


class DeviceStatePool:
    """``buffers[j][t]``: state layer ``j``'s tensor ``t`` (StateLayout order), ``[num_slots + scratch + 1,
    *shape]``, zeros at start.

    Contract:
    - Slot ids ``0 .. num_slots-1`` come from :meth:`alloc` (a free list, as PageAllocator's: a
      double free raises); the tensors are never resized. :meth:`alloc` does not zero a slot: a
      request's working slot is zeroed (:meth:`zero_slot`) before its first token.
    - Writers: the model's state layers (the batch's ``state_slots`` in place, ``snap_slots``
      copies) and :meth:`zero_slot` / :meth:`copy_slot` / :meth:`write_slot`. All run on the
      scheduler's thread, in its stream order (a copy issued after a forward sees its state).
    - :meth:`read_slot` copies to the host and waits for the device: the scheduler calls it
      only off its hot path (tests, a tier move that already waits).
    - ``scratch`` slots (ids ``scratch_base .. scratch_base + scratch - 1``) are outside the free
      list (see the module doc); the same writers, the same thread.
    - Row ``pad_slot`` (the last) is never allocated: whatever a CUDA graph's padding rows compute
      lands there, and nothing reads it as a sequence's state.
    - No locking: one scheduler thread owns the pool.
    """

    def __init__(self, layout: StateLayout, num_slots: int, device: torch.device | str, scratch: int = 0) -> None:
        self.device = torch.device(device)
        self.slots = StateSlots(layout, num_slots, "state slot", device=self.device, extra=scratch + 1)
        self.layout = layout
        self.num_slots = num_slots
        self.scratch_base = num_slots
        self.num_scratch = scratch
        # the row after the scratch slots, never allocated: a CUDA graph's padding rows (and rows taking no
        # snapshot) read and write their state there (serving/runner/cuda_graph.py)
        self.pad_slot = num_slots + scratch

    @property
    def buffers(self) -> list[list[torch.Tensor]]:
        return self.slots.buffers

    def layer(self, j: int) -> list[torch.Tensor]:
        """State layer ``j``'s tensors (``[num_slots + scratch + 1, *shape]`` each), in StateLayout order."""
        return self.slots.buffers[j]

    def release(self) -> None:
        """Shutdown: drop the buffers (their memory goes back once nothing else holds them)."""
        self.slots.release()

    # -- slots (the shared bookkeeping: hicache/tiers/state_slots.py) -----------------------------

    @property
    def num_free(self) -> int:
        return self.slots.num_free

    @property
    def num_used(self) -> int:
        return self.slots.num_used

    def can_alloc(self, n: int = 1) -> bool:
        return self.slots.can_alloc(n)

    def alloc(self, n: int = 1) -> list[int]:
        """``n`` distinct free slots (their contents are stale: zero or overwrite them)."""
        try:
            return self.slots.alloc(n)
        except OutOfPages:
            raise OutOfStateSlots(
                f"asked for {n} state slots, {self.slots.num_free} free of {self.num_slots}") from None

    def free(self, slots: list[int] | tuple[int, ...]) -> None:
        """Give slots back; a slot not allocated raises ValueError (a double free is a bug)."""
        self.slots.free(slots)

    def is_allocated(self, slot: int) -> bool:
        return self.slots.is_allocated(slot)

    def check_integrity(self) -> None:
        """The free list's invariants, and every buffer has the layout's shape and dtype."""
        self.slots.check_integrity()

    # -- contents ------------------------------------------------------------------------------

    def zero_slot(self, slot: int) -> None:
        """The state before any token (every layer's tensors zero)."""
        self.slots.zero(slot)

    def copy_slot(self, src: int, dst: int) -> None:
        """``dst`` := ``src`` for every layer (on the device, in stream order)."""
        self.slots.copy(src, dst)

    def read_slot(self, slot: int) -> list[torch.Tensor]:
        """Host copies of the slot's tensors, layer by layer in StateLayout order (what L2/L3 store)."""
        return self.slots.read(slot)

    def write_slot(self, slot: int, tensors: list[torch.Tensor]) -> None:
        """The slot := ``tensors`` (``read_slot``'s list: the same shapes and order)."""
        self.slots.write(slot, tensors)

    @property
    def bytes_per_slot(self) -> int:
        return self.layout.bytes_per_slot()

    def nbytes(self) -> int:
        """Every row's bytes: the slots, the scratch slots and the padding row."""
        return self.bytes_per_slot * (self.pad_slot + 1)
