"""The ragged machinery of the state layers (Gated DeltaNet, Mamba2): a causal short convolution
that reads and writes each sequence's conv state, and a token-by-token recurrence over a batch's
new tokens, each sequence starting from its slot's state (torch; CPU and CUDA).

A :class:`StatePlan` is built once per forward pass from the batch's host lists and shared by every
state layer: the rows that lay each sequence's conv history before its new tokens, the recurrence's
steps (step ``t`` advances every sequence with more than ``t`` new tokens by one token) and where
snapshots are taken (``ForwardBatch.snap_slots`` / ``snap_offsets``). The recurrence is exact per
token, so a sequence split over several forwards (chunked prefill) reaches the same state as one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from serving.structs.forward_batch import ForwardBatch

# step(state rows [A, ...] float32, token rows [A]) -> (new state rows, output rows [A, ...])
StepFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


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
    steps: tuple[tuple[torch.Tensor | None, torch.Tensor], ...]  # per step: (sequences or None: all, token rows)
    snaps_at: dict[int, tuple[torch.Tensor, torch.Tensor]]  # step -> (sequences, snapshot slots)

    @staticmethod
    def build(batch: ForwardBatch, width: int) -> StatePlan:
        if batch.state_slots is None or batch.state_slots_list is None:
            raise ValueError("a model with state layers needs the batch's state slots (ForwardBatch.set_state)")
        lens, h = batch.extend_lens_list, width - 1
        b = len(lens)
        hist, toks, wins, tails = [], [], [], []
        offset = 0
        for n in lens:
            hist.extend(range(offset, offset + h))
            toks.extend(range(offset + h, offset + h + n))
            wins.extend(list(range(offset + j, offset + j + width)) for j in range(n))
            tails.append(list(range(offset + n, offset + n + h)))
            offset += h + n
        snap_seqs, snap_slots, snap_tails = [], [], []
        by_step: dict[int, tuple[list[int], list[int]]] = {}
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        for i, (slot, k) in enumerate(zip(batch.snap_slots_list or [-1] * b, batch.snap_offsets_list or [-1] * b,
                                          strict=True)):
            if k < 0:
                continue
            snap_seqs.append(i)
            snap_slots.append(slot)
            first = starts[i] + i * h  # sequence i's first extended row
            snap_tails.append(list(range(first + k + 1, first + k + 1 + h)))
            seqs, slots = by_step.setdefault(k, ([], []))
            seqs.append(i)
            slots.append(slot)
        dev = batch.input_ids.device
        steps = []
        for t in range(max(lens, default=0)):
            active = [i for i, n in enumerate(lens) if n > t]
            rows = [starts[i] + t for i in active]
            steps.append((None if len(active) == b else _t(active, dev), _t(rows, dev)))
        return StatePlan(
            slots=batch.state_slots, num_ext=offset, hist_rows=_t(hist, dev), tok_rows=_t(toks, dev),
            windows=_t(wins, dev).view(-1, width), tails=_t(tails, dev).view(b, h),
            snap_seqs=_t(snap_seqs, dev), snap_slots=_t(snap_slots, dev), snap_tails=_t(snap_tails, dev).view(-1, h),
            steps=tuple(steps), snaps_at={k: (_t(s, dev), _t(sl, dev)) for k, (s, sl) in by_step.items()})


def _t(values: list, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(device)


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                plan: StatePlan) -> torch.Tensor:
    """Depthwise causal conv of ``x [T, C]`` (weight ``[C, width]``) over each sequence's history
    (``conv_state [slots, C, width - 1]``, the last ``width - 1`` inputs, oldest first), without the
    activation. Updates the working slots' history and writes the snapshots'."""
    c, width = weight.shape
    ext = x.new_empty(plan.num_ext, c)
    hist = conv_state[plan.slots].transpose(1, 2).to(x.dtype)  # [B, width - 1, C]
    ext[plan.hist_rows] = hist.reshape(-1, c)
    ext[plan.tok_rows] = x
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
