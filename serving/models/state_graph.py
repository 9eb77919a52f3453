"""The state layers' plan on static buffers, for the extend CUDA graphs (serving/runner/cuda_graph_extend.py).

An eager extend builds its :class:`~serving.models.state_scan.StatePlan` from the batch's host lists: index
tensors sized by the batch, and as many passes of the whole-sequence kernels as the most pieces a sequence
is cut into (``StatePlan.passes``). A graph replays fixed shapes and launches, so a bucket of ``T`` new
tokens and ``S`` sequences (conv width ``w``, ``h = w - 1`` history rows) keeps everything at that size:

- **The conv's extended rows** (``StatePlan.build``'s layout): sequence ``i``'s ``h`` history rows, then its
  new tokens, sequence after sequence; then the padding sequences' history rows; then the padding tokens'
  rows: always ``T + S * h`` rows. Padding sequences read and write the state pool's scratch row
  (``pad_slot``); so do the snapshots of sequences that take none.
- **Two passes** of the whole-sequence kernel over all ``S`` sequences (``cu_seqlens`` on the device, a piece
  may be empty): pass 0 runs each sequence up to and including its snapshot token (all its tokens without
  one), pass 1 the rest. A batch has at most one snapshot a sequence (a speculative verify row, a snapshot
  after every token, runs eagerly: :meth:`ExtendStatePlan.fits`). Each pass gathers its token rows first
  (``perm``: the pass's rows in ``cu`` order, then the others, which the kernel does not read), and its
  outputs go back to the batch's order (``inv``); a token row takes the output of the pass it belongs to
  (``member``). The snapshot slots take pass 0's final states; the working slots the last pass's that
  ran the sequence (``more``: pass 1 had tokens of it). fla's fused recurrent kernel reads ``cu_seqlens``
  on the device and its grid depends on shapes only, so the passes launch the same kernels every replay.

:meth:`ExtendStatePlan.fill` lays a batch out on the host (numpy) and copies the result into the static
buffers: one integer and one boolean copy a replay, from pinned memory on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from serving.models.state_scan import StatePlan
from serving.structs.forward_batch import SNAP_EVERY, ForwardBatch

# run(*token-major inputs [1, T, ...], initial_state [S, ...], cu_seqlens [S + 1], recurrent) -> (out, finals)
RunFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
PASSES = 2


@dataclass(frozen=True)
class GraphPasses:
    """The two passes of a static plan (see the module docstring); every tensor a view of the plan's buffers."""

    perm: torch.Tensor  # [2, T] int64
    inv: torch.Tensor  # [2, T] int64
    cu: torch.Tensor  # [2, S + 1] int64
    member: torch.Tensor  # [2, T] bool
    more: torch.Tensor  # [S] bool
    snap_slots: torch.Tensor  # [S] int64: pass 0's final state goes here

    def run(self, run: RunFn, inputs: list[torch.Tensor], recurrent: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``serving.models.state_kernels.run_segments`` on the static layout: outputs ``[T, ...]``; the
        working and snapshot slots of ``recurrent`` updated."""
        state = recurrent[slots].float()
        outs, finals = [], []
        for p in range(PASSES):
            part = [x[self.perm[p]].unsqueeze(0) for x in inputs]
            o, hn = run(*part, state.contiguous(), self.cu[p], True)
            hn = hn.float()
            if p == 0:
                recurrent[self.snap_slots] = hn.to(recurrent.dtype)
            outs.append(o[0][self.inv[p]])
            finals.append(hn)
            state = hn
        more = self.more.view(-1, *([1] * (state.dim() - 1)))
        recurrent[slots] = torch.where(more, finals[1], finals[0]).to(recurrent.dtype)
        first = self.member[0].view(-1, *([1] * (outs[0].dim() - 1)))
        return torch.where(first, outs[0], outs[1])


class ExtendStatePlan:
    """A :class:`StatePlan` on static buffers for one extend bucket (``tokens``, ``seqs``); ``plan`` is the
    same object every replay, :meth:`fill` rewrites its buffers. One user: the graph runner's thread."""

    def __init__(self, tokens: int, seqs: int, width: int, pad_slot: int, device: torch.device) -> None:
        self.tokens, self.seqs, self.width, self.pad_slot = tokens, seqs, width, pad_slot
        t, s, h = tokens, seqs, width - 1
        # one int64 buffer: slots, snap_slots, hist_rows, tok_rows, windows, tails, snap_tails, perm, inv, cu
        self._sizes = (s, s, s * h, t, t * width, s * h, s * h, PASSES * t, PASSES * t, PASSES * (s + 1))
        self._ints = torch.zeros(sum(self._sizes), dtype=torch.int64, device=device)
        self._flags = torch.zeros(PASSES * t + s, dtype=torch.bool, device=device)  # member, more
        (slots, snap_slots, hist_rows, tok_rows, windows, tails, snap_tails, perm, inv, cu) = \
            self._ints.split(self._sizes)
        self.passes = GraphPasses(perm=perm.view(PASSES, t), inv=inv.view(PASSES, t), cu=cu.view(PASSES, s + 1),
                                  member=self._flags[: PASSES * t].view(PASSES, t), more=self._flags[PASSES * t:],
                                  snap_slots=snap_slots)
        self.plan = StatePlan(
            slots=slots, num_ext=t + s * h, hist_rows=hist_rows, tok_rows=tok_rows, windows=windows.view(t, width),
            tails=tails.view(s, h), snap_seqs=torch.arange(s, device=device), snap_slots=snap_slots,
            snap_tails=snap_tails.view(s, h), lens=(0,) * s, snaps=(), graph=self.passes)
        self.fill([], [], [], [])  # every sequence and token padding: warm-up and capture touch the scratch row only

    @staticmethod
    def fits(batch: ForwardBatch) -> bool:
        """Whether the batch's snapshots fit the two passes (no speculative verify row)."""
        return SNAP_EVERY not in (batch.snap_offsets_list or ())

    def fill(self, lens: Sequence[int], slots: Sequence[int], snap_slots: Sequence[int],
             snap_offsets: Sequence[int]) -> None:
        """Lay out a batch of ``len(lens)`` sequences (at most ``seqs``, ``sum(lens)`` at most ``tokens``) with
        its working slots and snapshots (slot, offset; -1: none) in the buffers (see the module docstring)."""
        t, s, w, h, pad = self.tokens, self.seqs, self.width, self.width - 1, self.pad_slot
        b = len(lens)
        if b > s or sum(lens) > t:
            raise ValueError(f"{b} sequences of {sum(lens)} tokens do not fit the bucket {t} x {s}")
        n = np.zeros(s, dtype=np.int64)
        n[:b] = lens
        slot = np.full(s, pad, dtype=np.int64)
        slot[:b] = slots
        off = np.full(s, -1, dtype=np.int64)
        off[:b] = snap_offsets
        snap = np.full(s, pad, dtype=np.int64)
        snap[:b] = np.where(off[:b] >= 0, np.asarray(snap_slots, dtype=np.int64), pad)
        base = np.concatenate([[0], np.cumsum(n + h)[:-1]])  # each sequence's first extended row
        hist_rows = (base[:, None] + np.arange(h)).reshape(-1)
        real = int(n.sum())
        start = np.concatenate([[0], np.cumsum(n)[:-1]])  # each sequence's first token row
        seq_of = np.repeat(np.arange(s), n)  # per real token row: its sequence
        j = np.arange(real) - start[seq_of]  # its offset in the sequence
        tok_rows = np.concatenate([base[seq_of] + h + j, int(base[-1] + n[-1] + h) + np.arange(t - real)])
        windows = tok_rows[:, None] - h + np.arange(w)
        tails = base[:, None] + n[:, None] + np.arange(h)
        snap_tails = np.where((off >= 0)[:, None], base[:, None] + off[:, None] + 1 + np.arange(h), tails)
        cut = np.where(off >= 0, off + 1, n)  # pass 0 runs tokens [0, cut), pass 1 [cut, n)
        in_first = np.zeros(t, dtype=bool)
        in_first[:real] = j < cut[seq_of]
        in_second = np.zeros(t, dtype=bool)
        in_second[:real] = ~in_first[:real]
        perms, invs, cus = [], [], []
        for member, pieces in ((in_first, cut), (in_second, n - cut)):
            perm = np.concatenate([np.flatnonzero(member), np.flatnonzero(~member)])
            inv = np.empty(t, dtype=np.int64)
            inv[perm] = np.arange(t)
            perms.append(perm)
            invs.append(inv)
            cus.append(np.concatenate([[0], np.cumsum(pieces)]))
        ints = np.concatenate([slot, snap, hist_rows, tok_rows, windows.reshape(-1), tails.reshape(-1),
                               snap_tails.reshape(-1), *perms, *invs, *cus])
        flags = np.concatenate([in_first, in_second, n - cut > 0])
        host_ints, host_flags = torch.from_numpy(ints), torch.from_numpy(flags)
        if self._ints.is_cuda:  # pinned (as ForwardBatch.from_host): a pageable copy would wait for the GPU
            host_ints, host_flags = host_ints.pin_memory(), host_flags.pin_memory()
        self._ints.copy_(host_ints, non_blocking=True)
        self._flags.copy_(host_flags, non_blocking=True)

    def fill_batch(self, batch: ForwardBatch) -> None:
        """:meth:`fill` from the batch's host lists (``ForwardBatch.set_state``)."""
        lens = batch.extend_lens_list
        b = len(lens)
        self.fill(lens, batch.state_slots_list or [], batch.snap_slots_list or [-1] * b,
                  batch.snap_offsets_list or [-1] * b)
