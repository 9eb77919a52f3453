"""The ragged machinery of the state layers (Gated DeltaNet, Mamba2): a causal short convolution
that reads and writes each sequence's conv state, and a token-by-token recurrence over a batch's
new tokens, each sequence starting from its slot's state (torch; the CPU reference, and CUDA
without fla-core: serving/models/state_kernels.py picks).

A :class:`StatePlan` is built once per forward pass from the batch's host lists and shared by every
state layer: the rows that lay each sequence's conv history before its new tokens, where snapshots
are taken (``ForwardBatch.snap_slots`` / ``snap_offsets``), and, computed on first use, the
recurrence's steps (step ``t`` advances every sequence with more than ``t`` new tokens by one
token; the torch path) or the batch cut at its snapshot points (:class:`Segments`; the chunked
kernels). The recurrence is exact per token, so a sequence split over several forwards (chunked
prefill) reaches the same state as one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch

from serving.structs.forward_batch import ForwardBatch

# step(state rows [A, ...] float32, token rows [A]) -> (new state rows, output rows [A, ...])
StepFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Segments:
    """The batch cut at its snapshot points, for kernels that run whole sequences from an initial
    state (fla-core's ``cu_seqlens`` / ``initial_state`` / ``output_final_state``). Pass 1 runs
    every sequence up to and including its snapshot token (all its tokens if it has none); the
    snapshot slots take pass 1's final states of ``snap_seqs``; pass 2 runs the remainders of
    ``seqs2`` from those states. Row tensors index the batch's token rows; ``None``: all, in order."""

    rows1: torch.Tensor | None
    cu1: torch.Tensor  # [B + 1] int64
    cu1_host: tuple[int, ...]
    seqs2: torch.Tensor  # [R] sequences with tokens after their snapshot
    rows2: torch.Tensor
    cu2: torch.Tensor  # [R + 1]
    cu2_host: tuple[int, ...]


@dataclass(frozen=True)
class StatePlan:
    """Index tensors (on the batch's device) for one forward pass with conv width ``width``.

    The conv works on an extended row space: sequence ``i``'s ``width - 1`` history rows, then its
    new tokens, sequence after sequence."""

    slots: torch.Tensor  # [B] int64 working slots
    num_ext: int  # rows of the extended space
    hist_rows: torch.Tensor  # [B * (width - 1)] where each sequence's history goes
    tok_rows: torch.Tensor  # [T] where each new token goes
    windows: torch.Tensor  # [T, width] the rows each token's convolution reads (oldest first)
    tails: torch.Tensor  # [B, width - 1] each sequence's history after its new tokens
    snap_seqs: torch.Tensor  # [S] sequences with a snapshot
    snap_slots: torch.Tensor  # [S] their snapshot slots
    snap_tails: torch.Tensor  # [S, width - 1] their conv history at the snapshot
    lens: tuple[int, ...]  # new tokens per sequence
    snap_offsets: tuple[int, ...]  # per sequence, the token after which its snapshot is taken (-1: none)
    snap_slots_host: tuple[int, ...]

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
        snap_seqs, snap_slots, snap_tails = [], [], []
        first = 0  # sequence i's first extended row
        for i, (slot, k) in enumerate(zip(snap_slot_list, offsets, strict=True)):
            if k >= 0:
                snap_seqs.append(i)
                snap_slots.append(slot)
                snap_tails.append(list(range(first + k + 1, first + k + 1 + h)))
            first += h + lens[i]
        dev = batch.input_ids.device
        tok_rows = _t(toks, dev)
        windows = tok_rows[:, None] - h + torch.arange(width, device=dev)  # a token reads its h rows before it
        return StatePlan(
            slots=batch.state_slots, num_ext=offset, hist_rows=_t(hist, dev), tok_rows=tok_rows, windows=windows,
            tails=_t(tails, dev).view(b, h), snap_seqs=_t(snap_seqs, dev), snap_slots=_t(snap_slots, dev),
            snap_tails=_t(snap_tails, dev).view(-1, h), lens=tuple(lens), snap_offsets=tuple(offsets),
            snap_slots_host=tuple(snap_slot_list))

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
        for i, (k, slot) in enumerate(zip(self.snap_offsets, self.snap_slots_host, strict=True)):
            if k >= 0:
                seqs, slots = by_step.setdefault(k, ([], []))
                seqs.append(i)
                slots.append(slot)
        return {k: (_t(s, self.device), _t(sl, self.device)) for k, (s, sl) in by_step.items()}

    @cached_property
    def segments(self) -> Segments:
        starts, dev = _starts(self.lens), self.device
        cut = [n if k < 0 else k + 1 for n, k in zip(self.lens, self.snap_offsets, strict=True)]
        rows1 = None if cut == list(self.lens) else \
            [r for i, c in enumerate(cut) for r in range(starts[i], starts[i] + c)]
        seqs2 = [i for i, (c, n) in enumerate(zip(cut, self.lens, strict=True)) if c < n]
        rows2 = [r for i in seqs2 for r in range(starts[i] + cut[i], starts[i + 1])]
        cu1, cu2 = _starts(cut), _starts([self.lens[i] - cut[i] for i in seqs2])
        return Segments(rows1=None if rows1 is None else _t(rows1, dev), cu1=_t(cu1, dev), cu1_host=tuple(cu1),
                        seqs2=_t(seqs2, dev), rows2=_t(rows2, dev), cu2=_t(cu2, dev), cu2_host=tuple(cu2))


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
