"""Continuous batching: admit, chunk, decode, retract, finish.

Each ``step()`` runs one forward pass over a ragged batch that mixes decode tokens of
running requests with prefill chunks under the step's prompt-token budget
(serving.scheduler.prefill: short waiting requests beside a prompt in chunks, then the partly
prefilled ones, then newly admitted ones in the schedule policy's order). With speculative decoding (``spec``,
serving.speculative.worker) a decode row also carries its request's drafts, verified in the
same pass. A step is three methods: ``_plan`` (the rows: decode tokens, drafts, prefill chunks),
``_forward`` (the batch and its forward pass, grammar masks filled meanwhile) and ``_commit`` (KV
advanced, tokens sampled and appended, drafts verified), with the PD role's step and the overlap
scheduler's resolve before them. The optional parts are typed protocols (serving/scheduler/parts.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from serving.cache.prefill_timer import PrefillTimer
from serving.cache.req_cache import ReqCache
from serving.config import SchedulerConfig
from serving.runner.logprobs import plan_prompt_rows, record_outputs, record_prompt_rows
from serving.runner.sampler import Sampler
from serving.scheduler.parts import GrammarPart, PDRolePart, SpeculativePart
from serving.scheduler.prefill import PrefillPlanner
from serving.scheduler.prompt_check import check_fits
from serving.scheduler.schedule_policy import make_schedule_policy
from serving.scheduler.step_records import StepForward, StepPlan
from serving.scheduler.stop import StopChecker
from serving.structs.forward_batch import ForwardBatch
from serving.structs.request import Req


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "storage": 0})
    generated_tokens: int = 0
    retractions: int = 0
    forward_passes: int = 0


class Scheduler:
    """Continuous batching over one model and one request cache (see the module docstring).

    Concurrency contract: one thread, the scheduler thread (the engine loop's, or the offline
    Engine caller's), calls every method and owns ``waiting``, ``running``, ``stats`` and the
    requests in them; no lock. A step waits only for its own forward pass (the sampled tokens
    reach the host; with overlap scheduling, on CUDA, for the previous step's while the next
    one is queued) and for this step's grammar masks, filled on the runner's ``grammar-mask``
    thread while the forward pass runs. It never waits for the cache's background work: L2
    loads, L3 lookups and fetches and grammar compiles are polled (``cache.poll``,
    ``cache.poll_load``, ``_poll_grammars``), and a request whose KV or grammar is not ready
    stays in the queue (on CUDA a layered load is waited for on the GPU, layer by layer).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        cache: ReqCache,
        forward: Callable[[ForwardBatch], torch.Tensor],
        stop_checker: StopChecker,
        context_len: int,
        device: torch.device | str = "cpu",
        grammar: GrammarPart | None = None,  # structured output
        prefill_timer: PrefillTimer | None = None,
        sampler: Sampler | None = None,  # shared with the speculative part (its verification samples)
        spec: SpeculativePart | None = None,  # speculative decoding
        pd: PDRolePart | None = None,  # a prefill / decode server's role
    ) -> None:
        self.config = config
        self.cache = cache
        self.forward = forward
        self.stop = stop_checker
        self.context_len = context_len
        self.device = torch.device(device)
        self.page_size = cache.page_size
        self.policy = make_schedule_policy(config.schedule_policy)
        self.prefill = PrefillPlanner(self)
        self.sampler = sampler if sampler is not None else Sampler()
        self.waiting: list[Req] = []
        self._finished_outside_step: list[Req] = []  # finished while scheduling (not sampled)
        self.running: list[Req] = []  # admitted, in admission order
        self.stats = SchedulerStats()
        self.grammar = grammar  # None: no structured output
        # times the forward passes that prefill (GPU time on CUDA): the L3 cost model's prefill rate
        self.prefill_timer = prefill_timer
        self._step_prefill = 0
        self._overlap = None  # serving.scheduler.overlap.OverlapScheduler: batch N+1 prepared while N runs
        self.pd = pd  # None: colocated
        self.spec = spec  # None: off
        self._pd_emitted = False  # the last step returned PD first tokens without a forward pass
        if not config.disable_overlap_schedule and self.device.type == "cuda":
            from serving.scheduler.overlap import OverlapScheduler

            self._overlap = OverlapScheduler(self)

    # -- queue --------------------------------------------------------------------------
    def validate(self, req: Req) -> None:
        """Raise InvalidRequest for a prompt that can never fit in the KV cache. Called once per
        request, by ``EngineCore.make_request``, after the prompt's other rules
        (serving/scheduler/prompt_check.py: non-empty, ids in the vocabulary, shorter than the context)."""
        check_fits(len(req.input_ids), self.cache.allocator.num_pages * self.page_size)

    def add(self, req: Req) -> None:
        """Queue a request made by ``EngineCore.make_request`` (which validated it)."""
        try:
            if len(self.waiting) >= self.config.max_queued_requests:
                raise OverflowError(f"the queue is full ({len(self.waiting)} requests waiting)")
        except Exception:
            self._release_grammar(req)  # its compile is not waited for
            raise
        self.stats.prompt_tokens += len(req.input_ids)
        if req.sampling.max_new_tokens == 0:
            req.finish_reason = {"type": "length", "length": 0}
            self._release_grammar(req)
            return
        if self.pd is not None and self.pd.on_add(req):
            return  # a decode server's request waits in its role until its KV has arrived
        self.waiting.append(req)

    def abort(self, rid: str) -> Req | None:
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    self._finish(req, {"type": "abort", "message": "aborted"})
                    return req
        req = self._overlap.pending(rid) if self._overlap is not None else None
        if req is not None and not req.finished:  # its KV given back already, its last token pending
            self._finish(req, {"type": "abort", "message": "aborted"})
            return req
        return self.pd.abort(rid) if self.pd is not None else None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running) or (self.pd is not None and self.pd.busy) or \
            (self._overlap is not None and self._overlap.prev is not None)  # a token still to hand out

    def in_use_pages(self) -> int:
        return sum(r.own_pages for r in self.running) + (self.pd.held_pages() if self.pd is not None else 0)

    def start_decoding(self, r: Req, first_token: int) -> None:
        """A request whose prompt KV was computed elsewhere (a PD decode server): its pages
        hold the prompt's KV (``r.kv.kv_len == len(r.input_ids)``); it decodes from ``first_token``."""
        self.running.append(r)
        self.stats.cached_tokens += r.kv.cached_tokens
        for tier, v in r.kv.cached_by_tier.items():
            self.stats.cached_by_tier[tier] = self.stats.cached_by_tier.get(tier, 0) + v
        self._finished_outside_step.append(r)  # reported as updated by this step
        self._append_token(r, first_token)

    # -- one step -----------------------------------------------------------------------
    def step(self) -> list[Req]:
        """Run one forward pass; return the requests that got a token or finished."""
        t0 = time.perf_counter()
        self._step_prefill = 0
        out = self._step()
        if self.prefill_timer is not None:
            self.prefill_timer.poll()
        if self.spec is not None:  # what a draft costs, from the decode steps' times
            self.spec.observe(time.perf_counter() - t0)
        # lookups that finished during the forward pass start their fetch now, not a whole step later
        self.cache.advance_prefetches(self.waiting)
        return out

    def _step(self) -> list[Req]:
        """plan -> forward -> commit (sample and append): the requests that got a token or finished."""
        overlap, early = self._begin_overlap()
        self.cache.poll()
        emitted = self._pd_step(early, overlap)
        if emitted is not None:
            return emitted
        self._poll_grammars()
        plan = self._plan(early, overlap)
        if not plan.batch:
            return plan.updated + (self._overlap.resolve() if overlap else [])
        fwd = self._forward(plan, overlap)
        return self._commit(plan, fwd, overlap)

    def _begin_overlap(self) -> tuple[bool, list[Req]]:
        """Whether this step overlaps the next one's preparation (CUDA), and the previous step's
        requests it resolved. Grammar masks, logprobs and drafts need every token on the host."""
        if self._overlap is None:
            return False, []
        if ((self.grammar is not None and self.grammar.active(self.running + self.waiting))
                or any(r.logprob is not None for r in self.running + self.waiting)
                or (self.spec is not None and self.spec.speculating(self.running))):
            return False, self._overlap.resolve()
        return self._overlap.begin_step()

    def _pd_step(self, early: list[Req], overlap: bool) -> list[Req] | None:
        """The PD role's step; the requests to return at once when first tokens arrived with their
        KV (never twice in a row, so a stream of arrivals cannot starve the decode batch)."""
        if self.pd is None:
            return None
        arrived = self.pd.step()
        for r, first_token in arrived:
            self.start_decoding(r, first_token)
        if arrived and not self._pd_emitted:
            self._pd_emitted = True
            updated, self._finished_outside_step = self._finished_outside_step, []
            return early + updated + (self._overlap.resolve() if overlap else [])
        self._pd_emitted = False
        return None

    def _plan(self, early: list[Req], overlap: bool) -> StepPlan:
        """The step's rows: running requests' decode tokens (with their drafts) and the prefill
        chunks under the step's prompt-token budget (serving.scheduler.prefill)."""
        decode = self._reserve_decode()
        chunks = self.prefill.schedule()
        self._step_prefill = sum(n for _, n in chunks)
        spec = self.spec if decode and not overlap else None
        if spec is not None:
            spec.propose(decode, prefill=bool(chunks))  # drafts: verified as extra new tokens of their rows
        batch = [(r, 1 + len(spec.drafts(r)) if spec else 1) for r in decode] + chunks
        updated, self._finished_outside_step = early + self._finished_outside_step, []
        return StepPlan(batch, spec, updated)

    def _forward(self, plan: StepPlan, overlap: bool) -> StepForward:
        """Build the batch and run its forward pass; the grammar masks fill meanwhile."""
        spec, batch = plan.spec, plan.batch
        seqs = [(r.model_ids(r.kv.kv_len, r.kv.kv_len + n) if n == 1 or spec is None or not spec.drafts(r)
                 else r.model_ids(r.kv.kv_len, r.kv.kv_len + 1) + spec.drafts(r), r.kv.kv_len, r.kv.pages)
                for r, n in batch]
        fb = ForwardBatch.build(seqs, self.page_size, self.device, win_map=self.cache.win_map)
        if self.cache.states is not None:  # state layers: working slots, captures at page boundaries
            fb.set_state(*self.cache.states.plan(batch))
        fb.layer_waits = self.cache.layer_waits([r for r, _ in batch])
        prompt_rows = plan_prompt_rows(batch)  # prompt logprobs: logits of more positions than the last
        extra = [row for _, rows, _ in prompt_rows for row in rows]
        verify = spec.verify_rows(batch) if spec is not None else []
        if extra or verify:
            fb.logit_rows = torch.tensor(extra + verify, dtype=torch.int64, device=self.device)
        if overlap:
            fb = self._overlap.prepare(fb)
        masks = None  # structured output: next-token masks filled on a worker during the forward pass
        if self.grammar is not None:
            masks = self.grammar.begin_masks([r for r, n in batch if r.kv.kv_len + n == r.seq_len])
        # a batch whose layers wait for loads (L2/L3 -> L1) would time the loads, not the prefill
        timed = self._step_prefill and self.prefill_timer is not None and fb.layer_waits is None
        if timed:
            self.prefill_timer.begin()
        all_logits = logits = self.forward(fb)  # [B, vocab] (+ the extra rows)
        if timed:
            self.prefill_timer.end(self._step_prefill)
        self.stats.forward_passes += 1
        if prompt_rows or verify:
            logits = record_prompt_rows(prompt_rows, logits, len(batch))
        # the drafts' rows follow the prompt-logprob rows
        return StepForward(logits, all_logits, masks, verify_at=len(batch) + len(extra))

    def _commit(self, plan: StepPlan, fwd: StepForward, overlap: bool) -> list[Req]:
        """Advance each row's KV, sample the rows that finished their prompt (or decode), append
        the tokens (and what the grammar forces after them), verify the drafts."""
        spec, updated, verify_at = plan.spec, plan.updated, fwd.verify_at
        done_rows: list[int] = []
        drafted: list[tuple[Req, int, int]] = []  # (request, its last-token row, its first verify row)
        for i, (r, n) in enumerate(plan.batch):
            if spec is not None and n > 1 and spec.drafts(r):
                drafted.append((r, i, verify_at))
                verify_at += n - 1
                continue
            self.cache.advance(r, n)
            if r.kv.kv_len == r.seq_len:
                done_rows.append(i)
        if overlap:  # sample on the GPU; this step's tokens are read in the next step
            updated += self._overlap.finish(fwd.logits, done_rows, [plan.batch[i][0] for i in done_rows])
            self._overlap.release_ended()  # their pages are the next step's to admit into
            return updated
        if done_rows:
            reqs = [plan.batch[i][0] for i in done_rows]
            rows = fwd.logits[done_rows]
            if fwd.masks is not None:
                fwd.masks.apply(rows)  # tokens the grammars disallow -> -inf (constrained rows only)
            params = [r.sampling for r in reqs]
            rows = self.sampler.penalize(rows, params, [(r.input_ids, r.output_ids) for r in reqs])
            tokens = self.sampler.choose(rows, params, [r.rid for r in reqs])
            record_outputs(reqs, rows, tokens)  # logprobs of the requests that ask (none: no work)
            for r, tok in zip(reqs, tokens, strict=True):
                self._append_token(r, tok)
                if r.grammar is not None:  # tokens the grammar forces: appended now, prefilled next step
                    self.grammar.jump_forward(r, self._append_token)
                updated.append(r)
        if drafted:
            updated += spec.accept(drafted, fwd.all_logits, self._append_token)
        return updated

    def _append_token(self, r: Req, tok: int) -> None:
        if r.first_token_time is None:
            r.first_token_time = time.monotonic()
        r.output_ids.append(tok)
        self.stats.generated_tokens += 1
        reason = self.stop.check(r, self.context_len)
        if reason is None and r.grammar is not None:
            reason = self.grammar.accept(r, tok)  # the grammar terminated (stop) or rejected tok
        if reason is not None:
            self.running.remove(r)
            self._finish(r, reason)

    def resolve_overlapped(self, r: Req, tok: int) -> None:
        """Hand ``r`` its token ``tok`` from an overlapped batch launched before this step (see
        serving.scheduler.overlap): appended as a step's own token while ``r`` runs; when ``r`` was retracted
        after that launch (waiting again) the token still joins its output, and if it finishes ``r``
        the request leaves the queue; when ``r`` gave its pages back at that launch (``release_ended``: it
        left the queues) the token finishes it."""
        if r in self.running:
            self._append_token(r, tok)
            return
        self.running.append(r)  # _append_token removes a finished request from running
        self._append_token(r, tok)
        if r.finished:
            if r in self.waiting:
                self.waiting.remove(r)
        else:
            self.running.remove(r)

    def _finish(self, r: Req, reason: dict) -> None:
        r.finish_reason = reason
        if self.pd is None or not self.pd.on_finish(r):  # a prefill server keeps the pages until sent
            self.cache.release(r)
        self.sampler.forget(r.rid)
        self._release_grammar(r)
        if self.spec is not None:
            self.spec.forget(r)

    # -- structured output: requests wait in the queue until their grammar compiled -------
    def _release_grammar(self, r: Req) -> None:
        if r.grammar is not None and self.grammar is not None:
            self.grammar.release(r.grammar)  # the last request waiting for a compile cancels it

    def _poll_grammars(self) -> None:
        """Never waits: a request whose grammar is still compiling stays in the queue (skipped
        by admission); one whose compile failed (invalid, over the time budget) finishes."""
        if self.grammar is None:
            return
        for r in [r for r in self.waiting if r.grammar is not None and not r.grammar.ready]:
            if self.grammar.poll(r.grammar) and r.grammar.failure is not None:
                self.waiting.remove(r)
                self._finish(r, r.grammar.failure)
                self._finished_outside_step.append(r)

    # -- decode reservation and retraction ------------------------------------------------
    def _reserve_decode(self) -> list[Req]:
        # a request whose pending token is its last by length gets no decode: the overlapped step
        # would compute a token that is dropped (for one-token requests, a second forward pass each)
        decode = [r for r in self.running
                  if not r.prefilling and r.kv.kv_len == r.seq_len - 1 and self.cache.poll_load(r)
                  and not StopChecker.ends_by_length(r, self.context_len)]
        ready: list[Req] = []
        for r in decode:
            if r not in self.running:  # retracted below to make room for an earlier one
                continue
            while not self.cache.reserve(r, r.kv.kv_len + 1):
                if len(self.running) == 1 and self.cache.give_back_fetches(self.waiting):
                    continue  # the waiting requests' fetches held L1 pages
                if len(self.running) == 1:  # alone and still no room: the pool is too small
                    self.running.remove(r)
                    self._finish(r, {"type": "length", "length": len(r.output_ids)})
                    self._finished_outside_step.append(r)
                    break
                victim = self.running[-1]
                self.retract(victim)
                if victim is r:
                    break
            else:
                ready.append(r)
        return ready

    def retract(self, r: Req) -> None:
        """Preempt: cache what it computed, free its pages, requeue it at the front."""
        self.running.remove(r)
        self.cache.release(r)
        r.num_retractions += 1
        self.stats.retractions += 1
        self.waiting.insert(0, r)
