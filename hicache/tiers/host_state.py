"""L2 for recurrent state: snapshots in host memory, per state layer its tensors ``[num_slots, *shape]``
(pinned when CUDA is present), and the slot copies between a pool on the device and this one.

The tree (hicache/hiradix/state_snapshots.py) hands the slots to snapshots demoted from L1 (the
device pool, hicache/tiers/state_pool.py) and takes them back; ``state_backup`` / ``state_load``
transfers move their bytes with :func:`copy_slots`. A slot holds the same tensors in the same order
(:class:`~hicache.tiers.state_layout.StateLayout`) as an L1 slot, so L1 <-> L2 is a per-tensor copy;
:meth:`HostStatePool.slot_bytes` is the slot's L3 payload (every tensor's bytes in layout order).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from hicache.tiers.state_layout import StateLayout
from hicache.tiers.state_slots import StateSlots


class HostStatePool:
    """``buffers[j][t]``: state layer ``j``'s tensor ``t`` (StateLayout order), ``[num_slots, *shape]``
    on the host, zeros at start; pinned (page-locked, for asynchronous copies) when CUDA is present.

    Contract (as the device pool's, hicache/tiers/state_pool.py):
    - Slot ids ``0 .. num_slots-1`` come from :meth:`alloc` (a free list; a double free raises);
      the tree's L2 bookkeeping owns them. The tensors are never resized.
    - Writers: the cache controller (``state_backup`` copies into a slot the tree just handed out,
      an L3 fetch writing a snapshot in with :meth:`write_slot` / :meth:`load_slot_bytes`). The
      tree never hands out a slot that a copy still reads (pinned slots wait: ``tree.state.pins``).
    - Asynchronous copies (CUDA, pinned slots): the controller queues a slot's copy to or from the
      device on a CUDA stream and records its event here (:meth:`note_copy`, scheduler thread); every
      host-side access of that slot's bytes (:meth:`read_slot`, :meth:`write_slot`,
      :meth:`slot_bytes`, :meth:`load_slot_bytes`, any thread) first waits for it (:meth:`settle`), so
      the host never reads a slot a backup is still filling nor overwrites one a load still reads.
      ``_copies`` is guarded by ``_copies_lock``.
    - Not thread-safe for overlapping slot ids; the alloc / free calls come from the scheduler
      thread only.
    """

    def __init__(self, layout: StateLayout, num_slots: int, pin_memory: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.slots = StateSlots(layout, num_slots, "L2 state slot", pin_memory=self.pin)
        self.layout = layout
        self.num_slots = num_slots
        self._copies: dict[int, torch.cuda.Event] = {}  # slot -> the event after its last queued copy
        self._copies_lock = threading.Lock()

    def release(self) -> None:
        """Unpin and drop the slots (shutdown, once nothing copies any more)."""
        for slot in list(self._copies):
            self.settle(slot)
        self.slots.release()

    # -- asynchronous copies -------------------------------------------------------------------
    def note_copy(self, slots: Sequence[int], event: torch.cuda.Event) -> None:
        """``event`` follows copies queued on the device that read or write these slots."""
        with self._copies_lock:
            for slot in slots:
                self._copies[slot] = event

    def settle(self, slot: int) -> None:
        """Wait until no queued device copy reads or writes ``slot`` any more."""
        with self._copies_lock:
            event = self._copies.pop(slot, None)
        if event is not None:
            event.synchronize()

    @property
    def buffers(self) -> list[list[torch.Tensor]]:
        return self.slots.buffers

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer, layer by layer in StateLayout order (what :func:`copy_slots` takes)."""
        return self.slots.tensors()

    # -- slots (the shared bookkeeping: hicache/tiers/state_slots.py) -----------------------------
    @property
    def num_free(self) -> int:
        return self.slots.num_free

    @property
    def num_used(self) -> int:
        return self.slots.num_used

    def alloc(self, n: int = 1) -> list[int]:
        """``n`` distinct free slots (raises OutOfPages when fewer are free)."""
        return self.slots.alloc(n)

    def free(self, slots: Sequence[int]) -> None:
        """Give slots back; a slot not allocated raises ValueError."""
        self.slots.free(slots)

    def is_allocated(self, slot: int) -> bool:
        return self.slots.is_allocated(slot)

    def check_integrity(self) -> None:
        """The free list's invariants, and every buffer has the layout's shape and dtype."""
        self.slots.check_integrity()

    # -- contents ------------------------------------------------------------------------------
    def read_slot(self, slot: int) -> list[torch.Tensor]:
        """Copies of the slot's tensors, layer by layer in StateLayout order."""
        self.settle(slot)
        return self.slots.read(slot)

    def write_slot(self, slot: int, tensors: Sequence[torch.Tensor]) -> None:
        """The slot := ``tensors`` (``read_slot``'s list: the same shapes and order)."""
        self.settle(slot)
        self.slots.write(slot, tensors)

    def slot_bytes(self, slot: int, tail: int = 0) -> np.ndarray:
        """The slot as one value (every tensor's bytes in layout order): its L3 payload, as a uint8 array,
        followed by ``tail`` bytes left unset (the caller's trailer). Writer threads call it beside the
        scheduler's loop, so the memory is not zeroed first and each tensor is one numpy copy, both with
        the GIL released (``bytearray(n)`` would hold it while it zeroes: ~30 ms for a 50 MB snapshot)."""
        self.settle(slot)
        out = np.empty(self.bytes_per_slot + tail, dtype=np.uint8)
        at = 0
        for buf in self.tensors():
            src = buf[slot].reshape(-1).view(torch.uint8).numpy()
            np.copyto(out[at : at + src.size], src)
            at += src.size
        return out

    def load_slot_bytes(self, slot: int, data: bytes | bytearray | memoryview | np.ndarray) -> None:
        """The slot := ``data`` (:meth:`slot_bytes`' form); raises ValueError on a wrong length. Reads
        ``data`` in place (no copy of the payload before the one into the slot)."""
        if len(data) != self.bytes_per_slot:
            raise ValueError(f"{len(data)} bytes for a state slot of {self.bytes_per_slot}")
        self.settle(slot)
        flat = _bytes_view(data)
        at = 0
        for buf in self.tensors():
            dst = buf[slot].view(-1).view(torch.uint8)
            dst.copy_(flat[at : at + dst.numel()])
            at += dst.numel()

    @property
    def bytes_per_slot(self) -> int:
        return self.layout.bytes_per_slot()

    def nbytes(self) -> int:
        return self.bytes_per_slot * self.num_slots


