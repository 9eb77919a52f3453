"""`make test`'s file-per-worker scheduling (``--dist loadfile``) without pytest-xdist 3.8's hang after
a worker crash.

When a worker dies (a segfault, an ``os._exit`` in native code, the OOM killer), xdist replaces it and
puts the dead worker's files back on the queue. Its ``LoadScopeScheduling`` (which ``loadfile`` is) then
deadlocks the whole run instead of finishing it with one failure (pytest-xdist issues #784, #1327, #1378;
CI hit it: a run that never ended instead of naming the test). The faults fixed here:

- ``remove_node`` re-queues every file the dead worker ever ran, finished ones included, and the test it
  died on: a finished file becomes an empty unit that is never marked complete, so no worker is ever
  rescheduled again. Here only files with tests still to run go back, without the one it died on
  (xdist has already reported that one as failed).
- a worker that has just died (its node-down event not handled yet) cannot be sent work: the unit stays
  assigned to it and goes back to the queue with its other units when that event comes.
- a replacement worker still collecting (two workers died close together, and the other
  replacement's collection triggers ``schedule()``) is passed over, not sent tests it cannot index yet
  (xdist raised ``KeyError`` and ended the run); it gets work when its own collection is in.
- a worker runs a test only once the next one has arrived (or it is told to shut down), but a
  replacement may be handed a single one-test file and then nothing: it waits forever. Here a worker
  below two pending tests gets units until it has two, or is told to shut down when none are left.

A test a worker died in runs once more, on another worker (:meth:`mark_test_pending`, asked by
``tests/conftest.py``'s ``pytest_handlecrashitem``): a native crash that does not come back (CI once lost a
run to one it never showed again) is reported as a rerun, with the crash's output above it; one that comes
back fails the run.

``tests/conftest.py`` installs it through xdist's ``pytest_xdist_make_scheduler`` hook;
``tests/layout/test_xdist_crash.py`` runs crashing suites through it.
"""

from __future__ import annotations

from xdist.scheduler.loadfile import LoadFileScheduling


class CrashSafeLoadFileScheduling(LoadFileScheduling):
    """``--dist loadfile``, finishing the run when a worker crashes (see the module docstring).

    Concurrency contract: xdist's controller calls every method from its one event loop thread.
    """

    def remove_node(self, node):  # noqa: ANN001, ANN201 (xdist's signature)
        workload = self.assigned_work.pop(node)
        if not self._pending_of(workload):
            return None
        crashitem = next(nid for unit in workload.values() for nid, done in unit.items() if not done)
        for unit in workload.values():
            if crashitem in unit:
                unit[crashitem] = True  # reported as failed already: never run again
        self.workqueue.update({scope: unit for scope, unit in workload.items() if not all(unit.values())})
        for other in self.assigned_work:
            self._reschedule(other)
        return crashitem

    def mark_test_pending(self, item: str) -> None:
        """Queue ``item`` (a test its worker died in) to run again, in its file's unit; the live
        workers are rescheduled (a replacement worker gets it once it has collected)."""
        self.workqueue.setdefault(self._split_scope(item), {})[item] = False
        for node in self.assigned_work:
            self._reschedule(node)

    def _reschedule(self, node) -> None:  # noqa: ANN001
        if node.shutting_down or node not in self.registered_collections:
            return  # a replacement still collecting: ``schedule()`` reaches it when its collection is in
        if not self.workqueue:
            node.shutdown()
            return
        if self._pending_of(self.assigned_work[node]) > 2:
            return
        try:
            self._assign_work_unit(node)
            while self.workqueue and self._pending_of(self.assigned_work[node]) < 2:
                self._assign_work_unit(node)
        except OSError:
            return  # the worker just died: its node-down event follows and puts its units back
        if not self.workqueue and self._pending_of(self.assigned_work[node]) < 2:
            node.shutdown()  # its last test runs only on shutdown (or once a next one would arrive)


_CRASHED: set[str] = set()  # tests a worker died in (xdist's controller process)


def rerun_once(crashitem: str, report, sched) -> None:  # noqa: ANN001
    """``pytest_handlecrashitem``: the first crash of ``crashitem`` queues it again and turns its
    report into a rerun (neither passed nor failed: the rerun's own report decides); a second one
    leaves the failure."""
    if crashitem in _CRASHED or not hasattr(sched, "mark_test_pending"):
        return
    _CRASHED.add(crashitem)
    sched.mark_test_pending(crashitem)
    report.outcome = "rerun"
    report.longrepr = f"{report.longrepr}; it runs once more"


def summarize_reruns(terminalreporter) -> None:  # noqa: ANN001
    """``pytest_terminal_summary``: name each test a worker died in, so a crash that did not come back
    still shows in the log (its native traceback, if any, is above: the worker's stderr)."""
    reruns = terminalreporter.stats.get("rerun", [])
    if reruns:
        terminalreporter.write_sep("=", f"{len(reruns)} test(s) crashed their worker and ran again")
        for rep in reruns:
            terminalreporter.write_line(str(rep.longrepr))


def make_scheduler(config, log):  # noqa: ANN001, ANN201
    """The hook's answer: ours for ``--dist loadfile``, xdist's own otherwise (None)."""
    if config.getvalue("dist") == "loadfile":
        return CrashSafeLoadFileScheduling(config, log)
    return None
