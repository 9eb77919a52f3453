"""`make test`'s scheduling survives a worker crash (harness/xdist_sched.py): a suite in which one test
kills its worker process finishes, reports that test as failed and runs every other test once. With
pytest-xdist's own ``loadfile`` scheduler these runs never end (CI once ran out of time on one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFTEST = ("import pytest\n\nfrom harness.xdist_sched import make_scheduler\n\n"
            "pytest_xdist_make_scheduler = pytest.hookimpl(optionalhook=True)(make_scheduler)\n")
PASS = "def test_{0}_a():\n    pass\n\n\ndef test_{0}_b():\n    pass\n"
CRASH = "import os\n\n\ndef test_crash():\n    os._exit(1)\n\n\ndef test_after_the_crash():\n    pass\n"


@pytest.mark.parametrize("workers", [1, 2])
def test_a_crashed_worker_fails_one_test_and_the_run_ends(tmp_path: Path, workers: int) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_1_crash.py").write_text(CRASH)
    (tmp_path / "test_2_one.py").write_text("def test_one():\n    pass\n")
    for i in range(3, 6):
        (tmp_path / f"test_{i}_two.py").write_text(PASS.format(i))
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", str(workers), "--dist", "loadfile",
           "--no-loadscope-reorder", "-p", "no:cacheprovider", "-p", "no:langsmith_plugin", str(tmp_path)]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert "1 failed, 8 passed" in out.stdout, out.stdout + out.stderr
    assert "crashed while running" in out.stdout and "test_crash" in out.stdout, out.stdout
