"""What the scheduler calls for structured output.

Per request, a :class:`GrammarState` (created at validation, ``new_state``): only a size check
runs there (over ``grammar_max_bytes``: a 400 naming the limit). Parsing and compiling run off
the scheduler thread (``compile_pool``): a trial in a worker process that is killed past
``grammar_compile_timeout_s``, then the compile in this process. Until the grammar is ready
the request waits in the queue while others run: the scheduler calls ``poll`` each step and
admits the request once its matcher exists, or finishes it with ``failure`` (an invalid
grammar, or one over the time budget: status 400 with a message naming the problem). A
request that leaves (finished, aborted) calls ``release``: the last request waiting for a
compile cancels it.

A grammar may wait for a token (``grammar_after_token_id``: a reasoning parser's end marker):
until the request samples it, its rows are not masked, ``accept`` only watches for it and nothing
is jumped or drafted; from the token after it on, the grammar constrains as any other.

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
   The look-ahead is bounded (``jump_max_tokens``, the request's remaining ``max_new_tokens``,
   ``jump_max_s``): a grammar may force an infinite string (``root ::= "ab" root``, a JSON
   schema that requires itself). A look-ahead that stops at a bound is used as any other run
   (the tokens it found are exact); the request continues, step by step or with the next
   jump. A run as long as the request's remaining tokens is appended like one that ends the
   grammar: it ends the request.
   Multi-token strings the tokenizer can split several ways (``": "`` as ``":`` + `` "`` or
   ``:`` + ``" "`` ...) are never skipped: which split the model picks depends on its logits.
   Tokens match step-by-step decoding exactly; the logits after a jump can differ in the last
   bits where the jumped tokens' KV comes from a prefill kernel instead of a decode kernel
   (bf16 on GPU), as with any change of batch shape.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from serving.grammar.base import GrammarBackend, GrammarError, Matcher
from serving.grammar.compile_job import CompileJob
from serving.grammar.compile_pool import CompilePool
from serving.grammar.deferred import DeferredBackend
from serving.grammar.lru import CompiledGrammarCache
from serving.grammar.registry import grammar_backend_factory
from serving.structs.grammar_spec import grammar_spec
from serving.structs.sampling_params import InvalidRequest

# A forced run that does not end the grammar is appended only from this length on: its tokens
# are prefilled as a chunk in the next step, which turns that step from a decode batch (CUDA
# graphs on GPU, one batched attention on CPU) into a mixed batch that costs more than the few
# decode steps a short run saves (see bench/structured.py).
MIN_JUMP_TOKENS = 8


@dataclass
class GrammarState:
    """A request's grammar: its compile (shared through the cache) and, once that is done, its
    own matcher."""

    kind: str
    text: str
    job: CompileJob
    matcher: Matcher | None = None
    failure: dict[str, Any] | None = None  # the request's finish reason when the compile failed
    released: bool = False
    after: int | None = None  # the token the grammar waits for (None: it constrains now)

    @property
    def ready(self) -> bool:
        return self.matcher is not None

    @property
    def waiting(self) -> bool:
        """The grammar does not constrain yet: its request has not sampled ``after``."""
        return self.after is not None


@dataclass
class GrammarStats:
    masked_steps: int = 0  # steps with at least one constrained row
    masked_rows: int = 0
    fill_s: float = 0.0  # mask fill, on the worker thread (overlaps the forward pass)
    wait_s: float = 0.0  # scheduler blocked joining the worker after the forward pass
    apply_s: float = 0.0  # masks applied to logits
    jump_s: float = 0.0  # jump-forward checks
    jumped_tokens: int = 0  # tokens appended without their own forward pass
    jumps: int = 0  # runs appended
    looked_ahead: int = 0  # tokens the look-aheads accepted (then rolled back)
    jump_capped: int = 0  # look-aheads stopped by grammar_jump_forward_max_tokens / _max_ms


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
                 off_reason: str = "", cache_capacity: int = 256, compile_timeout_s: float = 10.0,
                 max_grammar_bytes: int = 32768, compile_workers: int = 2, max_pending_compiles: int = 128,
                 compile_max_memory_mb: int = 1024, jump_max_tokens: int = 256, jump_max_ms: float = 20.0) -> None:
        if jump_max_tokens <= 0 or not jump_max_ms > 0:
            raise ValueError("jump_max_tokens and jump_max_ms must be positive")
        self.backend = backend
        self.enable_jump_forward = jump_forward
        self.min_jump_tokens = MIN_JUMP_TOKENS
        self.jump_max_tokens = jump_max_tokens
        self.jump_max_s = jump_max_ms / 1000
        self.off_reason = off_reason
        self.max_grammar_bytes = max_grammar_bytes
        self.cache = CompiledGrammarCache(cache_capacity)
        self.stats = GrammarStats()
        self.compiles = CompilePool(backend, compile_workers, compile_timeout_s, max_pending_compiles,
                                    compile_max_memory_mb) if backend is not None else None
        self._fill_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self._mask: torch.Tensor | None = None  # the masks' buffer, allocated with the first constrained step
        self._job: MaskJob | None = None

    @property
    def enabled(self) -> bool:
        return self.backend is not None

    # -- requests --------------------------------------------------------------------------
    def new_state(self, params: Any) -> GrammarState | None:
        """The state for a request's SamplingParams (None: unconstrained). Checks the size
        (InvalidRequest naming the limit) and starts the compile unless cached; raises
        OverflowError (a 429) when too many grammars are waiting to compile."""
        spec = grammar_spec(params)
        if spec is None:
            return None
        if self.backend is None or self.compiles is None:
            raise InvalidRequest(f"{spec[0]}: structured output is not available ({self.off_reason})")
        kind, text = spec
        nbytes = len(text.encode("utf-8", "surrogatepass"))  # bounded by the request's body limit
        if nbytes > self.max_grammar_bytes:
            raise InvalidRequest(f"the {kind} is {nbytes} bytes, over the limit of {self.max_grammar_bytes} "
                                 f"bytes (grammar_max_bytes)")
        compiles = self.compiles
        job = self.cache.get_or_start(spec, lambda: compiles.submit(kind, text))
        assert isinstance(job, CompileJob)
        job.waiters += 1
        return GrammarState(kind, text, job, after=getattr(params, "grammar_after_token_id", None))

    def poll(self, st: GrammarState) -> bool:
        """True once ``st`` is settled: ready (its matcher made), or failed (``st.failure``)."""
        if st.matcher is not None or st.failure is not None:
            return True
        job = st.job
        if not job.done():
            return False
        assert self.backend is not None
        try:
            compiled = job.result()
        except CancelledError:  # only when nobody waits for it; a request polling it still does
            st.failure = _failure(f"the {st.kind} compile was cancelled", 503)
        except GrammarError as e:
            st.failure = _failure(str(e), 400)
        except Exception as e:
            st.failure = _failure(str(e) or type(e).__name__, getattr(e, "status", 500))
        else:
            st.matcher = self.backend.new_matcher(compiled)
            return True
        self.release(st)
        return True

    def release(self, st: GrammarState) -> None:
        """The request holding ``st`` finished or left: the last one waiting cancels the compile."""
        if st.released or self.compiles is None:
            return
        st.released = True
        if self.compiles.release(st.job):
            self.cache.discard((st.kind, st.text), st.job)

    def shutdown(self) -> None:
        if self.compiles is not None:
            self.compiles.shutdown()
        self._fill_pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def active(reqs: Sequence[Any]) -> bool:
        return any(r.grammar is not None for r in reqs)

    # -- per step --------------------------------------------------------------------------
    def begin_masks(self, reqs: Sequence[Any]) -> MaskJob | None:
        """Start filling the masks of the constrained ``reqs`` (the rows about to be sampled)."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None and not r.grammar.waiting]
        if not rows or self.backend is None:
            return None
        if self._job is not None:  # a step that failed before joining its job
            self._job.future.result()
        if self._mask is None or self._mask.shape[0] < len(reqs):
            grown = 64 if self._mask is None else 2 * self._mask.shape[0]
            self._mask = self.backend.allocate_mask(max(len(reqs), grown))
        self.stats.masked_steps += 1
        self.stats.masked_rows += len(rows)
        states = [reqs[i].grammar for i in rows]
        self._job = MaskJob(self, self._fill_pool.submit(self._fill, states, rows))
        return self._job

    def _fill(self, states: list[GrammarState], rows: list[int]) -> list[int]:
        t0 = time.perf_counter()
        assert self.backend is not None and self._mask is not None
        matchers = [st.matcher for st in states]  # the scheduler admits a request once it has its matcher
        assert all(m is not None for m in matchers)
        self.backend.fill_masks(matchers, self._mask, rows)  # type: ignore[arg-type]
        self.stats.fill_s += time.perf_counter() - t0
        return rows

    def accept(self, r: Any, tok: int) -> dict[str, Any] | None:
        """Advance ``r``'s matcher by ``tok``; a finish reason when the request must end."""
        st: GrammarState = r.grammar
        if st.waiting:
            if tok == st.after:
                st.after = None  # the grammar constrains from the next token on
            return None
        if self._job is not None and not self._job.future.done():
            self._job.future.result()
        m = st.matcher
        assert m is not None
        if not m.accept_token(tok):
            return {"type": "abort", "message": f"token {tok} does not match the {st.kind}"}
        if m.is_terminated():
            return {"type": "stop", "matched": tok}
        return None

    def jump_forward(self, r: Any, append: Callable[[Any, int], None]) -> None:
        """Append the tokens the grammar forces after ``r``'s last token (see the module doc):
        a forced run that ends the grammar or the request always (no pass needed), a run that
        does not only when it has ``min_jump_tokens`` tokens or more. The look-ahead stops at
        ``jump_max_tokens``, at the request's remaining tokens and after ``jump_max_s``."""
        st: GrammarState | None = r.grammar
        if not self.enable_jump_forward or st is None or st.matcher is None or st.waiting or r.finished:
            return
        assert self.backend is not None
        t0 = time.perf_counter()
        m = st.matcher
        left = r.sampling.max_new_tokens - len(r.output_ids)
        limit = min(self.jump_max_tokens, left)
        forced: list[int] = []  # look ahead on the matcher, then roll back
        capped = False
        while len(forced) < limit:
            tok = self.backend.forced_token(m)
            if tok is None or not m.accept_token(tok):
                break
            forced.append(tok)
            if m.is_terminated():
                break
            if time.perf_counter() - t0 > self.jump_max_s:
                capped = True
                break
        capped = capped or (len(forced) == self.jump_max_tokens < left and not m.is_terminated())
        ends = bool(forced) and (m.is_terminated() or len(forced) >= left)
        if forced:
            m.rollback(len(forced))
        self.stats.looked_ahead += len(forced)
        self.stats.jump_capped += capped
        if forced and (ends or len(forced) >= self.min_jump_tokens):
            self.stats.jumps += 1
            for tok in forced:
                if r.finished:
                    break
                append(r, tok)  # stop checks and accept(), exactly as for a sampled token
                self.stats.jumped_tokens += 1
        self.stats.jump_s += time.perf_counter() - t0


