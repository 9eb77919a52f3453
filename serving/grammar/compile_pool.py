"""Grammar compiles with a time and a memory budget, run where the scheduler never waits for them.

A new grammar goes through two phases, each off the scheduler thread:

1. **trial**: compiled in a worker process (``compile_worker``), one grammar at a time per
   worker, ``workers`` of them. A trial that runs past ``timeout_s`` is killed with its
   process (the request fails with :class:`GrammarTimeout`, a 400 naming the budget) and the
   worker is restarted; so is a trial whose every waiting request was aborted. A trial that
   crashes the process fails its request. A trial whose worker grows more than
   ``max_memory_mb`` over its idle size (RSS, read every ``POLL_S``; the worker also sets
   itself a hard address-space limit above that, see ``compile_worker``) is killed the same
   way (:class:`GrammarMemoryLimit`, a 400 naming the limit). Nothing that a grammar does
   there can hold a thread, a core or memory of the engine process beyond the budgets.
2. **compile**: a grammar that compiled within the budget is compiled again in this process,
   on a thread (xgrammar releases the GIL), which takes about as long as the trial did. The
   compiled grammar is not shipped from the worker because xgrammar's only serialization is
   JSON, which can be hundreds of times larger than the grammar (see ``compile_worker``).

The scheduler only polls: a request whose grammar is not ready yet stays in the queue while
other requests run. At most ``max_pending`` grammars wait or compile at once; beyond that a
new grammar is refused (OverflowError, a 429) rather than queued behind them.

A :class:`CompileJob` is the future of one grammar, shared by every request that waits for it
(the runner's cache dedupes them); ``release`` is called once per waiting request when it
finishes or is aborted: the last one to leave cancels the job (dequeues it, or kills its trial).
"""

from __future__ import annotations

import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import InvalidStateError, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from serving.grammar.base import GrammarBackend, GrammarError
from serving.grammar.compile_job import CompileJob, CompileUnavailable, GrammarMemoryLimit, GrammarTimeout
from serving.grammar.compile_worker import read_frame, write_frame
from serving.grammar.memory_limits import memory_bytes

log = logging.getLogger(__name__)

POLL_S = 0.02  # how often a trial checks whether its requests were aborted
START_TIMEOUT_S = 300.0  # a worker imports xgrammar (and with it torch): seconds on a busy machine
START_RETRY_S = 5.0  # after a worker failed to start
_ROOT = str(Path(__file__).resolve().parents[2])  # the folder that holds the ``serving`` package


_TIMEOUT, _CANCELLED, _CLOSED, _MEMORY = object(), object(), object(), object()