def _bytes_view(data: bytes | bytearray | memoryview | np.ndarray) -> torch.Tensor:
    """A uint8 tensor over ``data``'s memory (no copy; empty for empty data)."""
    if len(data) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # a read-only buffer (bytes) warns; we only read from it there
        warnings.simplefilter("ignore")
        return torch.frombuffer(data, dtype=torch.uint8)


def copy_slots(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], src_slots: Sequence[int],
               dst_slots: Sequence[int], non_blocking: bool = False) -> None:
    """``dst[t][dst_slots[i]] := src[t][src_slots[i]]`` for every tensor ``t`` (two pools' ``tensors()``
    lists, one on the device and one on the host, or two on the same device): a ``state_backup``
    (device -> host) or a ``state_load`` (host -> device). A slot is contiguous in each tensor, so each
    is one copy between the two slots' memory, no index tensors and no staging copy. ``non_blocking``:
    queued on the current CUDA stream from / to pinned memory (the caller orders it and records
    :meth:`HostStatePool.note_copy`); else each copy has landed when it returns."""
    if len(src) != len(dst) or len(src_slots) != len(dst_slots):
        raise ValueError(f"{len(src)} -> {len(dst)} tensors, {len(src_slots)} -> {len(dst_slots)} slots")
    for s, d in zip(src, dst, strict=True):
        for a, b in zip(src_slots, dst_slots, strict=True):
            d[b].copy_(s[a], non_blocking=non_blocking)
