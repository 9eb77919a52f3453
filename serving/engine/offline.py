"""Offline engine, shaped like ``sgl.Engine``: ``Engine(model_path=...).generate(...)``."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from hicache.config import CacheConfig
from serving.config import EngineConfig, ModelConfig, SchedulerConfig
from serving.engine.core import EngineCore
from serving.engine.offline_stream import StreamState
from serving.runner.logprob_meta import sglang_meta
from serving.runner.logprobs import LogprobState
from serving.structs.logprob_options import LogprobOptions
from serving.structs.request import Req
from serving.structs.sampling_params import InvalidRequest

IDLE_WAIT_S = 0.0005  # a step that ran nothing sleeps this long (a spinning loop starves the I/O threads)
_SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}


def _per_prompt(value: Any, n: int, name: str, is_list: Any) -> list[Any]:
    if is_list(value):
        if len(value) != n:
            raise InvalidRequest(f"{name}: the list must have one value per prompt ({n})")
        return list(value)
    return [value] * n


def _logprob_options(n: int, ret: Any, start: Any, top: Any, ids: Any) -> list[LogprobOptions | None]:
    """One LogprobOptions per prompt (None: that prompt asked for none), as sgl.Engine takes them."""
    rets = _per_prompt(ret, n, "return_logprob", lambda v: isinstance(v, list))
    starts = _per_prompt(start, n, "logprob_start_len", lambda v: isinstance(v, list))
    tops = _per_prompt(top, n, "top_logprobs_num", lambda v: isinstance(v, list))
    idss = _per_prompt(ids, n, "token_ids_logprob", lambda v: isinstance(v, list) and v and isinstance(v[0], list))
    out: list[LogprobOptions | None] = []
    for r, s, t, i in zip(rets, starts, tops, idss, strict=True):
        if not r:
            out.append(None)
            continue
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t < 0):
            raise InvalidRequest("top_logprobs_num must be a non-negative integer")
        out.append(LogprobOptions(start_len=s, top=t or 0, token_ids=tuple(i) if i is not None else None))
    return out


def config_from_kwargs(**kwargs: Any) -> EngineConfig:
    """Spread flat SGLang-style keyword arguments over the component configs."""
    parts: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    for key, value in kwargs.items():
        for name, cls in _SECTIONS.items():
            if key in {f.name for f in dataclasses.fields(cls)}:
                parts[name][key] = value
                break
        else:
            raise TypeError(f"unknown engine argument {key!r}")
    return EngineConfig(**{name: _SECTIONS[name](**vals) for name, vals in parts.items()})


def output_dict(core: EngineCore, r: Req) -> dict[str, Any]:
    text = ""
    if core.tokenizer is not None:
        text = core.tokenizer.decode(r.output_ids, r.sampling.skip_special_tokens)
        reason = r.finish_reason or {}
        if reason.get("type") == "stop" and isinstance(reason.get("matched"), str):
            cut = text.find(reason["matched"])
            if cut >= 0:
                text = text[:cut]
    return {
        "text": text,
        "output_ids": list(r.output_ids),
        "meta_info": {
            "id": r.rid,
            "prompt_tokens": len(r.input_ids),
            "completion_tokens": len(r.output_ids),
            "cached_tokens": r.kv.cached_tokens,
            "cached_tokens_details": dict(r.kv.cached_by_tier),
            "finish_reason": r.finish_reason,
            **({"l3_decision": r.kv.l3_decision} if r.kv.l3_decision else {}),
            **(r.spec.meta() if r.spec is not None else {}),  # speculative decoding (SGLang's spec_* fields)
        },
    }


class Engine:
    """Runs the scheduler in the caller's thread; ``generate`` blocks until done (``stream=True``:
    steps as its iterator is read), ``async_generate`` steps in the event loop's thread.

    Concurrency contract: one thread uses an Engine (its core is not thread-safe); concurrent
    ``async_generate`` calls are fine, as coroutines of one event loop.
    """

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        if config is not None and kwargs:
            raise TypeError("give either config or keyword arguments, not both")
        self.config = config or config_from_kwargs(**kwargs)
        self.core = EngineCore(self.config, exit_on_rank_death=False)  # the caller's process: raise

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        session_id: str | None = None,
        cache_salt: str | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        token_ids_logprob: list[int] | list[list[int]] | None = None,
        stream: bool = False,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """``cache_salt`` (vLLM's name): requests with the same salt share cached prefixes,
        requests with different salts (or none) share nothing (hicache.salt). The logprob
        arguments are ``sgl.Engine.generate``'s (a value, or a list with one per prompt); the
        answers carry them in ``meta_info`` as /generate does (serving/runner/logprob_meta.py).
        ``stream=True`` (one prompt): an iterator of incremental chunks (serving/engine/offline_stream.py)
        whose ``text`` and ``output_ids`` concatenate to the non-streamed answer's; the scheduler steps
        as the iterator is read."""
        job = self._submit(prompt, sampling_params, input_ids, session_id, cache_salt, return_logprob,
                           logprob_start_len, top_logprobs_num, token_ids_logprob, stream)
        if stream:
            return self._stream(job)
        reqs = job[0]
        while not all(r.finished for r in reqs):
            self._step()
        return self._answers(job)

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """``generate`` for asyncio, as ``sgl.Engine.async_generate``: awaited, the answer; with
        ``stream=True`` an async iterator of the same chunks as ``generate``'s stream. Concurrent
        calls share the scheduler's batches: each waiting call steps the one engine in turn, in the
        event loop's thread (a step runs the model there: the loop waits for it), yielding to the
        others between steps."""
        job = self._submit(prompt, sampling_params, input_ids, kwargs.pop("session_id", None),
                           kwargs.pop("cache_salt", None), kwargs.pop("return_logprob", False),
                           kwargs.pop("logprob_start_len", None), kwargs.pop("top_logprobs_num", None),
                           kwargs.pop("token_ids_logprob", None), stream)
        if kwargs:
            raise TypeError(f"unknown argument(s) {sorted(kwargs)}")
        if stream:
            return self._astream(job)
        reqs = job[0]
        while not all(r.finished for r in reqs):
            self._step()
            await asyncio.sleep(0)  # the other calls' turn
        return self._answers(job)

    # -- the parts of generate ------------------------------------------------------------------
    def _submit(self, prompt: Any, sampling_params: Any, input_ids: Any, session_id: str | None,
                cache_salt: str | None, return_logprob: Any, logprob_start_len: Any, top_logprobs_num: Any,
                token_ids_logprob: Any, stream: bool) -> tuple[list[Req], list[LogprobOptions | None], bool]:
        """Check and add the requests; (requests, their logprob options, whether one prompt was given)."""
        if (prompt is None) == (input_ids is None):
            raise InvalidRequest("give exactly one of prompt or input_ids")
        single = isinstance(prompt, str) or (input_ids is not None and (not input_ids or isinstance(input_ids[0], int)))
        if stream and not single:
            raise InvalidRequest("stream=True takes one prompt (as sgl.Engine): iterate one stream per prompt")
        if prompt is not None:
            items: list[dict[str, Any]] = [{"text": p} for p in ([prompt] if single else prompt)]
        else:
            items = [{"input_ids": ids} for ids in ([input_ids] if single else input_ids)]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(items)
        if len(params) != len(items):
            raise InvalidRequest("sampling_params list must match the number of prompts")
        if session_id is not None and session_id not in self.core.sessions:
            self.core.open_session(session_id)
        reqs = [self.core.make_request(**it, sampling_params=p, session_id=session_id, cache_salt=cache_salt)
                for it, p in zip(items, params, strict=True)]
        lp_opts = _logprob_options(len(reqs), return_logprob, logprob_start_len, top_logprobs_num, token_ids_logprob)
        for r, opts in zip(reqs, lp_opts, strict=True):
            if opts is not None:
                r.logprob = LogprobState.from_request(opts, r.input_ids, self.core.runner.arch.vocab_size)
        for r in reqs:
            self.core.add(r)
        return reqs, lp_opts, single

    def _step(self) -> None:
        before = self.core.scheduler.stats.forward_passes
        self.core.step()
        if self.core.scheduler.stats.forward_passes == before:
            time.sleep(IDLE_WAIT_S)  # waiting for a copy or the store: leave them the GIL

    def _answers(self, job: tuple[list[Req], list[LogprobOptions | None], bool]) -> Any:
        reqs, lp_opts, single = job
        outs = [output_dict(self.core, r) for r in reqs]
        for out, r, opts in zip(outs, reqs, lp_opts, strict=True):
            if opts is not None:
                lp = r.logprob.take_new(r.output_ids) or {}
                out["meta_info"].update(sglang_meta(lp, opts, self.core.tokenizer, with_text=True))
        return outs[0] if single else outs

    def _next_chunk(self, state: StreamState, opts: LogprobOptions | None) -> dict[str, Any] | None:
        tok = self.core.tokenizer
        decode = None if tok is None else (lambda ids: tok.decode(ids, state.req.sampling.skip_special_tokens))
        out = output_dict(self.core, state.req)
        chunk = state.chunk(out, decode)
        if chunk is not None and opts is not None:  # this chunk's logprobs: those of its new tokens
            lp = state.req.logprob.take_new(state.req.output_ids) or {}
            chunk["meta_info"].update(sglang_meta(lp, opts, tok, with_text=True))
        return chunk

    def _turns(self, job: tuple[list[Req], list[LogprobOptions | None], bool]) -> Iterator[dict[str, Any] | None]:
        """A stream's turns: each its new chunk (None when nothing is new), an engine step between
        turns; it ends after the request's final chunk."""
        (req,), (opts,), _ = job
        state = StreamState(req)
        while True:
            done = req.finished
            yield self._next_chunk(state, opts)
            if done:
                return
            self._step()

    def _stream(self, job: tuple[list[Req], list[LogprobOptions | None], bool]) -> Iterator[dict[str, Any]]:
        yield from (chunk for chunk in self._turns(job) if chunk is not None)

    async def _astream(self, job: tuple[list[Req], list[LogprobOptions | None], bool]) -> AsyncIterator[dict[str, Any]]:
        for chunk in self._turns(job):
            if chunk is not None:
                yield chunk
            await asyncio.sleep(0)  # other coroutines (concurrent async_generate calls) run between steps

    def open_session(self, session_id: str | None = None) -> str:
        return self.core.open_session(session_id)

    def close_session(self, session_id: str) -> None:
        self.core.close_session(session_id)

    def flush_cache(self, clear_storage: bool = False) -> bool:
        """Drop the cached prefixes (False while requests run); ``clear_storage``: L3's pages too."""
        return self.core.flush_cache(clear_storage=clear_storage)

    def check_integrity(self) -> None:
        self.core.check_integrity()

    def shutdown(self) -> None:
        """Stop the engine and give its memory back (GPU memory, pinned host memory): another
        Engine in this process then gets the same KV capacity."""
        core, self.core = self.core, None  # type: ignore[assignment]
        if core is not None:
            try:
                core.shutdown()
            finally:
                core.release()
