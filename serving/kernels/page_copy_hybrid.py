"""Moving pages between a hybrid SWA L1 pool (full layers by logical page, sliding layers by window
page: hicache/tiers/window_pages.py) and the L2 host pool, whose pages keep every KV layer in the
usual row order (K of each KV layer, then V of each).

A backup copies a page's full layers from its logical page and its sliding layers from its window
page when it has one; the host page's ``sliding_valid`` flag says which (a page without a window page
leaves its host page's sliding rows stale, flagged invalid). A load copies the full layers into the
logical page and the sliding layers into the window page when the logical page has one (the caller
gives window pages only to pages whose host flag is valid and whose window KV a reader needs).

Same two paths as :class:`~serving.kernels.page_copy.PageMover`: the CUDA kernel (one launch per run
of consecutive rows: the pool's full and window rows interleave in the host's order) and torch
indexing through staging buffers. A layered load records one event after all of its rows (every
layer waits for the whole load).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hicache.tiers.device import DeviceKVPool
from hicache.tiers.host import HostKVPool
from hicache.tiers.kv_codec import storage_dtype
from serving.kernels.page_copy import PageMover, flat, host_page_dim


def _row_runs(host_rows: list[int]) -> list[tuple[int, int, int]]:
    """``(host_lo, dev_lo, n)`` runs where host row ``host_rows[i]`` is device row ``i``."""
    runs: list[tuple[int, int, int]] = []
    for d, h in enumerate(host_rows):
        if runs and runs[-1][0] + runs[-1][2] == h and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((h, d, 1))
    return runs


class HybridPageMover(PageMover):
    """A :class:`PageMover` over a pool with a window buffer (``pool.windows`` set)."""

    def __init__(self, pool: DeviceKVPool, host: HostKVPool, use_kernel: bool | None = None) -> None:
        assert pool.windows is not None and pool.win_buffer is not None
        self.pool = pool
        self.windows = pool.windows
        nl = pool.layout.num_layers
        self.full_rows = [kv * nl + i for kv in (0, 1) for i in pool.full_layers]
        self.win_rows = [kv * nl + i for kv in (0, 1) for i in pool.window_layers]
        self.win = flat(pool.win_buffer.view(storage_dtype(pool.win_buffer.dtype)))  # [2Ls, W, X]
        super().__init__(pool.kv_buffer, host, use_kernel)  # self.dev: [2Lf, P, X] (warm-up below)
        dev = self.win.device
        self._full_idx = torch.tensor(self.full_rows, dtype=torch.int64, device=dev)
        self._win_idx = torch.tensor(self.win_rows, dtype=torch.int64, device=dev)

    def _warm_up(self) -> None:
        """Compile the kernels now (as PageMover's): page 0 (and window page 0) out to host page 0 and back."""
        hdim = host_page_dim(self.host)
        saved = self.host.buffer.select(hdim, 0).clone()
        ids = torch.zeros(1, dtype=torch.int64, device=self.win.device)
        self._runs(True, ids, ids, ids, ids)
        self._runs(False, ids, ids, ids, ids)
        torch.cuda.synchronize(self.win.device)
        self.host.buffer.select(hdim, 0).copy_(saved)

    def _staging_rows(self, name: str, n: int, device: torch.device, pin: bool = False) -> torch.Tensor:
        rows, x = len(self.full_rows) + len(self.win_rows), self.win.shape[2]
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < rows * n * x:
            buf = torch.empty(rows * n * x, dtype=self.win.dtype, device=device, pin_memory=pin)
            self._bufs[name] = buf
        return buf[: rows * n * x].view(rows, n, x)

    def _windowed(self, device_pages: Sequence[int]) -> tuple[list[int], list[int]]:
        """(indexes into ``device_pages`` of the pages with a window page, their window pages)."""
        m = self.windows.map
        idx = [i for i, p in enumerate(device_pages) if m[p] >= 0]
        return idx, [m[device_pages[i]] for i in idx]

    # -- kernel path ------------------------------------------------------------------
    def _runs(self, to_host: bool, dev_ids: torch.Tensor, host_ids: torch.Tensor, win_ids: torch.Tensor,
              win_host_ids: torch.Tensor, max_programs: int | None = None) -> None:
        from serving.kernels.page_copy_triton import move_pages

        hdim = host_page_dim(self.host)
        hb = self.host.buffer
        for rows, buf, d_ids, h_ids in ((self.full_rows, self.dev, dev_ids, host_ids),
                                        (self.win_rows, self.win, win_ids, win_host_ids)):
            if d_ids.numel() == 0:
                continue
            for h_lo, d_lo, n in _row_runs(rows):
                h = hb[:, h_lo: h_lo + n] if hdim == 0 else hb[h_lo: h_lo + n]
                d = buf[d_lo: d_lo + n]
                if to_host:
                    move_pages(d, 1, d_ids, h, hdim, h_ids)
                else:
                    move_pages(h, hdim, h_ids, d, 1, d_ids, max_programs=max_programs)

    def _kernel_ids(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> tuple[torch.Tensor, ...]:
        idx, wins = self._windowed(device_pages)
        a = self._dev_ids(list(device_pages) + wins, list(host_pages) + [host_pages[i] for i in idx])
        n = len(device_pages)
        return a[0, :n], a[1, :n], a[0, n:], a[1, n:]

    def _kernel_backup(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        ready = torch.cuda.Event()
        ready.record(self._main)
        s = self._backup_stream
        s.wait_event(ready)
        with torch.cuda.stream(s):
            d, h, w, wh = self._kernel_ids(device_pages, host_pages)
            self._runs(True, d, h, w, wh)
            done = torch.cuda.Event()
            done.record(s)
        self._main.wait_event(done)
        self.host.add_pending_write(done)

    def _kernel_load(self, host_pages: Sequence[int], device_pages: Sequence[int],
                     layered: bool = False) -> list[torch.cuda.Event] | None:
        from serving.kernels.page_copy import LOAD_PROGRAMS

        s = torch.cuda.current_stream(self.win.device)
        if s != self._main:
            after = torch.cuda.Event()
            after.record(self._main)
            s.wait_event(after)
        pending = self.host.pending_write
        if pending is not None:
            s.wait_event(pending)
        d, h, w, wh = self._kernel_ids(device_pages, host_pages)
        self._runs(False, d, h, w, wh, max_programs=LOAD_PROGRAMS if layered else None)
        if not layered:
            return None
        ev = torch.cuda.Event()
        ev.record(s)
        return [ev] * self.pool.layout.num_layers

    # -- moves --------------------------------------------------------------------------
    def device_to_host(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        if len(device_pages) != len(host_pages):
            raise ValueError("device_pages and host_pages differ in length")
        if not device_pages:
            return
        m = self.windows.map
        for p, hp in zip(device_pages, host_pages, strict=True):
            self.host.sliding_valid[hp] = 1 if m[p] >= 0 else 0
        if self.use_kernel:
            self._kernel_backup(device_pages, host_pages)
            return
        n, dev = len(device_pages), self.win.device
        st = self._staging_rows("out_dev", n, dev)  # [2L, n, X] in the host's row order
        st[self._full_idx] = self.dev.index_select(1, self._ids(device_pages, dev))
        idx, wins = self._windowed(device_pages)
        if idx:
            got = self.win.index_select(1, self._ids(wins, dev))  # [2Ls, k, X]
            st[self._win_idx[:, None], self._ids(idx, dev)[None, :]] = got
        if dev.type != "cpu":
            pinned = self._staging_rows("out_host", n, torch.device("cpu"), pin=self.host.pin)
            pinned.copy_(st)
            st = pinned
        self.host.write_pages(self._ids(host_pages, torch.device("cpu")), st)

    def host_to_device(self, host_pages: Sequence[int], device_pages: Sequence[int],
                       non_blocking: bool = False) -> None:
        if len(device_pages) != len(host_pages):
            raise ValueError("device_pages and host_pages differ in length")
        if not host_pages:
            return
        if self.use_kernel:
            self._kernel_load(host_pages, device_pages)
            if not non_blocking:
                torch.cuda.current_stream(self.win.device).synchronize()
            return
        n, dev = len(host_pages), self.win.device
        cpu = torch.device("cpu")
        src = self.host.read_pages(self._ids(host_pages, cpu),
                                   out=self._staging_rows("in_host", n, cpu, pin=self.host.pin and dev.type != "cpu"))
        if dev.type != "cpu":
            staged = self._staging_rows("in_dev", n, dev)
            staged.copy_(src, non_blocking=non_blocking)
            src = staged
        self.dev.index_copy_(1, self._ids(device_pages, dev), src.index_select(0, self._full_idx))
        idx, wins = self._windowed(device_pages)
        if idx:
            part = src.index_select(0, self._win_idx).index_select(1, self._ids(idx, dev))
            self.win.index_copy_(1, self._ids(wins, dev), part)


def make_page_mover(pool: DeviceKVPool, host: HostKVPool) -> PageMover:
    """The mover for ``pool``: a :class:`HybridPageMover` when it has a window buffer."""
    return PageMover(pool.kv_buffer, host) if pool.windows is None else HybridPageMover(pool, host)
