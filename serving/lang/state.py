"""The program state ``s``: ``s += ...``, ``s["name"]``, ``s.fork(n)``, ``s.text()``, ``s.messages()``.

A thin handle over its :class:`serving.lang.interpreter.StreamExecutor`. Forks: the parent's
queued calls finish first, then (with ``n > 1``) its text is sent once as a prefill-only
request so the radix tree holds the shared prefix before the branches arrive; each fork is a
new state with a copy of the parent's text, messages and variables and its own worker, so
the branches run in parallel. ``join()`` waits for them and (SGLang's default mode,
``gather_variable``) gives the parent each new variable as a list over the forks;
``concate_and_append`` appends their new text to the parent instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from serving.lang.errors import BackendError, LangError
from serving.lang.interpreter import StreamExecutor


class ProgramState:
    def __init__(self, executor: StreamExecutor) -> None:
        self.stream_executor = executor

    def __iadd__(self, other: Any) -> ProgramState:
        self.stream_executor.submit(other)
        return self

    def __getitem__(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.sync()
        with self.stream_executor.cond:
            self.stream_executor.variables[name] = value

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self.stream_executor.variables

    def get_var(self, name: str) -> Any:
        return self[name]

    def get_meta_info(self, name: str) -> Any:
        self.stream_executor.get_var(name)
        return self.stream_executor.meta_info.get(name)

    def sync(self) -> ProgramState:
        self.stream_executor.sync()
        return self

    def text(self) -> str:
        self.sync()
        return self.stream_executor.text

    def messages(self) -> list[dict[str, str]]:
        self.sync()
        return list(self.stream_executor.messages)

    def error(self) -> Exception | None:
        self.stream_executor.wait_idle()
        return self.stream_executor.error

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        return self.stream_executor.text_iter(var_name)

    def variables(self) -> dict[str, Any]:
        self.sync()
        return dict(self.stream_executor.variables)

    def fork(self, size: int = 1) -> ProgramStateGroup:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError("fork(n) needs an integer n >= 1")
        ex = self.stream_executor
        ex.sync()
        if size > 1:
            lead = None
            try:
                if ex.gate is not None and ex.calls == 0:  # a batch program's first call (serving.lang.batch)
                    ex.calls = 1
                    lead = ex.gate.enter(ex.text)
                ex.backend.cache_prefix(ex)
            except BackendError as e:
                raise LangError(f"fork({size})", ex.program, str(e), e.status) from None
            finally:
                if ex.gate is not None:
                    ex.gate.release(lead)
        forks = [ProgramState(ex.fork_copy(ex.stream)) for _ in range(size)]
        ex.children += [f.stream_executor for f in forks]
        return ProgramStateGroup(forks, self)

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    """The forks of a state: index or iterate them, ``+=`` appends to every fork, ``join()``."""

    def __init__(self, states: list[ProgramState], parent: ProgramState) -> None:
        self.states = states
        self.parent = parent
        self._before = set(parent.stream_executor.variables)
        self._text_at_fork = len(parent.stream_executor.text)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        if isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} expressions for {len(self.states)} forks")
            for s, x in zip(self.states, other, strict=True):
                s += x
        else:
            for s in self.states:
                s += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        for s in self.states:
            s.stream_executor.end()
        errors = [s.stream_executor.error for s in self.states if s.stream_executor.error is not None]
        if errors:
            raise errors[0]
        ex = self.parent.stream_executor
        if mode == "gather_variable":
            names = [n for n in self.states[0].stream_executor.variables if n not in self._before]
            with ex.cond:
                for n in names:
                    ex.variables[n] = [s.stream_executor.variables.get(n) for s in self.states]
                    ex.meta_info[n] = [s.stream_executor.meta_info.get(n) for s in self.states]
        elif mode == "concate_and_append":
            self.parent += "".join(s.stream_executor.text[self._text_at_fork:] for s in self.states)
        else:
            raise ValueError(f"unknown join mode {mode!r}: gather_variable or concate_and_append")
