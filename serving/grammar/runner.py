"""What the scheduler calls for structured output.

Per request, a :class:`GrammarState` (created at validation: the grammar is parsed there, so
an invalid one is a 400 before the request reaches a batch; the compile runs on a worker
thread and is joined only when the request's first token is sampled, so it overlaps prefill).

Per step:

1. ``begin_masks(reqs)`` (before the forward pass): the rows that will be sampled and have a
   grammar get their next-token masks filled on a worker thread (xgrammar fills the rows of
   the batch in parallel and releases the GIL), while the forward pass runs;
2. ``MaskJob.apply(logits)`` (after it): join, then set disallowed logits to -inf in place,
   only on the constrained rows, so constrained and unconstrained requests share a batch;
3. ``accept(r, tok)`` from ``Scheduler._append_token``: advance the matcher; the grammar's
   termination (it accepted a stop token) finishes the request with reason ``stop``;
4. ``jump_forward(r, append)``: jump-forward decoding (the compressed-FSM idea of the SGLang
   paper) made exact. While the grammar allows exactly one next token, step-by-step
   constrained decoding would get a mask with a single allowed token and pick it whatever the
   logits (greedy or sampled), so appending it without a forward pass gives the same tokens.
   The run of forced tokens is found by looking ahead on the matcher (then rolled back) and
   appended through the scheduler's normal path (stop checks, ``accept``):
   - a run that ends the grammar (its last token is the stop token) is always appended: the
     request finishes at once, without the passes for its closing tokens;
   - a run that does not end it is appended only when it has ``min_jump_tokens`` tokens or
     more: its tokens are then prefilled together in the next step (the request is
     "prefilling" again), one pass instead of one per token, but that step is a mixed batch,
     which costs more than a decode batch (no CUDA graph; the CPU attention loops per sequence).
   Multi-token strings the tokenizer can split several ways (``": "`` as ``":`` + `` "`` or
   ``:`` + ``" "`` ...) are never skipped: which split the model picks depends on its logits.
   Tokens match step-by-step decoding exactly; the logits after a jump can differ in the last
   bits where the jumped tokens' KV comes from a prefill kernel instead of a decode kernel
   (bf16 on GPU), as with any change of batch shape.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import torch

from serving.grammar.base import GrammarBackend, GrammarError, Matcher
from serving.grammar.lru import CompiledGrammarCache
from serving.grammar.registry import make_grammar_backend
from serving.grammar.spec import grammar_spec
from serving.sampling_params import InvalidRequest

# A forced run that does not end the grammar is appended only from this length on: its tokens
# are prefilled as a chunk in the next step, which turns that step from a decode batch (CUDA
# graphs on GPU, one batched attention on CPU) into a mixed batch that costs more than the few
# decode steps a short run saves (see bench/structured.py).
MIN_JUMP_TOKENS = 8
MAX_JUMP_TOKENS = 256  # look-ahead bound per step


@dataclass
class GrammarState:
    """A request's grammar: its compile (shared through the cache) and its own matcher."""

    kind: str
    text: str
    compiled: Future[Any]
    matcher: Matcher | None = None
    error: str | None = None

    def ready_matcher(self, backend: GrammarBackend) -> Matcher | None:
        """The matcher, waiting for the compile if needed; None if the compile failed."""
        if self.matcher is None and self.error is None:
            try:
                compiled = self.compiled.result()
            except Exception as e:
                self.error = str(e) or type(e).__name__
                return None
            self.matcher = backend.new_matcher(compiled)
        return self.matcher


@dataclass
class GrammarStats:
    masked_steps: int = 0  # steps with at least one constrained row
    masked_rows: int = 0
    compile_wait_s: float = 0.0  # worker waiting for compiles (first token of a new grammar)
    fill_s: float = 0.0  # mask fill, on the worker thread (overlaps the forward pass)
    wait_s: float = 0.0  # scheduler blocked joining the worker after the forward pass
    apply_s: float = 0.0  # masks applied to logits
    jump_s: float = 0.0  # jump-forward checks
    jumped_tokens: int = 0  # tokens appended without their own forward pass


class MaskJob:
    """One step's mask fill, running on the worker thread."""

    def __init__(self, runner: GrammarRunner, future: Future[list[int]]) -> None:
        self.runner, self.future = runner, future

    def apply(self, logits: torch.Tensor) -> None:
        """Join the fill and mask ``logits`` ([B, vocab], row i = ``begin_masks``' reqs[i]) in place."""
        r = self.runner
        t0 = time.perf_counter()
        rows = self.future.result()
        t1 = time.perf_counter()
        if rows:
            r.backend.apply_masks(logits, r._mask, rows)  # type: ignore[union-attr]
        r.stats.wait_s += t1 - t0
        r.stats.apply_s += time.perf_counter() - t1


