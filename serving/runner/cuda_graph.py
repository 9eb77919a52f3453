"""CUDA graphs for decode batches.

A decode step of a small model or a small batch is bound by kernel launches, not by the
GPU: dozens of kernels per layer, each a few microseconds. So decode batches replay graphs
captured once per batch size (1, 2, 4, 8, 16, 24, 32, 48, 64 up to ``cuda_graph_max_bs``);
a batch is padded up to the next captured size.

Graph-safety: a graph replays fixed kernels on fixed addresses, so every input the
forward pass reads lives in a static buffer that ``replay`` overwrites in place (token ids,
positions, sequence lengths, page table, KV slots); intermediate tensors come from the
graphs' private memory pool; the decode kernel's split count is fixed per size
(``ForwardBatch.decode_splits``), and nothing on the path syncs with the host. The rotary
cos/sin table is built for the whole context before capture. Padding rows store no KV
(slot -1, skipped by the store kernel), attend to one key and are cut from the logits.

A hybrid SWA L1 (``windows``: hicache/tiers/window_pages.py): the sliding layers read through the
batch's window view (``ForwardBatch.win``: the page table and KV slots in window pages), so the
static batch has a static window view too (:class:`WindowBuffers`), filled per replay from the
batch's like the others (padding rows: slot -1); a runner takes only batches that have a window
view exactly when it has one.

A model with state layers (Gated DeltaNet, Mamba2) also reads its working state slots and
writes a snapshot where a sequence's token ends a page (serving/cache/request_states.py):
both are static buffers (``state_slots``, ``snap_slots``) under a state plan built once on them
(``make_state_plan``: ``StatePlan.for_decode``). Every row writes a snapshot: a row that takes
none, and every padding row, reads and writes the state pool's scratch row (``pad_slot``),
which no sequence owns.

``capture=False`` keeps the static buffers and padding but runs the forward pass eagerly
on them: the same code path for tests on a CPU (with Triton's interpreter).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from serving.structs.forward_batch import ForwardBatch

log = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def capture_sizes(max_bs: int, max_running: int | None = None) -> list[int]:
    """Captured sizes: ``CAPTURE_SIZES`` up to ``max_bs`` (and ``max_bs`` itself), no larger
    than needed for ``max_running`` requests."""
    if max_running is not None:
        max_bs = min(max_bs, max_running)
    out = [s for s in CAPTURE_SIZES if s < max_bs]
    return out + [max_bs]


def decode_splits(batch_size: int, kv_heads: int) -> int:
    """Fixed split-KV count for a captured size: split only when the batch is too small
    to fill the GPU (the kernel handles any length with any split count)."""
    from serving.kernels.triton_decode import BUSY_PROGRAMS, MAX_SPLITS  # triton: a GPU-only import (0.6 s)

    return 1 if batch_size * kv_heads >= BUSY_PROGRAMS else MAX_SPLITS


class WindowBuffers:
    """Static buffers of the window view (``ForwardBatch.win``) of a graph runner's static batches:
    a page table of window pages ``[seqs, max_pages]`` and the new tokens' window slots ``[tokens]``."""

    def __init__(self, seqs: int, tokens: int, max_pages: int, device: torch.device) -> None:
        self.page_table = torch.zeros((seqs, max_pages), dtype=torch.int32, device=device)
        self.out_cache_loc = torch.full((tokens,), -1, dtype=torch.int64, device=device)

    def attach(self, static: ForwardBatch, seqs: int, tokens: int) -> ForwardBatch:
        """``static`` with its window view on these buffers (its first ``seqs`` rows, ``tokens`` slots)."""
        static.win = static.window_view(self.page_table[:seqs], self.out_cache_loc[:tokens])
        return static

    def fill(self, win: ForwardBatch, padded_tokens: int) -> None:
        """Copy a batch's window view in; slots past its tokens up to ``padded_tokens`` store nothing (-1).
        Padding rows keep stale window pages (valid ids of the pool) and read one key or none."""
        b, w = win.page_table.shape
        t = win.out_cache_loc.shape[0]
        self.page_table[:b, :w].copy_(win.page_table, non_blocking=True)
        self.out_cache_loc[:t].copy_(win.out_cache_loc, non_blocking=True)
        if padded_tokens > t:
            self.out_cache_loc[t:padded_tokens].fill_(-1)


