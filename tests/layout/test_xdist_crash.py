"""`make test`'s scheduling survives a worker crash (harness/xdist_sched.py): a suite in which one test
kills its worker process finishes and runs every other test once; the test that crashed runs once
more, on another worker, and fails the run only if it crashes again. With pytest-xdist's own
``loadfile`` scheduler these runs never end (CI once ran out of time on one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFTEST = ("import pytest\n\nfrom harness.xdist_sched import make_scheduler, rerun_once\n\n"
            "pytest_xdist_make_scheduler = pytest.hookimpl(optionalhook=True)(make_scheduler)\n"
            "pytest_handlecrashitem = pytest.hookimpl(optionalhook=True)(rerun_once)\n"
            "from harness.xdist_sched import summarize_reruns as pytest_terminal_summary  # noqa: E402\n")
PASS = "def test_{0}_a():\n    pass\n\n\ndef test_{0}_b():\n    pass\n"
CRASH = "import os\n\n\ndef test_crash():\n    os._exit(1)\n\n\ndef test_after_the_crash():\n    pass\n"
# crashes its worker the first time only (a file beside it remembers)
CRASH_ONCE = ("import os\nfrom pathlib import Path\n\n\ndef test_crash():\n"
              "    mark = Path(__file__).with_suffix('.crashed')\n    if not mark.exists():\n"
              "        mark.touch()\n        os._exit(1)\n\n\ndef test_after_the_crash():\n    pass\n")


def run_suite(tmp_path: Path, workers: int, crash: str) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_1_crash.py").write_text(crash)
    (tmp_path / "test_2_one.py").write_text("def test_one():\n    pass\n")
    for i in range(3, 6):
        (tmp_path / f"test_{i}_two.py").write_text(PASS.format(i))
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", str(workers), "--dist", "loadfile",
           "--no-loadscope-reorder", "-p", "no:cacheprovider", "-p", "no:langsmith_plugin", str(tmp_path)]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("workers", [1, 2])
def test_a_test_that_crashes_twice_fails_and_the_run_ends(tmp_path: Path, workers: int) -> None:
    out = run_suite(tmp_path, workers, CRASH)
    assert out.returncode == 1 and "1 failed, 8 passed, 1 rerun" in out.stdout, out.stdout + out.stderr
    assert "crashed while running" in out.stdout and "test_crash" in out.stdout, out.stdout


@pytest.mark.parametrize("workers", [1, 2])
def test_a_test_that_crashes_once_runs_again_and_passes(tmp_path: Path, workers: int) -> None:
    out = run_suite(tmp_path, workers, CRASH_ONCE)
    assert out.returncode == 0 and "9 passed, 1 rerun" in out.stdout, out.stdout + out.stderr
    assert "1 test(s) crashed their worker and ran again" in out.stdout, out.stdout
    assert "crashed while running 'test_1_crash.py::test_crash'; it runs once more" in out.stdout, out.stdout


class _Node:
    """The part of xdist's ``WorkerController`` the scheduler touches."""

    def __init__(self, name: str) -> None:
        self.name, self.shutting_down, self.sent = name, False, []
        self.gateway = type("Gateway", (), {"id": name})()

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent.extend(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


class _Config:
    class option:  # noqa: N801 (xdist reads config.option.loadscopereorder)
        loadscopereorder = False

    def getvalue(self, name: str):  # noqa: ANN201
        return {"tx": ["2*popen"], "dist": "loadfile"}[name]


def test_a_replacement_that_has_not_collected_yet_gets_no_work() -> None:
    """Both workers die close together (CI's run): a replacement is added but its collection is not in
    when the other replacement's collection triggers ``schedule()``; it is skipped, not sent work it
    cannot index (xdist's ``KeyError`` ended the run), and gets its share once it has collected."""
    from harness.xdist_sched import CrashSafeLoadFileScheduling

    tests = [f"test_{f}.py::test_{t}" for f in range(4) for t in range(2)]
    sched = CrashSafeLoadFileScheduling(_Config())
    gw0, gw1, gw2, gw3 = (_Node(f"gw{i}") for i in range(4))
    for node in (gw0, gw1):
        sched.add_node(node)
        sched.add_node_collection(node, tests)
    sched.schedule()
    assert sched.remove_node(gw0) is not None and sched.remove_node(gw1) is not None
    sched.add_node(gw2)
    sched.add_node(gw3)
    sched.add_node_collection(gw2, tests)
    sched.schedule()  # gw3 has not collected: must be passed over
    assert gw2.sent and not gw3.sent and not gw3.shutting_down
    sched.add_node_collection(gw3, tests)
    sched.schedule()
    assert gw3.sent or not sched.workqueue