class CompilePool:
    """Runs grammar compiles within their budgets (see the module docstring).

    Concurrency contract. Threads: the scheduler thread (through ``serving.grammar.runner``)
    calls :meth:`submit`, :meth:`release`, :meth:`stats` and :meth:`shutdown`; one
    ``grammar-trial-<i>`` thread per worker process (a ``_Slot``) takes queued jobs and runs
    their trials; the ``grammar-compile`` threads (``_local``) compile grammars that passed
    their trial. The scheduler thread never waits for a compile: it polls each job's future;
    it blocks only briefly on ``_cv``, and in :meth:`shutdown`, which kills the workers and
    joins their threads (5 s each at most). A slot's thread waits on ``_cv`` for a job, and on
    its worker's pipe (``select``, every ``POLL_S``) during a trial or a start. Three locks:

    - ``_cv`` (a condition) guards the queue, ``_pending``, ``_slots``, ``_closed``, ``counts``
      and each job's ``phase`` / ``cancel_requested`` / ``waiters``; it is notified when a job
      is queued and at shutdown. A job's result is set outside it (the future's own lock).
    - ``_spec_lock`` guards ``_spec``, the workers' start message, built once on the first
      worker start; held while it is built (a tokenizer's vocabulary is serialized), which is
      why it is not ``_cv``: :meth:`submit` and :meth:`release` never wait for that.
    - ``_Slot._lock`` guards the slot's ``proc``, swapped by its thread when it starts a worker
      and by :meth:`_Slot.kill` (its thread, or :meth:`shutdown` on the scheduler thread), so a
      worker is killed exactly once.
    """

    def __init__(self, backend: GrammarBackend, workers: int = 2, timeout_s: float = 10.0,
                 max_pending: int = 128, max_memory_mb: int = 1024) -> None:
        if workers <= 0 or timeout_s <= 0 or max_pending <= 0 or max_memory_mb <= 0:
            raise ValueError("workers, timeout_s, max_pending and max_memory_mb must be positive")
        self.backend = backend
        self.workers = workers
        self.timeout_s = timeout_s
        self.max_pending = max_pending
        self.max_memory_mb = max_memory_mb
        self._cv = threading.Condition()
        self._queue: deque[CompileJob] = deque()
        self._pending: set[CompileJob] = set()
        self._slots: list[_Slot] = []
        self._spec: dict[str, Any] | None = None
        self._spec_lock = threading.Lock()
        self._local = ThreadPoolExecutor(workers, thread_name_prefix="grammar-compile")
        self._closed = False
        self.counts = {"trials": 0, "timeouts": 0, "over_memory": 0, "cancelled": 0, "failed": 0, "crashed": 0,
                       "compiled": 0, "worker_starts": 0}

    # -- the scheduler's side ------------------------------------------------------------
    def submit(self, kind: str, text: str) -> CompileJob:
        """Queue the compile of ``text``; OverflowError when ``max_pending`` are pending."""
        with self._cv:
            if self._closed:
                raise CompileUnavailable("the engine is shutting down")
            if len(self._pending) >= self.max_pending:
                raise OverflowError(f"{len(self._pending)} grammars are waiting to compile, the limit "
                                    f"(grammar_max_pending_compiles); retry later")
            job = CompileJob((kind, text))
            self._pending.add(job)
            self._queue.append(job)
            if not self._slots:  # the workers start with the first grammar
                self._slots = [_Slot(self, i) for i in range(self.workers)]
            self._cv.notify()
        return job

    def release(self, job: CompileJob) -> bool:
        """One request waiting for ``job`` left. True when that cancels the job (then it must
        leave every cache now: it will never have a result)."""
        cancel_now = False
        with self._cv:
            job.waiters -= 1
            if job.waiters > 0 or job.done() or job.cancel_requested:
                return False
            if job.phase == "queued":
                self._queue.remove(job)
                self._pending.discard(job)
                job.phase = "done"
                cancel_now = True
            elif job.phase == "trial":
                job.cancel_requested = True  # its slot kills the worker within POLL_S
            else:  # compiling here: it compiled within the budget in a worker; let it finish (and stay cached)
                return False
            self.counts["cancelled"] += 1
        if cancel_now:
            job.cancel()
        return True

    def stats(self) -> dict[str, int]:
        with self._cv:
            phases = [j.phase for j in self._pending]
            return {"workers": sum(s.proc is not None for s in self._slots), "queued": phases.count("queued"),
                    "in_trial": phases.count("trial"), "compiling": phases.count("compiling"), **self.counts}

    def shutdown(self) -> None:
        with self._cv:
            self._closed = True
            queued = list(self._queue)
            self._queue.clear()
            slots = list(self._slots)
            self._cv.notify_all()
        for job in queued:
            self._settle(job, error=CompileUnavailable("the engine is shutting down"))
        for s in slots:
            s.kill()
        for s in slots:
            s.thread.join(timeout=5)
        self._local.shutdown(wait=False, cancel_futures=True)

    # -- the slots' side -----------------------------------------------------------------
    def _take(self) -> CompileJob | None:
        with self._cv:
            while not self._closed and not self._queue:
                self._cv.wait()
            if self._closed:
                return None
            job = self._queue.popleft()
            job.phase, job.started = "trial", time.monotonic()
            self.counts["trials"] += 1
            return job

    def _settle(self, job: CompileJob, result: Any = None, error: BaseException | None = None,
                cancel: bool = False) -> None:
        with self._cv:
            self._pending.discard(job)
            job.phase = "done"
        try:
            if cancel:
                job.cancel()
            elif error is not None:
                job.set_exception(error)
            else:
                job.set_result(result)
        except InvalidStateError:  # cancelled meanwhile
            pass

    def _trial_passed(self, job: CompileJob, seconds: float) -> None:
        job.trial_s = seconds
        with self._cv:
            if job.cancel_requested:
                cancelled = True
            else:
                cancelled, job.phase = False, "compiling"
        if cancelled:
            self._settle(job, cancel=True)
            return
        try:
            self._local.submit(self._compile_here, job)
        except RuntimeError:  # shut down meanwhile
            self._settle(job, error=CompileUnavailable("the engine is shutting down"))

    def _compile_here(self, job: CompileJob) -> None:
        try:
            compiled = self.backend.compile(self.backend.parse(*job.key))
        except Exception as e:
            self._count("failed")
            err = e if isinstance(e, GrammarError) else GrammarError(f"the {job.key[0]} failed to compile: {e}")
            self._settle(job, error=err)
        else:
            self._count("compiled")
            self._settle(job, result=compiled)

    def _count(self, name: str) -> None:
        with self._cv:
            self.counts[name] += 1

    def worker_spec(self) -> dict[str, Any]:
        with self._spec_lock:  # not under _cv: serializing a tokenizer's vocabulary takes a moment
            if self._spec is None:
                factory, config = self.backend.worker_spec()
                self._spec = {"factory": factory, "config": config}
            return self._spec


