"""Moving scattered pages between the L1 pool and the L2 host pool.

Every move covers all layers, K and V, of a whole list of pages (never one copy call per
page).

- CUDA with a pinned host pool: one Triton kernel per move (``page_copy_triton``) reads the
  device pool and writes pinned host memory through its UVA address (or the reverse), in
  either host layout. Backups (L1 -> L2) run on the mover's own backup stream, ordered
  after the KV writes already queued on the model's stream by an event; the model's stream
  then waits (on the GPU, not the host) for the copy before it may overwrite those pages.
  The host pool remembers the copy's event, and host-side readers of L2 wait for it.
  Loads (L2 -> L1) run on the caller's current stream (the controller's side stream),
  after pending backups and after the work already queued on the model's stream; a
  *layered* load launches once per layer and records an event after each, so a forward
  pass can start layer ``i`` as soon as layer ``i``'s KV has landed.
- CPU, or an unpinned host pool: torch indexing through reused staging buffers (on CUDA
  the gather runs on the device, one bulk copy crosses PCIe, the scatter runs on the host).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from hicache.tiers.host import HostKVPool
from hicache.tiers.kv_codec import storage_dtype

log = logging.getLogger(__name__)

# Layers per launch pair (K rows, V rows) of a layered load: fewer launches hold the GIL for
# less time (reader threads of an L3 fetch need it); each group ends with one event.
LAYER_GROUP = 4
# A layered load's copy kernel runs beside the forward pass that waits for it: at most this many
# programs, each looping over its chunks, so the layers' kernels keep the other SMs. Measured on
# the H200 (8B shape, 4k-token L2 hit, median of 12): one program per chunk 18.1 ms, 16: 14.2,
# 32: 13.9, 64: 14.0, 132: 17.1, 264: 17.2 (bench/results/diag/l2-hit-load-programs-h200-2026-12-01.json);
# None: one program per chunk.
LOAD_PROGRAMS: int | None = 32


def flat(kv_buffer: torch.Tensor) -> torch.Tensor:
    # [2, L, P, ps, H, D] -> [2L, P, ps*H*D]
    two, layers, pages = kv_buffer.shape[:3]
    return kv_buffer.view(two * layers, pages, kv_buffer.shape[3:].numel())  # (no -1: a pool may hold 0 layers)


def host_page_dim(host: HostKVPool) -> int:
    return 0 if host.layout_name == "page_first" else 1


class PageMover:
    """Copies pages between one device pool buffer and one host pool. One user at a time
    per direction (the controller serializes loads on one thread; backups run on the
    scheduler thread)."""

    def __init__(self, kv_buffer: torch.Tensor, host: HostKVPool, use_kernel: bool | None = None) -> None:
        self.dev = flat(kv_buffer.view(storage_dtype(kv_buffer.dtype)))  # [2L, P, X]; an fp8 L1 moves as bytes
        self.host = host
        self._bufs: dict[str, torch.Tensor] = {}
        dev = self.dev.device
        can = dev.type == "cuda" and host.buffer.is_pinned() and host.encoding == "raw"  # encoded: read/write_pages
        self.use_kernel = can if use_kernel is None else (use_kernel and can)
        if self.use_kernel:
            self._main = torch.cuda.current_stream(dev)  # the model's stream (built on the scheduler thread)
            self._backup_stream = torch.cuda.Stream(dev)
            self._ids_ring: list[tuple[torch.Tensor | None, torch.cuda.Event | None]] = [(None, None)] * 4
            self._warm_up()

    def _warm_up(self) -> None:
        """Compile both directions now, on this thread (Triton's first launch compiles; the
        loader thread and the scheduler thread should not both do that at once). Moves page
        0 out and back, so the pools hold what they held."""
        from serving.kernels.page_copy_triton import move_pages

        ids = torch.zeros(1, dtype=torch.int64, device=self.dev.device)
        saved = self.host.buffer.select(host_page_dim(self.host), 0).clone()
        move_pages(self.dev, 1, ids, self.host.buffer, host_page_dim(self.host), ids)
        move_pages(self.host.buffer, host_page_dim(self.host), ids, self.dev, 1, ids)
        if LOAD_PROGRAMS is not None:  # a layered load's capped kernel too (a first build takes ~1 s)
            move_pages(self.host.buffer, host_page_dim(self.host), ids, self.dev, 1, ids, max_programs=1)
        torch.cuda.synchronize(self.dev.device)
        self.host.buffer.select(host_page_dim(self.host), 0).copy_(saved)

    # -- staging path (CPU, unpinned host) --------------------------------------------
    def _staging(self, name: str, n: int, device: torch.device, pin: bool = False) -> torch.Tensor:
        rows, x = self.dev.shape[0], self.dev.shape[2]
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < rows * n * x:
            buf = torch.empty(rows * n * x, dtype=self.dev.dtype, device=device, pin_memory=pin)
            self._bufs[name] = buf
        return buf[: rows * n * x].view(rows, n, x)

    def _ids(self, pages: Sequence[int], device: torch.device) -> torch.Tensor:
        return torch.tensor(list(pages), dtype=torch.int64, device=device)

    # -- kernel path ------------------------------------------------------------------
    def _dev_ids(self, src: Sequence[int], dst: Sequence[int]) -> torch.Tensor:
        """``[2, n]`` int64 on the GPU, copied on the current stream from one of a few reused
        pinned buffers (a fresh pinned tensor per call can cost a ``cudaHostAlloc``, i.e.
        hundreds of microseconds during which the GPU waits)."""
        n = len(src)
        slot = self._ids_next = (getattr(self, "_ids_next", -1) + 1) % len(self._ids_ring)
        buf, event = self._ids_ring[slot]
        if buf is None or buf.shape[1] < n:
            buf = torch.empty((2, max(n, 1024)), dtype=torch.int64, pin_memory=True)
        elif event is not None:
            event.synchronize()  # its last copy to the GPU (long done in practice)
        host = buf.numpy()
        host[0, :n] = src
        host[1, :n] = dst
        ids = torch.empty((2, n), dtype=torch.int64, device=self.dev.device)
        ids.copy_(buf[:, :n], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._ids_ring[slot] = (buf, event)
        return ids

    def _kernel_backup(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        from serving.kernels.page_copy_triton import move_pages

        ready = torch.cuda.Event()
        ready.record(self._main)  # every KV write queued so far
        s = self._backup_stream
        s.wait_event(ready)
        with torch.cuda.stream(s):
            ids = self._dev_ids(device_pages, host_pages)
            move_pages(self.dev, 1, ids[0], self.host.buffer, host_page_dim(self.host), ids[1])
            done = torch.cuda.Event()
            done.record(s)
        self._main.wait_event(done)  # freed L1 pages are rewritten only after the copy
        self.host.add_pending_write(done)

    def _kernel_load(self, host_pages: Sequence[int], device_pages: Sequence[int],
                     layered: bool = False) -> list[torch.cuda.Event] | None:
        """Queue the load on the current stream; ``layered``: launches per group of
        ``LAYER_GROUP`` layers, each group followed by an event; returns one event per layer
        (a group's layers share theirs) that a forward pass waits for before that layer
        reads its KV."""
        from serving.kernels.page_copy_triton import move_pages

        s = torch.cuda.current_stream(self.dev.device)
        if s != self._main:
            after = torch.cuda.Event()
            after.record(self._main)  # earlier readers of the reused L1 pages
            s.wait_event(after)
        pending = self.host.pending_write
        if pending is not None:
            s.wait_event(pending)  # a backup still writing host pages
        ids = self._dev_ids(host_pages, device_pages)
        if not layered:
            move_pages(self.host.buffer, host_page_dim(self.host), ids[0], self.dev, 1, ids[1])
            return None
        layers = self.dev.shape[0] // 2  # row r of the flat pool: K of layer r (< L), V of layer r - L
        hdim = host_page_dim(self.host)
        events = []
        for lo in range(0, layers, LAYER_GROUP):
            hi = min(layers, lo + LAYER_GROUP)
            for rows in (slice(lo, hi), slice(layers + lo, layers + hi)):  # K rows, then V rows
                src = self.host.buffer[:, rows] if hdim == 0 else self.host.buffer[rows]
                move_pages(src, hdim, ids[0], self.dev[rows], 1, ids[1], max_programs=LOAD_PROGRAMS)
            ev = torch.cuda.Event()
            ev.record(s)
            events += [ev] * (hi - lo)
        return events

    # -- moves --------------------------------------------------------------------------
    def device_to_host(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        if len(device_pages) != len(host_pages):
            raise ValueError("device_pages and host_pages differ in length")
        if not device_pages:
            return
        if self.use_kernel:
            self._kernel_backup(device_pages, host_pages)
            return
        n, dev = len(device_pages), self.dev.device
        gathered = torch.index_select(self.dev, 1, self._ids(device_pages, dev),
                                      out=self._staging("out_dev", n, dev))  # [2L, n, X]
        if dev.type != "cpu":
            pinned = self._staging("out_host", n, torch.device("cpu"), pin=self.host.pin)
            pinned.copy_(gathered)
            gathered = pinned
        self.host.write_pages(self._ids(host_pages, torch.device("cpu")), gathered)

    def host_to_device(self, host_pages: Sequence[int], device_pages: Sequence[int],
                       non_blocking: bool = False) -> None:
        """With the kernel the copy is queued on the current stream; ``non_blocking=False``
        then waits for it."""
        if len(device_pages) != len(host_pages):
            raise ValueError("device_pages and host_pages differ in length")
        if not host_pages:
            return
        if self.use_kernel:
            self._kernel_load(host_pages, device_pages)
            if not non_blocking:
                torch.cuda.current_stream(self.dev.device).synchronize()
            return
        n, dev = len(host_pages), self.dev.device
        cpu = torch.device("cpu")
        src = self.host.read_pages(self._ids(host_pages, cpu),
                                   out=self._staging("in_host", n, cpu, pin=self.host.pin and dev.type != "cpu"))
        if dev.type != "cpu":
            staged = self._staging("in_dev", n, dev)
            staged.copy_(src, non_blocking=non_blocking)
            src = staged
        self.dev.index_copy_(1, self._ids(device_pages, dev), src)

    def host_to_device_layered(self, host_pages: Sequence[int],
                               device_pages: Sequence[int]) -> list[torch.cuda.Event]:
        """Kernel path only: queue the load on the current stream a few layers at a time;
        returns one event per layer, recorded once that layer's K and V of every page (and
        those of the layers before it) have landed."""
        if not self.use_kernel:
            raise RuntimeError("layered loads need the CUDA kernel path (pinned L2)")
        if len(device_pages) != len(host_pages) or not host_pages:
            raise ValueError("need equally long, non-empty page lists")
        return self._kernel_load(host_pages, device_pages, layered=True)

    def synchronize(self) -> None:
        """Wait on the host until every backup queued so far has landed in L2."""
        self.host.wait_pending_writes()


def device_to_host(kv_buffer: torch.Tensor, host: HostKVPool, device_pages: Sequence[int],
                   host_pages: Sequence[int]) -> None:
    """One-off move (tests, tools); hot paths keep a :class:`PageMover`."""
    PageMover(kv_buffer, host).device_to_host(device_pages, host_pages)


def host_to_device(host: HostKVPool, kv_buffer: torch.Tensor, host_pages: Sequence[int],
                   device_pages: Sequence[int]) -> None:
    PageMover(kv_buffer, host).host_to_device(host_pages, device_pages)
