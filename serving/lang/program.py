"""``@function``: an LLM program, with ``.run(**kwargs)`` and ``.run_batch([...])``.

``run`` calls the decorated function with a fresh state in the caller's thread; the function
queues expressions and returns at once unless it reads a variable; ``run`` then waits for the
state's calls (unless ``stream=True``) and raises the first failure as a
:class:`serving.lang.errors.LangError` naming the call. Sampling keywords given to ``run``
(``max_new_tokens``, ``temperature``, ...) are the defaults of its ``gen`` calls.

``run_batch`` runs the programs on ``num_threads`` threads and orders their first calls so
that shared prefixes are computed once (serving.lang.batch: the first program of each group of
programs sharing a prefix prefills it, the others of the group wait for that prefill only, then
all send together and batch in the server). It returns the states in input order; a program whose call failed has its
error in ``state.error()`` and raises it on access (a program body that raised, e.g. by reading
a failed variable, makes ``run_batch`` raise it).
"""

from __future__ import annotations

import concurrent.futures as cf
import inspect
from collections.abc import Callable
from typing import Any

from serving.lang.batch import PrefixGate
from serving.lang.interpreter import StreamExecutor
from serving.lang.state import ProgramState

_default_backend: list[Any] = [None]


def set_default_backend(backend: Any) -> None:
    _default_backend[0] = backend


def get_default_backend() -> Any:
    return _default_backend[0]


class SglFunction:
    def __init__(self, func: Callable[..., Any], num_api_spec_tokens: int | None = None) -> None:
        self.func = func
        self.name = getattr(func, "__name__", "program")
        params = list(inspect.signature(func).parameters)
        if not params:
            raise TypeError(f"@function {self.name}: the first argument must be the state (s)")
        self.arg_names = params[1:]

    def _start(self, args: tuple, kwargs: dict[str, Any], backend: Any, stream: bool, sampling: dict[str, Any],
               use_session: bool = True, gate: PrefixGate | None = None) -> ProgramState:
        backend = backend or get_default_backend()
        if backend is None:
            raise RuntimeError("no backend: call sgl.set_default_backend(sgl.RuntimeEndpoint(url)) or pass backend=")
        ex = StreamExecutor(backend, _sampling(sampling), self.name, stream, use_session, gate)
        state = ProgramState(ex)
        try:
            ret = self.func(state, *args, **kwargs)
        except BaseException:
            ex.end()
            raise
        if isinstance(ret, ProgramState) and ret is not state:
            raise TypeError(f"@function {self.name} returned another program's state")
        return state

    def run(self, *args: Any, backend: Any = None, stream: bool = False, **kwargs: Any) -> ProgramState:
        sampling = {k: kwargs.pop(k) for k in list(kwargs) if k in _RUN_SAMPLING}
        state = self._start(args, kwargs, backend, stream, sampling)
        if stream:
            import threading

            threading.Thread(target=state.stream_executor.end, daemon=True).start()
            return state
        state.stream_executor.end()
        if state.stream_executor.error is not None:
            raise state.stream_executor.error
        return state

    __call__ = run

    def run_batch(self, batch_kwargs: list[dict[str, Any]], *, backend: Any = None, num_threads: int | str = "auto",
                  progress_bar: bool = False, **sampling: Any) -> list[ProgramState]:
        if not isinstance(batch_kwargs, list) or not all(isinstance(b, dict) for b in batch_kwargs):
            raise TypeError("run_batch takes a list of keyword-argument dicts")
        unknown = set(sampling) - set(_RUN_SAMPLING)
        if unknown:
            raise TypeError(f"run_batch: unknown argument(s) {', '.join(sorted(unknown))}")
        if not batch_kwargs:
            return []
        threads = min(len(batch_kwargs), 64) if num_threads == "auto" else int(num_threads)
        bar = _progress(len(batch_kwargs)) if progress_bar else None
        states: list[ProgramState | None] = [None] * len(batch_kwargs)

        gate = PrefixGate()

        def one(i: int) -> None:
            try:
                states[i] = self._start((), batch_kwargs[i], backend, False, sampling, gate=gate)
                states[i].stream_executor.end()
            finally:
                if bar is not None:
                    bar.update(1)

        try:
            with cf.ThreadPoolExecutor(max(1, threads)) as pool:
                for f in [pool.submit(one, i) for i in range(len(batch_kwargs))]:
                    f.result()
        finally:
            if bar is not None:
                bar.close()
        return [s for s in states if s is not None]


_RUN_SAMPLING = ("max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
                 "frequency_penalty", "presence_penalty", "repetition_penalty", "ignore_eos", "seed")


def _sampling(kw: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kw.items() if v is not None}


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total)


def function(func: Callable[..., Any] | None = None, *, num_api_spec_tokens: int | None = None) -> Any:
    """``@function`` or ``@function(...)``: make ``func(s, ...)`` an LLM program."""
    if func is None:
        return lambda f: SglFunction(f, num_api_spec_tokens)
    return SglFunction(func, num_api_spec_tokens)
