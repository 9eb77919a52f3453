"""`make test`'s file-per-worker scheduling (``--dist loadfile``) without pytest-xdist 3.8's hang after
a worker crash.

When a worker dies (a segfault, an ``os._exit`` in native code, the OOM killer), xdist replaces it and
puts the dead worker's files back on the queue. Its ``LoadScopeScheduling`` (which ``loadfile`` is) then
deadlocks the whole run instead of finishing it with one failure (pytest-xdist issues #784, #1327, #1378;
CI hit it: a run that never ended instead of naming the test). Two faults, both fixed here:

- ``remove_node`` re-queues every file the dead worker ever ran, finished ones included, and the test it
  died on: a finished file becomes an empty unit that is never marked complete, so no worker is ever
  rescheduled again. Here only files with tests still to run go back, without the one it died on
  (xdist has already reported that one as failed).
- a worker runs a test only once the next one has arrived (or it is told to shut down), but a
  replacement may be handed a single one-test file and then nothing: it waits forever. Here a worker
  below two pending tests gets units until it has two, or is told to shut down when none are left.

``tests/conftest.py`` installs it through xdist's ``pytest_xdist_make_scheduler`` hook;
``tests/layout/test_xdist_crash.py`` runs a crashing suite through it.
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

    def _reschedule(self, node) -> None:  # noqa: ANN001
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        if self._pending_of(self.assigned_work[node]) > 2:
            return
        self._assign_work_unit(node)
        while self.workqueue and self._pending_of(self.assigned_work[node]) < 2:
            self._assign_work_unit(node)
        if not self.workqueue and self._pending_of(self.assigned_work[node]) < 2:
            node.shutdown()  # its last test runs only on shutdown (or once a next one would arrive)


def make_scheduler(config, log):  # noqa: ANN001, ANN201
    """The hook's answer: ours for ``--dist loadfile``, xdist's own otherwise (None)."""
    if config.getvalue("dist") == "loadfile":
        return CrashSafeLoadFileScheduling(config, log)
    return None
