"""Moving scattered pages between the L1 pool and the L2 host pool.

Every move covers all layers, K and V, of a whole list of pages (never one copy call per
page). An L2 page holds every KV layer in one row order (K of each KV layer, then V of each).

A hybrid SWA L1 (hicache/tiers/window_pages.py) keeps its sliding layers in a window buffer
indexed by window pages: a page's full layers move from / to its logical page, its sliding
layers from / to its window page where it has one (``windows.map``). A backup of a page without
one leaves its host page's sliding rows stale and says so (``host.sliding_valid``); a load fills
the window pages of the pages that have one (the caller gives window pages only to pages whose
host flag is valid and whose window KV a reader needs). An L2 with a host window pool
(``host.windows``, hicache/tiers/host_windows.py) mirrors that: its pages hold the full layers, and a
backup gives each page with an L1 window page a host window page (``HostWindows.take``: reclaiming
under pressure; a page that gets none keeps no sliding part), into which its sliding layers go; a
load reads a page's sliding layers from its host window page. A window-only load (``full=False``) moves the
sliding layers alone, into the window pages of pages whose full layers are on L1 already
(serving/cache/request_windows.py, ``restore``).

- CUDA with a pinned host pool: one Triton kernel per move (``page_copy_triton``) reads the
  device pool and writes pinned host memory through its UVA address (or the reverse), in
  either host layout. Backups (L1 -> L2) run on the mover's own backup stream, ordered
  after the KV writes already queued on the model's stream by an event; the model's stream
  then waits (on the GPU, not the host) for the copy before it may overwrite those pages.
  The host pool remembers the copy's event, and host-side readers of L2 wait for it.
  Loads (L2 -> L1) run on the caller's current stream (the controller's side stream),
  after pending backups and after the work already queued on the model's stream; a
  *layered* load launches once per layer and records an event after each, so a forward
  pass can start layer ``i`` as soon as layer ``i``'s KV has landed. With a window buffer a
  move is one launch per run of host rows that sit in one buffer in the same order (full and
  sliding layers interleave in the host's order; ``_runs``); with a host window pool as well, one
  launch per buffer's run of rows (each host buffer keeps its L1 buffer's row order).
- CPU, or an unpinned host pool: torch indexing through reused staging buffers (on CUDA
  the gather runs on the device, one bulk copy crosses PCIe, the scatter runs on the host).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from hicache.tiers.device import DeviceKVPool
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
    """Copies pages between one L1 pool (a :class:`DeviceKVPool`, its window buffer included, or one
    pool buffer of every layer) and one host pool. One user at a time per direction (the controller
    serializes loads on one thread; backups run on the scheduler thread)."""

    def __init__(self, pool: DeviceKVPool | torch.Tensor, host: HostKVPool, use_kernel: bool | None = None) -> None:
        kv_buffer = pool if isinstance(pool, torch.Tensor) else pool.kv_buffer
        self.dev = flat(kv_buffer.view(storage_dtype(kv_buffer.dtype)))  # [2Lf, P, X]; an fp8 L1 moves as bytes
        self.host = host
        self.windows = None if isinstance(pool, torch.Tensor) else pool.windows
        self.win: torch.Tensor | None = None  # the window buffer, flat: [2Ls, W, X]
        nl = self.dev.shape[0] // 2  # KV layers (all of them in one buffer)
        full, sliding = tuple(range(nl)), ()
        if self.windows is not None:
            assert pool.win_buffer is not None
            self.win = flat(pool.win_buffer.view(storage_dtype(pool.win_buffer.dtype)))
            nl, full, sliding = pool.layout.num_layers, pool.full_layers, pool.window_layers
        self.layers = nl
        self.hwin = host.windows  # an L2 with a host window pool: its rows of a buffer are the device's
        # host row -> (buffer 0: full / 1: window, its row there)
        self.row_of = [None] * (2 * nl)
        self._run_cache: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}  # (lo, hi) -> _runs
        for b, layers in enumerate((full, sliding)):
            for kv in (0, 1):
                for row, i in enumerate(layers):
                    self.row_of[kv * nl + i] = (b, kv * len(layers) + row)
        dev = self.dev.device
        self._full_idx = torch.tensor([kv * nl + i for kv in (0, 1) for i in full], dtype=torch.int64, device=dev)
        self._win_idx = torch.tensor([kv * nl + i for kv in (0, 1) for i in sliding], dtype=torch.int64, device=dev)
        self._bufs: dict[str, torch.Tensor] = {}
        can = dev.type == "cuda" and host.buffer.is_pinned() and host.encoding == "raw" and \
            (self.hwin is None or self.hwin.buffer.is_pinned())  # encoded: read/write_pages
        self.use_kernel = can if use_kernel is None else (use_kernel and can)
        if self.use_kernel:
            self._main = torch.cuda.current_stream(dev)  # the model's stream (built on the scheduler thread)
            self._backup_stream = torch.cuda.Stream(dev)
            self._ids_ring: list[tuple[torch.Tensor | None, torch.cuda.Event | None]] = [(None, None)] * 4
            self._warm_up()

    def _warm_up(self) -> None:
        """Compile both directions now, on this thread (Triton's first launch compiles; the
        loader thread and the scheduler thread should not both do that at once). Moves page
        0 (and window page 0) out and back, so the pools hold what they held."""
        hdim = host_page_dim(self.host)
        ids = torch.zeros(1, dtype=torch.int64, device=self.dev.device)
        saved = self.host.buffer.select(hdim, 0).clone()
        hwin = self.hwin
        saved_win = None if hwin is None else hwin.buffer.select(hwin.page_dim, 0).clone()
        every = [(0, 2 * self.layers)]
        self.move(True, (ids,) * 4, every)
        self.move(False, (ids,) * 4, every)
        if LOAD_PROGRAMS is not None:  # a layered load's capped kernels too (a first build takes ~1 s)
            for lo in range(0, self.layers, LAYER_GROUP):
                hi = min(self.layers, lo + LAYER_GROUP)
                self.move(False, (ids,) * 4, [(lo, hi), (self.layers + lo, self.layers + hi)], max_programs=1)
        torch.cuda.synchronize(self.dev.device)
        self.host.buffer.select(hdim, 0).copy_(saved)
        if hwin is not None and saved_win is not None:
            hwin.buffer.select(hwin.page_dim, 0).copy_(saved_win)

    # -- staging path (CPU, unpinned or encoded host) -----------------------------------
    def _staging(self, name: str, n: int, device: torch.device, pin: bool = False) -> torch.Tensor:
        """``[2L, n, X]``: ``n`` pages of every KV layer in the host's row order."""
        rows, x = 2 * self.layers, self.dev.shape[2]
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < rows * n * x:
            buf = torch.empty(rows * n * x, dtype=self.dev.dtype, device=device, pin_memory=pin)
            self._bufs[name] = buf
        return buf[: rows * n * x].view(rows, n, x)

    def _ids(self, pages: Sequence[int], device: torch.device) -> torch.Tensor:
        return torch.tensor(list(pages), dtype=torch.int64, device=device)

    def _windowed(self, device_pages: Sequence[int], host_pages: Sequence[int] | None = None
                  ) -> tuple[list[int], list[int]]:
        """(indexes into ``device_pages`` of the pages with a window page, their window pages); with a host
        window pool and ``host_pages``, only the pages whose host page has a host window page too."""
        if self.windows is None:
            return [], []
        m = self.windows.map
        idx = [i for i, p in enumerate(device_pages) if m[p] >= 0]
        if self.hwin is not None and host_pages is not None:
            hm = self.hwin.map
            idx = [i for i in idx if hm[host_pages[i]] >= 0]
        return idx, [m[device_pages[i]] for i in idx]

    # -- kernel path ------------------------------------------------------------------
    def _runs(self, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
        """Host rows ``lo .. hi - 1`` as ``(buffer, host row, buffer row, n)`` runs of consecutive rows (one
        launch each), computed once per range. With a host window pool a buffer's rows lie in the host in that
        buffer's own order, so only the buffer rows need be consecutive: Gemma-3's 5:1 layers move in 2 runs,
        not 32."""
        runs = self._run_cache.get((lo, hi))
        if runs is not None:
            return runs
        runs = []
        rows = [(*self.row_of[h], h) for h in range(lo, hi)]
        if self.hwin is not None:
            rows.sort()
        for b, d, h in rows:
            last = runs[-1] if runs else None
            if last is not None and last[0] == b and last[2] + last[3] == d and \
                    (self.hwin is not None or last[1] + last[3] == h):
                runs[-1] = (*last[:3], last[3] + 1)
            else:
                runs.append((b, h, d, 1))
        self._run_cache[(lo, hi)] = runs
        return runs

    def id_lists(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> tuple[list[int], list[int]]:
        """The kernel's page ids: ``device_pages`` then their window pages, and the host pages of each (their
        host window pages with a host window pool)."""
        idx, wins = self._windowed(device_pages, host_pages)
        hosts = [host_pages[i] for i in idx]
        if self.hwin is not None:
            hosts = [self.hwin.map[h] for h in hosts]
        return list(device_pages) + wins, list(host_pages) + hosts

    def move(self, to_host: bool, ids: tuple[torch.Tensor, ...], host_rows: Sequence[tuple[int, int]],
             max_programs: int | None = None) -> None:
        """Launch the copies of host row ranges ``host_rows`` on the current stream. ``ids``: (logical pages,
        their host pages, window pages, their host pages) as tensors where the kernel runs (a window page's
        rows go to / come from its logical page's host page)."""
        from serving.kernels.page_copy_triton import move_pages

        hdim, hb = host_page_dim(self.host), self.host.buffer
        bufs = (self.dev, self.win)
        hbufs = (hb, hb if self.hwin is None else self.hwin.buffer)
        for lo, hi in host_rows:
            for b, h_lo, d_lo, n in self._runs(lo, hi):
                d_ids, h_ids = ids[2 * b], ids[2 * b + 1]
                if d_ids.numel() == 0:
                    continue
                if self.hwin is not None:  # its own buffers' rows, in the device buffers' order
                    hb, h_lo = hbufs[b], d_lo
                h = hb[:, h_lo: h_lo + n] if hdim == 0 else hb[h_lo: h_lo + n]
                d = bufs[b][d_lo: d_lo + n]
                if to_host:
                    move_pages(d, 1, d_ids, h, hdim, h_ids)
                else:
                    move_pages(h, hdim, h_ids, d, 1, d_ids, max_programs=max_programs)

    def _dev_ids(self, device_pages: Sequence[int], host_pages: Sequence[int],
                 full: bool = True) -> tuple[torch.Tensor, ...]:
        """``move``'s ids on the GPU, copied on the current stream from one of a few reused pinned
        buffers (a fresh pinned tensor per call can cost a ``cudaHostAlloc``, i.e. hundreds of
        microseconds during which the GPU waits; one is taken only while a slot's copy is queued).
        ``full=False``: no logical pages (a window-only load)."""
        src, dst = self.id_lists(device_pages, host_pages)
        k = len(device_pages)
        if not full:
            src, dst, k = src[k:], dst[k:], 0
        n = len(src)
        slot = self._ids_next = (getattr(self, "_ids_next", -1) + 1) % len(self._ids_ring)
        buf, event = self._ids_ring[slot]
        if buf is None or buf.shape[1] < n or (event is not None and not event.query()):
            # a slot still copying (a backup's copy waits on its stream for the forward pass in flight): a fresh
            # buffer rather than a wait for that pass; the caching host allocator reuses the old one only once
            # its copy is done
            buf = torch.empty((2, max(n, 1024)), dtype=torch.int64, pin_memory=True)
        host = buf.numpy()
        host[0, :n] = src
        host[1, :n] = dst
        ids = torch.empty((2, n), dtype=torch.int64, device=self.dev.device)
        ids.copy_(buf[:, :n], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._ids_ring[slot] = (buf, event)
        return ids[0, :k], ids[1, :k], ids[0, k:], ids[1, k:]

    def _kernel_backup(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        ready = torch.cuda.Event()
        ready.record(self._main)  # every KV write queued so far
        s = self._backup_stream
        s.wait_event(ready)
        with torch.cuda.stream(s):
            self.move(True, self._dev_ids(device_pages, host_pages), [(0, 2 * self.layers)])
            done = torch.cuda.Event()
            done.record(s)
        self._main.wait_event(done)  # freed L1 pages are rewritten only after the copy
        self.host.add_pending_write(done)

    def _kernel_load(self, host_pages: Sequence[int], device_pages: Sequence[int],
                     layered: bool = False, full: bool = True) -> list[torch.cuda.Event] | None:
        """Queue the load on the current stream; ``layered``: launches per group of
        ``LAYER_GROUP`` layers, each group followed by an event; returns one event per layer
        (a group's layers share theirs) that a forward pass waits for before that layer
        reads its KV. ``full=False``: the sliding layers' rows only (a window-only load)."""
        s = torch.cuda.current_stream(self.dev.device)
        if s != self._main:
            after = torch.cuda.Event()
            after.record(self._main)  # earlier readers of the reused L1 pages
            s.wait_event(after)
        pending = self.host.pending_write
        if pending is not None:
            s.wait_event(pending)  # a backup still writing host pages
        ids = self._dev_ids(device_pages, host_pages, full)
        nl = self.layers  # host row r: K of layer r (< L), V of layer r - L
        if not layered:
            self.move(False, ids, [(0, 2 * nl)])
            return None
        events = []
        for lo in range(0, nl, LAYER_GROUP):
            hi = min(nl, lo + LAYER_GROUP)
            self.move(False, ids, [(lo, hi), (nl + lo, nl + hi)], max_programs=LOAD_PROGRAMS)  # K rows, V rows
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
        if self.windows is not None and self.hwin is not None:  # host window pages for the windowed pages
            m = self.windows.map
            self.hwin.drop([hp for p, hp in zip(device_pages, host_pages, strict=True) if m[p] < 0])
            self.hwin.take([hp for p, hp in zip(device_pages, host_pages, strict=True) if m[p] >= 0])
        elif self.windows is not None:  # which host pages get their sliding rows
            m = self.windows.map
            for p, hp in zip(device_pages, host_pages, strict=True):
                self.host.sliding_valid[hp] = 1 if m[p] >= 0 else 0
        if self.use_kernel:
            self._kernel_backup(device_pages, host_pages)
            return
        n, dev = len(device_pages), self.dev.device
        st = self._staging("out_dev", n, dev)  # [2L, n, X] in the host's row order
        if self.win is None:
            torch.index_select(self.dev, 1, self._ids(device_pages, dev), out=st)
        else:
            st[self._full_idx] = self.dev.index_select(1, self._ids(device_pages, dev))
            idx, wins = self._windowed(device_pages)
            if idx:
                got = self.win.index_select(1, self._ids(wins, dev))  # [2Ls, k, X]
                st[self._win_idx[:, None], self._ids(idx, dev)[None, :]] = got
        if dev.type != "cpu":
            pinned = self._staging("out_host", n, torch.device("cpu"), pin=self.host.pin)
            pinned.copy_(st)
            st = pinned
        self.host.write_pages(self._ids(host_pages, torch.device("cpu")), st)

    def host_to_device(self, host_pages: Sequence[int], device_pages: Sequence[int],
                       non_blocking: bool = False, full: bool = True) -> None:
        """With the kernel the copy is queued on the current stream; ``non_blocking=False``
        then waits for it. ``full=False``: only the sliding layers' KV, into the window pages of
        ``device_pages`` (a window-only load: their full layers are on L1 already)."""
        if len(device_pages) != len(host_pages):
            raise ValueError("device_pages and host_pages differ in length")
        if not full and self.windows is None:
            raise ValueError("a window-only load needs a hybrid SWA L1")
        if not host_pages:
            return
        if self.use_kernel:
            self._kernel_load(host_pages, device_pages, full=full)
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
        if self.win is None:
            self.dev.index_copy_(1, self._ids(device_pages, dev), src)
            return
        if full:
            self.dev.index_copy_(1, self._ids(device_pages, dev), src.index_select(0, self._full_idx))
        idx, wins = self._windowed(device_pages, host_pages)
        if idx:
            part = src.index_select(0, self._win_idx).index_select(1, self._ids(idx, dev))
            self.win.index_copy_(1, self._ids(wins, dev), part)

    def host_to_device_layered(self, host_pages: Sequence[int], device_pages: Sequence[int],
                               full: bool = True) -> list[torch.cuda.Event]:
        """Kernel path only: queue the load on the current stream a few layers at a time;
        returns one event per layer, recorded once that layer's K and V of every page (and
        those of the layers before it) have landed. ``full=False``: as :meth:`host_to_device`."""
        if not self.use_kernel:
            raise RuntimeError("layered loads need the CUDA kernel path (pinned L2)")
        if len(device_pages) != len(host_pages) or not host_pages:
            raise ValueError("need equally long, non-empty page lists")
        return self._kernel_load(host_pages, device_pages, layered=True, full=full)

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
