"""The future of one grammar compile and the errors it may end with (serving/grammar/compile_pool.py
runs the compiles).

A :class:`CompileJob` is shared by every request that waits for the same grammar (the runner's
cache dedupes them). Its ``phase`` and ``cancel_requested`` are read and written under the
pool's condition (``CompilePool._cv``); its result is set once, by whichever thread settles it
(a ``Future``: its own lock).
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future

from serving.grammar.base import GrammarError


class GrammarTimeout(GrammarError):
    """A grammar that did not compile within the time budget. Kept in the compiled-grammar
    cache (``cached``), so the same grammar sent again fails at once instead of costing
    another budget of a worker's time."""

    cached = True


class GrammarMemoryLimit(GrammarError):
    """A grammar whose compile needed more than the memory budget; cached like a timeout."""

    cached = True


class CompileUnavailable(RuntimeError):
    """No worker could compile (it could not start, or the engine is shutting down): a 503."""

    status = 503


class CompileJob(Future):
    """The compile of one grammar ``(kind, text)``; its result is the compiled grammar."""

    _ids = itertools.count()

    def __init__(self, key: tuple[str, str]) -> None:
        super().__init__()
        self.key = key
        self.id = next(self._ids)
        self.waiters = 0  # requests waiting for it (scheduler thread only)
        self.phase = "queued"  # queued -> trial -> compiling -> done
        self.cancel_requested = False  # every waiter left during the trial: the slot kills it
        self.started = 0.0  # when the trial began (monotonic)
        self.trial_s: float | None = None  # how long the trial compile took
