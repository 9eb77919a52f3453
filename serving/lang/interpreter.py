"""The interpreter: one worker thread per program state runs its expressions in order.

``s += gen("x")`` only queues the expression and returns; the worker sends the backend call,
appends the result to the text and sets ``x``. Reading ``s["x"]`` waits for that variable
alone, so a program runs ahead of its calls and forks (each with its own worker) run in
parallel. A failed call stores a :class:`LangError` naming it; later expressions of that state
are skipped and every read raises it.

Concurrency contract: ``submit``, ``get_var``, ``sync`` and the readers (``text``, ``messages``,
``text_iter``) may be called from any thread; the fields below are written by the worker only,
under ``cond`` (readers take it too); the backend is called from the worker only, outside the
lock. ``session_id`` is opened lazily by the worker (the second call of a long program) and
closed by ``end()``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

from serving.lang import choices as cm
from serving.lang import ir
from serving.lang.errors import BackendError, LangError

SESSION_AFTER_CALLS = 1  # a program that makes more calls than this keeps its KV in a session
_STOP = object()


class StreamExecutor:
    """One program state's interpreter. Concurrency contract: ``submit``, ``get_var``, ``sync``,
    ``end`` and the readers may be called from any thread; only the worker thread runs
    expressions, calls the backend (outside ``cond``) and writes ``text``, ``messages``,
    ``variables``, ``meta_info`` and ``error`` (under ``cond``, which readers take too); a
    variable's event is set once its call has finished or failed."""

    def __init__(self, backend: Any, defaults: dict[str, Any], program: str = "", stream: bool = False,
                 use_session: bool = True, gate: Any = None) -> None:
        self.backend = backend
        self.template = backend.chat_template
        self.defaults = {**ir.DEFAULT_SAMPLING, **defaults}
        self.program = program
        self.stream = stream
        self.use_session = use_session
        self.gate = gate  # run_batch's serving.lang.batch.PrefixGate (None: not in a batch)
        self.text = ""
        self.messages: list[dict[str, str]] = []
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.role: str | None = None
        self.role_start = 0
        self.calls = 0
        self.session_id: str | None = None
        self.error: LangError | None = None
        self.cond = threading.Condition()
        self._events: dict[str, threading.Event] = {}
        self._pieces: dict[str, list[str]] = {}  # a streamed variable's deltas, as the backend sent them
        self._queue: queue.Queue[Any] = queue.Queue()
        self._closed = False
        self.children: list[StreamExecutor] = []  # forks: ended with this state
        self._thread = threading.Thread(target=self._loop, name=f"sgl-{program}", daemon=True)
        self._thread.start()

    # -- any thread ---------------------------------------------------------------------------
    def submit(self, expr: Any) -> None:
        expr = ir.to_expr(expr)
        for e in _flatten(expr):
            if isinstance(e, (ir.Gen, ir.Select)) and e.name is not None:
                with self.cond:
                    self._events[e.name] = threading.Event()
            self._queue.put(e)

    def wait_idle(self) -> None:
        """Block until every submitted expression has run (or failed)."""
        self._queue.join()

    def sync(self) -> None:
        self.wait_idle()
        if self.error is not None:
            raise self.error

    def get_var(self, name: str) -> Any:
        with self.cond:
            ev = self._events.get(name)
        if ev is None:
            self.sync()
        else:
            ev.wait()
        if self.error is not None and name not in self.variables:
            raise self.error
        if name not in self.variables:
            raise KeyError(f"program {self.program!r} has no variable {name!r}")
        return self.variables[name]

    def end(self) -> None:
        """After the program: wait for its calls, close its session, stop the worker."""
        try:
            self.wait_idle()
            for child in self.children:
                child.end()
        finally:
            if not self._closed:
                self._closed = True
                self._queue.put(_STOP)
                if self.session_id is not None:
                    try:
                        self.backend.close_session(self.session_id)
                    except BackendError:
                        pass  # the server is gone or closed it (idle expiry): nothing to release

    def done(self) -> bool:
        return self._queue.unfinished_tasks == 0

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """New text as it is produced until the state is done. With ``var_name``: that variable's
        deltas one by one as the backend streamed them (a reader that comes late still sees each
        one); without: the state's text, whatever was added since the last piece."""
        pos = 0
        while True:
            with self.cond:
                while True:
                    new, finished = self._stream_view(var_name, pos)
                    if new or finished:
                        break
                    self.cond.wait(0.5)
            yield from new
            pos += sum(map(len, new)) if var_name is None else len(new)
            if finished:
                if self.error is not None:
                    raise self.error
                return

    def _stream_view(self, var_name: str | None, pos: int) -> tuple[list[str], bool]:
        """(the pieces after ``pos``, finished), under ``cond``."""
        if var_name is None:
            finished = self.done() or self.error is not None
            return ([self.text[pos:]] if len(self.text) > pos else []), finished
        ev = self._events.get(var_name)
        finished = (ev.is_set() if ev is not None else self.done()) or self.error is not None
        pieces = self._pieces.get(var_name)
        if pieces is None:  # not streamed (a select, or a gen that has not started): its value once done
            value = self.variables.get(var_name, "") if finished else ""
            pieces = [value if isinstance(value, str) else str(value)] if value != "" else []
        return pieces[pos:], finished

    def fork_copy(self, stream: bool) -> StreamExecutor:
        child = StreamExecutor(self.backend, self.defaults, self.program, stream, use_session=False)
        with self.cond:
            child.text, child.messages = self.text, list(self.messages)
            child.variables, child.meta_info = dict(self.variables), dict(self.meta_info)
            child.role, child.role_start = self.role, self.role_start
            child.template = self.template
        return child

    # -- the worker ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            expr = self._queue.get()
            try:
                if expr is _STOP:
                    return
                if self.error is None:
                    self._run(expr)
            except BackendError as e:
                self._fail(expr, str(e), e.status)
            except (ValueError, TypeError, KeyError) as e:
                self._fail(expr, str(e), None)
            except Exception as e:  # noqa: BLE001 - a program's failure is reported, never lost
                self._fail(expr, f"{type(e).__name__}: {e}", None)
            finally:
                if isinstance(expr, (ir.Gen, ir.Select)) and expr.name in self._events:
                    self._events[expr.name].set()
                with self.cond:
                    self.cond.notify_all()
                self._queue.task_done()

    def _fail(self, expr: Any, message: str, status: int | None) -> None:
        with self.cond:
            self.error = LangError(expr.label(), self.program, message, status)
            for ev in self._events.values():
                ev.set()

    def _append(self, s: str) -> None:
        with self.cond:
            self.text += s
            self.cond.notify_all()

    def _run(self, e: Any) -> None:
        if isinstance(e, ir.Text):
            self._append(e.value)
        elif isinstance(e, ir.RoleBegin):
            if e.role not in self.template.prefix:
                raise ValueError(f"unknown role {e.role!r}")
            if e.role != "system" and not self.messages and self.role is None and not self.text:
                self._append(self.template.default_system)
            self._append(self.template.begin(e.role))
            self.role, self.role_start = e.role, len(self.text)
        elif isinstance(e, ir.RoleEnd):
            if self.role != e.role:
                raise ValueError(f"{e.role}_end() without {e.role}_begin()")
            with self.cond:
                self.messages.append({"role": e.role, "content": self.text[self.role_start:]})
            self._append(self.template.end(e.role))
            self.role = None
        elif isinstance(e, ir.Gen):
            self._gen(e)
        elif isinstance(e, ir.Select):
            self._select(e)
        else:
            raise TypeError(f"cannot run {e!r}")

    def _before_call(self) -> None:
        self.calls += 1
        if self.gate is not None and self.calls == 1:
            lead = self.gate.enter(self.text)
            try:
                if lead is not None:  # the first of its group: its text goes into the tree first
                    self.backend.cache_prefix(self)
            finally:
                self.gate.release(lead)
        if self.use_session and self.session_id is None and self.calls > SESSION_AFTER_CALLS:
            self.session_id = self.backend.open_session()

    def _gen(self, e: ir.Gen) -> None:
        params = {**self.defaults, **{k: v for k, v in e.params.items() if v is not None}}
        if e.dtype is int and "regex" not in params:
            params["regex"] = r"-?\d+"
        self._before_call()
        start = len(self.text)
        if self.stream:
            meta: dict[str, Any] = {}
            if e.name is not None:
                with self.cond:
                    self._pieces[e.name] = []
            for delta, m in self.backend.generate_stream(self, params, e):
                with self.cond:
                    self.text += delta
                    if e.name is not None and delta:
                        self._pieces[e.name].append(delta)
                        self.variables[e.name] = self.text[start:]
                    self.cond.notify_all()
                meta = m or meta
            value = self.text[start:]
        else:
            value, meta = self.backend.generate(self, params, e)
            self._append(value)
        if e.name is not None:
            out: Any = value
            if e.dtype is not None and e.dtype is not str:
                out = e.dtype(value.strip())
            with self.cond:
                self.variables[e.name], self.meta_info[e.name] = out, meta

    def _select(self, e: ir.Select) -> None:
        if not e.choices or not all(isinstance(c, str) and c for c in e.choices):
            raise ValueError("choices must be a non-empty list of non-empty strings")
        method = cm.resolve(e.choices_method)
        self._before_call()
        lps = self.backend.choice_logprobs(self, e.choices, method.needs_unconditional)
        best, scores = method.pick(lps)
        self._append(e.choices[best])
        meta = {"choices": list(e.choices), "scores": scores, "choices_method": method.name,
                "input_token_logprobs": [c.cond for c in lps],
                "unconditional_token_logprobs": [c.uncond for c in lps] if method.needs_unconditional else None}
        if e.name is not None:
            with self.cond:
                self.variables[e.name], self.meta_info[e.name] = e.choices[best], meta


def _flatten(e: ir.Expr) -> list[ir.Expr]:
    if isinstance(e, ir.ExprList):
        return [x for item in e.items for x in _flatten(item)]
    return [e]
