"""Overlap scheduling: the CPU schedules and builds batch N+1 while the GPU runs batch N.

Without it every step ends in a host sync (the sampled tokens), so the GPU idles while
the scheduler picks the next batch, builds its tensors and checks stop conditions. With
it, a step:

1. schedules batch N+1 as if every request of batch N will continue: a request whose
   token from batch N is still on the GPU carries ``Req.pending`` (the row of that token
   in step N's token tensor); its ``fill_ids`` end with a placeholder ``-1 - row``;
2. builds the batch (pinned host tensors, non-blocking copies) and replaces placeholders
   on the GPU by indexing step N's token tensor; launches the forward pass and a greedy
   argmax, then starts a non-blocking copy of the new tokens to pinned memory;
3. only then waits for step N's tokens (an event recorded after their copy, so the wait
   ends when batch N ends, while N+1 already runs), appends them and checks stop
   conditions: one step late. A request that stopped there ran one extra decode in
   batch N+1; that token is dropped. The KV it wrote is the KV of its last real token,
   so the pages it releases hold correct data.

A request whose pending token ends it by length whatever it is (a one-token request after its prefill,
any request's last decode) gives its KV back as soon as its last pass is launched (:meth:`release_ended`):
it leaves the running list, the tree caches its pages, and the next step admits into them while that pass
still runs. No later pass reads its KV, and every use of the pages by another request comes after that
pass: its forward passes run on the same stream, and loads and backups wait for the stream's work queued
before them. Otherwise each such pass left the GPU idle while the step after it waited for its token and
only the one after admitted the next requests (a turn of one-token returning requests ran as admit, wait,
admit, wait). Its token is handed to it later as to a retracted one (``Scheduler.resolve_overlapped``).

Only greedy requests without penalties or grammar are sampled on the GPU this way. When any
request in the queues needs the host sampler (temperature, penalties, a grammar mask), the
step first resolves the pending tokens (a sync) and runs the plain step. ``disable_overlap_schedule`` turns it
off; it is on by default on CUDA (on a CPU nothing runs asynchronously, so it is off there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serving.scheduler.stop import StopChecker
from serving.structs.forward_batch import ForwardBatch
from serving.structs.request import Req


@dataclass
class _Launched:
    tokens: torch.Tensor  # [n] int64 on the device
    host: torch.Tensor  # [n] int64, pinned, filled by a non-blocking copy
    event: torch.cuda.Event | None  # recorded after that copy (None on CPU)
    reqs: list[Req]  # row i's request


def _simple(r: Req) -> bool:
    """Sampled on the GPU by a plain argmax: greedy, no penalties, no grammar."""
    return r.sampling.greedy and not r.sampling.needs_penalties and getattr(r, "grammar", None) is None


class OverlapScheduler:
    """The scheduler's helper for overlapped steps (see the module doc).

    Concurrency contract: the scheduler thread only, as its scheduler. ``prev``'s requests may have left the
    scheduler's queues (:meth:`release_ended`): until their token is resolved only ``prev`` holds them.
    """

    def __init__(self, sched) -> None:  # noqa: ANN001 - serving.scheduler.scheduler.Scheduler (import cycle)
        self.s = sched
        self.prev: _Launched | None = None
        self.overlapped_steps = 0
        self.released_early = 0  # requests whose KV went back at their last pass's launch (release_ended)

    # -- hooks called by Scheduler.step ------------------------------------------------
    def begin_step(self) -> tuple[bool, list[Req]]:
        """(overlap this step?, requests that got their token now). A step that cannot be
        overlapped first resolves the pending tokens."""
        s = self.s
        if all(_simple(r) for r in s.running) and all(_simple(r) for r in s.waiting):
            return True, []
        return False, self.resolve()

    def prepare(self, fb: ForwardBatch) -> ForwardBatch:
        """Replace placeholder ids by the previous step's tokens, on the device. A placeholder
        that names no row of the previous step is refused here, on the host (a RuntimeError: the
        step fails), not left to the device's gather, whose failed bounds check would end the
        CUDA context of every request."""
        i64, _, t = fb.host[:3]
        lowest = int(i64[:t].min()) if t else 0
        if lowest < 0 and (self.prev is None or -1 - lowest >= len(self.prev.reqs)):
            rows = 0 if self.prev is None else len(self.prev.reqs)
            raise RuntimeError(f"overlap: a placeholder for row {-1 - lowest} of the previous step's tokens, "
                               f"which has {rows} rows")
        if self.prev is None:
            return fb
        ids = fb.input_ids
        rows = (-1 - ids).clamp_(min=0)
        fb.input_ids = torch.where(ids < 0, self.prev.tokens[rows], ids)
        if fb.win is not None:  # a hybrid SWA pool's window view (CPU's fused decoder embeds through it)
            fb.win.input_ids = fb.input_ids
        return fb

    def finish(self, logits: torch.Tensor, rows: list[int], done: list[Req]) -> list[Req]:
        """After the forward pass is queued: queue the argmax of ``logits[rows]`` (row
        ``rows[i]`` is request ``done[i]``), resolve the previous step, mark the new pending
        tokens. Returns the requests that got a token (from the previous step)."""
        launched = None
        if done:
            if rows != list(range(logits.shape[0])):
                # a list index would be copied from pageable memory: a sync with the GPU
                idx = torch.tensor(rows, dtype=torch.int64)
                if logits.device.type == "cuda":
                    idx = idx.pin_memory().to(logits.device, non_blocking=True)
                logits = logits[idx]
            tokens = torch.argmax(logits, dim=-1)
            if tokens.device.type == "cuda":
                host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
                host.copy_(tokens, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            else:
                host, event = tokens, None
            launched = _Launched(tokens, host, event, done)
        updated = self.resolve()
        if launched is not None:
            for i, r in enumerate(launched.reqs):
                if not r.finished:
                    r.pending = i
            self.prev = launched
            self.overlapped_steps += 1
        return updated

    def release_ended(self) -> None:
        """The launched requests whose pending token ends them by length leave the running list and give
        their KV back now (see the module doc). Not under a PD role: a prefill server keeps a finished
        request's pages until they are sent, a decode server backs its sequence up as it finishes."""
        s = self.s
        if self.prev is None or s.pd is not None:
            return
        for r in self.prev.reqs:
            if StopChecker.ends_by_length(r, s.context_len) and not r.finished and r in s.running:  # (cheap first)
                s.running.remove(r)
                s.cache.release(r)
                self.released_early += 1

    def pending(self, rid: str) -> Req | None:
        """The request ``rid`` whose token is still pending, if any (it may have left the queues)."""
        if self.prev is None:
            return None
        return next((r for r in self.prev.reqs if r.rid == rid and r.pending >= 0), None)

    def resolve(self) -> list[Req]:
        """Wait for the previous step's tokens and hand them to their requests."""
        prev, self.prev = self.prev, None
        if prev is None:
            return []
        if prev.event is not None:
            prev.event.synchronize()  # batch N done; batch N+1 (if queued) keeps the GPU busy
        s = self.s
        updated: list[Req] = []
        for r, tok in zip(prev.reqs, prev.host.tolist(), strict=True):
            if r.pending < 0:
                continue
            r.pending = -1
            if r.finished:  # aborted (or cut short) after its batch was launched
                r.output_ids.append(tok)
                continue
            s.resolve_overlapped(r, tok)
            updated.append(r)
        return updated
