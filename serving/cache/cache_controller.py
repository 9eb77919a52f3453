"""Executes the tree's tier moves with the page-copy kernels.

The tree decides, the controller moves. Backups (L1 -> L2) run synchronously on the
scheduler's thread, so a freed L1 page is never reused before its bytes are saved.
Loads (L2 -> L1) run on a background thread (a CUDA side stream on GPU); each load's
future is bound to the ``PendingLoad`` the tree put on the loading nodes (a window-only load,
``window_load``, moves the sliding layers' rows alone, the same way; its ``PendingLoad`` is the
request side's: serving/cache/request_windows.py). On CPU every
request that reads those pages is skipped by the scheduler until the load is done. On
CUDA a load is *layered*: queued on the side stream one layer at a time with an event per
layer (``_GpuLoad.layer_events``), so the scheduler runs a reader at once and its forward
pass waits, on the GPU, for layer ``i``'s event before layer ``i`` (the copy overlaps the
compute; see ``serving.structs.forward_batch.LayerWaits``).

A model with state layers also moves state snapshots (``state_backup`` / ``state_load``, slot ids of
the L1 and L2 state pools) with :func:`hicache.tiers.host_state.copy_slots`, both on the scheduler's
thread in the transfers' order: a snapshot is one slot per sequence end (not pages per token), so on
CUDA (pinned L2) both directions are queued on the current stream (the forward passes after a load read
it in stream order; the host waits for a backup only where it reads the slot, HostStatePool.settle)
and on CPU copied at once; a load's ``PendingLoad`` is bound to a finished future.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from hicache.hiradix import Transfer
from hicache.tiers.device import DeviceKVPool
from hicache.tiers.host import HostKVPool
from hicache.tiers.host_state import HostStatePool, copy_slots
from hicache.tiers.state_pool import DeviceStatePool
from serving.kernels.page_copy import PageMover


class _GpuLoad(Future):
    """A load queued on the controller's CUDA stream by the page-move kernel: ``done()`` polls
    its event, ``result()`` waits for it. No thread: a loader thread would contend for the GIL
    with the scheduler's loop, which polls the load while it waits. ``layer_events[i]`` is
    recorded once layer ``i`` of every page has landed (the last one is ``done()``'s event)."""

    def __init__(self, layer_events: list[torch.cuda.Event]) -> None:
        super().__init__()
        self.layer_events = layer_events
        self._event = layer_events[-1]

    def done(self) -> bool:
        if not super().done() and self._event.query():
            self.set_result(None)
        return super().done()

    def result(self, timeout: float | None = None) -> None:
        if not super().done():
            self._event.synchronize()
            self.set_result(None)
        return super().result(timeout)


class CacheController:
    """L1 <-> L2 copies for the tree's transfers (see the module docstring).

    Concurrency contract: :meth:`execute` and :meth:`shutdown` are called on the scheduler
    thread only. A backup runs there, synchronously; it waits only for an earlier load of the
    same batch (``last.result()``), to keep the transfers' order. A load runs on the
    ``hicache-load`` thread (one worker, so loads run in order), or is queued on the CUDA side
    stream without a thread; readers wait for it through its ``PendingLoad``, never here.
    Each mover is used by one thread: ``_backup_mover`` by the scheduler thread,
    ``_load_mover`` by the loader thread (or the scheduler thread when it queues on the stream).
    ``_lock`` guards ``pages_loaded``, which the loader thread and the scheduler thread both
    add to. ``pages_backed_up`` is written only by the scheduler thread (backups run there),
    so it needs no lock; a reader on another thread sees a value at most one batch old.
    :meth:`shutdown` waits for the loads in flight.
    """

    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool,
                 state_pools: tuple[DeviceStatePool, HostStatePool] | None = None) -> None:
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.state_pools = state_pools  # (L1, L2) state pools of a model with state layers
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicache-load")
        # high priority: a load's copy kernel gets SMs ahead of the forward pass that waits for it
        self._stream = torch.cuda.Stream(device_pool.device, priority=-1) if device_pool.device.type == "cuda" \
            else None
        self._lock = threading.Lock()
        self._backup_mover = PageMover(device_pool, host_pool)  # a hybrid SWA pool: its window pages too
        self._load_mover = PageMover(device_pool, host_pool)
        self.pages_backed_up = 0
        self.pages_loaded = 0
        self.state_slots_moved = 0  # snapshots backed up or loaded (scheduler thread only)

    def execute(self, transfers: list[Transfer]) -> Future | None:
        """Run ``transfers`` in order; bind each load's copy to its ``PendingLoad`` (readers
        poll that); return the future of the last load, if any."""
        last: Future | None = None
        for t in transfers:
            if t.kind in ("state_backup", "state_load"):
                self._move_state(t)
                continue
            if t.kind == "backup":
                if last is not None:  # keep order with an earlier load in this batch
                    last.result()
                self._backup_mover.device_to_host(t.src_pages, t.dst_pages)
                self.pages_backed_up += len(t.src_pages)
                continue
            if self._load_mover.use_kernel:  # CUDA + pinned L2: queue the kernel, no thread
                last = self._load_on_stream(t)
            else:
                if self._stream is not None:  # the copy waits for the work queued so far on this thread's
                    after = torch.cuda.Event()  # stream: a pass still writing a page this load reuses
                    after.record()
                    last = self._loader.submit(self._load_after, t, after)
                else:
                    last = self._loader.submit(self._load, t)
            if t.pending is not None:
                t.pending.bind(last)
        return last

    def _move_state(self, t: Transfer) -> None:
        """A snapshot's copy between the L1 and L2 state pools (see the module docstring)."""
        if self.state_pools is None:
            raise RuntimeError(f"a {t.kind} transfer without state pools")
        device, host = self.state_pools
        queued = self.device_pool.device.type == "cuda" and host.pin  # pinned: the copies run on the stream
        if t.kind == "state_backup":
            copy_slots(device.slots.tensors(), host.tensors(), t.src_pages, t.dst_pages, non_blocking=queued)
        else:
            copy_slots(host.tensors(), device.slots.tensors(), t.src_pages, t.dst_pages, non_blocking=queued)
        if queued:  # the host slots' bytes are settled (HostStatePool.settle) once this event has passed
            event = torch.cuda.Event()
            event.record()
            host.note_copy(t.dst_pages if t.kind == "state_backup" else t.src_pages, event)
        if t.kind == "state_load":
            if t.pending is not None:
                done: Future = Future()
                done.set_result(None)
                t.pending.bind(done)
        self.state_slots_moved += len(t.src_pages)

    def _load_on_stream(self, t: Transfer) -> Future:
        with torch.cuda.stream(self._stream):
            events = self._load_mover.host_to_device_layered(t.src_pages, t.dst_pages, full=t.kind == "load")
        with self._lock:
            self.pages_loaded += len(t.src_pages) if t.kind == "load" else 0  # (a window load: a page's part)
        return _GpuLoad(events)

    def _load_after(self, t: Transfer, after: torch.cuda.Event) -> None:
        self._stream.wait_event(after)
        self._load(t)

    def _load(self, t: Transfer) -> None:
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                self._load_mover.host_to_device(t.src_pages, t.dst_pages, non_blocking=True, full=t.kind == "load")
            self._stream.synchronize()
        else:
            self._load_mover.host_to_device(t.src_pages, t.dst_pages, full=t.kind == "load")
        with self._lock:
            self.pages_loaded += len(t.src_pages) if t.kind == "load" else 0  # (a window load: a page's part)

    def shutdown(self) -> None:
        self._loader.shutdown(wait=True)
