"""How long prefill takes, for the L3 load policy's recompute estimate (serving.cache.cost_model).

A step's wall time is its compute only where the forward pass is synchronous (a CPU). On
CUDA the step returns once the batch is queued (overlap scheduling samples on the GPU and
reads the tokens a step later; graphs replay asynchronously), so its wall time is the
launch: measured on the H200 (8B shape, a 4k prompt), 156k tok/s "prefill" against a real
~30k, and the cost model then refused L3 loads that were 5x faster than recomputing. There,
two events bracket the forward pass and are read once the GPU has passed the second one
(``query``, never a wait): the GPU time of the batch.

Contract: the scheduler thread only (``begin`` / ``end`` around one forward pass, ``poll``
once a step); events not yet complete wait for a later ``poll``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch


class PrefillTimer:
    def __init__(self, observe: Callable[[int, float], None], device: torch.device) -> None:
        self._observe = observe
        self._cuda = device.type == "cuda"
        self._t0 = 0.0
        self._start: torch.cuda.Event | None = None
        self._pending: deque[tuple[int, torch.cuda.Event, torch.cuda.Event]] = deque()

    def begin(self) -> None:
        if self._cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def end(self, tokens: int) -> None:
        """After the forward pass of a batch with ``tokens`` prefill tokens was queued."""
        if not self._cuda:
            self._observe(tokens, time.perf_counter() - self._t0)
            return
        stop = torch.cuda.Event(enable_timing=True)
        stop.record()
        self._pending.append((tokens, self._start, stop))
        self._start = None

    def poll(self) -> None:
        """Report the batches the GPU has finished (in order; stops at the first still running)."""
        while self._pending and self._pending[0][2].query():
            tokens, start, stop = self._pending.popleft()
            self._observe(tokens, start.elapsed_time(stop) / 1e3)
