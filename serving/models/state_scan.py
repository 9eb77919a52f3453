"""The ragged machinery of the state layers (Gated DeltaNet, Mamba2): a causal short convolution
that reads and writes each sequence's conv state, and a token-by-token recurrence over a batch's
new tokens, each sequence starting from its slot's state (torch; the CPU reference, and CUDA
without fla-core: serving/models/state_kernels.py picks).

A :class:`StatePlan` is built once per forward pass from the batch's host lists and shared by every
state layer: the rows that lay each sequence's conv history before its new tokens, where snapshots
are taken (``ForwardBatch.snap_slots`` / ``snap_offsets``), and, computed on first use, the
recurrence's steps (step ``t`` advances every sequence with more than ``t`` new tokens by one
token; the torch path) or the batch cut at its snapshot points (:class:`Pass`; fla-core's
kernels). A speculative verify row takes a snapshot after each of its tokens but the last (into
scratch slots, serving/cache/request_states.py), so its state after whichever draft is the last
accepted is at hand. The recurrence is exact per token, so a sequence split over several forwards (chunked
prefill) reaches the same state as one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from serving.structs.forward_batch import SNAP_EVERY, ForwardBatch

# step(state rows [A, ...] float32, token rows [A]) -> (new state rows, output rows [A, ...])
StepFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Pass:
    """One launch of a kernel that runs whole sequences from an initial state (fla-core's
    ``cu_seqlens`` / ``initial_state`` / ``output_final_state``): the batch is cut at its snapshot
    points and pass ``p`` runs each sequence's ``p``-th piece (a sequence without a snapshot has one
    piece: all its new tokens). Its sequences start from the state the previous pass left them; the
    snapshots whose token ends a piece here take that piece's final state. ``None``: all sequences
    (all token rows), in order."""

    seqs: torch.Tensor | None
    rows: torch.Tensor | None
    cu: torch.Tensor  # [len(seqs) + 1] int64
    cu_host: tuple[int, ...]
    snap_idx: torch.Tensor  # [S] which of this pass's sequences end at a snapshot
    snap_slots: torch.Tensor  # [S] their snapshot slots

    @property
    def longest(self) -> int:
        """The most tokens of one sequence in this pass."""
        return max((b - a for a, b in zip(self.cu_host, self.cu_host[1:], strict=False)), default=0)

    @property
    def one_token(self) -> bool:
        """Every piece is one token (a decode-shaped launch: no ``cu_seqlens``)."""
        return len(self.cu_host) - 1 == self.cu_host[-1]


@dataclass(frozen=True)
class StatePlan:
    """Index tensors (on the batch's device) for one forward pass with conv width ``width``.

    The conv works on an extended row space: sequence ``i``'s ``width - 1`` history rows, then its
    new tokens, sequence after sequence. Snapshots (``snaps``: sequence, offset, slot; several per
    sequence for a verify row, ``ForwardBatch.set_state``'s ``SNAP_EVERY``) take the state after
    their offset's new token."""

    slots: torch.Tensor  # [B] int64 working slots
    num_ext: int  # rows of the extended space
    hist_rows: torch.Tensor  # [B * (width - 1)] where each sequence's history goes
    tok_rows: torch.Tensor  # [T] where each new token goes
    windows: torch.Tensor  # [T, width] the rows each token's convolution reads (oldest first)
    tails: torch.Tensor  # [B, width - 1] each sequence's history after its new tokens
    snap_seqs: torch.Tensor  # [S] the sequence of each snapshot
    snap_slots: torch.Tensor  # [S] its slot
    snap_tails: torch.Tensor  # [S, width - 1] its conv history
    lens: tuple[int, ...]  # new tokens per sequence
    snaps: tuple[tuple[int, int, int], ...]  # (sequence, offset, slot) per snapshot, by sequence
    # the static passes of an extend graph's plan (serving/models/state_graph.py; None: ``passes``)
    graph: Any = None

    @property
    def device(self) -> torch.device:
        return self.slots.device

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.lens)

    @staticmethod
    def build(batch: ForwardBatch, width: int) -> StatePlan:
        if batch.state_slots is None or batch.state_slots_list is None:
            raise ValueError("a model with state layers needs the batch's state slots (ForwardBatch.set_state)")
        lens, h = batch.extend_lens_list, width - 1
        b = len(lens)
        hist, toks, tails = [], [], []
        offset = 0
        for n in lens:
            hist.extend(range(offset, offset + h))
            toks.extend(range(offset + h, offset + h + n))
            tails.append(list(range(offset + n, offset + n + h)))
            offset += h + n
        offsets = list(batch.snap_offsets_list or [-1] * b)
        snap_slot_list = list(batch.snap_slots_list or [-1] * b)
        snaps, snap_tails = [], []
        first = 0  # sequence i's first extended row
        for i, (slot, k) in enumerate(zip(snap_slot_list, offsets, strict=True)):
            every = k == SNAP_EVERY and slot >= 0
            for j in (range(lens[i] - 1) if every else [k] if k >= 0 else []):
                snaps.append((i, j, slot + j if every else slot))
                snap_tails.append(list(range(first + j + 1, first + j + 1 + h)))
            first += h + lens[i]
        dev = batch.input_ids.device
        tok_rows = _t(toks, dev)
        windows = tok_rows[:, None] - h + torch.arange(width, device=dev)  # a token reads its h rows before it
        return StatePlan(
            slots=batch.state_slots, num_ext=offset, hist_rows=_t(hist, dev), tok_rows=tok_rows, windows=windows,
            tails=_t(tails, dev).view(b, h), snap_seqs=_t([s[0] for s in snaps], dev),
            snap_slots=_t([s[2] for s in snaps], dev), snap_tails=_t(snap_tails, dev).view(-1, h),
            lens=tuple(lens), snaps=tuple(snaps))

    @staticmethod
    def for_decode(slots: torch.Tensor, snap_slots: torch.Tensor, width: int) -> StatePlan:
        """A decode plan on fixed tensors, for a CUDA graph (serving/runner/cuda_graph.py): ``slots`` [B]
        the working slots, ``snap_slots`` [B] where each sequence's state after its token also goes
        (a scratch row for a sequence taking no snapshot). The graph runner fills both in place before
        each replay; nothing here is rebuilt, so the plan holds no host values that change."""
        b, h, dev = slots.shape[0], width - 1, slots.device
        rows = torch.arange(b, device=dev)
        tok_rows = rows * width + h  # sequence i's extended rows: i * width .. i * width + h
        tails = tok_rows[:, None] - h + 1 + torch.arange(h, device=dev)  # its history after the token
        plan = StatePlan(
            slots=slots, num_ext=b * width, hist_rows=(tok_rows[:, None] - h + torch.arange(h, device=dev)).reshape(-1),
            tok_rows=tok_rows, windows=tok_rows[:, None] - h + torch.arange(width, device=dev), tails=tails,
            snap_seqs=rows, snap_slots=snap_slots, snap_tails=tails, lens=(1,) * b,
            snaps=tuple((i, 0, -1) for i in range(b)))  # their slots: never read, the cached properties are set
        plan.__dict__["steps"] = ((None, rows),)  # the cached properties, fixed (no host values)
        plan.__dict__["snaps_at"] = {0: (rows, snap_slots)}
        cu = tuple(range(b + 1))
        plan.__dict__["passes"] = (Pass(seqs=None, rows=None, cu=torch.arange(b + 1, device=dev), cu_host=cu,
                                        snap_idx=rows, snap_slots=snap_slots),)
        return plan

    @cached_property
    def steps(self) -> tuple[tuple[torch.Tensor | None, torch.Tensor], ...]:
        """Per step of the torch recurrence: (its sequences, None: all; their token rows)."""
        starts = _starts(self.lens)
        b, dev, out = len(self.lens), self.device, []
        for t in range(max(self.lens, default=0)):
            active = [i for i, n in enumerate(self.lens) if n > t]
            rows = [starts[i] + t for i in active]
            out.append((None if len(active) == b else _t(active, dev), _t(rows, dev)))
        return tuple(out)

    @cached_property
    def snaps_at(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Step -> (its sequences with a snapshot, their snapshot slots)."""
        by_step: dict[int, tuple[list[int], list[int]]] = {}
        for i, k, slot in self.snaps:
            seqs, slots = by_step.setdefault(k, ([], []))
            seqs.append(i)
            slots.append(slot)
        return {k: (_t(s, self.device), _t(sl, self.device)) for k, (s, sl) in by_step.items()}

    @cached_property
    def passes(self) -> tuple[Pass, ...]:
        """The batch cut at its snapshot points (see :class:`Pass`): as many passes as the most
        pieces of a sequence (one without snapshots; a verify row's drafts + 1 tokens: one each)."""
        starts, dev, b = _starts(self.lens), self.device, len(self.lens)
        ends: list[list[int]] = [[] for _ in range(b)]  # each sequence's piece ends
        ending: dict[tuple[int, int], list[int]] = {}  # (sequence, piece end) -> snapshot slots
        for i, k, slot in self.snaps:
            ending.setdefault((i, k + 1), []).append(slot)
            ends[i].append(k + 1)
        ends = [sorted({*e, n}) for e, n in zip(ends, self.lens, strict=True)]
        out = []
        for p in range(max((len(e) for e in ends), default=0)):
            seqs = [i for i in range(b) if len(ends[i]) > p and self.lens[i] > 0]
            pieces = [(ends[i][p - 1] if p else 0, ends[i][p]) for i in seqs]
            rows = [starts[i] + r for i, (a, z) in zip(seqs, pieces, strict=True) for r in range(a, z)]
            snap_idx, snap_slots = [], []
            for j, (i, (_, z)) in enumerate(zip(seqs, pieces, strict=True)):
                for slot in ending.get((i, z), []):
                    snap_idx.append(j)
                    snap_slots.append(slot)
            whole = len(seqs) == b and rows == list(range(starts[-1]))
            cu = _starts([z - a for a, z in pieces])
            out.append(Pass(seqs=None if len(seqs) == b else _t(seqs, dev), rows=None if whole else _t(rows, dev),
                            cu=_t(cu, dev), cu_host=tuple(cu), snap_idx=_t(snap_idx, dev),
                            snap_slots=_t(snap_slots, dev)))
        return tuple(out)


def _starts(lens: list[int] | tuple[int, ...]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def _t(values: list, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(device)


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                plan: StatePlan) -> torch.Tensor:
    """Depthwise causal conv of ``x [T, C]`` (weight ``[C, width]``) over each sequence's history
    (``conv_state [slots, C, width - 1]``, the last ``width - 1`` inputs, oldest first), without the
    activation. Updates the working slots' history and writes the snapshots'. On CPU the windows
    are gathered and summed (the reference); on CUDA one depthwise ``conv1d`` runs over the
    extended rows (no ``[T, width, C]`` gather)."""
    c, width = weight.shape
    ext = x.new_empty(plan.num_ext, c)
    hist = conv_state[plan.slots].transpose(1, 2).to(x.dtype)  # [B, width - 1, C]
    ext[plan.hist_rows] = hist.reshape(-1, c)
    ext[plan.tok_rows] = x
    if x.is_cuda:
        full = torch.nn.functional.conv1d(ext.t().unsqueeze(0), weight.to(x.dtype).unsqueeze(1), groups=c)
        out = full[0].t()[plan.tok_rows - (width - 1)]  # output row r reads ext rows r .. r + width - 1
    else:
        out = (ext[plan.windows] * weight.t().to(x.dtype)).sum(1)  # [T, width, C] -> [T, C]
    if bias is not None:
        out = out + bias.to(x.dtype)
    if plan.snap_seqs.numel():
        conv_state[plan.snap_slots] = ext[plan.snap_tails].transpose(1, 2).to(conv_state.dtype)
    conv_state[plan.slots] = ext[plan.tails].transpose(1, 2).to(conv_state.dtype)
    return out


def scan(recurrent: torch.Tensor, plan: StatePlan, out: torch.Tensor, step: StepFn) -> None:
    """Run ``step`` token by token: sequence ``i`` starts from ``recurrent[slots[i]]`` (float32
    compute), ``out[token rows]`` receives each step's output; the working slots end at the state
    after their last new token, the snapshot slots hold the state after their offset's token."""
    state = recurrent[plan.slots].float()  # [B, ...]
    for t, (seqs, rows) in enumerate(plan.steps):
        if seqs is None:
            state, o = step(state, rows)
        else:
            new, o = step(state[seqs], rows)
            state[seqs] = new
        out[rows] = o.to(out.dtype)
        snap = plan.snaps_at.get(t)
        if snap is not None:
            recurrent[snap[1]] = state[snap[0]].to(recurrent.dtype)
    recurrent[plan.slots] = state.to(recurrent.dtype)