class CudaGraphRunner:
    def __init__(
        self,
        forward: Callable[[ForwardBatch], torch.Tensor],
        batch_sizes: list[int],
        context_len: int,
        page_size: int,
        kv_heads: int,
        device: torch.device,
        capture: bool = True,
        keep_alive: object = None,
        windows: bool = False,
        make_state_plan: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
        pad_slot: int = -1,
    ) -> None:
        """``windows``: the pool has a window pool (a hybrid SWA L1): batches come with a window view.
        ``make_state_plan`` (slots, snapshot slots) -> the state plan of a model with state layers, whose
        pool's ``pad_slot`` takes padding rows' state."""
        self.forward = forward
        self.sizes = sorted(batch_sizes)
        self.max_bs = self.sizes[-1]
        self.context_len = context_len
        self.page_size = page_size
        self.max_pages = -(-context_len // page_size)
        self.kv_heads = kv_heads
        self.device = device
        self.capture = capture
        self.keep_alive = keep_alive  # tensors the graphs read that nobody else may free
        n = self.max_bs
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.out_cache_loc = torch.full((n,), -1, **i64)
        self.prefix_lens = torch.zeros(n, **i32)
        self.extend_lens = torch.ones(n, **i32)
        self.seq_lens = torch.ones(n, **i32)
        self.extend_start = torch.arange(n, **i32)
        self.page_table = torch.zeros((n, self.max_pages), **i32)
        self.win = WindowBuffers(n, n, self.max_pages, device) if windows else None
        # state layers: the working and snapshot slots (the scratch row where there is none)
        self.make_state_plan = make_state_plan
        self.pad_slot = pad_slot
        self.state_slots = torch.full((n,), pad_slot, **i64) if make_state_plan else None
        self.snap_slots = torch.full((n,), pad_slot, **i64) if make_state_plan else None
        self.batches = {bs: self._static_batch(bs) for bs in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0
        if capture:
            self._capture_all()

    def _static_batch(self, bs: int) -> ForwardBatch:
        fb = ForwardBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs], prefix_lens=self.prefix_lens[:bs],
            extend_lens=self.extend_lens[:bs], seq_lens=self.seq_lens[:bs], extend_start=self.extend_start[:bs],
            page_table=self.page_table[:bs], out_cache_loc=self.out_cache_loc[:bs], page_size=self.page_size,
            # max_seq_len = context_len: the rotary table is built whole before capture
            prefix_lens_list=[self.context_len - 1] * bs, extend_lens_list=[1] * bs,
            decode_splits=decode_splits(bs, self.kv_heads),
        )
        if self.make_state_plan is not None:
            assert self.state_slots is not None and self.snap_slots is not None
            fb.state_slots = self.state_slots[:bs]
            fb.state_plan = self.make_state_plan(self.state_slots[:bs], self.snap_slots[:bs])
        return fb if self.win is None else self.win.attach(fb, bs, bs)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        for bs in reversed(self.sizes):  # largest first: the smaller graphs reuse its pool memory
            fb = self.batches[bs]
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up: compiles the Triton kernels, fills caches
                for _ in range(2):
                    self.forward(fb)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self.forward(fb)
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def padded_size(self, bs: int) -> int | None:
        for s in self.sizes:
            if s >= bs:
                return s
        return None

    def can_run(self, batch: ForwardBatch) -> bool:
        return (
            batch.is_decode
            and batch.logit_rows is None  # prompt logprobs need more rows than a graph returns
            and 0 < batch.batch_size <= self.max_bs
            and batch.page_size == self.page_size
            and batch.page_table.shape[1] <= self.max_pages
            and (batch.win is not None) == (self.win is not None)
            and (self.state_slots is None) == (batch.state_slots is None)
        )

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits ``[B, vocab]`` of a decode batch (``can_run`` must hold). The tensor is the
        graph's output buffer: read it before the next replay."""
        b = batch.batch_size
        bs = self.padded_size(b)
        assert bs is not None
        w = batch.page_table.shape[1]
        self.input_ids[:b].copy_(batch.input_ids, non_blocking=True)
        self.positions[:b].copy_(batch.positions, non_blocking=True)
        self.seq_lens[:b].copy_(batch.seq_lens, non_blocking=True)
        self.out_cache_loc[:b].copy_(batch.out_cache_loc, non_blocking=True)
        self.page_table[:b, :w].copy_(batch.page_table, non_blocking=True)
        if self.win is not None:
            self.win.fill(batch.win, bs)
        if self.state_slots is not None and self.snap_slots is not None:
            assert batch.state_slots is not None and batch.snap_slots is not None and batch.snap_offsets is not None
            self.state_slots[:b].copy_(batch.state_slots, non_blocking=True)
            scratch = torch.full_like(batch.snap_slots, self.pad_slot)
            self.snap_slots[:b].copy_(torch.where(batch.snap_offsets >= 0, batch.snap_slots, scratch),
                                      non_blocking=True)
            self.state_slots[b:bs].fill_(self.pad_slot)
            self.snap_slots[b:bs].fill_(self.pad_slot)
        if bs > b:  # padding rows: no KV stored, one key read
            self.out_cache_loc[b:bs].fill_(-1)
            self.seq_lens[b:bs].fill_(1)
            self.positions[b:bs].zero_()
            self.input_ids[b:bs].zero_()
        self.replays += 1
        if self.capture:
            self.graphs[bs].replay()
            return self.outputs[bs][:b]
        return self.forward(self.batches[bs])[:b]