def _failure(message: str, status: int) -> dict[str, Any]:
    """The finish reason of a request whose grammar could not be used: the engine process
    answers it with an error of ``status`` (see serving.engine.requests)."""
    return {"type": "abort", "message": message, "status": status}


def make_grammar_runner(config: Any, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> GrammarRunner:
    """The engine's runner for a SchedulerConfig; a disabled one (requests with a grammar get a
    400) when the backend is ``none`` or the model has no tokenizer."""
    if config.grammar_backend == "none":
        return GrammarRunner(None, off_reason="the server runs with --grammar-backend none")
    if tokenizer is None:
        return GrammarRunner(None, off_reason="this model has no tokenizer")
    factory = grammar_backend_factory(config.grammar_backend)  # an unknown name fails now, not at the first grammar
    hf = getattr(tokenizer, "hf_full", lambda: tokenizer)  # the HF tokenizer, built with the backend
    backend = DeferredBackend(config.grammar_backend, vocab_size, lambda: factory(hf(), vocab_size, stop_ids))
    return GrammarRunner(
        backend, config.jump_forward,
        compile_timeout_s=config.grammar_compile_timeout_s, max_grammar_bytes=config.grammar_max_bytes,
        compile_workers=config.grammar_compile_workers, max_pending_compiles=config.grammar_max_pending_compiles,
        compile_max_memory_mb=config.grammar_compile_max_memory_mb,
        jump_max_tokens=config.grammar_jump_forward_max_tokens, jump_max_ms=config.grammar_jump_forward_max_ms)