class _Slot:
    """One worker process and the thread that feeds it trials and enforces their budget."""

    def __init__(self, pool: CompilePool, index: int) -> None:
        self.pool = pool
        self.proc: subprocess.Popen[bytes] | None = None
        self.idle_rss: int | None = None  # the worker's peak RSS once ready: its trials' memory counts from it
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=f"grammar-trial-{index}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        pool = self.pool
        try:
            while not pool._closed:
                if self.proc is None:
                    try:
                        self._start()
                    except Exception as e:
                        self.kill()
                        if pool._closed:
                            break
                        log.error("a grammar compile worker failed to start: %s", e)
                        job = pool._take()
                        if job is not None:
                            pool._settle(job, error=CompileUnavailable(
                                f"the grammar compile worker could not start: {e}"))
                        time.sleep(START_RETRY_S)
                        continue
                job = pool._take()
                if job is None:
                    break
                try:
                    self._trial(job)
                except Exception as e:  # a bug here must not leave the job's requests waiting forever
                    log.exception("grammar compile slot failed")
                    self.kill()
                    pool._settle(job, error=CompileUnavailable(f"the grammar compile failed: {e}"))
        finally:
            self.kill()

    def _start(self) -> None:
        spec = self.pool.worker_spec()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
        proc = subprocess.Popen([sys.executable, "-m", "serving.grammar.compile_worker", str(os.getpid())],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        with self._lock:
            self.proc = proc
        self.pool._count("worker_starts")
        assert proc.stdin is not None
        write_frame(proc.stdin.fileno(), {**spec, "max_memory_mb": self.pool.max_memory_mb})
        reply = self._wait(time.monotonic() + START_TIMEOUT_S, None)
        if reply is _TIMEOUT:
            raise RuntimeError(f"not ready after {START_TIMEOUT_S:.0f} s")
        if reply != ["ready"]:
            raise RuntimeError(f"unexpected first message {reply!r}")
        self.idle_rss = memory_bytes(proc.pid)

    def _wait(self, deadline: float, job: CompileJob | None) -> Any:
        """The worker's next frame, or _TIMEOUT / _CANCELLED / _CLOSED / _MEMORY (a trial over
        the memory budget); EOFError if it died."""
        proc = self.proc
        if proc is None or proc.stdout is None:
            raise EOFError("the worker was stopped")
        fd = proc.stdout.fileno()
        poller = select.poll()  # not select.select: no limit on the descriptor's number
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        while True:
            if self.pool._closed:
                return _CLOSED
            if job is not None and job.cancel_requested:
                return _CANCELLED
            if job is not None and self._grew(proc.pid, self.pool.max_memory_mb):
                return _MEMORY
            left = deadline - time.monotonic()
            if left <= 0:
                return _TIMEOUT
            if poller.poll(max(1, int(1000 * min(left, POLL_S)))):
                return read_frame(fd)  # EOFError when the worker died

    def _trial(self, job: CompileJob) -> None:
        pool, (kind, text), proc = self.pool, job.key, self.proc
        try:
            if proc is None or proc.stdin is None:
                raise EOFError("the worker was stopped")
            write_frame(proc.stdin.fileno(), [job.id, kind, text])
            reply = self._wait(job.started + pool.timeout_s, job)
        except (OSError, EOFError, ValueError) as e:
            code = self.kill()
            if pool._closed:
                pool._settle(job, error=CompileUnavailable("the engine is shutting down"))
                return
            pool._count("crashed")
            log.warning("a %s of %d bytes crashed the grammar compile worker (%s, exit code %s)",
                        kind, len(text), type(e).__name__, code)
            pool._settle(job, error=GrammarError(
                f"the {kind} crashed the grammar compiler (exit code {code}; its memory limit is "
                f"{pool.max_memory_mb} MB, grammar_compile_max_memory_mb)"))
            return
        if isinstance(reply, list) and (reply[3:] == ["memory"] or self._grew(proc.pid, pool.max_memory_mb)):
            reply = _MEMORY  # its own hard limit stopped it, or it ended with its peak over the budget
        if reply is _TIMEOUT:
            self.kill()
            pool._count("timeouts")
            log.warning("a %s of %d bytes did not compile within %g s: its worker was killed",
                        kind, len(text), pool.timeout_s)
            pool._settle(job, error=GrammarTimeout(
                f"the {kind} did not compile within the time budget of {pool.timeout_s:g} s "
                f"(grammar_compile_timeout_s); simplify it"))
        elif reply is _MEMORY:
            self.kill()
            pool._count("over_memory")
            log.warning("a %s of %d bytes needed more than %d MB to compile: its worker was killed",
                        kind, len(text), pool.max_memory_mb)
            pool._settle(job, error=GrammarMemoryLimit(
                f"the {kind} needed more than the memory limit of {pool.max_memory_mb} MB to compile "
                f"(grammar_compile_max_memory_mb); simplify it"))
        elif reply is _CANCELLED:
            self.kill()  # nobody waits for it any more: stop burning a core on it
            log.info("the compile of a %s of %d bytes was cancelled after %.1f s (its requests left): "
                     "its worker was killed", kind, len(text), time.monotonic() - job.started)
            pool._settle(job, cancel=True)
        elif reply is _CLOSED:
            pool._settle(job, error=CompileUnavailable("the engine is shutting down"))
        else:
            _, ok, detail = reply[:3]
            if ok:
                pool._trial_passed(job, float(detail))
            else:
                pool._count("failed")
                pool._settle(job, error=GrammarError(str(detail)))
            if self.proc is not None and self._grew(self.proc.pid, pool.max_memory_mb // 2, "VmRSS"):
                self.kill()  # it kept much of what the trial took: the next trial starts on a fresh one

    def _grew(self, pid: int, limit_mb: int, field: str = "VmHWM") -> bool:
        """The worker's memory (``field``) is more than ``limit_mb`` over its idle size."""
        now = memory_bytes(pid, field)
        return now is not None and self.idle_rss is not None and now - self.idle_rss > limit_mb * 2**20

    def kill(self) -> int | None:
        """Kill the worker (if any); its exit code."""
        with self._lock:
            proc, self.proc = self.proc, None
        if proc is None:
            return None
        proc.kill()
        try:
            code = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = None
        for f in (proc.stdin, proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        return code
