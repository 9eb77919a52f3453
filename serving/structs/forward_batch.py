"""Batch metadata for one forward pass, passed explicitly to the model and kernels."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

SNAP_EVERY = -2  # a snapshot offset: the state after each new token but the last (see ForwardBatch.set_state)


class LayerWaits:
    """GPU events of layered L2 -> L1 loads that a forward pass reads from: before layer ``i``
    touches the KV pool, the current stream waits (on the GPU; the host never blocks) for
    every load's layer-``i`` event. A decode-graph replay waits for all of them first
    (:meth:`before_all`); an extend-graph replay hands them to its :class:`GraphLayerWaits`."""

    __slots__ = ("per_layer",)

    def __init__(self, loads: list[list]) -> None:
        self.per_layer = list(zip(*loads, strict=True))  # [layers][loads]

    def before_layer(self, i: int) -> None:
        stream = torch.cuda.current_stream()
        for ev in self.per_layer[i]:
            stream.wait_event(ev)

    def before_all(self) -> None:
        self.before_layer(len(self.per_layer) - 1)  # each load's layers land in order


class GraphLayerWaits:
    """Per-layer waits inside captured CUDA graphs: one static external event per layer
    (``torch.cuda.Event(external=True)``). Captured, :meth:`before_layer` becomes an event-wait
    node on layer ``i``'s event; before a replay, :meth:`arm` re-records each event on a relay
    stream behind that layer's events of the loads the batch reads (:class:`LayerWaits`), so
    inside the replay layer ``i`` waits only for its own KV.

    Contract: every event is recorded once at construction (PyTorch creates a CUDA event at its
    first record, and a wait on one never recorded is not captured), so with no load in flight
    the events are complete. A replay that arms nothing waits on the last arming's records,
    which an earlier replay on the same stream already waited for: complete by then. Arming
    happens on the host before the replay's launch; a wait node waits for the record that was
    the event's latest when the graph was launched (as ``cudaStreamWaitEvent`` does when it is
    called), so a later arming cannot move an earlier replay's waits (checked on the GPU by
    tests/engine/test_gpu.py). One user: the scheduler thread."""

    @classmethod
    def create(cls, num_layers: int, device: torch.device) -> GraphLayerWaits | None:
        """None on a CPU, or with a PyTorch without external events (before 2.9): a replay then
        waits for every load before it starts (``LayerWaits.before_all``)."""
        if device.type != "cuda":
            return None
        try:
            return cls(num_layers, device)
        except TypeError:
            return None

    def __init__(self, num_layers: int, device: torch.device) -> None:
        self.events = [torch.cuda.Event(external=True) for _ in range(num_layers)]
        self.relay = torch.cuda.Stream(device)
        stream = torch.cuda.current_stream(device)
        for ev in self.events:
            ev.record(stream)
        self.armed = 0  # replays armed (for tests and stats)

    def before_layer(self, i: int) -> None:
        torch.cuda.current_stream().wait_event(self.events[i])

    def arm(self, waits: LayerWaits) -> None:
        """Re-record layer ``i``'s event behind every load's layer-``i`` event (a group of
        layers shares its load events: each is waited once)."""
        if len(waits.per_layer) != len(self.events):
            raise ValueError(f"{len(waits.per_layer)} layers of load events for {len(self.events)} layers")
        prev: tuple = ()
        for ev, loads in zip(self.events, waits.per_layer, strict=True):
            if len(loads) != len(prev) or any(a is not b for a, b in zip(loads, prev, strict=True)):
                for load in loads:
                    self.relay.wait_event(load)
                prev = loads
            ev.record(self.relay)
        self.armed += 1


@dataclass
class ForwardBatch:
    """A ragged batch: sequence ``i`` adds ``extend_lens[i]`` new tokens on top of
    ``prefix_lens[i]`` tokens whose KV is already in the paged pool.

    Decode is the special case ``extend_lens == 1`` for every sequence. All new
    tokens of all sequences are concatenated along one token axis ``T``.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    prefix_lens: torch.Tensor  # [B] int32
    extend_lens: torch.Tensor  # [B] int32
    seq_lens: torch.Tensor  # [B] int32 = prefix_lens + extend_lens
    extend_start: torch.Tensor  # [B] int32, offset of sequence i's first new token in T
    page_table: torch.Tensor  # [B, max_pages] int32 page ids, padded with 0
    out_cache_loc: torch.Tensor  # [T] int64 flat slot (page_id * page_size + offset) of each new token
    page_size: int
    # Python copies for loops on the host (avoid device syncs)
    prefix_lens_list: list[int]
    extend_lens_list: list[int]
    # decode only: fixed number of KV splits (CUDA graphs fix the grid); None picks per batch
    decode_splits: int | None = None
    # extend graphs: the captured bucket (tokens, sequences) the extend kernel's launch is sized for,
    # not this batch's lengths (serving.kernels.triton_extend_split); None: sized for this batch
    extend_bucket: tuple[int, int] | None = None
    # prompt logprobs (serving.runner.logprobs): rows of T whose logits the model also returns, after the B last ones
    logit_rows: torch.Tensor | None = None
    # L2 -> L1 loads still landing in pages this batch reads (GPU only); see LayerWaits
    layer_waits: LayerWaits | GraphLayerWaits | None = None
    # the host buffers ``build`` made (int64 part, int32 part, T, B, width): what tensor parallelism
    # sends the other ranks (serving.parallel), without reading anything back from the device
    host: tuple | None = None
    # Models with state layers (hicache/tiers/state_pool.py; see ``set_state``). ``state_slots`` [B]
    # int64: the slot holding sequence i's state before these tokens, updated in place to the state
    # after them. ``snap_slots`` / ``snap_offsets`` [B] int64 (-1: none): after new token
    # ``snap_offsets[i]`` (0-based, so the state of ``prefix_lens[i] + snap_offsets[i] + 1`` tokens)
    # each state layer also copies its state into slot ``snap_slots[i]``; ``snap_offsets[i] ==
    # SNAP_EVERY`` (speculative verification): the state after each new token ``j < n - 1`` goes to
    # slot ``snap_slots[i] + j`` (a run of the state pool's scratch). The ``*_list`` fields are
    # the same values on the host (the torch paths loop over them without a device sync).
    state_slots: torch.Tensor | None = None
    snap_slots: torch.Tensor | None = None
    snap_offsets: torch.Tensor | None = None
    state_slots_list: list[int] | None = None
    snap_slots_list: list[int] | None = None
    snap_offsets_list: list[int] | None = None
    # a state plan built once on fixed tensors (serving/models/state_scan.py ``StatePlan.for_decode``: a
    # CUDA graph's static batch); None: the model builds one from the fields above
    state_plan: Any = None
    # A hybrid SWA L1 (hicache/tiers/window_pages.py): the sliding layers' view of this batch, the same
    # batch with ``page_table`` and ``out_cache_loc`` in window pages (``set_window``); None: every
    # layer reads the pages above
    win: ForwardBatch | None = None

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.extend_lens_list)

    @property
    def max_seq_len(self) -> int:
        return max(p + e for p, e in zip(self.prefix_lens_list, self.extend_lens_list, strict=True))

    def set_state(self, state_slots: list[int], snap_slots: list[int] | None = None,
                  snap_offsets: list[int] | None = None) -> None:
        """The state slots of a model with state layers (the fields above); ``snap_*`` None: no capture."""
        b = self.batch_size
        snap_slots = [-1] * b if snap_slots is None else list(snap_slots)
        snap_offsets = [-1] * b if snap_offsets is None else list(snap_offsets)
        if not len(state_slots) == len(snap_slots) == len(snap_offsets) == b:
            raise ValueError(f"state slots for {len(state_slots)} / {len(snap_slots)} / {len(snap_offsets)} "
                             f"sequences in a batch of {b}")
        used = [s for s in state_slots if s >= 0]
        for i, (slot, snap, off, n) in enumerate(
                zip(state_slots, snap_slots, snap_offsets, self.extend_lens_list, strict=True)):
            every = off == SNAP_EVERY and snap >= 0 and n >= 2
            if slot < 0 or (not every and ((snap < 0) != (off < 0) or off >= n)) or snap == slot:
                raise ValueError(f"sequence {i}: state slot {slot}, snapshot slot {snap} after new token {off} "
                                 f"of {n}")
            used.extend(range(snap, snap + n - 1) if every else [snap] if snap >= 0 else [])
        if len(set(used)) != len(used):
            raise ValueError(f"state slots {list(state_slots)} and snapshot slots {snap_slots} repeat a slot")
        host = torch.tensor(list(state_slots) + snap_slots + snap_offsets, dtype=torch.int64)
        dev = self.input_ids.device
        if dev.type == "cuda":
            host = host.pin_memory().to(dev, non_blocking=True)
        elif dev.type != "cpu":
            host = host.to(dev)
        self.state_slots, self.snap_slots, self.snap_offsets = host[:b], host[b: 2 * b], host[2 * b:]
        self.state_slots_list, self.snap_slots_list, self.snap_offsets_list = \
            list(state_slots), snap_slots, snap_offsets

    def set_window(self, win_map: list[int], seqs: list[tuple[list[int], int, list[int]]]) -> None:
        """The sliding layers' view (``win``) of a hybrid SWA pool: each page of ``seqs`` (as ``build``'s)
        through ``win_map`` (logical page -> window page, -1: none). A page a new token is stored into must
        have a window page (ValueError); one without, which no new token reads, becomes window page 0."""
        ps, width = self.page_size, self.page_table.shape[1]
        table = [0] * (len(seqs) * width)
        locs: list[int] = []
        for i, (ids, prefix, pages) in enumerate(seqs):
            table[i * width: i * width + len(pages)] = [max(win_map[p], 0) for p in pages]
            for pos in range(prefix, prefix + len(ids)):
                w = win_map[pages[pos // ps]]
                if w < 0:
                    raise ValueError(f"sequence {i}: position {pos} is stored into page {pages[pos // ps]}, "
                                     "which has no window page")
                locs.append(w * ps + pos % ps)
        i64 = torch.tensor(locs, dtype=torch.int64)
        i32 = torch.tensor(table, dtype=torch.int32)
        dev = self.input_ids.device
        if dev.type == "cuda":
            i64, i32 = i64.pin_memory().to(dev, non_blocking=True), i32.pin_memory().to(dev, non_blocking=True)
        elif dev.type != "cpu":
            i64, i32 = i64.to(dev), i32.to(dev)
        self.win = self.window_view(i32.view(len(seqs), width), i64)

    def window_view(self, page_table: torch.Tensor, out_cache_loc: torch.Tensor) -> ForwardBatch:
        """This batch as the sliding layers of a hybrid SWA pool see it: ``page_table`` / ``out_cache_loc`` in
        window pages, every other field shared (``set_window``'s; the CUDA graph runners' static ``win``)."""
        return replace(self, page_table=page_table, out_cache_loc=out_cache_loc, host=None, win=None)

    @staticmethod
    def build(
        seqs: list[tuple[list[int], int, list[int]]],
        page_size: int,
        device: torch.device | str = "cpu",
        state_slots: list[int] | None = None,
        snap_slots: list[int] | None = None,
        snap_offsets: list[int] | None = None,
        win_map: list[int] | None = None,
    ) -> ForwardBatch:
        """Build from ``(new_token_ids, prefix_len, page_ids)`` per sequence.

        ``page_ids`` must cover positions ``0 .. prefix_len + len(new_token_ids) - 1``.
        ``state_slots`` (and optional ``snap_slots`` / ``snap_offsets``): see ``set_state``.
        ``win_map``: a hybrid SWA pool's map of logical to window pages (``set_window``).
        """
        input_ids: list[int] = []
        positions: list[int] = []
        locs: list[int] = []
        prefix_lens: list[int] = []
        extend_lens: list[int] = []
        starts: list[int] = []
        max_pages = max(len(p) for _, _, p in seqs)
        width = max(max_pages, 1)
        table = [0] * (len(seqs) * width)  # [B, width] row-major, padded with 0
        for i, (ids, prefix, pages) in enumerate(seqs):
            n = len(ids)
            if prefix + n > len(pages) * page_size:
                raise ValueError(f"sequence {i}: {prefix + n} tokens do not fit {len(pages)} pages")
            starts.append(len(input_ids))
            input_ids.extend(ids)
            pos = range(prefix, prefix + n)
            positions.extend(pos)
            locs.extend(pages[p // page_size] * page_size + p % page_size for p in pos)
            prefix_lens.append(prefix)
            extend_lens.append(n)
            table[i * width: i * width + len(pages)] = pages
        dev = torch.device(device)
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
        t, b = len(input_ids), len(seqs)
        # Two host buffers (int64 and int32), pinned on CUDA and copied without blocking: a
        # pageable copy would wait for the forward pass already running on the GPU.
        i64 = torch.tensor(input_ids + positions + locs, dtype=torch.int64)
        i32 = torch.tensor(prefix_lens + extend_lens + seq_lens + starts + table, dtype=torch.int32)
        batch = ForwardBatch.from_host(i64, i32, t, b, width, page_size, prefix_lens, extend_lens, dev)
        if win_map is not None:
            batch.set_window(win_map, seqs)
        if state_slots is not None:
            batch.set_state(state_slots, snap_slots, snap_offsets)
        elif snap_slots is not None or snap_offsets is not None:
            raise ValueError("snapshot slots without state slots")
        return batch

    @staticmethod
    def from_host(i64: torch.Tensor, i32: torch.Tensor, t: int, b: int, width: int, page_size: int,
                  prefix_lens: list[int], extend_lens: list[int], device: torch.device | str) -> ForwardBatch:
        """The batch of ``build``'s two host buffers (also how another TP rank rebuilds it)."""
        dev = torch.device(device)
        host = (i64, i32, t, b, width)
        if dev.type == "cuda":
            i64 = i64.pin_memory().to(dev, non_blocking=True)
            i32 = i32.pin_memory().to(dev, non_blocking=True)
        elif dev.type != "cpu":
            i64, i32 = i64.to(dev), i32.to(dev)
        return ForwardBatch(
            input_ids=i64[:t],
            positions=i64[t: 2 * t],
            prefix_lens=i32[:b],
            extend_lens=i32[b: 2 * b],
            seq_lens=i32[2 * b: 3 * b],
            extend_start=i32[3 * b: 4 * b],
            page_table=i32[4 * b:].view(b, width),
            out_cache_loc=i64[2 * t:],
            page_size=page_size,
            prefix_lens_list=prefix_lens,
            extend_lens_list=extend_lens,
            host=host,
        )
