"""A step's prefill: which requests prefill how many prompt tokens under the step's budget.

The budget is ``chunked_prefill_size`` prompt tokens per forward pass (-1: no limit); decode tokens
of running requests come on top of it. A step fills it in this order:

1. **Short requests beside a prompt in chunks.** While a request is partly prefilled (a long prompt
   runs in chunks), the waiting requests whose uncached prompt is short -- those that fit, together,
   in half the budget, in the queue policy's order (the first ``BESIDE_SCAN`` looked at) -- get that
   room first. They are admitted in this same pass and prefilled whole, and their decode steps then
   run beside the long prompt's remaining chunks: a short request waits about one chunk behind a
   long prefill, never the whole prefill. Their uncached length is read from the tree without
   touching it (``ReqCache.uncached_len``).
2. **Partly prefilled requests continue** (in admission order, once their L2 load is in), with the
   rest of the budget: the long prompt keeps at least half of every pass, so short requests arriving
   at every step at most halve its prefill rate. One that finds no pages for its chunk retracts the
   requests admitted after it, youngest first (as a decode step does), so the oldest always progresses.
3. **New requests** in the policy's order take what the continuing ones left (only when they left
   some: their prefill ended in this pass), the last of them possibly in chunks. So one prompt runs in
   chunks at a time, as in SGLang; a long request that waits is not started beside another's chunks.
   Each is admitted by one call, ``ReqCache.try_admit`` (serving/cache/admission.py), which answers
   READY (it computes in this pass), LOADING (admitted; it computes once its L2 -> L1 load is in),
   WAIT (it stays queued for its L3 prefetch) or NO_ROOM (admission stops for this pass).

Where SGLang (``PrefillAdder``) and vLLM continue a chunked prompt with the whole budget first, so the
requests behind it wait for its whole prefill, here short ones take part of its next chunk (vLLM's
``long_prefill_token_threshold`` caps a long prompt's share per step to the same end). Batch order and
chunk boundaries never change a request's tokens: every row attends to its own KV only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from serving.cache.admission import Answer
from serving.structs.request import Req

if TYPE_CHECKING:
    from serving.scheduler.scheduler import Scheduler

# Waiting requests looked at, per step, for room beside a prompt in chunks (a read-only tree lookup
# each); the rest of a longer queue waits its turn as before.
BESIDE_SCAN = 64


class PrefillPlanner:
    """Plans the prefill of each step for its scheduler (see the module docstring). Runs on the
    scheduler thread only and keeps no state between steps: everything it reads is the scheduler's."""

    def __init__(self, sched: Scheduler) -> None:
        self.s = sched

    def budget(self) -> int:
        n = self.s.config.chunked_prefill_size
        return n if n > 0 else 1 << 62

    def schedule(self) -> list[tuple[Req, int]]:
        """This pass's prefill rows: (request, prompt tokens to compute), their pages reserved."""
        s = self.s
        budget = self.budget()
        going = [r for r in s.running if r.prefilling and s.cache.poll_load(r)]  # loads still landing wait
        order = self._order() if s.waiting else []
        beside, held = self._beside(order, budget) if going else ([], 0)
        room = budget - held
        chunks: list[tuple[Req, int]] = []
        for r in going:
            if r not in s.running:  # retracted below to make room for an older one
                continue
            n = s.cache.chunk(r, min(r.seq_len - r.kv.kv_len, room))
            if n <= 0 or not self._reserve(r, n):
                continue
            chunks.append((r, n))
            room -= n
        picked = {id(r) for r in beside}
        rest = [r for r in order if id(r) not in picked] if room > 0 else []
        return chunks + self._admit(beside + rest, room + held)

    def _reserve(self, r: Req, n: int) -> bool:
        """Pages (and a hybrid SWA L1's window pages) for ``n`` more tokens of ``r``, retracting requests
        admitted after it that are still prefilling (youngest first) while it finds no room, as a decode
        step does; with none it waits. Without this, requests in chunks that each hold part of a pool (a
        small window pool: the two windows each keeps) could all wait for one another, no pass running."""
        s = self.s
        while not s.cache.reserve(r, r.kv.kv_len + n):
            # only those still prefilling: this step's decode rows are reserved already (they finish and free)
            younger = [v for v in s.running[s.running.index(r) + 1:] if v.prefilling]
            if not younger:
                # alone, only the waiting requests' fetches can free L1 (else it waits for decodes to end)
                return len(s.running) == 1 and s.cache.give_back_fetches(s.waiting) and \
                    s.cache.reserve(r, r.kv.kv_len + n)
            s.retract(younger[-1])
        return True

    def _order(self) -> list[Req]:
        s = self.s
        s.cache.advance_prefetches(s.waiting)
        ready = [r for r in s.waiting if r.grammar is None or r.grammar.ready]  # the rest still compile
        return s.policy.order(ready, lambda r: s.cache.admission_key(r)) if ready else []

    def _beside(self, order: list[Req], budget: int) -> tuple[list[Req], int]:
        """The waiting requests that run beside the prompts in chunks, and the tokens they hold back."""
        s = self.s
        share = budget // 2
        slots = s.config.max_running_requests - len(s.running)
        picked: list[Req] = []
        held = 0
        for r in order[:BESIDE_SCAN]:
            if len(picked) >= slots or held >= share:
                break
            need = s.cache.uncached_len(r)
            if held + need <= share and s.cache.prefetch_ready(r):
                picked.append(r)
                held += need
        return picked, held

    def _admit(self, order: list[Req], budget: int) -> list[tuple[Req, int]]:
        """Admit waiting requests in ``order`` while the budget lasts (``ReqCache.try_admit``: their
        cached prefix locked, their first chunk's pages reserved); the first that finds no room stops
        admission."""
        s = self.s
        chunks: list[tuple[Req, int]] = []
        for r in order:
            if budget <= 0 or len(s.running) >= s.config.max_running_requests:
                break
            a = s.cache.try_admit(r, budget)
            if a.answer is Answer.WAIT:
                continue
            if a.answer is Answer.NO_ROOM:
                if not s.running:  # nothing can free L1 but the waiting requests' fetches: next step
                    s.cache.give_back_fetches(s.waiting)
                break
            s.waiting.remove(r)
            s.running.append(r)
            if a.first:
                s.stats.cached_tokens += r.kv.cached_tokens
                for tier, v in r.kv.cached_by_tier.items():
                    s.stats.cached_by_tier[tier] += v
            if a.answer is Answer.LOADING:
                continue  # runs once its L2 -> L1 copy is in (CPU); the budget stays free meanwhile
            chunks.append((r, a.tokens))
            budget -= a.tokens
        return chunks