class GrammarRunner:
    def __init__(self, backend: GrammarBackend | None, jump_forward: bool = True,
                 off_reason: str = "", cache_capacity: int = 256) -> None:
        self.backend = backend
        self.enable_jump_forward = jump_forward
        self.min_jump_tokens = MIN_JUMP_TOKENS
        self.off_reason = off_reason
        self.cache = CompiledGrammarCache(cache_capacity)
        self.stats = GrammarStats()
        self._compile_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._fill_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self._mask = backend.allocate_mask(64) if backend is not None else None
        self._job: MaskJob | None = None

    @property
    def enabled(self) -> bool:
        return self.backend is not None

    # -- requests --------------------------------------------------------------------------
    def new_state(self, params: Any) -> GrammarState | None:
        """The state for a request's SamplingParams (None: unconstrained). Parses the grammar
        now (InvalidRequest naming the problem) and starts its compile unless cached."""
        spec = grammar_spec(params)
        if spec is None:
            return None
        if self.backend is None:
            raise InvalidRequest(f"{spec[0]}: structured output is not available ({self.off_reason})")
        backend = self.backend

        def start() -> Future[Any]:
            parsed = backend.parse(*spec)
            return self._compile_pool.submit(backend.compile, parsed)

        try:
            fut = self.cache.get_or_start(spec, start)
        except GrammarError as e:
            raise InvalidRequest(str(e)) from None
        return GrammarState(spec[0], spec[1], fut)

    @staticmethod
    def active(reqs: Sequence[Any]) -> bool:
        return any(r.grammar is not None for r in reqs)

    # -- per step --------------------------------------------------------------------------
    def begin_masks(self, reqs: Sequence[Any]) -> MaskJob | None:
        """Start filling the masks of the constrained ``reqs`` (the rows about to be sampled)."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not rows or self.backend is None:
            return None
        if self._job is not None:  # a step that failed before joining its job
            self._job.future.result()
        assert self._mask is not None
        if self._mask.shape[0] < len(reqs):
            self._mask = self.backend.allocate_mask(max(len(reqs), 2 * self._mask.shape[0]))
        self.stats.masked_steps += 1
        self.stats.masked_rows += len(rows)
        states = [reqs[i].grammar for i in rows]
        self._job = MaskJob(self, self._fill_pool.submit(self._fill, states, rows))
        return self._job

    def _fill(self, states: list[GrammarState], rows: list[int]) -> list[int]:
        t0 = time.perf_counter()
        assert self.backend is not None and self._mask is not None
        matchers, filled = [], []
        for st, row in zip(states, rows, strict=True):
            m = st.ready_matcher(self.backend)  # waits for a compile still running
            if m is not None:  # a failed compile: unmasked here, finished by accept()
                matchers.append(m)
                filled.append(row)
        t1 = time.perf_counter()
        if matchers:
            self.backend.fill_masks(matchers, self._mask, filled)
        self.stats.compile_wait_s += t1 - t0
        self.stats.fill_s += time.perf_counter() - t1
        return filled

    def accept(self, r: Any, tok: int) -> dict[str, Any] | None:
        """Advance ``r``'s matcher by ``tok``; a finish reason when the request must end."""
        st: GrammarState = r.grammar
        assert self.backend is not None
        if self._job is not None and not self._job.future.done():
            self._job.future.result()
        m = st.ready_matcher(self.backend)
        if m is None:
            return {"type": "abort", "message": f"the {st.kind} failed to compile: {st.error}"}
        if not m.accept_token(tok):
            return {"type": "abort", "message": f"token {tok} does not match the {st.kind}"}
        if m.is_terminated():
            return {"type": "stop", "matched": tok}
        return None

    def jump_forward(self, r: Any, append: Callable[[Any, int], None]) -> None:
        """Append the tokens the grammar forces after ``r``'s last token (see the module doc):
        a forced run that ends the grammar always (the request finishes, no pass needed), a
        run that does not only when it has ``min_jump_tokens`` tokens or more."""
        st: GrammarState | None = r.grammar
        if not self.enable_jump_forward or st is None or st.matcher is None or r.finished:
            return
        assert self.backend is not None
        t0 = time.perf_counter()
        m = st.matcher
        forced: list[int] = []  # look ahead on the matcher, then roll back
        while len(forced) < MAX_JUMP_TOKENS:
            tok = self.backend.forced_token(m)
            if tok is None or not m.accept_token(tok):
                break
            forced.append(tok)
            if m.is_terminated():
                break
        ends = bool(forced) and m.is_terminated()
        if forced:
            m.rollback(len(forced))
        if forced and (ends or len(forced) >= self.min_jump_tokens):
            for tok in forced:
                if r.finished:
                    break
                append(r, tok)  # stop checks and accept(), exactly as for a sampled token
                self.stats.jumped_tokens += 1
        self.stats.jump_s += time.perf_counter() - t0

    def stats_dict(self) -> dict[str, Any]:
        return {**asdict(self.stats), "cache": self.cache.stats()}


def make_grammar_runner(backend_name: str, jump_forward: bool, tokenizer: Any, vocab_size: int,
                        stop_ids: Sequence[int]) -> GrammarRunner:
    """The engine's runner; a disabled one (requests with a grammar get a 400) when the backend
    is ``none`` or the model has no tokenizer."""
    if backend_name == "none":
        return GrammarRunner(None, off_reason="the server runs with --grammar-backend none")
    if tokenizer is None:
        return GrammarRunner(None, off_reason="this model has no tokenizer")
    hf = getattr(tokenizer, "hf", tokenizer)
    return GrammarRunner(make_grammar_backend(backend_name, hf, vocab_size, stop_ids), jump_forward)
